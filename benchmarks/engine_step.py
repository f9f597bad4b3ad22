"""Benchmark 2, the shim's cost per engine step with 0, 16 and 256 loads in
flight, at full size (``kvd bench`` runs a short version of the same code,
:mod:`kvd.bench.step`).

    .venv/bin/python -m benchmarks.engine_step [--quick] [--inflight 0,16,256] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.daemon_entry import entry
from kvd.bench import common as cm
from kvd.bench.step import _vllm, goals, run, table


def main(argv: list[str] | None = None) -> int:
    """Benchmark 2 (``python -m benchmarks.engine_step``): runs :func:`run`, prints the
    table and the p50 <= 30 us / p99 <= 200 us goals, writes ``--json``.
    Returns 0, or 2 without vLLM."""
    ap = argparse.ArgumentParser(description="kvd benchmark 2: the shim's cost per engine step")
    ap.add_argument("--quick", action="store_true", help="a short run (seconds)")
    ap.add_argument("--inflight", default="0,16,256", help="loads kept in flight (comma-separated)")
    ap.add_argument("--steps", type=int, default=0, help="timed steps per case (default 400, quick 60)")
    ap.add_argument("--forward-ms", type=float, default=5.0, help="the simulated forward pass (default 5 ms)")
    ap.add_argument("--daemon-arg", action="append", default=[], metavar="FLAG")
    ap.add_argument("--daemon-set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="change a daemon module default first (benchmarks.daemon_entry)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment for the daemons")
    ap.add_argument("--json", default="")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        _vllm()
    except ImportError as e:
        print(f"benchmark 2 needs vLLM (pip install -e '.[vllm]'): {e}", file=sys.stderr)
        return 2
    steps = args.steps or (60 if args.quick else 400)
    res = run([int(x) for x in args.inflight.split(",")], steps=steps, warmup=10 if args.quick else 30,
              forward_s=args.forward_ms / 1e3, unary_n=50 if args.quick else 300, progress=not args.no_progress,
              daemon_args=args.daemon_arg, daemon_env=dict(e.split("=", 1) for e in args.env) or None,
              entry=entry(args.daemon_set))
    res["daemon_set"] = args.daemon_set
    res["machine"] = cm.machine()
    res["command"] = " ".join(["python -m benchmarks.engine_step", *(argv if argv is not None else sys.argv[1:])])
    print(table(res))
    g = goals(res)
    res["goals"] = g
    print(f"goal p50 <= 30 us and p99 <= 200 us: loads held in flight: {'met' if g['held_met'] else 'NOT met'}; "
          f"with loads starting and ending every step: {'met' if g['met'] else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
