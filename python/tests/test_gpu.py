"""GPU: kvferry.checksum on torch CUDA tensors equals the CPU checksum of the same bytes and runs
after the caller's stream without synchronising it; a Producer/Consumer pair with KV in GPU memory
verifies loads and catches a corrupted byte under each policy (docs/design.md §5).

Skipped without torch or a CUDA device, unless KVFERRY_REQUIRE_GPU=1 (scripts/gpu-tests.sh sets
it on a machine with a GPU), which turns the skip into a failure.
"""

import os

import pytest

import kvferry
from kvferry import checksum as kc

REQUIRE = os.environ.get("KVFERRY_REQUIRE_GPU") == "1"


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    return torch, None


torch, WHY = _torch_cuda()
if torch is None:
    if REQUIRE:
        raise RuntimeError(f"KVFERRY_REQUIRE_GPU=1 but {WHY}")
    pytest.skip(WHY, allow_module_level=True)

LAYOUTS = {
    "KV B N H D": (2, 8, 16, 4, 64),
    "B KV N H D": (8, 2, 16, 4, 64),
    "B KV H N D": (8, 2, 4, 16, 64),
    "B H N KV D": (8, 4, 16, 2, 64),
    "B N D": (8, 16, 576),
}


def random_kv(shape, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g)
    if dtype.itemsize == 2:
        return bits.view(dtype)
    return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=g).view(dtype)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_checksum_equals_the_cpu_checksum(layout, dtype):
    dt = getattr(torch, dtype)
    cpu = random_kv(LAYOUTS[layout], dt, seed=len(layout))
    gpu = cpu.to("cuda")
    torch.cuda.synchronize()
    name = "model.layers.5.self_attn.attn"
    blocks, num_tokens = [7, 0, 3, 5], 16 * 3 + 9
    want = kc.block_checksums([kc.KVCacheLayer(name, cpu, layout, head_offset=4)], blocks, num_tokens, start=1)
    layer = kc.KVCacheLayer(name, gpu, layout, head_offset=4)
    assert layer.device == "cuda:0"
    got = kc.block_checksums([layer], blocks, num_tokens, start=1, stream=torch.cuda.current_stream())
    assert got == want and any(want)


def test_cuda_checksum_runs_after_the_callers_stream_without_synchronising_it():
    shape = LAYOUTS["KV B N H D"]
    src = random_kv(shape, torch.bfloat16, seed=77).to("cuda")
    dst = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    layer = kc.KVCacheLayer("model.layers.0.attn", dst, "KV B N H D")
    blocks = [1, 2, 3]
    kc.block_checksums([layer], blocks, 48)  # compiles the kernel once, before the timed part
    want = kc.block_checksums([kc.KVCacheLayer("model.layers.0.attn", src.cpu(), "KV B N H D")], blocks, 48)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(2_000_000_000)  # keeps the stream busy (about a second)
        dst.copy_(src)  # the "forward" writing the KV, queued behind the sleep
        pending = kc.submit([layer], blocks, 48)  # stream=None: torch's current stream, s
        stream_still_busy = not s.query()
        ready_early = pending.done()
    values = pending.wait(60.0)
    assert stream_still_busy, "submit synchronised the caller's stream"
    assert not ready_early, "the checksum did not wait for the caller's stream"
    assert values == want, "the checksum read the KV before the caller's stream wrote it"


def gpu_rank(num_blocks, seed, tp_rank=0, tp_size=1, heads=4):
    h = heads // tp_size
    tensors, layers = [], []
    for layer in range(2):
        shape = (2, num_blocks, 16, h, 64)
        t = random_kv(shape, torch.bfloat16, seed + layer).to("cuda") if seed is not None else \
            torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        tensors.append(t)
        layers.append(kc.KVCacheLayer(f"model.layers.{layer}.self_attn.attn", t, "KV B N H D",
                                      head_offset=tp_rank * h, kind="FullAttentionSpec", dtype="torch.bfloat16"))
    torch.cuda.synchronize()
    return kvferry.Rank([kvferry.KVCacheGroup(0, layers)], tp_rank=tp_rank, tp_size=tp_size), tensors


REMOTE, LOCAL, PROMPT = [4, 0, 5, 2], [1, 6, 3, 7], 16 * 3 + 11


def corrupt(tensors, layer, token):
    def hook(landed):
        g = landed["groups"][0]
        block = g["local_blocks"][g["positions"].index(token // 16)]
        tensors[layer].view(torch.int16)[1, block, token % 16, 2, 5] ^= 0x100
        torch.cuda.synchronize()
    return hook


@pytest.mark.parametrize("fail_closed, policy, action", [
    (False, "fail", "complete"),
    (True, "fail", "fail"),
    (True, "recompute", "recompute"),
])
def test_producer_consumer_with_kv_in_gpu_memory(fail_closed, policy, action):
    prank, pt = gpu_rank(6, seed=3)
    crank, ct = gpu_rank(8, seed=None)
    with kvferry.Producer([prank]) as producer:
        consumer = kvferry.Consumer([crank], fail_closed=fail_closed, load_failure_policy=policy)
        assert producer.publish("ok", [REMOTE], PROMPT, load_key="key-ok").checksummed
        out = consumer.load("ok", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="key-ok")
        assert out.landed and out.verdict.verified and out.action == "complete"
        for r, l in zip(REMOTE, LOCAL):
            for p, c in zip(pt, ct):
                assert torch.equal(p[:, r].view(torch.int16), c[:, l].view(torch.int16))
        producer.publish("bad", [REMOTE], PROMPT, load_key="key-bad")
        consumer.set_landed_hook(corrupt(ct, 1, 40))
        out = consumer.load("bad", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="key-bad")
        assert out.verdict.mismatches == [(0, [2])]
        assert out.action == action


def test_tp2_gpu_producer_to_tp1_gpu_consumer():
    ranks = [gpu_rank(6, seed=10 + 2 * r, tp_rank=r, tp_size=2) for r in range(2)]
    crank, ct = gpu_rank(8, seed=None)
    with kvferry.Producer([r for r, _ in ranks]) as producer:
        consumer = kvferry.Consumer([crank], fail_closed=True)
        producer.publish("tp", [REMOTE], PROMPT, load_key="key-tp")
        out = consumer.load("tp", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="key-tp")
        assert out.verdict.verified and out.action == "complete"
        for layer in range(2):
            whole = torch.cat([ranks[r][1][layer] for r in range(2)], dim=3)
            for r, l in zip(REMOTE, LOCAL):
                assert torch.equal(whole[:, r].view(torch.int16), ct[layer][:, l].view(torch.int16))


def test_publish_orders_the_copy_after_the_callers_stream():
    """A kernel that spins, then the writes of the KV's final values, queued on the caller's stream
    right before publish(stream=...): the consumer's landed bytes are the final values (the copy
    stream waited for the event publish recorded there), and publish did not wait for the spin."""
    prank, pt = gpu_rank(6, seed=3)
    crank, ct = gpu_rank(8, seed=None)
    final = [random_kv(t.shape, torch.bfloat16, 40 + i).to("cuda") for i, t in enumerate(pt)]
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    # Without checksums: the checksums' own ordering would hold publish until the spin ends.
    with kvferry.Producer([prank], checksums=False) as producer:
        consumer = kvferry.Consumer([crank])
        torch.cuda._sleep(1 << 32)  # about two seconds of one thread spinning
        for t, f in zip(pt, final):
            t.copy_(f)
        producer.publish("late", [REMOTE], PROMPT, load_key="key-late", stream=stream.cuda_stream)
        assert not stream.query(), "publish synchronised the caller's stream"
        out = consumer.load("late", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="key-late")
        assert out.landed
        torch.cuda.synchronize()
        for r, l in zip(REMOTE, LOCAL):
            for f, c in zip(final, ct):
                assert torch.equal(f[:, r].view(torch.int16), c[:, l].view(torch.int16)), \
                    "the copy read the KV before the caller's stream wrote it"
