"""What a new NIXL agent's first ``add_remote_agent`` costs, with and without
the warm-up the daemon does at registration (``NixlAgent.warm_up``: load and
forget a probe agent).

Per pair: two agents, each with ``--mib`` MiB of memfd memory registered
(DRAM, UCX), then one agent loads the other's metadata; the time of that
call is the first contact's ``add_remote`` phase (the handshake log line of
``kvd.core.peers``). Pairs alternate cold/warm, in one process::

    .venv/bin/python -m benchmarks.agent_warm_up --pairs 16

Prints the median and range per variant in milliseconds; results in
docs/PERFORMANCE.md ("First contact").
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvd.core.nixl_agent import NixlAgent  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=16, help="agent pairs, alternating cold and warm (default 16)")
    ap.add_argument("--mib", type=int, default=1024, help="MiB registered per agent (default 1024)")
    args = ap.parse_args(argv)
    size = args.mib << 20
    keep = []  # agents and their memory stay alive until the end

    def agent(name: str, warm: bool) -> NixlAgent:
        a = NixlAgent(name, ["UCX"])
        fd = os.memfd_create(name)
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
        os.close(fd)
        view = np.frombuffer(m, dtype=np.uint8)
        a.register_dram(view.ctypes.data, size)
        if warm:
            a.warm_up()
        keep.append((a, m, view))
        return a

    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.pairs):
        warm = bool(i % 2)
        a, b = agent(f"bench-a{i}-{os.getpid()}", warm), agent(f"bench-b{i}-{os.getpid()}", warm)
        t0 = time.perf_counter()
        a.add_remote(b.metadata())
        times[warm].append(1e3 * (time.perf_counter() - t0))
    for warm, v in times.items():
        print(f"{'warm (warm_up at registration)' if warm else 'cold':32s} first add_remote_agent: median "
              f"{statistics.median(v):7.1f} ms, range {min(v):.1f}-{max(v):.1f} ms ({len(v)} pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
