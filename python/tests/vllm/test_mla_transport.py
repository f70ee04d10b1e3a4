"""MLA latent caches through kvferry.vllm.transport without engines: a producer rank and a
consumer rank in this process over TCP on 127.0.0.1, each layer's cache as vLLM 0.32 hands it
to ``register_kv_caches`` for DeepSeek-V2/V3 (``[B, 1, N, 576]``, spec ``MLAAttentionSpec``;
docs/vllm-connector-notes.md §9), plus older vLLM's 3-D ``[B, N, 576]``."""

import importlib.util
import time

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

import torch
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from kvferry.vllm.layouts import LayoutError
from kvferry.vllm.metadata import LoadOrder, SendOrder
from kvferry.vllm.params import RemoteSource
from kvferry.vllm.transport import KvferryTransport, TransportConfig

BLOCK = 16  # vLLM's CPU MLA backend forces block_size 16
LATENT = 576  # kv_lora_rank 512 + qk_rope_head_dim 64
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PORT = 17755


def spec(dtype):
    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LATENT, dtype=dtype, max_tp_shards=1)


def caches(shape, dtype, seed):
    if seed is None:
        return {n: torch.zeros(shape, dtype=dtype) for n in LAYERS}
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(dtype) for n in LAYERS}


def make(role, kv, port, specs, tp_rank=0, tp_size=1, **cfg):
    t = KvferryTransport(TransportConfig(host="127.0.0.1", port=port, **cfg), tp_rank=tp_rank, pp_rank=0,
                         tp_size=tp_size, pp_size=1, block_size=BLOCK, is_producer=role == "p",
                         is_consumer=role == "c", kv_cache_specs=specs)
    t.register(kv)
    return t


def send_and_load(producer, consumer, tid, port, tp_size=1, num_tokens=43, remote=(3, 0, 5), local=(7, 2, 6)):
    if producer is not None:  # None: already served
        producer.serve(SendOrder(request_id="p-" + tid, transfer_id=tid, block_ids=(remote,), num_tokens=num_tokens,
                                lease_seconds=10.0, load_key="k-" + tid))
    src = RemoteSource(transfer_id=tid, engine_id="e", host="127.0.0.1", port=port, tp_size=tp_size, pp_size=1,
                       remote_block_ids=(remote,), load_key="k-" + tid)
    spec_ = LoadOrder(request_id="d-" + tid, source=src, block_ids=(local,), num_tokens=num_tokens)
    return consumer.load(spec_, time.monotonic() + 20)


@pytest.fixture
def pair():
    made = []

    def build(port, shape, dtype, specs, **kw):
        pkv, ckv = caches(shape, dtype, seed=1), caches(shape, dtype, seed=None)
        cfg = {k: v for k, v in kw.items() if k == "test_corrupt_transfer_prefix"}
        ranks = {k: v for k, v in kw.items() if k != "test_corrupt_transfer_prefix"}
        p = make("p", pkv, port, specs, **ranks)
        made.append(p)
        c = make("c", ckv, port, specs, **ranks, **cfg)
        made.append(c)
        return p, c, pkv, ckv

    yield build
    for t in made:
        t.shutdown()


def _assert_landed(pkv, ckv, num_tokens=43, remote=(3, 0, 5), local=(7, 2, 6)):
    for name in LAYERS:
        pv, cv = pkv[name].view(pkv[name].shape[0], -1, LATENT), ckv[name].view(ckv[name].shape[0], -1, LATENT)
        for i, (rb, lb) in enumerate(zip(remote, local)):
            n = min(BLOCK, num_tokens - i * BLOCK)
            # Byte-equal: compare the raw bits, not the values.
            assert torch.equal(pv[rb, :n].view(torch.uint8), cv[lb, :n].view(torch.uint8)), (name, rb, lb)
        untouched = [b for b in range(cv.shape[0]) if b not in local]
        assert not cv[untouched].view(torch.uint8).any(), "bytes outside the load's blocks changed"


def test_mla_cache_vllm_0_32_lands_byte_equal_and_verified(pair):
    p, c, pkv, ckv = pair(PORT, (8, 1, BLOCK, LATENT), torch.bfloat16, {n: spec(torch.bfloat16) for n in LAYERS})
    assert {layout for _, layout, _ in c._views.values()} == {"B N D"}
    r = send_and_load(p, c, "t0", PORT)
    assert r.ok and r.verdict == "verified", r
    _assert_landed(pkv, ckv)


def test_mla_cache_3d_without_spec_lands_verified(pair):
    # Older vLLM's MLA shape [num_blocks, block_size, head_size]; 3-D is unambiguous without a spec.
    p, c, pkv, ckv = pair(PORT + 10, (8, BLOCK, LATENT), torch.float32, {})
    assert list(c._kinds.values()) == ["MLAAttentionSpec"] * 2
    r = send_and_load(p, c, "t1", PORT + 10)
    assert r.ok and r.verdict == "verified", r
    _assert_landed(pkv, ckv)


def test_mla_on_tp_rank_1_verifies_its_own_copy(pair):
    # Every TP rank holds the whole latent cache; rank 1's pair compares rank 1's copy.
    p, c, pkv, ckv = pair(PORT + 20, (8, 1, BLOCK, LATENT), torch.bfloat16, {n: spec(torch.bfloat16) for n in LAYERS},
                          tp_rank=1, tp_size=2)
    r = send_and_load(p, c, "t2", PORT + 20, tp_size=2)
    assert r.ok and r.verdict == "verified", r
    _assert_landed(pkv, ckv)


@pytest.mark.parametrize("producer_tp, consumer_tp", [(1, 2), (2, 1)])
def test_mla_between_different_tp_sizes_is_refused_unverified(producer_tp, consumer_tp):
    # Every rank holds the whole latent; one transfer id, as the connector publishes it on every
    # producer rank. TP 1 -> TP 2 would have both consumer ranks load producer rank 0's lease,
    # served once (docs/design.md §4.6); TP 2 -> TP 1 would leave producer rank 1's unloaded.
    port = PORT + 50
    pkv = caches((8, 1, BLOCK, LATENT), torch.bfloat16, seed=3)
    specs = {n: spec(torch.bfloat16) for n in LAYERS}
    made = []
    try:
        made += [make("p", pkv, port, specs, tp_rank=r, tp_size=producer_tp) for r in range(producer_tp)]
        ckvs = [caches((8, 1, BLOCK, LATENT), torch.bfloat16, seed=None) for _ in range(consumer_tp)]
        consumers = [make("c", ckvs[r], port, specs, tp_rank=r, tp_size=consumer_tp) for r in range(consumer_tp)]
        made += consumers
        for r in range(consumer_tp):
            out = send_and_load(made[0] if r == 0 else None, consumers[r], "x", port, tp_size=producer_tp)
            assert not out.ok and out.verdict == "unverified", (r, out)
            assert f"same TP size ({consumer_tp}), not {producer_tp}" in out.reason, out.reason
            assert not any(v.view(torch.uint8).any() for v in ckvs[r].values()), "a refused load wrote bytes"
    finally:
        for t in made:
            t.shutdown()


def test_mla_flipped_landed_bit_is_a_mismatch(pair):
    p, c, _, ckv = pair(PORT + 30, (8, 1, BLOCK, LATENT), torch.bfloat16, {n: spec(torch.bfloat16) for n in LAYERS},
                        test_corrupt_transfer_prefix="bad-")
    r = send_and_load(p, c, "bad-0", PORT + 30)
    assert not r.ok and r.verdict == "mismatch", r
    assert send_and_load(p, c, "good-0", PORT + 30).verdict == "verified"


@pytest.mark.parametrize("shape, specs, match", [
    # 3-D, tokens per block other than block_size
    ((8, 2 * BLOCK, LATENT), {}, "no known layout"),
    # 3-D, latent size other than the spec's head_size
    ((8, BLOCK, 512), {n: spec(torch.float32) for n in LAYERS}, "no known layout"),
    # 4-D MLA spec with more than one head
    ((8, 2, BLOCK, LATENT), {n: spec(torch.float32) for n in LAYERS}, "no known layout"),
    # 4-D one head without a spec: CPU attention or MLA cannot be told apart
    ((8, 1, BLOCK, LATENT), {}, "ambiguous"),
])
def test_wrong_mla_shapes_are_layout_errors(shape, specs, match):
    with pytest.raises(LayoutError, match=match):
        make("c", caches(shape, torch.float32, seed=None), PORT + 40, specs)


def test_mla_layers_reach_kvferry_with_kind_mla(monkeypatch):
    # The kind feeds the layer fingerprint (docs/design.md §2.3): vLLM's own spec class name.
    import kvferry

    seen = []
    real = kvferry.KVCacheLayer

    def recording(name, view, layout, **kw):
        seen.append((name, layout, kw["kind"], kw["head_offset"]))
        return real(name, view, layout, **kw)

    monkeypatch.setattr(kvferry, "KVCacheLayer", recording)
    t = make("c", caches((8, 1, BLOCK, LATENT), torch.float32, seed=None), PORT + 60,
             {n: spec(torch.float32) for n in LAYERS}, tp_rank=1, tp_size=2)
    t.shutdown()
    assert seen == [(n, "B N D", "MLAAttentionSpec", 0) for n in LAYERS]
