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

from kvferry.vllm import params as P
from kvferry.vllm.groups import kv_cache_groups
from kvferry.vllm.layouts import kv_layout_tags, layer_specs
from kvferry.vllm.metadata import KvferryConnectorMetadata
from kvferry.vllm.scheduler import KvferrySchedulerSide, SchedulerConfig
from kvferry.vllm.transport import KvferryTransport, TransportConfig, rdma_devices_for
from kvferry.vllm.units import ConfigError
from kvferry.vllm.worker import KvferryWorkerSide

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

DEFAULT_PORT = 17500
# As the CLI's --transport: RDMA when a usable device exists, else TCP (each worker logs its choice).
DEFAULT_PROTOCOL = "auto"


def _extra(extra: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = extra.get(key, default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] = {value!r}: expected {kind.__name__}")
    return value


def port_range(value: Any) -> str:
    """``kv_connector_extra_config["engine_ports"]``, ``"LO-HI"`` (or one port, 1..65535, LO <=
    HI): the range every transfer engine of this instance's workers on a host takes its
    listening ports from (the lowest free ones), returned as ``"LO-HI"``. Raises
    :class:`~kvferry.vllm.units.ConfigError` for anything else."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    lo, dash, hi = text.partition("-")
    hi = hi if dash else lo
    if not (lo.strip().isdigit() and hi.strip().isdigit() and 1 <= int(lo) <= int(hi) <= 65535):
        raise ConfigError(f"kv_connector_extra_config['engine_ports'] = {value!r}: expected a port range "
                          "\"LO-HI\" (e.g. \"20000-20099\"), ports 1-65535")
    return f"{int(lo)}-{int(hi)}"


def engine_port(base: int, dp_rank: int, tp_size: int, pp_size: int, head_splits: int, layer_splits: int) -> int:
    """The side-channel base port of data-parallel engine ``dp_rank``: ``base + dp_rank *
    tp_size * pp_size * layer_splits * head_splits`` (each engine's producer units take that
    many ports from its base, params.unit_port), so DP engines on one host do not collide; the
    scheduler names it as ``remote_port``, consumers need nothing else. Raises
    :class:`~kvferry.vllm.units.ConfigError` when the engine's last port passes 65535."""
    width = tp_size * pp_size * max(layer_splits, 1) * max(head_splits, 1)
    port = base + dp_rank * width
    if port + width - 1 > 65535:
        raise ConfigError(f"kv_connector_extra_config['port'] = {base}: data-parallel engine {dp_rank} needs ports "
                          f"{port}..{port + width - 1}, past 65535")
    return port


class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over kvferry: push flow (the consumer asks, the producer WRITEs the
    prompt's KV into the consumer's blocks), every load verified before it is reported finished."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        # Refuses, with the reason, a group kvferry's connector cannot move (before any engine starts).
        groups = kv_cache_groups(kv_cache_config, vllm_config.cache_config.block_size)
        ktc = vllm_config.kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        port = _extra(extra, "port", int, DEFAULT_PORT)
        if not 1 <= port <= 65535:
            raise ConfigError(f"kv_connector_extra_config['port'] = {port} is not a TCP port")
        lease = _extra(extra, "lease_seconds", float, 30.0)
        timeout = _extra(extra, "load_timeout_seconds", float, 30.0)
        connect_timeout = _extra(extra, "connect_timeout_seconds", float, 5.0)
        if lease <= 0 or timeout <= 0 or connect_timeout <= 0:
            raise ConfigError("kv_connector_extra_config lease_seconds, load_timeout_seconds and "
                              "connect_timeout_seconds must be > 0")
        protocol = _extra(extra, "protocol", str, DEFAULT_PROTOCOL)
        if protocol not in ("tcp", "rdma", "auto"):
            raise ConfigError(f"kv_connector_extra_config['protocol'] = {protocol!r}: expected tcp, rdma or auto")
        fail_closed = _extra(extra, "fail_closed", bool, True)
        # Checked against the rank's KV heads when a producer rank registers them (units.py).
        head_splits = _extra(extra, "head_splits", int, 1)
        # Checked against the stage's layers when a producer rank registers them (units.py).
        layer_splits = _extra(extra, "layer_splits", int, 1)
        if layer_splits < 1:
            raise ConfigError(f"kv_connector_extra_config['layer_splits'] = {layer_splits} must be >= 1")
        rdma_devices = extra.get("rdma_devices")  # resolved per worker below (rdma_devices_for)
        corrupt = extra.get("test_corrupt_transfer_prefix")
        if corrupt is not None and not isinstance(corrupt, str):
            raise ConfigError(f"kv_connector_extra_config['test_corrupt_transfer_prefix'] = {corrupt!r}: expected str")
        engine_ports = extra.get("engine_ports")
        if engine_ports is not None:
            engine_ports = port_range(engine_ports)
        secret_file = extra.get("secret_file")
        if secret_file is not None and (not isinstance(secret_file, str) or not secret_file):
            raise ConfigError(f"kv_connector_extra_config['secret_file'] = {secret_file!r}: expected a file path")
        allowed = extra.get("allowed_producers")
        try:
            allowed = P.producer_policy(allowed, secret_file)
        except ValueError as e:
            raise ConfigError(f"kv_connector_extra_config['allowed_producers']: {e}") from None
        host = extra.get("host")
        if host is None:
            from vllm.utils.network_utils import get_ip

            host = get_ip()
        if not isinstance(host, str) or not host:
            raise ConfigError(f"kv_connector_extra_config['host'] = {host!r}: expected a host name or address")
        self._scheduler: KvferrySchedulerSide | None = None
        self._worker: KvferryWorkerSide | None = None
        pc = vllm_config.parallel_config
        # This DP engine's own base port. data_parallel_index keeps the DP rank where vLLM resets
        # data_parallel_rank to 0 (independent dense-model DP engines).
        dp_rank = getattr(pc, "data_parallel_index", None)
        port = engine_port(port, pc.data_parallel_rank if dp_rank is None else dp_rank, pc.tensor_parallel_size,
                           pc.pipeline_parallel_size, head_splits, layer_splits)
        # Every PP stage's layer numbers [start, end), as vLLM's model partitions them (honours
        # VLLM_PP_LAYER_PARTITION); the producer sends them, a consumer stage pairs by them.
        from vllm.distributed.utils import get_pp_indices

        num_layers = vllm_config.model_config.get_total_num_hidden_layers()
        stage_layers = tuple(get_pp_indices(num_layers, r, pc.pipeline_parallel_size)
                             for r in range(pc.pipeline_parallel_size))
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KvferrySchedulerSide(
                SchedulerConfig(
                    engine_id=str(ktc.engine_id),
                    is_producer=ktc.is_kv_producer,
                    is_consumer=ktc.is_kv_consumer,
                    host=host,
                    port=port,
                    tp_size=pc.tensor_parallel_size,
                    pp_size=pc.pipeline_parallel_size,
                    block_size=vllm_config.cache_config.block_size,
                    lease_seconds=lease,
                    head_splits=head_splits,
                    layer_splits=layer_splits,
                    stage_layers=stage_layers,
                    allowed_producers=allowed,
                    group_block_sizes=tuple(g.block_size for g in groups),
                    group_windows=tuple(g.sliding_window for g in groups),
                    group_states=tuple(g.state for g in groups),
                    # What packs a block beyond its shape (the CPU attention kernel's ISA).
                    group_kv_layouts=kv_layout_tags(vllm_config, kv_cache_config, groups),
                )
            )
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            from vllm.distributed.parallel_state import get_world_group

            tp_rank, pp_rank = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
            devices = rdma_devices_for(rdma_devices, get_world_group().local_rank)
            transport = KvferryTransport(
                TransportConfig(host=host, port=port, protocol=protocol, fail_closed=fail_closed,
                                load_failure_policy=ktc.kv_load_failure_policy, lease_seconds=lease,
                                load_timeout_seconds=timeout, connect_timeout_seconds=connect_timeout,
                                test_corrupt_transfer_prefix=corrupt, head_splits=head_splits,
                                layer_splits=layer_splits, rdma_devices=devices, secret_file=secret_file,
                                engine_ports=engine_ports),
                tp_rank=tp_rank, pp_rank=pp_rank, tp_size=pc.tensor_parallel_size,
                pp_size=pc.pipeline_parallel_size, block_size=vllm_config.cache_config.block_size,
                is_producer=ktc.is_kv_producer, is_consumer=ktc.is_kv_consumer,
                # Each layer's spec decides its layout (MLA's [B, 1, N, D] looks like a one-head cache).
                kv_cache_specs=layer_specs(kv_cache_config),
                # The layout vLLM resolved (KVCacheConfig.kv_cache_layout, else CacheConfig's): the
                # physical axis order of every layer's [B, H, N, C] view (notes §10).
                kv_cache_layout=getattr(kv_cache_config, "kv_cache_layout", None)
                or getattr(vllm_config.cache_config, "kv_cache_layout", None),
                stage_layers=stage_layers[pp_rank], kv_cache_groups=groups)
            self._worker = KvferryWorkerSide(
                tp_rank=tp_rank, pp_rank=pp_rank, load_timeout_seconds=transport.config.load_deadline_seconds(),
                transport=transport, report_blocks=len(groups) == 1,
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
