"""kvferry.vllm.transport with a Mamba-type state group, without engines: a rank laid out as
vLLM's hybrid KV cache manager lays out a Mamba2 + full-attention model on CPU (the Mamba layer's
page handed to the connector as bytes, ``[B, 1, 1, page content]``; vLLM's own ``MambaSpec``),
producer and consumer in this process over TCP on 127.0.0.1. The state block moves and is
skipped by both checksums, so the attention group verifies; a producer of another TP size is
refused before any byte moves. The engine test is test_vllm_cpu_hybrid.py."""

import importlib.util
import time

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

from kvferry.vllm.groups import kv_cache_groups
from kvferry.vllm.layouts import layer_specs
from kvferry.vllm.metadata import LoadOrder, SendOrder
from kvferry.vllm.params import RemoteSource
from kvferry.vllm.transport import KvferryTransport, TransportConfig
from kvferry.vllm.units import ConfigError

ATTN, MIXER = "model.layers.1.self_attn.attn", "model.layers.0.mixer"
MAMBA = MambaSpec(block_size=256, shapes=((3, 288), (4, 64, 16)), dtypes=(torch.float32, torch.float32))
FULL = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32)
CONFIG = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec([MIXER], MAMBA), KVCacheGroupSpec([ATTN], FULL)])
STATE_BYTES = (3 * 288 + 4 * 64 * 16) * 4
PORT = 17855


def caches(seed):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    attn = torch.randn(8, 2, 128, 64, generator=g) if g else torch.zeros(8, 2, 128, 64)
    page = torch.randint(-128, 128, (8, 1, 1, STATE_BYTES), generator=g, dtype=torch.int8) if g else \
        torch.zeros(8, 1, 1, STATE_BYTES, dtype=torch.int8)
    return {MIXER: page, ATTN: attn}


def make(role, kv, port, **cfg):
    t = KvferryTransport(TransportConfig(host="127.0.0.1", port=port, **cfg), tp_rank=0, pp_rank=0, tp_size=1,
                         pp_size=1, block_size=128, is_producer=role == "p", is_consumer=role == "c",
                         kv_cache_specs=layer_specs(CONFIG), kv_cache_layout="LBHNC",
                         kv_cache_groups=kv_cache_groups(CONFIG, 128))
    t.register(kv)
    return t


def load(consumer, tid, port, tp_size=1):
    src = RemoteSource(transfer_id=tid, engine_id="e", host="127.0.0.1", port=port, tp_size=tp_size, pp_size=1,
                       remote_block_ids=((3,), (5,)), load_key="k-" + tid, block_sizes=(256, 128))
    return consumer.load(LoadOrder(request_id="d-" + tid, source=src, block_ids=((6,), (2,)), num_tokens=74),
                         time.monotonic() + 20)


@pytest.fixture
def pair():
    made = []

    def build(port):
        pkv, ckv = caches(1), caches(None)
        p, c = make("p", pkv, port), make("c", ckv, port)
        made.extend([p, c])
        for tid in ("t0", "t1"):
            p.serve(SendOrder(request_id="p-" + tid, transfer_id=tid, block_ids=((3,), (5,)), num_tokens=74,
                             lease_seconds=10.0, load_key="k-" + tid))
        return p, c, pkv, ckv

    yield build
    for t in made:
        t.shutdown()


def test_the_state_block_lands_and_the_attention_group_verifies(pair):
    p, c, pkv, ckv = pair(PORT)
    r = load(c, "t0", PORT)
    assert r.ok and r.verdict == "verified", r
    assert torch.equal(ckv[MIXER][6], pkv[MIXER][3])
    assert torch.equal(ckv[ATTN][2, :, :74], pkv[ATTN][5, :, :74])


def test_a_producer_of_another_tp_size_is_refused_before_any_byte_moves(pair):
    p, c, pkv, ckv = pair(PORT + 10)
    r = load(c, "t1", PORT + 10, tp_size=2)
    assert not r.ok and r.verdict == "unverified"
    assert "Mamba-type state is split across TP ranks" in r.reason
    assert not ckv[MIXER].any() and not ckv[ATTN].any()


def test_head_splits_with_a_state_group_is_refused_at_start_up():
    with pytest.raises(ConfigError, match="holds Mamba-type state, which is not split by KV heads"):
        make("p", caches(1), PORT + 20, head_splits=2)
