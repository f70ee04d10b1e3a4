"""kvferry.vllm with real vLLM on an MLA model: a tiny random-weight DeepSeek-V2 (engine_run.py
``TINY_DSV2``) on vLLM's CPU MLA backend, a TP 1 producer and a TP 1 consumer (policy recompute)
side by side. Each layer's KV cache is the latent ``[B, 1, 16, 576]`` under ``MLAAttentionSpec``
(docs/vllm-connector-notes.md §9). Run by scripts/vllm-tests.sh; skipped where vLLM is missing."""

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

from test_vllm_cpu import _caught, _verified, run_engines


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    return run_engines(["producer-mla", "consumer-mla"], tmp_path_factory, model_name="tiny-dsv2")


def test_mla_layers_register_as_latent_caches(mla):
    for r in mla.values():
        # (blocks, 1, block_size 16, kv_lora_rank 512 + qk_rope_head_dim 64), float32.
        line = next((l for l in r["log"].splitlines() if "kvferry rank tp=0 pp=0: 2 KV layers" in l), None)
        assert line is not None, r["log"][-3000:]
        assert ", 1, 16, 576) stride" in line and "float32" in line, line
        assert "Using CPU_MLA backend" in r["log"] or "Using AMX_MLA backend" in r["log"]


def test_mla_model_output_depends_on_the_whole_prompt(mla):
    r = mla["consumer-mla"]
    assert all(a["tokens"] != b["tokens"] for a, b in zip(r["reference"], r["reference_context_changed"]))


def test_mla_every_load_verified(mla):
    c = mla["consumer-mla"]
    assert [o["finish_reason"] for o in c["decode_ok"]] == ["length"] * 3
    assert _verified(c["log"]) == 3, c["log"][-3000:]


def test_mla_decode_equals_the_plain_run(mla):
    p, c = mla["producer-mla"], mla["consumer-mla"]
    assert [o["tokens"] for o in c["reference"]] == [o["tokens"] for o in p["reference"]]
    ref = [o["tokens"] for o in c["reference"]]
    if [o["tokens"] for o in c["reference_continued"]] != [t[4:] for t in ref]:
        # A consumer computes the last prompt token with the decode path over the loaded KV,
        # the plain run with the prefill path: equal outputs need the two paths to agree.
        pytest.xfail("vLLM's CPU MLA prefill and decode paths disagree without kvferry: prompt + its first "
                     f"4 reference tokens continue as {[o['tokens'] for o in c['reference_continued']]}, "
                     f"decoding gave {[t[4:] for t in ref]} (docs/vllm-connector-notes.md §9)")
    assert [o["tokens"] for o in c["decode_ok"]] == ref


def test_mla_corruption_caught_and_recomputed(mla):
    c = mla["consumer-mla"]
    assert c["log"].count("kvferry TEST HOOK: flipped a bit") == 3
    assert _caught(c["log"]) == 3
    assert [o["tokens"] for o in c["decode_corrupt"]] == [o["tokens"] for o in c["reference"]]
    assert c["free_after"] == c["free_total"], "blocks leaked after the loads"
    assert mla["producer-mla"]["free_after_lease"] == mla["producer-mla"]["free_before"]


def test_the_mla_pair_loads_in_secret_mode(mla):
    # Both engines take up kv_connector_extra_config's secret_file (each rank logs its mode), so
    # neither falls back to open mode's loopback-only producers, and every load above verified
    # between two sides that each had to prove the secret.
    for name, r in mla.items():
        assert "secret mode (peers prove the shared secret)" in r["log"], f"{name}: {r['log'][-3000:]}"
        assert "neither allowed_producers nor secret_file" not in r["log"], name
