"""Same-node copy: both engines on one kvd daemon vs a single-thread memcpy (and two daemons).

One command; see `--help` and docs/PERFORMANCE.md ("Same-node copy"). The
code is in kvd/bench/same_node.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvd.bench.same_node import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
