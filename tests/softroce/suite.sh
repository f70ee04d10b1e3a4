#!/usr/bin/env bash
# The soft-RoCE suite (DESIGN.md §7): kvferry's RDMA tests, the demo and the RDMA benchmark
# beside ib_write_bw, all in one boot of the QEMU guest (tests/softroce/run.sh).
#
# On the host:   tests/softroce/suite.sh [OUTDIR]
#   builds the test executables (release) and the `kvferry` binary, then boots the guest
#   running this same script. Env: CARGO_TARGET_DIR (default <repo>/target), KVFERRY_BIN
#   (default $CARGO_TARGET_DIR/release/kvferry), SOFTROCE_SKIP_CLI=1 (tests only),
#   SOFTROCE_TIMEOUT (default 1200 s for the whole guest run).
# In the guest (SOFTROCE_GUEST=1, set by run.sh): runs the steps listed in
#   $SOFTROCE_OUT/manifest, logs each to $SOFTROCE_OUT/<step>.log, prints a summary and exits
#   non-zero when any step failed. KVFERRY_REQUIRE_RDMA=1: a test that finds no device fails.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [ -z "${SOFTROCE_GUEST:-}" ]; then
    set -e
    ROOT=$(cd "$HERE/../.." && pwd)
    cd "$ROOT"
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
    OUT=${1:-$(mktemp -d /tmp/softroce-suite.XXXXXX)}
    mkdir -p "$OUT"
    OUT=$(realpath "$OUT")
    echo "[suite] building RDMA test executables (release)" >&2
    cargo test --release -p kvferry-transfer --features rdma --no-run --message-format=json 2>"$OUT/build.log" \
        | grep -o '"executable":"[^"]*"' | sed 's/"executable":"\(.*\)"/\1/' >"$OUT/executables" \
        || { cat "$OUT/build.log" >&2; exit 1; }
    {
        # the transport's own tests (lib unit tests, filtered) and every tests/rdma_*.rs
        grep '/kvferry_transfer-[0-9a-f]*$' "$OUT/executables" | sed 's/$/ transport::rdma::/'
        grep '/rdma_[a-z_]*-[0-9a-f]*$' "$OUT/executables"
    } >"$OUT/manifest"
    [ "$(wc -l <"$OUT/manifest")" -ge 2 ] || { echo "[suite] test executables not found" >&2; cat "$OUT/executables" >&2; exit 1; }
    export KVFERRY_BIN=${KVFERRY_BIN:-$CARGO_TARGET_DIR/release/kvferry}
    if [ -z "${SOFTROCE_SKIP_CLI:-}" ]; then
        echo "[suite] building kvferry (release)" >&2
        cargo build --release -p kvferry --features rdma --bin kvferry 2>>"$OUT/build.log" || { tail -30 "$OUT/build.log" >&2; exit 1; }
    fi
    exec "$HERE/run.sh" -t "${SOFTROCE_TIMEOUT:-1200}" -o "$OUT" "$HERE/suite.sh"
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

# 1. kvferry's RDMA tests
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
    # 2. the demo over RDMA: every load verified; the corruption modes give their exact counts
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

    # 3. benchmark: kvferry bench over RDMA beside ib_write_bw on the same device, same boot
    ibbw() { # ibbw SIZE ITERATIONS -> prints MB/s (MiB, as perftest reports)
        timeout 120 ib_write_bw -d "$DEV" -x 1 -s "$1" -n "$2" >"$OUT/ib_write_bw-srv-$1.log" 2>&1 &
        local srv=$! rc=1 try
        # the server may need a while to listen under TCG: retry the client
        for try in $(seq 1 20); do
            sleep 1
            timeout 60 ib_write_bw -d "$DEV" -x 1 -s "$1" -n "$2" "$SOFTROCE_IP" >"$OUT/ib_write_bw-$1.log" 2>&1
            rc=$?
            [ $rc = 0 ] && break
            grep -q "Couldn't connect" "$OUT/ib_write_bw-$1.log" || break
        done
        wait $srv
        [ $rc = 0 ] || { cat "$OUT/ib_write_bw-$1.log" >&2; return $rc; }
        awk -v s="$1" '$1==s && NF>=5 {print $4}' "$OUT/ib_write_bw-$1.log" | tail -1
    }
    bench() {
        local ib64 ib1m
        # about 130 MB each: a few seconds at soft-RoCE speed. kvferry keeps a batch of 128
        # requests in flight, as ib_write_bw keeps 128 work requests (its default tx depth).
        ib64=$(ibbw 65536 2000) || ib64=0
        ib1m=$(ibbw 1048576 125) || ib1m=0
        ib64=${ib64:-0}; ib1m=${ib1m:-0}
        "$BIN" bench --transport rdma --block-sizes 64K,1M --batch 128 --seconds 4 --json >"$OUT/bench.json" || return 1
        cat "$OUT/bench.json"
        python3 - "$OUT/bench.json" "$ib64" "$ib1m" >"$OUT/bench_ratio.txt" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
ib = {65536: float(sys.argv[2]), 1048576: float(sys.argv[3])}  # MiB/s (perftest: MB = 2^20 B)
# kvferry must have run over RDMA and moved data at every point; a missing ib_write_bw
# figure (perftest under TCG sometimes reports nothing) only leaves that ratio out.
ok = r.get("transport") == "rdma" and len(r["points"]) > 0
if not ok:
    print(f"kvferry bench did not run over RDMA: transport {r.get('transport')}")
for p in r["points"]:
    ok = ok and p["gb_per_s"] > 0
    base = ib.get(p["block_size"], 0.0) * 1048576 / 1e9
    if base > 0:
        print(f"block {p['block_size']:>8} batch {p['batch']:>4}: kvferry {p['gb_per_s']:.4f} GB/s, "
              f"ib_write_bw {base:.4f} GB/s, ratio {p['gb_per_s'] / base:.2f}")
    else:
        print(f"block {p['block_size']:>8} batch {p['batch']:>4}: kvferry {p['gb_per_s']:.4f} GB/s, "
              f"no ib_write_bw baseline (it reported {ib.get(p['block_size'])} MiB/s): ratio left out")
sys.exit(0 if ok else 1)
EOF
        local rc=$?
        cat "$OUT/bench_ratio.txt"
        return $rc
    }
    export OUT DEV BIN
    export -f ibbw bench
    step bench bash -c bench
fi

echo "=== soft-RoCE suite summary"
printf '%s\n' "${RESULTS[@]}" | tee "$OUT/summary.txt"
exit $failed
