"""Throughput of concurrent loads: batches of ``concurrency`` loads posted at
once, through one P and one D daemon (:class:`kvd.bench.kvd_pair.KvdPair`)
and between two plain NIXL processes (:class:`kvd.bench.nixl_pair.NixlPair`,
all READs posted back to back and polled together).

A batch's wall time runs from the first post to the last completion; loads/s
is ``concurrency / wall``. The goal (docs/PERFORMANCE.md): >= 10,000
one-block loads/s with 64 in flight. Benchmark 4 (``benchmarks.scale``) runs
the same batches over more shapes and peers.
"""

from __future__ import annotations

import time

import numpy as np

from kvd.bench import common as cm
from kvd.bench.kvd_pair import HOLD_AHEAD_S, KvdPair
from kvd.bench.nixl_pair import NixlPair, PeerConfig
from kvd.testing.shm import ShmSegment

BLOCK_LEN = 4 * cm.KiB  # as benchmark 4
CONCURRENCY = 64
GOAL_LOADS_S = 10_000.0


def kvd_batch(kvd: KvdPair, block_len: int, ids: list[tuple[list[int], list[int]]], concurrency: int,
              poll_s: float, tags=("",), hold_ahead_s: float = 0.0) -> tuple[float, list[float]]:
    """Posts ``concurrency`` kvd loads at once (load ``i`` uses
    ``ids[i % len(ids)]`` = (local, remote) block ids and the source worker
    ``tags[i % len(tags)]``) and waits for all; their holds go out
    ``hold_ahead_s`` before the first load (0: each with its load, timed;
    ``kvd.bench.kvd_pair``). Returns (wall seconds from the first post to the
    last ``recv_done``, each load's seconds from its post)."""
    held = []
    if hold_ahead_s > 0:
        held = [kvd.hold(block_len, ids[i % len(ids)][1], tags[i % len(tags)]) for i in range(concurrency)]
        time.sleep(hold_ahead_s)
    t0 = time.perf_counter()
    started = {}
    for i in range(concurrency):
        loc, rem = ids[i % len(ids)]
        tag = tags[i % len(tags)]
        rid = kvd.load(block_len, loc, rem, held[i], tag) if held else kvd.start(block_len, loc, rem, tag=tag)
        started[rid] = time.perf_counter()
    done = kvd.wait(block_len, set(started), poll_s)
    return max(done.values()) - t0, [done[k] - started[k] for k in started]


def nixl_batch(nixl: NixlPair, block_len: int, seg_bytes: int, ids: list[tuple[list[int], list[int]]],
               concurrency: int, poll_s: float) -> tuple[float, list[float]]:
    """The same batch as :func:`kvd_batch` between two plain NIXL processes
    (segments of ``seg_bytes``). Returns (wall seconds, each READ's seconds
    from the first post to its DONE)."""
    key = nixl.prep(block_len, seg_bytes // block_len)
    times = nixl.read_many(key, [(*ids[i % len(ids)], b"s") for i in range(concurrency)], poll_s)
    return max(times), times


def segments(concurrency: int, block_len: int, blocks: int) -> tuple[ShmSegment, ShmSegment, list]:
    """The source and destination shm segments of batches of ``concurrency``
    loads of ``blocks`` blocks of ``block_len`` bytes (the source filled),
    and the block ids of the batches' loads: ``(local, remote)`` lists, 8
    pairs at most (load ``i`` uses pair ``i % 8``), the same every run."""
    seg = max(64, 2 * concurrency * blocks) * block_len
    src, dst = ShmSegment(seg, cm.SHM_PREFIX), ShmSegment(seg, cm.SHM_PREFIX)
    src.fill(7)
    rng = np.random.default_rng(3)
    nb = seg // block_len
    ids = [(rng.permutation(nb)[:blocks].tolist(), rng.permutation(nb)[:blocks].tolist())
           for _ in range(min(concurrency, 8))]
    return src, dst, ids


def run(reps: int, concurrency: int = CONCURRENCY, block_len: int = BLOCK_LEN, blocks: int = 1,
        poll_s: float = 50e-6, progress: bool = True, title: str = "(3) throughput",
        hold_ahead_s: float = HOLD_AHEAD_S) -> dict:
    """``reps`` interleaved rounds of one batch of ``concurrency`` loads of
    ``blocks`` blocks of ``block_len`` bytes, kvd (one P, one D daemon)
    then plain NIXL, each alone (the other pair paused: an idle NIXL agent
    spins a core). Returns a dict: median loads/s of each (``kvd_loads_s``,
    ``plain_loads_s``), their median per-round ratio ``kvd_over_plain``,
    latency p50/p99 (ms), raw walls (s) and whether the goal is met."""
    src, dst, ids = segments(concurrency, block_len, blocks)
    seg = src.size
    wd = cm.workdir()
    kvd = nixl = None
    walls, lat, bwalls, blat = [], [], [], []
    prog = cm.Progress(total=reps + 1, title=title, enabled=progress)
    t_start = time.time()
    try:
        kvd = KvdPair(wd, (src.name, seg), (dst.name, seg))
        nixl = NixlPair(src.name, seg, dst.name, seg, PeerConfig())
        for r in range(reps + 1):  # round 0: handshake and first use, untimed
            nixl.pause(True)
            kvd.pause(False)
            w, ls = kvd_batch(kvd, block_len, ids, concurrency, poll_s, hold_ahead_s=hold_ahead_s)
            kvd.drain_sources()
            kvd.pause(True)
            nixl.pause(False)
            bw, bls = nixl_batch(nixl, block_len, seg, ids, concurrency, poll_s)
            if r:
                walls.append(w)
                lat.extend(ls)
                bwalls.append(bw)
                blat.extend(bls)
                label = (f"round {r}/{reps}: kvd {concurrency / w:,.0f}, plain {concurrency / bw:,.0f} loads/s")
            else:
                label = "warm-up"
            prog.step(label)
    finally:
        prog.close()
        cm.close_pairs(nixl, kvd)
        src.close()
        dst.close()
        cm.remove_workdir(wd)
    a, b = concurrency / cm.median(walls), concurrency / cm.median(bwalls)
    return dict(concurrency=concurrency, block_len=block_len, blocks=blocks, reps=reps, poll_us=poll_s * 1e6,
                hold_ahead_ms=hold_ahead_s * 1e3,
                kvd_loads_s=a, plain_loads_s=b, kvd_over_plain=cm.median([bw / w for w, bw in zip(walls, bwalls)]),
                kvd_lat_p50_ms=cm.pct(lat, 50) * 1e3, kvd_lat_p99_ms=cm.pct(lat, 99) * 1e3,
                plain_lat_p50_ms=cm.pct(blat, 50) * 1e3, plain_lat_p99_ms=cm.pct(blat, 99) * 1e3,
                kvd_wall_s=walls, plain_wall_s=bwalls, goal_loads_s=GOAL_LOADS_S, goal_met=a >= GOAL_LOADS_S,
                seconds=time.time() - t_start)


def text(res: dict) -> str:
    """The throughput figures and the goal line, as printed by ``kvd bench``."""
    c, bl = res["concurrency"], cm.fmt_bytes(res["block_len"])
    return (f"    kvd (one P, one D daemon): {res['kvd_loads_s']:,.0f} loads/s (latency p50 "
            f"{res['kvd_lat_p50_ms']:.2f} ms, p99 {res['kvd_lat_p99_ms']:.2f} ms)\n"
            f"    plain NIXL processes:      {res['plain_loads_s']:,.0f} loads/s (latency p50 "
            f"{res['plain_lat_p50_ms']:.2f} ms, p99 {res['plain_lat_p99_ms']:.2f} ms)\n"
            f"    kvd/plain {res['kvd_over_plain']:.3f}\n"
            f"    goal >= {res['goal_loads_s']:,.0f} one-block loads/s with {c} in flight ({bl} blocks): "
            f"{'met' if res['goal_met'] else 'NOT met'} ({res['kvd_loads_s']:,.0f} loads/s)")
