"""kvferry.vllm with real vLLM (the CPU build, scripts/vllm-env.sh): one engine per subprocess
(engine_run.py), tiny random-weight Qwen3 written by the test, token-id prompts, greedy decoding.

Run by scripts/vllm-tests.sh (installs vLLM into a venv first). Skipped, saying why, where vLLM
is not installed.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE_TIMEOUT_S = 540


def run_engine(scenario: str, tmp_path_factory) -> dict:
    model = str(tmp_path_factory.mktemp("tiny-qwen3"))
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "engine_run.py"), scenario, model],
        capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        # vLLM logs to stdout, Python tracebacks go to stderr: show the end of both.
        pytest.fail(f"{scenario} engine exited {proc.returncode}\n--- stdout tail ---\n{proc.stdout[-4000:]}"
                    f"\n--- stderr tail ---\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    result["log"] = proc.stdout + proc.stderr  # vLLM logs to stdout
    return result


@pytest.fixture(scope="module")
def producer(tmp_path_factory):
    return run_engine("producer", tmp_path_factory)


@pytest.fixture(scope="module")
def producer_tp2(tmp_path_factory):
    return run_engine("producer-tp2", tmp_path_factory)


@pytest.fixture(scope="module")
def consumer_recompute(tmp_path_factory):
    return run_engine("consumer-recompute", tmp_path_factory)


@pytest.fixture(scope="module")
def consumer_fail(tmp_path_factory):
    return run_engine("consumer-fail", tmp_path_factory)


def test_producer_returns_params_for_the_consumer(producer):
    for i, out in enumerate(producer["prefill"]):
        kvp = out["kv_transfer_params"]
        assert kvp is not None, f"prompt {i}: no kv_transfer_params returned"
        assert kvp["do_remote_prefill"] is True and kvp["do_remote_decode"] is False
        assert kvp["transfer_id"] == f"t{i}"
        assert (kvp["remote_host"], kvp["remote_port"]) == ("127.0.0.1", 17555)
        assert (kvp["remote_tp_size"], kvp["remote_pp_size"]) == (1, 1)
        assert kvp["remote_engine_id"]
        # The prefill's one token is the first token of the plain greedy run.
        assert out["tokens"] == producer["reference"][i]["tokens"][:1]


def test_producer_holds_blocks_until_the_lease_expires(producer):
    # Each prompt keeps its ceil(len / 32) blocks (the first sampled token may add none: 7, 32,
    # 75 tokens + 1 = 1, 2, 3 blocks).
    held = producer["free_before"] - producer["free_held"]
    assert held >= 1 + 1 + 3, f"only {held} blocks held after the prefills"
    assert producer["free_after_lease"] == producer["free_before"], "blocks not freed after the lease"
    assert producer["log"].count("lease expired before its consumer was served") >= 3


def test_each_tp_rank_process_runs_its_own_connector(producer_tp2):
    kvp = producer_tp2["prefill"][0]["kv_transfer_params"]
    assert (kvp["remote_tp_size"], kvp["remote_pp_size"]) == (2, 1)
    log = producer_tp2["log"]
    for rank in (0, 1):
        # One KV head per rank (2 in the model): (blocks, heads, block_size, 2 * head_dim).
        line = next((l for l in log.splitlines() if f"kvferry rank tp={rank} pp=0: 2 KV layers" in l), None)
        assert line is not None, f"TP rank {rank} registered no KV caches"
        assert ", 1, 32, 128) stride" in line, line


def test_failed_load_recompute_gives_the_reference_output(consumer_recompute):
    r = consumer_recompute
    # The model's output depends on the whole prompt's KV (else equality below proves nothing).
    changed = r["reference_context_changed"]
    assert all(a["tokens"] != b["tokens"] for a, b in zip(r["reference"], changed))
    assert [o["tokens"] for o in r["decode"]] == [o["tokens"] for o in r["reference"]]
    assert all(o["finish_reason"] == "length" for o in r["decode"])
    # Each load went through the connector's worker and was reported as failed.
    assert r["log"].count("reported to vLLM's kv_load_failure_policy") == 3
    assert r["free_after"] == r["free_total"], "blocks leaked after the failed loads"


def test_failed_load_fail_policy_errors_the_request(consumer_fail):
    r = consumer_fail
    assert all(o["finish_reason"] == "length" for o in r["reference"])
    assert [o["finish_reason"] for o in r["decode"]] == ["error"] * 3
    assert r["free_after"] == r["free_total"], "blocks leaked after the failed loads"
