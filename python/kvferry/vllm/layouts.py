"""The KV cache layouts of vLLM 0.32 in kvferry's terms: which kvferry layout (docs/design.md
§2.2), cache kind and fingerprint (§2.3) one layer's tensor from ``register_kv_caches`` has.

The layer's KV cache spec (``kv_cache_config.kv_cache_groups[*].kv_cache_spec``, given to every
connector's constructor) decides where it is known; the tensor's shape decides only where it is
unambiguous. vLLM 0.32 hands every attention layer a 4-D logical ``[B, H, N, C]`` view
(``vllm/v1/worker/utils.py`` ``allocate_kv_cache``), MLA's included (``[B, 1, N, 576]`` for
DeepSeek-V2/V3, ``docs/vllm-connector-notes.md`` §9): by shape alone an MLA cache is a one-head
CPU attention cache with ``2 * D = 576``, so a 4-D one-head tensor without its spec is refused.
Where K and V sit depends on the backend (notes §10): the CPU backend reads ``[B, H, N, 2*D]``
as ``[B, H, 2*N, D]`` (K/V split across tokens); the CUDA backends (FlashAttention, FlashInfer,
Triton) split the last axis (``C = [K | V]``). The physical order of the four axes is the
resolved ``KVCacheLayout`` (``kv_cache_config.kv_cache_layout``, e.g. ``LBNHC`` = NHD, ``LBHNC``
= HND) and is only carried by the strides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MLA_KIND = "MLAAttentionSpec"
FULL_KIND = "FullAttentionSpec"


class LayoutError(ValueError):
    """A KV cache tensor whose layout the connector does not know; the message gives its shape."""


def _spec_classes(spec: Any) -> list[str]:
    return [c.__name__ for c in type(spec).__mro__]


def is_mla_spec(spec: Any) -> bool:
    """True when ``spec`` is vLLM's ``MLAAttentionSpec`` or a subclass of it
    (``vllm/v1/kv_cache_interface.py``); checked by class name, so no vLLM import is needed."""
    return spec is not None and MLA_KIND in _spec_classes(spec)


def layer_specs(kv_cache_config: Any) -> dict[str, Any]:
    """Layer name -> that layer's KV cache spec, from vLLM's ``KVCacheConfig``
    (``kv_cache_groups[*]``: ``layer_names`` and ``kv_cache_spec``; a group's
    ``UniformTypeKVCacheSpecs`` is unpacked into its per-layer ``kv_cache_specs``). ``None`` or a
    config without groups gives ``{}`` (the layout then comes from the shape alone)."""
    out: dict[str, Any] = {}
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)
        for name in group.layer_names:
            out[name] = per_layer.get(name, spec) if isinstance(per_layer, dict) else spec
    return out


@dataclass(frozen=True)
class LayerLayout:
    """How kvferry reads one layer's tensor: ``view`` (same memory, axes in ``layout`` order:
    ``"B H KV N D"``, ``"B N H KV D"``, ``"B H N KV D"``, ``"KV B N H D"``, ``"B N D"``...)
    and the cache ``kind`` of the layer
    fingerprint (docs/design.md §2.3, e.g. ``"MLAAttentionSpec"``)."""

    view: Any
    layout: str
    kind: str


def _mla_view(t: Any, block_size: int, spec: Any) -> Any:
    """``[B, N, C]`` view of an MLA latent cache: 4-D ``[B, 1, N, C]`` (vLLM 0.32) or 3-D
    ``[B, N, C]`` (older vLLM's ``get_kv_cache_shape``)."""
    shape = tuple(t.shape)
    if spec is not None:
        packed = [f for f in ("state_content_bytes", "num_head_slots") if getattr(spec, f, None) is not None]
        if getattr(spec, "tokens_per_state", 1) != 1 or getattr(spec, "head_size_v", 0) or packed:
            raise LayoutError(
                f"MLA KV cache of shape {shape} with spec {type(spec).__name__} (tokens_per_state "
                f"{getattr(spec, 'tokens_per_state', None)}, head_size_v {getattr(spec, 'head_size_v', None)}, "
                f"packed {packed or None}) is not a plain latent cache: not handled"
            )
    want_c = getattr(spec, "head_size", None)
    if len(shape) == 4 and shape[1] == 1:
        view = t[:, 0]
    elif len(shape) == 3:
        view = t
    else:
        view = None
    if view is None or view.shape[1] != block_size or (want_c is not None and view.shape[2] != want_c):
        raise LayoutError(
            f"MLA KV cache tensor of shape {shape} (block_size {block_size}, head_size {want_c}) has no "
            "known layout: expected [B, 1, N, head_size] or [B, N, head_size]"
        )
    return view


# vLLM 0.32's KVCacheLayout names (vllm/v1/kv_cache_layout.py) -> the physical order of a layer's
# logical [B, H, N, C] view, outermost first (``KVCacheLayout.layer_view_order``); C is always
# innermost. "NHD" / "HND" are vLLM's legacy aliases (vllm/config/cache.py _LAYOUT_COMPAT_ALIASES).
LAYER_VIEW_ORDER = {
    "LBHNC": (0, 1, 2, 3),
    "LBNHC": (0, 2, 1, 3),
    "LHBNC": (1, 0, 2, 3),
    "BLHNC": (0, 1, 2, 3),
    "BLNHC": (0, 2, 1, 3),
    "BHLNC": (0, 1, 2, 3),
}
LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
# Axis names of the 5-D view [B, H, N, KV, D] of a CUDA layer (C split into K and V).
_GPU_AXES = ("B", "H", "N", "KV", "D")
# vLLM's KVQuantMode values whose cache is plain [K | V] elements of the spec's dtype:
# NONE (0) and FP8_PER_TENSOR (1) (vllm/v1/kv_cache_interface.py KVQuantMode).
_PLAIN_QUANT_MODES = (0, 1)


def resolved_layout_name(kv_cache_layout: str | None) -> str | None:
    """vLLM's canonical ``KVCacheLayout`` name for ``kv_cache_layout`` (``"NHD"`` -> ``"LBNHC"``,
    ``"HND"`` -> ``"LBHNC"``, canonical names unchanged); None stays None. Raises
    :class:`LayoutError` for a name vLLM 0.32 does not define."""
    if kv_cache_layout is None:
        return None
    name = LAYOUT_ALIASES.get(str(kv_cache_layout), str(kv_cache_layout))
    if name not in LAYER_VIEW_ORDER:
        raise LayoutError(
            f"unknown vLLM KV cache layout {kv_cache_layout!r}: expected one of "
            f"{sorted(LAYER_VIEW_ORDER) + sorted(LAYOUT_ALIASES)}"
        )
    return name


def _check_plain_attention_spec(shape: tuple, spec: Any) -> int:
    """Head size D of a plain (dense ``[K | V]``) attention spec matching ``shape`` =
    ``[B, H, N, C]``; raises :class:`LayoutError` for packed, compressed, per-token-head or
    NVFP4-quantised caches and for a K head size different from V's."""
    quant = getattr(spec, "kv_quant_mode", 0)
    odd = {
        f: getattr(spec, f, None)
        for f in ("num_head_slots", "state_content_bytes", "page_size_padded")
        if getattr(spec, f, None) is not None
    }
    d, dv = getattr(spec, "head_size", None), getattr(spec, "head_size_v", None)
    if odd or getattr(spec, "tokens_per_state", 1) != 1 or int(quant) not in _PLAIN_QUANT_MODES or d != dv:
        raise LayoutError(
            f"KV cache of shape {shape} with spec {type(spec).__name__} (head_size {d}, head_size_v {dv}, "
            f"kv_quant_mode {quant!r}, tokens_per_state {getattr(spec, 'tokens_per_state', None)}, "
            f"{odd or 'no packing'}) is not a plain [K | V] attention cache: not handled"
        )
    want = (getattr(spec, "num_kv_heads", None), 2 * d)
    if (shape[1], shape[3]) != want:
        raise LayoutError(
            f"KV cache of shape {shape} does not match its spec {type(spec).__name__} "
            f"(num_kv_heads {want[0]}, head_size {d}: expected [B, {want[0]}, N, {want[1]}])"
        )
    return d


def _gpu_view(t: Any, block_size: int, spec: Any, layout_name: str | None) -> tuple[Any, str]:
    """``(view, layout)`` of a CUDA backend's ``[B, H, N, 2*D]`` layer (K = ``C[:D]``,
    V = ``C[D:]``): ``[B, H, N, 2, D]`` permuted into the physical order of ``layout_name``
    (logical order, strides unchecked, when None), after checking the strides follow that order."""
    shape = tuple(t.shape)
    if spec is not None:
        d = _check_plain_attention_spec(shape, spec)
    elif shape[1] == 1:
        raise LayoutError(
            f"KV cache tensor of shape {shape} (block_size {block_size}) is ambiguous without its KV cache "
            "spec: a one-head attention cache [B, 1, N, 2*D] or an MLA latent cache [B, 1, N, D]"
        )
    else:
        d = shape[3] // 2
    v = t.unflatten(3, (2, d))
    if layout_name is None:
        # No physical order claimed: the logical axes, whatever the strides (kvferry reads them).
        return v, "B H N KV D"
    perm = (*LAYER_VIEW_ORDER[layout_name][:3], 3, 4)
    # Each axis (of size > 1) must step over everything physically inside it.
    inner = 1
    for ax in reversed(perm):
        if v.shape[ax] > 1:
            if v.stride(ax) < inner:
                raise LayoutError(
                    f"KV cache tensor of shape {shape}, strides {tuple(t.stride())} (elements) does not have "
                    f"vLLM's {layout_name} layout: axis "
                    f"{_GPU_AXES[ax]} steps {v.stride(ax)} < {inner}"
                )
            inner = v.stride(ax) * v.shape[ax]
    return v.permute(*perm), " ".join(_GPU_AXES[a] for a in perm)


def layer_view(t: Any, block_size: int, spec: Any = None, kv_cache_layout: str | None = None, *,
               device_type: str | None = None) -> tuple[Any, str]:
    """``(view, layout)`` of one layer's KV cache tensor in kvferry's axis names (outermost
    first; strides are read from the view, so a permuted physical order is fine). ``spec`` is
    the layer's vLLM KV cache spec, or None where the connector has none; ``kv_cache_layout``
    vLLM's resolved layout name (``KVCacheConfig.kv_cache_layout``: ``LBNHC``/``NHD``,
    ``LBHNC``/``HND``, ``LHBNC``, ``BLHNC``, ``BLNHC``, ``BHLNC``), or None where unknown;
    ``device_type`` the device whose backend wrote the tensor (default: the tensor's own;
    tests pass ``"cuda"`` to lay CPU tensors out as a CUDA backend would).

    - MLA (``spec`` an ``MLAAttentionSpec``; vLLM 0.32 hands ``[B, 1, N, kv_lora_rank +
      qk_rope_head_dim]``): viewed as ``[B, N, D]`` = ``"B N D"`` (one part, no heads). Without a
      spec only a 3-D ``[B, N, D]`` tensor is taken as MLA.
    - vLLM CPU attention (0.32, ``cpu_attn.py``, layout ``LBHNC`` only): each layer's tensor is
      ``[B, H, N, 2 * D]`` (contiguous), which the kernel reads as ``[B, H, 2 * N, D]``: K in the
      first N rows of a block's head, V in the next. Viewed as ``[B, H, 2, N, D]`` =
      ``"B H KV N D"``. Without a spec only ``H > 1`` is taken as this (one head is also MLA's).
    - vLLM 0.32 CUDA FlashAttention, FlashInfer, Triton (``[B, H, N, 2 * D]`` logical view,
      K = ``C[:D]``, V = ``C[D:]``, docs/vllm-connector-notes.md §10): ``[B, H, N, 2, D]`` in the
      layout's physical order: ``"B N H KV D"`` for NHD (``LBNHC``, vLLM's default),
      ``"B H N KV D"`` for HND (``LBHNC``), ``"H B N KV D"`` for ``LHBNC``; logical
      ``"B H N KV D"`` when the layout is unknown. A spec must be plain (no NVFP4, per-token-head
      scales, packing, ``head_size_v != head_size``) and match H and C.
    - Older vLLM FlashAttention / FlashInfer: ``[2, B, N, H, D]`` = ``"KV B N H D"``.

    Raises :class:`LayoutError` for any other shape (N must be ``block_size``: kernel-block split
    views are not handled), for an MLA spec whose cache is packed or compressed (fp8_ds_mla,
    DeepSeek-V4), for a 4-D one-head tensor without a spec, for strides that contradict
    ``kv_cache_layout``, for an unknown layout name, and for a CPU tensor with a layout other
    than ``LBHNC``."""
    shape = tuple(t.shape)
    layout_name = resolved_layout_name(kv_cache_layout)
    device = device_type if device_type is not None else t.device.type
    if is_mla_spec(spec) or (spec is None and len(shape) == 3):
        return _mla_view(t, block_size, spec), "B N D"
    if len(shape) == 4 and device != "cpu" and shape[2] == block_size and shape[3] % 2 == 0:
        return _gpu_view(t, block_size, spec, layout_name)
    if len(shape) == 4 and device == "cpu" and shape[2] == block_size and shape[3] % 2 == 0:
        if spec is None and shape[1] == 1:
            raise LayoutError(
                f"KV cache tensor of shape {shape} (block_size {block_size}) is ambiguous without its KV cache "
                "spec: a one-head CPU attention cache [B, 1, N, 2*D] or an MLA latent cache [B, 1, N, D]"
            )
        if layout_name not in (None, "LBHNC") or not t.is_contiguous():
            raise LayoutError(
                f"CPU KV cache tensor of shape {shape}, strides {tuple(t.stride())}, layout {layout_name}: "
                "vLLM's CPU attention reads only a contiguous LBHNC (HND) cache"
            )
        b, h, n, d2 = shape
        return t.view(b, h, 2, n, d2 // 2), "B H KV N D"
    if len(shape) == 5 and shape[0] == 2 and shape[2] == block_size:
        return t, "KV B N H D"
    raise LayoutError(
        f"KV cache tensor of shape {shape} (block_size {block_size}, spec "
        f"{type(spec).__name__ if spec is not None else None}) has no known layout: expected "
        "[B, H, N, 2*D], [2, B, N, H, D], or MLA [B, 1, N, D] / [B, N, D]"
    )


def layer_layout(t: Any, block_size: int, spec: Any, kv_cache_layout: str | None = None, *,
                 device_type: str | None = None) -> LayerLayout:
    """The :class:`LayerLayout` of one layer's tensor (``spec``, ``kv_cache_layout`` and
    ``device_type`` as in :func:`layer_view`): the
    spec's class name as kind (``MLAAttentionSpec`` for a spec-less MLA tensor,
    ``FullAttentionSpec`` for other spec-less ones).

    An MLA latent is the same on every TP rank (vLLM's ``MLAAttentionSpec``: one KV head,
    ``max_tp_shards=1``) and has no H axis: the transport gives it global head 0 and never splits
    it (units.py). Its replica key stays ``(1, 0)``: the connector's Producers / Consumers hold
    one rank each (docs/python-verified-loads.md, "Ranks and processes"), each pair comparing its
    own copy, so every copy is checked by its own pair; a key ``(tp_size, tp_rank)`` is for a
    coordinator holding the whole TP grid (docs/design.md §2.3) and leaves a one-rank consumer's
    group "replica not checksummed". Raises :class:`LayoutError` as :func:`layer_view`."""
    view, layout = layer_view(t, block_size, spec, kv_cache_layout, device_type=device_type)
    if spec is not None:
        kind = type(spec).__name__
    else:
        kind = MLA_KIND if layout == "B N D" else FULL_KIND
    return LayerLayout(view, layout, kind)


def cpu_attention_isa(dtype: Any, block_size: int, head_size: int) -> str | None:
    """The kernel vLLM's CPU attention backend picks for a cache of ``dtype``, ``block_size``
    and ``head_size`` (``cpu_attn._get_attn_isa``: ``"vec"``, ``"vec16"``, ``"amx"``,
    ``"neon"``...); None where vLLM's CPU backend is not importable."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:  # not vLLM's CPU build, or another vLLM: nothing to tell
        return None
    return _get_attn_isa(dtype, block_size, head_size)


def kv_layout_tags(vllm_config: Any, kv_cache_config: Any, groups: Any) -> tuple[str | None, ...]:
    """Each KV cache group's layout tag, in ``groups`` order (kvferry.vllm.groups.GroupInfo):
    what decides how a block is laid out in memory beyond its shape, named in a producer's
    ``remote_kv_layouts`` and compared by its consumers (:func:`kvferry.vllm.params.kv_layout_refusal`).

    On vLLM's CPU build: an attention group's ``"CPU_ATTN:<isa>:<cache dtype>"``, ``<isa>`` the
    kernel ``cpu_attn._get_attn_isa`` picks for the group's block size and head size and the
    model's dtype, as the backend's metadata builder calls it (``vec``, ``vec16``, ``amx``,
    ``neon``...: each packs a block its own way, and which one runs depends on the host's CPU,
    AMX tiles above all); an MLA group's backend (``"AMX_MLA"`` where AMX tiles exist and the
    CPU_MLA backend was not asked for, else ``"CPU_MLA"``, as ``platforms/cpu.py`` picks it);
    several tags of one group (layers of other head sizes) joined by ``+``. None for a
    Mamba-type state group and on every other platform (CUDA backends lay blocks out by the
    shape and the resolved ``KVCacheLayout``, which kvferry reads from the strides)."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # no vLLM: nothing decides a layout beyond the shape
        return tuple(None for _ in groups)
    if not current_platform.is_cpu():
        return tuple(None for _ in groups)
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype = vllm_config.model_config.dtype
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    amx = current_platform.get_cpu_architecture().name == "X86" and torch.cpu._is_amx_tile_supported()
    specs = layer_specs(kv_cache_config)
    tags: list[str | None] = []
    for group in groups:
        if group.state:
            tags.append(None)
            continue
        found = set()
        for spec in [specs[n] for n in group.layer_names if n in specs] or [None]:
            if is_mla_spec(spec):
                found.add("AMX_MLA" if amx and getattr(backend, "name", None) != "CPU_MLA" else "CPU_MLA")
                continue
            head_size = getattr(spec, "head_size", None)
            isa = _get_attn_isa(dtype, group.block_size, head_size, cache_dtype)
            found.add(f"CPU_ATTN:{isa}:{cache_dtype}")
        tags.append("+".join(sorted(found)))
    return tuple(tags)


def cpu_vec_parts(view: Any) -> list[tuple[str, Any, str]]:
    """``(suffix, view, layout)`` of the K and V parts of one layer of vLLM 0.32's CPU attention
    cache under its ``vec`` kernel (``view``: the layer's ``"B H KV N D"`` view of
    :func:`layer_view`). That kernel writes each block's K transposed, dimension-major (``[D,
    N]``, so its dot products read one dimension of every token at once), and V token-major
    (``[N, D]``) (``ops.cpu_attn_reshape_and_cache``, measured on vLLM 0.32). Whole blocks move
    the same either way, but tokens moved one by one (different block sizes) need the real
    order, so the parts are described as two layers: ``.k`` as ``"B H D N"``, ``.v`` as
    ``"B H N D"``."""
    b, h, _, n, d = view.shape
    k = view[:, :, 0].flatten(2).unflatten(2, (d, n))
    return [("k", k, "B H D N"), ("v", view[:, :, 1], "B H N D")]
