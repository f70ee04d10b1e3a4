#!/usr/bin/env bash
# kvferry.vllm against real vLLM (the CPU build): installs vLLM into a venv (scripts/vllm-env.sh),
# installs kvferry's Python package into it, and runs python/tests/vllm: a producer and two
# consumer engines side by side, then a TP = 2 producer. Run by scripts/test-all.sh
# (KVFERRY_SKIP_VLLM=1 skips it); times in docs/vllm-connector-notes.md §7.
#
# Usage: bash scripts/vllm-tests.sh [pytest args...]   (KVFERRY_VLLM_VENV overrides .dev/vllm-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVFERRY_VLLM_VENV:-.dev/vllm-venv}"
log() { printf '==> %s\n' "$*" >&2; }

bash scripts/vllm-env.sh "$VENV" >/dev/null
log "installing kvferry (python/) into $VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check ./python
log "kvferry.vllm tests with real vLLM"
# -p no:cacheprovider: nothing written into the tree; vLLM logs land in the failure messages.
"$VENV/bin/python" -m pytest -p no:cacheprovider -v python/tests/vllm "$@"
