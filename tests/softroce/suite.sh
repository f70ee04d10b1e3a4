#!/usr/bin/env bash
# The soft-RoCE suite (docs/design.md §7): kvferry's RDMA tests, the demo and the RDMA benchmark
# beside ib_write_bw (and Mooncake's Transfer Engine), all in one boot of the QEMU guest
# (tests/softroce/run.sh).
#
# On the host:   tests/softroce/suite.sh [--bench-only] [OUTDIR]
#   builds the test executables (release) and the `kvferry` binary, finds or installs
#   Mooncake's engine for the bench, then boots the guest running this same script, with the
#   repo, the target directory and the binary's directory shared into it (so a clone under
#   /tmp works). --bench-only: builds only `kvferry` and runs only the bench, in its full mode
#   unless SOFTROCE_BENCH says otherwise. Env: CARGO_TARGET_DIR (default <repo>/target),
#   KVFERRY_BIN (default $CARGO_TARGET_DIR/release/kvferry), SOFTROCE_SKIP_CLI=1 (tests only),
#   SOFTROCE_TIMEOUT (default 1800 s for the whole guest run, 2500 s in the full bench mode), SOFTROCE_MOONCAKE=0 (bench
#   without Mooncake), MOONCAKE_VENV (where bench/mooncake_compare.py installs it).
#   SOFTROCE_BENCH: `quick` (the default, what the test command runs: one round, at least 6
#   batches and 2 s per point, kvferry with 1 and 4 QPs at 64K and 1M too, 420 s of rounds at
#   most), `full` (3 rounds, at least 6 batches and 4 s per point, the same QP sweep, 2000 s
#   of rounds at most) or `off`. Each of the mode's settings can be overridden:
#   SOFTROCE_BENCH_ROUNDS, SOFTROCE_BENCH_SECONDS, SOFTROCE_BENCH_MIN_BATCHES,
#   SOFTROCE_BENCH_BUDGET, SOFTROCE_BENCH_TIMEOUT (the step's), SOFTROCE_BENCH_SIZES
#   (64K,256K,1M,4M), SOFTROCE_BENCH_BATCH_BYTES (32M: a batch's bytes at most, and what
#   ib_write_bw moves per run at least), SOFTROCE_BENCH_QPS_SWEEP (empty: none),
#   SOFTROCE_BENCH_QPS_SWEEP_SIZES, SOFTROCE_BENCH_INFLIGHT (2: kvferry and Mooncake run the
#   batch as that many parts in flight, each on a thread of its own),
#   SOFTROCE_BENCH_INFLIGHT_SWEEP (1: kvferry with the whole batch drained as well; empty: none).
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [ -z "${SOFTROCE_GUEST:-}" ]; then
    set -e
    export SOFTROCE_BENCH_ONLY=""
    if [ "${1:-}" = --bench-only ]; then
        SOFTROCE_BENCH_ONLY=1
        export SOFTROCE_BENCH=${SOFTROCE_BENCH:-full}
        unset SOFTROCE_SKIP_CLI
        shift
    fi
    ROOT=$(cd "$HERE/../.." && pwd)
    # Relative paths are the caller's: resolve them before moving to the repo root. cargo
    # prints executable paths under CARGO_TARGET_DIR as given, and the guest needs them whole.
    export CARGO_TARGET_DIR=$(realpath -m "${CARGO_TARGET_DIR:-$ROOT/target}")
    OUT=$(realpath -m "${1:-$(mktemp -d /tmp/softroce-suite.XXXXXX)}")
    export KVFERRY_BIN=$(realpath -m "${KVFERRY_BIN:-$CARGO_TARGET_DIR/release/kvferry}")
    cd "$ROOT"
    mkdir -p "$OUT" "$CARGO_TARGET_DIR"
    if [ -n "$SOFTROCE_BENCH_ONLY" ]; then
        : >"$OUT/manifest"
    else
        # The same package selection and features as the test command's build (--workspace,
        # kvferry/rdma): with `-p kvferry-transfer` cargo unifies features differently and
        # rebuilds the dependencies (about 3 minutes on 2 cores); this way the build above is reused.
        echo "[suite] building RDMA test executables (release)" >&2
        cargo test --release --workspace --features kvferry/rdma --no-run --message-format=json 2>"$OUT/build.log" \
            | grep -o '"executable":"[^"]*"' | sed 's/"executable":"\(.*\)"/\1/' >"$OUT/executables" \
            || { cat "$OUT/build.log" >&2; exit 1; }
        {
            # the transport's own tests (lib unit tests, filtered) and every tests/rdma_*.rs
            grep '/kvferry_transfer-[0-9a-f]*$' "$OUT/executables" | sed 's/$/ transport::rdma::/'
            grep '/rdma_[a-z_]*-[0-9a-f]*$' "$OUT/executables"
        } >"$OUT/manifest"
        [ "$(wc -l <"$OUT/manifest")" -ge 2 ] || { echo "[suite] test executables not found" >&2; cat "$OUT/executables" >&2; exit 1; }
    fi
    shares=(-s "$CARGO_TARGET_DIR")
    if [ -z "${SOFTROCE_SKIP_CLI:-}" ]; then
        echo "[suite] building kvferry (release)" >&2
        cargo build --release --workspace --features kvferry/rdma --bin kvferry 2>>"$OUT/build.log" || { tail -30 "$OUT/build.log" >&2; exit 1; }
        shares+=(-s "$(dirname "$KVFERRY_BIN")")
        # Mooncake's engine beside kvferry in the bench: installed on the host (the guest has
        # no network) and run from the guest, which sees the host's files.
        export SOFTROCE_MOONCAKE_PY="" SOFTROCE_MOONCAKE_SKIP="SOFTROCE_MOONCAKE=0"
        if [ "${SOFTROCE_MOONCAKE:-1}" != 0 ]; then
            if py=$(python3 bench/mooncake_compare.py --print-python 2>>"$OUT/build.log"); then
                SOFTROCE_MOONCAKE_PY=$py
                venv=$(dirname "$(dirname "$py")")
                case "$venv" in /tmp/*|/var/tmp/*|/run/*) shares+=(-s "$venv") ;; esac
            else
                SOFTROCE_MOONCAKE_SKIP="cannot install mooncake-transfer-engine-non-cuda (see build.log)"
                echo "[suite] bench without Mooncake: $SOFTROCE_MOONCAKE_SKIP" >&2
            fi
        fi
    fi
    exec "$HERE/run.sh" -t "${SOFTROCE_TIMEOUT:-$([ "${SOFTROCE_BENCH:-}" = full ] && echo 2500 || echo 1800)}" -o "$OUT" "${shares[@]}" "$HERE/suite.sh"
fi

# ---------------------------------------------------------------- inside the guest
OUT=$SOFTROCE_OUT
export KVFERRY_REQUIRE_RDMA=1 RUST_BACKTRACE=1
export KVFERRY_LOG=${KVFERRY_LOG:-warn}
DEV=${SOFTROCE_DEVICE:-rxe0}
declare -a RESULTS=()
failed=0

STEP_TIMEOUT=${SOFTROCE_STEP_TIMEOUT:-600}
step() { # step NAME CMD...: runs CMD (bounded), output to NAME.log and the console, records the outcome
    local name=$1; shift
    local t0=$(date +%s)
    echo "=== [$name] $*"
    timeout --kill-after=10 "$STEP_TIMEOUT" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    [ $rc = 124 ] && echo "step $name: timed out after ${STEP_TIMEOUT}s" >>"$OUT/$name.log"
    cat "$OUT/$name.log"
    local dt=$(( $(date +%s) - t0 ))
    if [ $rc = 0 ]; then RESULTS+=("PASS $name (${dt}s)"); else RESULTS+=("FAIL $name (exit $rc, ${dt}s)"); failed=1; fi
    return $rc
}

step devinfo ibv_devinfo -d "$DEV"

# 1. kvferry's RDMA tests (none in --bench-only: the manifest is empty)
i=0
while read -r exe filter; do
    [ -n "$exe" ] || continue
    i=$((i + 1))
    step "test-$i-$(basename "$exe" | sed 's/-[0-9a-f]*$//')" "$exe" --test-threads=1 $filter
done <"$OUT/manifest"

BIN=${KVFERRY_BIN:-}
if [ -z "$BIN" ] || [ ! -x "$BIN" ]; then
    RESULTS+=("SKIP demo and bench: no kvferry binary at '${BIN}'")
else
    if [ -z "${SOFTROCE_BENCH_ONLY:-}" ]; then
        # 2. doctor: on this node `auto` must pick RDMA for host memory over the rxe device, and
        # the JSON names that device with a GID (seconds; the output is kept as doctor.json)
        step doctor bash -c '
            "$0" doctor --json >"$1/doctor.json"; rc=$?
            cat "$1/doctor.json"; "$0" doctor || true
            [ $rc -le 1 ] || exit 1
            python3 -c "import json,sys; r=json.load(open(sys.argv[1])); h=r[\"host_path\"]; ok=h[\"transport\"]==\"rdma\" and sys.argv[2] in json.dumps(r[\"rdma\"]); print(\"check:\", \"ok\" if ok else \"FAILED: host memory not over RDMA on \"+sys.argv[2]); sys.exit(0 if ok else 1)" "$1/doctor.json" "$2"
        ' "$BIN" "$OUT" "$DEV"

        # 3. the demo over RDMA: every load verified; the corruption modes give their exact counts
        demo() { # demo NAME PY-EXPR ARGS...
            local name=$1 expr=$2; shift 2
            step "$name" bash -c '
                out=$("$0" demo --json --transport rdma --requests 8 --min-tokens 16 --max-tokens 200 "${@:2}") || exit 1
                echo "$out"
                python3 -c "import json,sys; r=json.loads(sys.argv[1]); ok=(r[\"transport\"]==\"rdma\" and ($1)); print(\"check:\", \"ok\" if ok else \"FAILED: \"+sys.argv[2]); sys.exit(0 if ok else 1)" "$out" "$1"
            ' "$BIN" "$expr" "$@"
        }
        demo demo-verified "r['verified']==8 and r['mismatch']==r['unverified']==r['failed']==0"
        demo demo-corrupt "r['mismatch']==2 and r['verified']==6" --corrupt 2
        demo demo-fail-closed "r['failed']==2" --corrupt 2 --fail-closed --load-failure-policy fail
        demo demo-recompute "r['recomputed']==2" --corrupt 2 --fail-closed --load-failure-policy recompute
        # different TP sizes on the two sides: KV heads mapped between ranks over RDMA
        demo demo-tp2-to-tp1 "r['mismatch']==2 and r['verified']==6" --model tiny --prefill-tp 2 --decode-tp 1 --corrupt 2
    fi

    # 4. benchmark: kvferry beside ib_write_bw and Mooncake on the same device, same boot;
    # rounds with the engines' order rotated, medians and spread (tests/softroce/bench.py).
    # kvferry with 2 QPs per endpoint (its default) beside ib_write_bw -q 2 and Mooncake (2 QPs
    # too), side by side with ib_write_bw per size. `quick` (the test command) is one round,
    # `full` 3; both run kvferry alone with 1 and 4 QPs at 64 KiB and 1 MiB too (a sweep at
    # every size: SOFTROCE_BENCH_QPS_SWEEP_SIZES=64K,256K,1M,4M).
    case "${SOFTROCE_BENCH:-quick}" in
        quick) b_rounds=1 b_seconds=2 b_min=6 b_budget=420 b_timeout=900 b_sweep=1,4 b_isweep=1 ;;
        full) b_rounds=3 b_seconds=4 b_min=6 b_budget=2000 b_timeout=2300 b_sweep=1,4 b_isweep=1 ;;
        off|0) b_rounds=0 ;;
        *) echo "SOFTROCE_BENCH=${SOFTROCE_BENCH}: not quick, full or off" >&2; b_rounds=-1 ;;
    esac
    if [ "$b_rounds" = -1 ]; then
        RESULTS+=("FAIL bench (SOFTROCE_BENCH=${SOFTROCE_BENCH}: not quick, full or off)"); failed=1
    elif [ "$b_rounds" = 0 ]; then
        RESULTS+=("SKIP bench (SOFTROCE_BENCH=${SOFTROCE_BENCH})")
    else
        step bench-self-test python3 "$SOFTROCE_SCRIPT_DIR/bench.py" --self-test
        mc=()
        [ -n "${SOFTROCE_MOONCAKE_PY:-}" ] && mc=(--mooncake-python "$SOFTROCE_MOONCAKE_PY")
        STEP_TIMEOUT=${SOFTROCE_BENCH_TIMEOUT:-$b_timeout} step bench python3 "$SOFTROCE_SCRIPT_DIR/bench.py" \
            --out "$OUT" --kvferry "$BIN" --device "$DEV" --ip "$SOFTROCE_IP" --batch 128 --batch-bytes "${SOFTROCE_BENCH_BATCH_BYTES:-32M}" \
            --ib-bytes "${SOFTROCE_BENCH_BATCH_BYTES:-32M}" \
            --sizes "${SOFTROCE_BENCH_SIZES:-64K,256K,1M,4M}" --qps 2 --qps-sweep "${SOFTROCE_BENCH_QPS_SWEEP-$b_sweep}" \
            --qps-sweep-sizes "${SOFTROCE_BENCH_QPS_SWEEP_SIZES:-64K,1M}" \
            --inflight "${SOFTROCE_BENCH_INFLIGHT:-2}" --inflight-sweep "${SOFTROCE_BENCH_INFLIGHT_SWEEP-$b_isweep}" \
            --rounds "${SOFTROCE_BENCH_ROUNDS:-$b_rounds}" --seconds "${SOFTROCE_BENCH_SECONDS:-$b_seconds}" \
            --min-batches "${SOFTROCE_BENCH_MIN_BATCHES:-$b_min}" --budget "${SOFTROCE_BENCH_BUDGET:-$b_budget}" "${mc[@]}" \
            --mooncake-skip-reason "${SOFTROCE_MOONCAKE_SKIP:-}"
    fi
fi

echo "=== soft-RoCE suite summary"
printf '%s\n' "${RESULTS[@]}" | tee "$OUT/summary.txt"
exit $failed
