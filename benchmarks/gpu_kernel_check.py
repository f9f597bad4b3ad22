#!/usr/bin/env python3
"""Device check of kvd's row copies (``kvd.cuda_copy``, ``kvd.cudart``): bytes, on a GPU.

Rows of every kind the same-node copy and the staged copies can make, in one
2 GiB buffer pair on one GPU, copied by each way kvd has, every byte compared
with the expected result (computed with torch on the GPU):

- the kernel (``RowCopier``, default shape), for: aligned rows of 64 KiB-4 MiB;
  rows whose source and destination share their offset from a 16-byte
  boundary but start off it (head and tail bytes, words between); rows
  whose offsets differ (bytes only); lengths of 0-100,000 bytes at random;
  one row of 256 MiB (cut into segments);
- ``cudaMemcpyBatchAsync`` and one ``cudaMemcpyAsync`` per row
  (``Cudart.copy_rows``, the kernel's fallbacks) on the random rows;
- a row of another device's memory is out of scope (one GPU).

Prints one line per case and ``all equal`` or the cases that were not;
exits 1 on any difference, 3 when all were equal but the kernel did not load
(the ``kernel`` rows were its fallback). Its GB/s are no benchmark (one
call each, the first with the kernel's build). ``--out`` writes
``gpu_kernel_check.json``. Run it with the daemon's Python too: the daemon
finds NVRTC on its own ``sys.path``.

    python3 benchmarks/gpu_kernel_check.py --out "$OUT"      # ~10 s on an H200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def rows_for(kind: str, rng, size: int):
    """(dst offsets, src offsets, lengths) into buffers of ``size`` bytes;
    destination rows never overlap (sources may)."""
    import numpy as np

    if kind.startswith("aligned-"):
        block = {"aligned-64k": 64 << 10, "aligned-1m": 1 << 20, "aligned-4m": 4 << 20}[kind]
        nblk = size // block // 2
        dst = rng.permutation(nblk)[: nblk // 2] * block
        src = rng.permutation(nblk)[: nblk // 2] * block
        return dst.astype(np.int64), src.astype(np.int64), np.full(len(dst), block, np.int64)
    if kind == "one-256m":
        return np.array([0], np.int64), np.array([size // 2 + 16], np.int64), np.array([256 << 20], np.int64)
    n = 4000
    lens = rng.integers(0, 100_000, n).astype(np.int64)
    gaps = rng.integers(0, 64, n).astype(np.int64)
    dst = np.cumsum(np.r_[0, (lens + gaps)[:-1]]) + rng.integers(0, 16)
    assert int(dst[-1] + lens[-1]) < size
    if kind == "co-aligned":  # the same offset from a 16-byte boundary on both sides
        src = (rng.integers(0, (size - 200_000) // 16, n) * 16 + (dst & 15)).astype(np.int64)
    else:  # "random": any offsets
        src = rng.integers(0, size - 200_000, n).astype(np.int64)
    return dst.astype(np.int64), src, lens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "")
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args(argv)
    import numpy as np
    import torch

    from kvd import cuda_copy, cudart

    if torch.version.cuda is None or not torch.cuda.is_available():
        print("gpu_kernel_check: needs a CUDA build of torch and a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)
    size = 2 << 30
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    rt = cudart.load()
    eng = cuda_copy.engine()
    per_row = cudart.Cudart(rt._lib, rt.path)
    per_row._batch = None  # the last fallback: one cudaMemcpyAsync per row
    ways = {"kernel": eng.copy_rows, "batch": rt.copy_rows, "per-row": per_row.copy_rows}
    rng = np.random.default_rng(7)
    results, bad = [], []
    for kind in ("aligned-4m", "aligned-1m", "aligned-64k", "co-aligned", "random", "one-256m"):
        d_off, s_off, lens = rows_for(kind, rng, size)
        want = torch.zeros_like(dst)
        for d_, s_, n_ in zip(d_off.tolist(), s_off.tolist(), lens.tolist()):  # torch's own slice copies
            want[d_:d_ + n_] = src[s_:s_ + n_]
        for way, fn in ways.items():
            dst.zero_()
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            err = ""
            try:
                fn(args.device, dst.data_ptr() + d_off, src.data_ptr() + s_off, lens)
            except Exception as e:  # reported per case
                err = str(e)[:300]
            dt = time.perf_counter() - t0
            equal = not err and bool(torch.equal(dst, want))
            r = {"rows": kind, "way": way, "n": int(len(lens)), "bytes": int(lens.sum()), "equal": equal,
                 "gbps": int(lens.sum()) / dt / 1e9 if dt > 0 else 0.0, "error": err}
            results.append(r)
            print(f"{kind:>12} {way:>8}: {r['n']:6d} rows, {r['bytes'] / 2**20:9.1f} MiB, "
                  f"{'equal' if equal else 'NOT EQUAL'} {r['gbps']:8.1f} GB/s {err}", flush=True)
            if not equal:
                bad.append(f"{kind}/{way}")
        del want
    summary = {"kernel_in_use": eng.kernel, "why": eng.why, "results": results, "bad": bad}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_kernel_check.json").write_text(json.dumps(summary, indent=1))
    print("all equal" if not bad else f"NOT equal: {bad}", f"(kernel in use: {eng.kernel} {eng.why})")
    if not bad and not eng.kernel:
        print(f"the kernel did not load here ({eng.why}): the rows labelled kernel were the fallback's",
              file=sys.stderr)
        return 3
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
