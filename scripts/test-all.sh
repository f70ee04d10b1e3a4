#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what it needs, builds,
# runs the unit/integration tests, the demo's end-to-end checks, and the
# soft-RoCE suite in a QEMU guest. Fails on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each step's wall time, printed as a table when the script ends (green or red): the README's
# step times come from it.
T0=$SECONDS
step_name=""
step_t=$SECONDS
steps=()
log() {
  local now=$SECONDS
  [ -z "$step_name" ] || steps+=("$(printf '%6ds  %s' $((now - step_t)) "$step_name")")
  step_name="$*"
  step_t=$now
  printf '\n==> [%dm%02ds] %s\n' $(((now - T0) / 60)) $(((now - T0) % 60)) "$*" >&2
}
bg_pids=()
finish() {
  local rc=$?
  for p in "${bg_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -z "$step_name" ] || steps+=("$(printf '%6ds  %s' $((SECONDS - step_t)) "$step_name")")
  printf '\nstep times (wall seconds; exit status %d after %dm%02ds):\n' "$rc" \
    $(((SECONDS - T0) / 60)) $(((SECONDS - T0) % 60)) >&2
  printf '%s\n' "${steps[@]}" >&2
}
trap finish EXIT

need_pkgs=()
# libclang: only for the lints below (--all-features includes the bindgen path of the verbs
# bindings); the builds and tests need neither it nor cmake.
[ -e /usr/lib/llvm-14/lib/libclang.so ] || ls /usr/lib/llvm-*/lib/libclang*.so >/dev/null 2>&1 || need_pkgs+=(libclang-dev)
command -v pkg-config >/dev/null || need_pkgs+=(pkg-config)
# The Python venvs (ours and vLLM's, the latter created in the background below).
python3 -c 'import ensurepip, venv' 2>/dev/null || need_pkgs+=(python3-venv)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  log "installing build dependencies: ${need_pkgs[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi

# vLLM's CPU build (a 6 GB venv, about 3 min, nearly all of it download) installs in the
# background while the Rust steps use the CPU; the vLLM step below waits for it.
VLLM_VENV="${KVFERRY_VLLM_VENV:-.dev/vllm-venv}"
if [ "${KVFERRY_SKIP_VLLM:-0}" != "1" ]; then
  mkdir -p .dev
  printf '\n==> vLLM CPU build installing into %s in the background (log: .dev/vllm-env.log)\n' "$VLLM_VENV" >&2
  bash scripts/vllm-env.sh "$VLLM_VENV" >.dev/vllm-env.log 2>&1 &
  vllm_env_pid=$!
  bg_pids+=("$vllm_env_pid")
fi

log "citations stay inside the repository"
# Docs and comments cite docs/design.md, tests/softroce/README.md, ...: never a file outside the
# repo (the old blueprint, shared notes, one machine's paths). scripts/repoint-design-citations.sh
# rewrites the known ones. Patterns are spelled with [...] so that this file does not match.
outside='DESIGN[.]md|notes/(anchors|softroce)[.]md|[.][.]/shared/|/wor[k]/'
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  cites=(git grep --untracked -nIE "$outside" -- . ':!scripts/repoint-design-citations.sh')
else
  cites=(grep -rnIE --exclude-dir=target --exclude-dir=.git --exclude-dir=.dev \
         --exclude=repoint-design-citations.sh "$outside" .)
fi
if "${cites[@]}"; then
  echo "the lines above cite files outside the repository (bash scripts/repoint-design-citations.sh)" >&2
  exit 1
fi

log "structure: no import cycle between modules, no oversized source file (about a second)"
# Each crate's module graph and the Python package's imports; files over 600 lines under
# transfer/src or 700 elsewhere (tests aside). The self-test first: the check judges small
# trees with known answers.
python3 scripts/check-structure.py --self-test
python3 scripts/check-structure.py

# The RDMA transport is a cargo feature (pregenerated verbs bindings: no cmake or libclang
# needed on x86_64); the suite builds and tests with it.
FEATURES=(--features kvferry/rdma)

log "format and lints: cargo fmt --check, cargo clippy -D warnings"
if command -v rustup >/dev/null; then
  for c in rustfmt clippy; do rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c"; done
fi
cargo fmt --all --check
# --release shares the build below; the lints are the workspace's ([workspace.lints]).
cargo clippy --release --workspace --all-targets --all-features -- -D warnings

log "build (release, with RDMA)"
cargo build --release --workspace --all-targets "${FEATURES[@]}"

log "unit and integration tests"
cargo test --release --workspace "${FEATURES[@]}"

# The fuzz targets' sanitizer build (a build of its own, about 3 min of both cores) runs in the
# background from here, at the lowest priority, on the cores the Python and vLLM steps leave
# idle (they wait on sockets and subprocesses much of the time); the fuzz step waits for it.
FUZZ_SECONDS="${KVFERRY_FUZZ_SECONDS:-60}"
if [ "$FUZZ_SECONDS" != "0" ]; then
  fuzz_target_dir="$(pwd)/${CARGO_TARGET_DIR:-target}/fuzz"
  case "${CARGO_TARGET_DIR:-}" in /*) fuzz_target_dir="$CARGO_TARGET_DIR/fuzz" ;; esac
  mkdir -p .dev
  fuzz() { (cd fuzz && RUSTC_BOOTSTRAP=1 CARGO_TARGET_DIR="$fuzz_target_dir" cargo fuzz "$@"); }
  printf '\n==> fuzz targets building in the background (log: .dev/fuzz-build.log)\n' >&2
  (
    renice -n 19 -p "$BASHPID" >/dev/null 2>&1 || true
    command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
    fuzz build -O
  ) </dev/null >.dev/fuzz-build.log 2>&1 &
  fuzz_build_pid=$!
  bg_pids+=("$fuzz_build_pid")
fi

log "Python package: pip install ./python, pytest python/tests (conformance with Mooncake's wheel)"
bash scripts/python-tests.sh

# The README's and docs/' code blocks marked `runnable`, as a reader runs them (the quick demo,
# serve/load, the Python quickstarts), with the binary built above and the Python tests' venv:
# about 5 s.
log "code blocks of README.md and docs/ (scripts/doc-blocks.py)"
python3 scripts/doc-blocks.py --python "${KVFERRY_PY_VENV:-.dev/py-tests}/bin/python"

# kvferry.vllm with real vLLM: a producer and two consumer engines on CPU move and
# verify KV through the connector; a flipped landed bit is caught under fail and recompute.
# Installs vLLM's CPU build into .dev/vllm-venv (~6 GB) first; docs/vllm-connector-notes.md
# gives the measured times.
if [ "${KVFERRY_SKIP_VLLM:-0}" = "1" ]; then
  log "vLLM connector tests skipped (KVFERRY_SKIP_VLLM=1)"
else
  log "vLLM connector end to end: scripts/vllm-tests.sh (waits for the venv install started above)"
  if ! wait "$vllm_env_pid"; then
    tail -n 40 .dev/vllm-env.log >&2
    echo "installing vLLM's CPU build into $VLLM_VENV failed (the log's end above)" >&2
    exit 1
  fi
  KVFERRY_VLLM_VENV="$VLLM_VENV" bash scripts/vllm-tests.sh
fi

# Fuzzing: every decoder of peer input for a bounded time. cargo-fuzz needs nightly
# flags; RUSTC_BOOTSTRAP=1 lets the stable toolchain take them. A crash fails the suite; its
# input lands in fuzz/artifacts/<target>/ and becomes a regression test.
if [ "$FUZZ_SECONDS" = "0" ]; then
  log "fuzzing skipped (KVFERRY_FUZZ_SECONDS=0)"
else
  log "fuzz targets: wait for their build (started in the background after the Rust tests)"
  if ! wait "$fuzz_build_pid"; then
    tail -n 60 .dev/fuzz-build.log >&2
    echo "building the fuzz targets failed (the log's end above: .dev/fuzz-build.log)" >&2
    exit 1
  fi
  # libFuzzer runs one process per target: two targets at a time fill both cores of a 2-core
  # machine and halve the step's time, each target still getting its full seconds.
  targets=(payload p2p_messages control_port transfer_frames)
  for ((i = 0; i < ${#targets[@]}; i += 2)); do
    pair=("${targets[@]:i:2}")
    log "fuzz ${pair[*]} for ${FUZZ_SECONDS} s each, side by side"
    pids=()
    for t in "${pair[@]}"; do
      fuzz run -O "$t" -- -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 >".dev/fuzz-$t.log" 2>&1 &
      pids+=($!)
      bg_pids+=($!)
    done
    for j in "${!pair[@]}"; do
      if ! wait "${pids[j]}"; then
        tail -n 60 ".dev/fuzz-${pair[j]}.log" >&2
        echo "fuzz target ${pair[j]} failed (the log's end above; its input is under fuzz/artifacts/${pair[j]}/)" >&2
        exit 1
      fi
      grep -E '^Done [0-9]+ runs' ".dev/fuzz-${pair[j]}.log" | sed "s/^/${pair[j]}: /" >&2 || true
    done
  done
fi

log "demo end-to-end checks"
bash scripts/demo-checks.sh "${CARGO_TARGET_DIR:-target}/release/kvferry"

if [ "${KVFERRY_SKIP_SOFTROCE:-0}" = "1" ]; then
  log "soft-RoCE suite skipped (KVFERRY_SKIP_SOFTROCE=1)"
else
  log "soft-RoCE suite (QEMU guest)"
  bash tests/softroce/suite.sh target/softroce-out
fi
log "all green"
