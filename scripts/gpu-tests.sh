#!/usr/bin/env bash
# GPU tests and benchmark of the CUDA checksum backend (docs/design.md §5, §7).
#
#   scripts/gpu-tests.sh build   # on a machine with Rust: release test binaries + bench + the Python
#                                # wheel (maturin, from PyPI into .dev/maturin-venv) -> .dev/gpu/
#   scripts/gpu-tests.sh run     # on the GPU machine (no Rust needed): runs .dev/gpu/*, and the Python
#                                # GPU tests with the wheel installed --no-deps; logs to $OUT or .dev/gpu/out
#   scripts/gpu-tests.sh         # both, on a machine with Rust and a GPU
#
# The tests print "SKIPPED: <reason>" and pass where no CUDA device exists. NVRTC is found
# through LD_LIBRARY_PATH, /usr/local/cuda, or a Python wheel (nvidia-cuda-nvrtc).
set -euo pipefail
# A relative CARGO_TARGET_DIR is the caller's: made absolute before moving to the repo root
# (cargo also prints relative executable paths for a relative target directory).
if [ -n "${CARGO_TARGET_DIR:-}" ]; then export CARGO_TARGET_DIR=$(realpath -m "$CARGO_TARGET_DIR"); fi
cd "$(dirname "$0")/.."
DIR=.dev/gpu
mode=${1:-all}

build() {
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
    mkdir -p "$DIR"
    rm -f "$DIR"/test-* "$DIR"/gpu_bench
    { cargo test --no-run --release -p kvferry-kernels 2>&1
      cargo test --no-run --release -p kvferry-transfer --test gpu_memory --test hardening --test transfer_tcp --test cuda_ipc_gpu 2>&1
    } | tee "$DIR/build.log" >&2
    grep 'Executable' "$DIR/build.log" | grep -o '([^)]*)$' | tr -d '()' | while read -r path; do
        [ -f "$path" ] || { echo "gpu-tests: built executable $path not found" >&2; exit 1; }
        base=$(basename "$path"); base=${base%-*}
        cp "$path" "$DIR/test-$base"
    done
    cargo build --release -p kvferry-kernels --example gpu_bench >&2
    cp "$CARGO_TARGET_DIR/release/examples/gpu_bench" "$DIR/"
    cargo build --release -p kvferry-transfer --example cuda_ipc_bench >&2
    cp "$CARGO_TARGET_DIR/release/examples/cuda_ipc_bench" "$DIR/"
    if command -v strip >/dev/null; then strip "$DIR"/test-* "$DIR"/gpu_bench "$DIR"/cuda_ipc_bench; fi
    build_wheel
    ls -la "$DIR" "$DIR/wheel" >&2
}

# The kvferry Python package (python/) as an abi3 wheel: the GPU machine has Python and
# torch but no Rust toolchain, so the wheel is built here and installed there with --no-deps.
build_wheel() {
    local venv=.dev/maturin-venv
    [ -x "$venv/bin/maturin" ] || { python3 -m venv "$venv" && "$venv/bin/pip" install -q 'maturin>=1.5,<2'; } >&2
    rm -rf "$DIR/wheel"
    "$venv/bin/maturin" build --release --strip --compatibility linux -m python/Cargo.toml -o "$DIR/wheel" >&2
}

find_nvrtc() {
    local d
    for d in ${KVFERRY_NVRTC_DIR:-} /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then echo "$d"; return; fi
    done
    d=$(find /usr /opt -name 'libnvrtc.so.1[0-9]*' 2>/dev/null | grep -v alt | head -1)
    [ -n "$d" ] && dirname "$d"
}

run() {
    local out=${OUT:-$DIR/out}
    mkdir -p "$out"
    local nv
    nv=$(find_nvrtc || true)
    if [ -n "$nv" ]; then
        export KVFERRY_NVRTC_DIR=$nv
        export LD_LIBRARY_PATH=$nv${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
    if ! ldconfig -p 2>/dev/null | grep -q 'libcuda.so.1'; then
        local cu
        cu=$(find /usr/local/nvidia /usr/lib /usr/lib64 -name 'libcuda.so.1' 2>/dev/null | head -1 || true)
        [ -n "$cu" ] && export LD_LIBRARY_PATH=$(dirname "$cu")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
    # On a machine with a GPU, a test that would skip fails instead.
    if nvidia-smi -L >/dev/null 2>&1; then export KVFERRY_REQUIRE_GPU=1; fi
    {
        echo "== device"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 || true
        echo "nvrtc dir: ${nv:-none}; LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
        # Resource report of the kernels (registers, spills) where nvcc exists.
        if command -v nvcc >/dev/null; then
            nvcc -arch=sm_90 -Xptxas -v -cubin -o /tmp/kvf_checksum.cubin kernels/cuda/checksum.cu 2>&1 | grep -E "registers|spill|error" || true
            command -v cuobjdump >/dev/null && echo "128-bit loads in SASS: $(cuobjdump -sass /tmp/kvf_checksum.cubin | grep -c 'LDG.E.*128' || true)"
        fi
    } 2>&1 | tee "$out/device.txt"
    local rc=0 t
    for t in "$DIR"/test-*; do
        echo "== $t"
        # --nocapture shows the SKIPPED and coverage lines of passing tests.
        "$t" --test-threads 4 --nocapture 2>&1 | tee "$out/$(basename "$t").log" | grep -vE "^test .* ok$" || rc=1
        grep -E "^test result" "$out/$(basename "$t").log" || true
    done
    if ls "$DIR"/wheel/kvferry-*.whl >/dev/null 2>&1; then
        echo "== python: kvferry wheel, python/tests/test_gpu.py (+ the CPU checksum and p2p tests)"
        local site=/tmp/kvferry-site
        rm -rf "$site"
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$DIR"/wheel/kvferry-*.whl || rc=1
        PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} python3 -m pytest -q -p no:cacheprovider -rs \
            python/tests/test_gpu.py python/tests/test_checksum.py python/tests/test_p2p.py 2>&1 \
            | tee "$out/python.log" | tail -25 || rc=1
    fi
    echo "== gpu_bench"
    "$DIR/gpu_bench" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.txt" || rc=1
    echo "== cuda_ipc_bench"
    "$DIR/cuda_ipc_bench" 2>&1 | tee "$out/cuda_ipc_bench.txt" || rc=1
    echo "== done rc=$rc"
    return $rc
}

case "$mode" in
    build) build ;;
    run) run ;;
    all) build && run ;;
    *) echo "usage: $0 [build|run]" >&2; exit 2 ;;
esac
