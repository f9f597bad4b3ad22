"""Where the time of one small load goes: engine -> daemon -> NIXL -> engine.

    .venv/bin/python -m kvd.bench.trace [--blocks 16] [--block-len 64K] [--reps 50]

Starts two daemons (``--same-node``: one) with a tracing entry
(``kvd.bench.daemon_entry --trace``), times loads from the engine side
(``EngineClient.load`` -> ``recv_done`` in ``drain_events``) and joins each
with the trace points (``kvd.tracepoints``) of the engine client and of the
decode daemon: bytes at the gate, the session reader, the core's load, the
post (or the same-node copy: start, end, state), the event and its bytes
out. Clocks are CLOCK_MONOTONIC in both processes. Prints the median of each leg.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time

from kvd.bench import common as cm
from kvd.testing.shm import ShmSegment
from kvd.bench.dataplane import parse_sizes
from kvd.bench.kvd_pair import KvdPair

LEGS = (("engine -> daemon core (command: client thread, gRPC, relay, session reader)", "t0", "load"),
        ("part: engine: load() -> command built by the client's sender thread", "t0", "sent"),
        ("part: client gRPC send -> bytes at the daemon's gate", "sent", "gatein"),
        ("part: gate relay + daemon gRPC server -> session reader has the command", "gatein", "read"),
        ("part: session reader -> the core's load runs", "read", "load"),
        ("daemon: checks, plan, hand-off to the NIXL thread", "load", "post"),
        ("move: NIXL post (UCX: CMA), or the same-node copy", "post", "posted"),
        ("daemon: completion -> event built", "posted", "event"),
        ("daemon -> engine (event: gRPC, relay, client thread, 50 us poll)", "event", "t1"),
        ("part: event built -> its bytes at the gate (daemon gRPC server)", "event", "gateout"),
        ("part: gate relay + client gRPC receive -> client's session thread has the event", "gateout", "recv"),
        ("part: session thread -> engine's poll (drain_events, 50 us poll)", "recv", "t1"),
        ("total, as the engine sees it", "t0", "t1"))


def _client_stamps() -> tuple[dict, dict]:
    """Times (perf_counter) at which this process's EngineClient built each
    load's command (sender thread, ``tracepoints.SENT``) and received each
    event (session thread, ``tracepoints.RECEIVED``)."""
    from kvd import tracepoints as tp

    sent, recv = {}, {}

    def sink(point: str, request_id: str, detail: str, t: float) -> None:
        if point == tp.SENT:
            sent.setdefault(request_id, t)
        elif point == tp.RECEIVED and detail == "recv_done":
            recv.setdefault(request_id, t)

    tp.install(sink)
    return sent, recv


def _first_after(times: list[float], t: float) -> float | None:
    import bisect

    i = bisect.bisect_right(times, t)
    return times[i] if i < len(times) else None


def daemon_points(log: str) -> tuple[dict, dict]:
    """The ``TP`` lines of a tracing daemon's log (``kvd.bench.daemon_entry``):
    ``(by point: sorted times of hits without a request id, by (point,
    request id): [(time, detail), ...])``."""
    bare: dict[str, list[float]] = {}
    named: dict[tuple[str, str], list[tuple[float, str]]] = {}
    for m in re.finditer(r"^TP (\S+) (\S+) (\S+) (\S+)$", log, re.M):
        point, t, rid, detail = m.group(1), float(m.group(2)), m.group(3), m.group(4)
        if rid == "-":
            bare.setdefault(point, []).append(t)
        else:
            named.setdefault((point, rid), []).append((t, detail))
    for v in bare.values():
        v.sort()
    return bare, named


def run(block_len: int, blocks: int, reps: int, poll_s: float = 50e-6, daemon_set=(), same_node: bool = False) -> dict:
    """Times ``reps`` loads of ``blocks`` blocks of ``block_len`` bytes (after 5
    untimed) through two tracing daemons (``same_node``: one, both engines on
    it) and joins the engine's and the decode daemon's trace points. Returns a
    dict: per-leg median and p90 (ms), and how many moves were done when
    their post returned."""
    size = max(4 * cm.MiB, 4 * block_len * blocks)
    src, dst = ShmSegment(size, cm.SHM_PREFIX), ShmSegment(size, cm.SHM_PREFIX)
    src.fill(3)
    wd = cm.workdir()
    entry = ("-m", "kvd.bench.daemon_entry", "--trace", *[x for a in daemon_set for x in ("--set", a)])
    pair = KvdPair(wd, (src.name, size), (dst.name, size), entry=entry, same_node=same_node)
    engine = {}
    sent, recv = _client_stamps()
    try:
        local, remote = list(range(blocks)), list(range(blocks, 2 * blocks))
        for i in range(reps + 5):
            t0 = time.perf_counter()
            rid = pair.start(block_len, local, remote)
            t1 = pair.wait(block_len, {rid}, poll_s)[rid]
            pair.drain_sources()
            if i >= 5:
                engine[rid] = (t0, t1)
            time.sleep(0.01)
    finally:
        pair.close()  # the daemons write their trace points as they exit
        src.close()
        dst.close()
        with open(f"{wd}/{'S' if same_node else 'D'}.log") as f:
            log = f.read()
        cm.remove_workdir(wd)
    from kvd import tracepoints as tp

    tp.install(None)
    bare, named = daemon_points(log)
    rows, states = [], []
    for rid, (t0, t1) in engine.items():
        pts = {p: named.get((p, rid)) for p in (tp.SESSION_READ, tp.LOAD, tp.POST, tp.POSTED, tp.EVENT)}
        if None in pts.values() or rid not in sent or rid not in recv:
            continue
        t = dict(t0=t0, t1=t1, sent=sent[rid], recv=recv[rid], read=pts[tp.SESSION_READ][0][0],
                 load=pts[tp.LOAD][0][0], post=pts[tp.POST][0][0], posted=pts[tp.POSTED][-1][0],
                 event=pts[tp.EVENT][0][0])
        t["gatein"] = _first_after(bare.get(tp.GATE_IN, []), t["sent"])
        t["gateout"] = _first_after(bare.get(tp.GATE_OUT, []), t["event"])
        if None in t.values():
            continue
        states.append(pts[tp.POSTED][-1][1])
        rows.append({name: (t[b] - t[a]) * 1e3 for name, a, b in LEGS})
    return dict(benchmark="trace", block_len=block_len, blocks=blocks, reps=len(rows), same_node=same_node,
                done_at_post=sum(s in ("DONE", "COPIED") for s in states),
                legs_ms={name: statistics.median(r[name] for r in rows) for name, _, _ in LEGS} if rows else {},
                legs_p90_ms={name: cm.pct([r[name] for r in rows], 90) for name, _, _ in LEGS} if rows else {})


def main(argv: list[str] | None = None) -> int:
    """``python -m kvd.bench.trace``: runs :func:`run`, prints the legs, writes ``--json``. Returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-len", default="64K")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--daemon-set", action="append", default=[])
    ap.add_argument("--same-node", action="store_true", help="one daemon, both engines on it (a same-node copy)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    load0 = cm.loadavg()
    res = run(parse_sizes(args.block_len)[0], args.blocks, args.reps, daemon_set=args.daemon_set,
              same_node=args.same_node)
    res.update(loadavg_start=load0, loadavg_end=cm.loadavg(), machine=cm.machine(),
               command=" ".join(["python -m kvd.bench.trace", *(argv if argv is not None else sys.argv[1:])]))
    rows = [[name, f"{res['legs_ms'][name]:.3f}", f"{res['legs_p90_ms'][name]:.3f}"] for name, _, _ in LEGS]
    print(cm.fmt_table(["leg", "p50 ms", "p90 ms"], rows))
    print(f"{res['done_at_post']}/{res['reps']} moves were done when their post returned; "
          f"load average {load0} -> {res['loadavg_end']}")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
