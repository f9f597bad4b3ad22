"""Benchmark 6, same-node copy: both engines on one kvd daemon (the daemon
copies the blocks itself, ``kvd.core.local_copy``) against a single-thread
memcpy of the same blocks, and against two daemons.

    .venv/bin/python -m benchmarks.same_node [--block-lens 64K] [--blocks 16,256,1024,4096] [--reps 7] [--with-daemons]

Cases of :mod:`kvd.bench.dataplane`, interleaved in one run: (s) one daemon,
a prefill and a decode worker on it, timed from the engine's ``load()`` to
``recv_done`` in its poll; (m) one ``memmove`` per block in this process (kvd's
native row copy on one thread, one call, where it was built),
the single-thread memcpy of the same blocks; (c) ``numpy.take`` of them;
with ``--with-daemons`` also (a), two daemons and NIXL. The goal is
(s)/(m) >= 0.8. ``kvd bench`` runs (s) and (m) in its short run too. See
docs/PERFORMANCE.md, section 6.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.daemon_entry import entry
from benchmarks.dataplane import parse_sizes
from kvd.bench import common as cm
from kvd.bench import dataplane
from kvd.testing.shm import cleanup_segments


def main(argv: list[str] | None = None) -> int:
    """Runs the cells, prints :func:`kvd.bench.dataplane.same_node_table` and
    the goal, writes ``--json``. Returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-lens", default="64K", help="comma-separated, e.g. 4K,64K,1M")
    ap.add_argument("--blocks", default="16,256,1024,4096", help="blocks per request")
    ap.add_argument("--max-mib", type=int, default=256, help="skip cells above this many MiB per request")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--with-daemons", action="store_true", help="also (a): two daemons, NIXL")
    ap.add_argument("--poll-us", type=float, default=50.0, help="the engine's completion poll interval")
    ap.add_argument("--daemon-set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="change a module constant in the daemons first (benchmarks.daemon_entry)")
    ap.add_argument("--json", default="", metavar="FILE")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    cleanup_segments(cm.SHM_PREFIX)
    info = cm.machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load average {info['loadavg_start']}", flush=True)
    cells = dataplane.cells_for(parse_sizes(args.block_lens), [int(x) for x in args.blocks.split(",")],
                                args.max_mib * cm.MiB)
    res = dataplane.run(cells, args.reps, args.poll_us * 1e-6, progress=not args.no_progress, title="same node",
                        methods="smca" if args.with_daemons else "smc", entry=entry(args.daemon_set))
    res.update(benchmark="same_node", machine=info, same_node_setup=dataplane.same_node_setup(),
               command=" ".join(["python -m benchmarks.same_node", *(argv if argv is not None else sys.argv[1:])]))
    setup = res["same_node_setup"]
    print(f"(s): the daemon copies on {setup['daemon_copy_threads']} thread(s) (its defaults); (m): {setup['m']}")
    print(dataplane.same_node_table(res))
    sm = [c["s_over_m"] for c in res["cells"]]
    print(f"goal (s)/(m) >= 0.8: {sum(x >= 0.8 for x in sm)}/{len(sm)} cells; "
          f"load average {res['loadavg_start']} -> {res['loadavg_end']}, {res['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
