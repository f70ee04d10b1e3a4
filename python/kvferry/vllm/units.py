"""Which KV heads each kvferry Producer ("unit") of a producer rank holds, and which units a
consumer rank loads from: heterogeneous TP between two vLLM instances
(docs/vllm-connector-notes.md §8). Pure arithmetic, no engines.

A producer rank ``tp`` with ``Hp`` local KV heads serves them through ``head_splits = s``
units; unit ``j`` holds the global heads ``[tp * Hp + j * Hp / s, tp * Hp + (j + 1) * Hp / s)``.
A consumer rank ``tc`` with ``Hc`` local heads holds ``[tc * Hc, (tc + 1) * Hc)`` and loads from
every unit inside that range; the range must be a union of whole units. kvferry's checksum is a
sum over (layer, global KV head) slices (docs/design.md §2.1), so a load of one unit's heads
verifies on its own when both sides' kvferry objects cover exactly those heads.

A layer without an ``H`` axis (an MLA latent, replicated on every TP rank) is not split: consumer
rank ``tc`` loads the whole rank's KV from producer rank ``tc % producer_tp_size``.
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
    """One producer unit a consumer rank loads from: producer TP rank ``tp_rank``, unit index
    ``unit`` (``0 <= unit < head_splits``) and ``heads``, the global KV heads ``[start, end)``
    it holds, or None when it covers the consumer rank's whole KV (one load over the rank's
    unsliced tensors, as between equal TP sizes)."""

    tp_rank: int
    unit: int
    heads: tuple[int, int] | None


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
                   producer_tp_size: int, producer_pp_size: int, producer_head_splits: int) -> list[Unit]:
    """The producer units consumer rank ``(tp_rank, any pp)`` loads from, in head order.

    ``local_heads``: :func:`common_heads` of this rank's layers. Equal TP sizes with
    ``producer_head_splits`` 1 give exactly one unit, the producer rank of the same TP rank,
    covering the whole rank (``heads`` None). Raises :class:`PairingError` with the reason when
    the PP sizes differ, when the producer's heads per rank are not a whole number, when this
    rank's head range is not a union of whole units (saying which ``head_splits`` the producer
    needs), when an MLA rank meets a producer that splits heads, and when layers with and
    without a head axis are mixed across different TP sizes."""
    if producer_pp_size != pp_size:
        raise PairingError(
            f"producer PP size {producer_pp_size} differs from this instance's {pp_size}: "
            "loads between different PP sizes are not supported (docs/vllm-connector-notes.md §8)")
    s = producer_head_splits
    if local_heads == NO_HEAD_AXIS:
        if s != 1:
            raise PairingError(
                f"the producer splits each rank's KV heads into {s} units, but this rank's KV has no head axis "
                "(MLA: the latent is replicated on every TP rank): start the producer with head_splits 1")
        return [Unit(tp_rank % producer_tp_size, 0, None)]
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
