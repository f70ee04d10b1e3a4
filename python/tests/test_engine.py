"""kvferry.TransferEngine behaviour that the Mooncake conformance table does not cover: calls
before initialize, initialize's arguments, locations, unknown ids, a silent peer, logging, the
docstrings. Runs without Mooncake, libibverbs or a GPU."""

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import kvferry
from kvferry import TransferEngine

PUBLIC = [m for m in dir(TransferEngine) if not m.startswith("_")]


def engine():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return e


def seg(e):
    return f"127.0.0.1:{e.get_rpc_port()}"


def test_every_public_method_has_a_docstring_naming_its_return():
    assert TransferEngine.__doc__ and "Mooncake" in TransferEngine.__doc__
    for m in PUBLIC:
        doc = getattr(TransferEngine, m).__doc__
        assert doc and len(doc) > 40, m


def test_calls_before_initialize_return_failure_codes_and_do_not_raise():
    e = TransferEngine()
    assert e.get_rpc_port() == -1
    assert e.register_memory(4096, 4096) == -1
    assert e.unregister_memory(4096) == -1
    assert e.batch_register_memory([4096], [4096]) == -1
    assert e.batch_unregister_memory([4096]) == -1
    assert e.transfer_sync_write("127.0.0.1:1", 1, 2, 3) == -1
    assert e.transfer_sync_read("127.0.0.1:1", 1, 2, 3) == -1
    assert e.batch_transfer_sync_write("127.0.0.1:1", [1], [2], [3]) == -1
    assert e.batch_transfer_sync_read("127.0.0.1:1", [1], [2], [3]) == -1
    assert e.batch_transfer_async_write("127.0.0.1:1", [1], [2], [3]) == 0
    assert e.batch_transfer_async_read("127.0.0.1:1", [1], [2], [3]) == 0
    assert e.get_batch_transfer_status([1]) == -1
    assert e.transfer_submit_write("127.0.0.1:1", 1, 2, 3) == 0
    assert e.transfer_check_status(1) == -1
    assert e.send_probe("127.0.0.1:1") == -1
    assert "not initialized" in repr(e)


def test_initialize_arguments():
    assert TransferEngine().initialize("127.0.0.1", "etcd://127.0.0.1:2379", "tcp", "") == -1
    assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "carrier-pigeon", "") == -1
    assert TransferEngine().initialize("", "P2PHANDSHAKE", "tcp", "") == -1
    assert TransferEngine().initialize("127.0.0.1:notaport", "P2PHANDSHAKE", "tcp", "") == -1
    # "rdma" without a usable device falls back to TCP, as Mooncake does
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "no_such_dev0") == 0
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1  # already initialized
    # an explicit port is used as the handshake port
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    e2 = TransferEngine()
    assert e2.initialize(f"127.0.0.1:{port}", "P2PHANDSHAKE", "tcp", "") == 0
    assert e2.get_rpc_port() == port
    assert TransferEngine().initialize(f"127.0.0.1:{port}", "P2PHANDSHAKE", "tcp", "") == -1
    e3 = TransferEngine()
    if e3.initialize("[::1]", "P2PHANDSHAKE", "tcp", "") == 0:  # hosts without IPv6 skip this
        assert e3.get_rpc_port() > 0


def free_run(n):
    """The first port of `n` consecutive free ports on 127.0.0.1."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            lo = s.getsockname()[1]
        if lo + n > 65535:
            continue
        try:
            for p in range(lo, lo + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return lo
        except OSError:
            continue


def bindable(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_engine_ports_env_puts_the_handshake_and_data_ports_in_the_range(monkeypatch):
    lo = free_run(2)
    monkeypatch.setenv("KVFERRY_ENGINE_PORTS", f"{lo}-{lo + 1}")
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert lo <= e.get_rpc_port() <= lo + 1
    # Both ports of the range are held: the handshake listener's and the TCP data listener's.
    assert not bindable(lo) and not bindable(lo + 1)
    # A second engine finds no free port in the range; a malformed range is refused.
    assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1
    monkeypatch.setenv("KVFERRY_ENGINE_PORTS", "9-1")
    assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1
    # Transfers still work between an engine in a range and one on ephemeral ports.
    monkeypatch.delenv("KVFERRY_ENGINE_PORTS")
    other = engine()
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    assert other.register_memory(src.ctypes.data, 4096) == 0
    assert e.register_memory(dst.ctypes.data, 4096) == 0
    assert other.transfer_sync_write(seg(e), src.ctypes.data, dst.ctypes.data, 4096) == 0
    assert (dst == src).all()


def test_locations():
    e = engine()
    buf = np.zeros(1 << 16, dtype=np.uint8)
    a = buf.ctypes.data
    for loc in ["*", "cpu", "cpu:0", "cpu:1"]:
        assert e.register_memory(a, 4096, loc) == 0, loc
        assert e.unregister_memory(a) == 0
    assert e.register_memory(a, 4096, "gpu") == -1
    assert e.register_memory(a, 4096, "cuda:x") == -1
    # host memory claimed to be GPU memory: refused (no CUDA here, or not device memory)
    assert e.register_memory(a, 4096, "cuda:0") == -1
    assert e.batch_register_memory([a, a + 8192], [4096], "*") == -1  # lengths differ


def test_unknown_ids():
    e = engine()
    assert e.transfer_check_status(424242) == -1
    assert e.get_batch_transfer_status([424242]) == -1
    assert e.get_batch_transfer_status([]) == 0


def test_send_probe_bad_name():
    e = engine()
    assert e.send_probe("no-port-here") == -101
    assert e.transfer_sync_write("no-port-here", 1, 2, 3) == -1


def test_send_probe_unresolvable_host_is_err_dns():
    # Mooncake's probe answers ERR_DNS when getaddrinfo fails (".invalid" never resolves);
    # a transfer to it is the generic -1, as Mooncake's transfer_sync
    e = engine()
    assert e.send_probe("kvferry-no-such-host.invalid:12345") == -101
    assert e.transfer_sync_write("kvferry-no-such-host.invalid:12345", 1, 2, 3) == -1


def test_send_probe_sees_memory_registered_after_first_contact():
    a, b = engine(), engine()
    src = np.arange(8192, dtype=np.uint8)
    d1, d2 = np.zeros(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    assert a.register_memory(src.ctypes.data, src.nbytes) == 0
    assert b.register_memory(d1.ctypes.data, d1.nbytes) == 0
    assert a.send_probe(seg(b)) == 0
    assert b.register_memory(d2.ctypes.data, d2.nbytes) == 0
    assert a.send_probe(seg(b)) == 0
    assert a.transfer_sync_write(seg(b), src.ctypes.data + 4096, d2.ctypes.data, 4096) == 0
    assert (d2 == src[4096:]).all()


def test_silent_peer_fails_within_the_handshake_deadline():
    """A peer that accepts the connection and never answers: kvferry gives up after its 5 s
    handshake deadline. (Mooncake 0.3.13 waits about 60 s for send_probe and longer for a
    transfer here, measured; not run, it would cost minutes.)"""
    e = engine()
    buf = np.zeros(4096, dtype=np.uint8)
    assert e.register_memory(buf.ctypes.data, 4096) == 0
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    target = f"127.0.0.1:{s.getsockname()[1]}"
    try:
        t0 = time.monotonic()
        assert e.send_probe(target) == -102
        assert e.transfer_sync_write(target, buf.ctypes.data, 0, 10) == -1
        assert time.monotonic() - t0 < 30  # two 5 s handshake deadlines, with room
    finally:
        s.close()


def test_failure_reasons_reach_python_logging(caplog):
    e = engine()
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        assert e.unregister_memory(0x1000) == -3
        assert TransferEngine().initialize("127.0.0.1", "etcd://x:1", "tcp", "") == -1
    msgs = [(r.name, r.getMessage()) for r in caplog.records]
    assert any(n == "kvferry.python.engine" and "no memory region registered at 0x1000" in m
               for n, m in msgs), msgs
    assert any("P2PHANDSHAKE" in m for _, m in msgs), msgs


def test_engine_thread_logs_reach_logging_while_python_threads_transfer():
    """Debug lines logged by the engine's own threads (handshake listener) reach Python's
    logging, while 8 Python threads run transfers: nothing deadlocks (every blocking call
    releases the GIL, so an engine thread can always take it to log). Runs in a subprocess
    because the forwarded level is fixed at import (KVFERRY_LOG)."""
    code = textwrap.dedent("""
        import logging, socket, threading, numpy as np, kvferry
        got = []
        class H(logging.Handler):
            def emit(self, r): got.append((r.name, threading.current_thread().name, r.getMessage()))
        logging.getLogger("kvferry").addHandler(H()); logging.getLogger("kvferry").setLevel(1)
        a, b = kvferry.TransferEngine(), kvferry.TransferEngine()
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        src = np.ones(1 << 22, np.uint8); dst = np.zeros(1 << 22, np.uint8)
        assert a.register_memory(src.ctypes.data, src.nbytes) == 0
        assert b.register_memory(dst.ctypes.data, dst.nbytes) == 0
        t = f"127.0.0.1:{b.get_rpc_port()}"
        codes = []
        def work(i):
            for _ in range(20):
                codes.append(a.batch_transfer_sync_write(t, [src.ctypes.data + i * 65536],
                             [dst.ctypes.data + i * 65536], [65536]))
                s = socket.create_connection(("127.0.0.1", b.get_rpc_port()))
                s.sendall(b"garbage that is not a handshake frame" * 4); s.close()
        ths = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        [x.start() for x in ths]; [x.join(60) for x in ths]
        assert not any(x.is_alive() for x in ths), "deadlock"
        assert codes == [0] * 160, codes
        import time; time.sleep(0.5)
        from_engine = [g for g in got if g[0].startswith("kvferry.transfer")
                       and not g[1].startswith("Thread-") and g[1] != "MainThread"]
        assert from_engine, got[:5]
        print("OK", len(got), len(from_engine))
    """)
    env = dict(os.environ, KVFERRY_LOG="debug")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]


def test_module_imports_without_libibverbs_or_libcuda_dependencies():
    """The extension loads verbs and the CUDA driver with dlopen, if at all: `ldd` of the
    built module lists neither."""
    so = kvferry._kvferry.__file__
    p = subprocess.run(["ldd", so], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"ldd unavailable: {p.stderr}")
    for lib in ["libibverbs", "libcuda", "libcudart", "librdmacm", "libmlx5"]:
        assert lib not in p.stdout, p.stdout


def test_batch_register_is_all_or_nothing():
    e = engine()
    bufs = [np.zeros(8192, dtype=np.uint8) for _ in range(3)]
    a = [b.ctypes.data for b in bufs]
    assert e.register_memory(a[2], 8192) == 0
    # the third overlaps the region registered above: -7, and the first two are rolled back
    assert e.batch_register_memory([a[0], a[1], a[2] + 16], [8192, 8192, 64]) == -7
    assert e.unregister_memory(a[0]) == -3
    assert e.batch_register_memory(a[:2], [8192, 8192]) == 0
    assert e.batch_unregister_memory(a) == 0


def test_register_memory_refuses_ranges_the_process_has_not_mapped():
    e = engine()
    # Address 1 for 2**63 bytes: returned 0, and a peer then read whatever it pointed at.
    assert e.register_memory(1, 2**63) == -1
    assert e.register_memory(1, 2**63, "cpu") == -1
    buf = np.zeros(8192, dtype=np.uint8)
    assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
    assert e.unregister_memory(buf.ctypes.data) == 0


# A target engine in a process of its own (so that it can be stopped): registers LEN bytes
# of 7s and prints its handshake port and their address.
TARGET = """
import sys
import numpy as np
from kvferry import TransferEngine
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = np.full(%d, 7, dtype=np.uint8)
assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
print(e.get_rpc_port(), buf.ctypes.data, flush=True)
sys.stdin.read()
"""


def test_unregister_memory_returns_4_while_a_transfer_uses_the_region():
    """-4 (Mooncake's ERR_BATCH_BUSY) while a READ into the region is outstanding (its target
    is stopped with SIGSTOP), after unregister_memory's 5 s wait: the region stays registered,
    and the READ completes into it once the target runs again; then it unregisters."""
    n = 8 << 20
    child = subprocess.Popen([sys.executable, "-c", TARGET % n], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        port, remote = map(int, child.stdout.readline().split())
        target = f"127.0.0.1:{port}"
        e = engine()
        buf = np.zeros(n, dtype=np.uint8)
        assert e.register_memory(buf.ctypes.data, n) == 0
        # the target's descriptor is fetched while it runs
        assert e.transfer_sync_read(target, buf.ctypes.data, remote, 4096) == 0
        os.kill(child.pid, signal.SIGSTOP)
        try:
            bid = e.batch_transfer_async_read(target, [buf.ctypes.data], [remote], [n])
            assert bid != 0
            assert e.unregister_memory(buf.ctypes.data) == -4
        finally:
            os.kill(child.pid, signal.SIGCONT)
        assert e.get_batch_transfer_status([bid]) == 0
        assert (buf == 7).all()
        assert e.unregister_memory(buf.ctypes.data) == 0
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
