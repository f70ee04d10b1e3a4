"""kvferry.vllm.layouts: the layout, kind and head placement chosen for one layer's tensor, from
vLLM 0.32's own KV cache spec classes (no engines, no sockets)."""

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
)

from kvferry.vllm.layouts import LayoutError, layer_layout, layer_specs, layer_view

MLA = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, max_tp_shards=1)
FULL = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=288, dtype=torch.bfloat16)


def test_one_tensor_two_specs_two_layouts():
    # vLLM 0.32 hands both as [B, H=1, N, C=576]: only the spec tells them apart.
    t = torch.zeros(4, 1, 16, 576, dtype=torch.bfloat16)
    mla = layer_layout(t, 16, MLA)
    assert (mla.layout, tuple(mla.view.shape), mla.kind) == ("B N D", (4, 16, 576), "MLAAttentionSpec")
    assert mla.view.data_ptr() == t.data_ptr() and mla.view.stride() == (16 * 576, 576, 1)
    full = layer_layout(t, 16, FULL)
    assert (full.layout, tuple(full.view.shape), full.kind) == ("B H KV N D", (4, 1, 2, 16, 288), "FullAttentionSpec")
    with pytest.raises(LayoutError, match="ambiguous"):
        layer_view(t, 16)


def test_cpu_attention_with_several_heads_needs_no_spec():
    view, layout = layer_view(torch.zeros(4, 2, 32, 128), 32)
    assert layout == "B H KV N D" and tuple(view.shape) == (4, 2, 2, 32, 64)


def test_packed_mla_cache_is_refused():
    packed = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.uint8, max_tp_shards=1,
                              cache_dtype_str="fp8_ds_mla", state_content_bytes=656)
    with pytest.raises(LayoutError, match="not a plain latent cache"):
        layer_view(torch.zeros(4, 1, 16, 656, dtype=torch.uint8), 16, packed)


def test_kind_without_a_spec_follows_the_layout():
    assert layer_layout(torch.zeros(4, 16, 576), 16, None).kind == "MLAAttentionSpec"
    assert layer_layout(torch.zeros(4, 2, 16, 8), 16, None).kind == "FullAttentionSpec"


def test_layer_specs_reads_groups_and_uniform_type_specs():
    other = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32, max_tp_shards=1)
    uniform = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a.0.attn": MLA, "a.1.attn": other})
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a.0.attn", "a.1.attn"], uniform),
        KVCacheGroupSpec(["b.2.attn"], FULL),
    ])
    assert layer_specs(cfg) == {"a.0.attn": MLA, "a.1.attn": other, "b.2.attn": FULL}
    assert layer_specs(None) == {}
