"""The KV checksum of KV cache blocks, its payload, verdicts and failure policy.

Definition (docs/design.md §2.1; the vLLM KV checksum series, "What a
checksum is"): a block's checksum is ``sum over layers and KV heads of m * s mod 2**64`` with
``m = 2 * (layer * MAX_KV_HEADS_PER_LAYER + head) + 1`` and the slice checksum
``s = sum_j x_j * (2j + 1) mod 2**64`` over the little-endian 8-byte pieces ``x_j`` of the
slice's cells (K then V of one head and token), ``j = t * P + p`` numbered from the request's
first token; tokens at or past ``num_tokens`` are left out.

- ``block_checksums(layers, block_ids, num_tokens, ...)``: one rank's values (list of int).
- ``submit(...)``: the same, returned as a ``KVChecksumPending`` (CUDA: no host sync).
- ``KVChecksumPayload`` / ``KVChecksumGroup``: what a producer sends (the seed's wire format,
  byte-equal to ``kvferry payload encode``).
- ``compare(expected, actual)`` -> ``KVChecksumVerdict``; ``KVChecksumPolicy`` / ``decide``:
  the action (``"complete"``, ``"fail"``, ``"recompute"``).
"""

import sys

from kvferry._kvferry import (  # noqa: F401
    MAX_KV_HEADS_PER_LAYER,
    KVCacheLayer,
    KVChecksumGroup,
    KVChecksumPayload,
    KVChecksumPending,
    KVChecksumPolicy,
    KVChecksumVerdict,
    _submit_checksums,
    compare,
    decide,
    group_fingerprint,
    layer_fingerprint,
)

__all__ = [
    "MAX_KV_HEADS_PER_LAYER",
    "KVCacheLayer",
    "KVChecksumGroup",
    "KVChecksumPayload",
    "KVChecksumPending",
    "KVChecksumPolicy",
    "KVChecksumVerdict",
    "block_checksums",
    "compare",
    "decide",
    "group_fingerprint",
    "layer_fingerprint",
    "submit",
]


def _stream_handle(layers, stream):
    """The raw CUDA stream handle (int) to order CUDA checksums after, or None for CPU layers.

    ``stream`` may be an int (a ``cudaStream_t``), an object with ``cuda_stream`` (a
    ``torch.cuda.Stream``), or None: then torch's current stream of the layers' device when torch
    is imported, else the legacy default stream (0), which waits for all blocking streams.
    """
    device = layers[0].device if layers else "cpu"
    if not device.startswith("cuda"):
        return None
    if stream is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return 0
        index = int(device.split(":", 1)[1])
        return int(torch.cuda.current_stream(index).cuda_stream)
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    return int(stream)


def submit(layers, block_ids, num_tokens, *, start=0, stream=None):
    """Starts the checksum of blocks and returns a ``KVChecksumPending``.

    - layers: list of ``KVCacheLayer`` of one rank (one device, one block size, one replica
      key); their values are summed.
    - block_ids: logical block ids, ``block_ids[i]`` at request position ``start + i``.
    - num_tokens: tokens of the request; slots at or past it are left out (the last block).
    - start: request position of ``block_ids[0]``.
    - stream: for CUDA layers, the stream whose queued work (e.g. the forward writing the KV)
      must finish before the checksum reads it: int handle, ``torch.cuda.Stream``, or None
      (torch's current stream). Nothing synchronises that stream and the host does not wait.
      Ignored for CPU layers, which are checksummed before this returns (the GIL released).

    ``.wait(timeout)`` on the result gives the list of int (u64), one per block id.
    Raises ValueError: no layers, layers on several devices, of several replica keys or block
    sizes, a block id the tensors do not hold; RuntimeError: CUDA layers without a usable CUDA
    checksum backend or a device failure.
    """
    layers = list(layers)
    return _submit_checksums(layers, list(block_ids), num_tokens, start, _stream_handle(layers, stream))


def block_checksums(layers, block_ids, num_tokens, *, start=0, stream=None, timeout=30.0):
    """The checksum of blocks over ``layers``: list of int (u64), one per block id.

    As ``submit(...).wait(timeout)``: CUDA layers are checksummed after ``stream``'s queued work
    and this call waits (GIL released, at most ``timeout`` seconds, TimeoutError after) for the
    values only, never synchronising the stream. The values are this rank's part; a side's value
    of a block is the sum mod 2**64 over its TP and PP ranks (docs/design.md §2.3).
    """
    return submit(layers, block_ids, num_tokens, start=start, stream=stream).wait(timeout)
