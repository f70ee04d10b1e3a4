"""kvferry.vllm.transport without engines: a producer rank and a consumer rank in this process
over TCP on 127.0.0.1, KV in vLLM's CPU layout ([B, H, N, 2 * D] per layer). Seconds, not
minutes: the engine tests (test_vllm_cpu.py) cover the same path inside vLLM."""

import importlib.util
import time

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

import torch

from kvferry.vllm.metadata import LoadSpec, SendSpec
from kvferry.vllm.params import RemoteSource
from kvferry.vllm.transport import KvferryTransport, LayoutError, TransportConfig, layer_view

BLOCK = 32
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PORT = 17655


def caches(num_blocks, seed):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return {name: (torch.randn(num_blocks, 2, BLOCK, 128, generator=g) if g else torch.zeros(num_blocks, 2, BLOCK, 128))
            for name in LAYERS}


def make(role, kv, port, **cfg):
    t = KvferryTransport(TransportConfig(host="127.0.0.1", port=port, **cfg), tp_rank=0, pp_rank=0, tp_size=1,
                         pp_size=1, block_size=BLOCK, is_producer=role == "p", is_consumer=role == "c")
    t.register(kv)
    return t


def send_and_load(producer, consumer, tid, port, num_tokens=75, remote=(3, 0, 5), local=(7, 2, 6)):
    producer.serve(SendSpec(request_id="p-" + tid, transfer_id=tid, block_ids=(remote,), num_tokens=num_tokens,
                            lease_seconds=10.0, load_key="k-" + tid))
    src = RemoteSource(transfer_id=tid, engine_id="e", host="127.0.0.1", port=port, tp_size=1, pp_size=1,
                       remote_block_ids=(remote,), load_key="k-" + tid)
    spec = LoadSpec(request_id="d-" + tid, source=src, block_ids=(local,), num_tokens=num_tokens)
    return consumer.load(spec, time.monotonic() + 20)


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
    for name in LAYERS:
        for rb, lb in zip((3, 0, 5), (7, 2, 6)):
            # The last block holds 75 - 64 = 11 tokens: compare those rows of K and V.
            n = BLOCK if rb != 5 else 11
            pv, cv = layer_view(pkv[name], BLOCK)[0], layer_view(ckv[name], BLOCK)[0]
            assert torch.equal(pv[rb, :, :, :n], cv[lb, :, :, :n])
    end = time.monotonic() + 10
    released = []
    while not released and time.monotonic() < end:
        released = p.released()
        time.sleep(0.05)
    assert released == [("p-t0", "served")]


def test_a_flipped_landed_bit_is_a_mismatch_and_not_ok(pair):
    p, c, _, ckv = pair(PORT + 10, test_corrupt_transfer_prefix="bad-")
    r = send_and_load(p, c, "bad-0", PORT + 10)
    assert not r.ok and r.verdict == "mismatch", r
    # Same transport, a transfer id without the prefix: untouched, verified.
    assert send_and_load(p, c, "good-0", PORT + 10).verdict == "verified"


def test_a_wrong_load_key_does_not_land(pair):
    p, c, _, _ = pair(PORT + 20)
    p.serve(SendSpec(request_id="p", transfer_id="t", block_ids=((1,),), num_tokens=5, lease_seconds=10.0,
                     load_key="right"))
    src = RemoteSource(transfer_id="t", engine_id="e", host="127.0.0.1", port=PORT + 20, tp_size=1, pp_size=1,
                       remote_block_ids=((1,),), load_key="wrong")
    r = c.load(LoadSpec(request_id="d", source=src, block_ids=((2,),), num_tokens=5), time.monotonic() + 20)
    assert not r.ok and "did not land" in r.reason


def test_different_tp_sizes_are_refused_before_any_transfer(pair):
    p, c, _, _ = pair(PORT + 30)
    src = RemoteSource(transfer_id="t", engine_id="e", host="127.0.0.1", port=PORT + 30, tp_size=2, pp_size=1,
                       remote_block_ids=((1,),), load_key="k")
    r = c.load(LoadSpec(request_id="d", source=src, block_ids=((2,),), num_tokens=5), time.monotonic() + 20)
    assert not r.ok and "differs" in r.reason


def test_unknown_layout_is_a_clear_error():
    with pytest.raises(LayoutError, match="no known layout"):
        layer_view(torch.zeros(4, 3, 5), BLOCK)
