"""kvferry's vLLM v1 KV connector: ``kv_connector_module_path="kvferry.vllm"``,
``kv_connector="KvferryConnector"`` (see :mod:`kvferry.vllm.connector`).

Needs vLLM (0.32 CPU build tested, `scripts/vllm-env.sh`); importing this module without vLLM
raises ImportError naming it.
"""

try:
    import vllm  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("kvferry.vllm needs vLLM: install it (scripts/vllm-env.sh installs the CPU build)") from e

from kvferry.vllm.connector import KvferryConnector

__all__ = ["KvferryConnector"]
