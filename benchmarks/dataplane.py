"""Benchmark 1, data plane: (a) two kvd daemons vs (b) two plain NIXL processes vs (c) memcpy.

One command; see `--help` and docs/PERFORMANCE.md. The code is in
kvd/bench/ (`kvd bench` runs a short version).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvd.bench.dataplane import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
