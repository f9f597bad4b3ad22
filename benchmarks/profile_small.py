"""Small loads through two kvd daemons (or one: ``--same-node``), for a profiler to attach to.

    .venv/bin/python benchmarks/profile_small.py --mode latency --seconds 40 --pidfile /tmp/pids.json

Starts daemons P and D (``kvd serve``, or ``benchmarks/profile_entry.py`` with
``--telemetry``), registers one engine worker on each with the real
``EngineClient`` (as benchmarks 1 and 3 do), writes the pids of P, D and this
process (the engine side) to ``--pidfile`` once warm, then loads for
``--seconds``:

- ``latency``: 16 x 64 KiB loads, polled every 50 us, 10 ms apart
  (benchmark 3's kvd case, and ``benchmarks.trace``'s loop);
- ``dataplane``: 1 x 64 KiB and 16 x 64 KiB loads alternating, back to back
  (benchmark 1's two smallest cells from 64 KiB blocks up);
- ``concurrent``: ``--inflight`` one-block loads started at once, all
  waited for, again (the throughput goal's case; times are per batch).

Prints (and with ``--json`` writes) each size's p50/p90 and the load average;
with ``--telemetry`` also the median of NIXL's per-transfer telemetry in D.
``benchmarks/profile.sh`` runs it under py-spy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

from kvd.bench import common as cm
from kvd.bench.kvd_pair import KvdPair
from kvd.testing.shm import ShmSegment, cleanup_segments

BLOCK = 64 * cm.KiB


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("latency", "dataplane", "concurrent"), default="latency")
    ap.add_argument("--inflight", type=int, default=64, help="loads per batch in --mode concurrent")
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--pidfile", default="")
    ap.add_argument("--telemetry", action="store_true")
    ap.add_argument("--random-ids", action="store_true",
                    help="random, unordered source block ids (as benchmarks 1 and 3) instead of 16..16+n")
    ap.add_argument("--same-node", action="store_true",
                    help="one daemon, both engine workers on it (a same-node copy; its pid is written as P and D)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    cleanup_segments(cm.SHM_PREFIX)
    size = 4 * cm.MiB
    src, dst = ShmSegment(size, cm.SHM_PREFIX), ShmSegment(size, cm.SHM_PREFIX)
    src.fill(3)
    wd = cm.workdir()
    entry = (str(Path(__file__).resolve().parent / "profile_entry.py"), *(["--telemetry"] if args.telemetry else []))
    pair = KvdPair(wd, (src.name, size), (dst.name, size), entry=entry, same_node=args.same_node)
    sizes = {"latency": (16,), "dataplane": (1, 16), "concurrent": (1,)}[args.mode]
    times: dict[int, list[float]] = {n: [] for n in sizes}
    load0 = cm.loadavg()
    try:
        import random

        rnd = random.Random(1)
        nsrc = size // BLOCK
        remote_ids = {n: (rnd.sample(range(nsrc), n) if args.random_ids else list(range(16, 16 + n))) for n in sizes}

        def one(n: int) -> float:
            if args.mode == "concurrent":  # a batch of one-block loads, source blocks 16.., local 0..
                t0 = time.perf_counter()
                rids = {pair.start(BLOCK, [i % nsrc], [16 + i % (nsrc - 16)]) for i in range(args.inflight)}
                dt = max(pair.wait(BLOCK, rids, 50e-6).values()) - t0
            else:
                dt = pair.transfer(BLOCK, list(range(n)), remote_ids[n], 50e-6)
            pair.drain_sources()
            return dt

        for i in range(20):
            one(sizes[i % len(sizes)])
        if args.pidfile:
            with open(args.pidfile + ".tmp", "w") as f:
                json.dump(dict(P=pair.p.pid, D=pair.d.pid, client=os.getpid()), f)
            os.replace(args.pidfile + ".tmp", args.pidfile)
        deadline = time.monotonic() + args.seconds
        i = 0
        while time.monotonic() < deadline:
            n = sizes[i % len(sizes)]
            times[n].append(one(n) * 1e3)
            i += 1
            if args.mode == "latency":
                time.sleep(0.01)
    finally:
        pair.close()
        src.close()
        dst.close()
        with open(f"{wd}/{'S' if args.same_node else 'D'}.log") as f:
            dlog = f.read()
        cm.remove_workdir(wd)
    res = dict(mode=args.mode, seconds=args.seconds, random_ids=args.random_ids, loadavg_start=load0, loadavg_end=cm.loadavg(),
               loads={str(n): dict(count=len(t), p50_ms=statistics.median(t), p90_ms=cm.pct(t, 90))
                      for n, t in times.items() if t})
    if args.telemetry:
        rows = [dict(zip(("make_us", "transfer_us", "post_us", "xfer_us", "descs", "bytes"),
                         (float(m.group(1)), float(m.group(2)), float(m.group(4)), float(m.group(5)),
                          int(m.group(6)), int(m.group(7)))), state=m.group(3))
                for m in re.finditer(r"TELEM make_us (\S+) transfer_us (\S+) state (\S+) start \S+ post_us (\S+) "
                                     r"xfer_us (\S+) descs (\S+) bytes (\S+)", dlog)]
        by_bytes: dict[int, list[dict]] = {}
        for r in rows:
            by_bytes.setdefault(r["bytes"], []).append(r)
        res["telemetry"] = {str(b): dict(count=len(rs), done_at_post=sum(r["state"] == "DONE" for r in rs),
                                         **{f"{k}_p50": statistics.median(r[k] for r in rs)
                                            for k in ("make_us", "transfer_us", "post_us", "xfer_us", "descs")},
                                         **{f"{k}_p90": cm.pct([r[k] for r in rs], 90)
                                            for k in ("make_us", "transfer_us", "post_us", "xfer_us")})
                            for b, rs in sorted(by_bytes.items())}
        errs = re.findall(r"TELEM error (.*)", dlog)
        if errs:
            res["telemetry_errors"] = errs[:3]
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
