#!/usr/bin/env python3
"""kvferry beside Mooncake's Transfer Engine on the same work: loopback TCP WRITEs.

For every (request size, batch) point, one submitting thread writes a batch of `batch`
requests of `size` bytes each from one registered buffer into another engine's registered
buffer, waits for the batch, and repeats for `--seconds`. Throughput = bytes landed / wall time
(10^9 bytes per GB), the same definition `kvferry bench` uses. The two engines run
alternately (Mooncake, kvferry, Mooncake, kvferry, ...), `--repeats` times each; the table
shows medians and the ratio kvferry / Mooncake.

Mooncake side: the PyPI wheel `mooncake-transfer-engine-non-cuda`, two `TransferEngine`s in one
child process, P2P handshake, protocol "tcp", `batch_transfer_sync_write`. After the timed
loop the target buffer is compared byte for byte with the source.
kvferry side: `kvferry bench --transport tcp --threads 1 --json` (a child process as well).

Python-API mode (`--python-api`): the same Python loop (`batch_transfer_sync_write` from one
thread, or from 8 threads as vLLM's transfer pool does, each thread on its own slice of the
buffers) timed with Mooncake's `TransferEngine` and with `kvferry.TransferEngine` (the package
from `pip install ./python`; `--kvferry-python` names an interpreter that imports it), plus
`kvferry bench --threads T` (Rust) on the same points (`--points 64Kx128,1Mx16`,
`--threads 1,8`), alternating with a rotating order. It reports kvferry-Python / Mooncake and
kvferry-Python / kvferry-Rust.

Mooncake is installed into a venv (env MOONCAKE_VENV, default <repo>/.dev/mc-venv) when this
interpreter cannot import it; when PyPI cannot be reached the script says so and exits 0.

Source: docs/design.md §9 (Mooncake's API and benchmarks), §6.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VENV = REPO / ".dev" / "mc-venv"
PACKAGE = "mooncake-transfer-engine-non-cuda"


def parse_sizes(text):
    """'64K,1M' -> [65536, 1048576]; K/M/G suffixes are powers of 1024 (as kvferry's)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        mul = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(part[-1].upper(), 1)
        num = part[:-1] if mul > 1 else part
        if not num.isdigit() or int(num) == 0:
            raise SystemExit(f"{part!r}: not a size (a positive number with an optional K, M or G)")
        out.append(int(num) * mul)
    if not out:
        raise SystemExit(f"{text!r}: an empty list")
    return out


def human(n):
    for unit, mul in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mul and n % mul == 0:
            return f"{n // mul}{unit}"
    return str(n)


# ------------------------------------------------------------------ Mooncake installation


def mooncake_importable(python):
    r = subprocess.run([python, "-c", "import mooncake.engine, numpy"], capture_output=True)
    return r.returncode == 0


def ensure_mooncake():
    """Returns a python executable that can import mooncake.engine and numpy, or None with the
    reason printed (PyPI unreachable, install failed)."""
    if mooncake_importable(sys.executable):
        return sys.executable
    venv = Path(os.environ.get("MOONCAKE_VENV", DEFAULT_VENV))
    py = venv / "bin" / "python"
    if py.exists() and mooncake_importable(str(py)):
        return str(py)
    print(f"mooncake: not importable; installing {PACKAGE} into {venv}", file=sys.stderr)
    if not py.exists():
        r = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"SKIP mooncake: cannot create venv {venv}: {r.stderr.strip()}", file=sys.stderr)
            return None
    r = subprocess.run(
        [str(py), "-m", "pip", "install", "--quiet", "--timeout", "20", "--retries", "1", PACKAGE, "numpy"],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0 or not mooncake_importable(str(py)):
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        print(f"SKIP mooncake: pip install {PACKAGE} failed (PyPI unreachable?): {' | '.join(tail)}", file=sys.stderr)
        return None
    return str(py)


# ------------------------------------------------------------------ Mooncake point (child process)


def mooncake_point(size, batch, seconds, protocol="tcp", host="127.0.0.1", device="",
                   min_batches=1, max_batches=0):
    """Runs in the venv python. Returns the point as a dict (same fields as kvferry's).
    Batches: at least `min_batches`, at most `max_batches` (0: no bound), none started after
    `seconds` once the minimum is done (as `kvferry bench --min-batches/--max-batches`)."""
    return next(mooncake_points([(size, batch)], seconds, protocol, host, device, min_batches,
                                max_batches))


def mooncake_points(points, seconds, protocol="tcp", host="127.0.0.1", device="",
                    min_batches=1, max_batches=0):
    """Yields one dict per (size, batch[, threads]) of `points`, measured in turn by one pair of
    engines with one registered buffer per side (as large as the largest point): the start-up,
    import and registration, which take most of a soft-RoCE guest's time, are paid once.
    `threads` (default 1) threads each loop `batch_transfer_sync_write` over their own `batch`
    requests (their own slice of both buffers), so up to `threads` batches are in flight (the
    binding releases the GIL while a batch runs); `min_batches`/`max_batches` count per thread."""
    import threading

    import numpy as np
    from mooncake.engine import TransferEngine

    src_e, dst_e = TransferEngine(), TransferEngine()
    for e in (src_e, dst_e):
        if e.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
            raise RuntimeError(f"mooncake: initialize({host!r}, P2PHANDSHAKE, {protocol!r}, {device!r}) failed")
    target = f"{host}:{dst_e.get_rpc_port()}"
    points = [(p[0], p[1], p[2] if len(p) > 2 else 1) for p in points]
    total = max(size * batch * threads for size, batch, threads in points)
    # same pattern as kvferry bench: (i * 31) ^ (i >> 12), as bytes. As bytes it repeats every
    # MiB, so one MiB is computed and copied (cheap in a soft-RoCE guest, which has 2 GiB and
    # emulates every instruction)
    i = np.arange(1 << 20, dtype=np.uint64)
    period = ((i * 31) ^ (i >> 12)).astype(np.uint8)
    del i
    src = np.empty(total, dtype=np.uint8)
    for off in range(0, total, len(period)):
        n = min(len(period), total - off)
        src[off:off + n] = period[:n]
    dst = np.zeros(total, dtype=np.uint8)
    sa, da = src.ctypes.data, dst.ctypes.data
    if src_e.register_memory(sa, total) != 0 or dst_e.register_memory(da, total) != 0:
        raise RuntimeError("mooncake: register_memory failed")
    for size, batch, threads in points:
        per = size * batch
        used = per * threads
        dst[:used] = 0
        # No warm-up batch: `kvferry bench` has none either.
        lat = [[] for _ in range(threads)]
        errors = []
        start = time.perf_counter()
        deadline = start + seconds

        def work(t):
            locals_ = [sa + t * per + k * size for k in range(batch)]
            remotes = [da + t * per + k * size for k in range(batch)]
            lens = [size] * batch
            mine = lat[t]
            while not errors:
                t0 = time.perf_counter()
                if max_batches and len(mine) >= max_batches:
                    break
                if t0 >= deadline and len(mine) >= min_batches:
                    break
                if src_e.batch_transfer_sync_write(target, locals_, remotes, lens) != 0:
                    errors.append("mooncake: a batch failed")
                    break
                mine.append(time.perf_counter() - t0)

        ths = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        elapsed = time.perf_counter() - start
        if errors:
            raise RuntimeError(errors[0])
        all_lat = sorted(x for l in lat for x in l)
        # every batch writes the same bytes: after the last one the target must equal the source
        if not all_lat or not np.array_equal(src[:used], dst[:used]):
            bad = int(np.flatnonzero(src[:used] != dst[:used])[0]) if all_lat else -1
            raise RuntimeError(f"mooncake: landed bytes differ from the source (first at offset {bad})")
        n = len(all_lat)
        yield {
            "block_size": size,
            "batch": batch,
            "threads": threads,
            "gb_per_s": n * per / elapsed / 1e9,
            "avg_latency_us": sum(all_lat) / n * 1e6,
            "p99_latency_us": all_lat[min(n - 1, max(0, -(-n * 99 // 100) - 1))] * 1e6,
            "batches": n,
        }
    src_e.unregister_memory(sa)
    dst_e.unregister_memory(da)


def run_mooncake(python, size, batch, seconds, timeout):
    cmd = [python, str(Path(__file__).resolve()), "--mooncake-point", str(size), str(batch), str(seconds)]
    env = dict(os.environ, GLOG_minloglevel="2")  # Mooncake logs every connection at INFO
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"mooncake point {human(size)}x{batch} failed (rc {r.returncode}): {r.stderr.strip()[-800:]}")
    return json.loads(lines[-1])


# ------------------------------------------------------------------ Python-API point (either engine)


def py_point(impl, size, batch, threads, seconds):
    """Runs in a child interpreter. The same Python loop for both engines: `threads` threads
    (vLLM's transfer pool), each calling `batch_transfer_sync_write(target, locals, remotes,
    lens)` with its own `batch` requests of `size` bytes (its own slice of both buffers,
    contiguous, as `kvferry bench`) until `seconds` pass. Throughput = bytes landed / wall
    time from the start of the threads to the end of the last one. Afterwards the target must
    equal the source byte for byte."""
    import threading

    import numpy as np

    if impl == "mooncake":
        from mooncake.engine import TransferEngine
    else:
        from kvferry import TransferEngine
    src_e, dst_e = TransferEngine(), TransferEngine()
    for e in (src_e, dst_e):
        if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"{impl}: initialize failed")
    target = f"127.0.0.1:{dst_e.get_rpc_port()}"
    per = size * batch
    total = per * threads
    i = np.arange(total, dtype=np.uint64)
    src = ((i * 31) ^ (i >> 12)).astype(np.uint8)
    del i
    dst = np.zeros(total, dtype=np.uint8)
    sa, da = src.ctypes.data, dst.ctypes.data
    if src_e.register_memory(sa, total) != 0 or dst_e.register_memory(da, total) != 0:
        raise RuntimeError(f"{impl}: register_memory failed")
    stop = threading.Event()
    lat = [[] for _ in range(threads)]
    errors = []

    def work(t):
        locals_ = [sa + t * per + k * size for k in range(batch)]
        remotes = [da + t * per + k * size for k in range(batch)]
        lens = [size] * batch
        mine = lat[t]
        while not stop.is_set():
            t0 = time.perf_counter()
            if src_e.batch_transfer_sync_write(target, locals_, remotes, lens) != 0:
                errors.append(f"{impl}: a batch failed")
                return
            mine.append(time.perf_counter() - t0)

    ths = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    start = time.perf_counter()
    for th in ths:
        th.start()
    time.sleep(seconds)
    stop.set()
    for th in ths:
        th.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise RuntimeError(errors[0])
    if not np.array_equal(src, dst):
        raise RuntimeError(f"{impl}: landed bytes differ from the source "
                           f"(first at offset {int(np.flatnonzero(src != dst)[0])})")
    src_e.unregister_memory(sa)
    dst_e.unregister_memory(da)
    all_lat = sorted(x for l in lat for x in l)
    n = len(all_lat)
    if n == 0:
        raise RuntimeError(f"{impl}: no batch completed")
    return {"block_size": size, "batch": batch, "threads": threads,
            "gb_per_s": n * per / elapsed / 1e9, "avg_latency_us": sum(all_lat) / n * 1e6,
            "batches": n}


def run_py_point(python, impl, size, batch, threads, seconds, timeout):
    cmd = [python, str(Path(__file__).resolve()), "--py-point", impl, str(size), str(batch),
           str(threads), str(seconds)]
    env = dict(os.environ, GLOG_minloglevel="2")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{impl} python point {human(size)}x{batch}x{threads} failed "
                           f"(rc {r.returncode}): {r.stderr.strip()[-800:]}")
    return json.loads(lines[-1])


def kvferry_python(arg):
    """An interpreter that imports kvferry (the package from `pip install ./python`)."""
    for c in [arg, os.environ.get("KVFERRY_PYTHON"), sys.executable,
              str(REPO / ".dev" / "py-tests" / "bin" / "python")]:
        if c and Path(c).is_file() and subprocess.run(
                [c, "-c", "import kvferry, numpy"], capture_output=True).returncode == 0:
            return c
    raise SystemExit("no interpreter imports kvferry and numpy: `pip install ./python numpy`, "
                     "then pass --kvferry-python PATH or set KVFERRY_PYTHON")


def python_api_mode(a, binary, mc_python, kv_python):
    """Python-API mode: for each point and thread count, Mooncake's and kvferry's
    TransferEngine under the same Python loop, plus `kvferry bench` (Rust) with the same
    threads, alternating (the order rotates every repeat)."""
    points = []
    for p in a.points.split(","):
        sz, _, bt = p.strip().partition("x")
        points.append((parse_sizes(sz)[0], int(bt)))
    threads = [int(t) for t in a.threads.split(",")]
    timeout = a.seconds * 4 + 120
    rows = []
    for size, batch in points:
        for nt in threads:
            runs = {"mooncake": [], "kvferry_py": [], "kvferry_rust": []}
            kinds = list(runs)
            for rep in range(a.repeats):
                order = kinds[rep % 3:] + kinds[:rep % 3]
                for who in order:
                    if who == "mooncake":
                        runs[who].append(run_py_point(mc_python, "mooncake", size, batch, nt, a.seconds, timeout))
                    elif who == "kvferry_py":
                        runs[who].append(run_py_point(kv_python, "kvferry", size, batch, nt, a.seconds, timeout))
                    else:
                        runs[who].append(run_kvferry(binary, size, batch, a.seconds, timeout, nt))
                print(f"  {human(size):>5} x {batch:<4} threads {nt} rep {rep + 1}: "
                      + "  ".join(f"{k} {v[-1]['gb_per_s']:.3f}" for k, v in runs.items()),
                      file=sys.stderr, flush=True)
            med = {k: statistics.median(x["gb_per_s"] for x in v) for k, v in runs.items()}
            rows.append({
                "block_size": size, "batch": batch, "threads": nt,
                "mooncake_py_gb_per_s": med["mooncake"],
                "kvferry_py_gb_per_s": med["kvferry_py"],
                "kvferry_rust_gb_per_s": med["kvferry_rust"],
                "ratio_kvferry_py_over_mooncake_py": med["kvferry_py"] / med["mooncake"],
                "ratio_kvferry_py_over_kvferry_rust": med["kvferry_py"] / med["kvferry_rust"],
                "runs": runs,
            })
    print(f"{'size':>6} {'batch':>6} {'thr':>4} {'Mooncake-py':>12} {'kvferry-py':>11} "
          f"{'kvferry-rust':>13} {'py/Mooncake':>12} {'py/rust':>8}")
    for r in rows:
        print(f"{human(r['block_size']):>6} {r['batch']:>6} {r['threads']:>4} "
              f"{r['mooncake_py_gb_per_s']:>12.3f} {r['kvferry_py_gb_per_s']:>11.3f} "
              f"{r['kvferry_rust_gb_per_s']:>13.3f} {r['ratio_kvferry_py_over_mooncake_py']:>12.2f} "
              f"{r['ratio_kvferry_py_over_kvferry_rust']:>8.2f}")
    if a.out:
        meta = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "mode": "python-api",
                "seconds": a.seconds, "repeats": a.repeats, "statistic": "median",
                "cpus": os.cpu_count(), "machine": platform.platform(),
                "kvferry_binary": binary, "kvferry_python": kv_python, "mooncake_python": mc_python}
        Path(a.out).write_text(json.dumps({"meta": meta, "points": rows}, indent=2))
    return 0


# ------------------------------------------------------------------ Mooncake point via its C++ benchmark


def default_tebench(python):
    """The `transfer_engine_bench` binary shipped inside the wheel, next to engine.so."""
    if python is None:
        return None
    r = subprocess.run([python, "-c", "import mooncake, os; print(os.path.dirname(mooncake.__file__))"],
                       capture_output=True, text=True)
    p = Path(r.stdout.strip()) / "transfer_engine_bench"
    return str(p) if r.returncode == 0 and p.is_file() else None


def run_tebench(tebench, size, batch, seconds, timeout):
    """Mooncake's own C++ benchmark (no Python on the path): a target process and an initiator
    process, P2P handshake, TCP, WRITE, one submitting thread. The target is stopped afterwards."""
    import re
    import threading

    buf = size * batch
    common = ["--protocol=tcp", "--metadata_server=P2PHANDSHAKE", f"--buffer_size={buf}"]
    tgt = subprocess.Popen([tebench, "--mode=target", "--local_server_name=127.0.0.1:17990", *common],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port, deadline = None, time.monotonic() + 30
        while port is None and time.monotonic() < deadline:
            line = tgt.stderr.readline()
            if not line:
                break
            m = re.search(r"P2P handshake, listening on [^:\s]+:(\d+)", line)
            port = m and m.group(1)
        if port is None:
            raise RuntimeError(f"tebench target did not report its handshake port (rc {tgt.poll()})")
        threading.Thread(target=lambda: [None for _ in tgt.stderr], daemon=True).start()  # keep draining
        dur = max(1, round(seconds))  # the benchmark takes whole seconds
        r = subprocess.run([tebench, "--mode=initiator", "--local_server_name=127.0.0.1:17991",
                            f"--segment_id=127.0.0.1:{port}", "--operation=write", "--threads=1",
                            f"--batch_size={batch}", f"--block_size={size}", f"--duration={dur}", *common],
                           capture_output=True, text=True, timeout=timeout)
        m = re.search(r"duration ([0-9.]+), batch count (\d+), throughput", r.stderr)
        if r.returncode != 0 or not m:
            raise RuntimeError(f"tebench point {human(size)}x{batch} failed (rc {r.returncode}): {r.stderr.strip()[-800:]}")
        elapsed, n = float(m.group(1)), int(m.group(2))
        return {"block_size": size, "batch": batch, "gb_per_s": n * buf / elapsed / 1e9, "batches": n,
                "avg_latency_us": elapsed / max(n, 1) * 1e6, "p99_latency_us": None}
    finally:
        tgt.kill()
        tgt.wait()


# ------------------------------------------------------------------ kvferry point


def plot(points, out, title):
    """Throughput against request size, kvferry beside Mooncake, one line per engine and batch
    (solid kvferry, dashed Mooncake, one colour per batch), written to `out` (SVG or PNG by its
    suffix). Needs matplotlib: without it, says what to install and returns False."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install matplotlib", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    batches = sorted({p["batch"] for p in points})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, batch in enumerate(batches):
        ps = sorted((p for p in points if p["batch"] == batch), key=lambda p: p["block_size"])
        sizes = [p["block_size"] for p in ps]
        c = colours[i % len(colours)]
        ax.plot(sizes, [p["kvferry_gb_per_s"] for p in ps], "-o", color=c, label=f"kvferry, batch {batch}")
        ax.plot(sizes, [p["mooncake_gb_per_s"] for p in ps], "--s", color=c, label=f"Mooncake, batch {batch}")
    ax.set_xscale("log", base=2)
    ticks = sorted({p["block_size"] for p in points})
    ax.set_xticks(ticks, [human(t) for t in ticks])
    ax.set_xlabel("request size")
    ax.set_ylabel("throughput (GB/s, 10^9 bytes)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    print(f"plot: {out}", file=sys.stderr)
    return True


def find_kvferry(arg):
    cands = [arg] if arg else []
    cands += [os.environ.get("KVFERRY_BIN")]
    if os.environ.get("CARGO_TARGET_DIR"):
        cands.append(str(Path(os.environ["CARGO_TARGET_DIR"]) / "release" / "kvferry"))
    cands += [str(REPO / "target" / "release" / "kvferry"), shutil.which("kvferry")]
    for c in cands:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise SystemExit("kvferry binary not found: build it (`cargo build --release`) and pass --kvferry PATH "
                     "or set KVFERRY_BIN / CARGO_TARGET_DIR")


def run_kvferry(binary, size, batch, seconds, timeout, threads=1):
    cmd = [binary, "bench", "--transport", "tcp", "--block-sizes", str(size), "--batch", str(batch),
           "--threads", str(threads), "--seconds", str(seconds), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"kvferry point {human(size)}x{batch} failed (rc {r.returncode}): {r.stderr.strip()[-800:]}")
    rep = json.loads(lines[-1])
    if rep.get("transport") != "tcp" or len(rep.get("points", [])) != 1:
        raise RuntimeError(f"kvferry bench: unexpected report {rep}")
    return rep["points"][0]


# ------------------------------------------------------------------ driver


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64K,1M,16M", help="request sizes (K/M/G suffixes)")
    ap.add_argument("--batches", default="16,128", help="requests per batch")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds per measurement")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per engine and point")
    ap.add_argument("--max-buffer", default="512M",
                    help="skip points whose buffer (size x batch, per side) exceeds this")
    ap.add_argument("--kvferry", help="path of the kvferry binary")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--plot", help="write a plot of kvferry beside Mooncake here (.svg or .png; needs matplotlib)")
    ap.add_argument("--plot-from", metavar="JSON",
                    help="only plot the results a run saved with --out (to --plot, default beside it)")
    ap.add_argument("--mooncake-impl", choices=("python", "tebench"), default="python",
                    help="Mooncake through its Python API (as vLLM's connector uses it) or through "
                         "its C++ transfer_engine_bench (target + initiator processes)")
    ap.add_argument("--tebench", help="path of transfer_engine_bench (default: the wheel's)")
    ap.add_argument("--python-api", action="store_true",
                    help="Python-API mode: Mooncake's and kvferry's TransferEngine under the same "
                         "Python loop, and `kvferry bench`, at --points with --threads")
    ap.add_argument("--points", default="64Kx128,1Mx16", help="python-api mode: SIZExBATCH list")
    ap.add_argument("--threads", default="1,8", help="python-api mode: submitting threads")
    ap.add_argument("--kvferry-python", help="python-api mode: an interpreter that imports kvferry")
    ap.add_argument("--py-point", nargs=5, metavar=("IMPL", "SIZE", "BATCH", "THREADS", "SECONDS"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--print-python", action="store_true",
                    help="install Mooncake if needed, print the python that imports it, and exit "
                         "(exit 1 when it cannot be installed)")
    # One Mooncake point in this process (used by run_mooncake and the soft-RoCE suite).
    ap.add_argument("--mooncake-point", nargs=3, metavar=("SIZE", "BATCH", "SECONDS"),
                    help="run one Mooncake point here and print it as JSON")
    ap.add_argument("--mooncake-points", nargs=2, metavar=("SIZE:BATCH[:THREADS],...", "SECONDS"),
                    help="run several Mooncake points here with one pair of engines and print "
                         "each as a JSON line (THREADS batches in flight, default 1)")
    ap.add_argument("--protocol", default="tcp", help="--mooncake-point: tcp or rdma")
    ap.add_argument("--host", default="127.0.0.1", help="--mooncake-point: address of both engines")
    ap.add_argument("--device", default="", help="--mooncake-point: RDMA device names, e.g. rxe0")
    ap.add_argument("--min-batches", type=int, default=1, help="--mooncake-point: batches at least")
    ap.add_argument("--max-batches", type=int, default=0, help="--mooncake-point: batches at most (0: no bound)")
    a = ap.parse_args()

    if a.plot_from:
        saved = json.loads(Path(a.plot_from).read_text())
        out = a.plot or str(Path(a.plot_from).with_suffix(".svg"))
        title = f"loopback TCP WRITEs, {saved.get('meta', {}).get('cpus', '?')} CPUs (medians)"
        return 0 if plot(saved.get("points", []), out, title) else 2
    if a.py_point:
        impl, size, batch, nt, secs = a.py_point
        print(json.dumps(py_point(impl, int(size), int(batch), int(nt), float(secs))), flush=True)
        return 0

    if a.print_python:
        python = ensure_mooncake()
        if python is None:
            return 1
        print(python)
        return 0
    if a.mooncake_points:
        pts = [tuple(int(v) for v in p.split(":")) for p in a.mooncake_points[0].split(",") if p]
        for p in mooncake_points(pts, float(a.mooncake_points[1]), a.protocol, a.host, a.device,
                                 max(1, a.min_batches), max(0, a.max_batches)):
            print(json.dumps(p), flush=True)
        return 0
    if a.mooncake_point:
        size, batch, secs = int(a.mooncake_point[0]), int(a.mooncake_point[1]), float(a.mooncake_point[2])
        print(json.dumps(mooncake_point(size, batch, secs, a.protocol, a.host, a.device,
                                        max(1, a.min_batches), max(0, a.max_batches))), flush=True)
        return 0

    if not (a.seconds > 0) or a.repeats < 1:
        raise SystemExit("--seconds must be > 0 and --repeats >= 1")
    sizes, batches = parse_sizes(a.sizes), parse_sizes(a.batches)
    max_buffer = parse_sizes(a.max_buffer)[0]
    binary = find_kvferry(a.kvferry)
    tebench = None
    if a.mooncake_impl == "tebench" and a.tebench:
        python = None
        tebench = a.tebench
    else:
        python = ensure_mooncake()
        if a.mooncake_impl == "tebench":
            tebench = default_tebench(python)
            if tebench is None and python is not None:
                raise SystemExit("transfer_engine_bench not found in the Mooncake wheel: pass --tebench PATH")
    if a.python_api and python is not None:
        return python_api_mode(a, binary, python, kvferry_python(a.kvferry_python))
    if python is None and tebench is None:
        print("mooncake_compare: skipped (Mooncake Transfer Engine not installable here)")
        if a.out:
            Path(a.out).write_text(json.dumps({"skipped": "mooncake not installable"}, indent=2))
        return 0
    timeout = a.seconds * 4 + 120

    rows, skipped = [], []
    for size in sizes:
        for batch in batches:
            if size * batch > max_buffer:
                skipped.append(f"{human(size)}x{batch}")
                continue
            mc, kv = [], []
            for rep in range(a.repeats):
                # alternate, and swap who goes first each repeat (page cache, thermal, neighbours)
                order = ("mc", "kv") if rep % 2 == 0 else ("kv", "mc")
                for who in order:
                    if who == "mc":
                        if tebench:
                            mc.append(run_tebench(tebench, size, batch, a.seconds, timeout))
                        else:
                            mc.append(run_mooncake(python, size, batch, a.seconds, timeout))
                    else:
                        kv.append(run_kvferry(binary, size, batch, a.seconds, timeout))
                print(f"  {human(size):>5} x {batch:<4} rep {rep + 1}: mooncake {mc[-1]['gb_per_s']:.3f} GB/s"
                      f"  kvferry {kv[-1]['gb_per_s']:.3f} GB/s", file=sys.stderr, flush=True)
            m_gbs = statistics.median(p["gb_per_s"] for p in mc)
            k_gbs = statistics.median(p["gb_per_s"] for p in kv)
            rows.append({
                "block_size": size,
                "batch": batch,
                "mooncake_gb_per_s": m_gbs,
                "kvferry_gb_per_s": k_gbs,
                "ratio_kvferry_over_mooncake": k_gbs / m_gbs if m_gbs > 0 else None,
                "mooncake_avg_latency_us": statistics.median(p["avg_latency_us"] for p in mc),
                "kvferry_avg_latency_us": statistics.median(p["avg_latency_us"] for p in kv),
                "mooncake_runs": mc,
                "kvferry_runs": kv,
            })

    print(f"{'size':>6} {'batch':>6} {'Mooncake GB/s':>14} {'kvferry GB/s':>13} {'kvferry/Mooncake':>17}")
    for r in rows:
        ratio = r["ratio_kvferry_over_mooncake"]
        print(f"{human(r['block_size']):>6} {r['batch']:>6} {r['mooncake_gb_per_s']:>14.3f} "
              f"{r['kvferry_gb_per_s']:>13.3f} {ratio if ratio is not None else float('nan'):>17.2f}")
    if skipped:
        print(f"skipped (buffer over --max-buffer): {', '.join(skipped)}")
    if a.out:
        mc_version = subprocess.run([python, "-m", "pip", "show", PACKAGE], capture_output=True,
                                    text=True).stdout if python else ""
        meta = {
            "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
            "seconds": a.seconds,
            "repeats": a.repeats,
            "statistic": "median",
            "cpus": os.cpu_count(),
            "machine": platform.platform(),
            "mooncake_package": next((l.split(":", 1)[1].strip() for l in mc_version.splitlines()
                                      if l.startswith("Version:")), None),
            "kvferry_binary": binary,
            "mooncake_impl": a.mooncake_impl,
            "skipped": skipped,
        }
        Path(a.out).write_text(json.dumps({"meta": meta, "points": rows}, indent=2))
    if a.plot and rows:
        plot(rows, a.plot, f"loopback TCP WRITEs, {os.cpu_count()} CPUs (medians of {a.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
