"""Benchmark 4b, engine pairs: how kvd's throughput scales with independent
engine pairs sharing one prefill daemon P and one decode daemon D.

Goal (docs/PERFORMANCE.md, summary): 8 engine pairs on one daemon pair scale
to >= 6x one pair, in aggregate one-block loads per second.

Method. P and D are started once, for the whole run. For each N in
``--pairs`` (1, 2, 4, 8), N engine pairs run side by side, each in its own
process (spawned: real engines are separate processes, and one Python process
driving N pairs would measure itself, not kvd). Pair ``i`` registers a
prefill worker on P and a decode worker on D (engine ids ``n<N>-pair<i>-...``)
on two shm segments of its own, through
:class:`kvd.bench.kvd_pair.KvdPair` with the daemons given (it reaches them by
their sockets and P's peer address). Each pair runs one untimed warm-up batch
(handshakes, first use); once every pair has, and neither daemon is still
preparing descriptor lists, all pairs leave a common barrier and run ``reps``
timed batches back to back: a batch is ``concurrency`` one-block loads posted
at once, their holds sent ``hold_ahead_s`` before the first load, then waited
for (:func:`kvd.bench.throughput.kvd_batch`, as in ``kvd bench``'s (3)).
Pairs are closed (unregistered) after each N; the next N starts new ones.

Figures for each N:

- aggregate loads/s: every pair's loads / the overlapped window, from the
  first pair's start after the barrier to the last pair's end (so it
  includes each batch's hold-ahead sleep: the daemons work on the holds
  then). ``scaling`` is that over the aggregate with one pair.
- per-pair loads/s: each pair's median over its batches of
  ``concurrency / batch wall`` (the wall from the first load's post to the
  last ``recv_done``), then the median (and minimum) over the pairs.
- latency p50/p99 (ms): of every load, post to ``recv_done``.
- CPU per load (ms): user + system CPU seconds of D and of P over the timed
  window (``/proc/<pid>/stat``, read before the barrier opens and once every
  pair has reported), and of the engine processes (their own
  ``time.process_time`` over their timed batches), over the window's loads.
- overlap: the share of the window in which all N pairs were running
  (``(earliest end - latest start) / window``); a low one means the pairs
  did not run side by side and the aggregate is not a scaling figure.

The engine processes need CPU too: with fewer cores than N + 2 the pairs
compete with the daemons for it, and the scaling says as much about the
machine as about kvd (a note is printed then).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
import traceback

import numpy as np

from benchmarks.daemon_entry import entry
from kvd.bench import common as cm
from kvd.bench.kvd_pair import HOLD_AHEAD_S, KvdPair
from kvd.bench.throughput import kvd_batch
from kvd.testing.daemons import Daemon, start_daemon
from kvd.testing.shm import ShmSegment, cleanup_segments
from kvd.testing.util import wait_until

BLOCK_LEN = 4 * cm.KiB  # as benchmark 4 and kvd bench's (3)
CONCURRENCY = 64
PAIRS = [1, 2, 4, 8]
GOAL_PAIRS, GOAL_SCALING = 8, 6.0
# How long a pair waits at the barrier, and the parent for any pair's report (s).
WAIT_S = 300.0


def _daemon_spec(d: Daemon) -> dict:
    """What a pair process needs to reach daemon ``d`` (``Daemon`` holds a
    ``Popen``, which does not pickle): socket, log path, peer address, name."""
    return dict(socket=d.socket, log_path=d.log_path, peer_address=d.peer_address, name=d.name)


def _daemon_from(spec: dict) -> Daemon:
    """A :class:`Daemon` known by its socket only (``proc`` None: started by
    another process; :class:`KvdPair` given it never stops or pauses it)."""
    return Daemon(None, spec["socket"], spec["log_path"], peer_address=spec["peer_address"], name=spec["name"])


def pair_main(i: int, cfg: dict, q, barrier, release) -> None:
    """One engine pair, in its own process: pair ``i`` of ``cfg["pairs"]``.

    Registers its workers on P and D (``cfg["P"]``, ``cfg["D"]``: see
    :func:`_daemon_spec`), runs one warm-up batch, puts ``("ready", i)`` on
    ``q``, waits at ``barrier``, runs ``cfg["reps"]`` timed batches of
    ``cfg["concurrency"]`` loads of ``cfg["block_len"]`` bytes and puts
    ``("done", i, result)``: result has ``walls_s`` (each batch's wall,
    seconds), ``loads`` (per batch), ``lat_s`` (each load's seconds),
    ``t0``/``t1`` (``time.monotonic`` seconds, system-wide, at the start of
    its first batch and the end of its last) and ``cpu_s`` (its own CPU
    seconds over them). Then waits for ``release`` before unregistering, so
    that the daemons' CPU is read with every pair still registered. On an
    error puts ``("error", i, traceback)`` and breaks the barrier."""
    kvd = src = dst = None
    try:
        bl, conc, poll_s = cfg["block_len"], cfg["concurrency"], cfg["poll_s"]
        seg = max(64, 2 * conc) * bl
        src, dst = ShmSegment(seg, cm.SHM_PREFIX), ShmSegment(seg, cm.SHM_PREFIX)
        src.fill(7 + i)
        nb = seg // bl
        rng = np.random.default_rng(3 + i)
        ids = [(rng.permutation(nb)[:1].tolist(), rng.permutation(nb)[:1].tolist()) for _ in range(min(conc, 8))]
        kvd = KvdPair(cfg["workdir"], (src.name, seg), (dst.name, seg),
                      daemons=(_daemon_from(cfg["P"]), _daemon_from(cfg["D"])), prefix=f"n{cfg['pairs']}-pair{i}-")
        kvd_batch(kvd, bl, ids, conc, poll_s, hold_ahead_s=cfg["hold_ahead_s"])  # handshakes, first use
        kvd.drain_sources()
        q.put(("ready", i))
        barrier.wait(WAIT_S)
        walls, loads, lat = [], [], []
        t0, c0 = time.monotonic(), time.process_time()
        for _ in range(cfg["reps"]):
            w, ls = kvd_batch(kvd, bl, ids, conc, poll_s, hold_ahead_s=cfg["hold_ahead_s"])
            kvd.drain_sources()
            walls.append(w)
            loads.append(conc)
            lat.extend(ls)
        t1, c1 = time.monotonic(), time.process_time()
        q.put(("done", i, dict(walls_s=walls, loads=loads, lat_s=lat, t0=t0, t1=t1, cpu_s=c1 - c0)))
        release.wait(WAIT_S)
    except BaseException:
        barrier.abort()
        q.put(("error", i, traceback.format_exc()))
    finally:
        if kvd is not None:
            kvd.close()
        for s in (src, dst):
            if s is not None:
                s.close()


def _collect(q, procs, kind: str, n: int) -> dict[int, object]:
    """Reads ``n`` ``(kind, i, ...)`` messages from ``q``; raises RuntimeError
    on a pair's error message, on a pair process that exited, or after
    :data:`WAIT_S` seconds."""
    got: dict[int, object] = {}
    deadline = time.monotonic() + WAIT_S
    while len(got) < n:
        try:
            msg = q.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode is not None]
            if dead:
                raise RuntimeError(f"pair process {dead[0].name} exited {dead[0].exitcode} before '{kind}'")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n - len(got)} pairs not '{kind}' after {WAIT_S} s")
            continue
        if msg[0] == "error":
            raise RuntimeError(f"pair {msg[1]} failed:\n{msg[2]}")
        if msg[0] == kind:
            got[msg[1]] = msg[2] if len(msg) > 2 else None
    return got


def _settled(d: Daemon) -> bool:
    """Whether ``d`` prepares no descriptor lists now (``dlists_preparing`` 0:
    they are prepared about a second after a handshake, on the daemon's CPU)."""
    return d.stats().dlists_preparing == 0


def run_n(ctx, n: int, P: Daemon, D: Daemon, wd: str, block_len: int, concurrency: int, reps: int,
          poll_s: float, hold_ahead_s: float) -> dict:
    """N = ``n`` pair processes (:func:`pair_main`), overlapped timed batches;
    returns the figures of the module docstring for this N (loads/s,
    latencies in ms, CPU in seconds per load, walls in seconds)."""
    cfg = dict(pairs=n, workdir=wd, P=_daemon_spec(P), D=_daemon_spec(D), block_len=block_len,
               concurrency=concurrency, reps=reps, poll_s=poll_s, hold_ahead_s=hold_ahead_s)
    q = ctx.Queue()
    barrier, release = ctx.Barrier(n + 1), ctx.Event()
    procs = [ctx.Process(target=pair_main, args=(i, cfg, q, barrier, release), name=f"pair{i}", daemon=True)
             for i in range(n)]
    for p in procs:
        p.start()
    try:
        _collect(q, procs, "ready", n)
        time.sleep(0.2)  # P and D schedule the descriptor lists' preparation after the handshakes
        for d in (P, D):
            wait_until(lambda: _settled(d), 30.0, f"{d.name}: descriptor lists prepared", interval=0.1)
        cpu0 = {k: cm.cpu_seconds(d.pid) for k, d in (("P", P), ("D", D))}
        try:
            barrier.wait(WAIT_S)
        except threading.BrokenBarrierError:
            _collect(q, procs, "done", n)  # raises the failed pair's error
            raise
        res = _collect(q, procs, "done", n)
        cpu1 = {k: cm.cpu_seconds(d.pid) for k, d in (("P", P), ("D", D))}
        release.set()
        for p in procs:
            p.join(60)
    finally:
        release.set()
        try:
            barrier.abort()
        except Exception:
            pass
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(10)
    for d in (P, D):
        if d.proc.poll() is not None:
            raise RuntimeError(f"daemon {d.name} exited {d.proc.returncode}:\n{d.log_tail(60)}")
    rs = [res[i] for i in range(n)]
    t0, t1 = min(r["t0"] for r in rs), max(r["t1"] for r in rs)
    window = t1 - t0
    loads = sum(sum(r["loads"]) for r in rs)
    lat = [x for r in rs for x in r["lat_s"]]
    per_pair = [cm.median([c / w for c, w in zip(r["loads"], r["walls_s"])]) for r in rs]
    return dict(pairs=n, concurrency=concurrency, loads=loads, window_s=window, loads_s=loads / window,
                pair_loads_s=per_pair, pair_loads_s_p50=cm.median(per_pair), pair_loads_s_min=min(per_pair),
                lat_p50_ms=cm.pct(lat, 50) * 1e3, lat_p99_ms=cm.pct(lat, 99) * 1e3,
                overlap=max(0.0, min(r["t1"] for r in rs) - max(r["t0"] for r in rs)) / window,
                d_cpu_s_per_load=(cpu1["D"] - cpu0["D"]) / loads, p_cpu_s_per_load=(cpu1["P"] - cpu0["P"]) / loads,
                engine_cpu_s_per_load=sum(r["cpu_s"] for r in rs) / loads,
                walls_s=[r["walls_s"] for r in rs])


def run(pairs=PAIRS, concurrency: int = CONCURRENCY, total_concurrency: int = 0, block_len: int = BLOCK_LEN,
        reps: int = 10, poll_s: float = 50e-6, hold_ahead_s: float = HOLD_AHEAD_S, daemon_args=(), daemon_set=(),
        progress: bool = True) -> dict:
    """Benchmark 4b: starts P and D, then :func:`run_n` for each N in
    ``pairs`` (``concurrency`` loads in flight per pair, or
    ``total_concurrency // N`` when that is set), stops them. Returns a dict:
    ``cases`` (one per N, with ``scaling`` against N = 1 when measured, else
    None), the goal's ``scaling_at_goal`` (None unless 1 and 8 were
    measured) and ``goal_met``, the settings and the load averages."""
    load0, t_start = cm.loadavg(), time.time()
    ctx = mp.get_context("spawn")
    wd = cm.workdir()
    P = D = None
    cases = []
    prog = cm.Progress(total=len(pairs), title="pairs", enabled=progress)
    try:
        P = start_daemon(wd, "P", *daemon_args, entry=entry(daemon_set), timeout=60.0, log_level="warning")
        D = start_daemon(wd, "D", *daemon_args, entry=entry(daemon_set), timeout=60.0, log_level="warning")
        for n in pairs:
            conc = max(1, total_concurrency // n) if total_concurrency else concurrency
            c = run_n(ctx, n, P, D, wd, block_len, conc, reps, poll_s, hold_ahead_s)
            cases.append(c)
            prog.step(f"N={n}: {c['loads_s']:,.0f} loads/s")
    finally:
        prog.close()
        for d in (D, P):
            if d is not None:
                d.stop()
        cm.remove_workdir(wd)
    base = next((c["loads_s"] for c in cases if c["pairs"] == 1), None)
    for c in cases:
        c["scaling"] = c["loads_s"] / base if base else None
    at_goal = next((c["scaling"] for c in cases if c["pairs"] == GOAL_PAIRS), None)
    return dict(benchmark="pairs", block_len=block_len, blocks=1, reps=reps, poll_us=poll_s * 1e6,
                hold_ahead_ms=hold_ahead_s * 1e3, concurrency=concurrency, total_concurrency=total_concurrency,
                cases=cases, goal_pairs=GOAL_PAIRS, goal_scaling=GOAL_SCALING, scaling_at_goal=at_goal,
                goal_met=None if at_goal is None else at_goal >= GOAL_SCALING,
                daemon_args=list(daemon_args), daemon_set=list(daemon_set), cores=os.cpu_count(),
                seconds=time.time() - t_start, loadavg_start=load0, loadavg_end=cm.loadavg())


def table(res: dict, markdown: bool = False) -> str:
    """The cases as a text (or ``markdown``) table: pairs, loads in flight per
    pair, aggregate loads/s, scaling, per-pair loads/s, latency (ms), CPU of
    D, P and the engines per load (ms), overlap (%)."""
    rows = []
    for c in res["cases"]:
        rows.append([c["pairs"], c["concurrency"], f"{c['loads_s']:,.0f}",
                     f"{c['scaling']:.2f}" if c["scaling"] is not None else "", f"{c['pair_loads_s_p50']:,.0f}",
                     f"{c['lat_p50_ms']:.2f}", f"{c['lat_p99_ms']:.2f}", f"{c['d_cpu_s_per_load'] * 1e3:.3f}",
                     f"{c['p_cpu_s_per_load'] * 1e3:.3f}", f"{c['engine_cpu_s_per_load'] * 1e3:.3f}",
                     f"{100 * c['overlap']:.0f}"])
    return cm.fmt_table(["pairs", "conc/pair", "loads/s", "scaling", "pair loads/s p50", "lat p50 ms",
                         "lat p99 ms", "D cpu ms/load", "P cpu ms/load", "engines cpu ms/load", "overlap %"],
                        rows, markdown)


def goal_line(res: dict) -> str:
    """``8 pairs >= 6x 1 pair: met/NOT met (x.xx)``, or why it was not measured."""
    head = f"goal {res['goal_pairs']} pairs >= {res['goal_scaling']:g}x 1 pair"
    if res["scaling_at_goal"] is None:
        return f"{head}: not measured (--pairs must include 1 and {res['goal_pairs']})"
    return f"{head}: {'met' if res['goal_met'] else 'NOT met'} ({res['scaling_at_goal']:.2f})"


def main(argv: list[str] | None = None) -> int:
    """Benchmark 4b (``python -m benchmarks.pairs``): runs :func:`run`, prints
    the table and the goal line, writes ``--json``. Returns 0."""
    ap = argparse.ArgumentParser(description="kvd benchmark 4b: N engine pairs (processes) on one daemon pair, "
                                             "aggregate one-block loads/s and scaling")
    ap.add_argument("--pairs", default=",".join(map(str, PAIRS)), help="numbers of engine pairs (default 1,2,4,8)")
    ap.add_argument("--concurrency", type=int, default=CONCURRENCY, help="loads in flight per pair (default 64)")
    ap.add_argument("--total-concurrency", type=int, default=0,
                    help="loads in flight over all pairs, split evenly (overrides --concurrency)")
    ap.add_argument("--block-len", default="4K", help="block length (default 4K; K/M suffixes)")
    ap.add_argument("--reps", type=int, default=10, help="timed batches per pair (default 10)")
    ap.add_argument("--hold-ahead-ms", type=float, default=HOLD_AHEAD_S * 1e3,
                    help=f"each batch's holds go out this long before its loads (default {HOLD_AHEAD_S * 1e3:g})")
    ap.add_argument("--poll-us", type=float, default=50.0, help="the engines' completion poll interval (default 50)")
    ap.add_argument("--daemon-arg", action="append", default=[], metavar="FLAG", help="extra `kvd serve` flag (repeat)")
    ap.add_argument("--daemon-set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="change a module default in the daemons first (benchmarks.daemon_entry)")
    ap.add_argument("--json", default="", metavar="FILE", help="write the results here")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    pairs = [int(x) for x in args.pairs.split(",")]
    units = {"K": cm.KiB, "M": cm.MiB}
    bl = args.block_len.upper().removesuffix("IB").removesuffix("B")
    block_len = int(bl[:-1]) * units[bl[-1]] if bl[-1] in units else int(bl)
    cleanup_segments(cm.SHM_PREFIX)
    info = cm.machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load average {info['loadavg_start']}", flush=True)
    if info["cores"] and max(pairs) + 2 > info["cores"]:
        print(f"note: up to {max(pairs)} engine processes and 2 daemons on {info['cores']} cores: the pairs "
              f"compete with the daemons for CPU", flush=True)
    res = run(pairs, args.concurrency, args.total_concurrency, block_len, args.reps, args.poll_us * 1e-6,
              args.hold_ahead_ms * 1e-3, args.daemon_arg, args.daemon_set, progress=not args.no_progress)
    res["machine"] = info
    res["command"] = " ".join(["python -m benchmarks.pairs", *(argv if argv is not None else sys.argv[1:])])
    print(f"{cm.fmt_bytes(block_len)} one-block loads, {args.reps} batches per pair, holds "
          f"{args.hold_ahead_ms:g} ms ahead; load average {res['loadavg_start']} -> {res['loadavg_end']}")
    print(table(res))
    print(goal_line(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
