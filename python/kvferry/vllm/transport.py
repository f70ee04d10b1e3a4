"""kvferry's per-rank data path for the vLLM connector: :class:`kvferry.Producer` objects
(producer rank) and :class:`kvferry.Consumer` objects (consumer rank) per vLLM worker process,
over the rank's own KV cache tensors (docs/python-verified-loads.md, "Ranks and processes").

Units (docs/vllm-connector-notes.md §8): a *unit* is one ``kvferry.Producer`` holding a
contiguous run of layers and a contiguous run of global KV heads of one producer rank. A
producer rank with ``Hp`` local heads of a PP stage holding layers ``[a, b)`` serves them
through ``layer_splits = r`` layer units times ``head_splits = s`` head units; head unit ``j``
of layer unit ``k`` of rank ``(tp, pp)`` holds global heads ``[tp * Hp + j * Hp / s, tp * Hp +
(j + 1) * Hp / s)`` of the layers ``[a + k * n // r, a + (k + 1) * n // r)`` (``n = b - a``)
and listens on ``tcp://host:port + ((pp * tp_size + tp) * r + k) * s + j`` (``r = s = 1``: one
unit per rank, the rank's KV, port ``port + pp * tp_size + tp``).

Push flow: a consumer rank asks every unit whose layers and heads lie in its own to WRITE the
request's blocks into its own blocks (a :class:`kvferry.Consumer` over the matching layers and
head slice of its tensors per distinct pair); each unit replies FINISH with its checksum payload
(computed when the request was published); the consumer checksums the landed blocks of those
layers and heads with kvferry's kernels, compares, and applies the policy (fail-closed,
``kv_load_failure_policy``). kvferry's checksum is a sum over (layer, global KV head) slices
(docs/design.md §2.1), so each unit's load verifies on its own; the request counts as loaded only
when every unit's load completed. The consumer's head range and layer range must be unions of
whole units (else the load is refused, naming the ``head_splits`` or ``layer_splits`` the
producer needs); TP and PP sizes may differ.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable

import kvferry
from kvferry.outcomes import Action, Release, ReleaseReason, Verdict

from kvferry.vllm.groups import STATE_KIND, STATE_SKIP, GroupInfo, blocks_for
from kvferry.vllm.layouts import LayoutError, cpu_attention_isa, cpu_vec_parts, layer_layout, layer_view
from kvferry.vllm.metadata import LoadOrder, SendOrder
from kvferry.vllm.params import host_port, unit_port
from kvferry.vllm.units import (ConfigError, PairingError, Unit, common_heads, consumer_units, layer_number,
                                layer_units, producer_units)
from kvferry.vllm.worker import LoadResult

# Under vLLM's logger, so vLLM's logging configuration (format, level) applies.
log = logging.getLogger("vllm.kvferry")

# layouts.py holds the layout rules; these names stay importable from here.
__all__ = ["KvferryTransport", "LayoutError", "TransportConfig", "layer_view"]


@dataclass(frozen=True)
class TransportConfig:
    """One rank's transport settings (from ``kv_connector_extra_config``, see connector.py).

    ``host``: the address this rank's transfer engines and control sockets listen on and name to
    peers; ``port``: the side-channel base port (where each unit binds:
    :func:`kvferry.vllm.params.unit_port`);
    ``head_splits``: producer head units per rank (each over an equal run of the rank's KV heads;
    units.py); ``layer_splits``: producer layer units per rank (each over a contiguous run of its
    stage's layers; units.py), ``head_splits * layer_splits`` ``kvferry.Producer`` objects in all;
    ``protocol``:
    ``"auto"`` (default: RDMA when a usable device exists, else TCP; the choice is logged once
    per worker) | ``"tcp"`` | ``"rdma"``; ``fail_closed``: an unverifiable load fails;
    ``load_failure_policy``: vLLM's ``kv_load_failure_policy`` (``"fail"`` | ``"recompute"``,
    named in kvferry's logs); ``lease_seconds``: how long a producer holds published blocks;
    ``load_timeout_seconds``: how long a load waits for its producer (reply timeout and overall
    wait; :meth:`load_deadline_seconds` adds connecting and checksumming, and a producer's WRITEs
    for one load may take :meth:`transfer_timeout_seconds`); ``connect_timeout_seconds``:
    connecting to a producer; ``checksum_timeout_seconds``: one rank's checksums of a load;
    ``test_corrupt_transfer_prefix``: test-only fault injection, flips a bit of the first landed
    block of every unit load whose transfer id starts with it (None: off); ``rdma_devices``:
    the RDMA devices this rank's engines may use, comma-separated (``""``: any; see
    :func:`rdma_devices_for`); ``secret_file``: the shared secret's file, the same on every
    instance (16..4096 bytes): the rank's transfer engines authenticate (docs/design.md §8.1) and
    every load writes under a per-load grant (None: open engines, trusted networks only);
    ``engine_ports``: ``"LO-HI"``, the range this rank's transfer engines take their listening
    ports from, the lowest free ones (two per engine over TCP: handshake and data; one over
    RDMA); None: ports the OS picks (ephemeral)."""

    host: str
    port: int
    protocol: str = "auto"
    fail_closed: bool = True
    load_failure_policy: str = "fail"
    lease_seconds: float = 30.0
    load_timeout_seconds: float = 30.0
    connect_timeout_seconds: float = 5.0
    checksum_timeout_seconds: float = 30.0
    test_corrupt_transfer_prefix: str | None = None
    head_splits: int = 1
    layer_splits: int = 1
    rdma_devices: str = ""
    secret_file: str | None = None
    engine_ports: str | None = None

    def load_deadline_seconds(self) -> float:
        """The longest one load of this rank may take, from the call to its verdict: kvferry's
        own rule (``kvferry.Consumer.load_deadline_for``) over the consumers this rank builds."""
        return kvferry.Consumer.load_deadline_for(
            reply_timeout=self.load_timeout_seconds, max_wait=self.load_timeout_seconds,
            checksum_timeout=self.checksum_timeout_seconds, connect_timeout=self.connect_timeout_seconds)

    def transfer_timeout_seconds(self) -> float:
        """How long a producer unit's WRITEs for one load may take: half the load timeout. A
        consumer's budget must leave the producer its whole transfer time (kvferry's p2p refuses
        a budget below it): half leaves room on any load timeout, so equal configs pair."""
        return self.load_timeout_seconds / 2


def rdma_devices_for(value: Any, local_rank: int) -> str:
    """The RDMA devices one worker's engines may use, from ``kv_connector_extra_config``'s
    ``rdma_devices``: a string (``"mlx5_0,mlx5_1"``, every worker of the host the same list; ``""``:
    every device, kvferry picks) or a list with one string per worker of the host, indexed by
    the worker's local rank (``["mlx5_0", "mlx5_1", ...]``: each GPU's own NIC, as Mooncake's
    per-GPU topology does). Raises :class:`~kvferry.vllm.units.ConfigError` for another type or
    a list without an entry for ``local_rank``."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        if 0 <= local_rank < len(value):
            return value[local_rank]
        raise ConfigError(f"kv_connector_extra_config['rdma_devices'] has {len(value)} entries; this worker's "
                          f"local rank is {local_rank}: give one device list per worker of the host")
    raise ConfigError(f"kv_connector_extra_config['rdma_devices'] = {value!r}: expected a string of "
                      "comma-separated device names or a list of them, one per worker of the host")


# The keys of the loads' stats (:meth:`KvferryTransport.take_stats`, kvferry.vllm.stats).
STATS_KEYS = ("transfer_duration", "bytes_transferred", "checksum_duration", "num_verified", "num_mismatch",
              "num_unverified", "num_failed_transfers", "num_recomputed")


class KvferryTransport:
    """One rank's :class:`~kvferry.vllm.worker.RankTransport` over kvferry's p2p layer.

    Built per worker process; :meth:`register` (from ``register_kv_caches``) starts the rank's
    producer units (``config.layer_splits * config.head_splits`` Producers) and/or its
    whole-rank Consumer over its tensors; a load that needs other layers or head slices builds
    their Consumers on first use. Each layer's layout and kind come from
    :func:`kvferry.vllm.layouts.layer_layout`, by its spec in ``kv_cache_specs`` (layer name ->
    vLLM KV cache spec, :func:`kvferry.vllm.layouts.layer_specs`; a layer without one: by the
    tensor's shape where unambiguous) and vLLM's resolved ``kv_cache_layout`` name (physical
    axis order; None where unknown). ``stage_layers``: the layer numbers ``[start, end)`` of
    this rank's PP stage (vLLM's ``get_pp_indices``; None: from its layers' numbers, lowest to
    highest). ``kv_cache_groups``: vLLM's KV cache groups the connector moves
    (:func:`kvferry.vllm.groups.kv_cache_groups`; None: one full-attention group of every layer
    at ``block_size``); each becomes a kvferry group of the same id, with its block size and
    sliding window. Errors: :class:`LayoutError` for an unknown tensor layout;
    :class:`~kvferry.vllm.units.ConfigError` for a ``head_splits`` that does not fit the rank's
    KV heads, a ``layer_splits`` that does not fit its stage's layers, or a layer in no KV
    cache group; kvferry's
    ValueError/RuntimeError when an engine cannot start."""

    # Seconds past a load's deadline to wait for its unit loads to return (each has the
    # deadline as its own timeout; this covers checksumming and scheduling the threads).
    UNIT_JOIN_GRACE_SECONDS = 10.0

    def __init__(self, config: TransportConfig, *, tp_rank: int, pp_rank: int, tp_size: int, pp_size: int,
                 block_size: int, is_producer: bool, is_consumer: bool,
                 kv_cache_specs: dict[str, Any] | None = None, kv_cache_layout: str | None = None,
                 stage_layers: tuple[int, int] | None = None, kv_cache_groups: list[GroupInfo] | None = None):
        self.config = config
        self.tp_rank, self.pp_rank = tp_rank, pp_rank
        self.tp_size, self.pp_size = tp_size, pp_size
        self.block_size = block_size
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.stage_layers = stage_layers
        self.groups = list(kv_cache_groups or [GroupInfo(0, (), block_size)])
        # layer name -> its group (a group without names takes every layer: one group)
        self._group_of = {name: g for g in self.groups for name in g.layer_names}
        # Producer units, head unit j of layer unit k at index k * head_splits + j.
        self.producers: list[Any] = []
        # Consumers by (layers, heads): the layer numbers and global KV heads [start, end) they
        # cover (None: all of the rank's; (None, None) is the whole-rank Consumer).
        self.consumers: dict[tuple[tuple[int, int] | None, tuple[int, int] | None], Any] = {}
        # layer name -> (view, layout, dtype text)
        self._views: dict[str, tuple[Any, str, str]] = {}
        self.kv_cache_specs = dict(kv_cache_specs or {})
        # vLLM's resolved KVCacheLayout name (e.g. "LBNHC"), None where unknown (layouts.py)
        self.kv_cache_layout = kv_cache_layout
        # layer name -> cache kind of the layer fingerprint (e.g. "MLAAttentionSpec")
        self._kinds: dict[str, str] = {}
        # layer name -> kvferry's layer number (None: the name has none)
        self._numbers: dict[str, int | None] = {}
        self.local_heads: int | None = None
        # The CPU attention kernel whose block layout is not token-addressable here (vLLM's CPU
        # kernels other than "vec" pack each block their own way): only whole blocks move, so
        # a load between different block sizes is refused. None: every block is described.
        self.packed_isa: str | None = None
        # transfer id -> [vLLM request id, units not yet released, first reason not served]
        self._published: dict[str, list] = {}
        self._released_ready: list[tuple[str, ReleaseReason]] = []
        self._lock = threading.Lock()
        self._stats: dict[str, list] = {k: [] for k in STATS_KEYS}
        self._stats_lock = threading.Lock()
        self._consumers_lock = threading.Lock()
        self._publish_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvferry-publish")
        self._unit_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvferry-unit-load")

    def unit_port(self, unit: int = 0, layer_unit: int = 0) -> int:
        """This rank's control port of its producer head unit ``unit`` of layer unit ``layer_unit``."""
        c = self.config
        return unit_port(c.port, self.tp_rank, self.pp_rank, self.tp_size, c.head_splits, unit, c.layer_splits,
                         layer_unit)

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Describes the rank's layers to kvferry and starts its producer units and/or its
        whole-rank Consumer."""
        heads = []
        for name, t in kv_caches.items():
            group = self._group_of.get(name)
            if group is None:
                if len(self.groups) > 1 or self.groups[0].layer_names:
                    raise ConfigError(f"KV cache layer {name!r} is in none of vLLM's KV cache groups")
                group = self._group_of[name] = self.groups[0]
            if group.state:
                if self.config.head_splits > 1:
                    raise ConfigError(f"kv_connector_extra_config['head_splits'] = {self.config.head_splits}: layer "
                                      f"{name!r} holds Mamba-type state, which is not split by KV heads")
                for part, v in state_parts(name, t):
                    self._views[part] = (v, "B N D", str(v.dtype))
                    self._kinds[part] = STATE_KIND
                    self._numbers[part] = layer_number(name)
                    self._group_of[part] = group
                continue
            lay = layer_layout(t, group.block_size, self.kv_cache_specs.get(name), self.kv_cache_layout)
            view, layout = lay.view, lay.layout
            parts = [(name, view, layout)]
            if t.device.type == "cpu" and layout == "B H KV N D":
                isa = cpu_attention_isa(t.dtype, group.block_size, view.shape[-1])
                if isa == "vec":
                    # Each part a kvferry layer of its own (its own axis order, layouts.py).
                    parts = [(f"{name}.{suffix}", v, lay_) for suffix, v, lay_ in cpu_vec_parts(view)]
                elif isa is not None:
                    self.packed_isa = isa
            for part, v, lay_ in parts:
                self._views[part] = (v, lay_, str(t.dtype))
                self._kinds[part] = lay.kind
                self._numbers[part] = layer_number(name)
                self._group_of[part] = group
            axes = layout.split()
            heads.append(view.shape[axes.index("H")] if "H" in axes else None)
        self.local_heads = common_heads(heads)
        numbered = [n for n in self._numbers.values() if n is not None]
        if self.stage_layers is None and numbered:
            self.stage_layers = (min(numbered), max(numbered) + 1)
        c = self.config
        if self.is_producer:
            head_units = producer_units(self.tp_rank, self.local_heads, c.head_splits)
            for k, unit_layers in enumerate(self._producer_layer_units()):
                for j, unit_heads in enumerate(head_units):
                    producer = kvferry.Producer(
                        [self._rank(unit_heads, unit_layers)], bind="tcp://" + host_port(c.host, self.unit_port(j, k)),
                        host=c.host, protocol=c.protocol, rdma_devices=c.rdma_devices,
                        lease=c.lease_seconds, transfer_timeout=c.transfer_timeout_seconds(),
                        secret_file=c.secret_file, engine_ports=c.engine_ports)
                    self.producers.append(producer)
                    log.info("kvferry producer rank tp=%d pp=%d serves on %s (%s)%s", self.tp_rank, self.pp_rank,
                             producer.endpoint, producer.transport, _unit_text(unit_heads, unit_layers))
        if self.is_consumer:
            self._consumer(None, None)
        self.transport = self._log_transport()

    def _log_transport(self) -> str:
        """Logs, once per worker (``register`` runs once), which transport ``protocol`` gave this
        rank's engines, and returns it (``"tcp"``, ``"rdma"``, or both joined by ``"+"``). With
        ``auto`` and GPU KV, ``tcp`` means the KV goes through pinned host buffers."""
        engines = [*self.producers, *self.consumers.values()]
        chosen = "+".join(sorted({e.transport for e in engines})) or "none"
        why = ""
        if self.config.protocol == "auto" and chosen == "tcp":
            why = " (no usable RDMA device or a build without RDMA; kvferry's log says which)"
        devices = f", RDMA devices {self.config.rdma_devices}" if self.config.rdma_devices else ""
        # Which trust applies, so an operator can tell from the log that the secret was taken up.
        mode = "secret mode (peers prove the shared secret)" if self.config.secret_file else "open mode"
        log.info("kvferry rank tp=%d pp=%d: protocol %r -> transport %s%s%s, %s", self.tp_rank, self.pp_rank,
                 self.config.protocol, chosen, devices, why, mode)
        return chosen

    def _producer_layer_units(self) -> list[tuple[int, int] | None]:
        """The layer numbers ``[start, end)`` of each of this producer rank's layer units;
        ``[None]`` (all of the rank's layers) with ``layer_splits`` 1. Raises
        :class:`~kvferry.vllm.units.ConfigError` when ``layer_splits`` does not fit the stage or
        some of the rank's layers would be in no unit (no layer number, or outside the stage)."""
        r = self.config.layer_splits
        if r == 1:
            return [None]
        if self.stage_layers is None:
            raise ConfigError(f"kv_connector_extra_config['layer_splits'] = {r}: this rank's layers have no "
                              "layer numbers to split")
        units = layer_units(self.stage_layers, r)
        a, b = self.stage_layers
        outside = sorted(name for name, n in self._numbers.items() if n is None or not a <= n < b)
        if outside:
            raise ConfigError(f"kv_connector_extra_config['layer_splits'] = {r}: layers {outside} have no layer "
                              f"number in this PP stage's [{a}, {b}) and would be in no layer unit")
        for lo, hi in units:
            if not any(lo <= n < hi for n in self._numbers.values() if n is not None):
                raise ConfigError(f"kv_connector_extra_config['layer_splits'] = {r}: layer unit [{lo}, {hi}) "
                                  "holds none of this rank's KV cache layers")
        return units

    def _layers(self, heads: tuple[int, int] | None,
                layers: tuple[int, int] | None = None) -> list[tuple[str, Any, str, int, str]]:
        """``(name, view, layout, head_offset, dtype)`` of every layer whose number lies in
        ``layers`` (None: every layer), each view narrowed to the global KV heads ``heads``
        (None: all of the rank's; a layer without an H axis whole)."""
        out = []
        for name, (view, layout, dtype) in self._views.items():
            n = self._numbers[name]
            if layers is not None and (n is None or not layers[0] <= n < layers[1]):
                continue
            axes = layout.split()
            if "H" not in axes:
                # No head axis (MLA): never split (units.py); its head offset is 0.
                out.append((name, view, layout, 0, dtype))
                continue
            h = axes.index("H")
            offset = self.tp_rank * view.shape[h]
            if heads is not None:
                view, offset = view.narrow(h, heads[0] - offset, heads[1] - heads[0]), heads[0]
            out.append((name, view, layout, offset, dtype))
        return out

    def _rank(self, heads: tuple[int, int] | None, layers: tuple[int, int] | None = None) -> Any:
        """A ``kvferry.Rank`` over this rank's layers in ``layers`` narrowed to ``heads`` (see
        :meth:`_layers`): one kvferry group per KV cache group holding some of them, with the
        group's id and sliding window."""
        by_group: dict[int, list] = {}
        for name, view, layout, offset, dtype in self._layers(heads, layers):
            by_group.setdefault(self._group_of[name].group_id, []).append(
                kvferry.KVCacheLayer(name, view, layout, head_offset=offset, kind=self._kinds[name], dtype=dtype))
        return kvferry.Rank([
            kvferry.KVCacheGroup(g.group_id, by_group[g.group_id], skipped=STATE_SKIP, block_size=g.block_size)
            if g.state else kvferry.KVCacheGroup(g.group_id, by_group[g.group_id], sliding_window=g.sliding_window)
            for g in self.groups if g.group_id in by_group])

    def _group_ids(self, heads: tuple[int, int] | None, layers: tuple[int, int] | None) -> set[int]:
        """The KV cache groups holding some of the layers of :meth:`_rank` ``(heads, layers)``."""
        return {self._group_of[name].group_id for name, *_ in self._layers(heads, layers)}

    def _consumer(self, heads: tuple[int, int] | None, layers: tuple[int, int] | None = None) -> Any:
        """The Consumer over the layers ``layers`` and global KV heads ``heads`` (None, None:
        the whole rank), built on first use. Raises what ``kvferry.Consumer`` raises."""
        with self._consumers_lock:
            consumer = self.consumers.get((layers, heads))
            if consumer is not None:
                return consumer
            c = self.config
            consumer = kvferry.Consumer(
                [self._rank(heads, layers)], host=c.host, protocol=c.protocol, rdma_devices=c.rdma_devices,
                fail_closed=c.fail_closed,
                load_failure_policy=c.load_failure_policy, reply_timeout=c.load_timeout_seconds,
                max_wait=c.load_timeout_seconds, connect_timeout=c.connect_timeout_seconds,
                checksum_timeout=c.checksum_timeout_seconds, secret_file=c.secret_file, engine_ports=c.engine_ports)
            if c.test_corrupt_transfer_prefix is not None:
                # The first layer of each group: a landed block is flipped in its own group's layer.
                first: dict[int, tuple[Any, str]] = {}
                for name, view, layout, _, _ in self._layers(heads, layers):
                    if self._group_of[name].state:
                        continue  # not checksummed (skipped on both sides): a flip there is not caught
                    first.setdefault(self._group_of[name].group_id, (view, layout))
                consumer.set_landed_hook(self._corrupt_hook(c.test_corrupt_transfer_prefix, first))
                log.warning("kvferry TEST HOOK on: loads of transfers %r* get a landed bit flipped%s",
                            c.test_corrupt_transfer_prefix, _unit_text(heads, layers))
            self.consumers[(layers, heads)] = consumer
            return consumer

    @staticmethod
    def _corrupt_hook(prefix: str, first: dict[int, tuple[Any, str]]) -> Callable[[dict], None]:
        """Flips a bit of the last landed block of every group with landed blocks, in that
        group's first layer (``first``: group id -> (view, layout)): the last block is checksummed
        in every group (a sliding window's clip keeps it), so each group's flip is caught."""
        import torch

        words = {g: (view.view(torch.int32) if view.element_size() == 4 else view.view(torch.int16), layout)
                 for g, (view, layout) in first.items()}

        def hook(landed: dict) -> None:
            if not landed["request_id"].startswith(prefix):
                return
            for g in landed["groups"]:
                if not g["local_blocks"] or g["group_id"] not in words:
                    continue
                b = g["local_blocks"][-1]
                word, layout = words[g["group_id"]]
                # Element 0 of every axis but B (K, the view's first head, the block's first
                # token) of the last landed block of the group's first layer.
                word[tuple(b if axis == "B" else 0 for axis in layout.split())] ^= 0x100
                if word.is_cuda:
                    torch.cuda.synchronize(word.device)
                log.warning("kvferry TEST HOOK: flipped a bit of landed block %d of transfer %s (group %d)",
                            b, landed["request_id"], g["group_id"])

        return hook

    def serve(self, send: SendOrder, on_publish: Callable[[], bool] | None = None) -> None:
        """Publishes a finished prompt's blocks through every unit (checksummed now, off the
        forward path). ``on_publish``: called on the publish thread first; False drops the send
        unpublished (the worker freed its blocks meanwhile)."""
        if not self.producers:
            log.error("kvferry: request %s asks to be served but this rank has no producer", send.request_id)
            return
        with self._lock:
            self._published[send.transfer_id] = [send.request_id, len(self.producers), ReleaseReason(Release.SERVED)]
        self._publish_pool.submit(self._publish, send, on_publish)

    def _publish(self, send: SendOrder, on_publish: Callable[[], bool] | None = None) -> None:
        if on_publish is not None and not on_publish():
            log.warning("kvferry: request %s (transfer %s) was freed before its publish; not published",
                        send.request_id, send.transfer_id)
            with self._lock:
                self._published.pop(send.transfer_id, None)
            return
        for j, producer in enumerate(self.producers):
            try:
                info = producer.publish(send.transfer_id, [list(g) for g in send.block_ids], send.num_tokens,
                                        load_key=send.load_key)
            except Exception as e:  # this unit will never release it: count it released now
                log.error("kvferry: publishing request %s (transfer %s) on unit %d failed: %s",
                          send.request_id, send.transfer_id, j, e)
                self._unit_released(send.transfer_id, ReleaseReason.failed(f"publish on unit {j}: {e}"))
                continue
            if info.warning:
                log.warning("kvferry: transfer %s published without checksums on unit %d: %s",
                            send.transfer_id, j, info.warning)

    def _unit_released(self, transfer_id: str, reason: ReleaseReason) -> None:
        """Counts one unit's release of ``transfer_id``; queues ``(request id, reason)`` for
        :meth:`released` once every unit released it (reason :attr:`Release.SERVED` when all
        were served, else the first other reason)."""
        with self._lock:
            entry = self._published.get(transfer_id)
            if entry is None:
                return
            entry[1] -= 1
            if reason.kind is not Release.SERVED and entry[2].kind is Release.SERVED:
                entry[2] = reason
            if entry[1] > 0:
                return
            del self._published[transfer_id]
            self._released_ready.append((entry[0], entry[2]))

    def released(self) -> list[tuple[str, ReleaseReason]]:
        """``(vLLM request id, reason)`` of the sends every unit released since the last call
        (the first reason not served of any unit): their blocks may be freed."""
        for producer in self.producers:
            for transfer_id, reason in producer.released():
                self._unit_released(transfer_id, reason)
        with self._lock:
            out, self._released_ready = self._released_ready, []
        return out

    def load(self, spec: LoadOrder, deadline: float) -> LoadResult:
        """Loads and verifies one request's KV of this rank from every producer unit that holds
        some of its layers and KV heads (concurrently, one deadline); blocks until all returned
        or ``deadline``. ``ok`` only when every unit's load completed; else the first failing
        unit's verdict and reason. A producer whose units do not tile this rank's layers and
        heads is refused as unverified before any transfer (the reason says what to set)."""
        if (None, None) not in self.consumers:  # register() builds the whole-rank Consumer of a consumer rank
            return LoadResult(ok=False, verdict=Verdict.UNVERIFIED, reason="this rank has no consumer")
        src = spec.source
        try:
            units = consumer_units(tp_rank=self.tp_rank, tp_size=self.tp_size, pp_size=self.pp_size,
                                   local_heads=self.local_heads, producer_tp_size=src.tp_size,
                                   producer_pp_size=src.pp_size, producer_head_splits=src.head_splits,
                                   pp_rank=self.pp_rank, stage_layers=self.stage_layers,
                                   layer_numbers=self._numbers.values(), producer_stage_layers=src.stage_layers,
                                   producer_layer_splits=src.layer_splits)
        except PairingError as e:
            return LoadResult(ok=False, verdict=Verdict.UNVERIFIED, reason=str(e))
        remote, local, sizes = [], [], []
        if src.tp_size != self.tp_size and any(g.state for g in self.groups):
            return LoadResult(ok=False, verdict=Verdict.UNVERIFIED,
                              reason=f"the producer runs TP {src.tp_size}, this instance TP {self.tp_size}: Mamba-type "
                                     "state is split across TP ranks by its own projections, not by KV heads, so it "
                                     "moves only between equal TP sizes")
        if self.packed_isa is not None and src.block_sizes is not None and any(
                r != g.block_size for r, g in zip(src.block_sizes, self.groups)):
            return LoadResult(ok=False, verdict=Verdict.UNVERIFIED,
                              reason=f"the producer's block sizes {list(src.block_sizes)} differ from this rank's "
                                     f"{[g.block_size for g in self.groups]}, and vLLM's CPU attention kernel "
                                     f"{self.packed_isa!r} packs each block its own way: only whole blocks move")
        if len(spec.block_ids) != len(self.groups):
            return LoadResult(ok=False, verdict=Verdict.UNVERIFIED,
                              reason=f"{len(spec.block_ids)} block tables for {len(self.groups)} KV cache groups")
        for g, (group, blocks) in enumerate(zip(self.groups, spec.block_ids)):
            n = blocks_for(spec.num_tokens, group.block_size)
            table: list[int | None] = (list(blocks) + [None] * n)[:n]
            rbs = src.block_sizes[g] if src.block_sizes is not None and g < len(src.block_sizes) else group.block_size
            rn = blocks_for(spec.num_tokens, rbs)
            rtable = list(src.remote_block_ids[g])[:rn] if g < len(src.remote_block_ids) else []
            if len(rtable) < rn:
                return LoadResult(ok=False, verdict=Verdict.UNVERIFIED,
                                  reason=f"producer's block table of group {g} covers {len(rtable)} blocks of "
                                         f"{rbs} tokens, the prompt needs {rn}")
            remote.append(rtable)
            local.append(table)
            sizes.append(rbs)
        if len(units) == 1:
            results = [self._load_unit(spec, units[0], remote, local, sizes, deadline)]
        else:
            futures = [self._unit_pool.submit(self._load_unit, spec, u, remote, local, sizes, deadline)
                       for u in units]
            wait(futures, timeout=max(deadline - time.monotonic(), 0.0) + self.UNIT_JOIN_GRACE_SECONDS)
            results = [f.result() if f.done() else
                       LoadResult(ok=False, verdict=Verdict.UNVERIFIED, reason="the load did not return by its deadline")
                       for f in futures]
        for unit, result in zip(units, results):
            if not result.ok:
                where = f"{_unit_text(unit.heads, unit.layers).strip()}: " if len(units) > 1 else ""
                return LoadResult(ok=False, verdict=result.verdict, reason=where + result.reason)
        return LoadResult(ok=True, verdict=results[0].verdict)

    def _load_unit(self, spec: LoadOrder, unit: Unit, remote: list, local: list, sizes: list,
                   deadline: float) -> LoadResult:
        """One unit's load (on the calling thread); never raises. ``remote`` / ``local``: each
        group's tables, ``sizes`` the producer's block size of each group; a group none of the
        unit's layers belongs to is not loaded through it (empty tables)."""
        src = spec.source
        endpoint = "tcp://" + host_port(src.host, src.unit_port(unit.tp_rank, unit.stage, unit.unit, unit.layer_unit))
        try:
            consumer = self._consumer(unit.heads, unit.layers)
            mine = self._group_ids(unit.heads, unit.layers)
            keep = [g.group_id in mine for g in self.groups]
            out = consumer.load(src.transfer_id, endpoint, [t if k else [] for t, k in zip(remote, keep)],
                                [t if k else [] for t, k in zip(local, keep)], spec.num_tokens,
                                num_local_computed=spec.num_local_computed,
                                timeout=max(deadline - time.monotonic(), 0.001), load_key=src.load_key,
                                remote_block_sizes=sizes)
        except Exception as e:  # a bad spec or an engine that cannot start: this unit failed
            self._record(None)
            return LoadResult(ok=False, verdict=Verdict.UNVERIFIED, reason=f"load from {endpoint} raised {e!r}")
        self._record(out)
        status = Verdict(out.verdict.status) if out.verdict is not None else Verdict.UNVERIFIED
        if not out.landed:
            return LoadResult(ok=False, verdict=status, reason=f"did not land: {out.error}")
        if out.action != Action.COMPLETE:
            return LoadResult(ok=False, verdict=status, reason=f"kvferry policy says {out.action} (verdict: {out.verdict})")
        log.info("kvferry: load of request %s (transfer %s) %s: %d bytes, transfer %.4f s, checksum %.4f s%s",
                 spec.request_id, src.transfer_id, status, out.bytes, out.transfer_seconds, out.checksum_seconds,
                 _unit_text(unit.heads, unit.layers, f" from {endpoint}"))
        return LoadResult(ok=True, verdict=status)

    def _record(self, out: Any) -> None:
        """Counts one unit load (None: it raised) in the stats vLLM collects (kvferry.vllm.stats)."""
        with self._stats_lock:
            d = self._stats
            if out is None or not out.landed:
                d["num_failed_transfers"].append(1)
                return
            d["transfer_duration"].append(out.transfer_seconds)
            d["bytes_transferred"].append(out.bytes)
            if out.verdict is not None:
                d["checksum_duration"].append(out.checksum_seconds)
                key = {Verdict.VERIFIED: "num_verified", Verdict.MISMATCH: "num_mismatch"}.get(out.verdict.status, "num_unverified")
                d[key].append(1)
            if out.action == Action.RECOMPUTE:
                d["num_recomputed"].append(1)

    def record_refused(self) -> None:
        """Counts a load refused before any transfer (the scheduler's refusal: another KV cache
        layout) as unverified in the stats vLLM collects: it never landed, nothing was compared."""
        with self._stats_lock:
            self._stats["num_unverified"].append(1)

    def take_stats(self) -> dict[str, list] | None:
        """The loads' stats since the last call (see kvferry.vllm.stats), None when there were none."""
        with self._stats_lock:
            if not any(self._stats.values()):
                return None
            out, self._stats = self._stats, {k: [] for k in STATS_KEYS}
        return out

    def shutdown(self) -> None:
        """Stops the publish thread (waits for a publish in flight), then the producer units;
        drops the Consumers (their engines stop with them)."""
        # kvferry.Producer.shutdown waits for its lock with the GIL held while a publish on
        # another thread holds that lock and needs the GIL to return: never overlap them.
        self._publish_pool.shutdown(wait=True, cancel_futures=True)
        self._unit_pool.shutdown(wait=False, cancel_futures=True)
        for j, producer in enumerate(self.producers):
            try:
                producer.shutdown()
            except Exception as e:  # shutting down: nothing left to protect
                log.warning("kvferry: producer unit %d shutdown: %s", j, e)
        with self._consumers_lock:
            self.consumers.clear()


def state_parts(name: str, state: Any) -> list[tuple[str, Any]]:
    """``(part name, view)`` of each state tensor of one Mamba-type layer (vLLM hands such a
    layer a list of tensors, e.g. Mamba2's conv and SSM state, each ``[B, *shape]`` inside the
    layer's page): part ``i`` as ``"<name>.state<i>"``, viewed ``[B, 1, S]`` (``"B N D"``: one
    state per block, ``S`` elements, the same memory). Raises
    :class:`~kvferry.vllm.layouts.LayoutError` where a state tensor's block is not contiguous
    (it could not be described as one run per block)."""
    tensors = list(state) if isinstance(state, (list, tuple)) else [state]
    out = []
    for i, t in enumerate(tensors):
        try:
            v = t.view(t.shape[0], 1, -1)
        except RuntimeError:
            raise LayoutError(f"Mamba-type state tensor {i} of layer {name!r}, shape {tuple(t.shape)}, strides "
                              f"{tuple(t.stride())}: a block's state is not contiguous") from None
        out.append((f"{name}.state{i}", v))
    return out


def _unit_text(heads: tuple[int, int] | None, layers: tuple[int, int] | None, suffix: str = "") -> str:
    """`` (layers [a, b), KV heads [c, d)<suffix>)`` for a unit of some layers and/or heads
    (each part only when not the whole rank's), ``""`` for a whole rank."""
    parts = ([] if layers is None else [f"layers [{layers[0]}, {layers[1]})"]) + \
        ([] if heads is None else [f"KV heads [{heads[0]}, {heads[1]})"])
    return f" ({', '.join(parts)}{suffix})" if parts else ""
