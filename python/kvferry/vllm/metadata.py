"""What the scheduler-side connector tells its worker-side ranks each engine step
(`KVConnectorMetadata`, vLLM 0.32 `vllm/distributed/kv_transfer/kv_connector/v1/base.py`).

Block ids are engine-global (every TP/PP rank holds the same block ids for its own layers and
heads), so one metadata object serves every rank. It is pickled to the worker processes: plain
dataclasses only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvferry.vllm.params import RemoteSource


@dataclass(frozen=True)
class LoadOrder:
    """The scheduler's order to every consumer rank to load one request (each rank's
    transport turns it into loads of the Rust ``kvferry_p2p::LoadSpec``): land ``num_tokens``
    prompt tokens of ``source``'s request into ``block_ids`` (one table per KV cache group:
    this engine's block id at each request position from 0, None where nothing is written: a
    local prefix-cache hit of the first ``num_local_computed`` tokens, a null block outside a
    sliding window; a shorter table is padded with None). ``refusal``: why the scheduler
    refused the load before any byte moves (the producer's KV cache layout differs): every
    rank reports it failed without connecting."""

    request_id: str
    source: RemoteSource
    block_ids: tuple[tuple[int | None, ...], ...]
    num_tokens: int
    num_local_computed: int = 0
    refusal: str | None = None


@dataclass(frozen=True)
class SendOrder:
    """The scheduler's order to every producer rank to hold one finished request's KV blocks
    (per group) for the consumer of ``transfer_id`` until served or until ``lease_seconds``
    after the worker sees this order (then freed: reported in ``finished_sending``). Only a
    load carrying ``load_key`` is served. ``block_ids``: per group, the block id at each
    request position (None: a null block, outside a sliding window)."""

    request_id: str
    transfer_id: str
    block_ids: tuple[tuple[int | None, ...], ...]
    num_tokens: int
    lease_seconds: float
    load_key: str


@dataclass
class KvferryConnectorMetadata(KVConnectorMetadata):
    """One engine step's new loads (consumer) and sends (producer)."""

    loads: list[LoadOrder] = field(default_factory=list)
    sends: list[SendOrder] = field(default_factory=list)
