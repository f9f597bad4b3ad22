"""What the hold claim costs a load: a one-block load's latency, command sent
to RecvDone, across two daemons (the reader asks the source's daemon,
PeerService.Claim) and within one daemon (answered by a direct call), and
one PeerService.Claim call alone.

Run it on this tree and on a tree without claims (``PYTHONPATH=<tree>``) to
compare::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/claim_cost.py --loads 400

Prints medians and 90th percentiles in milliseconds; results in
docs/SECURITY.md ("What a claim costs").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvd.testing.daemons import start_daemon, stop_daemons  # noqa: E402
from kvd.testing.sessions import Engine, KvShape, event_kind  # noqa: E402

SHAPE = KvShape(num_layers=4, num_blocks=64, block_len=4096)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def loads(src: Engine, dst: Engine, n: int, tag: str) -> list[float]:
    """``n`` sequential one-block loads (ms each), every one of a held request."""
    out = []
    for i in range(n):
        rid = f"{tag}-{i}"
        src.hold(rid, [i % SHAPE.num_blocks], lease_s=60)
        t0 = time.perf_counter()
        dst.load(rid, [i % SHAPE.num_blocks], src, [i % SHAPE.num_blocks], rid, timeout_s=10)
        ev = dst.wait(rid, 20)
        out.append((time.perf_counter() - t0) * 1e3)
        assert event_kind(ev) == "recv_done", ev
        src.wait(rid, 20)
    return out


async def claims(address: str, engine_id: str, n: int) -> list[float]:
    """``n`` PeerService.Claim calls (ms each) for a held request."""
    from kvd.daemon.peer_client import PeerClient

    client = PeerClient()
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            await client.claim(address, engine_id, 0, "claimed", [[1]], 0.0, 5.0)
            out.append((time.perf_counter() - t0) * 1e3)
    finally:
        await client.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", type=int, default=400, help="loads per case")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kvd-claim-")
    a, b = start_daemon(work, "a"), start_daemon(work, "b")
    engines = []
    try:
        src = Engine(a, "src", SHAPE, seed=1)
        near = Engine(a, "near", SHAPE)
        far = Engine(b, "far", SHAPE)
        engines = [src, near, far]
        loads(src, far, 20, "warm-far")
        loads(src, near, 20, "warm-near")
        rows = {"across daemons": loads(src, far, args.loads, "far"),
                "one daemon": loads(src, near, args.loads, "near")}
        try:
            src.hold("claimed", [1], lease_s=600)
            rows["Claim call alone"] = asyncio.run(claims(a.peer_address, "src", args.loads))
        except (ImportError, AttributeError) as e:
            print(f"(no PeerService.Claim in this tree: {e})")
        for name, xs in rows.items():
            print(f"{name:18s} n={len(xs):4d}  median {statistics.median(xs):6.3f} ms  p90 {_pct(xs, 0.9):6.3f} ms")
    finally:
        for e in engines:
            e.close()
        stop_daemons([a, b])
    return 0


if __name__ == "__main__":
    sys.exit(main())
