"""1P1D move of GPU KV through kvferry's Mooncake-compatible TransferEngine (protocol
"nvlink_intra": CUDA IPC) between two processes on one GPU, as ratios to an in-process
device copy of the same bytes (torch, timed with CUDA events) measured in the same run.

The target process allocates and registers the destination; this process registers its
source and WRITEs with `transfer_sync_write` (one contiguous request) and
`batch_transfer_sync_write` (64 KiB pieces at every other offset on both sides, so nothing
coalesces), timed on the host from call to return, as a Mooncake user would see it. The same
requests go through the Rust API in `cuda_ipc_bench` (its engine columns). The bytes are
checked at the end (sums of the landed pieces, computed by the target on its GPU).

    python3 bench/python_cuda_ipc.py [MAX_MIB]     # needs torch with CUDA and the kvferry wheel
"""

import multiprocessing as mp
import sys
import time

MIB = 1 << 20


def target(conn, n):
    import torch
    from kvferry import TransferEngine

    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink_intra", "") == 0
    buf = torch.zeros(2 * n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    assert e.register_memory(buf.data_ptr(), 2 * n) == 0
    conn.send((f"127.0.0.1:{e.get_rpc_port()}", buf.data_ptr()))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        off, length = msg
        conn.send(int(buf[off:off + length].to(torch.int64).sum()))


def main():
    import torch
    from kvferry import TransferEngine

    max_mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    n = max_mib * MIB
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(child, n), daemon=True)
    p.start()
    seg, remote = parent.recv()
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink_intra", "") == 0
    src = torch.randint(0, 256, (2 * n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    torch.cuda.synchronize()
    assert e.register_memory(src.data_ptr(), 2 * n) == 0
    base = src.data_ptr()

    def reference(size, reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dst[:size].copy_(src[:size])
        a.record()
        for _ in range(reps):
            dst[:size].copy_(src[:size])
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / reps

    def host_time(f, reps):
        f()
        t = time.perf_counter()
        for _ in range(reps):
            f()
        return (time.perf_counter() - t) / reps

    print(f"device: {torch.cuda.get_device_name()} (one GPU, process pair, Python TransferEngine, nvlink_intra)")
    print("| size | reference GB/s | contiguous | 64K pieces |")
    print("|---|---|---|---|")
    size = 1 * MIB
    while size <= n:
        reps = max(5, min(200, (256 * MIB) // size))
        ref = reference(size, max(20, reps))
        contig = host_time(lambda: e.transfer_sync_write(seg, base, remote, size) == 0 or sys.exit("write failed"), reps)
        k = size // (64 << 10)
        offs = [2 * i * (64 << 10) for i in range(k)]
        locs = [base + o for o in offs]
        rems = [remote + o for o in offs]
        lens = [64 << 10] * k
        pieces = host_time(lambda: e.batch_transfer_sync_write(seg, locs, rems, lens) == 0 or sys.exit("batch write failed"), reps)
        label = f"{size // MIB} MiB"
        print(f"| {label} | {size / ref / 1e9:.1f} | {ref / contig:.3f} | {ref / pieces:.3f} |")
        size *= 4
    # Bytes: the last batch's pieces, summed on both sides.
    size = n // 4 if n >= 4 * MIB else n
    bad = 0
    for o in [2 * i * (64 << 10) for i in range(0, size // (64 << 10), max(1, size // (64 << 10) // 16))]:
        parent.send((o, 64 << 10))
        if parent.recv() != int(src[o:o + (64 << 10)].to(torch.int64).sum()):
            bad += 1
    print(f"bytes: {bad} of the sampled 64 KiB pieces differ")
    parent.send(None)
    p.join(10)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
