"""kvferry's loads through vLLM's connector stats hooks: real kvferry transports over TCP (a
verified load, a corrupted one, one that cannot land), their stats taken as the connector's
``get_kv_connector_stats`` takes them, aggregated and reduced as vLLM's logger does, and recorded
in vLLM's Prometheus metrics through ``build_prom_metrics``, read back from the registry."""

import time
from types import SimpleNamespace

import prometheus_client
import pytest

from kvferry.vllm.connector import KvferryConnector
from kvferry.vllm.metadata import LoadOrder, SendOrder
from kvferry.vllm.params import RemoteSource
from kvferry.vllm.stats import KvferryKVConnectorStats, KvferryPromMetrics

from test_transport import caches, make, send_and_load  # noqa: F401

PORT = 17955


@pytest.fixture(scope="module")
def loaded():
    pkv, ckv = caches(8, seed=1), caches(8, seed=None)
    p = make("p", pkv, PORT)
    c = make("c", ckv, PORT, test_corrupt_transfer_prefix="bad-")
    try:
        assert send_and_load(p, c, "good-0", PORT).verdict == "verified"
        assert send_and_load(p, c, "bad-0", PORT).verdict == "mismatch"
        # Published with another load key: the producer refuses it, nothing lands.
        p.serve(SendOrder(request_id="p-lost", transfer_id="lost-0", block_ids=((1,),), num_tokens=5,
                         lease_seconds=10.0, load_key="right"))
        src = RemoteSource(transfer_id="lost-0", engine_id="e", host="127.0.0.1", port=PORT, tp_size=1,
                           pp_size=1, remote_block_ids=((1,),), load_key="wrong")
        r = c.load(LoadOrder(request_id="d-lost", source=src, block_ids=((2,),), num_tokens=5),
                   time.monotonic() + 10)
        assert not r.ok and "did not land" in r.reason, r
        data = c.take_stats()
        assert c.take_stats() is None  # taken once; none until the next load
        yield data
    finally:
        p.shutdown()
        c.shutdown()


def test_stats_are_taken_once(loaded):
    # The fixture took them; the transport holds none until the next load.
    assert loaded is not None and len(loaded["num_verified"]) == 1


def test_stats_count_the_loads_by_verdict_and_reduce_as_vllm_logs_them(loaded):
    data = loaded
    stats = KvferryConnector.build_kv_connector_stats(data)
    assert isinstance(stats, KvferryKVConnectorStats) and not stats.is_empty()
    # vLLM aggregates the workers' stats objects; an empty one changes nothing.
    total = KvferryConnector.build_kv_connector_stats().aggregate(stats)
    total = total.aggregate(KvferryKVConnectorStats())
    r = total.reduce()
    assert r["Num landed loads"] == 2
    assert r["Num verified"] == 1 and r["Num mismatch"] == 1 and r["Num unverified"] == 0
    assert r["Num failed transfers"] == 1
    assert r["Num recomputed"] == 0
    assert r["Avg xfer time (ms)"] > 0 and r["Avg checksum time (ms)"] > 0
    assert r["Avg MB per transfer"] == pytest.approx(sum(data["bytes_transferred"]) / 2 / 2**20, abs=1e-3)


def test_prometheus_metrics_follow_vllms_nixl_names_with_the_kvferry_prefix(loaded):
    data = loaded
    registry = prometheus_client.CollectorRegistry()

    def bound(cls):
        class Bound(cls):
            def __init__(self, *a, **kw):
                super().__init__(*a, registry=registry, **kw)
        return Bound

    types = {prometheus_client.Gauge: bound(prometheus_client.Gauge),
             prometheus_client.Counter: bound(prometheus_client.Counter),
             prometheus_client.Histogram: bound(prometheus_client.Histogram)}
    prom = KvferryConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]})
    assert isinstance(prom, KvferryPromMetrics)
    prom.observe(data, engine_idx=0)
    labels = {"model_name": "m", "engine": "0"}

    def value(name):
        return registry.get_sample_value(name, labels)

    assert value("vllm:kvferry_xfer_time_seconds_count") == 2
    assert value("vllm:kvferry_bytes_transferred_sum") == sum(data["bytes_transferred"])
    assert value("vllm:kvferry_checksum_time_seconds_count") == 2
    assert value("vllm:kvferry_num_verified_loads_total") == 1
    assert value("vllm:kvferry_num_mismatched_loads_total") == 1
    assert value("vllm:kvferry_num_failed_transfers_total") == 1
    assert value("vllm:kvferry_num_unverified_loads_total") == 0
