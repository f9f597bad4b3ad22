"""Benchmark 3, completion latency of a small request: (a) kvd vs (b) plain
NIXL, and the idle CPU of both.

    .venv/bin/python -m benchmarks.latency [--block-len 64K] [--blocks 16] [--reps 200] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from benchmarks.daemon_entry import entry
from benchmarks.dataplane import add_common_args, parse_sizes, peer_cfg_from
from kvd.bench import common as cm
from kvd.bench.dataplane import Bench, Cell
from kvd.bench.nixl_pair import PeerConfig
from kvd.testing.shm import cleanup_segments


def latency(block_len: int = 64 * cm.KiB, blocks: int = 16, reps: int = 200, poll_s: float = 50e-6,
            peer_cfg: PeerConfig | None = None, daemon_args=(), daemon_env=None, progress: bool = True,
            daemon_set=()) -> dict:
    """Benchmark 3: completion latency of one small request, (a) vs (b), ``reps``
    times each, alternating; from ``load`` (start_load_kv) to ``recv_done`` in
    the engine's poll (get_finished), and for (b) from post to DONE."""
    cell = Cell(block_len, blocks)
    load0 = cm.loadavg()
    t_start = time.time()
    bench = Bench(max(cell.nbytes * 4, 4 * cm.MiB), poll_s, peer_cfg or PeerConfig(), daemon_args, daemon_env,
                  entry=entry(daemon_set))
    prog = cm.Progress(total=reps + 10, title="latency", enabled=progress)
    try:
        bench.verify(cell, "a")
        bench.verify(cell, "b")
        for i in range(10):  # warm-up
            bench.run_a(cell)
            bench.run_b(cell)
            prog.step("warm-up")
        idle = bench.idle_cpu()
        for i in range(reps):
            for m in ("ab" if i % 2 == 0 else "ba"):
                getattr(cell, m).append(getattr(bench, f"run_{m}")(cell))
            if i % 10 == 9:
                prog.step(f"{i + 1}/{reps}", 10)
    finally:
        prog.close()
        bench.close()
    q = lambda xs, p: cm.pct(xs, p) * 1e3  # noqa: E731
    return dict(benchmark="latency", block_len=block_len, blocks=blocks, bytes=cell.nbytes, reps=reps,
                poll_us=poll_s * 1e6, peer_config=asdict(peer_cfg or PeerConfig()), daemon_args=list(daemon_args),
                daemon_env=daemon_env or {}, daemon_set=list(daemon_set),
                a_p50_ms=q(cell.a, 50), a_p90_ms=q(cell.a, 90), a_p99_ms=q(cell.a, 99),
                b_p50_ms=q(cell.b, 50), b_p90_ms=q(cell.b, 90), b_p99_ms=q(cell.b, 99),
                a_over_b_p50=cm.pct(cell.a, 50) / cm.pct(cell.b, 50),
                a_over_b_paired=cm.median([a / b for a, b in zip(cell.a, cell.b) if b > 0]),
                a_s=cell.a, b_s=cell.b, idle_cpu_pct=idle, seconds=time.time() - t_start, loadavg_start=load0,
                loadavg_end=cm.loadavg())


def latency_table(res: dict, markdown: bool = False) -> str:
    """Benchmark 3's result as a table of p50/p90/p99 ms for (a) kvd and (b)
    plain NIXL, the kvd / NIXL ratio at p50 and the idle CPU (% of a core)."""
    rows = [["(a) kvd", f"{res['a_p50_ms']:.3f}", f"{res['a_p90_ms']:.3f}", f"{res['a_p99_ms']:.3f}"],
            ["(b) plain NIXL", f"{res['b_p50_ms']:.3f}", f"{res['b_p90_ms']:.3f}", f"{res['b_p99_ms']:.3f}"]]
    return cm.fmt_table(["path", "p50 ms", "p90 ms", "p99 ms"], rows, markdown) + (
        f"\nkvd / plain NIXL at p50: {res['a_over_b_p50']:.2f}x (paired median {res['a_over_b_paired']:.2f}x)"
        f"\nidle CPU, % of a core: " + ", ".join(f"{k} {v:.1f}" for k, v in res.get("idle_cpu_pct", {}).items()))


def main(argv: list[str] | None = None) -> int:
    """Benchmark 3 (``python -m benchmarks.latency``): completion latency of a small
    request, kvd vs plain NIXL; prints the table and the <= 1.5x goal, writes
    ``--json``. Returns 0."""
    ap = argparse.ArgumentParser(description="kvd benchmark 3: completion latency of a small request, kvd vs plain NIXL")
    ap.add_argument("--block-len", default="64K")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--reps", type=int, default=200)
    add_common_args(ap)
    args = ap.parse_args(argv)
    cleanup_segments(cm.SHM_PREFIX)
    info = cm.machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load average {info['loadavg_start']}", flush=True)
    res = latency(parse_sizes(args.block_len)[0], args.blocks, args.reps, args.poll_us * 1e-6, peer_cfg_from(args),
                  args.daemon_arg, dict(e.split("=", 1) for e in args.env) or None, progress=not args.no_progress,
                  daemon_set=args.daemon_set)
    res["machine"] = info
    res["command"] = " ".join(["python -m benchmarks.latency", *(argv if argv is not None else sys.argv[1:])])
    print(latency_table(res))
    print(f"goal <= 1.5x: {'met' if res['a_over_b_p50'] <= 1.5 else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
