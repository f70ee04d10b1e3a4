"""`KvferryConnector`: kvferry as a vLLM v1 KV connector (`KVConnectorBase_V1` + `SupportsHMA`).

Load it with::

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "kvferry.vllm",
                           "kv_role": "kv_producer" | "kv_consumer",
                           "kv_load_failure_policy": "fail" | "recompute",
                           "kv_connector_extra_config": {"host": "10.0.0.5", "port": 17500,
                               "protocol": "auto", "fail_closed": true,
                               "lease_seconds": 30, "load_timeout_seconds": 30,
                               "connect_timeout_seconds": 5, "head_splits": 1,
                               "layer_splits": 1}}'

Extra config keys: ``host`` (this instance's address, reachable by the peer; default vLLM's
``get_ip()``), ``port`` (side-channel base port; head unit ``j`` of layer unit ``k`` of producer
rank ``(tp, pp)`` binds ``port + ((pp * tp_size + tp) * layer_splits + k) * head_splits + j``,
data-parallel engine ``d`` from ``port + d * tp_size * pp_size * layer_splits * head_splits``),
``protocol`` (``auto``, the default: RDMA when a usable device exists, else TCP, as the CLI;
each worker logs what it chose | ``tcp`` | ``rdma``),
``fail_closed`` (a mismatched or unverifiable load goes to vLLM's ``kv_load_failure_policy``;
default true, unlike the CLI and ``kvferry.Consumer``: in serving, decoding from KV known to
differ is the worse outcome), ``lease_seconds``,
``load_timeout_seconds``, ``connect_timeout_seconds``, ``head_splits`` (read by producers; int
>= 1, default 1, must divide each rank's KV heads: each producer rank serves its heads through
that many kvferry Producers, "units", of ``Hp / head_splits`` heads each; a consumer rank
holding ``Hc`` heads loads and verifies the units of exactly its heads, so ``Hp / head_splits``
must divide ``Hc``: e.g. TP 1 -> TP 2 needs ``head_splits`` 2 on the producer; TP 2 -> TP 1 needs
nothing; docs/vllm-connector-notes.md §8), ``layer_splits`` (read by producers; int >= 1, default
1, at most each PP stage's layer count: each producer rank serves its stage's layers ``[a, b)``
(vLLM's ``get_pp_indices``) through that many layer units, unit ``k`` holding ``[a + k * n //
layer_splits, a + (k + 1) * n // layer_splits)``, ``n = b - a``, times ``head_splits`` head
units; a consumer PP stage loads and verifies the layer units inside its own layers, so its layer
range must be a union of whole layer units: e.g. PP 1 -> PP 2 needs ``layer_splits`` 2 on the
producer, PP 2 -> PP 1 needs nothing; a refused load names the ``layer_splits`` needed),
``rdma_devices`` (the RDMA NICs of each worker: ``"mlx5_0,mlx5_1"`` for every worker of the
host, or a list with one entry per worker indexed by its local rank, e.g. ``["mlx5_0",
"mlx5_1"]`` for GPU 0 and GPU 1; default ``""``: kvferry picks; Mooncake's ``device_name``),
``allowed_producers`` (read by consumers: a list of ``"host"`` or ``"host:port"`` (base port)
strings; a request whose ``kv_transfer_params`` name another producer is computed locally,
never connected to; absent: with ``secret_file``, any producer that proves the secret, else
loopback producers only, so that a client that reaches the consumer's API cannot make it load
KV from a host of its choosing; docs/deploy.md), ``secret_file`` (the path of a shared
secret of 16..4096 bytes, mode 600, the same on every instance: every rank's transfer engines
authenticate and each load writes under a per-load grant, as the CLI's ``--secret-file``;
docs/design.md §8.1; load keys stay the random per-request keys the proxy carries),
``engine_ports`` (``"LO-HI"``: the range every transfer engine of the host's workers takes its
listening ports from, the lowest free ones, two per engine over TCP and one over RDMA, so a
firewall can list them; default: ports the OS picks), and the
test-only ``test_corrupt_transfer_prefix``
(flips a landed bit of every load whose transfer id starts with it: fault injection for the
tests; never set it in production).

vLLM constructs it once in the scheduler process (role SCHEDULER: :mod:`kvferry.vllm.scheduler`)
and once in every worker process, i.e. per TP/PP rank (role WORKER: :mod:`kvferry.vllm.worker`).
Hybrid models run with vLLM's hybrid KV cache manager on: every KV cache group (full attention,
sliding window, MLA) moves with its own block table and verifies on its own; a group the
connector cannot move (Mamba-type state, chunked local, cross or encoder-only attention) is
refused at start-up with the reason (:func:`kvferry.vllm.groups.kv_cache_groups`). Instances of
different ``--block-size`` pair where the seed's chunk sums verify them (the producer names its
block sizes in ``kv_transfer_params``; a consumer that could not verify refuses before any byte
moves, :func:`kvferry.vllm.groups.block_size_refusal`). Signatures are vLLM 0.32's
(`vllm/distributed/kv_transfer/kv_connector/v1/base.py`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvferry.vllm.config import DEFAULT_PORT, DEFAULT_PROTOCOL, ConnectorConfig, engine_port, port_range
from kvferry.vllm.layouts import kv_layout_tags, layer_specs
from kvferry.vllm.metadata import KvferryConnectorMetadata
from kvferry.vllm.scheduler import KvferrySchedulerSide
from kvferry.vllm.transport import KvferryTransport
from kvferry.vllm.worker import KvferryWorkerSide

# The settings are read in config.py; these names stay importable from here.
__all__ = ["DEFAULT_PORT", "DEFAULT_PROTOCOL", "KvferryConnector", "engine_port", "port_range"]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's logger, so vLLM's logging configuration (format, level) applies.
log = logging.getLogger("vllm.kvferry")

class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over kvferry: push flow (the consumer asks, the producer WRITEs the
    prompt's KV into the consumer's blocks), every load verified before it is reported finished."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        config = ConnectorConfig.from_vllm_config(vllm_config, kv_cache_config)
        self._scheduler: KvferrySchedulerSide | None = None
        self._worker: KvferryWorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            # What packs a block beyond its shape (the CPU attention kernel's ISA), per group.
            layouts = kv_layout_tags(vllm_config, kv_cache_config, config.groups)
            self._scheduler = KvferrySchedulerSide(config.scheduler_config(group_kv_layouts=layouts))
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank, get_world_group

            tp_rank, pp_rank = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
            transport_config = config.transport_config(get_world_group().local_rank)
            transport = KvferryTransport(
                transport_config, tp_rank=tp_rank, pp_rank=pp_rank, tp_size=config.tp_size, pp_size=config.pp_size,
                block_size=config.block_size, is_producer=config.is_producer, is_consumer=config.is_consumer,
                # Each layer's spec decides its layout (MLA's [B, 1, N, D] looks like a one-head cache).
                kv_cache_specs=layer_specs(kv_cache_config),
                # The layout vLLM resolved (KVCacheConfig.kv_cache_layout, else CacheConfig's): the
                # physical axis order of every layer's [B, H, N, C] view (notes §10).
                kv_cache_layout=getattr(kv_cache_config, "kv_cache_layout", None)
                or getattr(vllm_config.cache_config, "kv_cache_layout", None),
                stage_layers=config.stage_layers[pp_rank], kv_cache_groups=list(config.groups))
            self._worker = KvferryWorkerSide(
                tp_rank=tp_rank, pp_rank=pp_rank, load_timeout_seconds=transport_config.load_deadline_seconds(),
                transport=transport, report_blocks=len(config.groups) == 1,
            )

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler: tokens to load from the producer, loaded asynchronously (see scheduler.py)."""
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: "Request") -> None:
        """Scheduler: a producer of a model with Mamba-type state drops the prompt's last token
        of a request it prefills for a consumer (see scheduler.py)."""
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        """Scheduler: queues the load into the blocks vLLM just allocated."""
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """Scheduler: this step's new loads and sends for every rank."""
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta()

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        """Scheduler: the groups a load fills: every transfer group."""
        # The request's own blocks land in every transfer group (as Mooncake's connector says).
        return self._kv_cache_config.transfer_group_ids

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler: (keep the blocks for a consumer?, params for the proxy); one KV cache group."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler (SupportsHMA): as request_finished, block ids per KV cache group."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        """Scheduler: forgets sends whose blocks the workers released."""
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output.finished_sending)

    def has_pending_push_work(self) -> bool:
        """Scheduler: True while blocks are held for a consumer (keeps the engine stepping)."""
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Worker: records this rank's KV cache tensors (layer name -> tensor)."""
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Worker: takes this step's metadata: holds new sends, starts new loads (asynchronous)."""
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvferryConnectorMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are whole-request and asynchronous (between scheduler steps): nothing per layer.
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # Push flow: the producer sends from its paged cache after the request finished.
        return None

    def wait_for_save(self):
        """Nothing to wait for: the push flow sends after the request finished."""
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker: (requests whose held blocks may be freed, requests whose load ended)."""
        assert self._worker is not None
        return self._worker.get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> "KVConnectorTransferResults":
        """Worker: finished sends, finished loads and failed loads (a failed load is finished
        too); vLLM's kv_load_failure_policy decides what a failed load's request does."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        assert self._worker is not None
        sending, recving, failed = self._worker.transfer_results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker: blocks of loads that failed since the last call (one KV cache group only, see
        worker.py); vLLM's kv_load_failure_policy decides."""
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    # ---- stats (vLLM's connector stats hooks; kvferry.vllm.stats) ----

    def get_kv_connector_stats(self) -> "KVConnectorStats | None":
        """Worker: this rank's loads since the last call (None when there were none)."""
        if self._worker is None:
            return None
        # Test transports and the placeholder before register_kv_caches keep no stats.
        take = getattr(self._worker.transport, "take_stats", None)
        data = take() if take is not None else None
        if data is None:
            return None
        from kvferry.vllm.stats import KvferryKVConnectorStats

        return KvferryKVConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> "KVConnectorStats | None":
        """vLLM's logger: the workers' stats data as kvferry's stats object."""
        from kvferry.vllm.stats import KvferryKVConnectorStats

        return KvferryKVConnectorStats(data=data) if data is not None else KvferryKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> "KVConnectorPromMetrics":
        """vLLM's Prometheus logger: kvferry's metrics (``vllm:kvferry_*``)."""
        from kvferry.vllm.stats import KvferryPromMetrics

        return KvferryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        """Worker: stops the load pool."""
        if self._worker is not None:
            self._worker.shutdown()
