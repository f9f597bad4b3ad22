"""Benchmark 1, data plane: (a) two kvd daemons vs (b) two plain NIXL
processes vs (c) memcpy, at full size (``kvd bench`` runs a short version of
the same code, :mod:`kvd.bench.dataplane`).

    .venv/bin/python -m benchmarks.dataplane [--quick] [--block-lens 4K,64K] [--blocks 1,16] [--json FILE]

Also the options benchmarks 1, 3 and 4 share (:func:`add_common_args`).
See docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.daemon_entry import entry
from kvd.bench import common as cm
from kvd.bench.dataplane import (BLOCK_LENS, BLOCKS, MAX_BYTES, QUICK_BLOCK_LENS, QUICK_BLOCKS, QUICK_MAX_BYTES,
                                 cells_for, goals, run, table)
from kvd.bench.nixl_pair import PeerConfig
from kvd.testing.shm import cleanup_segments


def parse_sizes(s: str) -> list[int]:
    """Comma-separated sizes with optional K/KiB/M/MiB suffixes (binary) -> bytes;
    ``"4K,1M"`` -> ``[4096, 1048576]``. Raises ValueError on a bad number."""
    out = []
    for x in s.split(","):
        x = x.strip().upper()
        mult = 1
        for suf, m in (("KIB", cm.KiB), ("MIB", cm.MiB), ("K", cm.KiB), ("M", cm.MiB)):
            if x.endswith(suf):
                x, mult = x[: -len(suf)], m
                break
        out.append(int(float(x) * mult))
    return out


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """Adds the options benchmarks 1 and 3 share: poll interval (us), the plain
    NIXL side's progress-thread settings, daemon flags and module defaults,
    environment, ``--json`` and ``--no-progress``."""
    ap.add_argument("--poll-us", type=float, default=50.0,
                    help="completion poll interval of the engine side in (a) and the reader in (b) (default 50)")
    ap.add_argument("--nixl-prog-thread", choices=("on", "off"), default="on",
                    help="(b): NIXL progress thread (vLLM's NixlConnector: on)")
    ap.add_argument("--nixl-num-threads", type=int, default=4, help="(b): UCX backend threads (vLLM: 4)")
    ap.add_argument("--nixl-pthr-delay-us", type=int, default=0,
                    help="(b): progress thread poll() timeout (NIXL's Python API: 0, a spinning thread)")
    ap.add_argument("--daemon-arg", action="append", default=[], metavar="FLAG",
                    help="extra `kvd serve` flag for (a)'s daemons (repeat; e.g. --daemon-arg=--log-level=info)")
    ap.add_argument("--daemon-set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="(a)'s daemons: change a module default first (benchmarks.daemon_entry), e.g. "
                         "kvd.core.nixl_agent.PROGRESS_US=0")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for (a)'s daemons and (b)'s processes (e.g. UCX_TLS=...)")
    ap.add_argument("--json", default="", metavar="FILE", help="write the results here")
    ap.add_argument("--no-progress", action="store_true")


def peer_cfg_from(args) -> PeerConfig:
    """The plain-NIXL processes' ``PeerConfig`` from the parsed common options."""
    env = dict(e.split("=", 1) for e in args.env)
    return PeerConfig(prog_thread=args.nixl_prog_thread == "on", num_threads=args.nixl_num_threads,
                      pthr_delay_us=args.nixl_pthr_delay_us, env=env)


def main(argv: list[str] | None = None) -> int:
    """Benchmark 1 (``python -m benchmarks.dataplane``): (a) kvd vs (b) plain NIXL vs (c)
    memcpy over the cells, with the goals (a)/(b) >= 0.97 for blocks >= 64 KiB
    and (a)/(c) >= 0.7; prints the table, writes ``--json``. Returns 0."""
    ap = argparse.ArgumentParser(description="kvd benchmark 1: data plane, (a) kvd vs (b) plain NIXL vs (c) memcpy")
    ap.add_argument("--quick", action="store_true", help="a short run (seconds)")
    ap.add_argument("--block-lens", default="", help="comma-separated, e.g. 4K,64K,1M (default 4K..4M)")
    ap.add_argument("--blocks", default="", help="blocks per request, e.g. 1,16,256,4096")
    ap.add_argument("--max-mib", type=int, default=0, help="skip cells above this many MiB per request (default 256)")
    ap.add_argument("--reps", type=int, default=0, help="rounds (default 7, quick 3)")
    add_common_args(ap)
    args = ap.parse_args(argv)
    bls = parse_sizes(args.block_lens) if args.block_lens else (QUICK_BLOCK_LENS if args.quick else BLOCK_LENS)
    blocks = [int(x) for x in args.blocks.split(",")] if args.blocks else (QUICK_BLOCKS if args.quick else BLOCKS)
    max_bytes = args.max_mib * cm.MiB if args.max_mib else (QUICK_MAX_BYTES if args.quick else MAX_BYTES)
    reps = args.reps or (3 if args.quick else 7)
    cleanup_segments(cm.SHM_PREFIX)
    info = cm.machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load average {info['loadavg_start']}", flush=True)
    res = run(cells_for(bls, blocks, max_bytes), reps, args.poll_us * 1e-6, peer_cfg_from(args),
              args.daemon_arg, dict(e.split("=", 1) for e in args.env) or None, progress=not args.no_progress,
              entry=entry(args.daemon_set))
    res["daemon_set"] = args.daemon_set
    res["machine"] = info
    res["command"] = " ".join(["python -m benchmarks.dataplane", *(argv if argv is not None else sys.argv[1:])])
    print(table(res))
    g = goals(res)
    res["goals"] = g
    print(f"(a)/(b) for blocks >= 64 KiB: min {g['a_over_b_min_ge64k']:.2f}, median {g['a_over_b_median_ge64k']:.2f}"
          f" ({g['a_over_b_cells_met']} cells >= 0.97); (a)/(c) >= 0.7 in {g['a_over_c_cells_met']} cells")
    print(f"load average {res['loadavg_start']} -> {res['loadavg_end']}, {res['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
