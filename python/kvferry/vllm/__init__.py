"""kvferry's vLLM v1 KV connector: ``kv_connector_module_path="kvferry.vllm"``,
``kv_connector="KvferryConnector"`` (see :mod:`kvferry.vllm.connector`).

``KvferryConnector`` needs vLLM (0.32 tested); it is imported on first use, so that the parts
that do not need vLLM (the proxy, :mod:`kvferry.vllm.proxy`; the params and units helpers)
import without it. Asking for ``KvferryConnector`` without vLLM raises ImportError naming what
to install.
"""

__all__ = ["KvferryConnector"]


def __getattr__(name: str):
    # PEP 562: vLLM's connector factory does getattr(module, "KvferryConnector").
    if name != "KvferryConnector":
        raise AttributeError(f"module 'kvferry.vllm' has no attribute {name!r}")
    try:
        import vllm  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "kvferry.vllm.KvferryConnector runs inside vLLM, which is not installed here: "
            "`pip install vllm` (GPU; 0.32 tested), or vLLM's CPU build for a CPU-only machine"
        ) from e
    from kvferry.vllm.connector import KvferryConnector

    return KvferryConnector
