"""vLLM's CPU attention cache as its ``vec`` kernel writes it (``ops.cpu_attn_reshape_and_cache``):
K dimension-major, V token-major in each block, so kvferry describes the two parts as layers of
their own (kvferry.vllm.layouts.cpu_vec_parts) and tokens moved one by one between different
block sizes land where the kernel reads them. Skipped where vLLM's CPU build is missing."""

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

import torch

from kvferry.vllm.layouts import cpu_vec_parts, layer_view


@pytest.mark.parametrize("block_size", [32, 64])
def test_the_vec_kernels_k_and_v_are_read_back_token_by_token(block_size):
    ops = pytest.importorskip("vllm._custom_ops")
    blocks, heads, d, tokens = 3, 2, 64, 75
    cache = torch.zeros(blocks, heads, block_size, 2 * d)
    k_cache, v_cache = cache.view(blocks, heads, 2 * block_size, d).chunk(2, dim=2)
    key, value = torch.randn(tokens, heads, d), torch.randn(tokens, heads, d)
    # Tokens 0..74 into blocks 2, 0, 1 (a scattered table).
    table = [2, 0, 1]
    slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(tokens)])
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, "vec")
    view, layout = layer_view(cache, block_size)
    assert layout == "B H KV N D"
    (ks, k, k_layout), (vs, v, v_layout) = cpu_vec_parts(view)
    assert (ks, k_layout, vs, v_layout) == ("k", "B H D N", "v", "B H N D")
    for t in range(tokens):
        b, n = table[t // block_size], t % block_size
        assert torch.equal(k[b, :, :, n], key[t]), t
        assert torch.equal(v[b, :, n, :], value[t]), t
        # The plain "B H KV N D" view reads V right but not K (it is why K is a part of its own).
        assert torch.equal(view[b, :, 1, n], value[t])
    assert not torch.equal(view[table[0], :, 0, 1], key[1])
