"""Benchmark 2, engine-step cost of the shim with 0, 16, 256 loads in flight
(vLLM's real scheduler, real daemons), and a blocking unary gRPC for reference.

One command; see `--help` and docs/PERFORMANCE.md. The code is in
kvd/bench/step.py (`kvd bench` runs a short version).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvd.bench.step import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
