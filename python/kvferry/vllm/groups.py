"""vLLM's KV cache groups in kvferry's terms: which groups the connector moves and verifies, and
which it refuses at start-up (with the reason).

vLLM 0.32's hybrid KV cache manager gives each group of layers of one attention type its own
block table (``KVCacheConfig.kv_cache_groups``; e.g. a model mixing sliding-window and full
attention layers has one group of each). kvferry moves every group's blocks with the request's
table of that group and verifies each group on its own (docs/design.md §2.5, §2.6): a
sliding-window group's blocks outside the window are vLLM's null block (id 0, ``BlockPool``'s
first block, never a request's block) on both sides, and only its last ``ceil(window /
block_size) + 1`` positions are checksummed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvferry.vllm.units import ConfigError

# vLLM's spec class of Mamba-type state (Mamba, Mamba2, GDN, linear attention, short conv): a
# fixed-size state per request instead of per-token KV blocks.
STATE_KIND = "MambaSpec"
# The checksum's skip reason of a state group (docs/design.md §2.6): reported skipped on both
# sides, so the attention groups still decide the verdict.
STATE_SKIP = "no_per_token_blocks"

# vLLM's null block: ``BlockPool.null_block`` is the pool's first block (id 0); a group's table
# holds it where the request has no block (outside a sliding window).
NULL_BLOCK_ID = 0

# Why each spec class kvferry's connector does not move is refused (shown at start-up), by vLLM
# 0.32's class names (``vllm/v1/kv_cache_interface.py``; a subclass is refused as its base). Other
# specs go on to layouts.py, which lays out full, sliding-window and MLA attention caches and
# refuses the rest naming the tensor's shape.
_REFUSED = {
    "ChunkedLocalAttentionSpec": "chunked local attention keeps only the current chunk's blocks, a rule "
                                 "kvferry's block selection does not have",
    "CrossAttentionSpec": "cross-attention KV comes from the encoder, not from the prompt's tokens",
    "EncoderOnlyAttentionSpec": "encoder-only attention keeps no KV cache to move",
    "SinkFullAttentionSpec": "attention-sink blocks are not part of the request's block table",
    "CircularBufferSpec": "a circular buffer's blocks do not hold fixed token positions",
}


@dataclass(frozen=True)
class GroupInfo:
    """One KV cache group the connector moves: ``group_id`` (vLLM's index in
    ``kv_cache_groups``, also kvferry's group id and the index of the request's block tables),
    its ``layer_names``, ``block_size`` in tokens and ``sliding_window`` in tokens (None: full
    attention) and ``state`` (a Mamba-type state group: its blocks move, the checksum skips it)."""

    group_id: int
    layer_names: tuple[str, ...]
    block_size: int
    sliding_window: int | None = None
    state: bool = False


def _state_refusal(spec: Any) -> str | None:
    """Why a Mamba-type state spec cannot be moved; None when it can: vLLM keeps one state block
    per request (``mamba_cache_mode`` "none") holding the state after the request's computed
    tokens. The prefix-caching modes ("all", "align") keep a state per block boundary, and
    speculative decoding adds scratch blocks, neither at positions the consumer's table pairs."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "none":
        return (f"mamba_cache_mode {mode!r} keeps a state per block boundary, which this connector does not pair; "
                "run without prefix caching for Mamba layers (mamba_cache_mode 'none')")
    if getattr(spec, "num_speculative_blocks", 0):
        return "speculative decoding's scratch state blocks are not moved"
    return None


def _layer_specs(spec: Any, names: list[str]) -> list[tuple[str, Any]]:
    per_layer = getattr(spec, "kv_cache_specs", None)
    if isinstance(per_layer, dict):  # UniformTypeKVCacheSpecs: one spec per layer
        return [(n, per_layer.get(n, spec)) for n in names]
    return [(n, spec) for n in names]


def kv_cache_groups(kv_cache_config: Any, default_block_size: int) -> list[GroupInfo]:
    """The groups of ``kv_cache_config`` (vLLM's ``KVCacheConfig``; None or one without groups:
    one full-attention group of every layer at ``default_block_size``, layer names unknown).

    Raises :class:`~kvferry.vllm.units.ConfigError` naming the group, its spec and the reason
    when a group holds a spec the connector does not move (chunked local, cross or
    encoder-only attention, attention sinks, a Mamba-type state kept per block boundary or with
    speculative blocks, :func:`_state_refusal`), when a group mixes state and attention layers,
    when a group does not take
    part in vLLM's KV transfer (``enable_kv_transfer`` false: the scheduler would not hand over
    its blocks), or when one group mixes sliding windows."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not groups:
        return [GroupInfo(0, (), default_block_size)]
    out = []
    for gid, group in enumerate(groups):
        names = list(group.layer_names)
        if not getattr(group, "enable_kv_transfer", True):
            raise ConfigError(f"KV cache group {gid} (layers {names[:3]}...) does not take part in vLLM's KV "
                              "transfer: kvferry's connector cannot move this model")
        windows, states = set(), set()
        for name, spec in _layer_specs(group.kv_cache_spec, names):
            kind = type(spec).__name__
            classes = [c.__name__ for c in type(spec).__mro__]
            refused = next((c for c in classes if c in _REFUSED), None)
            why = _REFUSED[refused] if refused is not None else \
                _state_refusal(spec) if STATE_KIND in classes else None
            if why is not None:
                raise ConfigError(f"KV cache group {gid} holds layer {name!r} with {kind}: {why}. "
                                  "kvferry's connector moves full-attention, sliding-window, MLA and Mamba-type "
                                  "state groups")
            states.add(STATE_KIND in classes)
            sliding = any(c.__name__ == "SlidingWindowSpec" for c in type(spec).__mro__)
            windows.add(getattr(spec, "sliding_window", None) if sliding else None)
        if len(windows) > 1:
            raise ConfigError(f"KV cache group {gid} mixes sliding windows {sorted(windows, key=str)}: one window "
                              "per group is checksummed")
        if len(states) > 1:
            raise ConfigError(f"KV cache group {gid} mixes Mamba-type state and attention layers: a group is "
                              "either checksummed per token or skipped")
        block_size = int(getattr(group.kv_cache_spec, "block_size", default_block_size))
        out.append(GroupInfo(gid, tuple(names), block_size, windows.pop(), state=states.pop() if states else False))
    return out


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks holding ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


def producer_table(block_ids: list[int], num_tokens: int, block_size: int) -> tuple[int | None, ...]:
    """A producer group's table as kvferry takes it: the blocks holding the prompt's
    ``num_tokens`` tokens (the sampled token's block, if any, is not sent), vLLM's null block as
    None."""
    return tuple(None if b == NULL_BLOCK_ID else int(b) for b in block_ids[:blocks_for(num_tokens, block_size)])


def consumer_table(blocks: list[Any], num_tokens: int, block_size: int) -> tuple[int | None, ...]:
    """A consumer group's table from vLLM's ``KVCacheBlock`` list of the request (one per
    position from 0): the block id where the load writes, None for a null block (outside a
    sliding window) and for a local prefix-cache hit (a block with a hash: computed here, not
    loaded); the first ``ceil(num_tokens / block_size)`` positions."""
    out = []
    for b in blocks[:blocks_for(num_tokens, block_size)]:
        null = getattr(b, "is_null", False) or b.block_id == NULL_BLOCK_ID
        out.append(None if null or b.block_hash is not None else int(b.block_id))
    return tuple(out)


def block_size_refusal(remote: tuple[int, ...], local: tuple[int, ...], windows: tuple[int | None, ...],
                       num_tokens: int, num_local_computed: int, states: tuple[bool, ...] = ()) -> str | None:
    """Why a consumer with group block sizes ``local`` and sliding windows ``windows`` (None: full
    attention) must not load a prompt of ``num_tokens`` tokens, ``num_local_computed`` of them a
    local prefix hit, from a producer of block sizes ``remote`` (the reply's
    ``remote_block_sizes``); None when it may. Decided before any byte moves, by the seed's
    rules (docs/design.md §2.5, §2.6), since such a load could only end unverified:

    - the group counts differ (different models or KV cache managers);
    - a Mamba-type state group (``states[g]`` true) has different block sizes: its one state
      block per request is not made of tokens, so it cannot be refilled token by token;
    - a group's sizes are not multiples of each other (chunks of the larger size are compared);
    - the consumer has smaller blocks and its first checksummed block starts inside a producer
      block: after a local prefix hit, or in a sliding-window group, whose checksum keeps only
      the last ``ceil(window / block_size) + 1`` positions on each side (and whose blocks
      before ``num_tokens - window + 1`` are null), so its first one depends on the prompt's
      length."""
    if len(remote) != len(local):
        return (f"the producer has {len(remote)} KV cache groups, this instance {len(local)}: the instances "
                "run different models or KV cache managers")
    for g, (r, c) in enumerate(zip(remote, local)):
        if r == c:
            continue
        if g < len(states) and states[g]:
            return (f"group {g} holds Mamba-type state, whose block sizes differ ({r} at the producer, {c} here): "
                    "a state block is not made of tokens and cannot be refilled token by token")
        if max(r, c) % min(r, c):
            return (f"group {g}: block sizes {r} (producer) and {c} (here) are not multiples of each other, "
                    "so no chunk of the larger size could be compared: the load would be unverified")
        if c > r:
            continue
        start = num_local_computed // c
        w = windows[g] if g < len(windows) else None
        if w:
            n = blocks_for(num_tokens, c)
            start = max(start, n - (blocks_for(w, c) + 1), max(num_tokens - w + 1, 0) // c)
        if start * c % r:
            what = f"the sliding window ({w} tokens)" if w and start * c > num_local_computed else \
                f"a local prefix hit of {num_local_computed} tokens"
            return (f"group {g}: after {what} the first checksummed block of {c} tokens starts at token "
                    f"{start * c}, inside a producer block of {r} tokens: the load would be unverified")
    return None
