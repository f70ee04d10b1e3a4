"""kvferry.Producer / kvferry.Consumer with a hybrid model and with different block sizes on the
two sides (docs/design.md §2.5, §2.6, §4.5), KV in NumPy arrays, both sides in this process over
TCP on 127.0.0.1. A hybrid spec (full attention, sliding window, Mamba-type state) moves every
group and verifies its attention groups, including TP 2 -> TP 1; a flipped bit in each attention
group is a mismatch of that group at the consumer's position. Block sizes 16/32 and 32/16 verify
(with TP 2 -> TP 1), a flipped bit is a mismatch at the consumer blocks of its chunk, and a
consumer with smaller blocks whose first loaded block starts inside a producer block is
unverified."""

import numpy as np
import pytest

import kvferry

HEADS = 4
D = 8
WINDOW = 32
STATE = 32  # state elements per head
PROMPT = 90
BLOCKS = 24


def table(bs, salt):
    return [(i * 7 + salt) % BLOCKS for i in range(-(-PROMPT // bs))]


def windowed(t, bs):
    first = (PROMPT - WINDOW) // bs
    return [None if i < first else b for i, b in enumerate(t)]


def last_only(t):
    return [None] * (len(t) - 1) + [t[-1]]


def random_fill(a, rng):
    a.view(np.uint16)[...] = rng.integers(0, 2**16, size=a.shape, dtype=np.uint16)


def make_rank(tp_rank, tp_size, bs, seed, *, hybrid):
    """One TP rank: group 0 full attention (layers 0, 2; KV B N H D), and with `hybrid` group 1
    sliding window (layers 1, 3; B KV N H D) and group 2 state (layers 4, 5: one state per
    block, B N H D with N = 1, skipped by the checksum)."""
    h = HEADS // tp_size
    rng = np.random.default_rng(seed)
    arrays, groups = {}, []
    specs = [(0, [0, 2], "KV B N H D", (2, BLOCKS, bs, h, D), "FullAttentionSpec")]
    if hybrid:
        specs += [(1, [1, 3], "B KV N H D", (BLOCKS, 2, bs, h, D), "SlidingWindowSpec"),
                  (2, [4, 5], "B N H D", (BLOCKS, 1, h, STATE), "MambaSpec")]
    for gid, layers, layout, shape, kind in specs:
        ls = []
        for layer in layers:
            a = np.zeros(shape, dtype=np.float16)
            if seed is not None:
                random_fill(a, rng)
            arrays[layer] = a
            ls.append(kvferry.KVCacheLayer(f"model.layers.{layer}.mixer", a, layout,
                                           head_offset=tp_rank * h, kind=kind,
                                           dtype="torch.float16"))
        if gid == 0:
            groups.append(kvferry.KVCacheGroup(0, ls))
        elif gid == 1:
            groups.append(kvferry.KVCacheGroup(1, ls, sliding_window=WINDOW))
        else:
            groups.append(kvferry.KVCacheGroup(2, ls, skipped="no_per_token_blocks", block_size=bs))
    return kvferry.Rank(groups, tp_rank=tp_rank, tp_size=tp_size), arrays


def token_flip(arrays, layer, layout_kv_first, blocks, bs, token):
    """A landed hook flipping one bit of `token`'s K, head 0, of `layer` on this rank."""
    def hook(_landed):
        b = blocks[token // bs]
        cell = arrays[layer][0, b, token % bs, 0] if layout_kv_first else arrays[layer][b, 0, token % bs, 0]
        cell.view(np.uint8)[1] ^= 0x20
    return hook


@pytest.mark.parametrize("ptp", [1, 2])
def test_a_hybrid_spec_moves_every_group_and_verifies_its_attention_groups(ptp):
    bs = 16
    prod = [make_rank(r, ptp, bs, seed=20 + r, hybrid=True) for r in range(ptp)]
    crank, carr = make_rank(0, 1, bs, seed=None, hybrid=True)
    remote, local = table(bs, 2), table(bs, 11)
    rtables = [remote, windowed(remote, bs), last_only(remote)]
    ltables = [local, windowed(local, bs), last_only(local)]
    with kvferry.Producer([r for r, _ in prod]) as producer:
        consumer = kvferry.Consumer([crank], fail_closed=True)
        for rid in ["ok", "flip-full", "flip-window"]:
            producer.publish(rid, rtables, PROMPT, load_key=rid)
        out = consumer.load("ok", producer.endpoint, rtables, ltables, PROMPT, load_key="ok")
        assert out.verdict.verified and out.action == "complete", out.verdict
        # The state block moved (every head, from the producer rank holding it).
        for layer in (4, 5):
            want = np.concatenate([a[layer][remote[-1]] for _, a in prod], axis=-2)
            assert np.array_equal(carr[layer][local[-1]].view(np.uint16), want.view(np.uint16))
        # A flipped bit in each attention group: a mismatch of that group at its position.
        for rid, group, layer, kv_first, token in [("flip-full", 0, 2, True, 40),
                                                   ("flip-window", 1, 3, False, 85)]:
            consumer.set_landed_hook(token_flip(carr, layer, kv_first, ltables[group], bs, token))
            out = consumer.load(rid, producer.endpoint, rtables, ltables, PROMPT, load_key=rid)
            assert out.verdict.mismatches == [(group, [token // bs])], out.verdict
            assert out.action == "fail"
            consumer.set_landed_hook(None)


@pytest.mark.parametrize("pbs, cbs, ptp", [(16, 32, 1), (32, 16, 1), (16, 32, 2), (32, 16, 2)])
def test_different_block_sizes_verify_and_flag_the_consumer_blocks_of_the_chunk(pbs, cbs, ptp):
    prod = [make_rank(r, ptp, pbs, seed=30 + r, hybrid=False) for r in range(ptp)]
    crank, carr = make_rank(0, 1, cbs, seed=None, hybrid=False)
    remote, local = table(pbs, 1), table(cbs, 5)
    with kvferry.Producer([r for r, _ in prod]) as producer:
        consumer = kvferry.Consumer([crank])
        for rid in ["ok", "flip", "prefix"]:
            producer.publish(rid, [remote], PROMPT, load_key=rid)
        out = consumer.load("ok", producer.endpoint, [remote], [local], PROMPT, load_key="ok",
                            remote_block_sizes=[pbs])
        assert out.verdict.verified, out.verdict
        # Token by token, every head (the producer's ranks' heads concatenated).
        for t in range(PROMPT):
            want = np.concatenate([a[0][:, remote[t // pbs], t % pbs] for _, a in prod], axis=-2)
            got = carr[0][:, local[t // cbs], t % cbs]
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), t
        consumer.set_landed_hook(token_flip(carr, 0, True, local, cbs, 70))
        out = consumer.load("flip", producer.endpoint, [remote], [local], PROMPT, load_key="flip",
                            remote_block_sizes=[pbs])
        chunk = max(pbs, cbs)
        want = list(range(70 // chunk * chunk // cbs, min((70 // chunk + 1) * chunk // cbs, len(local))))
        assert out.verdict.mismatches == [(0, want)], out.verdict
        consumer.set_landed_hook(None)
        # A prefix hit of one consumer block: starts inside a producer block when cbs < pbs.
        out = consumer.load("prefix", producer.endpoint, [remote], [local], PROMPT, load_key="prefix",
                            num_local_computed=cbs, remote_block_sizes=[pbs])
        if cbs < pbs:
            assert out.verdict.status == "unverified"
            assert out.verdict.unverified == [(0, "unaligned_start")]
        else:
            assert out.verdict.verified, out.verdict


def test_a_state_group_between_different_block_sizes_is_refused():
    prank, _ = make_rank(0, 1, 16, seed=1, hybrid=True)
    crank, _ = make_rank(0, 1, 32, seed=None, hybrid=True)
    remote, local = table(16, 1), table(32, 5)
    with kvferry.Producer([prank]) as producer:
        consumer = kvferry.Consumer([crank])
        producer.publish("r", [remote, windowed(remote, 16), last_only(remote)], PROMPT, load_key="r")
        with pytest.raises(ValueError, match="state group"):
            consumer.load("r", producer.endpoint, [remote, [], last_only(remote)],
                          [local, [], last_only(local)], PROMPT, load_key="r",
                          remote_block_sizes=[16, 16, 16])
    with pytest.raises(ValueError, match="state group"):
        kvferry.KVCacheGroup(0, [kvferry.KVCacheLayer(
            "model.layers.0.attn", np.zeros((2, 4, 16, 1, 8), np.float16), "KV B N H D")], block_size=32)
