"""kvferry.vllm.connector's engine-level checks without an engine: which KV cache groups the
connector moves (full attention and sliding window under vLLM's hybrid KV cache manager) and
which it refuses at start-up with the reason (chunked local attention, Mamba-type state kept per
block boundary or with speculative blocks), vLLM's own ``MambaSpec`` as a state group, and
each data-parallel engine's own side-channel base port."""

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

import torch
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        MambaSpec, SlidingWindowSpec)

from kvferry.vllm.connector import engine_port, port_range
from kvferry.vllm.groups import GroupInfo, block_size_refusal, kv_cache_groups
from kvferry.vllm.layouts import LayoutError
from kvferry.vllm.params import unit_port
from kvferry.vllm.units import ConfigError

FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
SLIDING = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=128)


def config(*groups):
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=list(groups))


def test_one_kv_cache_group_is_one_group_of_its_block_size():
    assert kv_cache_groups(config(KVCacheGroupSpec(["l.0.attn", "l.1.attn"], FULL)), 32) == [
        GroupInfo(0, ("l.0.attn", "l.1.attn"), 16, None)]
    assert kv_cache_groups(None, 32) == [GroupInfo(0, (), 32, None)]


def test_a_hybrid_models_sliding_window_and_full_groups_are_each_moved_with_their_window():
    hybrid = config(KVCacheGroupSpec(["l.0.attn"], SLIDING), KVCacheGroupSpec(["l.1.attn"], FULL))
    assert kv_cache_groups(hybrid, 16) == [GroupInfo(0, ("l.0.attn",), 16, 128), GroupInfo(1, ("l.1.attn",), 16, None)]


MAMBA = MambaSpec(block_size=256, shapes=((3, 288), (4, 64, 16)), dtypes=(torch.float32, torch.float32))


def test_a_mamba_state_group_is_moved_as_a_state_group_of_its_block_size():
    hybrid = config(KVCacheGroupSpec(["l.0.mixer"], MAMBA), KVCacheGroupSpec(["l.1.attn"], FULL))
    assert kv_cache_groups(hybrid, 16) == [GroupInfo(0, ("l.0.mixer",), 256, None, state=True),
                                           GroupInfo(1, ("l.1.attn",), 16, None)]


@pytest.mark.parametrize("mode", ["all", "align"])
def test_a_mamba_state_kept_per_block_boundary_is_refused_at_start_up_with_the_reason(mode):
    spec = MambaSpec(block_size=256, shapes=((3, 288),), dtypes=(torch.float32,), mamba_cache_mode=mode)
    with pytest.raises(ConfigError, match=f"group 1 holds layer 'l.1.mixer' with MambaSpec: mamba_cache_mode '{mode}'"):
        kv_cache_groups(config(KVCacheGroupSpec(["l.0.attn"], FULL), KVCacheGroupSpec(["l.1.mixer"], spec)), 16)


def test_speculative_mamba_state_blocks_are_refused_at_start_up_with_the_reason():
    spec = MambaSpec(block_size=256, shapes=((3, 288),), dtypes=(torch.float32,), num_speculative_blocks=2)
    with pytest.raises(ConfigError, match="speculative decoding's scratch state blocks"):
        kv_cache_groups(config(KVCacheGroupSpec(["l.1.mixer"], spec)), 16)


def test_a_state_group_refuses_a_producer_of_another_block_size_before_any_byte_moves():
    why = block_size_refusal((512, 16), (256, 16), (None, None), 75, 0, (True, False))
    assert why is not None and "group 0 holds Mamba-type state" in why
    assert block_size_refusal((256, 16), (256, 32), (None, None), 75, 0, (True, False)) is None


def test_state_parts_are_views_of_vllms_mamba_state_tensors():
    from kvferry.vllm.transport import state_parts

    # As vLLM lays a Mamba2 layer out: both state tensors inside one padded page per block.
    page = torch.zeros(4, 16384)
    conv = torch.as_strided(page, (4, 3, 288), (16384, 288, 1))
    ssm = torch.as_strided(page, (4, 4, 64, 16), (16384, 1024, 16, 1), 3 * 288)
    parts = state_parts("l.0.mixer", [conv, ssm])
    assert [(n, tuple(v.shape)) for n, v in parts] == [("l.0.mixer.state0", (4, 1, 864)),
                                                       ("l.0.mixer.state1", (4, 1, 4096))]
    parts[1][1][2, 0, 5] = 7.0
    assert ssm[2].flatten()[5] == 7.0 and page[2, 3 * 288 + 5] == 7.0
    with pytest.raises(LayoutError, match="a block's state is not contiguous"):
        state_parts("l.0.mixer", [conv.transpose(1, 2)])


def test_chunked_local_attention_is_refused_with_the_reason():
    chunked = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32,
                                        attention_chunk_size=64)
    with pytest.raises(ConfigError, match="ChunkedLocalAttentionSpec: chunked local attention"):
        kv_cache_groups(config(KVCacheGroupSpec(["l.0.attn"], chunked)), 16)


def test_dp_engines_get_disjoint_port_ranges_from_their_own_base():
    # TP 2 x PP 2, layer_splits 3, head_splits 2: 24 ports per engine.
    bases = [engine_port(17500, d, 2, 2, 2, 3) for d in range(3)]
    assert bases == [17500, 17524, 17548]
    used = [{unit_port(b, tp, pp, 2, 2, j, 3, k) for tp in range(2) for pp in range(2) for j in range(2)
             for k in range(3)} for b in bases]
    assert [len(u) for u in used] == [24, 24, 24]
    assert not (used[0] & used[1]) and not (used[1] & used[2])
    assert [(min(u), max(u)) for u in used] == [(17500, 17523), (17524, 17547), (17548, 17571)]


def test_dp_rank_0_keeps_the_configured_port_and_a_range_past_65535_is_refused():
    assert engine_port(17500, 0, 1, 1, 1, 1) == 17500
    assert engine_port(65534, 0, 2, 1, 1, 1) == 65534
    with pytest.raises(ConfigError, match="past 65535"):
        engine_port(65534, 1, 2, 1, 1, 1)


def test_rdma_devices_one_list_for_all_workers_or_one_entry_per_local_rank():
    from kvferry.vllm.transport import rdma_devices_for

    assert rdma_devices_for(None, 3) == ""
    assert rdma_devices_for("mlx5_0,mlx5_1", 3) == "mlx5_0,mlx5_1"
    assert [rdma_devices_for(["mlx5_0", "mlx5_1"], r) for r in (0, 1)] == ["mlx5_0", "mlx5_1"]
    with pytest.raises(ConfigError, match="2 entries; this worker's local rank is 2"):
        rdma_devices_for(["mlx5_0", "mlx5_1"], 2)
    with pytest.raises(ConfigError, match="expected a string"):
        rdma_devices_for(7, 0)


def test_engine_ports_is_a_range_or_one_port_and_anything_else_is_refused():
    assert port_range("20000-20099") == "20000-20099"
    assert port_range(" 20000 - 20001 ") == "20000-20001"
    assert port_range(20000) == "20000-20000"
    for bad in ("", "0-5", "20-10", "1-65536", "a-b", "5-", "-5", True, [20000, 20001], None):
        with pytest.raises(ConfigError, match="engine_ports"):
            port_range(bad)
