"""The disaggregation proxy: one OpenAI-compatible endpoint in front of a prefill (producer) and a
decode (consumer) vLLM instance running kvferry's connector, as vLLM's disaggregated examples do
(`examples/online_serving/disaggregated_serving`, NIXL's / Mooncake's toy proxies).

For each ``/v1/completions`` or ``/v1/chat/completions`` request:

1. to the prefill instance, the body with ``max_tokens=1`` (``max_completion_tokens`` too),
   ``min_tokens`` at most 1, ``n=1``, no ``best_of``, ``stream=False`` and ``kv_transfer_params={"do_remote_decode": True, "transfer_id": <new>}``;
2. to the decode instance, the original body with the ``kv_transfer_params`` the prefill
   returned (the producer's address, block table and load key); its answer (streamed or not)
   is the client's.

Run::

    python -m kvferry.vllm.proxy --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 --port 8000

Needs ``fastapi``, ``uvicorn`` and ``httpx`` (vLLM's own requirements; not vLLM itself:
``pip install 'kvferry[proxy]'`` on a machine without vLLM). Errors: a prefill that
fails or returns no ``kv_transfer_params`` answers the client with its status and message
(HTTP 502 when it returned no params); nothing is sent to the decode instance then.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at run time.

import argparse
import contextlib
import copy
import uuid
from typing import Any

from kvferry.vllm import params as P


class ProxyError(Exception):
    """The prefill step failed: ``status`` (HTTP) and ``message`` go back to the client."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The request for the prefill instance: one token (``max_tokens`` 1, ``min_tokens`` at most
    1), one sequence (``n`` 1, no ``best_of``), not streamed, KV held for a consumer."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    # vLLM refuses min_tokens > max_tokens, and several samples would finish one request with
    # several sequences: one token, one sequence.
    if out.get("min_tokens") is not None:
        out["min_tokens"] = min(out["min_tokens"], 1) if isinstance(out["min_tokens"], int) else 1
    out["n"] = 1
    out.pop("best_of", None)
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = {P.DO_REMOTE_DECODE: True, P.TRANSFER_ID: transfer_id}
    return out


def decode_body(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The request for the decode instance: the client's, with the prefill's ``kv_transfer_params``.

    Raises :class:`ProxyError` (502) when the prefill response carries none (its instance does
    not run kvferry's connector as ``kv_producer``, or the request did not finish by length)."""
    kvp = prefill_response.get("kv_transfer_params")
    if not isinstance(kvp, dict) or not kvp.get(P.DO_REMOTE_PREFILL):
        raise ProxyError(502, f"the prefill instance returned no kv_transfer_params for a remote decode: {kvp!r}")
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = kvp
    return out


PROXY_PACKAGES = ("fastapi", "uvicorn", "httpx")


def _require_web_stack() -> None:
    """Raises ImportError naming the proxy's missing packages and the command that installs them
    (they come with vLLM; a machine running only the proxy needs just these)."""
    import importlib.util

    missing = [p for p in PROXY_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise ImportError(
            f"the kvferry proxy needs {', '.join(missing)}: pip install {' '.join(missing)} "
            "(or pip install 'kvferry[proxy]')"
        )


def make_app(prefill_url: str, decode_url: str, timeout_s: float = 600.0, transport: Any = None):
    """The FastAPI app: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /health``.
    ``transport``: an ``httpx`` transport for the upstream calls (tests); default: the network."""
    _require_web_stack()
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # One client per event loop: the app's (created at startup, closed at shutdown).
        async with httpx.AsyncClient(timeout=timeout_s, transport=transport) as c:
            state["client"] = c
            yield

    app = FastAPI(lifespan=lifespan)

    async def handle(path: str, request: Request):
        client = state["client"]
        body = await request.json()
        transfer_id = f"kvferry-{uuid.uuid4().hex}"
        try:
            r = await client.post(prefill_url.rstrip("/") + path, json=prefill_body(body, transfer_id))
            if r.status_code != 200:
                raise ProxyError(r.status_code, f"prefill instance: {r.text}")
            dbody = decode_body(body, r.json())
        except ProxyError as e:
            return JSONResponse({"error": {"message": e.message, "transfer_id": transfer_id}}, status_code=e.status)
        url = decode_url.rstrip("/") + path
        if dbody.get("stream"):
            req = client.build_request("POST", url, json=dbody)
            resp = await client.send(req, stream=True)

            async def chunks():
                try:
                    async for c in resp.aiter_bytes():
                        yield c
                finally:
                    await resp.aclose()

            return StreamingResponse(chunks(), status_code=resp.status_code,
                                     media_type=resp.headers.get("content-type", "text/event-stream"))
        resp = await client.post(url, json=dbody)
        return JSONResponse(resp.json(), status_code=resp.status_code)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle("/v1/chat/completions", request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def main(argv: list[str] | None = None) -> None:
    """``python -m kvferry.vllm.proxy --prefill URL --decode URL [--host H] [--port N]``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="base URL of the prefill (kv_producer) instance")
    ap.add_argument("--decode", required=True, help="base URL of the decode (kv_consumer) instance")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")
    a = ap.parse_args(argv)
    _require_web_stack()
    import uvicorn

    uvicorn.run(make_app(a.prefill, a.decode, a.timeout), host=a.host, port=a.port, log_level="info")


if __name__ == "__main__":
    main()
