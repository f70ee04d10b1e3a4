"""kvferry.vllm.proxy's request flow, with both vLLM instances replaced by an httpx mock that
records what they were sent (the engines' side of the params is test_vllm_cpu.py's)."""

import importlib.util
import json

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

import httpx
from fastapi.testclient import TestClient

from kvferry.vllm.proxy import make_app

REPLY = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "x", "remote_engine_id": "e",
         "remote_host": "10.0.0.1", "remote_port": 17500, "remote_tp_size": 1, "remote_pp_size": 1,
         "remote_block_ids": [[4, 9]], "load_key": "k"}


def upstreams(prefill_params=REPLY, prefill_status=200):
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append((request.url.host, request.url.path, body))
        if request.url.host == "prefill":
            if prefill_status != 200:
                return httpx.Response(prefill_status, text="boom")
            kvp = dict(prefill_params, transfer_id=body["kv_transfer_params"]["transfer_id"]) if prefill_params else None
            return httpx.Response(200, json={"choices": [{"text": "a"}], "kv_transfer_params": kvp})
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})

    return sent, httpx.MockTransport(handler)


@pytest.fixture
def client():
    made = []

    def build(transport):
        c = TestClient(make_app("http://prefill:8100", "http://decode:8200", transport=transport))
        made.append(c.__enter__())  # runs the app's lifespan: its upstream client
        return made[-1]

    yield build
    for c in made:
        c.__exit__(None, None, None)


def test_prefill_gets_one_token_and_do_remote_decode_then_decode_gets_its_params(client):
    sent, transport = upstreams()
    r = client(transport).post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 20,
                                                        "stream": False})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    (h1, p1, b1), (h2, p2, b2) = sent
    assert (h1, p1) == ("prefill", "/v1/completions") and (h2, p2) == ("decode", "/v1/completions")
    assert b1["max_tokens"] == 1 and b1["stream"] is False
    assert b1["kv_transfer_params"]["do_remote_decode"] is True
    tid = b1["kv_transfer_params"]["transfer_id"]
    assert b2["max_tokens"] == 20 and b2["prompt"] == [1, 2, 3]
    assert b2["kv_transfer_params"] == dict(REPLY, transfer_id=tid)


def test_each_request_gets_its_own_transfer_id(client):
    sent, transport = upstreams()
    c = client(transport)
    for _ in range(2):
        c.post("/v1/chat/completions", json={"model": "m", "messages": [], "max_completion_tokens": 5})
    tids = [b["kv_transfer_params"]["transfer_id"] for h, _, b in sent if h == "prefill"]
    assert len(set(tids)) == 2
    assert all(b["max_completion_tokens"] == 1 for h, _, b in sent if h == "prefill")


def test_a_prefill_without_params_is_a_502_and_nothing_reaches_decode(client):
    sent, transport = upstreams(prefill_params=None)
    r = client(transport).post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 3})
    assert r.status_code == 502 and "no kv_transfer_params" in r.json()["error"]["message"]
    assert [h for h, _, _ in sent] == ["prefill"]


def test_a_failed_prefill_passes_its_status_through(client):
    sent, transport = upstreams(prefill_status=503)
    r = client(transport).post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 3})
    assert r.status_code == 503
    assert [h for h, _, _ in sent] == ["prefill"]


def test_prefill_gets_at_most_one_min_token_and_one_sequence(client):
    sent, transport = upstreams()
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 20, "min_tokens": 5, "n": 3, "best_of": 4}
    r = client(transport).post("/v1/completions", json=body)
    assert r.status_code == 200
    (_, _, b1), (_, _, b2) = sent
    assert (b1["max_tokens"], b1["min_tokens"], b1["n"]) == (1, 1, 1) and "best_of" not in b1
    # The decode instance gets the client's sampling settings unchanged.
    assert (b2["max_tokens"], b2["min_tokens"], b2["n"], b2["best_of"]) == (20, 5, 3, 4)
