"""Does NIXL's ``transfer()`` release the GIL while it moves shared-memory bytes?

    .venv/bin/python -m benchmarks.gil_transfer [--mib 256] [--reps 3] [--json FILE]

Two NIXL agents in this process (UCX, DRAM), one READ of ``--mib`` MiB from
one buffer into the other, while a Python thread counts in a loop: the
count during each ``transfer()`` call against the count during a sleep as
long says how much of the call ran with the GIL released (a count near the
sleep's: released; near 0: held). ``kvd.core.limits.Bounds.inline_post_max_bytes``
rests on it: a READ posted on the daemon's event loop instead of its NIXL
thread blocks the loop for the whole call either way, and on the NIXL
thread the loop keeps running during it only if the GIL is released.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np


def run(mib: int, reps: int) -> list[dict]:
    """Times ``reps`` READs of ``mib`` MiB; returns per READ the seconds in
    ``transfer()``, the seconds to DONE, and the counting thread's count
    during ``transfer()`` and during a sleep of the same length."""
    from nixl._api import nixl_agent, nixl_agent_config

    n = mib << 20
    a = nixl_agent("gil-a", nixl_agent_config(backends=["UCX"]))
    b = nixl_agent("gil-b", nixl_agent_config(backends=["UCX"]))
    src, dst = np.ones(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)
    a.register_memory([(dst.ctypes.data, n, 0, "")], "DRAM")
    b.register_memory([(src.ctypes.data, n, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    local = a.get_xfer_descs([(dst.ctypes.data, n, 0)], "DRAM")
    remote = b.get_xfer_descs([(src.ctypes.data, n, 0)], "DRAM")
    count, stop = [0], [False]

    def spin() -> None:
        while not stop[0]:
            count[0] += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    out = []
    try:
        for _ in range(reps):
            h = a.initialize_xfer("READ", local, remote, "gil-b", b"gil")
            c0, t0 = count[0], time.perf_counter()
            state = a.transfer(h)
            t1, c1 = time.perf_counter(), count[0]
            while state == "PROC":
                state = a.check_xfer_state(h)
            t2 = time.perf_counter()
            a.release_xfer_handle(h)
            c2 = count[0]
            time.sleep(t1 - t0)
            out.append({"transfer_s": t1 - t0, "done_s": t2 - t0, "count_in_transfer": c1 - c0,
                        "count_in_sleep": count[0] - c2, "state": state})
    finally:
        stop[0] = True
        t.join()
    if not (dst == 1).all():
        raise RuntimeError("the READ did not move the bytes")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="MiB per READ (default 256)")
    ap.add_argument("--reps", type=int, default=3, help="READs (default 3; the first pays UCX's wire-up)")
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args()
    rows = run(args.mib, args.reps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "gil_transfer", "mib": args.mib, "reads": rows}, f, indent=1)
    for r in rows:
        print(f"transfer() {r['transfer_s'] * 1e3:8.1f} ms, DONE after {r['done_s'] * 1e3:8.1f} ms; "
              f"counter {r['count_in_transfer']:>10,} during it, {r['count_in_sleep']:>10,} in a sleep as long")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
