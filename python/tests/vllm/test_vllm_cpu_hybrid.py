"""kvferry.vllm with real vLLM on a hybrid model under vLLM's hybrid KV cache manager (no
``--disable-hybrid-kv-cache-manager``): a tiny random-weight Llama-style model with a
sliding-window layer (window 32) and a full-attention layer (engine_run.py ``TINY_HYBRID``), so
two KV cache groups with a block table each. Two engines, each producer and consumer at once
(``kv_both``): ``--block-size`` 32 with ``kv_load_failure_policy`` fail, 64 with recompute; each
serves both, itself included, so every pairing of equal and different block sizes runs (between
different ones the consumer's blocks are filled token by token, which needs the CPU kernel's
real order inside a block: test_cpu_block_layout.py). Beside them a tiny Granite 4 hybrid
(engine_run.py ``TINY_MAMBA``: a Mamba2 layer and a full-attention layer) in one engine that
serves itself: its state group moves and is skipped by both checksums, the attention group
verifies.

Run by scripts/vllm-tests.sh; skipped where vLLM is missing."""

import importlib.util
import re

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

from engine_run import TINY_MAMBA
from test_vllm_cpu import PROMPT_LENGTHS, _caught, _flipped, _verified, run_engines

# (producer engine, consumer engine, transfer id prefix of the pairing, producer block size,
# consumer block size)
PAIRS = [
    ("both-hyb-fail", "both-hyb-fail", "hyb-fail-{kind}-", 32, 32),
    ("both-hyb-fail", "both-hyb-rc", "hyb-rc-{kind}-", 32, 64),
    ("both-hyb-rc", "both-hyb-fail", "hyb-fail-{kind}-w-", 64, 32),
    ("both-hyb-rc", "both-hyb-rc", "hyb-rc-{kind}-w-", 64, 64),
]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The two sliding-window hybrid engines and the Mamba hybrid's engine, side by side."""
    return run_engines(["both-hyb-fail", "both-hyb-rc", "both-mamba"], tmp_path_factory, model_name="tiny-hybrids")


@pytest.fixture(scope="module")
def hyb(engines):
    return {k: v for k, v in engines.items() if "hyb" in k}


@pytest.fixture(scope="module")
def mamba(engines):
    return engines["both-mamba"]


def load_bytes(attention_block_size: int) -> int:
    """Bytes of one load of a prompt within one block from the Mamba hybrid: the attention
    layer's block (K and V of every token of it, CPU layout: whole blocks move) and the Mamba2
    layer's state (conv state of the last ``d_conv - 1`` inputs over the x, B and C channels,
    and the SSM state of every head), float32."""
    c = TINY_MAMBA
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    attention = attention_block_size * c["num_key_value_heads"] * 2 * head_dim * 4
    conv = (c["mamba_d_conv"] - 1) * (c["mamba_expand"] * c["hidden_size"] + 2 * c["mamba_n_groups"] * c["mamba_d_state"])
    ssm = c["mamba_n_heads"] * c["mamba_d_head"] * c["mamba_d_state"]
    return attention + (conv + ssm) * 4


def _key(kind: str, prefix: str) -> str:
    return f"decode_{kind}" + ("_w" if prefix.endswith("-w-") else "")


def _refused(log: str, transfer: str) -> int:
    """Loads the consumer's scheduler refused before any byte moved, of transfers matching ``transfer``."""
    return len(re.findall(rf"not loaded from producer \S+ \(transfer {transfer}\): group \d+: after the sliding "
                          r"window", log))


def test_each_instance_runs_two_kv_cache_groups_and_names_its_block_sizes(hyb):
    for scenario in ("both-hyb-fail", "both-hyb-rc"):
        p = hyb[scenario]
        bs = 64 if scenario.endswith("rc") else 32
        kvp = next(iter(p["prefill"].values()))["kv_transfer_params"]
        assert kvp["remote_block_sizes"] == [bs, bs]
        for tid, out in p["prefill"].items():
            n = PROMPT_LENGTHS[int(tid.rsplit("-", 1)[1])]
            # One table per group (sliding window, full attention), each of the prompt's blocks.
            assert [len(g) for g in out["kv_transfer_params"]["remote_block_ids"]] == [-(-n // bs)] * 2
    for r in hyb.values():
        assert "kvferry rank tp=0 pp=0: 2 KV layers" in r["log"], r["log"][-3000:]


def test_hybrid_model_output_depends_on_the_whole_prompt(hyb):
    r = hyb["both-hyb-fail"]
    assert all(a["tokens"] != b["tokens"] for a, b in zip(r["reference"], r["reference_context_changed"]))


@pytest.mark.parametrize("producer, consumer, prefix, pbs, cbs", PAIRS)
def test_decode_equals_the_plain_run_every_load_verified(hyb, producer, consumer, prefix, pbs, cbs):
    c = hyb[consumer]
    assert [o["tokens"] for o in c[_key("ok", prefix)]] == [o["tokens"] for o in c["reference"]]
    assert all(o["finish_reason"] == "length" for o in c[_key("ok", prefix)])
    ok = re.escape(prefix.format(kind="ok")) + r"\d"
    # A 75-token prompt from blocks of 64 into blocks of 32: the sliding window's checksummed
    # blocks start at token 32, inside a producer block, so the consumer computes it locally
    # rather than load KV it could not verify.
    refused = 1 if (pbs, cbs) == (64, 32) else 0
    # (vLLM may ask more than once before the request is scheduled: each asking is logged.)
    assert bool(_refused(c["log"], ok)) == bool(refused), c["log"][-3000:]
    assert _verified(c["log"], ok) == 3 - refused, c["log"][-3000:]


@pytest.mark.parametrize("producer, consumer, prefix, pbs, cbs", PAIRS)
def test_a_flipped_landed_bit_in_each_group_is_caught(hyb, producer, consumer, prefix, pbs, cbs):
    c = hyb[consumer]
    bad = re.escape(prefix.format(kind="corrupt")) + r"\d"
    loaded = 2 if (pbs, cbs) == (64, 32) else 3
    # One bit per group of every load, each group's mismatch caught.
    assert _flipped(c["log"], bad) == 2 * loaded
    assert _caught(c["log"], bad) == loaded
    outs = c[_key("corrupt", prefix)]
    if consumer.endswith("fail"):
        assert [o["finish_reason"] for o in outs][:loaded] == ["error"] * loaded
    else:
        assert [o["tokens"] for o in outs] == [o["tokens"] for o in c["reference"]]


def test_no_block_leaks_on_either_side(hyb):
    for name, r in hyb.items():
        # Every load's blocks and every held send's blocks freed again.
        assert r["free_after"] == r["free_total"], f"{name}: blocks leaked after the loads and sends"
        assert r["free_after_lease"] == r["free_before"], f"{name}: held blocks not freed"


# The Mamba2 + full-attention hybrid (engine_run.py TINY_MAMBA), one engine serving itself: a
# state group (vLLM's MambaSpec, one state block per request) and a full-attention group. The
# state block moves with the attention blocks (the decode instance continues from it) and is
# skipped by both checksums; the producer stops one token short of the prompt and the consumer
# computes that token itself (its state must not take it twice).


def test_the_state_group_and_the_attention_group_are_both_moved(mamba):
    p = c = mamba
    kvp = next(iter(p["prefill"].values()))["kv_transfer_params"]
    # Group 0 the Mamba2 layer's state, group 1 full attention, block sizes vLLM chose.
    sizes = kvp["remote_block_sizes"]
    assert len(sizes) == 2 and sizes[0] >= sizes[1], kvp
    for tid, out in p["prefill"].items():
        n = PROMPT_LENGTHS[int(tid.rsplit("-", 1)[1])] - 1  # the producer stops one token short
        tables = out["kv_transfer_params"]["remote_block_ids"]
        assert [len(t) for t in tables] == [-(-n // bs) for bs in sizes], (tid, tables)
    # vLLM hands the connector the Mamba2 layer's page as bytes (conv and SSM state together, one
    # run per block) and the attention layer's cache.
    assert "kvferry rank tp=0 pp=0: 2 KV layers, e.g. model.layers.0.mixer" in c["log"], c["log"][-3000:]


def test_mamba_model_output_depends_on_the_whole_prompt(mamba):
    r = mamba
    assert all(a["tokens"] != b["tokens"] for a, b in zip(r["reference"], r["reference_context_changed"]))


def test_decode_equals_the_plain_run_every_load_verified_with_the_state_group_skipped(mamba):
    c = mamba
    assert [o["tokens"] for o in c["decode_ok"]] == [o["tokens"] for o in c["reference"]]
    assert all(o["finish_reason"] == "length" for o in c["decode_ok"])
    # Verified under fail-closed: the state group is skipped by both checksums, so the attention
    # group decides.
    assert _verified(c["log"], r"mamba-ok-\d") == 3, c["log"][-3000:]
    # The state landed: every load moved the attention group's block and the state's page.
    sizes = next(iter(c["prefill"].values()))["kv_transfer_params"]["remote_block_sizes"]
    assert re.findall(r"\(transfer mamba-ok-\d\) verified: (\d+) bytes", c["log"]) == [str(load_bytes(sizes[1]))] * 3


def test_a_flipped_landed_bit_in_the_attention_group_fails_the_request(mamba):
    c = mamba
    assert _flipped(c["log"], r"mamba-corrupt-\d") == 3
    assert _caught(c["log"], r"mamba-corrupt-\d") == 3
    assert [o["finish_reason"] for o in c["decode_corrupt"]] == ["error"] * 3


def test_no_block_leaks_in_the_mamba_engine(mamba):
    assert mamba["free_after"] == mamba["free_total"], "blocks leaked after the loads and sends"
