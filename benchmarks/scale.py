"""Benchmark 4, scale: throughput and latency with 1, 8 and 64 concurrent
requests, 1 to 10,000 blocks per request, 1 to 16 remote peers; the daemons'
resident memory apart from the registered segments.

One decode worker on daemon D loads from ``peers`` prefill workers on daemon
P (each its own NIXL agent: to D, ``peers`` remote agents, handshakes,
prepped descriptor lists). A batch posts ``concurrency`` loads at once
(request ``i`` from peer ``i % peers``) and waits for all of them; figures are
medians over rounds. For one peer, the same batch is also run between two
plain NIXL processes (all transfers posted back to back, polled together):
(b) as in benchmark 1.

RSS: ``RssAnon + RssFile`` of each daemon (``/proc/<pid>/status``), i.e.
without the shared-memory pages of the registered KV segments.
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
from kvd.bench.kvd_pair import KvdPair
from kvd.bench.nixl_pair import NixlPair, PeerConfig
from kvd.bench.throughput import kvd_batch, nixl_batch

BLOCK_LEN = 4 * cm.KiB
BLOCKS = [1, 100, 1000, 10000]
CONCURRENCY = [1, 8, 64]
PEERS = [1, 4, 16]


def run(block_len: int = BLOCK_LEN, blocks=BLOCKS, concurrency=CONCURRENCY, peers=PEERS, reps: int = 3,
        poll_s: float = 50e-6, peer_cfg: PeerConfig | None = None, daemon_args=(), daemon_env=None,
        progress: bool = True, with_b: bool = True, daemon_set=()) -> dict:
    """Benchmark 4: for each (peers, concurrency, blocks per request) cell,
    ``reps`` rounds of ``concurrency`` concurrent kvd loads of ``block_len``-byte
    blocks (and plain NIXL with one peer unless ``with_b`` is False). Returns
    a dict: per-case wall time (ms), GB/s, latency p50/p99 (ms), us per block;
    daemon RSS without shm (MiB) after each case; idle CPU (% of a core)."""
    load0 = cm.loadavg()
    t_start = time.time()
    nblocks = max(blocks)
    seg = nblocks * block_len * 2
    src, dst = ShmSegment(seg, cm.SHM_PREFIX), ShmSegment(seg, cm.SHM_PREFIX)
    src.fill(7)
    wd = cm.workdir()
    kvd = nixl = None
    rng = np.random.default_rng(3)
    cases = []
    rss = {"P": [], "D": []}
    cells = [(p, c, b) for p in peers for c in concurrency for b in blocks]
    prog = cm.Progress(total=len(cells) * reps, title="scale", enabled=progress)
    try:
        kvd = KvdPair(wd, (src.name, seg), (dst.name, seg), tuple(daemon_args), env=daemon_env,
                      entry=entry(daemon_set))
        if with_b:
            nixl = NixlPair(src.name, seg, dst.name, seg, peer_cfg or PeerConfig())
            nixl.pause(True)
        rss["P"].append(("start", cm.rss_excluding_shm_mib(kvd.p.pid)))
        rss["D"].append(("start", cm.rss_excluding_shm_mib(kvd.d.pid)))
        for npeers, conc, nb in cells:
            ids = [(rng.permutation(seg // block_len)[:nb].tolist(), rng.permutation(seg // block_len)[:nb].tolist())
                   for _ in range(min(conc, 8))]
            tags = [f"-peer{i}" for i in range(npeers)]
            for t in tags:  # handshakes and first use, untimed
                rid = kvd.start(block_len, ids[0][0], ids[0][1], tag=t)  # held: readers claim holds
                kvd.wait(block_len, {rid}, poll_s)
            walls, lat, bwalls, blat = [], [], [], []
            for r in range(reps):
                kvd.pause(False)
                wall, times = kvd_batch(kvd, block_len, ids, conc, poll_s, tags)
                walls.append(wall)
                lat.extend(times)
                if nixl is not None and npeers == 1:
                    kvd.pause(True)
                    nixl.pause(False)
                    wall, times = nixl_batch(nixl, block_len, seg, ids, conc, poll_s)
                    bwalls.append(wall)
                    blat.extend(times)
                    nixl.pause(True)
                    kvd.pause(False)
                prog.step(f"{npeers} peers, {conc} x {nb} blocks")
            kvd.drain_sources()
            total = conc * nb * block_len
            wall = cm.median(walls)
            case = dict(peers=npeers, concurrency=conc, blocks=nb, bytes=total, wall_ms=wall * 1e3,
                        gbs=total / wall / 1e9, lat_p50_ms=cm.pct(lat, 50) * 1e3, lat_p99_ms=cm.pct(lat, 99) * 1e3,
                        us_per_block=wall / (conc * nb) * 1e6)
            if bwalls:
                bw = cm.median(bwalls)
                case.update(b_wall_ms=bw * 1e3, b_gbs=total / bw / 1e9, b_lat_p50_ms=cm.pct(blat, 50) * 1e3,
                            b_lat_p99_ms=cm.pct(blat, 99) * 1e3,
                            a_over_b=cm.median([b / a for a, b in zip(walls, bwalls)]))
            cases.append(case)
            rss["P"].append((f"{npeers}p {conc}c {nb}b", cm.rss_excluding_shm_mib(kvd.p.pid)))
            rss["D"].append((f"{npeers}p {conc}c {nb}b", cm.rss_excluding_shm_mib(kvd.d.pid)))
        st = {k: cm.proc_status(getattr(kvd, k.lower()).pid) for k in ("P", "D")}
        # Idle CPU with every worker registered (P: one per peer, each its own NIXL agent).
        kvd.pause(False)
        time.sleep(0.5)
        c0 = {k: cm.cpu_seconds(getattr(kvd, k.lower()).pid) for k in ("P", "D")}
        time.sleep(3.0)
        idle = {k: 100 * (cm.cpu_seconds(getattr(kvd, k.lower()).pid) - c0[k]) / 3.0 for k in ("P", "D")}
        workers = {"P": len(kvd._sources), "D": len(kvd._readers)}
    finally:
        prog.close()
        cm.close_pairs(nixl, kvd)
        src.close()
        dst.close()
        cm.remove_workdir(wd)
    return dict(benchmark="scale", block_len=block_len, reps=reps, poll_us=poll_s * 1e6, cases=cases,
                rss_mib=rss, rss_max_mib={k: max(v for _, v in rss[k]) for k in rss},
                proc_status_end_kib=st, idle_cpu_pct=idle, workers=workers, daemon_args=list(daemon_args), daemon_set=list(daemon_set), daemon_env=daemon_env or {},
                seconds=time.time() - t_start, loadavg_start=load0, loadavg_end=cm.loadavg())


def table(res: dict, markdown: bool = False) -> str:
    """Benchmark 4's cases as a text (or ``markdown``) table, with the daemons'
    maximum RSS (MiB) and idle CPU."""
    rows = []
    for c in res["cases"]:
        rows.append([c["peers"], c["concurrency"], c["blocks"], cm.fmt_bytes(c["bytes"]), f"{c['wall_ms']:.1f}",
                     f"{c['gbs']:.2f}", f"{c['lat_p50_ms']:.2f}", f"{c['lat_p99_ms']:.2f}",
                     f"{c['us_per_block']:.2f}",
                     f"{c['b_wall_ms']:.1f}" if "b_wall_ms" in c else "", f"{c['a_over_b']:.2f}" if "a_over_b" in c else ""])
    t = cm.fmt_table(["peers", "conc", "blocks/req", "bytes", "wall ms", "GB/s", "lat p50 ms", "lat p99 ms",
                      "us/block", "(b) wall ms", "a/b"], rows, markdown)
    m = res["rss_max_mib"]
    t += f"\ndaemon RSS without registered memory, max over the run: P {m['P']:.0f} MiB, D {m['D']:.0f} MiB"
    if "idle_cpu_pct" in res:
        i, w = res["idle_cpu_pct"], res["workers"]
        t += (f"\nidle CPU at the end, % of a core: P {i['P']:.1f} ({w['P']} workers), "
              f"D {i['D']:.1f} ({w['D']} worker)")
    return t


def main(argv: list[str] | None = None) -> int:
    """Benchmark 4 (``python -m benchmarks.scale``): runs :func:`run`, prints the table and
    the RSS <= 200 MB goal, writes ``--json``. Returns 0."""
    ap = argparse.ArgumentParser(description="kvd benchmark 4: scale (concurrency, blocks per request, peers, RSS)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--blocks", default="", help="blocks per request (default 1,100,1000,10000)")
    ap.add_argument("--concurrency", default="", help="default 1,8,64")
    ap.add_argument("--peers", default="", help="default 1,4,16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-b", action="store_true", help="skip the plain-NIXL comparison")
    from benchmarks.dataplane import add_common_args, peer_cfg_from

    add_common_args(ap)
    args = ap.parse_args(argv)
    ints = lambda s, d: [int(x) for x in s.split(",")] if s else d  # noqa: E731
    q = args.quick
    cleanup_segments(cm.SHM_PREFIX)
    info = cm.machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load average {info['loadavg_start']}", flush=True)
    res = run(BLOCK_LEN, ints(args.blocks, [1, 100] if q else BLOCKS), ints(args.concurrency, [1, 8] if q else CONCURRENCY),
              ints(args.peers, [1, 2] if q else PEERS), args.reps, args.poll_us * 1e-6, peer_cfg_from(args),
              args.daemon_arg, dict(e.split("=", 1) for e in args.env) or None, progress=not args.no_progress,
              with_b=not args.no_b, daemon_set=args.daemon_set)
    res["machine"] = info
    res["command"] = " ".join(["python -m benchmarks.scale", *(argv if argv is not None else sys.argv[1:])])
    print(table(res))
    ok = max(res["rss_max_mib"].values()) <= 200
    print(f"goal RSS <= 200 MB: {'met' if ok else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
