"""kvferry.vllm with real vLLM (the CPU build, scripts/vllm-env.sh): one engine per subprocess
(engine_run.py), tiny random-weight Qwen3 written by the test, token-id prompts, greedy decoding.

Run by scripts/vllm-tests.sh (installs vLLM into a venv first). Skipped, saying why, where vLLM
is not installed.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE_TIMEOUT_S = 900


def _engine(scenario: str, model: str, rdv: str | None = None) -> subprocess.Popen:
    args = [sys.executable, os.path.join(HERE, "engine_run.py"), scenario, model] + ([rdv] if rdv else [])
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _result(scenario: str, proc: subprocess.Popen, out: str) -> dict:
    lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"{scenario} engine exited {proc.returncode}\n--- output tail ---\n{out[-6000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    result["log"] = out  # vLLM logs to stdout
    return result


def run_engines(scenarios: list[str], tmp_path_factory, model_name: str = "tiny-qwen3") -> dict[str, dict]:
    """Runs the engines at the same time (they meet through files in one directory)."""
    model = str(tmp_path_factory.mktemp(model_name))
    rdv = str(tmp_path_factory.mktemp("rendezvous"))
    # The secret-mode engines' shared secret (engine_run.secret_path), one per run, owner-only.
    secret = os.path.join(rdv, "secret")
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(os.urandom(32).hex())
    procs = {s: _engine(s, model, rdv) for s in scenarios}
    outs = {}
    try:
        for s, p in procs.items():
            outs[s], _ = p.communicate(timeout=ENGINE_TIMEOUT_S)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    # KVFERRY_VLLM_LOG_DIR keeps each engine's whole log (CI artifacts, docs examples).
    log_dir = os.environ.get("KVFERRY_VLLM_LOG_DIR")
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        for s, out in outs.items():
            with open(os.path.join(log_dir, f"{s}.log"), "w") as f:
                f.write(out)
    return {s: _result(s, procs[s], outs[s]) for s in scenarios}


@pytest.fixture(scope="module")
def disagg(tmp_path_factory):
    """A producer and two consumers (kv_load_failure_policy recompute / fail), side by side."""
    return run_engines(["producer", "consumer-recompute", "consumer-fail"], tmp_path_factory)


@pytest.fixture(scope="module")
def producer(disagg):
    return disagg["producer"]


@pytest.fixture(scope="module")
def consumer_recompute(disagg):
    return disagg["consumer-recompute"]


@pytest.fixture(scope="module")
def consumer_fail(disagg):
    return disagg["consumer-fail"]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """TP = 2 and heterogeneous TP, side by side (all recompute): a TP = 2 producer serving a
    TP = 2 consumer (rank r loads from rank r) and a TP = 1 consumer (one load per producer
    rank's head); a TP = 1 producer with head_splits 2 serving the same TP = 2 consumer (each
    rank loads the unit of its head)."""
    return run_engines(["producer-tp2", "producer-split", "consumer-tp2", "consumer-tp1"], tmp_path_factory)


PROMPT_LENGTHS = (7, 32, 75)
BLOCK = 32


def test_producer_returns_params_for_the_consumer(producer):
    for tid, out in producer["prefill"].items():
        kvp = out["kv_transfer_params"]
        assert kvp is not None, f"{tid}: no kv_transfer_params returned"
        assert kvp["do_remote_prefill"] is True and kvp["do_remote_decode"] is False
        assert kvp["transfer_id"] == tid
        assert (kvp["remote_host"], kvp["remote_port"]) == ("127.0.0.1", 17555)
        assert (kvp["remote_tp_size"], kvp["remote_pp_size"]) == (1, 1)
        # The one PP stage's layers (vLLM's get_pp_indices over the tiny model's 2 layers), for
        # consumers of other PP sizes (docs/vllm-connector-notes.md §8); no splits: keys left out.
        assert kvp["remote_stage_layers"] == [[0, 2]]
        assert "remote_head_splits" not in kvp and "remote_layer_splits" not in kvp
        assert kvp["remote_engine_id"] and kvp["load_key"]
        # The CPU attention kernel vLLM picked for the group (fp32, head_dim 64, blocks of 32).
        assert kvp["remote_kv_layouts"] == ["CPU_ATTN:vec:auto"]
        i = int(tid.rsplit("-", 1)[1])
        # The prompt's blocks, one table per KV cache group.
        assert [len(g) for g in kvp["remote_block_ids"]] == [-(-PROMPT_LENGTHS[i] // BLOCK)]
        # The prefill's one token is the first token of the plain greedy run.
        assert out["tokens"] == producer["reference"][i]["tokens"][:1]
    keys = [o["kv_transfer_params"]["load_key"] for o in producer["prefill"].values()]
    assert len(set(keys)) == len(keys), "load keys repeat"


def test_producer_frees_served_and_expired_blocks(producer):
    # 15 prompts held: 5 x (1 + 1 + 3) blocks (7, 32, 75 tokens).
    held = producer["free_before"] - producer["free_held"]
    assert held >= 5 * (1 + 1 + 3), f"only {held} blocks held after the prefills"
    assert producer["free_after_lease"] == producer["free_before"], "blocks not freed after serving / the lease"
    # The three never-loaded transfers expire in kvferry's producer; the others were served.
    assert producer["log"].count("released without serving its consumer (expired)") == 3


def test_model_output_depends_on_the_whole_prompt(consumer_recompute):
    # Same last token, other context: outputs must differ, or equality below proves nothing.
    r = consumer_recompute
    assert all(a["tokens"] != b["tokens"] for a, b in zip(r["reference"], r["reference_context_changed"]))


def _verified(log: str, transfer: str = r"[^)]+") -> int:
    """Verified loads (one line per rank and producer unit) of transfers matching ``transfer``."""
    return len(re.findall(rf"kvferry: load of request \S+ \(transfer {transfer}\) verified:", log))


def _caught(log: str, transfer: str = r"[^)]+") -> int:
    """Loads failed by a mismatch (one line per rank and request) of transfers matching ``transfer``."""
    return len(re.findall(rf"kvferry: load of request \S+ \(transfer {transfer}\) failed \(mismatch\):.*"
                          "reported to vLLM's kv_load_failure_policy", log))


def _flipped(log: str, transfer: str) -> int:
    """Bits the test hook flipped (one per landed unit load) in transfers matching ``transfer``."""
    # The id must end there, but not necessarily the line: two TP ranks' processes share the log.
    return len(re.findall(rf"kvferry TEST HOOK: flipped a bit of landed block \d+ of transfer {transfer}(?![\w-])", log))


def test_disaggregated_decode_equals_the_plain_run(producer, consumer_recompute, consumer_fail):
    for r in (consumer_recompute, consumer_fail):
        assert [o["tokens"] for o in r["decode_ok"]] == [o["tokens"] for o in r["reference"]]
        assert [o["tokens"] for o in r["reference"]] == [o["tokens"] for o in producer["reference"]]
        assert all(o["finish_reason"] == "length" for o in r["decode_ok"])
        # Every load of the clean prompts landed and verified (3 per consumer): none recomputed.
        assert _verified(r["log"]) == 3, r["log"][-3000:]


def test_without_secret_or_allowlist_consumers_warn_they_load_from_this_host_only(consumer_recompute, consumer_fail):
    # The connector hands its extra config's trust settings to the scheduler: open mode, no
    # allowed_producers, so loopback producers only, said once at start-up (and the loads above
    # came from a loopback producer).
    for r in (consumer_recompute, consumer_fail):
        assert "neither allowed_producers nor secret_file" in r["log"], r["log"][-3000:]
        assert "open mode" in r["log"] and "secret mode" not in r["log"], r["log"][-3000:]


def test_corrupted_landed_byte_recompute_gives_the_reference(consumer_recompute):
    r = consumer_recompute
    assert _flipped(r["log"], r"recompute-corrupt-\d") == 3
    assert _caught(r["log"]) == 3
    assert [o["tokens"] for o in r["decode_corrupt"]] == [o["tokens"] for o in r["reference"]]
    assert all(o["finish_reason"] == "length" for o in r["decode_corrupt"])
    assert r["free_after"] == r["free_total"], "blocks leaked after the loads"


def test_connector_metrics_in_vllms_registry_count_the_loads(consumer_recompute):
    # The recompute consumer's load sequence: 3 loads from an unreachable producer (none
    # lands), 3 verified, 3 with a flipped bit (mismatch, recomputed). vLLM takes the stats
    # through get_kv_connector_stats and records them with build_prom_metrics, named as its
    # vllm:nixl_* metrics with the kvferry prefix.
    m = consumer_recompute["kvferry_metrics"]
    assert m.get("vllm:kvferry_num_verified_loads") == 3, m
    assert m.get("vllm:kvferry_num_mismatched_loads") == 3, m
    assert m.get("vllm:kvferry_num_failed_transfers") == 3, m
    assert m.get("vllm:kvferry_num_unverified_loads") == 0, m
    # Every landed load was timed and checksummed, the corrupted ones included.
    assert m.get("vllm:kvferry_xfer_time_seconds") == 6, m
    assert m.get("vllm:kvferry_checksum_time_seconds") == 6, m
    assert m.get("vllm:kvferry_bytes_transferred") == 6, m
    # Each prompt's KV twice: 2 layers x 2 KV heads x 64 dims x 4 bytes x 2 (K, V) per token,
    # whole blocks of 32 tokens (1, 1 and 3 blocks for 7, 32 and 75 tokens).
    assert m.get("vllm:kvferry_bytes_transferred_sum") == 2 * (1 + 1 + 3) * 32 * 2 * 2 * 64 * 4 * 2, m


def test_a_producer_of_another_cpu_kernel_layout_is_refused_before_any_byte_moves(consumer_fail):
    # The producer's params with its layout tag rewritten to the AMX kernel's: each request is
    # refused by the scheduler (the reason logged), reported failed without connecting, and errors
    # under the fail policy; nothing was verified against the misread layout.
    r = consumer_fail
    assert [o["finish_reason"] for o in r["decode_other_layout"]] == ["error"] * 3
    refused = re.findall(r"request \S+: load from producer \S+ \(transfer fail-ok-\d\) refused before any byte "
                         r"moves: group 0: the producer's KV cache layout is 'CPU_ATTN:amx:auto', this instance's "
                         r"'CPU_ATTN:vec:auto'", r["log"])
    assert len(refused) == 3, r["log"][-3000:]
    assert len(re.findall(r"load of request \S+ \(transfer fail-ok-\d\) failed \(unverified\): refused before "
                          r"any transfer", r["log"])) == 3, r["log"][-3000:]
    # No byte moved: the producer's lease still held, the same transfers then loaded and verified.
    assert _verified(r["log"], r"fail-ok-\d") == 3
    assert [o["tokens"] for o in r["decode_ok"]] == [o["tokens"] for o in r["reference"]]


def test_corrupted_landed_byte_fail_errors_the_request(consumer_fail):
    r = consumer_fail
    assert r["log"].count("kvferry TEST HOOK: flipped a bit") == 3
    assert _caught(r["log"]) == 3
    assert [o["finish_reason"] for o in r["decode_corrupt"]] == ["error"] * 3
    assert r["free_after"] == r["free_total"], "blocks leaked after the loads"


def test_each_tp_rank_process_runs_its_own_connector(tp2):
    p = tp2["producer-tp2"]
    kvp = p["prefill"]["tp2-ok-0"]["kv_transfer_params"]
    assert (kvp["remote_tp_size"], kvp["remote_pp_size"]) == (2, 1)
    assert "remote_head_splits" not in kvp
    for rank in (0, 1):
        # One KV head per rank (2 in the model): (blocks, heads, block_size, 2 * head_dim).
        for r in (p, tp2["consumer-tp2"]):
            line = next((l for l in r["log"].splitlines() if f"kvferry rank tp={rank} pp=0: 2 KV layers" in l), None)
            assert line is not None, f"TP rank {rank} registered no KV caches"
            assert ", 1, 32, 128) stride" in line, line
        assert f"kvferry producer rank tp={rank} pp=0 serves on tcp://127.0.0.1:{17565 + rank}" in p["log"]


def test_tp2_decode_equals_the_plain_run_every_rank_verified(tp2):
    r = tp2["consumer-tp2"]
    assert [o["tokens"] for o in r["reference"]] == [o["tokens"] for o in tp2["producer-tp2"]["reference"]]
    assert [o["tokens"] for o in r["decode_ok"]] == [o["tokens"] for o in r["reference"]]
    # 3 prompts x 2 ranks, each rank verifying its own KV head in one load.
    assert _verified(r["log"], r"tp2-ok-\d") == 6, r["log"][-3000:]


def test_tp2_corruption_caught_on_each_rank_and_recomputed(tp2):
    r = tp2["consumer-tp2"]
    hook_lines = "\n".join(l for l in r["log"].splitlines() if "TEST HOOK" in l or "tp2-corrupt" in l)
    assert _flipped(r["log"], r"tp2-corrupt-\d") == 6, hook_lines[-4000:]
    assert _caught(r["log"], r"tp2-corrupt-\d") == 6, hook_lines[-4000:]
    assert [o["tokens"] for o in r["decode_corrupt"]] == [o["tokens"] for o in r["reference"]]
    assert r["free_after"] == r["free_total"], "blocks leaked after the loads"
    assert tp2["producer-tp2"]["free_after_lease"] == tp2["producer-tp2"]["free_before"]


def test_tp2_producer_to_tp1_consumer_loads_each_ranks_head_verified(tp2):
    r = tp2["consumer-tp1"]
    assert [o["tokens"] for o in r["reference"]] == [o["tokens"] for o in tp2["producer-tp2"]["reference"]]
    assert [o["tokens"] for o in r["decode_ok"]] == [o["tokens"] for o in r["reference"]]
    # 3 prompts x 2 producer ranks: the one consumer rank loads and verifies each head on its own.
    assert _verified(r["log"], r"tp1-ok-\d") == 6, r["log"][-3000:]
    for heads, port in (("[0, 1)", 17565), ("[1, 2)", 17566)):
        assert len(re.findall(rf"\(transfer tp1-ok-\d\) verified:.*\(KV heads {re.escape(heads)} from "
                              rf"tcp://127.0.0.1:{port}\)", r["log"])) == 3, heads


def test_tp2_producer_to_tp1_consumer_corruption_caught_and_recomputed(tp2):
    r = tp2["consumer-tp1"]
    # The hook flips a bit in each unit's landed blocks; each request fails once and recomputes.
    assert _flipped(r["log"], r"tp1-corrupt-\d") == 6
    assert _caught(r["log"], r"tp1-corrupt-\d") == 3
    assert [o["tokens"] for o in r["decode_corrupt"]] == [o["tokens"] for o in r["reference"]]
    assert r["free_after"] == r["free_total"], "blocks leaked after the loads"


def test_split_producer_serves_each_head_through_its_own_unit(tp2):
    p = tp2["producer-split"]
    kvp = p["prefill"]["tp2-ok-s-0"]["kv_transfer_params"]
    assert (kvp["remote_tp_size"], kvp["remote_pp_size"], kvp["remote_head_splits"]) == (1, 1, 2)
    assert (kvp["remote_host"], kvp["remote_port"]) == ("127.0.0.1", 17575)
    for unit in (0, 1):
        assert (f"kvferry producer rank tp=0 pp=0 serves on tcp://127.0.0.1:{17575 + unit} (tcp) "
                f"(KV heads [{unit}, {unit + 1}))") in p["log"]
    # Blocks freed only once both units released: served, or (never loaded) expired.
    assert p["free_after_lease"] == p["free_before"], "blocks not freed after serving / the lease"
    assert p["log"].count("released without serving its consumer (expired)") == 3


def test_tp1_split_producer_to_tp2_consumer_each_rank_loads_its_unit_verified(tp2):
    r = tp2["consumer-tp2"]
    assert [o["tokens"] for o in r["decode_ok_s"]] == [o["tokens"] for o in r["reference"]]
    # 3 prompts x 2 consumer ranks, each one load of its unit (its whole rank).
    assert _verified(r["log"], r"tp2-ok-s-\d") == 6, r["log"][-3000:]


def test_tp1_split_producer_to_tp2_consumer_corruption_caught_and_recomputed(tp2):
    r = tp2["consumer-tp2"]
    assert _flipped(r["log"], r"tp2-corrupt-s-\d") == 6
    assert _caught(r["log"], r"tp2-corrupt-s-\d") == 6
    assert [o["tokens"] for o in r["decode_corrupt_s"]] == [o["tokens"] for o in r["reference"]]


def test_unreachable_producer_recompute_gives_the_reference_output(consumer_recompute):
    r = consumer_recompute
    assert [o["tokens"] for o in r["decode_unreachable"]] == [o["tokens"] for o in r["reference"]]
    assert all(o["finish_reason"] == "length" for o in r["decode_unreachable"])
    # Each load went through the connector's worker and was reported as failed (did not land).
    assert sum(1 for l in r["log"].splitlines() if "did not land" in l
               and "reported to vLLM's kv_load_failure_policy" in l) == 3


def test_unreachable_producer_fail_policy_errors_the_request(consumer_fail):
    r = consumer_fail
    assert all(o["finish_reason"] == "length" for o in r["reference"])
    assert [o["finish_reason"] for o in r["decode_unreachable"]] == ["error"] * 3
