"""kvferry.vllm.proxy in front of two real `vllm serve` processes (the CPU build): a prefill
(kv_producer) and a decode (kv_consumer) instance with kvferry's connector, the tiny Qwen3 of
engine_run.py. Each proxied request must come back with the tokens the decode instance gives
for the same request on its own, and the decode instance must log one verified load per
proxied request (the KV moved and verified through the proxy's params).

`vllm serve` loads vLLM's dummy weights as they are (no re-randomising hook in a server), with
which the next token barely depends on the context: the token equality here checks the flow, the
verified-load count that the KV arrived. test_vllm_cpu.py checks outputs with a model that
depends on the whole prompt."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

from fastapi.testclient import TestClient

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_run import BLOCK_SIZE, write_model  # noqa: E402

from kvferry.vllm.proxy import make_app  # noqa: E402

START_TIMEOUT_S = 480
PROMPTS = [list(range(3, 3 + n)) for n in (7, 32, 75)]


def _serve(model, port, role, kv_port, log_path):
    ktc = {"kv_connector": "KvferryConnector", "kv_connector_module_path": "kvferry.vllm", "kv_role": role,
           "kv_load_failure_policy": "fail",
           "kv_connector_extra_config": {"host": "127.0.0.1", "port": kv_port, "lease_seconds": 30.0,
                                         "load_timeout_seconds": 20.0}}
    # Not the `vllm` console script: it looks up the distribution "vllm", and the CPU build is
    # installed as "vllm-cpu" (PackageNotFoundError). This module is what `vllm serve` runs.
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1")
    log = open(log_path, "w")
    return subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy",
         "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
         "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "4", "--no-enable-prefix-caching", "--seed", "0",
         "--kv-transfer-config", json.dumps(ktc)],
        stdout=log, stderr=subprocess.STDOUT, env=env), log


def _wait_healthy(url, proc, log_path):
    end = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited {proc.returncode}:\n{open(log_path).read()[-5000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"vllm serve at {url} not healthy within {START_TIMEOUT_S} s:\n{open(log_path).read()[-5000:]}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    model = str(d / "tiny-qwen3")
    write_model(model)
    logs = {k: str(d / f"{k}.log") for k in ("prefill", "decode")}
    made = [_serve(model, 18100, "kv_producer", 17585, logs["prefill"]),
            _serve(model, 18200, "kv_consumer", 17595, logs["decode"])]
    try:
        _wait_healthy("http://127.0.0.1:18100", made[0][0], logs["prefill"])
        _wait_healthy("http://127.0.0.1:18200", made[1][0], logs["decode"])
        yield model, logs
    finally:
        for proc, log in made:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
        log_dir = os.environ.get("KVFERRY_VLLM_LOG_DIR")
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            for k, p in logs.items():
                shutil.copy(p, os.path.join(log_dir, f"serve-{k}.log"))


def test_proxied_requests_load_verified_kv_and_match_the_decode_instance(servers):
    model, logs = servers
    with TestClient(make_app("http://127.0.0.1:18100", "http://127.0.0.1:18200", timeout_s=120)) as proxy:
        run_prompts(proxy, model)
    decode_log = open(logs["decode"]).read()
    verified = [l for l in decode_log.splitlines() if "kvferry: load of request" in l and ") verified:" in l]
    assert len(verified) == len(PROMPTS), decode_log[-4000:]
    assert "kv_load_failure_policy" not in "".join(l for l in decode_log.splitlines() if "kvferry: load" in l)


def run_prompts(proxy, model):
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}
        r = proxy.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]
        req = urllib.request.Request("http://127.0.0.1:18200/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as plain:
            want = json.load(plain)["choices"][0]
        assert got["token_ids"] == want["token_ids"] and len(got["token_ids"]) == 8
        assert got["finish_reason"] == "length"
