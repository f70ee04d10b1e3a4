"""`kv_transfer_params` of kvferry's vLLM connector: the keys a request carries between the proxy,
the producer (prefill) instance and the consumer (decode) instance.

The keys follow vLLM's P2P connectors (NIXL, Mooncake in vLLM 0.32/0.33,
`vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py`):

- proxy -> producer: ``{"do_remote_decode": True, "transfer_id": str}`` (``max_tokens=1``).
- producer -> proxy (the finished request's ``kv_transfer_params``, built by
  :func:`producer_reply`): ``{"do_remote_prefill": True, "do_remote_decode": False,
  "transfer_id", "remote_engine_id", "remote_host", "remote_port", "remote_tp_size",
  "remote_pp_size", "remote_head_splits", "remote_layer_splits", "remote_stage_layers",
  "remote_block_ids", "remote_block_sizes", "load_key"}``: ``remote_head_splits`` and
  ``remote_layer_splits`` say through how many units (kvferry Producers) each producer rank serves its KV heads and its
  layers (absent = 1; a rank has ``head_splits * layer_splits`` units;
  docs/vllm-connector-notes.md §8); ``remote_stage_layers`` is each producer PP stage's layer
  numbers ``[start, end)`` as ``[[start, end], ...]`` (vLLM's ``get_pp_indices``, so an
  overridden ``VLLM_PP_LAYER_PARTITION`` travels too; absent: the consumer pairs only equal PP
  sizes without layer splits); ``remote_block_ids`` is the producer's
  block table per KV cache group (block id per request position, as NIXL's and Mooncake's
  ``remote_block_ids``; null where the group holds no block: outside a sliding window);
  ``remote_block_sizes`` the producer's block size (tokens) of each group, so a consumer of
  other block sizes fills its blocks token by token or refuses before any byte moves (absent:
  a producer of the consumer's block sizes); ``remote_kv_layouts`` the producer's KV cache
  layout tag of each group (what decides how a block is laid out in memory beyond its shape:
  on vLLM's CPU build the attention kernel's ISA, which packs each block its own way, e.g.
  ``"CPU_ATTN:vec:auto"``; null where nothing beyond the shape decides, e.g. on GPUs), which a
  consumer compares with its own before any byte moves (:func:`kv_layout_refusal`; absent: a
  producer that names no tags); ``load_key`` the lease's key: the producer serves only a load that
  carries it (kvferry's p2p request ownership, docs/design.md §8.1).
- proxy -> consumer: that reply, unchanged.

Unlike Mooncake's flow the producer names its own side-channel address in the reply, so the proxy
needs no bootstrap-server address of its own.
"""

from __future__ import annotations

import ipaddress

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
TRANSFER_ID = "transfer_id"
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_HOST = "remote_host"
REMOTE_PORT = "remote_port"
REMOTE_TP_SIZE = "remote_tp_size"
REMOTE_PP_SIZE = "remote_pp_size"
REMOTE_HEAD_SPLITS = "remote_head_splits"
REMOTE_LAYER_SPLITS = "remote_layer_splits"
REMOTE_STAGE_LAYERS = "remote_stage_layers"
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_BLOCK_SIZES = "remote_block_sizes"
REMOTE_KV_LAYOUTS = "remote_kv_layouts"
LOAD_KEY = "load_key"

# Layer numbers in ``remote_stage_layers`` lie in ``[0, MAX_LAYERS]`` (a stage's end at most
# MAX_LAYERS): far above any model's layer count, and it bounds the consumer's pairing arithmetic
# (units.py) on a peer's numbers. Stages tile the layers with at least one layer each, so there
# are at most MAX_LAYERS stages too.
MAX_LAYERS = 1 << 16

# Bounds of what a request's params may hold, checked before anything is built from them (the
# params come from whoever reaches the instance's API, through the proxy or not). Far above real
# use: a load key is 32 URL-safe characters (scheduler.py) and kvferry's producers accept at most
# 256 bytes; ids are vLLM request ids; a table of MAX_BLOCK_IDS blocks holds a million-token
# prompt at block size 1; block ids index a cache of at most MAX_BLOCK_ID blocks.
MAX_LOAD_KEY_BYTES = 256
MAX_ID_BYTES = 1024
MAX_HOST_BYTES = 255
MAX_GROUPS = 64
MAX_BLOCK_IDS = 1 << 20
MAX_BLOCK_ID = 1 << 32
# A block of more tokens than this is no vLLM block size (vLLM's largest, hybrid Mamba pages,
# stay far below).
MAX_BLOCK_SIZE = 1 << 20
# A layout tag is a short name ("CPU_ATTN:vec:auto", "AMX_MLA"): far below this, and of these
# characters only, so a peer's tag shown in a log line is plain text.
MAX_LAYOUT_TAG_BYTES = 64
_TAG_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_:.+-")


class ParamsError(ValueError):
    """A request's ``kv_transfer_params`` lack a key or hold a value of the wrong type; the
    message names the key. The connector then treats the request as a local prefill."""


@dataclass(frozen=True)
class RemoteSource:
    """Where a consumer loads a request's KV from: the producer's transfer id, engine id, the
    side-channel base address (``host:port`` of the producer's TP rank 0 / PP rank 0's unit 0),
    the producer's TP/PP sizes, its ``head_splits`` and ``layer_splits`` (where each unit
    listens: :meth:`unit_port`), its block table per KV cache group, the lease's load
    key, ``stage_layers``, each producer PP stage's layer numbers ``[start, end)`` (None: not
    sent), ``block_sizes``, the producer's block size in tokens per group (None: not sent,
    the consumer's own), and ``kv_layouts``, the producer's layout tag per group (None: not
    sent; an element None: nothing beyond the shape decides that group's layout). A table holds None where the producer's group has no block (outside a
    sliding window)."""

    transfer_id: str
    engine_id: str
    host: str
    port: int
    tp_size: int
    pp_size: int
    remote_block_ids: tuple[tuple[int, ...], ...]
    load_key: str
    head_splits: int = 1
    layer_splits: int = 1
    stage_layers: tuple[tuple[int, int], ...] | None = None
    block_sizes: tuple[int, ...] | None = None
    kv_layouts: tuple[str | None, ...] | None = None

    def unit_port(self, tp_rank: int, pp_rank: int, unit: int = 0, layer_unit: int = 0) -> int:
        """Side-channel port of head unit ``unit`` (``0 <= unit < head_splits``) of layer unit
        ``layer_unit`` (``0 <= layer_unit < layer_splits``) of the producer rank ``(tp_rank,
        pp_rank)``; with both splits 1 the rank's one port."""
        return unit_port(self.port, tp_rank, pp_rank, self.tp_size, self.head_splits, unit,
                         self.layer_splits, layer_unit)


def unit_port(base: int, tp_rank: int, pp_rank: int, tp_size: int, head_splits: int, unit: int,
              layer_splits: int = 1, layer_unit: int = 0) -> int:
    """``base + ((pp_rank * tp_size + tp_rank) * layer_splits + layer_unit) * head_splits +
    unit``: where a unit of a producer rank listens (both sides compute it from the same
    numbers; ``layer_splits`` 1 gives the head-units-only ports)."""
    return base + ((pp_rank * tp_size + tp_rank) * layer_splits + layer_unit) * head_splits + unit


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[::1]:5000``): the one form ZeroMQ
    endpoints, segment names and messages take. A host already in brackets is kept as is."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def _get(params: Mapping[str, Any], key: str, kind: type) -> Any:
    if not isinstance(params, Mapping):
        raise ParamsError(f"kv_transfer_params is {type(params).__name__}, expected a dict")
    if key not in params:
        raise ParamsError(f"kv_transfer_params lack {key!r}")
    value = params[key]
    # bool is an int in Python; a port or size given as True is a bug upstream.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ParamsError(
            f"kv_transfer_params[{key!r}] is {type(value).__name__}, expected {kind.__name__}"
        )
    return value


def _text(params: Mapping[str, Any], key: str, limit: int) -> str:
    """A non-empty string key of at most ``limit`` UTF-8 bytes."""
    value = _get(params, key, str)
    if not value:
        raise ParamsError(f"kv_transfer_params[{key!r}] is empty")
    if len(value) > limit or len(value.encode("utf-8", "surrogatepass")) > limit:
        raise ParamsError(f"kv_transfer_params[{key!r}] holds more than {limit} bytes")
    return value


def _block_tables(value: Any) -> tuple[tuple[int | None, ...], ...]:
    """``remote_block_ids`` checked: 1..MAX_GROUPS lists, MAX_BLOCK_IDS ids in all, each an int
    in ``[0, MAX_BLOCK_ID)`` or None (a null block); sizes are checked before any element is
    looked at."""
    key = REMOTE_BLOCK_IDS
    if not isinstance(value, list) or not value or len(value) > MAX_GROUPS:
        raise ParamsError(f"kv_transfer_params[{key!r}] must be a list of 1..{MAX_GROUPS} block tables")
    if not all(isinstance(g, list) for g in value):
        raise ParamsError(f"kv_transfer_params[{key!r}] must be a list of lists of block ids")
    total = sum(len(g) for g in value)
    if total > MAX_BLOCK_IDS:
        raise ParamsError(f"kv_transfer_params[{key!r}] holds {total} block ids, more than {MAX_BLOCK_IDS}")
    for g in value:
        for b in g:
            if b is None:
                continue
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < MAX_BLOCK_ID:
                shown = repr(b) if len(repr(b)) <= 40 else repr(b)[:40] + "..."
                raise ParamsError(f"kv_transfer_params[{key!r}]: block id {shown} is not an int in "
                                  f"[0, {MAX_BLOCK_ID})")
    return tuple(tuple(g) for g in value)


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """True when the producer must hold this request's KV for a consumer."""
    return isinstance(params, Mapping) and bool(params.get(DO_REMOTE_DECODE))


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """True when the consumer must load this request's prompt KV from a producer."""
    return isinstance(params, Mapping) and bool(params.get(DO_REMOTE_PREFILL))


def transfer_id_of(params: Mapping[str, Any]) -> str:
    """The non-empty ``transfer_id`` of at most MAX_ID_BYTES bytes; :class:`ParamsError`
    otherwise."""
    return _text(params, TRANSFER_ID, MAX_ID_BYTES)


def remote_source(params: Mapping[str, Any],
                  allowed: "ProducerAllowlist | LoopbackOnly | None" = None) -> RemoteSource:
    """Parses a consumer request's params, every size, type and range bounded (the MAX_*
    constants); with ``allowed``, the producer's address must be on it. :class:`ParamsError`
    names the first bad key."""
    port = _get(params, REMOTE_PORT, int)
    if not 1 <= port <= 65535:
        raise ParamsError(f"kv_transfer_params['remote_port'] = {port} is not a TCP port")
    sizes = []
    for key in (REMOTE_TP_SIZE, REMOTE_PP_SIZE, REMOTE_HEAD_SPLITS, REMOTE_LAYER_SPLITS):
        size = _get(params, key, int) if key in params else 1
        if size < 1:
            raise ParamsError(f"kv_transfer_params[{key!r}] = {size} must be >= 1")
        sizes.append(size)
    tp, pp, hs, ls = sizes
    last = unit_port(port, tp - 1, pp - 1, tp, hs, hs - 1, ls, ls - 1)
    if last > 65535:
        raise ParamsError(f"kv_transfer_params: the producer's last unit port {last} (remote_port {port}, "
                          f"TP {tp} x PP {pp} x layer_splits {ls} x head_splits {hs}) is not a TCP port")
    stage_layers = _stage_layers(params[REMOTE_STAGE_LAYERS], pp, ls) if REMOTE_STAGE_LAYERS in params else None
    host = _text(params, REMOTE_HOST, MAX_HOST_BYTES)
    if not all(c.isascii() and (c.isalnum() or c in ".-:[]_%") for c in host):
        raise ParamsError("kv_transfer_params['remote_host'] is not a host name or address")
    if allowed is not None:
        allowed.check(host, port)
    tables = _block_tables(_get(params, REMOTE_BLOCK_IDS, list))
    block_sizes = _block_sizes(params[REMOTE_BLOCK_SIZES], len(tables)) if REMOTE_BLOCK_SIZES in params else None
    kv_layouts = _kv_layouts(params[REMOTE_KV_LAYOUTS], len(tables)) if REMOTE_KV_LAYOUTS in params else None
    load_key = _text(params, LOAD_KEY, MAX_LOAD_KEY_BYTES)
    engine_id = _get(params, REMOTE_ENGINE_ID, str)
    if len(engine_id) > MAX_ID_BYTES:
        raise ParamsError(f"kv_transfer_params[{REMOTE_ENGINE_ID!r}] holds more than {MAX_ID_BYTES} bytes")
    return RemoteSource(
        transfer_id=transfer_id_of(params),
        engine_id=engine_id,
        host=host,
        port=port,
        tp_size=tp,
        pp_size=pp,
        remote_block_ids=tables,
        load_key=load_key,
        head_splits=hs,
        layer_splits=ls,
        stage_layers=stage_layers,
        block_sizes=block_sizes,
        kv_layouts=kv_layouts,
    )


def _block_sizes(value: Any, groups: int) -> tuple[int, ...]:
    """``remote_block_sizes`` checked: one int in ``[1, MAX_BLOCK_SIZE]`` per block table."""
    key = REMOTE_BLOCK_SIZES
    if not isinstance(value, list) or len(value) != groups or not all(
            isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= MAX_BLOCK_SIZE for b in value):
        raise ParamsError(f"kv_transfer_params[{key!r}] must be a list of {groups} block sizes in "
                          f"[1, {MAX_BLOCK_SIZE}] (one per table of remote_block_ids)")
    return tuple(value)


def _kv_layouts(value: Any, groups: int) -> tuple[str | None, ...]:
    """``remote_kv_layouts`` checked: one element per block table, each None or a non-empty
    string of at most MAX_LAYOUT_TAG_BYTES characters of ``[A-Za-z0-9_:.+-]``; sizes are checked
    before any element is looked at."""
    key = REMOTE_KV_LAYOUTS
    if not isinstance(value, list) or len(value) != groups:
        raise ParamsError(f"kv_transfer_params[{key!r}] must be a list of {groups} layout tags (one per table of "
                          "remote_block_ids)")
    for tag in value:
        if tag is None:
            continue
        if not isinstance(tag, str) or not 0 < len(tag) <= MAX_LAYOUT_TAG_BYTES or not _TAG_CHARS.issuperset(tag):
            shown = repr(tag) if len(repr(tag)) <= 40 else repr(tag)[:40] + "..."
            raise ParamsError(f"kv_transfer_params[{key!r}]: {shown} is not a layout tag (a string of 1..."
                              f"{MAX_LAYOUT_TAG_BYTES} characters of A-Z a-z 0-9 _ : . + -, or null)")
    return tuple(value)


def _names_a_layout(tags: Iterable[str | None] | None) -> bool:
    """Whether ``tags`` (layout tags per group; None: none sent) names any layout: a tag that is
    not null. All-null and absent tags both leave the layout to the shapes."""
    return any(t is not None for t in tags or ())


def kv_layout_refusal(remote: tuple[str | None, ...] | None, local: tuple[str | None, ...]) -> str | None:
    """Why a consumer whose groups have the layout tags ``local`` must not load from a producer
    that sent ``remote`` (its ``remote_kv_layouts``; None: it sent none); None when it may.

    Both sides read the KV through their own description of it, so a block packed one way and
    read another would still verify (each side checksums what it reads) and decode wrongly: the
    tags must be equal, group by group. Where neither side names any tag (nothing beyond the
    shape decides either layout, e.g. two GPU instances) the shapes decide; otherwise a producer
    that names no tags, or other ones, is refused. Group counts are compared elsewhere
    (:func:`kvferry.vllm.groups.block_size_refusal`)."""
    if not _names_a_layout(local) and not _names_a_layout(remote):
        return None
    if remote is None:
        return (f"the producer names no KV cache layout (remote_kv_layouts), this instance's is {list(local)}: "
                "blocks packed another way would verify and still be read wrongly")
    for g, (r, c) in enumerate(zip(remote, local)):
        if r != c:
            return (f"group {g}: the producer's KV cache layout is {r!r}, this instance's {c!r} (vLLM's CPU "
                    "attention kernels pack each block their own way): the blocks would verify and still be read "
                    "wrongly")
    return None


@dataclass(frozen=True)
class ProducerAllowlist:
    """The producers a consumer loads from (``kv_connector_extra_config["allowed_producers"]``):
    entries ``"host"`` (any side-channel port) or ``"host:port"`` (that base port, the
    ``remote_port`` its replies name; ``"[v6addr]:port"`` for IPv6). Hosts compare as written,
    case-insensitively: list them as the producers name themselves (their ``host`` setting). A
    request naming another address is refused before anything connects, so a client that
    reaches the consumer's API cannot make it connect to, and take KV from, a host of its
    choosing."""

    entries: tuple[tuple[str, int | None], ...]

    @classmethod
    def parse(cls, value: Any) -> "ProducerAllowlist":
        """From the config value: a non-empty list of strings; :class:`ValueError` otherwise."""
        if not isinstance(value, list) or not value or not all(isinstance(e, str) and e for e in value):
            raise ValueError("allowed_producers must be a non-empty list of \"host\" or \"host:port\" strings")
        entries = []
        for e in value:
            host, port = e, None
            if e.startswith("["):
                end = e.find("]")
                if end < 0:
                    raise ValueError(f"allowed_producers entry {e!r}: unclosed [")
                host, rest = e[1:end], e[end + 1:]
                if rest:
                    if not rest.startswith(":"):
                        raise ValueError(f"allowed_producers entry {e!r}: expected [host]:port")
                    port = _entry_port(e, rest[1:])
            elif e.count(":") == 1:
                host, p = e.split(":")
                port = _entry_port(e, p)
            entries.append((host.lower(), port))
        return cls(tuple(entries))

    def check(self, host: str, port: int) -> None:
        """:class:`ParamsError` unless ``host`` (and base ``port``) is on the list."""
        h = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        for eh, ep in self.entries:
            if eh == h.lower() and (ep is None or ep == port):
                return
        raise ParamsError(f"kv_transfer_params: producer {host_port(host, port)} is not in allowed_producers")


@dataclass(frozen=True)
class LoopbackOnly:
    """The producers a consumer loads from when neither ``allowed_producers`` nor
    ``secret_file`` is configured: loopback addresses only (``127.0.0.0/8``, ``::1``,
    ``localhost``). An open-mode consumer cannot tell a real producer from any host that
    answers, so it never connects off this host on a request's word; configure an allowlist
    (or a shared secret, which makes every producer prove itself) for producers elsewhere."""

    def check(self, host: str, port: int) -> None:
        """:class:`ParamsError` unless ``host`` is a loopback address."""
        h = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        h = h.lower()
        if h == "localhost":
            return
        try:
            if ipaddress.ip_address(h).is_loopback:
                return
        except ValueError:
            pass
        raise ParamsError(f"kv_transfer_params: producer {host_port(host, port)} is not on this host, and this "
                          "consumer has neither allowed_producers nor secret_file (open mode loads from loopback "
                          "producers only)")


def producer_policy(allowed: Any, secret_file: str | None) -> "ProducerAllowlist | LoopbackOnly | None":
    """Which producers a consumer loads from, from ``kv_connector_extra_config``: the
    ``allowed_producers`` list when given (:class:`ValueError` when malformed); without one, any
    producer in secret mode (``None``: each proves the secret before it is sent anything), and
    loopback producers only in open mode (:class:`LoopbackOnly`)."""
    if allowed is not None:
        return ProducerAllowlist.parse(allowed)
    return None if secret_file else LoopbackOnly()


def _entry_port(entry: str, text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"allowed_producers entry {entry!r}: {text!r} is not a TCP port")
    return int(text)


def _stage_layers(value: Any, pp_size: int, layer_splits: int) -> tuple[tuple[int, int], ...]:
    """``remote_stage_layers`` checked: ``pp_size`` pairs ``[start, end]`` of ints in ``[0,
    MAX_LAYERS]``, each stage holding at least ``layer_splits`` layers, each starting where the
    previous ended (vLLM's stages tile the layers, so at most MAX_LAYERS stages);
    :class:`ParamsError` otherwise."""
    key = REMOTE_STAGE_LAYERS
    ok = isinstance(value, list) and len(value) == pp_size and all(
        isinstance(s, list) and len(s) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                    for x in s) for s in value)
    if not ok:
        raise ParamsError(f"kv_transfer_params[{key!r}] must be a list of {pp_size} [start, end] layer numbers")
    if any(x > MAX_LAYERS for s in value for x in s):
        raise ParamsError(f"kv_transfer_params[{key!r}]: a layer number above {MAX_LAYERS} (no model has that many "
                          "layers)")
    stages = tuple((s[0], s[1]) for s in value)
    for i, (a, b) in enumerate(stages):
        if b - a < layer_splits:
            raise ParamsError(f"kv_transfer_params[{key!r}]: stage {i} [{a}, {b}) holds fewer layers than "
                              f"remote_layer_splits {layer_splits}")
        if i and a != stages[i - 1][1]:
            raise ParamsError(f"kv_transfer_params[{key!r}]: stage {i} starts at {a}, not where stage {i - 1} ends")
    return stages


def producer_reply(
    transfer_id: str, engine_id: str, host: str, port: int, tp_size: int, pp_size: int,
    block_ids: Sequence[Sequence[int | None]], load_key: str, head_splits: int = 1, layer_splits: int = 1,
    stage_layers: Sequence[tuple[int, int]] | None = None, block_sizes: Sequence[int] | None = None,
    kv_layouts: Sequence[str | None] | None = None,
) -> dict[str, Any]:
    """The params a finished producer request returns, for the proxy to hand to the consumer
    (``remote_head_splits`` and ``remote_layer_splits`` only when above 1;
    ``remote_stage_layers`` only when ``stage_layers`` is given: each PP stage's layer numbers
    ``[start, end)``; ``remote_block_sizes`` only when ``block_sizes`` is given, one per
    table of ``block_ids``; ``remote_kv_layouts`` only when ``kv_layouts`` is given and names
    a tag: one per table)."""
    reply = {
        DO_REMOTE_PREFILL: True,
        DO_REMOTE_DECODE: False,
        TRANSFER_ID: transfer_id,
        REMOTE_ENGINE_ID: engine_id,
        REMOTE_HOST: host,
        REMOTE_PORT: port,
        REMOTE_TP_SIZE: tp_size,
        REMOTE_PP_SIZE: pp_size,
        REMOTE_BLOCK_IDS: [list(g) for g in block_ids],
        LOAD_KEY: load_key,
    }
    if head_splits != 1:
        reply[REMOTE_HEAD_SPLITS] = head_splits
    if layer_splits != 1:
        reply[REMOTE_LAYER_SPLITS] = layer_splits
    if stage_layers is not None:
        reply[REMOTE_STAGE_LAYERS] = [[a, b] for a, b in stage_layers]
    if block_sizes is not None:
        reply[REMOTE_BLOCK_SIZES] = [int(b) for b in block_sizes]
    if _names_a_layout(kv_layouts):
        reply[REMOTE_KV_LAYOUTS] = list(kv_layouts)
    return reply
