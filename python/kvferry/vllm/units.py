"""Which KV heads and layers each kvferry Producer ("unit") of a producer rank holds, and which
units a consumer rank loads from: heterogeneous TP and PP between two vLLM instances
(docs/vllm-connector-notes.md §8). Pure arithmetic, no engines.

A producer rank ``tp`` with ``Hp`` local KV heads serves them through ``head_splits = s``
units; unit ``j`` holds the global heads ``[tp * Hp + j * Hp / s, tp * Hp + (j + 1) * Hp / s)``.
A consumer rank ``tc`` with ``Hc`` local heads holds ``[tc * Hc, (tc + 1) * Hc)`` and loads from
every unit inside that range; the range must be a union of whole units. kvferry's checksum is a
sum over (layer, global KV head) slices (docs/design.md §2.1), so a load of one unit's heads
verifies on its own when both sides' kvferry objects cover exactly those heads.

A layer without an ``H`` axis (an MLA latent, replicated on every TP rank) is not split, and such
a rank pairs only with a producer of the same TP size: consumer rank ``tc`` loads the whole
rank's KV from producer rank ``tc``. (With other TP sizes two consumer ranks would load one
producer rank's lease, which kvferry serves once (docs/design.md §4.6), or some producer ranks'
leases would never be loaded and would hold their blocks until they expire.)

Layers (PP): a PP stage holds the layers whose numbers (kvferry's layer number, design §2.1:
the one all-digit dot-separated component of the layer's name) lie in its range ``[a, b)``
(vLLM's ``get_pp_indices``). A producer stage serves them through ``layer_splits = r`` layer
units: layer unit ``k`` holds ``[a + k * n // r, a + (k + 1) * n // r)``, ``n = b - a``. A
consumer stage ``[c, d)`` loads from every producer layer unit inside it; ``[c, d)`` must be a
union of whole layer units. A producer unit is the pair (layer unit, head unit) of one
``(pp, tp)`` rank; the consumer loads the product of its layer units and its head units.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Iterable

# common_heads() of a rank none of whose layers has a KV head axis (MLA).
NO_HEAD_AXIS = 0


class ConfigError(ValueError):
    """A ``kv_connector_extra_config`` value is missing its type or range, or does not fit the
    model (``head_splits`` not dividing a rank's KV heads); the message names it. (connector.py
    re-exports it.)"""


class PairingError(ValueError):
    """A consumer rank cannot load from the producer's units; the message says why and what to
    set. The connector refuses that load as unverified (vLLM's ``kv_load_failure_policy`` decides)."""


@dataclass(frozen=True)
class Unit:
    """One producer unit a consumer rank loads from: producer TP rank ``tp_rank``, head unit
    index ``unit`` (``0 <= unit < head_splits``) and ``heads``, the global KV heads ``[start,
    end)`` it holds, or None when they are the consumer rank's own heads (the rank's tensors
    unsliced, as between equal TP sizes); producer PP stage ``stage``, layer unit index
    ``layer_unit`` (``0 <= layer_unit < layer_splits``) and ``layers``, the layer numbers
    ``[start, end)`` it holds, or None when they are the consumer stage's own layers (every layer
    of the rank, as between equal PP sizes)."""

    tp_rank: int
    unit: int
    heads: tuple[int, int] | None
    stage: int = 0
    layer_unit: int = 0
    layers: tuple[int, int] | None = None


def layer_number(name: str) -> int | None:
    """kvferry's layer number of a layer name (docs/design.md §2.1): its one dot-separated
    component made only of digits (``model.layers.12.self_attn.attn`` -> 12); None when the
    name has none or several."""
    digits = [part for part in name.split(".") if part.isdigit() and part.isascii()]
    return int(digits[0]) if len(digits) == 1 else None


def layer_units(stage: tuple[int, int], layer_splits: int) -> list[tuple[int, int]]:
    """The layer numbers ``[start, end)`` of each layer unit of a stage holding ``stage = [a,
    b)`` (unit ``k`` at index ``k``): ``[a + k * n // r, a + (k + 1) * n // r)`` with ``n = b -
    a`` and ``r = layer_splits`` (consecutive runs, sizes differing by at most one).

    Raises :class:`ConfigError` when ``layer_splits`` is below 1 or above ``n`` (a unit without
    layers)."""
    a, b = stage
    n = b - a
    if layer_splits < 1:
        raise ConfigError(f"kv_connector_extra_config['layer_splits'] = {layer_splits} must be >= 1")
    if layer_splits > n:
        raise ConfigError(f"kv_connector_extra_config['layer_splits'] = {layer_splits} exceeds the {n} layers "
                          f"[{a}, {b}) of this PP stage")
    return [(a + k * n // layer_splits, a + (k + 1) * n // layer_splits) for k in range(layer_splits)]


def _is_unit_edge(stage: tuple[int, int], layer_splits: int, x: int) -> bool:
    """Whether layer number ``x`` (``a < x < b`` for ``stage = [a, b)``) is an edge of the stage's
    layer units at ``layer_splits = r`` (:func:`layer_units`): some ``k`` with ``k * n // r == x -
    a``, i.e. the smallest ``k`` with ``k * n >= (x - a) * r`` also has ``k * n < (x - a + 1) *
    r``. O(1)."""
    a, b = stage
    n, m, r = b - a, x - a, layer_splits
    k = -(-m * r // n)
    return k * n < (m + 1) * r


def _layer_splits_needed(stages: list[tuple[int, int]], bounds: tuple[int, int]) -> int | None:
    """The smallest ``layer_splits`` (at most every producer stage's layer count) whose layer
    units have each of ``bounds`` that falls inside the producer's stages as a unit edge; None
    when none does. A stage's own ends are always edges, so only bounds strictly inside a stage
    are checked, each in O(1) per candidate: O(stages + min stage size) (params.py bounds layer
    numbers below ``2**16``)."""
    inner = [(stage, x) for x in bounds for stage in stages if stage[0] < x < stage[1]]
    for r in range(1, min(b - a for a, b in stages) + 1):
        if all(_is_unit_edge(stage, r, x) for stage, x in inner):
            return r
    return None


def consumer_layer_units(*, pp_rank: int, pp_size: int, stage_layers: tuple[int, int] | None,
                         layer_numbers: Iterable[int | None], producer_pp_size: int,
                         producer_stage_layers: list[tuple[int, int]] | None,
                         producer_layer_splits: int) -> list[tuple[int, int, tuple[int, int] | None]]:
    """``(producer stage, layer unit, layers)`` of every producer layer unit consumer stage
    ``pp_rank`` loads from, in layer order; ``layers`` None when the unit holds exactly the
    consumer stage's layers (every layer of the rank).

    ``stage_layers``: this stage's layer range ``[c, d)`` (None: unknown); ``layer_numbers``:
    the layer number of each of the rank's layers (:func:`layer_number`, None for a name without
    one); ``producer_stage_layers``: each producer stage's range (the reply's
    ``remote_stage_layers``; None: not sent). Without the producer's ranges only equal PP sizes
    with ``layer_splits`` 1 pair (stage ``pp_rank``, whole). Raises :class:`PairingError` when
    the PP sizes differ (or the producer splits layers) without the producer's ranges, when this
    stage's range is unknown, when a producer layer unit straddles its range (naming the
    ``layer_splits`` the producer needs), or when the stage loads several units (or none) and
    some of the rank's layers lie in none of them. (One unit of the whole stage loads every
    layer of the rank; kvferry's p2p refuses a producer and consumer of different layers.)"""
    r = producer_layer_splits
    if producer_stage_layers is None:
        if producer_pp_size == pp_size and r == 1:
            return [(pp_rank, 0, None)]
        raise PairingError(
            f"the producer (PP size {producer_pp_size}, layer_splits {r}) did not send its stages' layer ranges "
            f"(remote_stage_layers), needed to pair with this instance's PP size {pp_size}")
    if stage_layers is None:
        raise PairingError("this rank's layer range is unknown: cannot pair it with the producer's PP stages")
    c, d = stage_layers
    stages = [tuple(s) for s in producer_stage_layers]
    if len(stages) != producer_pp_size or any(b - a < max(r, 1) for a, b in stages):
        raise PairingError(f"the producer's stage layer ranges {stages} do not fit its PP size {producer_pp_size} "
                           f"and layer_splits {r}")
    out = []
    for p, stage in enumerate(stages):
        for k, (a, b) in enumerate(layer_units(stage, r)):
            if c <= a and b <= d:
                out.append((p, k, None if (a, b) == (c, d) else (a, b)))
            elif a < d and c < b:
                need = _layer_splits_needed(stages, (c, d))
                what = (f"start the producer with layer_splits {need}" if need is not None else
                        "no layer_splits of the producer aligns with it")
                raise PairingError(
                    f"producer stage {p}'s layer unit {k} holds layers [{a}, {b}), this PP stage holds [{c}, {d}): "
                    f"{what} (docs/vllm-connector-notes.md §8)")
    if len(out) == 1 and out[0][2] is None:
        # One load of the rank's whole KV: kvferry's p2p checks both sides hold the same layers.
        return out
    covered = [u[2] for u in out]
    numbers = list(layer_numbers)
    missing: list = sorted({n for n in numbers if n is not None and not any(a <= n < b for a, b in covered)})
    if None in numbers:  # loaded only with the rank's whole KV
        missing = ["(no layer number)", *missing]
    if missing or not out:
        raise PairingError(
            f"layers {missing} of this PP stage [{c}, {d}) lie in no layer unit of the producer's stages {stages}: "
            "the instances hold different layers")
    return out


def common_heads(per_layer: Iterable[int | None]) -> int | None:
    """The KV head count (``H`` axis size) all of a rank's layers share; ``per_layer`` gives
    each layer's, None for a layer without an ``H`` axis. Returns that count, ``NO_HEAD_AXIS``
    (0) when no layer has the axis (MLA), None when the layers disagree (mixed)."""
    counts = set(per_layer)
    if counts == {None} or not counts:
        return NO_HEAD_AXIS
    if len(counts) == 1:
        return counts.pop()
    return None


def producer_units(tp_rank: int, local_heads: int | None, head_splits: int) -> list[tuple[int, int] | None]:
    """Global head range of each unit of producer rank ``tp_rank`` (unit ``j`` at index ``j``);
    ``[None]`` (one unit, the rank's whole KV) when ``head_splits`` is 1.

    Raises :class:`ConfigError` when ``head_splits`` is below 1, or above 1 while the rank's
    layers have no common KV head axis (``local_heads`` 0 or None: MLA or mixed), or does not
    divide ``local_heads``."""
    if head_splits < 1:
        raise ConfigError(f"kv_connector_extra_config['head_splits'] = {head_splits} must be >= 1")
    if head_splits == 1:
        return [None]
    if not local_heads:
        raise ConfigError(
            f"kv_connector_extra_config['head_splits'] = {head_splits}: this rank's KV cache layers have no "
            "common KV head axis to split (MLA latents are replicated on every TP rank): use head_splits 1")
    if local_heads % head_splits:
        raise ConfigError(
            f"kv_connector_extra_config['head_splits'] = {head_splits} does not divide this rank's "
            f"{local_heads} KV heads")
    u = local_heads // head_splits
    lo = tp_rank * local_heads
    return [(lo + j * u, lo + (j + 1) * u) for j in range(head_splits)]


def consumer_units(*, tp_rank: int, tp_size: int, pp_size: int, local_heads: int | None,
                   producer_tp_size: int, producer_pp_size: int, producer_head_splits: int, pp_rank: int = 0,
                   stage_layers: tuple[int, int] | None = None, layer_numbers: Iterable[int | None] = (),
                   producer_stage_layers: list[tuple[int, int]] | None = None,
                   producer_layer_splits: int = 1) -> list[Unit]:
    """The producer units consumer rank ``(tp_rank, pp_rank)`` loads from, in (layer, head)
    order: every pair of a layer unit (:func:`consumer_layer_units`, which documents the layer
    arguments) and a head unit.

    ``local_heads``: :func:`common_heads` of this rank's layers. Equal TP and PP sizes with
    ``producer_head_splits`` and ``producer_layer_splits`` 1 give exactly one unit, the producer
    rank of the same TP and PP rank, covering the whole rank (``heads`` and ``layers`` None).
    Raises :class:`PairingError` with the reason when the layers do not pair
    (:func:`consumer_layer_units`), when the producer's heads per rank are not a whole number,
    when this rank's head range is not a union of whole units (saying which ``head_splits`` the
    producer needs), when an MLA rank meets a producer of another TP size or one that splits
    heads, and when layers with and without a head axis are mixed across different TP sizes."""
    layer_part = consumer_layer_units(
        pp_rank=pp_rank, pp_size=pp_size, stage_layers=stage_layers, layer_numbers=layer_numbers,
        producer_pp_size=producer_pp_size, producer_stage_layers=producer_stage_layers,
        producer_layer_splits=producer_layer_splits)
    return [Unit(u.tp_rank, u.unit, u.heads, stage, k, layers)
            for stage, k, layers in layer_part
            for u in _head_units(tp_rank=tp_rank, tp_size=tp_size, local_heads=local_heads,
                                 producer_tp_size=producer_tp_size, producer_head_splits=producer_head_splits)]


def _head_units(*, tp_rank: int, tp_size: int, local_heads: int | None, producer_tp_size: int,
                producer_head_splits: int) -> list[Unit]:
    """The head units of :func:`consumer_units` (stage 0, whole layers), in head order."""
    s = producer_head_splits
    if local_heads == NO_HEAD_AXIS:
        if s != 1:
            raise PairingError(
                f"the producer splits each rank's KV heads into {s} units, but this rank's KV has no head axis "
                "(MLA: the latent is replicated on every TP rank): start the producer with head_splits 1")
        if producer_tp_size != tp_size:
            # Every rank holds the whole latent: each producer rank's lease must be loaded exactly
            # once (a lease is served once, docs/design.md §4.6), i.e. by the consumer rank of its TP rank.
            raise PairingError(
                f"this rank's KV has no head axis (MLA: the latent is replicated on every TP rank), so it pairs only "
                f"with a producer of the same TP size ({tp_size}), not {producer_tp_size}: each producer rank's "
                "lease is served once, so two consumer ranks cannot load one producer rank, and a producer rank "
                "no consumer rank loads would hold its blocks until its lease expires")
        return [Unit(tp_rank, 0, None)]
    if local_heads is None:
        if producer_tp_size == tp_size and s == 1:
            return [Unit(tp_rank, 0, None)]
        raise PairingError(
            "this rank's KV cache layers do not share one KV head count (or some have no head axis): only a "
            f"producer of the same TP size ({tp_size}) with head_splits 1 pairs with it (producer TP "
            f"{producer_tp_size}, head_splits {s})")
    total = tp_size * local_heads
    if total % producer_tp_size:
        raise PairingError(
            f"the model's {total} KV heads do not split over the producer's TP size {producer_tp_size}")
    hp = total // producer_tp_size
    if hp % s:
        raise PairingError(f"the producer's head_splits {s} does not divide its {hp} KV heads per rank")
    u = hp // s
    lo, hi = tp_rank * local_heads, (tp_rank + 1) * local_heads
    if lo % u or hi % u:
        need = hp // gcd(hp, local_heads)
        raise PairingError(
            f"producer units hold {u} KV heads, this rank holds {local_heads} (global heads [{lo}, {hi})): "
            f"start the producer with head_splits {need} (or a multiple of it dividing its {hp} heads per rank)")
    units = []
    for g in range(lo // u, hi // u):
        start = g * u
        heads = None if (start, start + u) == (lo, hi) else (start, start + u)
        units.append(Unit(start // hp, (start % hp) // u, heads))
    return units
