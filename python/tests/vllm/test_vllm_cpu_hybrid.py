"""kvferry.vllm with real vLLM on a hybrid model under vLLM's hybrid KV cache manager (no
``--disable-hybrid-kv-cache-manager``): a tiny random-weight Llama-style model with a
sliding-window layer (window 32) and a full-attention layer (engine_run.py ``TINY_HYBRID``), so
two KV cache groups with a block table each. Two producers (``--block-size`` 32 and 64) and two
consumers (32 with ``kv_load_failure_policy`` fail, 64 with recompute) side by side: every
pairing of equal and different block sizes (between different ones the consumer's blocks are
filled token by token, which needs the CPU kernel's real order inside a block:
test_cpu_block_layout.py). The CPU build runs no Mamba-type model through this
connector (it refuses Mamba state groups at start-up, test_connector_config.py); state groups
are covered by kvferry's transfer layer (python/tests/test_p2p_hybrid.py).

Run by scripts/vllm-tests.sh; skipped where vLLM is missing."""

import importlib.util
import re

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

from test_vllm_cpu import PROMPT_LENGTHS, _caught, _flipped, _verified, run_engines

# (producer scenario, consumer scenario, transfer id prefix of the pairing, producer block size,
# consumer block size)
PAIRS = [
    ("producer-hyb", "consumer-hyb-fail", "hyb-fail-{kind}-", 32, 32),
    ("producer-hyb", "consumer-hyb-rc", "hyb-rc-{kind}-", 32, 64),
    ("producer-hyb64", "consumer-hyb-fail", "hyb-fail-{kind}-w-", 64, 32),
    ("producer-hyb64", "consumer-hyb-rc", "hyb-rc-{kind}-w-", 64, 64),
]


@pytest.fixture(scope="module")
def hyb(tmp_path_factory):
    return run_engines(["producer-hyb", "producer-hyb64", "consumer-hyb-fail", "consumer-hyb-rc"], tmp_path_factory,
                       model_name="tiny-hybrid")


def _key(kind: str, prefix: str) -> str:
    return f"decode_{kind}" + ("_w" if prefix.endswith("-w-") else "")


def _refused(log: str, transfer: str) -> int:
    """Loads the consumer's scheduler refused before any byte moved, of transfers matching ``transfer``."""
    return len(re.findall(rf"not loaded from producer \S+ \(transfer {transfer}\): group \d+: after the sliding "
                          r"window", log))


def test_each_instance_runs_two_kv_cache_groups_and_names_its_block_sizes(hyb):
    for scenario in ("producer-hyb", "producer-hyb64"):
        p = hyb[scenario]
        bs = 64 if scenario.endswith("64") else 32
        kvp = next(iter(p["prefill"].values()))["kv_transfer_params"]
        assert kvp["remote_block_sizes"] == [bs, bs]
        for tid, out in p["prefill"].items():
            n = PROMPT_LENGTHS[int(tid.rsplit("-", 1)[1])]
            # One table per group (sliding window, full attention), each of the prompt's blocks.
            assert [len(g) for g in out["kv_transfer_params"]["remote_block_ids"]] == [-(-n // bs)] * 2
    for r in hyb.values():
        assert "kvferry rank tp=0 pp=0: 2 KV layers" in r["log"], r["log"][-3000:]


def test_hybrid_model_output_depends_on_the_whole_prompt(hyb):
    r = hyb["consumer-hyb-fail"]
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
    for name in ("consumer-hyb-fail", "consumer-hyb-rc"):
        assert hyb[name]["free_after"] == hyb[name]["free_total"], f"{name}: blocks leaked after the loads"
    for name in ("producer-hyb", "producer-hyb64"):
        assert hyb[name]["free_after_lease"] == hyb[name]["free_before"], f"{name}: blocks not freed"
