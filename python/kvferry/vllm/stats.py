"""kvferry's loads through vLLM's connector stats hooks (vLLM 0.32's
``vllm/distributed/kv_transfer/kv_connector/v1/metrics.py``), in the manner of vLLM's NIXL
connector (``nixl/stats.py``): each worker's transport records its unit loads
(:meth:`kvferry.vllm.transport.KvferryTransport.take_stats`), the connector hands them to vLLM
from ``get_kv_connector_stats``, vLLM aggregates them across workers into
:class:`KvferryKVConnectorStats` (``build_kv_connector_stats``) for its periodic log line, and
:class:`KvferryPromMetrics` (``build_prom_metrics``) records them in vLLM's Prometheus metrics,
named as NIXL's with the ``kvferry`` prefix: ``vllm:kvferry_xfer_time_seconds``,
``vllm:kvferry_bytes_transferred``, ``vllm:kvferry_checksum_time_seconds``,
``vllm:kvferry_num_failed_transfers``, ``vllm:kvferry_num_verified_loads``,
``vllm:kvferry_num_mismatched_loads``, ``vllm:kvferry_num_unverified_loads``,
``vllm:kvferry_num_recomputed_loads``.

The data dict (what travels from the workers to the logger process; lists, so it pickles):
``transfer_duration`` (s) and ``bytes_transferred`` per landed load, ``checksum_duration`` (s) per
checked load, and one ``1`` per event in ``num_verified``, ``num_mismatch``, ``num_unverified``,
``num_failed_transfers`` (did not land), ``num_recomputed``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvferry.vllm.transport import STATS_KEYS


@dataclass
class KvferryKVConnectorStats(KVConnectorStats):
    """kvferry's loads over an interval (see the module doc for ``data``)."""

    def __post_init__(self):
        if not self.data:
            self.reset()
        for k in STATS_KEYS:
            self.data.setdefault(k, [])

    def reset(self):
        self.data: dict[str, list[float | int]] = {k: [] for k in STATS_KEYS}

    def clone_and_reset(self) -> "KvferryKVConnectorStats":
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return all(len(v) == 0 for v in self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for k, v in other.data.items():
                self.data.setdefault(k, []).extend(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        n = len(d["transfer_duration"])
        total_s = sum(d["transfer_duration"])
        total_mb = sum(d["bytes_transferred"]) / 2**20
        checks = d["checksum_duration"]
        return {
            "Num landed loads": n,
            "Num verified": len(d["num_verified"]),
            "Num mismatch": len(d["num_mismatch"]),
            "Num unverified": len(d["num_unverified"]),
            "Num failed transfers": len(d["num_failed_transfers"]),
            "Num recomputed": len(d["num_recomputed"]),
            "Avg xfer time (ms)": round(total_s / n * 1e3, 3) if n else 0,
            "Avg MB per transfer": round(total_mb / n, 3) if n else 0,
            "Throughput (MB/s)": round(total_mb / total_s, 3) if total_s > 0 else 0,
            "Avg checksum time (ms)": round(sum(checks) / len(checks) * 1e3, 3) if checks else 0,
        }


class KvferryPromMetrics(KVConnectorPromMetrics):
    """kvferry's loads in vLLM's Prometheus metrics (per engine, as vLLM labels them)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        time_buckets = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
        bytes_buckets = [2 ** (10 + i) for i in range(1, 25, 2)]

        def per_engine(metric):
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        self.xfer_time = per_engine(self._histogram_cls(
            name="vllm:kvferry_xfer_time_seconds",
            documentation="Histogram of transfer duration of kvferry KV cache loads (request to the producer's FINISH).",
            buckets=time_buckets, labelnames=labelnames))
        self.bytes_transferred = per_engine(self._histogram_cls(
            name="vllm:kvferry_bytes_transferred",
            documentation="Histogram of bytes per kvferry KV cache load.",
            buckets=bytes_buckets, labelnames=labelnames))
        self.checksum_time = per_engine(self._histogram_cls(
            name="vllm:kvferry_checksum_time_seconds",
            documentation="Histogram of the time verifying one kvferry KV cache load (checksums and compare).",
            buckets=time_buckets, labelnames=labelnames))
        self.counters = {
            key: per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames))
            for key, name, doc in (
                ("num_failed_transfers", "vllm:kvferry_num_failed_transfers",
                 "Number of kvferry KV cache loads that did not land."),
                ("num_verified", "vllm:kvferry_num_verified_loads",
                 "Number of kvferry KV cache loads whose checksums matched the producer's."),
                ("num_mismatch", "vllm:kvferry_num_mismatched_loads",
                 "Number of kvferry KV cache loads whose checksums differ from the producer's."),
                ("num_unverified", "vllm:kvferry_num_unverified_loads",
                 "Number of kvferry KV cache loads that could not be compared."),
                ("num_recomputed", "vllm:kvferry_num_recomputed_loads",
                 "Number of kvferry KV cache loads discarded for recomputation."),
            )
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for v in transfer_stats_data.get("transfer_duration", []):
            self.xfer_time[engine_idx].observe(v)
        for v in transfer_stats_data.get("bytes_transferred", []):
            self.bytes_transferred[engine_idx].observe(v)
        for v in transfer_stats_data.get("checksum_duration", []):
            self.checksum_time[engine_idx].observe(v)
        for key, counter in self.counters.items():
            n = len(transfer_stats_data.get(key, []))
            if n:
                counter[engine_idx].inc(n)
