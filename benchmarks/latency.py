"""Benchmark 3, completion latency of a small request (16 x 64 KiB): kvd vs plain NIXL.

One command; see `--help` and docs/PERFORMANCE.md. The code is in
kvd/bench/ (`kvd bench` runs a short version).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvd.bench.dataplane import latency_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(latency_main())
