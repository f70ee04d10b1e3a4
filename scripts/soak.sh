#!/usr/bin/env bash
# The loopback soak (p2p/tests/soak.rs): legitimate loads, each from a new consumer, alongside
# hostile connections to the producer (half-greetings held open, 8 GiB frame headers, consumers
# with the wrong secret, garbage on the engine's handshake port), under a 256-fd limit. Prints
# the failed legitimate loads (must be 0), fds and RSS over time (flat) and the warnings' bytes.
# The test command runs the same test for 20 s; this runs it for SECONDS (default 300).
# Usage: scripts/soak.sh [SECONDS] [REPORT_FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-300}
report=${2:-target/soak-report.txt}
KVFERRY_SOAK_SECONDS=$seconds KVFERRY_SOAK_REPORT=$report \
  cargo test --release -p kvferry-p2p --features kvferry/rdma --test soak -- --nocapture
echo "samples (seconds, fds, RSS KiB): $report"
