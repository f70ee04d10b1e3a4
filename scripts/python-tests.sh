#!/usr/bin/env bash
# The Python package's tests: a fresh venv under .dev/, `pip install ./python`
# (maturin builds the extension; it reuses $CARGO_TARGET_DIR), pytest and numpy, then
# `pytest python/tests`. The conformance test installs Mooncake's non-CUDA wheel from PyPI into
# a throwaway venv of its own; that wheel needs libibverbs.so.1 to import, installed here.
# Measured on the 2-core dev machine under load: about 5 min after test-all's workspace build
# (the extension reuses its artifacts), 16 min from an empty target dir; pytest alone 1.5 min.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
need=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || need+=(libibverbs1)
python3 -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  echo "python-tests: installing ${need[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
VENV=${KVFERRY_PY_VENV:-.dev/py-tests}
python3 -m venv --clear "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check pytest numpy
"$VENV/bin/pip" install -q --disable-pip-version-check ./python
# python/tests/vllm needs vLLM (scripts/vllm-tests.sh runs it in its own venv). Its skip guard
# (find_spec("vllm")) is fooled here: with python/tests on sys.path its folder is a namespace
# package named vllm.
"$VENV/bin/python" -m pytest -q python/tests --ignore=python/tests/vllm "$@"
