"""Test helpers for the KV checksum tests: an independent NumPy form of the checksum definition,
KV tensors in every layout built from one logical array, and the `kvferry` CLI binary.

The reference follows the definition as the vLLM KV checksum series and docs/design.md §2.1 state it,
and never calls kvferry: a cell is the K then the V elements of one KV head for one token, split
into little-endian 8-byte pieces x_j with j = t * P + p (t the token's index in the request, P
pieces per cell); a slice (one layer, one head, one block) has s = sum_j x_j * (2j + 1) mod 2**64
over tokens t < num_tokens; a block has c = sum over layers and heads of m * s mod 2**64 with
m = 2 * (layer * 65536 + head) + 1, head the global KV head index.
"""

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
U64 = np.uint64


def logical_kv(num_blocks, block_size, heads, parts, head_dim, dtype, seed):
    """Random KV as a logical array [block, token, head, part, element] of `dtype`."""
    rng = np.random.default_rng(seed)
    itemsize = np.dtype(dtype).itemsize
    raw = rng.integers(0, 256, size=num_blocks * block_size * heads * parts * head_dim * itemsize,
                       dtype=np.uint8)
    return raw.view(dtype).reshape(num_blocks, block_size, heads, parts, head_dim)


def physical(logical, layout, kernel_blocks=1):
    """`logical` [block, token, head, part, element] laid out in `layout` ("KV B N H D", ...):
    a C-contiguous array whose axes are the layout's dimensions in order, a logical block being
    `kernel_blocks` consecutive kernel blocks of N = block_size / kernel_blocks tokens."""
    nb, bs, h, parts, d = logical.shape
    n = bs // kernel_blocks
    # [B, N, H, KV, D]: token t of block b lies in kernel block b * kernel_blocks + t // n.
    a = logical.reshape(nb * kernel_blocks, n, h, parts, d)
    names = ["B", "N", "H", "KV", "D"]
    dims = layout.split()
    if "KV" not in dims:
        assert parts == 1
        a = a[:, :, :, 0, :]
        names.remove("KV")
    if "H" not in dims:
        assert h == 1
        a = a[:, :, 0]
        names.remove("H")
    return np.ascontiguousarray(a.transpose([names.index(x) for x in dims]))


def block_checksums(logical, layer, head_offset, block_ids, num_tokens, start=0):
    """The definition's values of the blocks `block_ids` (position start + i) of one layer whose
    KV is `logical` [block, token, head, part, element] (global heads from `head_offset`)."""
    nb, bs, h, parts, d = logical.shape
    cell = np.ascontiguousarray(logical).reshape(nb, bs, h, parts * d)
    cell_bytes = cell.shape[-1] * cell.itemsize
    assert cell_bytes % 8 == 0
    p = cell_bytes // 8
    pieces = cell.view(np.uint8).reshape(nb, bs, h, cell_bytes).copy().view("<u8")  # [nb, bs, h, P]
    out = []
    for i, b in enumerate(block_ids):
        pos = start + i
        tok = pos * bs + np.arange(bs, dtype=np.uint64)
        keep = tok < num_tokens
        x = pieces[b][keep]  # [t, h, P]
        j = tok[keep][:, None] * U64(p) + np.arange(p, dtype=np.uint64)[None, :]  # [t, P]
        w = U64(2) * j + U64(1)
        s = (x * w[:, None, :]).sum(axis=(0, 2), dtype=np.uint64)  # [h]
        heads = np.arange(h, dtype=np.uint64) + U64(head_offset)
        m = U64(2) * (U64(layer) * U64(65536) + heads) + U64(1)
        out.append(int((m * s).sum(dtype=np.uint64)) if len(s) else 0)
    return out


def kvferry_cli():
    """Path of the `kvferry` CLI binary: $KVFERRY_BIN, else release builds under
    $CARGO_TARGET_DIR or the repository's target/, else built with cargo (None without cargo)."""
    if os.environ.get("KVFERRY_BIN"):
        return os.environ["KVFERRY_BIN"]
    dirs = [os.environ.get("CARGO_TARGET_DIR"), str(REPO / "target")]
    for d in filter(None, dirs):
        p = Path(d) / "release" / "kvferry"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    if shutil.which("cargo") is None:
        return None
    subprocess.run(["cargo", "build", "--release", "--bin", "kvferry"], cwd=REPO, check=True)
    target = os.environ.get("CARGO_TARGET_DIR") or str(REPO / "target")
    return str(Path(target) / "release" / "kvferry")
