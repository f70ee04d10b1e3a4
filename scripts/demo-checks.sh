#!/usr/bin/env bash
# The main job as a user runs it: `kvferry demo` with its defaults (Qwen3-0.6B
# shape, 64 requests of 100-4000 tokens) and with TP2 / PP2 ranks, equal or
# different on the two sides; every load
# must verify, and the corruption modes must give their exact counts.
set -euo pipefail
bin=${1:-target/release/kvferry}
export KVFERRY_LOG=${KVFERRY_LOG:-warn}

check() { # check "ARGS" PY-EXPR
  local args=$1 expr=$2 out
  echo "--- kvferry demo --json $args" >&2
  out=$(eval "\"\$bin\" demo --json $args") # eval: ARGS may hold quoted words (a layout)
  echo "$out" >&2
  python3 -c "import json,sys; r=json.loads(sys.argv[1]); ok=($expr); print('ok' if ok else 'FAILED: '+sys.argv[2]); sys.exit(0 if ok else 1)" "$out" "$expr"
}

check "" "r['requests']==64 and r['verified']==64 and r['mismatch']==r['unverified']==r['failed']==r['recomputed']==0"
check "--prefill-tp 2 --decode-tp 2 --requests 16" "r['verified']==16"
check "--prefill-pp 2 --decode-pp 2 --requests 16" "r['verified']==16"
check "--prefill-tp 2 --decode-tp 2 --requests 16 --corrupt 5" "r['mismatch']==5 and r['completed']==16"
check "--prefill-pp 2 --decode-pp 2 --requests 16 --corrupt 5 --fail-closed --load-failure-policy fail" "r['failed']==5"
check "--prefill-tp 2 --decode-tp 2 --requests 16 --corrupt 5 --fail-closed --load-failure-policy recompute" "r['recomputed']==5 and r['kv_equal_after_recompute'] is True"
check "--model llama3-8b --requests 8" "r['verified']==8"
check "--model deepseek-v2-lite --prefill-tp 2 --decode-tp 2 --requests 8 --corrupt 2" "r['verified']==6 and r['mismatch']==2"
# different TP / PP sizes on the two sides (KV heads mapped between ranks)
check "--prefill-tp 2 --decode-tp 1 --requests 16 --layout 'B KV H N D'" "r['verified']==16"
check "--prefill-tp 1 --decode-tp 2 --prefill-pp 2 --requests 16 --corrupt 5 --fail-closed --load-failure-policy recompute" "r['recomputed']==5 and r['verified']==11 and r['kv_equal_after_recompute'] is True"
check "--model deepseek-v2-lite --prefill-tp 2 --decode-tp 4 --requests 8 --corrupt 2" "r['verified']==6 and r['mismatch']==2"
# loads in flight: one at a time, and all 16 at once, with exact counts (the default is 4)
check "--in-flight 1 --requests 16 --corrupt 5 --fail-closed --load-failure-policy recompute" "r['in_flight']==1 and r['recomputed']==5 and r['verified']==11 and r['kv_equal_after_recompute'] is True"
check "--in-flight 16 --requests 16 --corrupt 5 --fail-closed --load-failure-policy fail" "r['in_flight']==16 and r['failed']==5 and r['mismatch']==5 and r['verified']==11"
echo "demo checks passed" >&2
