"""kvferry: peer-to-peer KV-cache transfer for disaggregated LLM serving that verifies every load.

`kvferry.TransferEngine` is a drop-in for Mooncake's Python `TransferEngine`.
`kvferry.Producer` / `kvferry.Consumer` move KV cache tensors with verified loads;
`kvferry.checksum` computes, encodes and compares the KV checksums.
"""

from kvferry._kvferry import *  # noqa: F401,F403
from kvferry._kvferry import __version__  # noqa: F401  (the crate's version; `*` skips dunders)
from kvferry import checksum  # noqa: F401,E402
from kvferry.outcomes import Action, Release, ReleaseReason, Verdict  # noqa: F401,E402
