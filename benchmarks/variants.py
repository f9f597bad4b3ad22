"""Side-by-side A/B of daemon variants (how docs/PERFORMANCE.md chose the
defaults): one pair of daemons per variant, all on the same two segments,
every case run on every variant in turn (rotating order), plus plain NIXL (b)
as the reference. Idle variants are paused (SIGSTOP) while another runs.

A variant is a list of module defaults set before the daemon starts
(``benchmarks.daemon_entry``), environment variables, and/or another
checkout whose daemon code runs (``tree:DIR``: a before/after of a code
change in one interleaved run; the engine side is this checkout's), e.g.::

    python -m benchmarks.variants \\
        --variant 'thread-1ms=' \\
        --variant 'no-thread=kvd.core.nixl_agent.PROGRESS_US=0' \\
        --variant 'thread-10ms=kvd.core.nixl_agent.PROGRESS_US=10000' \\
        --variant 'tls-no-sm=env:UCX_TLS=cma,tcp,self' \\
        --variant 'before=tree:/tmp/kvd-before'
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from benchmarks.daemon_entry import entry
from kvd.bench import common as cm
from kvd.testing.shm import ShmSegment, cleanup_segments
from benchmarks.dataplane import parse_sizes
from kvd.bench.kvd_pair import HOLD_AHEAD_S, KvdPair
from kvd.bench.throughput import kvd_batch
from kvd.bench.nixl_pair import NixlPair, PeerConfig


def parse_variant(spec: str) -> tuple[str, list[str], dict, str]:
    """``"NAME=SET;SET;env:K=V;tree:DIR"`` -> ``(name, module-default
    assignments for benchmarks.daemon_entry, environment, checkout or "")``."""
    name, _, rest = spec.partition("=")
    sets, env, tree = [], {}, ""
    for item in filter(None, rest.split(";")):
        if item.startswith("env:"):
            k, _, v = item[4:].partition("=")
            env[k] = v
        elif item.startswith("tree:"):
            tree = item[5:]
        else:
            sets.append(item)
    return name, sets, env, tree


def run(variants: list[str], cells: list[tuple[int, int, int]], reps: int, poll_s: float = 50e-6,
        peer_cfg: PeerConfig | None = None, progress: bool = True, idle_s: float = 3.0,
        hold_ahead_s: float = HOLD_AHEAD_S) -> dict:
    """``cells``: (block_len, blocks, concurrency). Returns per variant and cell the
    per-request latencies (engine view) and batch walls; a batch's holds go out
    ``hold_ahead_s`` before its loads (``kvd.bench.kvd_pair``; 0: each with its load)."""
    specs = [parse_variant(v) for v in variants]
    seg = max(bl * n * 2 for bl, n, _ in cells)
    src, dst = ShmSegment(seg, cm.SHM_PREFIX), ShmSegment(seg, cm.SHM_PREFIX)
    src.fill(11)
    wd = cm.workdir()
    pairs: dict[str, KvdPair] = {}
    nixl = None
    rng = np.random.default_rng(5)
    load0 = cm.loadavg()
    out = {"benchmark": "variants", "variants": variants, "reps": reps, "poll_us": poll_s * 1e6,
           "hold_ahead_ms": hold_ahead_s * 1e3, "cells": []}
    prog = cm.Progress(total=len(cells) * reps, title="variants", enabled=progress)
    try:
        for i, (name, sets, env, tree) in enumerate(specs):
            pairs[name] = KvdPair(f"{wd}", (src.name, seg), (dst.name, seg), env=env or None,
                                  entry=entry(sets, tree=tree), prefix=f"v{i}-")
            pairs[name].pause(True)
        nixl = NixlPair(src.name, seg, dst.name, seg, peer_cfg or PeerConfig(num_threads=0, pthr_delay_us=1000))
        nixl.pause(True)

        def only(which: str) -> None:
            """Pauses (SIGSTOP) every variant and plain NIXL but ``which``."""
            for n, p in pairs.items():
                p.pause(n != which)
            nixl.pause(which != "(b)")

        # idle CPU of each variant's daemons, workers registered and handshaken
        idle = {}
        for bl in sorted({c[0] for c in cells}):
            for name, p in pairs.items():
                only(name)
                rid = p.start(bl, [0], [1])  # held: a reader claims the source's hold first
                p.wait(bl, {rid}, poll_s)
                p.drain_sources()
        for name, p in pairs.items():
            only(name)
            time.sleep(0.3)
            c0 = (cm.cpu_seconds(p.p.pid), cm.cpu_seconds(p.d.pid))
            time.sleep(idle_s)
            idle[name] = {"P": 100 * (cm.cpu_seconds(p.p.pid) - c0[0]) / idle_s,
                          "D": 100 * (cm.cpu_seconds(p.d.pid) - c0[1]) / idle_s}
        out["idle_cpu_pct"] = idle
        names = list(pairs) + ["(b)"]
        for bl, n, conc in cells:
            nsrc = seg // bl
            ids = [(rng.permutation(nsrc)[:n].tolist(), rng.permutation(nsrc)[:n].tolist()) for _ in range(conc)]
            lat = {k: [] for k in names}
            wall = {k: [] for k in names}
            cpu = {k: [0.0, 0.0] for k in pairs}  # CPU seconds of P and D during the timed batches
            for r in range(reps + 2):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    only(name)
                    if name == "(b)":
                        key = nixl.prep(bl, nsrc)
                        times = nixl.read_many(key, [(l, rm, b"v") for l, rm in ids], poll_s)
                        res_l, res_w = times, max(times)
                    else:
                        p = pairs[name]
                        c0 = (cm.cpu_seconds(p.p.pid), cm.cpu_seconds(p.d.pid))
                        res_w, res_l = kvd_batch(p, bl, ids, conc, poll_s, hold_ahead_s=hold_ahead_s)
                        p.drain_sources()
                        if r >= 2:
                            cpu[name][0] += cm.cpu_seconds(p.p.pid) - c0[0]
                            cpu[name][1] += cm.cpu_seconds(p.d.pid) - c0[1]
                    if r >= 2:  # two warm-up rounds
                        lat[name].extend(res_l)
                        wall[name].append(res_w)
                if r >= 2:
                    prog.step(f"{cm.fmt_bytes(bl)} x {n} x {conc}")
            cell = {"block_len": bl, "blocks": n, "concurrency": conc, "bytes": bl * n * conc, "by": {}}
            for k in names:
                cell["by"][k] = dict(p50_ms=cm.pct(lat[k], 50) * 1e3, p90_ms=cm.pct(lat[k], 90) * 1e3,
                                     p99_ms=cm.pct(lat[k], 99) * 1e3, wall_ms=cm.median(wall[k]) * 1e3,
                                     gbs=bl * n * conc / cm.median(wall[k]) / 1e9,
                                     over_b=cm.median([b / a for a, b in zip(wall[k], wall["(b)"])]))
                if k in cpu:  # per load, microseconds (the daemons' CPU includes their idle loops)
                    cell["by"][k].update(cpu_us_per_load_P=cpu[k][0] / (reps * conc) * 1e6,
                                         cpu_us_per_load_D=cpu[k][1] / (reps * conc) * 1e6)
            out["cells"].append(cell)
    finally:
        prog.close()
        for p in pairs.values():
            p.pause(False)
            p.close()
        if nixl is not None:
            nixl.close()
        src.close()
        dst.close()
        cm.remove_workdir(wd)
    out.update(loadavg_start=load0, loadavg_end=cm.loadavg())
    return out


def table(res: dict, markdown: bool = False) -> str:
    """The variants' results as a text (or ``markdown``) table: latency
    p50/p90/p99 (ms), GB/s and plain-NIXL time over the variant's, per cell,
    with idle CPU (% of a core)."""
    rows = []
    for c in res["cells"]:
        for k, v in c["by"].items():
            cpu = (f"{v['cpu_us_per_load_P']:.0f} / {v['cpu_us_per_load_D']:.0f}" if "cpu_us_per_load_P" in v
                   else "")
            rows.append([f"{cm.fmt_bytes(c['block_len'])} x {c['blocks']} x {c['concurrency']}", k,
                         f"{v['p50_ms']:.3f}", f"{v['p90_ms']:.3f}", f"{v['p99_ms']:.3f}", f"{v['gbs']:.2f}",
                         f"{v['over_b']:.2f}", cpu])
    t = cm.fmt_table(["case (block x blocks x concurrent)", "variant", "p50 ms", "p90 ms", "p99 ms", "GB/s",
                      "(b) time / this", "CPU us/load P / D"], rows, markdown)
    idle = res.get("idle_cpu_pct", {})
    if idle:
        t += "\nidle CPU, % of a core: " + "; ".join(f"{k}: P {v['P']:.1f}, D {v['D']:.1f}" for k, v in idle.items())
    return t


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.variants``: parses ``--variant`` and ``--cells``
    (``block_len:blocks:concurrency``), runs :func:`run`, prints the table,
    writes ``--json``. Returns 0."""
    ap = argparse.ArgumentParser(description="A/B of kvd daemon variants, side by side")
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=SET;SET;env:K=V")
    ap.add_argument("--cells", default="64K:16:1,64K:256:1,64K:4096:1,4K:100:8",
                    help="block_len:blocks:concurrency, comma-separated")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--poll-us", type=float, default=50.0)
    ap.add_argument("--hold-ahead-ms", type=float, default=HOLD_AHEAD_S * 1e3,
                    help="a batch's holds go out this long before its loads (default %(default)g; 0: each with "
                         "its load, timed)")
    ap.add_argument("--json", default="")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    cells = []
    for c in args.cells.split(","):
        bl, n, conc = c.split(":")
        cells.append((parse_sizes(bl)[0], int(n), int(conc)))
    cleanup_segments(cm.SHM_PREFIX)
    res = run(args.variant, cells, args.reps, args.poll_us * 1e-6, progress=not args.no_progress,
              hold_ahead_s=args.hold_ahead_ms / 1e3)
    res["machine"] = cm.machine()
    res["command"] = " ".join(["python -m benchmarks.variants", *(argv if argv is not None else sys.argv[1:])])
    print(table(res))
    print(f"load average {res['loadavg_start']} -> {res['loadavg_end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
