"""kvferry.TransferEngine with KV in GPU memory (torch CUDA tensors): registration with the
default location "*" must detect device memory (cuda:N) from the pointer, and bytes must move
GPU -> host and host -> GPU over TCP. Skipped, not failed, without torch or a CUDA device;
`KVFERRY_REQUIRE_GPU=1` (the GPU machine) turns the skip into a failure."""

import os

import numpy as np
import pytest

from kvferry import TransferEngine

try:
    import torch
except ImportError:
    torch = None
if torch is None or not torch.cuda.is_available():
    why = "torch is not installed" if torch is None else "torch sees no CUDA device"
    if os.environ.get("KVFERRY_REQUIRE_GPU") == "1":
        raise RuntimeError(f"KVFERRY_REQUIRE_GPU=1 but {why}")
    pytest.skip(why, allow_module_level=True)


def test_wildcard_location_detects_gpu_memory_and_moves_bytes():
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    n = 8 << 20
    g = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    back = torch.zeros(n, dtype=torch.uint8, device="cuda")
    host = np.zeros(n, dtype=np.uint8)
    torch.cuda.synchronize()
    assert a.batch_register_memory([g.data_ptr(), back.data_ptr()], [n, n]) == 0  # "*"
    assert b.register_memory(host.ctypes.data, n) == 0
    seg = f"127.0.0.1:{b.get_rpc_port()}"
    # GPU -> host (a device pointer misread as host memory would crash or copy garbage)
    assert a.transfer_sync_write(seg, g.data_ptr(), host.ctypes.data, n) == 0
    assert (host == g.cpu().numpy()).all()
    # host -> GPU, scattered
    blk = 64 << 10
    k = n // blk
    perm = np.random.default_rng(1).permutation(k)
    assert a.batch_transfer_sync_read(
        seg, [back.data_ptr() + i * blk for i in range(k)],
        [host.ctypes.data + int(perm[i]) * blk for i in range(k)], [blk] * k) == 0
    got = back.cpu().numpy().reshape(k, blk)
    want = host.reshape(k, blk)[perm]
    assert (got == want).all()
    # claiming host memory is GPU memory is refused
    extra = np.zeros(4096, dtype=np.uint8)
    assert a.register_memory(extra.ctypes.data, 4096, "cuda:0") == -1
    assert a.register_memory(extra.ctypes.data, 4096, "*") == 0
    assert a.batch_unregister_memory([g.data_ptr(), back.data_ptr(), extra.ctypes.data]) == 0
