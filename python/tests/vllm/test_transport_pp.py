"""kvferry.vllm.transport between different PP sizes (layer units, units.py) without vLLM engines
(vLLM's CPU build cannot run PP > 1, docs/vllm-connector-notes.md §3): producer and consumer
ranks in this process over TCP on 127.0.0.1, 4 layers in vLLM's CPU layout ([B, H, N, 2 * D], 2
KV heads of 64), each rank holding its stage's layers (and its TP rank's heads)."""

import importlib.util
import time

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec

from transport_helpers import released_soon
from kvferry.outcomes import Release, ReleaseReason
from kvferry.vllm.metadata import LoadOrder, SendOrder
from kvferry.vllm.params import RemoteSource
from kvferry.vllm.transport import KvferryTransport, TransportConfig, layer_view
from kvferry.vllm.units import ConfigError

BLOCK = 32
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
PORT = 17800
REMOTE, LOCAL, TOKENS = (3, 0, 5), (7, 2, 6), 75


def caches(seed):
    """All 4 layers' KV of TP 1 (8 blocks): random from ``seed``, zeros when None."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return {name: torch.randn(8, 2, BLOCK, 128, generator=g) if g else torch.zeros(8, 2, BLOCK, 128)
            for name in LAYERS}


def rank_of(kv, stage, tp_rank=0, tp_size=1):
    """The KV tensors rank ``(tp_rank, stage)`` holds: the stage's layers ``[a, b)``, its heads
    (contiguous clones, as vLLM allocates them)."""
    h = 2 // tp_size
    return {name: kv[name][:, tp_rank * h:(tp_rank + 1) * h].clone() for name in LAYERS[stage[0]:stage[1]]}


def full_spec(t):
    """vLLM's spec of a CPU attention layer's ``[B, H, N, 2 * D]`` tensor, as the connector passes
    it: a one-head tensor is ambiguous by shape alone (layouts.py)."""
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=t.shape[1], head_size=t.shape[3] // 2, dtype=t.dtype)


def view_of(t):
    """``t`` in kvferry's axes (``B H KV N D``)."""
    return layer_view(t, BLOCK, full_spec(t))[0]


@pytest.fixture
def built():
    made = []

    def build(role, kv, port, stage, pp_rank=0, pp_size=1, tp_rank=0, tp_size=1, **cfg):
        t = KvferryTransport(TransportConfig(host="127.0.0.1", port=port, **cfg), tp_rank=tp_rank, pp_rank=pp_rank,
                             tp_size=tp_size, pp_size=pp_size, block_size=BLOCK, is_producer=role == "p",
                             is_consumer=role == "c", stage_layers=stage,
                             kv_cache_specs={name: full_spec(x) for name, x in kv.items()})
        made.append(t)
        t.register(kv)
        return t

    yield build
    for t in made:
        t.shutdown()


def serve(producers, tid):
    for p in producers:
        p.serve(SendOrder(request_id="p-" + tid, transfer_id=tid, block_ids=(REMOTE,), num_tokens=TOKENS,
                         lease_seconds=10.0, load_key="k-" + tid))


def load(consumer, tid, port, stages, tp_size=1, head_splits=1, layer_splits=1):
    """``consumer`` loads ``tid`` from a producer of PP stages ``stages`` (the reply's
    ``remote_stage_layers``)."""
    src = RemoteSource(transfer_id=tid, engine_id="e", host="127.0.0.1", port=port, tp_size=tp_size,
                       pp_size=len(stages), remote_block_ids=(REMOTE,), load_key="k-" + tid, head_splits=head_splits,
                       layer_splits=layer_splits, stage_layers=tuple(stages))
    spec = LoadOrder(request_id="d-" + tid, source=src, block_ids=(LOCAL,), num_tokens=TOKENS)
    return consumer.load(spec, time.monotonic() + 20)


def assert_landed(pkv, ckv, heads=(0, 2), cheads=None):
    """Every layer ``ckv`` holds equals ``pkv``'s (global KV, TP 1) on the loaded blocks, heads
    ``heads`` of the producer against ``cheads`` (default ``heads``) of the consumer."""
    cheads = cheads or heads
    assert ckv
    for name, t in ckv.items():
        pv, cv = view_of(pkv[name]), view_of(t)
        for rb, lb in zip(REMOTE, LOCAL):
            n = BLOCK if rb != REMOTE[-1] else TOKENS - 2 * BLOCK
            assert torch.equal(pv[rb, heads[0]:heads[1], :, :n], cv[lb, cheads[0]:cheads[1], :, :n]), (name, rb)



def test_equal_pp_with_stage_layers_stays_one_load_per_rank(built):
    port, stages = PORT, [(0, 2), (2, 4)]
    pkv = caches(1)
    producers = [built("p", rank_of(pkv, st), port, st, pp_rank=s, pp_size=2) for s, st in enumerate(stages)]
    ckvs = [rank_of(caches(None), st) for st in stages]
    consumers = [built("c", ckvs[s], port, st, pp_rank=s, pp_size=2) for s, st in enumerate(stages)]
    serve(producers, "t")
    for s, c in enumerate(consumers):
        r = load(c, "t", port, stages)
        assert r.ok and r.verdict == "verified", r
        assert list(c.consumers) == [(None, None)] and len(producers[s].producers) == 1
        assert_landed(pkv, ckvs[s])


def test_pp2_producer_to_pp1_consumer_loads_both_stages_verified(built):
    port, stages = PORT + 10, [(0, 2), (2, 4)]
    pkv, ckv = caches(2), caches(None)
    producers = [built("p", rank_of(pkv, st), port, st, pp_rank=s, pp_size=2) for s, st in enumerate(stages)]
    # Stage 1's one unit listens on port + 1 (port + pp * tp_size + tp, as before layer units).
    assert [p.producers[0].endpoint for p in producers] == [f"tcp://127.0.0.1:{port + s}" for s in (0, 1)]
    c = built("c", ckv, port, (0, 4))
    serve(producers, "t")
    r = load(c, "t", port, stages)
    assert r.ok and r.verdict == "verified", r
    assert_landed(pkv, ckv)
    # One Consumer per producer stage's layers besides the whole-rank one.
    assert sorted(k for k in c.consumers if k != (None, None)) == [((0, 2), None), ((2, 4), None)]
    assert [released_soon(p) for p in producers] == [[("p-t", ReleaseReason(Release.SERVED))]] * 2


def test_pp1_producer_split_in_two_layer_units_to_pp2_consumer_each_stage_loads_its_unit(built):
    port, stages = PORT + 20, [(0, 2), (2, 4)]
    pkv = caches(3)
    p = built("p", pkv, port, (0, 4), layer_splits=2)
    assert [q.endpoint for q in p.producers] == [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"]
    ckvs = [rank_of(caches(None), st) for st in stages]
    consumers = [built("c", ckvs[s], port, st, pp_rank=s, pp_size=2) for s, st in enumerate(stages)]
    serve([p], "t")
    r0 = load(consumers[0], "t", port, [(0, 4)], layer_splits=2)
    assert r0.ok and r0.verdict == "verified", r0
    # Layer unit 0 is served, layer unit 1 still holds the request: vLLM must not free its blocks yet.
    assert p.released() == []
    r1 = load(consumers[1], "t", port, [(0, 4)], layer_splits=2)
    assert r1.ok and r1.verdict == "verified", r1
    assert released_soon(p) == [("p-t", ReleaseReason(Release.SERVED))]
    for s, c in enumerate(consumers):
        # Each stage's layers are a whole unit: one load, no layer-subset Consumer.
        assert list(c.consumers) == [(None, None)]
        assert_landed(pkv, ckvs[s])


def test_tp2_pp2_producer_to_tp1_pp1_consumer_loads_four_units_verified(built):
    port, stages = PORT + 30, [(0, 2), (2, 4)]
    pkv, ckv = caches(4), caches(None)
    producers = [built("p", rank_of(pkv, st, tp, 2), port, st, pp_rank=s, pp_size=2, tp_rank=tp, tp_size=2)
                 for s, st in enumerate(stages) for tp in (0, 1)]
    c = built("c", ckv, port, (0, 4))
    serve(producers, "t")
    r = load(c, "t", port, stages, tp_size=2)
    assert r.ok and r.verdict == "verified", r
    assert_landed(pkv, ckv)
    assert sorted(k for k in c.consumers if k != (None, None)) == [
        (lay, heads) for lay in ((0, 2), (2, 4)) for heads in ((0, 1), (1, 2))]
    assert [released_soon(p) for p in producers] == [[("p-t", ReleaseReason(Release.SERVED))]] * 4


def test_tp1_pp1_producer_split_two_by_two_to_tp2_pp2_consumer_ranks_load_their_unit(built):
    port, stages = PORT + 40, [(0, 2), (2, 4)]
    pkv = caches(5)
    p = built("p", pkv, port, (0, 4), layer_splits=2, head_splits=2)
    # Head unit j of layer unit k: port + k * 2 + j.
    assert [q.endpoint for q in p.producers] == [f"tcp://127.0.0.1:{port + i}" for i in range(4)]
    serve([p], "t")
    for s, st in enumerate(stages):
        for tp in (0, 1):
            ckv = rank_of(caches(None), st, tp, 2)
            c = built("c", ckv, port, st, pp_rank=s, pp_size=2, tp_rank=tp, tp_size=2)
            r = load(c, "t", port, [(0, 4)], head_splits=2, layer_splits=2)
            assert r.ok and r.verdict == "verified", (s, tp, r)
            assert list(c.consumers) == [(None, None)]
            assert_landed(pkv, ckv, (tp, tp + 1), (0, 1))
    assert released_soon(p) == [("p-t", ReleaseReason(Release.SERVED))]


def test_a_flipped_bit_in_one_stages_landed_layers_fails_the_load(built):
    port, stages = PORT + 50, [(0, 2), (2, 4)]
    pkv, ckv = caches(6), caches(None)
    producers = [built("p", rank_of(pkv, st), port, st, pp_rank=s, pp_size=2) for s, st in enumerate(stages)]
    c = built("c", ckv, port, (0, 4))
    view = view_of(ckv[LAYERS[3]])

    def flip(landed):
        # Layer 3 (stage 1's unit), head 0, K, token 0, element 0 of the first landed block.
        view[landed["groups"][0]["local_blocks"][0], 0, 0, 0, 0] += 1.0

    c._consumer(None, (2, 4)).set_landed_hook(flip)
    serve(producers, "t")
    r = load(c, "t", port, stages)
    assert not r.ok and r.verdict == "mismatch", r
    assert "layers [2, 4)" in r.reason and "policy says" in r.reason, r


def test_a_consumer_stage_smaller_than_a_layer_unit_is_refused_with_what_to_set(built):
    port = PORT + 60
    p = built("p", caches(7), port, (0, 4))  # layer_splits 1: one unit of 4 layers
    c = built("c", rank_of(caches(None), (2, 4)), port, (2, 4), pp_rank=1, pp_size=2)
    serve([p], "t")
    r = load(c, "t", port, [(0, 4)])
    assert not r.ok and r.verdict == "unverified", r
    assert "layer unit 0 holds layers [0, 4), this PP stage holds [2, 4)" in r.reason, r
    assert "layer_splits 2" in r.reason, r
    # Refused before any transfer: no Consumer beyond the whole-rank one, the lease still held.
    assert list(c.consumers) == [(None, None)] and p.released() == []


def test_layer_splits_must_fit_the_stages_layers(built):
    with pytest.raises(ConfigError, match=r"layer_splits'\] = 3 exceeds the 2 layers \[2, 4\)"):
        built("p", rank_of(caches(None), (2, 4)), PORT + 70, (2, 4), pp_rank=1, pp_size=2, layer_splits=3)
    # A layer outside the stage's range would be in no unit.
    with pytest.raises(ConfigError, match=r"would be in no layer unit"):
        built("p", caches(None), PORT + 70, (0, 2), layer_splits=2)
    # A layer unit without any of the rank's layers (its stage range wider than its layers).
    with pytest.raises(ConfigError, match=r"layer unit \[2, 4\) holds none of this rank's KV cache layers"):
        built("p", rank_of(caches(None), (0, 2)), PORT + 70, (0, 4), layer_splits=2)
