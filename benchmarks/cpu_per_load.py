"""CPU per one-block load of each process: the prefill daemon (P), the
decode daemon (D) and the engine process, during back-to-back batches of
64 loads (``kvd bench``'s throughput case, ``kvd.bench.throughput``).

    .venv/bin/python -m benchmarks.cpu_per_load [--seconds 10] [--json FILE]

On a machine with fewer cores than busy processes, loads/s is set by the
sum of the three (two cores here: loads/s ~ 2 / (P + D + engine) CPU per
load), so this is how a change to the per-load path is measured: each
process's user + system CPU (``/proc/PID/stat``, all its threads) over the
window, divided by the loads done in it. The engine process is the
benchmark itself (``EngineClient`` for both workers, polling every 50 us
as ``kvd bench`` does). D's counters tell how the loads were granted
(``claims_sent``, ``claims_followed``, ``claims_waited`` per load) and how
they went out (``coalesced_reads`` per load: 1/64 when each batch of 64
is one NIXL transfer, ``kvd.core.coalesce``), and the answers of the
followed holds' polls D applied per load (``holds_answers_applied``: each
a PeerService.Holds call, whose fixed cost the loads of an answer share),
and D's garbage collections per load by generation (``python_gc_collections_total``
at its /metrics: a daemon that serves collects seldom, ``kvd.daemon.heap``).

``--threads`` adds each thread's CPU and context switches per load
(``/proc/PID/task``, as ``benchmarks/thread_cpu.py``): which thread is
busy, and whether it ever waits (a thread with almost no voluntary switches
is never idle: the one that caps loads/s when cores are free).

A before/after of a code change: run it against each checkout in turn,
several alternating pairs, by path from outside the repository so that
``PYTHONPATH`` picks the code (the daemons run what the benchmark
imports), e.g. ``cd /tmp && PYTHONPATH=/tmp/kvd-before
/path/to/kvd/.venv/bin/python /path/to/kvd/benchmarks/cpu_per_load.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

try:
    from benchmarks import thread_cpu
except ImportError:  # run by path, PYTHONPATH naming another checkout's kvd only (see above)
    import thread_cpu
from kvd.bench import common as cm
from kvd.bench.kvd_pair import HOLD_AHEAD_S, KvdPair
from kvd.bench.throughput import BLOCK_LEN, CONCURRENCY, kvd_batch, segments
from kvd.testing import proxy
from kvd.testing.daemons import start_daemon
from kvd.testing.util import free_port


def run(seconds: float, concurrency: int = CONCURRENCY, block_len: int = BLOCK_LEN, poll_s: float = 50e-6,
        hold_ahead_s: float = HOLD_AHEAD_S, warm_batches: int = 3, threads: bool = False) -> dict:
    """Batches of ``concurrency`` one-block loads of ``block_len`` bytes, back
    to back for ``seconds`` after ``warm_batches`` untimed ones. Returns a
    dict: loads, seconds, median batch loads/s, CPU per load (us) of P, D
    and this process, and D's claim counters per load; with ``threads``,
    ``threads``: per process, rows ``[thread, CPU us, voluntary and
    involuntary context switches]`` per load, busiest first (``main`` is
    the process's first thread, which runs a daemon's event loop)."""
    src, dst, ids = segments(concurrency, block_len, 1)
    wd = cm.workdir()
    kvd = None
    daemons = []
    try:
        daemons.append(start_daemon(wd, "P", timeout=60.0, log_level="warning"))
        metrics_port = free_port()  # D's: its garbage collector's counts
        daemons.append(start_daemon(wd, "D", "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1",
                                    timeout=60.0, log_level="warning"))
        kvd = KvdPair(wd, (src.name, src.size), (dst.name, dst.size), daemons=tuple(daemons))
        for _ in range(warm_batches):  # handshake, first contact, the copy's first answers
            kvd_batch(kvd, block_len, ids, concurrency, poll_s, hold_ahead_s=hold_ahead_s)
            kvd.drain_sources()
        p, d = kvd.p.proc.pid, kvd.d.proc.pid
        s0, g0 = kvd.d.stats(), _gc_collections(metrics_port)
        pids = {"P": p, "D": d, "engine": os.getpid()}
        t0s = {k: thread_cpu.snap(v) for k, v in pids.items()} if threads else {}
        c0 = (cm.cpu_seconds(p), cm.cpu_seconds(d), time.process_time())
        t0 = time.monotonic()
        walls = []
        while time.monotonic() - t0 < seconds:
            w, _ = kvd_batch(kvd, block_len, ids, concurrency, poll_s, hold_ahead_s=hold_ahead_s)
            kvd.drain_sources()
            walls.append(w)
        elapsed = time.monotonic() - t0
        c1 = (cm.cpu_seconds(p), cm.cpu_seconds(d), time.process_time())
        t1s = {k: thread_cpu.snap(v) for k, v in pids.items()} if threads else {}
        s1, g1 = kvd.d.stats(), _gc_collections(metrics_port)
    finally:
        if kvd is not None:
            kvd.close()
        for d in daemons:
            d.stop()
        src.close()
        dst.close()
        cm.remove_workdir(wd)
    n = concurrency * len(walls)
    per = [(b - a) / n * 1e6 for a, b in zip(c0, c1)]
    return dict(concurrency=concurrency, block_len=block_len, poll_us=poll_s * 1e6, hold_ahead_ms=hold_ahead_s * 1e3,
                loads=n, seconds=elapsed, loads_s_median=concurrency / cm.median(walls), loads_s_window=n / elapsed,
                p_cpu_us=per[0], d_cpu_us=per[1], engine_cpu_us=per[2], total_cpu_us=sum(per),
                claims_sent=(s1.claims_sent - s0.claims_sent) / n,
                claims_followed=(s1.claims_followed - s0.claims_followed) / n,
                claims_waited=(s1.claims_waited - s0.claims_waited) / n if hasattr(s1, "claims_waited") else None,
                coalesced_reads=((s1.coalesced_reads - s0.coalesced_reads) / n
                                 if hasattr(s1, "coalesced_reads") else None),
                holds_answers=(s1.holds_answers_applied - s0.holds_answers_applied) / n,
                d_gc_per_load=[(b - a) / n for a, b in zip(g0, g1)],
                loadavg=os.getloadavg(),
                **({"threads": {k: _per_thread(t0s[k], t1s[k], pids[k], n) for k in t0s}} if threads else {}))


def _gc_collections(port: int) -> list[float]:
    """The daemon's garbage collections so far, generations 0, 1 and 2
    (``python_gc_collections_total`` at its /metrics; NaN for a daemon
    that does not export them, an older checkout's)."""
    m = proxy.parse_prometheus(proxy.get_text(f"http://127.0.0.1:{port}/metrics"))
    return [m.get(("python_gc_collections_total", (("generation", g),)), float("nan")) for g in "012"]


def _per_thread(before: dict, after: dict, pid: int, loads: int) -> list[list]:
    """Rows ``[thread, CPU us, voluntary, involuntary switches]`` per load
    for threads that lived through the window and did something."""
    rows = []
    for tid, (comm, u1, s1, v1, n1) in after.items():
        if tid not in before:
            continue
        _, u0, s0, v0, n0 = before[tid]
        cpu = ((u1 - u0) + (s1 - s0)) / thread_cpu.HZ / loads * 1e6
        if cpu >= 1.0 or (v1 - v0) / loads >= 0.05:
            rows.append(["main" if tid == pid else f"{comm} {tid}", round(cpu, 1), round((v1 - v0) / loads, 2),
                         round((n1 - n0) / loads, 2)])
    return sorted(rows, key=lambda r: -r[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="timed window (default 10)")
    ap.add_argument("--json", metavar="FILE", help="append the result as one JSON line here")
    ap.add_argument("--threads", action="store_true", help="also each thread's CPU and context switches per load")
    args = ap.parse_args(argv)
    res = run(args.seconds, threads=args.threads)
    print(f"{res['loads']:,} loads in {res['seconds']:.1f} s, {res['loads_s_median']:,.0f} loads/s (median batch; "
          f"{res['loads_s_window']:,.0f} over the window, the holds sent {HOLD_AHEAD_S * 1e3:g} ms ahead of each batch "
          f"included); "
          f"CPU per load: P {res['p_cpu_us']:.0f} us, D {res['d_cpu_us']:.0f} us, engine "
          f"{res['engine_cpu_us']:.0f} us (total {res['total_cpu_us']:.0f}); per load: claims sent "
          f"{res['claims_sent']:.2f}, followed {res['claims_followed']:.2f}, waited "
          f"{'-' if res['claims_waited'] is None else format(res['claims_waited'], '.2f')}, coalesced READs "
          f"{'-' if res.get('coalesced_reads') is None else format(res['coalesced_reads'], '.3f')}, "
          f"followed holds' answers {res['holds_answers']:.3f}, D's garbage collections "
          f"{' / '.join(format(x, '.4f') for x in res['d_gc_per_load'])} (generations 0 / 1 / 2) (all per load)")
    for proc, rows in res.get("threads", {}).items():
        print(f"  {proc}: " + "; ".join(f"{name} {cpu:.0f} us ({vol:.2f} vol, {inv:.2f} invol switches)"
                                      for name, cpu, vol, inv in rows))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
