"""kvferry: peer-to-peer KV-cache transfer for disaggregated LLM serving that verifies every load.

`kvferry.TransferEngine` is a drop-in for Mooncake's Python `TransferEngine`.
"""

from kvferry._kvferry import *  # noqa: F401,F403
