"""Where the time of one small load goes: engine -> daemon -> NIXL -> engine.

    .venv/bin/python -m benchmarks.trace [--blocks 16] [--block-len 64K] [--reps 50]

Starts two daemons (``--same-node``: one, both engines on it: a same-node
copy, whose ``POST``/``POSTED`` mark the copy) with a tracing entry (``benchmarks.daemon_entry --trace``:
a :mod:`kvd.tracepoints` sink), times loads from the engine side
(``EngineClient.load`` -> ``recv_done`` in ``drain_events``) and joins each
with the decode daemon's trace points: bytes at the engine socket's gate
(``GATE_IN``), the session reader's command (``SESSION_READ``), the core's
load (``LOAD``), the NIXL post (``POST``, ``POSTED`` with its state), the
event (``EVENT``) and its bytes leaving the gate (``GATE_OUT``). Clocks are
CLOCK_MONOTONIC in both processes. Prints the median of each leg.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time

from benchmarks.daemon_entry import entry as daemon_entry
from benchmarks.dataplane import parse_sizes
from kvd import tracepoints as tp
from kvd.bench import common as cm
from kvd.bench.kvd_pair import HOLD_AHEAD_S, KvdPair
from kvd.testing.shm import ShmSegment

LEGS = (("engine -> daemon core (command: client thread, command socket or gRPC + relay, session reader)", "t0",
         "load"),
        ("part: engine: load() -> command built by the client's sender thread", "t0", "sent"),
        ("part: client send -> bytes at the daemon (command socket, or the gRPC stream's gate)", "sent", "gatein"),
        ("part: frames parsed (or gate relay + daemon gRPC server) -> session reader has the command", "gatein",
         "read"),
        ("part: session reader -> Node.load runs", "read", "load"),
        ("daemon: checks, plan, hand-off to the post", "load", "post"),
        ("part: checks, remote workers, plan -> claim sent", "load", "claim"),
        ("part: claim on the source's hold (PeerService.Claim round trip, or a direct call)", "claim", "claimed"),
        ("part: claim answered -> the post starts (on the NIXL thread, or on the loop for a small READ)", "claimed",
         "post"),
        ("move: NIXL post (UCX: CMA), or the same-node copy", "post", "posted"),
        ("daemon: completion -> event built", "posted", "event"),
        ("daemon -> engine (event: command socket or gRPC + relay, client thread, 50 us poll)", "event", "t1"),
        ("part: event built -> its bytes written (command socket, or the gate after gRPC)", "event", "gateout"),
        ("part: client receive (socket, or gate relay + gRPC) -> client's session thread has the event", "gateout",
         "recv"),
        ("part: session thread -> engine's poll (drain_events, 50 us poll)", "recv", "t1"),
        ("total, as the engine sees it", "t0", "t1"))


def _client_stamps() -> tuple[dict, dict]:
    """Times (perf_counter) at which this process's EngineClient built each
    load's command (sender thread, ``SENT``) and received its recv_done
    (session thread, ``RECEIVED``): a :mod:`kvd.tracepoints` sink in this
    process."""
    sent, recv = {}, {}

    def sink(point: str, request_id: str, detail: str, t: float) -> None:
        if point == tp.SENT:
            sent.setdefault(request_id, t)
        elif point == tp.RECEIVED and detail == "recv_done":
            recv.setdefault(request_id, t)

    tp.install(sink)
    return sent, recv


def _hits(log: str) -> dict[str, list[tuple[str, str, float]]]:
    """The daemon log's ``HIT`` lines (:func:`benchmarks.daemon_entry.print_hits`)
    by point: ``[(request id, detail, perf_counter seconds)]``."""
    out: dict[str, list] = {}
    for m in re.finditer(r"^HIT (\S+) (\S+) (\S+) (\S+)$", log, re.M):
        rid, detail = (None if x == "-" else x for x in m.group(2, 3))
        out.setdefault(m.group(1), []).append((rid or "", detail or "", float(m.group(4))))
    return out


def _first_after(times: list[float], t: float) -> float | None:
    import bisect

    i = bisect.bisect_right(times, t)
    return times[i] if i < len(times) else None


def run(block_len: int, blocks: int, reps: int, poll_s: float = 50e-6, daemon_set=(),
        same_node: bool = False, hold_ahead_s: float = HOLD_AHEAD_S) -> dict:
    """Times ``reps`` loads of ``blocks`` blocks of ``block_len`` bytes (after 5
    untimed; each hold sent ``hold_ahead_s`` before its load, 0: with it,
    ``kvd.bench.kvd_pair``) through two tracing daemons (``same_node``: one) and joins the
    engine's and the decode daemon's timestamps. Returns a dict: per-leg
    median and p90 (ms), and how many moves (READs, copies) were done when
    their post returned."""
    size = max(4 * cm.MiB, 4 * block_len * blocks)
    src, dst = ShmSegment(size, cm.SHM_PREFIX), ShmSegment(size, cm.SHM_PREFIX)
    src.fill(3)
    wd = cm.workdir()
    pair = KvdPair(wd, (src.name, size), (dst.name, size), entry=daemon_entry(daemon_set, trace=True),
                   same_node=same_node)
    engine = {}
    sent, recv = _client_stamps()
    try:
        local, remote = list(range(blocks)), list(range(blocks, 2 * blocks))
        for i in range(reps + 5):
            rid, t0 = pair.timed_start(block_len, local, remote, hold_ahead_s)
            t1 = pair.wait(block_len, {rid}, poll_s)[rid]
            pair.drain_sources()
            if i >= 5:
                engine[rid] = (t0, t1)
            time.sleep(0.01)
    finally:
        tp.install(None)
        pair.close()
        src.close()
        dst.close()
        with open(f"{wd}/{'S' if same_node else 'D'}.log") as f:
            log = f.read()
        cm.remove_workdir(wd)
    hits = _hits(log)
    unnamed = {p: sorted(t for _, _, t in hits.get(p, [])) for p in (tp.GATE_IN, tp.GATE_OUT)}
    by_rid = {p: {} for p in (tp.SESSION_READ, tp.LOAD, tp.POST, tp.POSTED, tp.EVENT)}
    claims = {p: {} for p in (tp.CLAIM, tp.CLAIMED)}  # absent on a same-node copy's path
    for p, named in {**by_rid, **claims}.items():
        for rid, detail, t in hits.get(p, []):
            named.setdefault(rid, []).append((t, detail))
    rows = []
    states = []
    for rid, (t0, t1) in engine.items():
        if rid not in sent or rid not in recv or not all(rid in by_rid[p] for p in by_rid):
            continue
        posted_t, state = by_rid[tp.POSTED][rid][-1]  # the last post's return (the transfer that completed)
        t = dict(t0=t0, t1=t1, sent=sent[rid], recv=recv[rid], read=by_rid[tp.SESSION_READ][rid][0][0],
                 load=by_rid[tp.LOAD][rid][0][0], post=by_rid[tp.POST][rid][-1][0], posted=posted_t,
                 event=by_rid[tp.EVENT][rid][-1][0])
        t["claim"] = claims[tp.CLAIM].get(rid, [(t["load"], "")])[-1][0]
        t["claimed"] = claims[tp.CLAIMED].get(rid, [(t["claim"], "")])[-1][0]
        t["gatein"] = _first_after(unnamed[tp.GATE_IN], t["sent"])
        t["gateout"] = _first_after(unnamed[tp.GATE_OUT], t["event"])
        if None in t.values():
            continue
        states.append(state)
        rows.append({name: (t[b] - t[a]) * 1e3 for name, a, b in LEGS})
    return dict(benchmark="trace", block_len=block_len, blocks=blocks, reps=len(rows), same_node=same_node,
                hold_ahead_ms=hold_ahead_s * 1e3,
                done_at_post=sum(s in ("DONE", "COPIED") for s in states),
                legs_ms={name: statistics.median(r[name] for r in rows) for name, _, _ in LEGS} if rows else {},
                legs_p90_ms={name: cm.pct([r[name] for r in rows], 90) for name, _, _ in LEGS} if rows else {})


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.trace``: runs :func:`run`, prints the legs, writes ``--json``. Returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-len", default="64K")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--daemon-set", action="append", default=[])
    ap.add_argument("--same-node", action="store_true", help="one daemon, both engines on it (a same-node copy)")
    ap.add_argument("--hold-ahead-ms", type=float, default=HOLD_AHEAD_S * 1e3,
                    help="each hold is sent this long before its load (default %(default)g; 0: with it)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    load0 = cm.loadavg()
    res = run(parse_sizes(args.block_len)[0], args.blocks, args.reps, daemon_set=args.daemon_set,
              same_node=args.same_node, hold_ahead_s=args.hold_ahead_ms / 1e3)
    res.update(loadavg_start=load0, loadavg_end=cm.loadavg(), machine=cm.machine(),
               command=" ".join(["python -m benchmarks.trace", *(argv if argv is not None else sys.argv[1:])]))
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
