"""One script, two implementations: runs every call of Mooncake's Python TransferEngine API
against either `mooncake.engine.TransferEngine` or `kvferry.TransferEngine` and prints one JSON
object `{case: outcome}` as its last line of stdout.

    python conformance_script.py mooncake|kvferry

`test_conformance.py` runs it once per implementation (Mooncake from a throwaway venv with
`mooncake-transfer-engine-non-cuda`) and asserts the outcomes are equal, case by case. Two
engines live in this process and talk over TCP on 127.0.0.1 (initiator A, target B). Every
transfer that should move bytes is followed by a byte check; the outcome records the return
code(s) and the check, never a timing (except "failed within N seconds" for an unreachable
peer, which is the behaviour under test).

Cases: 1 MiB sync write and read; 64 scattered 4 KiB writes in one batch (and a
scattered read); async batch + status; submit + check status; 8 threads at once; the GIL (a
Python thread keeps counting while another runs a long transfer); errors: unreachable session,
remote range outside registered memory, lists of different lengths, a write into memory
unregistered after registration, overlapping/zero/unknown registrations, a local buffer that
was never registered.
"""

import json
import socket
import sys
import threading
import time

import numpy as np

MiB = 1 << 20
FAST_S = 5.0  # "fails within seconds": both fail in milliseconds on a refused port


def load(impl):
    if impl == "mooncake":
        from mooncake.engine import TransferEngine
    elif impl == "kvferry":
        from kvferry import TransferEngine
    else:
        raise SystemExit(f"unknown implementation {impl!r}: mooncake or kvferry")
    return TransferEngine


def addr(a, off=0):
    return a.ctypes.data + off


def dead_port():
    """A 127.0.0.1 port with no listener (bound once, then closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def poll(engine, batch_id, limit_s=30.0):
    """transfer_check_status until it leaves 0 (bounded)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        c = engine.transfer_check_status(batch_id)
        if c != 0:
            return c
        time.sleep(0.002)
    return "still pending"


METHODS = ["initialize", "get_rpc_port", "register_memory", "unregister_memory",
           "batch_register_memory", "batch_unregister_memory", "transfer_sync_write",
           "transfer_sync_read", "batch_transfer_sync_write", "batch_transfer_sync_read",
           "batch_transfer_async_write", "batch_transfer_async_read",
           "get_batch_transfer_status", "transfer_submit_write", "transfer_check_status",
           "send_probe"]


def signatures(TransferEngine, impl):
    """{method: [[name, default or None], ...]} without self. Mooncake's come from pybind11's
    docstring (`name: type = default`; unnamed parameters are `argN`, written "_"); kvferry's
    from `inspect.signature`."""
    sigs = {}
    for m in METHODS:
        f = getattr(TransferEngine, m)
        if impl == "mooncake":
            head = f.__doc__.strip().splitlines()[0]
            inner = head[head.index("(") + 1:head.rindex(")")]
            params = []
            for p in inner.split(", ")[1:]:
                name, _, rest = p.partition(":")
                default = rest.split(" = ", 1)[1] if " = " in rest else None
                if default is not None:
                    default = repr(eval(default))  # '*' and '' are Python literals
                params.append(["_" if name.startswith("arg") else name, default])
        else:
            import inspect
            params = [[p.name, None if p.default is inspect.Parameter.empty else repr(p.default)]
                      for p in list(inspect.signature(f).parameters.values())[1:]]
        sigs[m] = params
    return sigs


def run(impl):
    TransferEngine = load(impl)
    rng = np.random.default_rng(9)
    out = {"signatures": signatures(TransferEngine, impl)}

    a, b = TransferEngine(), TransferEngine()
    out["initialize"] = [a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""),
                         b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")]
    out["initialize_non_p2p_metadata"] = TransferEngine().initialize(
        "127.0.0.1", "http://127.0.0.1:1/metadata", "tcp", "")
    port = b.get_rpc_port()
    out["rpc_port_is_port"] = isinstance(port, int) and 0 < port < 65536
    sb = f"127.0.0.1:{port}"

    size = 8 * MiB
    src = np.zeros(size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    out["register"] = [a.register_memory(addr(src), size), b.register_memory(addr(dst), size)]
    out["register_overlap"] = a.register_memory(addr(src, 4096), 4096)
    out["register_zero_length"] = a.register_memory(addr(dst), 0)
    out["unregister_unknown"] = a.unregister_memory(addr(dst, 12345))
    out["batch_unregister_unknown"] = a.batch_unregister_memory([addr(dst, 12345)])
    out["send_probe"] = a.send_probe(sb)

    # 1 MiB sync write and read
    src[:MiB] = rng.integers(0, 256, MiB, dtype=np.uint8)
    rc = a.transfer_sync_write(sb, addr(src), addr(dst), MiB)
    out["sync_write_1MiB"] = [rc, bool((dst[:MiB] == src[:MiB]).all())]
    dst[MiB:2 * MiB] = rng.integers(0, 256, MiB, dtype=np.uint8)
    rc = a.transfer_sync_read(sb, addr(src, MiB), addr(dst, MiB), MiB)
    out["sync_read_1MiB"] = [rc, bool((src[MiB:2 * MiB] == dst[MiB:2 * MiB]).all())]
    out["sync_write_zero_length"] = a.transfer_sync_write(sb, addr(src), addr(dst), 0)
    out["batch_write_empty"] = a.batch_transfer_sync_write(sb, [], [], [])
    src[:8192] = rng.integers(0, 256, 8192, dtype=np.uint8)
    rc = a.batch_transfer_sync_write(sb, [addr(src), addr(src, 4096)], [addr(dst), addr(dst, 4096)],
                                     [4096, 0])
    out["batch_write_with_a_zero_length_entry"] = [rc, bool((dst[:4096] == src[:4096]).all())]

    # 64 scattered 4 KiB writes in one batch; then 64 scattered reads
    blk, n = 4096, 64
    base = 2 * MiB
    src[base:base + n * blk] = rng.integers(0, 256, n * blk, dtype=np.uint8)
    perm = rng.permutation(n)
    rc = a.batch_transfer_sync_write(
        sb, [addr(src, base + i * blk) for i in range(n)],
        [addr(dst, base + int(perm[i]) * blk) for i in range(n)], [blk] * n)
    ok = all((dst[base + int(perm[i]) * blk:][:blk] == src[base + i * blk:][:blk]).all()
             for i in range(n))
    out["batch_write_64x4KiB_scattered"] = [rc, bool(ok)]
    dst[base:base + n * blk] = rng.integers(0, 256, n * blk, dtype=np.uint8)
    rc = a.batch_transfer_sync_read(
        sb, [addr(src, base + i * blk) for i in range(n)],
        [addr(dst, base + int(perm[i]) * blk) for i in range(n)], [blk] * n)
    ok = all((src[base + i * blk:][:blk] == dst[base + int(perm[i]) * blk:][:blk]).all()
             for i in range(n))
    out["batch_read_64x4KiB_scattered"] = [rc, bool(ok)]

    # async batch + status (write, then read)
    off = 3 * MiB
    src[off:off + 16 * blk] = rng.integers(0, 256, 16 * blk, dtype=np.uint8)
    bid = a.batch_transfer_async_write(sb, [addr(src, off + i * blk) for i in range(16)],
                                       [addr(dst, off + i * blk) for i in range(16)], [blk] * 16)
    st = a.get_batch_transfer_status([bid]) if bid else None
    out["async_write_batch"] = [bid != 0, st,
                                bool((dst[off:off + 16 * blk] == src[off:off + 16 * blk]).all())]
    dst[off:off + 16 * blk] = rng.integers(0, 256, 16 * blk, dtype=np.uint8)
    bid = a.batch_transfer_async_read(sb, [addr(src, off + i * blk) for i in range(16)],
                                      [addr(dst, off + i * blk) for i in range(16)], [blk] * 16)
    bid2 = a.batch_transfer_async_write(sb, [addr(src, 4 * MiB)], [addr(dst, 4 * MiB)], [blk])
    st = a.get_batch_transfer_status([bid, bid2]) if bid and bid2 else None
    out["async_read_and_write_two_batches"] = [bid != 0, bid2 != 0, st, bool(
        (src[off:off + 16 * blk] == dst[off:off + 16 * blk]).all())]

    # submit + check status
    src[5 * MiB:5 * MiB + 65536] = rng.integers(0, 256, 65536, dtype=np.uint8)
    sid = a.transfer_submit_write(sb, addr(src, 5 * MiB), addr(dst, 5 * MiB), 65536)
    c = poll(a, sid) if sid else None
    out["submit_and_check"] = [sid != 0, c, bool(
        (dst[5 * MiB:5 * MiB + 65536] == src[5 * MiB:5 * MiB + 65536]).all())]

    # 8 threads at once, each on its own 256 KiB of both buffers, 20 scattered batches each
    def worker(t, results):
        trng = np.random.default_rng(100 + t)
        lo = 6 * MiB + t * 256 * 1024
        k, bs = 16, 16 * 1024
        codes, good = [], True
        for _ in range(20):
            src[lo:lo + k * bs] = trng.integers(0, 256, k * bs, dtype=np.uint8)
            p = trng.permutation(k)
            codes.append(a.batch_transfer_sync_write(
                sb, [addr(src, lo + i * bs) for i in range(k)],
                [addr(dst, lo + int(p[i]) * bs) for i in range(k)], [bs] * k))
            good &= all((dst[lo + int(p[i]) * bs:][:bs] == src[lo + i * bs:][:bs]).all()
                        for i in range(k))
        results[t] = [sorted(set(codes)), bool(good)]

    results = [None] * 8
    threads = [threading.Thread(target=worker, args=(t, results)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    out["threads_8"] = results

    # errors: unreachable session (nothing listens on the port)
    dead = f"127.0.0.1:{dead_port()}"
    t0 = time.monotonic()
    codes = [a.transfer_sync_write(dead, addr(src), addr(dst), 4096),
             a.batch_transfer_sync_write(dead, [addr(src)], [addr(dst)], [4096]),
             a.batch_transfer_async_write(dead, [addr(src)], [addr(dst)], [4096]),
             a.transfer_submit_write(dead, addr(src), addr(dst), 4096),
             a.send_probe(dead)]
    out["unreachable_session"] = [codes, time.monotonic() - t0 < FAST_S]

    # errors: remote range outside registered memory (ends 4 KiB past the end of dst)
    far = addr(dst, size - 100)
    bid = a.batch_transfer_async_write(sb, [addr(src)], [far], [4096])
    st = a.get_batch_transfer_status([bid]) if bid else None
    sid = a.transfer_submit_write(sb, addr(src), far, 4096)
    c = poll(a, sid) if sid else None
    out["remote_out_of_range"] = [
        a.transfer_sync_write(sb, addr(src), far, 4096),
        a.transfer_sync_read(sb, addr(src), far, 4096),
        a.batch_transfer_sync_write(sb, [addr(src), addr(src)], [addr(dst), far], [4096, 4096]),
        # async: failure reported by the id (0) or by the status (-1)
        "fail" if bid == 0 or st == -1 else "ok",
        "fail" if sid == 0 or c == -1 else "ok",
    ]

    # errors: lists of different lengths
    out["lists_of_different_lengths"] = [
        a.batch_transfer_sync_write(sb, [addr(src)], [addr(dst), addr(dst)], [4096]),
        a.batch_transfer_sync_read(sb, [addr(src), addr(src)], [addr(dst)], [4096]),
        a.batch_transfer_async_write(sb, [addr(src)], [addr(dst)], [4096, 4096]),
    ]

    # errors: a write into memory the target unregistered after registering it
    extra = np.zeros(MiB, dtype=np.uint8)
    r1 = b.register_memory(addr(extra), MiB)
    w1 = a.transfer_sync_write(sb, addr(src), addr(extra), 4096)
    written = bool((extra[:4096] == src[:4096]).all())
    extra[:] = 7
    u = b.unregister_memory(addr(extra))
    w2 = a.transfer_sync_write(sb, addr(src), addr(extra), 4096)
    r2 = a.transfer_sync_read(sb, addr(src, 7 * MiB), addr(extra), 4096)
    out["write_after_unregister"] = [r1, w1, written, u, w2, r2, bool((extra == 7).all())]

    # a local buffer that was never registered with the initiator
    loose = np.full(4096, 3, dtype=np.uint8)
    dst[:4096] = 0
    rc = a.transfer_sync_write(sb, addr(loose), addr(dst), 4096)
    out["local_buffer_not_registered"] = [rc, bool((dst[:4096] == 3).all())]

    # batch registration round trip
    regs = [np.zeros(8192, dtype=np.uint8) for _ in range(4)]
    out["batch_register_round_trip"] = [
        a.batch_register_memory([addr(r) for r in regs], [8192] * 4),
        a.batch_register_memory([addr(regs[0], 100)], [100]),  # overlaps regs[0]
        a.batch_unregister_memory([addr(r) for r in regs]),
        a.batch_unregister_memory([addr(r) for r in regs]),
    ]
    out["unregister"] = [a.unregister_memory(addr(src)), b.unregister_memory(addr(dst))]
    out["gil_released_during_transfer"] = gil_case(a, b)
    return out


def gil_case(a, b):
    """A Python thread counts (and stamps the time every 1000 counts) while this thread runs one
    long batch_transfer_sync_write. If the call held the GIL, no stamp could fall strictly
    inside the call (away from its edges, where a GIL switch may happen before the call enters
    C/Rust). Returns [rc, call long enough to judge, stamps inside the call > 0]."""
    size = 256 * MiB
    src = np.ones(size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    a.register_memory(addr(src), size)
    b.register_memory(addr(dst), size)
    sb = f"127.0.0.1:{b.get_rpc_port()}"
    stamps, stop = [], threading.Event()

    def count():
        i = 0
        while not stop.is_set():
            i += 1
            if i % 1000 == 0:
                stamps.append(time.perf_counter())

    th = threading.Thread(target=count)
    th.start()
    time.sleep(0.05)
    chunk = 4 * MiB
    n = size // chunk
    t0 = time.perf_counter()
    rc = a.batch_transfer_sync_write(sb, [addr(src, i * chunk) for i in range(n)],
                                     [addr(dst, i * chunk) for i in range(n)], [chunk] * n)
    t1 = time.perf_counter()
    stop.set()
    th.join()
    edge = max(0.01, 0.1 * (t1 - t0))
    inside = sum(1 for s in stamps if t0 + edge < s < t1 - edge)
    ok = bool(dst[::4096].all())
    a.unregister_memory(addr(src))
    b.unregister_memory(addr(dst))
    return [rc, ok, (t1 - t0) > 4 * edge, inside > 0]


if __name__ == "__main__":
    result = run(sys.argv[1] if len(sys.argv) > 1 else "kvferry")
    sys.stdout.flush()
    print(json.dumps(result, sort_keys=True))
