"""kvferry.metrics_text(): the process's Prometheus metrics after a known load sequence (a
verified load, a corrupted one under fail-closed recompute, one that cannot land), read as
deltas since the metrics are the whole process's."""

import re

import kvferry

from test_p2p import LOCAL, PROMPT, REMOTE, dead_endpoint, flip_hook, make_rank, pair  # noqa: F401


def series(text, name, **labels):
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-z_:]+)(\{[^}]*\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def test_metrics_count_loads_by_verdict_and_transfers_by_path(pair):  # noqa: F811
    before = kvferry.metrics_text()
    assert before.rstrip().endswith("# EOF")
    producer, consumer, parr, carr = pair(fail_closed=True, load_failure_policy="recompute")
    producer.publish("m-0", [REMOTE], PROMPT, load_key="k0")
    ok = consumer.load("m-0", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="k0")
    assert ok.verdict.status == "verified"
    producer.publish("m-1", [REMOTE], PROMPT, load_key="k1")
    consumer.set_landed_hook(flip_hook(carr, 1, LOCAL, 35, []))
    bad = consumer.load("m-1", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="k1")
    consumer.set_landed_hook(None)
    assert bad.verdict.status == "mismatch" and bad.action == "recompute"
    crank, _ = make_rank(0, 1, 8, seed=None)
    lost = kvferry.Consumer([crank], connect_timeout=1.0, reply_timeout=2.0, max_wait=3.0)
    gone = lost.load("m-2", dead_endpoint(), [REMOTE], [LOCAL], PROMPT)
    assert not gone.landed

    after = kvferry.metrics_text()

    def delta(name, **labels):
        return series(after, name, **labels) - series(before, name, **labels)

    assert delta("kvferry_num_loads_total", verdict="verified") == 1
    assert delta("kvferry_num_loads_total", verdict="mismatch") == 1
    assert delta("kvferry_num_loads_total", verdict="failed") == 1
    assert delta("kvferry_num_recomputed_total") == 1
    # Two loads landed and were checksummed; the failed one has no times.
    assert delta("kvferry_checksum_time_seconds_count") == 2
    assert delta("kvferry_load_time_seconds_count") == 2
    # The producer (same process) WRITEs both landed loads over TCP.
    assert delta("kvferry_transferred_bytes_total", path="tcp", op="write") == ok.bytes + bad.bytes
    assert delta("kvferry_num_failed_transfers_total") == 0
