"""kvferry.Producer / kvferry.Consumer from Python (docs/design.md §4, §2.6, §2.7): KV in
NumPy arrays, both sides in this process over TCP on 127.0.0.1. A correct load verifies and
lands the producer's bytes; a byte corrupted after landing (the landed hook) is caught under every
policy; TP differs between the sides; one Producer/Consumer pair per TP rank; a load that cannot
land reports the failure action."""

import os
import socket
import sys
import threading
import time

import numpy as np
import pytest

import kvferry

LAYOUT = "KV B N H D"
BLOCK = 16
HEADS = 4  # KV heads of the model
LAYERS = 2
D = 8


def make_rank(tp_rank, tp_size, num_blocks, seed, *, one_process_per_rank=False):
    """One TP rank's KV (float16 [2, B, 16, HEADS / tp_size, 8] per layer), random when `seed`."""
    h = HEADS // tp_size
    rng = np.random.default_rng(seed)
    arrays = []
    layers = []
    for layer in range(LAYERS):
        a = np.zeros((2, num_blocks, BLOCK, h, D), dtype=np.float16)
        if seed is not None:
            a.view(np.uint16)[...] = rng.integers(0, 2**16, size=a.shape, dtype=np.uint16)
        arrays.append(a)
        layers.append(kvferry.KVCacheLayer(f"model.layers.{layer}.self_attn.attn", a, LAYOUT,
                                           head_offset=tp_rank * h, kind="FullAttentionSpec",
                                           dtype="torch.float16"))
    group = kvferry.KVCacheGroup(0, layers)
    if one_process_per_rank:
        rank = kvferry.Rank([group])
    else:
        rank = kvferry.Rank([group], tp_rank=tp_rank, tp_size=tp_size)
    return rank, arrays


def heads_of(arrays_per_rank, block, tp_size):
    """The KV of `block` of every layer, all heads (ranks' heads concatenated)."""
    return [np.concatenate([arrays_per_rank[r][layer][:, block] for r in range(tp_size)], axis=-2)
            for layer in range(LAYERS)]


@pytest.fixture
def pair():
    """A TP1 producer with 6 blocks of random KV and a TP1 consumer with 8 empty blocks."""
    prank, parr = make_rank(0, 1, 6, seed=1)
    crank, carr = make_rank(0, 1, 8, seed=None)
    made = []

    def build(**consumer_options):
        producer = kvferry.Producer([prank])
        consumer = kvferry.Consumer([crank], **consumer_options)
        made.append(producer)
        return producer, consumer, parr, carr

    yield build
    for p in made:
        p.shutdown()


PROMPT = 70  # 5 blocks of 16, the last holding 6 tokens
REMOTE = [3, 0, 5, 1, 4]
LOCAL = [7, 2, 6, 0, 1]


def test_a_load_lands_the_producers_bytes_and_verifies(pair):
    producer, consumer, parr, carr = pair()
    info = producer.publish("req-0", [REMOTE], PROMPT, load_key="key-req-0")
    assert info.checksummed and info.warning is None and info.payload_bytes > 0
    out = consumer.load("req-0", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="key-req-0")
    assert out.landed and out.error is None
    assert out.verdict.status == "verified" and out.action == "complete"
    assert out.bytes == LAYERS * len(REMOTE) * 2 * BLOCK * HEADS * D * 2
    assert out.transfer_seconds > 0 and out.checksum_seconds > 0
    # Host memory: the producer writes (only same-host GPU KV is read by the consumer).
    assert out.read is False
    for r, l in zip(REMOTE, LOCAL):
        for layer in range(LAYERS):
            assert np.array_equal(carr[layer][:, l].view(np.uint16), parr[layer][:, r].view(np.uint16))
    deadline = time.monotonic() + 10
    released = []
    while not released and time.monotonic() < deadline:
        released = producer.released()
        time.sleep(0.01)
    assert released == [("req-0", kvferry.ReleaseReason(kvferry.Release.SERVED))]


def flip_hook(carr, layer, block_of, token, seen):
    """A landed hook flipping one bit of `token`'s K of head 1 in the landed block."""
    def hook(landed):
        seen.append(landed)
        g = landed["groups"][0]
        pos = token // BLOCK
        block = g["local_blocks"][g["positions"].index(pos)]
        carr[layer][0, block, token % BLOCK, 1].view(np.uint8)[3] ^= 0x10
    return hook


@pytest.mark.parametrize("fail_closed, policy, action", [
    (False, "fail", "complete"),
    (True, "fail", "fail"),
    (True, "recompute", "recompute"),
])
def test_a_corrupted_byte_is_caught_under_each_policy(pair, fail_closed, policy, action):
    producer, consumer, parr, carr = pair(fail_closed=fail_closed, load_failure_policy=policy)
    producer.publish("req-1", [REMOTE], PROMPT, load_key="key-req-1")
    seen = []
    consumer.set_landed_hook(flip_hook(carr, 1, LOCAL, 35, seen))
    out = consumer.load("req-1", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="key-req-1")
    assert seen and seen[0]["request_id"] == "req-1"
    assert seen[0]["groups"] == [{"group_id": 0, "positions": [0, 1, 2, 3, 4], "local_blocks": LOCAL}]
    assert out.landed
    assert out.verdict.status == "mismatch"
    assert out.verdict.mismatches == [(0, [2])]  # token 35 is in block position 2
    assert out.action == action


def test_the_hook_can_be_removed_and_its_errors_are_reported(pair, monkeypatch):
    producer, consumer, parr, carr = pair()
    producer.publish("a", [REMOTE], PROMPT, load_key="key-a")
    producer.publish("b", [REMOTE], PROMPT, load_key="key-b")
    caught = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: caught.append(u.exc_value))

    def broken(landed):
        raise RuntimeError("hook bug")
    consumer.set_landed_hook(broken)
    out = consumer.load("a", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="key-a")
    assert out.verdict.verified, "the load goes on"
    assert len(caught) == 1 and "hook bug" in str(caught[0])
    consumer.set_landed_hook(flip_hook(carr, 0, LOCAL, 3, []))
    consumer.set_landed_hook(None)
    assert consumer.load("b", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="key-b").verdict.verified


def test_a_local_prefix_hit_is_neither_loaded_nor_compared(pair):
    producer, consumer, parr, carr = pair()
    producer.publish("req-2", [REMOTE], PROMPT, load_key="key-req-2")
    # Corrupt the consumer's block at position 0 before the load: it is a local hit, not loaded.
    carr[0][:, LOCAL[0]] = 1
    out = consumer.load("req-2", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="key-req-2", num_local_computed=BLOCK)
    assert out.verdict.verified
    assert out.bytes == LAYERS * 4 * 2 * BLOCK * HEADS * D * 2


def test_tp2_producer_to_tp1_consumer_verifies_and_lands_every_head():
    ranks = [make_rank(r, 2, 6, seed=10 + r) for r in range(2)]
    crank, carr = make_rank(0, 1, 8, seed=None)
    with kvferry.Producer([ranks[1][0], ranks[0][0]]) as producer:
        consumer = kvferry.Consumer([crank], fail_closed=True)
        producer.publish("tp", [REMOTE], PROMPT, load_key="key-tp")
        out = consumer.load("tp", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="key-tp")
        assert out.verdict.verified and out.action == "complete"
        for r, l in zip(REMOTE, LOCAL):
            for layer, want in enumerate(heads_of([a for _, a in ranks], r, 2)):
                assert np.array_equal(carr[layer][:, l].view(np.uint16), want.view(np.uint16))
        seen = []
        consumer.set_landed_hook(flip_hook(carr, 0, LOCAL, 17, seen))
        producer.publish("tp-bad", [REMOTE], PROMPT, load_key="key-tp-bad")
        out = consumer.load("tp-bad", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="key-tp-bad")
        assert out.verdict.mismatches == [(0, [1])] and out.action == "fail"


def test_one_producer_and_consumer_per_tp_rank():
    # Each "worker process" holds one TP rank: a 1x1 grid with its global head offset.
    pairs = []
    for r in range(2):
        prank, parr = make_rank(r, 2, 6, seed=20 + r, one_process_per_rank=True)
        crank, carr = make_rank(r, 2, 8, seed=None, one_process_per_rank=True)
        pairs.append((kvferry.Producer([prank]), kvferry.Consumer([crank], fail_closed=True), parr, carr))
    try:
        for r, (producer, consumer, parr, carr) in enumerate(pairs):
            producer.publish("req", [REMOTE], PROMPT, load_key="key-req")
            if r == 1:
                consumer.set_landed_hook(flip_hook(carr, 1, LOCAL, 69, []))
            out = consumer.load("req", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="key-req")
            if r == 0:
                assert out.verdict.verified and out.action == "complete"
                assert np.array_equal(carr[0][:, LOCAL[4]].view(np.uint16), parr[0][:, REMOTE[4]].view(np.uint16))
            else:
                assert out.verdict.mismatches == [(0, [4])] and out.action == "fail"
    finally:
        for p, *_ in pairs:
            p.shutdown()


def dead_endpoint():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"tcp://127.0.0.1:{port}"


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_load_that_cannot_land_reports_the_failure_action(policy):
    crank, _ = make_rank(0, 1, 8, seed=None)
    consumer = kvferry.Consumer([crank], load_failure_policy=policy, connect_timeout=1.0, reply_timeout=2.0,
                                max_wait=3.0)
    t = time.monotonic()
    out = consumer.load("lost", dead_endpoint(), [REMOTE], [LOCAL], PROMPT)
    assert time.monotonic() - t < 30
    assert not out.landed and out.verdict is None and out.error
    assert out.action == policy


def test_the_default_load_deadline_is_the_cores_rule_over_the_consumers_timeouts():
    # connect and welcome (connect_timeout each), the send (5 s), the overall wait (never less
    # than reply_timeout), the checksums.
    assert kvferry.Consumer.load_deadline_for() == pytest.approx(2 * 5.0 + 5.0 + 120.0 + 30.0)
    assert kvferry.Consumer.load_deadline_for(reply_timeout=40.0, max_wait=20.0, checksum_timeout=3.0,
                                              connect_timeout=1.0) == pytest.approx(2.0 + 5.0 + 40.0 + 3.0)
    crank, _ = make_rank(0, 1, 8, seed=None)
    consumer = kvferry.Consumer([crank], reply_timeout=2.0, max_wait=3.0, checksum_timeout=4.0, connect_timeout=1.0)
    assert consumer.load_deadline == kvferry.Consumer.load_deadline_for(
        reply_timeout=2.0, max_wait=3.0, checksum_timeout=4.0, connect_timeout=1.0)
    with pytest.raises(ValueError):
        kvferry.Consumer.load_deadline_for(max_wait=-1.0)


def test_the_call_deadline_ends_a_load_waiting_for_its_publish(pair):
    producer, consumer, parr, carr = pair()
    stamps = []
    stop = threading.Event()

    def tick():  # needs the GIL after each sleep
        while not stop.is_set():
            stamps.append(time.monotonic())
            time.sleep(0.001)
    t = threading.Thread(target=tick)
    t.start()
    try:
        start = time.monotonic()
        # Never published: the producer holds the request for its publish; the call's timeout ends it.
        out = consumer.load("never", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="key-never", timeout=2.0)
        end = time.monotonic()
    finally:
        stop.set()
        t.join()
    assert not out.landed and "not done within" in out.error and out.action == "fail"
    # The wait released the GIL: the other Python thread ran well inside it.
    assert any(start + 0.1 < s < end - 0.1 for s in stamps)


def test_bad_arguments_raise(pair):
    producer, consumer, parr, carr = pair()
    with pytest.raises(ValueError, match="block id -1"):
        producer.publish("x", [[0, -1]], 20)
    with pytest.raises(ValueError, match="no block table for group 0"):
        producer.publish("x", [], 20)
    with pytest.raises(ValueError, match="remote_blocks has 1 groups, local_blocks 2"):
        consumer.load("x", producer.endpoint, [REMOTE], [LOCAL, LOCAL], PROMPT)
    # Tables must cover the prompt exactly, with distinct local blocks inside the cache.
    with pytest.raises(ValueError, match="has 2 positions, 70 tokens in blocks of 16 need exactly 5"):
        consumer.load("x", producer.endpoint, [[3]], [[7, 2]], PROMPT)
    with pytest.raises(ValueError, match="block 7 is written at positions 0 and 1"):
        consumer.load("x", producer.endpoint, [REMOTE], [[7, 7, 7, 7, 7]], PROMPT)
    with pytest.raises(ValueError, match="outside the cache"):
        consumer.load("x", producer.endpoint, [REMOTE], [[7, 2, 6, 0, 8]], PROMPT)
    with pytest.raises(ValueError, match="need exactly"):
        producer.publish("x", [[0]], 2**63)
    with pytest.raises(ValueError, match="timeout"):
        consumer.load("x", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="key-x", timeout=-1)
    producer.publish("dup", [REMOTE], PROMPT, load_key="key-dup")
    with pytest.raises(ValueError, match="dup"):
        producer.publish("dup", [REMOTE], PROMPT, load_key="key-dup")
    with pytest.raises(ValueError, match="expected tcp, rdma or auto"):
        kvferry.Consumer([make_rank(0, 1, 2, None)[0]], protocol="udp")
    with pytest.raises(ValueError, match="fail or recompute"):
        kvferry.Consumer([make_rank(0, 1, 2, None)[0]], load_failure_policy="retry")
    two = [make_rank(0, 2, 2, None)[0]]
    with pytest.raises(ValueError, match="1 workers for TP 2"):
        kvferry.Producer(two)
    producer.shutdown()
    producer.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        producer.publish("late", [REMOTE], PROMPT, load_key="key-late")


def test_layers_sharing_memory_are_registered_once():
    # Two layers over one buffer (KV sharing, or one allocation viewed per layer): their memory
    # ranges overlap and must be registered as one region.
    shared = np.random.default_rng(8).integers(0, 2**16, (2, 6, BLOCK, HEADS, D), dtype=np.uint16).view(np.float16)
    layers = [kvferry.KVCacheLayer(f"model.layers.{i}.self_attn.attn", shared, LAYOUT, kind="FullAttentionSpec",
                                    dtype="torch.float16") for i in (0, 1)]
    producer = kvferry.Producer([kvferry.Rank([kvferry.KVCacheGroup(0, layers)])])
    try:
        crank, carr = make_rank(0, 1, 8, seed=None)
        consumer = kvferry.Consumer([crank], fail_closed=True)
        producer.publish("s", [REMOTE], PROMPT, load_key="key-s")
        out = consumer.load("s", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="key-s")
        assert out.verdict.verified
    finally:
        producer.shutdown()


def test_groups_and_ranks_are_checked():
    a = kvferry.KVCacheLayer("model.layers.0.attn", np.zeros((2, 4, 16, 1, 8)), LAYOUT)
    b = kvferry.KVCacheLayer("model.layers.1.attn", np.zeros((2, 4, 32, 1, 8)), LAYOUT)
    with pytest.raises(ValueError, match="block size"):
        kvferry.KVCacheGroup(0, [a, b])
    with pytest.raises(ValueError, match="no layers"):
        kvferry.KVCacheGroup(0, [])
    with pytest.raises(ValueError, match="skipped"):
        kvferry.KVCacheGroup(0, [a], skipped="tired")
    g = kvferry.KVCacheGroup(0, [a])
    with pytest.raises(ValueError, match="twice"):
        kvferry.Rank([g, g])
    with pytest.raises(ValueError, match="tp_rank 2"):
        kvferry.Rank([g], tp_rank=2, tp_size=2)


def test_secret_mode_loads_between_engines_sharing_the_secret_and_refuses_others(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    other = tmp_path / "other"
    other.write_bytes(os.urandom(32))
    other.chmod(0o600)
    prank, parr = make_rank(0, 1, 6, seed=1)
    crank, carr = make_rank(0, 1, 8, seed=None)
    orank, oarr = make_rank(0, 1, 8, seed=None)
    with kvferry.Producer([prank], secret_file=str(secret)) as producer:
        consumer = kvferry.Consumer([crank], fail_closed=True, secret_file=str(secret))
        stranger = kvferry.Consumer([orank], fail_closed=True, secret_file=str(other), reply_timeout=5.0)
        producer.publish("s-0", [REMOTE], PROMPT, load_key="k0")
        producer.publish("s-1", [REMOTE], PROMPT, load_key="k1")
        # A consumer with another secret: the producer cannot write into its memory.
        out = stranger.load("s-1", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="k1")
        assert not out.landed
        assert all(not a.any() for a in oarr)
        out = consumer.load("s-0", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key="k0")
        assert out.landed and out.verdict.status == "verified", out.error
    with pytest.raises(ValueError, match="secret_file"):
        kvferry.Consumer([make_rank(0, 1, 2, None)[0]], secret_file=str(tmp_path / "missing"))


def test_engine_ports_bind_the_engines_in_the_range_and_a_taken_range_is_an_error():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # The range's only port is taken: the engine cannot start, and says which range.
        with pytest.raises(RuntimeError, match=f"port range {port}-{port} is in use"):
            kvferry.Consumer([make_rank(0, 1, 2, None)[0]], engine_ports=f"{port}-{port}")
    # Free ports: each engine's handshake port is in the range, and loads work as before.
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            lo = s.getsockname()[1]
        try:
            for p in range(lo, lo + 8):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            break
        except OSError:
            continue
    prank, _ = make_rank(0, 1, 6, seed=1)
    crank, carr = make_rank(0, 1, 8, seed=None)
    with kvferry.Producer([prank], engine_ports=f"{lo}-{lo + 7}") as producer:
        consumer = kvferry.Consumer([crank], engine_ports=f"{lo}-{lo + 7}")
        ports = [int(s.rsplit(":", 1)[1]) for s in [*producer.segments, *consumer.segments]]
        assert all(lo <= p <= lo + 7 for p in ports) and len(set(ports)) == 2, ports
        info = producer.publish("req-ports", [REMOTE], PROMPT)
        out = consumer.load("req-ports", producer.endpoint, [REMOTE], [LOCAL], PROMPT, load_key=info.load_key)
        assert out.verdict.verified, out
    for bad in ("", "9-1", "0-3", "1-70000", "x"):
        with pytest.raises(ValueError, match="engine_ports"):
            kvferry.Consumer([make_rank(0, 1, 2, None)[0]], engine_ports=bad)
