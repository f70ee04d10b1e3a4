#!/usr/bin/env python3
"""The soft-RoCE suite's benchmark step (run inside the guest by suite.sh): kvferry's RDMA
transfer engine beside `ib_write_bw` with as many QPs as kvferry's endpoint (`-q`) and, when a
Python with Mooncake's Transfer Engine is given, beside Mooncake's engine, on the same rxe
device in the same boot; and kvferry alone with other QP counts per endpoint (`--qps-sweep`).

Work: WRITEs of batches of requests of each size between two engines on one device in
loopback: `--batch` requests, fewer where that would pass `--batch-bytes` (a 4 MiB point runs
batches of 32). kvferry's requests land in reverse order on the target (`--pattern
scattered`), so it merges the slices of one request into one work request but never two
requests, as neither Mooncake nor ib_write_bw does. ib_write_bw keeps a batch's requests in
flight over its QPs all the time (tx depth batch / QPs per QP, stated explicitly: perftest lowers
the depth to the iteration count) and moves at least what kvferry's point moves (`--min-batches`
batches). kvferry and Mooncake split the batch into `--inflight` batches (2: two halves), each
submitted and waited for by a thread of its own, so that at most the batch's requests are in
flight, as with ib_write_bw, but a finished half is submitted again while the other still
moves, as a serving engine's transfer pool and Mooncake's own `transfer_engine_bench` (threads
that each loop submit and wait) keep batches in flight; one batch drained before the next
(`--inflight 1`) leaves the link idle between batches. `--inflight-sweep` runs kvferry with
other counts too. Each engine runs at least `--min-batches` batches (per thread) per point and
none started after `--seconds`. `--rounds` rounds, the engines' order rotated
each round: ib_write_bw and kvferry side by side at each size (a shared machine's load drifts
over minutes), Mooncake's one process before or after them; per point the medians over rounds
and their min-max, and the per-round ratios
kvferry / ib_write_bw and kvferry / Mooncake (median, min-max). The emulated link says nothing
about absolute speed: only ratios of the same boot mean something (docs/design.md §7). Each
run's go-back-N retries (the device's `completer_retry_err` and `duplicate_request` counters)
are recorded beside its rate: they swing a run's rate more than any engine setting measured.

Writes OUT/bench_ratio.txt (the summary) and OUT/bench_rounds.json (every run). Exit 1 when
kvferry did not run over RDMA or moved nothing at some point; a missing ib_write_bw or
Mooncake figure only leaves that ratio out (and says why).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GB = 1e9
MIB = 1 << 20


def parse_size(text):
    text = text.strip().upper()
    mul = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if mul > 1 else text) * mul


def human(n):
    for unit, v in (("MiB", MIB), ("KiB", 1024)):
        if n % v == 0:
            return f"{n // v} {unit}"
    return f"{n} B"


# rxe's port counters that say a run retransmitted: `completer_retry_err` counts the requester's
# go-back-N retries (its ACK timer fired, or a NAK), `duplicate_request` the packets the
# responder had already received (what a retry sent again)
RETRY_COUNTERS = ("completer_retry_err", "duplicate_request")


def counters(a):
    """{name: value} of the device's RETRY_COUNTERS ({} where the device has none)."""
    d = Path(f"/sys/class/infiniband/{a.device}/ports/1/hw_counters")
    vals = {}
    for name in RETRY_COUNTERS:
        try:
            vals[name] = int((d / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return vals


def delta(before, after):
    """Counter increments between two `counters` reads (a counter one read lacks is left out)."""
    return {k: after[k] - before[k] for k in before if k in after}


def batch_for(a, size):
    """Requests per batch at `size`: `--batch`, fewer where that passes `--batch-bytes`."""
    return max(1, min(a.batch, a.batch_bytes // size))


def split(a, size, inflight):
    """(requests per submitted batch, submitting threads) at `size` with `inflight` batches in
    flight: the batch of `batch_for` split into that many. Every thread submits as many
    requests (`kvferry bench --batch` and Mooncake's points take one count for all), so an
    uneven batch rounds up, as ib_write_bw's depth per QP does: 2 x 3 for a batch of 5, never
    2 x 2 with a request dropped; fewer threads where the last would add none."""
    batch = batch_for(a, size)
    per = -(-batch // max(1, min(inflight, batch)))
    # no thread with nothing to add: a batch of 4 in 3 goes as 2 x 2
    return per, -(-batch // per)


def ib_point(a, size, log):
    """ib_write_bw server + client on one device with `--qps` QPs; GB/s (10^9 B/s) or None,
    with the reason, the iterations per QP and the tx depth per QP. The batch's requests are
    in flight over all QPs together (depth per QP = batch / QPs) and the run moves what
    kvferry's point moves at least (`-n` counts per QP; perftest lowers the depth to it)."""
    depth = -(-batch_for(a, size) // a.qps)
    iters = max(depth, -(-a.min_batches * batch_for(a, size) // a.qps), -(-a.ib_bytes // (size * a.qps)))
    cmd = ["ib_write_bw", "-d", a.device, "-x", str(a.gid_index), "-s", str(size), "-n", str(iters),
           "-t", str(depth), "-q", str(a.qps)]
    srv = subprocess.Popen(cmd, stdout=open(f"{log}-server.log", "w"), stderr=subprocess.STDOUT)
    out, rc = "", 1
    try:
        # the server may need a while to listen under TCG: retry the client
        for _ in range(20):
            time.sleep(1)
            r = subprocess.run(cmd + [a.ip], capture_output=True, text=True, timeout=a.timeout)
            out, rc = r.stdout + r.stderr, r.returncode
            if rc == 0 or "Couldn't connect" not in out:
                break
    except subprocess.TimeoutExpired:
        out, rc = out + f"\nclient timed out after {a.timeout} s", 124
    finally:
        try:
            srv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
    Path(f"{log}.log").write_text(out)
    if rc != 0:
        return None, f"ib_write_bw exited {rc}", iters, depth
    # result line: #bytes #iterations BW peak[MB/sec] BW average[MB/sec] MsgRate[Mpps]
    # (perftest's MB is 2^20 bytes)
    for line in reversed(out.splitlines()):
        f = line.split()
        if len(f) >= 5 and f[0] == str(size):
            try:
                return float(f[3]) * MIB / GB, None, iters, depth
            except ValueError:
                break
    return None, "ib_write_bw printed no result line", iters, depth


def kvferry_points(a, log, qps, sizes, inflight):
    """{size: point} from `kvferry bench` with `qps` QPs per endpoint and `inflight` batches in
    flight (`split`) at `sizes` (one run per batch shape), or raises."""
    by_batch = {}
    for size in sizes:
        by_batch.setdefault(split(a, size, inflight), []).append(size)
    pts, text = {}, ""
    for (batch, threads), sizes in by_batch.items():
        cmd = [a.kvferry, "bench", "--transport", "rdma", "--block-sizes", ",".join(map(str, sizes)),
               "--batch", str(batch), "--threads", str(threads),
               "--seconds", str(a.seconds), "--min-batches", str(a.min_batches),
               "--pattern", "scattered", "--qps-per-endpoint", str(qps), "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        text += " ".join(cmd) + "\n" + r.stdout + r.stderr
        Path(f"{log}.log").write_text(text)
        if r.returncode != 0:
            raise RuntimeError(f"kvferry bench exited {r.returncode}: {r.stderr.strip()[-500:]}")
        rep = json.loads(r.stdout)
        if rep.get("transport") != "rdma":
            raise RuntimeError(f"kvferry bench ran over {rep.get('transport')!r}, not RDMA")
        pts.update({p["block_size"]: p for p in rep["points"]})
    return pts


def mooncake_points(a, log):
    """{size: point, or {"error": reason}} from one Mooncake process over every size."""
    spec = ",".join("%d:%d:%d" % ((size,) + split(a, size, a.inflight)) for size in a.sizes)
    cmd = [a.mooncake_python, a.mooncake_script, "--mooncake-points", spec, str(a.seconds),
           "--protocol", "rdma", "--host", a.ip, "--device", a.device, "--min-batches", str(a.min_batches)]
    env = dict(os.environ, GLOG_minloglevel="2")  # Mooncake logs every connection at INFO
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout * len(a.sizes), env=env)
        out, err, why = r.stdout, r.stderr, None
        if r.returncode != 0:
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            why = f"exited {r.returncode}: {tail[-300:]}"
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, why = "", f"timed out after {a.timeout * len(a.sizes):g} s"
    Path(f"{log}.log").write_text(" ".join(cmd) + "\n" + out + err)
    got = {}
    for line in out.splitlines():
        if line.startswith("{"):
            p = json.loads(line)
            got[p["block_size"]] = p
    return {size: got.get(size) or {"error": why or "no result"} for size in a.sizes}


def spread(values):
    """(median, min, max) of the values that exist, or None."""
    v = [x for x in values if x is not None]
    return (statistics.median(v), min(v), max(v)) if v else None


def fmt(s, digits=4):
    if s is None:
        return "n/a"
    return f"{s[0]:.{digits}f} ({s[1]:.{digits}f}-{s[2]:.{digits}f})"


def self_test():
    """Checks of the bench's own arithmetic (`bench.py --self-test`, run by suite.sh before the
    bench): every request of a batch is submitted, however it splits."""
    for batch in range(1, 40):
        for inflight in range(1, 5):
            a = argparse.Namespace(batch=batch, batch_bytes=1 << 40)
            per, threads = split(a, 1, inflight)
            assert per * threads >= batch, (batch, inflight, per, threads)
            assert per * (threads - 1) < batch, (batch, inflight, per, threads)
    assert split(argparse.Namespace(batch=5, batch_bytes=1 << 40), 1, 2) == (3, 2)
    assert split(argparse.Namespace(batch=128, batch_bytes=32 * MIB), 4 * MIB, 2) == (4, 2)
    print("bench.py self-test: ok")


def main():
    if sys.argv[1:] == ["--self-test"]:
        self_test()
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kvferry", required=True)
    ap.add_argument("--device", default="rxe0")
    ap.add_argument("--gid-index", type=int, default=1, help="ib_write_bw -x (1: IPv4-mapped RoCEv2)")
    ap.add_argument("--ip", required=True, help="the device's IPv4 address")
    ap.add_argument("--sizes", default="64K,256K,1M,4M")
    ap.add_argument("--batch", type=int, default=128, help="requests per batch (ib_write_bw: tx depth)")
    ap.add_argument("--batch-bytes", default="128M", help="bytes per batch at most (fewer requests at large sizes)")
    ap.add_argument("--qps", type=int, default=2,
                    help="kvferry's QPs per endpoint (its default, 2) and ib_write_bw's -q")
    ap.add_argument("--qps-sweep", default="1,4",
                    help="other QP counts per endpoint kvferry runs with each round (empty: none)")
    ap.add_argument("--qps-sweep-sizes", default="", help="sizes of the QP sweep (empty: --sizes)")
    ap.add_argument("--inflight", type=int, default=2,
                    help="batches in flight per engine (kvferry and Mooncake): the batch split into "
                         "this many, each on a submitting thread of its own")
    ap.add_argument("--inflight-sweep", default="",
                    help="other batches-in-flight counts kvferry runs with each round (e.g. 1: one "
                         "batch drained before the next; empty: none)")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--min-batches", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ib-bytes", default="128M", help="bytes per ib_write_bw run, at least")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per engine run (per size for Mooncake)")
    ap.add_argument("--budget", type=float, default=900.0,
                    help="seconds for all rounds: no round starts that could end past it")
    ap.add_argument("--mooncake-python", default="", help="a python that imports mooncake.engine")
    ap.add_argument("--mooncake-script", default=str(Path(__file__).resolve().parents[2] / "bench" / "mooncake_compare.py"))
    ap.add_argument("--mooncake-skip-reason", default="", help="why Mooncake is not measured")
    a = ap.parse_args()
    a.sizes = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
    a.batch_bytes = parse_size(a.batch_bytes)
    a.ib_bytes = parse_size(a.ib_bytes)
    sweep = [int(q) for q in a.qps_sweep.split(",") if q.strip() and int(q) != a.qps]
    if a.inflight < 1:
        ap.error("--inflight must be at least 1")
    isweep = [int(k) for k in a.inflight_sweep.split(",") if k.strip() and int(k) != a.inflight]
    a.sweep_sizes = [parse_size(s) for s in a.qps_sweep_sizes.split(",") if s.strip()] or a.sizes
    out = Path(a.out)
    engines = ["ib_write_bw", "kvferry"] + (["mooncake"] if a.mooncake_python else [])

    rounds = []
    ok = True
    began, longest, cut = time.time(), 0.0, None
    sweep_cut = []
    for rnd in range(a.rounds):
        # a round that could not end within the budget is not started (the step's timeout
        # would kill it, and with it every figure measured so far)
        if rnd > 0 and time.time() - began + longest > a.budget:
            cut = f"rounds cut to {rnd} of {a.rounds}: another would pass the {a.budget:g} s budget"
            print(cut, file=sys.stderr, flush=True)
            break
        round_began = time.time()
        order = engines[rnd % len(engines):] + engines[:rnd % len(engines)]
        # ib_write_bw and kvferry run side by side per size (the load of a shared machine
        # drifts over minutes: a ratio of two runs seconds apart means more than one of runs
        # minutes apart), in the round's order; Mooncake's one process per round (its start-up
        # is paid once) goes before or after them, as the rotation puts it
        pair = [e for e in order if e != "mooncake"]
        mc_first = bool(a.mooncake_python) and order[0] == "mooncake"
        # the QP sweep's runs go right after kvferry's own at each sweep size, rotated too
        qorder = sweep[rnd % len(sweep):] + sweep[:rnd % len(sweep)] if sweep else []
        res = {"round": rnd + 1, "order": order, "ib_write_bw": {}, "kvferry": {}, "mooncake": {},
               "kvferry_qps": {}, "kvferry_inflight": {}}
        spent = {e: 0.0 for e in engines}

        def run_mooncake():
            t0, c0 = time.time(), counters(a)
            res["mooncake"] = mooncake_points(a, out / f"mooncake-r{rnd + 1}")
            # one process for every size: its retries are the round's, not a size's
            res["mooncake_retries"] = delta(c0, counters(a))
            spent["mooncake"] += time.time() - t0

        if mc_first:
            run_mooncake()
        for size in a.sizes:
            for who in pair:
                t0 = time.time()
                if who == "ib_write_bw":
                    c0 = counters(a)
                    gbs, why, iters, depth = ib_point(a, size, out / f"ib_write_bw-r{rnd + 1}-{size}")
                    res["ib_write_bw"][size] = {"gb_per_s": gbs, "iterations_per_qp": iters,
                                                "tx_depth_per_qp": depth, "qps": a.qps, "error": why,
                                                "retries": delta(c0, counters(a))}
                else:
                    for q in [a.qps] + (qorder if size in a.sweep_sizes else []):
                        # the sweep yields to the budget: past it, only the main points run
                        if q != a.qps and time.time() - began > a.budget:
                            sweep_cut.append(f"round {rnd + 1}: kvferry with {q} QPs at {human(size)}")
                            continue
                        c0 = counters(a)
                        try:
                            pts = kvferry_points(a, out / f"kvferry-bench-r{rnd + 1}-q{q}-{size}", q, [size],
                                                 a.inflight)
                        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
                            print(f"round {rnd + 1}: kvferry ({q} QPs, {human(size)}): {e}", file=sys.stderr)
                            ok = False
                            pts = {}
                        p = pts.get(size)
                        if p is None or not p["gb_per_s"] > 0:
                            ok = False
                        else:
                            p["retries"] = delta(c0, counters(a))
                        res["kvferry_qps"].setdefault(q, {})[size] = p
                        if q == a.qps:
                            res["kvferry"][size] = p
                    # other batches-in-flight counts, right after kvferry's own run (the
                    # budget as the QP sweep's)
                    for k in isweep:
                        if time.time() - began > a.budget:
                            sweep_cut.append(f"round {rnd + 1}: kvferry with {k} in flight at {human(size)}")
                            continue
                        c0 = counters(a)
                        try:
                            pts = kvferry_points(a, out / f"kvferry-bench-r{rnd + 1}-i{k}-{size}", a.qps,
                                                 [size], k)
                        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
                            print(f"round {rnd + 1}: kvferry ({k} in flight, {human(size)}): {e}", file=sys.stderr)
                            pts = {}
                        p = pts.get(size)
                        if p is not None:
                            p["retries"] = delta(c0, counters(a))
                        res["kvferry_inflight"].setdefault(k, {})[size] = p
                spent[who] += time.time() - t0
        if a.mooncake_python and not mc_first:
            run_mooncake()
        print(f"round {rnd + 1}: " + ", ".join(f"{w} {spent[w]:.0f} s" for w in engines),
              file=sys.stderr, flush=True)
        rounds.append(res)
        longest = max(longest, time.time() - round_began)

    def gbs(r, who, size):
        p = r[who].get(size) or {}
        return p.get("gb_per_s")

    def ratio(r, size, base):
        k, b = gbs(r, "kvferry", size), gbs(r, base, size)
        return k / b if k and b else None

    def qgbs(r, q, size):
        return ((r["kvferry_qps"].get(q) or {}).get(size) or {}).get("gb_per_s")

    lines = [f"soft-RoCE bench: {a.device} under QEMU TCG, WRITE, batches of {a.batch} requests (at most "
             f"{human(a.batch_bytes)}: " + ", ".join(f"{batch_for(a, s)} at {human(s)}" for s in a.sizes)
             + f"), kvferry with {a.qps} QPs per endpoint beside ib_write_bw -q {a.qps} (the batch's "
             f"requests in flight over its QPs all the time) and Mooncake (2 QPs per endpoint); kvferry and "
             f"Mooncake with the batch split into {a.inflight} in flight ("
             + ", ".join("%d x %d" % split(a, s, a.inflight)[::-1] for s in a.sizes)
             + f"), {len(rounds)} rounds, at least {a.min_batches} "
             f"batches per thread and {a.seconds:g} s per point; GB/s and ratios as median (min-max) over rounds"]
    summary = []
    missed = []
    for size in a.sizes:
        k = spread([gbs(r, "kvferry", size) for r in rounds])
        ib = spread([gbs(r, "ib_write_bw", size) for r in rounds])
        mc = spread([gbs(r, "mooncake", size) for r in rounds])
        r_ib = spread([ratio(r, size, "ib_write_bw") for r in rounds])
        r_mc = spread([ratio(r, size, "mooncake") for r in rounds])
        batches = [(r["kvferry"].get(size) or {}).get("batches") for r in rounds]
        lines.append(f"block {human(size):>7}: kvferry {fmt(k)} GB/s ({'/'.join(str(b) for b in batches)} batches)"
                     f" | ib_write_bw -q {a.qps} {fmt(ib)} | Mooncake {fmt(mc)}")
        lines.append(f"{'':15}kvferry/ib_write_bw {fmt(r_ib, 2)} | kvferry/Mooncake {fmt(r_mc, 2)}")
        if r_ib and r_ib[0] < 0.95:
            missed.append(f"{human(size)}: kvferry/ib_write_bw {r_ib[0]:.2f} < 0.95")
        if r_mc and r_mc[0] < 1.2:
            missed.append(f"{human(size)}: kvferry/Mooncake {r_mc[0]:.2f} < 1.2")
        summary.append({"block_size": size, "batch": batch_for(a, size), "kvferry_gb_per_s": k,
                        "ib_write_bw_gb_per_s": ib, "mooncake_gb_per_s": mc,
                        "ratio_kvferry_over_ib_write_bw": r_ib, "ratio_kvferry_over_mooncake": r_mc})
    def igbs(r, k, size):
        return ((r["kvferry_inflight"].get(k) or {}).get(size) or {}).get("gb_per_s")

    for k in isweep:
        cells = []
        for size in a.sizes:
            g = spread([igbs(r, k, size) for r in rounds])
            rel = spread([igbs(r, k, size) / gbs(r, "kvferry", size) for r in rounds
                          if igbs(r, k, size) and gbs(r, "kvferry", size)])
            vs_ib = spread([igbs(r, k, size) / gbs(r, "ib_write_bw", size) for r in rounds
                            if igbs(r, k, size) and gbs(r, "ib_write_bw", size)])
            cells.append(f"{human(size)} {fmt(g)} GB/s, x{fmt(rel, 2)} of {a.inflight} in flight, "
                         f"/ib_write_bw {fmt(vs_ib, 2)}")
        lines.append(f"kvferry with {k} batch(es) in flight (median (min-max) over rounds): " + "; ".join(cells))
    if sweep:
        qs = sorted([a.qps] + sweep)
        lines.append(f"kvferry by QPs per endpoint (GB/s median; ratio to {a.qps} QPs, per round, median):")
        for size in a.sweep_sizes:
            cells = []
            for q in qs:
                g = spread([qgbs(r, q, size) for r in rounds])
                rel = spread([qgbs(r, q, size) / qgbs(r, a.qps, size) for r in rounds
                              if qgbs(r, q, size) and qgbs(r, a.qps, size)])
                cells.append(f"{q} QPs {g[0]:.4f} (x{rel[0]:.2f})" if g and rel else f"{q} QPs n/a")
            lines.append(f"block {human(size):>7}: " + " | ".join(cells))
    # a go-back-N retry (the requester's ACK timer fired, or a NAK) resends from the last
    # acknowledged packet: runs of one setting in one boot swung 2x with their retries. kvferry's
    # count includes its run's set-up and read-back check
    def retries(p):
        return ((p or {}).get("retries") or {}).get("completer_retry_err")

    cells = []
    for size in a.sizes:
        k = [retries(r["kvferry"].get(size)) for r in rounds]
        ib = [retries(r["ib_write_bw"].get(size)) for r in rounds]
        cells.append(f"{human(size)} kvferry {'/'.join(str(v) for v in k)}, ib_write_bw {'/'.join(str(v) for v in ib)}")
    mcr = [(r.get("mooncake_retries") or {}).get("completer_retry_err") for r in rounds]
    lines.append("retries (rxe completer_retry_err per run, rounds in order): " + "; ".join(cells)
                 + (f"; Mooncake (all sizes) {'/'.join(str(v) for v in mcr)}" if a.mooncake_python else ""))
    lines.append("targets (kvferry >= 0.95 x ib_write_bw -q, >= 1.2 x Mooncake, medians): "
                 + ("met at every size" if not missed else "missed at " + "; ".join(missed)))
    for r in rounds:
        for who in ("ib_write_bw", "mooncake"):
            for size, p in r[who].items():
                if p and p.get("error"):
                    lines.append(f"round {r['round']}: {who} {human(size)}: left out ({p['error']})")
    if cut:
        lines.append(cut)
    if sweep_cut:
        lines.append(f"QP sweep cut past the {a.budget:g} s budget: " + "; ".join(sweep_cut))
    if not a.mooncake_python:
        lines.append(f"Mooncake: not measured ({a.mooncake_skip_reason or 'no --mooncake-python'})")
    if not ok:
        lines.append("FAILED: kvferry did not move data over RDMA at every point of every round")
    text = "\n".join(lines) + "\n"
    (out / "bench_ratio.txt").write_text(text)
    (out / "bench_rounds.json").write_text(json.dumps({"summary": summary, "rounds": rounds}, indent=2))
    print(text, end="")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
