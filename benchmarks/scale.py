"""Benchmark 4, scale: 1/8/64 concurrent requests, 1..10,000 blocks per
request, 1..16 remote peers; daemon RSS without registered memory.

One command; see `--help` and docs/PERFORMANCE.md. The code is in
kvd/bench/scale.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvd.bench.scale import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
