"""The connector's settings, read once from ``vllm_config`` and checked (:class:`ConnectorConfig`),
with the rules that derive ports and deadlines from them. The keys of
``kv_connector_extra_config`` are described in :mod:`kvferry.vllm.connector`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvferry.vllm import params as P
from kvferry.vllm.groups import GroupInfo, kv_cache_groups
from kvferry.vllm.scheduler import SchedulerConfig
from kvferry.vllm.transport import TransportConfig, rdma_devices_for
from kvferry.vllm.units import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

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


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the connector reads from ``vllm_config``, checked once
    (:meth:`from_vllm_config`); the scheduler side and every worker take their settings from it
    (:meth:`scheduler_config`, :meth:`transport_config`; a worker's load deadline and its
    producers' transfer timeout are methods of the latter, over kvferry's own rule).

    ``base_port``: the extra config's ``port``; ``dp_rank``: this data-parallel engine (its
    ports: :attr:`port`); ``stage_layers``: every PP stage's layer numbers ``[start, end)``
    (vLLM's ``get_pp_indices``); ``groups``: the KV cache groups the connector moves
    (:func:`~kvferry.vllm.groups.kv_cache_groups`); ``rdma_devices``: the extra config's value,
    resolved per worker (:meth:`transport_config`); ``allowed_producers``: the consumer's
    producer policy (:func:`~kvferry.vllm.params.producer_policy`); the rest as their extra
    config keys (seconds for the ``*_seconds``)."""

    engine_id: str
    is_producer: bool
    is_consumer: bool
    load_failure_policy: str
    host: str
    base_port: int
    dp_rank: int
    tp_size: int
    pp_size: int
    block_size: int
    stage_layers: tuple[tuple[int, int], ...]
    groups: tuple[GroupInfo, ...]
    protocol: str = DEFAULT_PROTOCOL
    fail_closed: bool = True
    lease_seconds: float = 30.0
    load_timeout_seconds: float = 30.0
    connect_timeout_seconds: float = 5.0
    head_splits: int = 1
    layer_splits: int = 1
    rdma_devices: Any = None
    test_corrupt_transfer_prefix: str | None = None
    engine_ports: str | None = None
    secret_file: str | None = None
    allowed_producers: P.ProducerAllowlist | P.LoopbackOnly | None = None

    @classmethod
    def from_vllm_config(cls, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> "ConnectorConfig":
        """Reads and checks ``kv_transfer_config`` (with its extra config), the parallel and cache
        configs and the KV cache groups. ``host`` defaults to vLLM's ``get_ip()``. Raises
        :class:`~kvferry.vllm.units.ConfigError` for a bad value (naming its key) or a group the
        connector cannot move."""
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
        corrupt = extra.get("test_corrupt_transfer_prefix")
        if corrupt is not None and not isinstance(corrupt, str):
            raise ConfigError(f"kv_connector_extra_config['test_corrupt_transfer_prefix'] = {corrupt!r}: expected str")
        engine_ports = extra.get("engine_ports")
        if engine_ports is not None:
            engine_ports = port_range(engine_ports)
        secret_file = extra.get("secret_file")
        if secret_file is not None and (not isinstance(secret_file, str) or not secret_file):
            raise ConfigError(f"kv_connector_extra_config['secret_file'] = {secret_file!r}: expected a file path")
        try:
            allowed = P.producer_policy(extra.get("allowed_producers"), secret_file)
        except ValueError as e:
            raise ConfigError(f"kv_connector_extra_config['allowed_producers']: {e}") from None
        host = extra.get("host")
        if host is None:
            from vllm.utils.network_utils import get_ip

            host = get_ip()
        if not isinstance(host, str) or not host:
            raise ConfigError(f"kv_connector_extra_config['host'] = {host!r}: expected a host name or address")
        pc = vllm_config.parallel_config
        # data_parallel_index keeps the DP rank where vLLM resets data_parallel_rank to 0
        # (independent dense-model DP engines).
        dp_rank = getattr(pc, "data_parallel_index", None)
        # Every PP stage's layer numbers [start, end), as vLLM's model partitions them (honours
        # VLLM_PP_LAYER_PARTITION); the producer sends them, a consumer stage pairs by them.
        from vllm.distributed.utils import get_pp_indices

        num_layers = vllm_config.model_config.get_total_num_hidden_layers()
        stage_layers = tuple(get_pp_indices(num_layers, r, pc.pipeline_parallel_size)
                             for r in range(pc.pipeline_parallel_size))
        config = cls(
            engine_id=str(ktc.engine_id), is_producer=ktc.is_kv_producer, is_consumer=ktc.is_kv_consumer,
            load_failure_policy=ktc.kv_load_failure_policy, host=host, base_port=port,
            dp_rank=pc.data_parallel_rank if dp_rank is None else dp_rank, tp_size=pc.tensor_parallel_size,
            pp_size=pc.pipeline_parallel_size, block_size=vllm_config.cache_config.block_size,
            stage_layers=stage_layers, groups=tuple(groups), protocol=protocol, fail_closed=fail_closed,
            lease_seconds=lease, load_timeout_seconds=timeout, connect_timeout_seconds=connect_timeout,
            head_splits=head_splits, layer_splits=layer_splits, rdma_devices=extra.get("rdma_devices"),
            test_corrupt_transfer_prefix=corrupt, engine_ports=engine_ports, secret_file=secret_file,
            allowed_producers=allowed)
        config.port  # noqa: B018 -- the engine's ports must fit: ConfigError now, not at first use
        return config

    @property
    def port(self) -> int:
        """This data-parallel engine's side-channel base port (:func:`engine_port`)."""
        return engine_port(self.base_port, self.dp_rank, self.tp_size, self.pp_size, self.head_splits,
                           self.layer_splits)

    def scheduler_config(self, group_kv_layouts: tuple[str | None, ...] = ()) -> SchedulerConfig:
        """The scheduler side's settings; ``group_kv_layouts``: each group's layout tag
        (:func:`~kvferry.vllm.layouts.kv_layout_tags`), named in the producer's reply."""
        return SchedulerConfig(
            engine_id=self.engine_id, is_producer=self.is_producer, is_consumer=self.is_consumer, host=self.host,
            port=self.port, tp_size=self.tp_size, pp_size=self.pp_size, block_size=self.block_size,
            lease_seconds=self.lease_seconds, head_splits=self.head_splits, layer_splits=self.layer_splits,
            stage_layers=self.stage_layers, allowed_producers=self.allowed_producers,
            group_block_sizes=tuple(g.block_size for g in self.groups),
            group_windows=tuple(g.sliding_window for g in self.groups),
            group_states=tuple(g.state for g in self.groups), group_kv_layouts=group_kv_layouts)

    def transport_config(self, local_rank: int) -> TransportConfig:
        """The settings of the worker of local rank ``local_rank`` (its RDMA devices:
        :func:`~kvferry.vllm.transport.rdma_devices_for`). Its ``load_deadline_seconds()`` is the
        worker's deadline of a load, its ``transfer_timeout_seconds()`` its producers'."""
        return TransportConfig(
            host=self.host, port=self.port, protocol=self.protocol, fail_closed=self.fail_closed,
            load_failure_policy=self.load_failure_policy, lease_seconds=self.lease_seconds,
            load_timeout_seconds=self.load_timeout_seconds, connect_timeout_seconds=self.connect_timeout_seconds,
            test_corrupt_transfer_prefix=self.test_corrupt_transfer_prefix, head_splits=self.head_splits,
            layer_splits=self.layer_splits, rdma_devices=rdma_devices_for(self.rdma_devices, local_rank),
            secret_file=self.secret_file, engine_ports=self.engine_ports)
