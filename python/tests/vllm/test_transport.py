"""kvferry.vllm.transport without engines: producer ranks and consumer ranks in this process over
TCP on 127.0.0.1, KV in vLLM's CPU layout ([B, H, N, 2 * D] per layer, 2 KV heads of 64), equal
and different TP sizes (units of KV heads, units.py). Seconds, not minutes: the engine tests
(test_vllm_cpu.py) cover the same path inside vLLM."""

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
from kvferry.vllm.transport import KvferryTransport, LayoutError, TransportConfig, layer_view
from kvferry.vllm.units import ConfigError

BLOCK = 32
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PORT = 17655


def caches(num_blocks, seed):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return {name: (torch.randn(num_blocks, 2, BLOCK, 128, generator=g) if g else torch.zeros(num_blocks, 2, BLOCK, 128))
            for name in LAYERS}


def full_spec(t):
    """vLLM's spec of a CPU attention layer's ``[B, H, N, 2 * D]`` tensor, as the connector passes
    it: a one-head tensor is ambiguous by shape alone (layouts.py)."""
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=t.shape[1], head_size=t.shape[3] // 2, dtype=t.dtype)


def make(role, kv, port, tp_rank=0, tp_size=1, **cfg):
    specs = {name: full_spec(t) for name, t in kv.items()}
    t = KvferryTransport(TransportConfig(host="127.0.0.1", port=port, **cfg), tp_rank=tp_rank, pp_rank=0,
                         tp_size=tp_size, pp_size=1, block_size=BLOCK, is_producer=role == "p",
                         is_consumer=role == "c", kv_cache_specs=specs)
    t.register(kv)
    return t


def rank_slice(kv, tp_rank, tp_size):
    """TP rank ``tp_rank``'s own KV tensors (its heads, contiguous, as vLLM allocates them)."""
    h = next(iter(kv.values())).shape[1] // tp_size
    return {name: t[:, tp_rank * h:(tp_rank + 1) * h].clone() for name, t in kv.items()}


def serve(producers, tid, num_tokens=75, remote=(3, 0, 5)):
    for p in producers:
        p.serve(SendOrder(request_id="p-" + tid, transfer_id=tid, block_ids=(remote,), num_tokens=num_tokens,
                         lease_seconds=10.0, load_key="k-" + tid))


def load(consumer, tid, port, num_tokens=75, remote=(3, 0, 5), local=(7, 2, 6), tp_size=1, head_splits=1,
         pp_size=1):
    src = RemoteSource(transfer_id=tid, engine_id="e", host="127.0.0.1", port=port, tp_size=tp_size,
                       pp_size=pp_size, remote_block_ids=(remote,), load_key="k-" + tid, head_splits=head_splits)
    spec = LoadOrder(request_id="d-" + tid, source=src, block_ids=(local,), num_tokens=num_tokens)
    return consumer.load(spec, time.monotonic() + 20)


def send_and_load(producer, consumer, tid, port, num_tokens=75, remote=(3, 0, 5), local=(7, 2, 6)):
    serve([producer], tid, num_tokens, remote)
    return load(consumer, tid, port, num_tokens, remote, local)


def assert_landed(pkv, ckv, pheads, cheads=None, remote=(3, 0, 5), local=(7, 2, 6), last_tokens=11):
    """The consumer's local heads ``cheads`` (default ``pheads``) of the loaded blocks equal the
    producer's local heads ``pheads``, every layer (``[start, end)`` of the tensors' H axis)."""
    cheads = cheads or pheads
    for name in LAYERS:
        pv = layer_view(pkv[name], BLOCK, full_spec(pkv[name]))[0]
        cv = layer_view(ckv[name], BLOCK, full_spec(ckv[name]))[0]
        for rb, lb in zip(remote, local):
            # The last block holds 75 - 64 = 11 tokens: compare those rows of K and V.
            n = BLOCK if rb != remote[-1] else last_tokens
            assert torch.equal(pv[rb, pheads[0]:pheads[1], :, :n], cv[lb, cheads[0]:cheads[1], :, :n]), (name, rb)


@pytest.fixture
def pair():
    made = []

    def build(port, **cfg):
        pkv, ckv = caches(8, seed=1), caches(8, seed=None)
        p, c = make("p", pkv, port), make("c", ckv, port, **cfg)
        made.extend([p, c])
        return p, c, pkv, ckv

    yield build
    for t in made:
        t.shutdown()


def test_load_lands_the_producers_blocks_verified_and_releases_the_send(pair):
    p, c, pkv, ckv = pair(PORT)
    r = send_and_load(p, c, "t0", PORT)
    assert r.ok and r.verdict == "verified", r
    assert_landed(pkv, ckv, (0, 2))
    # Equal TP, one unit: one Consumer over the whole rank, one load.
    assert list(c.consumers) == [(None, None)] and len(p.producers) == 1
    end = time.monotonic() + 10
    released = []
    while not released and time.monotonic() < end:
        released = p.released()
        time.sleep(0.05)
    assert released == [("p-t0", ReleaseReason(Release.SERVED))]


def test_auto_is_the_default_protocol_and_each_rank_logs_its_choice_once(pair, caplog):
    assert TransportConfig(host="h", port=1).protocol == "auto"
    with caplog.at_level("INFO", logger="vllm.kvferry"):
        p, c, _, _ = pair(PORT + 90)
    lines = [r.getMessage() for r in caplog.records if "protocol 'auto' -> transport" in r.getMessage()]
    assert len(lines) == 2, lines  # one producer rank, one consumer rank
    assert all("transport tcp (no usable RDMA device or a build without RDMA; kvferry's log says which)" in line
               or "transport rdma" in line for line in lines), lines
    # No secret_file: each rank says it runs in open mode.
    assert all(line.endswith(", open mode") for line in lines), lines
    assert p.transport in ("tcp", "rdma") and c.transport == p.transport


def free_range(n):
    """``n`` TCP ports on 127.0.0.1 free a moment ago: ``(first, "LO-HI")``."""
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            lo = s.getsockname()[1]
        if lo + n - 1 > 65535:
            continue
        try:
            for port in range(lo, lo + n):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", port))
        except OSError:
            continue
        return lo, f"{lo}-{lo + n - 1}"


def test_engine_ports_bind_every_ranks_engines_in_the_range_and_loads_still_verify():
    lo, ports = free_range(8)
    pkv, ckv = caches(8, seed=1), caches(8, seed=None)
    p = make("p", pkv, PORT + 95, engine_ports=ports)
    c = make("c", ckv, PORT + 95, engine_ports=ports)
    try:
        segments = [s for e in (*p.producers, *c.consumers.values()) for s in e.segments]
        assert len(segments) == 2 and all(lo <= int(s.rsplit(":", 1)[1]) < lo + 8 for s in segments), segments
        r = send_and_load(p, c, "t-ports", PORT + 95)
        assert r.ok and r.verdict == "verified", r
    finally:
        p.shutdown()
        c.shutdown()


def test_a_flipped_landed_bit_is_a_mismatch_and_not_ok(pair):
    p, c, _, ckv = pair(PORT + 10, test_corrupt_transfer_prefix="bad-")
    r = send_and_load(p, c, "bad-0", PORT + 10)
    assert not r.ok and r.verdict == "mismatch", r
    # Same transport, a transfer id without the prefix: untouched, verified.
    assert send_and_load(p, c, "good-0", PORT + 10).verdict == "verified"


def test_a_wrong_load_key_does_not_land(pair):
    p, c, _, _ = pair(PORT + 20)
    p.serve(SendOrder(request_id="p", transfer_id="t", block_ids=((1,),), num_tokens=5, lease_seconds=10.0,
                     load_key="right"))
    src = RemoteSource(transfer_id="t", engine_id="e", host="127.0.0.1", port=PORT + 20, tp_size=1, pp_size=1,
                       remote_block_ids=((1,),), load_key="wrong")
    r = c.load(LoadOrder(request_id="d", source=src, block_ids=((2,),), num_tokens=5), time.monotonic() + 20)
    assert not r.ok and "did not land" in r.reason


def test_different_pp_sizes_without_the_producers_stage_layers_are_refused_before_any_transfer(pair):
    p, c, _, _ = pair(PORT + 30)
    serve([p], "t")
    r = load(c, "t", PORT + 30, pp_size=2)
    assert not r.ok and r.verdict == "unverified" and "did not send its stages' layer ranges" in r.reason, r
    assert list(c.consumers) == [(None, None)]


@pytest.fixture
def built():
    made = []

    def build(role, kv, port, **kw):
        t = make(role, kv, port, **kw)
        made.append(t)
        return t

    yield build
    for t in made:
        t.shutdown()



def test_tp2_producer_to_tp1_consumer_loads_both_ranks_units_verified(built):
    port = PORT + 40
    pkv, ckv = caches(8, seed=2), caches(8, seed=None)
    producers = [built("p", rank_slice(pkv, r, 2), port, tp_rank=r, tp_size=2) for r in (0, 1)]
    c = built("c", ckv, port)
    serve(producers, "t")
    r = load(c, "t", port, tp_size=2)
    assert r.ok and r.verdict == "verified", r
    assert_landed(pkv, ckv, (0, 2))
    # One Consumer per producer unit (a head each) besides the whole-rank one.
    assert sorted(k for k in c.consumers if k != (None, None)) == [(None, (0, 1)), (None, (1, 2))]
    assert [released_soon(p) for p in producers] == [[("p-t", ReleaseReason(Release.SERVED))]] * 2


def test_tp1_producer_split_in_two_to_tp2_consumer_each_rank_loads_its_unit(built):
    port = PORT + 50
    pkv = caches(8, seed=3)
    p = built("p", pkv, port, head_splits=2)
    assert [q.endpoint for q in p.producers] == [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"]
    ckvs = [rank_slice(caches(8, seed=None), r, 2) for r in (0, 1)]
    consumers = [built("c", ckvs[r], port, tp_rank=r, tp_size=2) for r in (0, 1)]
    serve([p], "t")
    r0 = load(consumers[0], "t", port, head_splits=2)
    assert r0.ok and r0.verdict == "verified", r0
    # Unit 0 is served, unit 1 still holds the request: vLLM must not free its blocks yet.
    assert p.released() == []
    r1 = load(consumers[1], "t", port, head_splits=2)
    assert r1.ok and r1.verdict == "verified", r1
    assert released_soon(p) == [("p-t", ReleaseReason(Release.SERVED))]
    for rank, c in enumerate(consumers):
        # Each consumer rank's one KV head is a whole unit: one load, no sliced Consumer.
        assert list(c.consumers) == [(None, None)]
        assert_landed(pkv, ckvs[rank], (rank, rank + 1), (0, 1))


def test_a_flipped_bit_in_one_units_landed_blocks_fails_the_load(built):
    port = PORT + 60
    pkv, ckv = caches(8, seed=4), caches(8, seed=None)
    producers = [built("p", rank_slice(pkv, r, 2), port, tp_rank=r, tp_size=2) for r in (0, 1)]
    c = built("c", ckv, port)
    view = layer_view(ckv[LAYERS[0]], BLOCK, full_spec(ckv[LAYERS[0]]))[0]

    def flip(landed):
        # Head 1 (unit (1, 2)), K, token 0, element 0 of the first landed block.
        view[landed["groups"][0]["local_blocks"][0], 1, 0, 0, 0] += 1.0

    c._consumer((1, 2)).set_landed_hook(flip)
    serve(producers, "t")
    r = load(c, "t", port, tp_size=2)
    assert not r.ok and r.verdict == "mismatch", r
    assert "KV heads [1, 2)" in r.reason and "policy says" in r.reason, r


def test_a_consumer_rank_smaller_than_a_unit_is_refused_with_what_to_set(built):
    port = PORT + 70
    pkv = caches(8, seed=5)
    p = built("p", pkv, port)  # head_splits 1: one unit of 2 heads
    c = built("c", rank_slice(caches(8, seed=None), 1, 2), port, tp_rank=1, tp_size=2)
    serve([p], "t")
    r = load(c, "t", port)
    assert not r.ok and r.verdict == "unverified", r
    assert "producer units hold 2 KV heads, this rank holds 1" in r.reason, r
    assert "head_splits 2" in r.reason, r
    # Refused before any transfer: no Consumer beyond the whole-rank one, the lease still held.
    assert list(c.consumers) == [(None, None)] and p.released() == []


def test_head_splits_must_divide_the_ranks_heads():
    with pytest.raises(ConfigError, match="does not divide this rank's 2 KV heads"):
        make("p", caches(2, seed=None), PORT + 80, head_splits=3)


def test_unknown_layout_is_a_clear_error():
    with pytest.raises(LayoutError, match="no known layout"):
        layer_view(torch.zeros(4, 3, 5), BLOCK)
