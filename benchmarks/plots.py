"""Figures of docs/PERFORMANCE.md from the benchmarks' JSON results.

    .venv/bin/python benchmarks/plots.py --results docs/perf-results --out docs/img

Reads ``dataplane.json`` (benchmark 1), ``scale.json`` (4) and ``step.json``
(2) where present; writes ``throughput_vs_block_length.png``,
``latency_vs_concurrency.png`` and ``step_cost_vs_inflight.png``.
Needs matplotlib (the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {"a": "(a) kvd daemons", "b": "(b) plain NIXL, two processes", "c": "(c) memcpy, one thread"}
STYLE = {"a": dict(marker="o", color="tab:blue"), "b": dict(marker="s", color="tab:orange"),
         "c": dict(marker="^", color="tab:gray", linestyle="--")}


def _load(d: Path, name: str):
    p = d / name
    return json.loads(p.read_text()) if p.exists() else None


def _kib(n: int) -> str:
    return f"{n // 1024} KiB" if n < 1 << 20 else f"{n >> 20} MiB"


def throughput(res: dict, out: Path) -> None:
    cells = res["cells"]
    counts = sorted({c["blocks"] for c in cells})
    fig, axes = plt.subplots(1, len(counts), figsize=(4 * len(counts), 3.6), sharey=True, squeeze=False)
    for ax, n in zip(axes[0], counts):
        row = sorted((c for c in cells if c["blocks"] == n), key=lambda c: c["block_len"])
        x = [c["block_len"] for c in row]
        for m in "abc":
            ax.plot(x, [c[f"{m}_gbs"] for c in row], label=LABELS[m], **STYLE[m])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(x, [_kib(v) for v in x], rotation=45, fontsize=8)
        ax.set_title(f"{n} block{'s' if n > 1 else ''} per request")
        ax.set_xlabel("block length")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("GB/s (median)")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle("Data plane throughput vs block length (benchmark 1)")
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_block_length.png", dpi=110)
    plt.close(fig)


def latency(res: dict, out: Path) -> None:
    cases = [c for c in res["cases"] if c["peers"] == 1]
    blocks = sorted({c["blocks"] for c in cases})
    fig, axes = plt.subplots(1, len(blocks), figsize=(4 * len(blocks), 3.6), squeeze=False)
    for ax, nb in zip(axes[0], blocks):
        row = sorted((c for c in cases if c["blocks"] == nb), key=lambda c: c["concurrency"])
        x = [c["concurrency"] for c in row]
        ax.plot(x, [c["lat_p50_ms"] for c in row], label="kvd p50", **STYLE["a"])
        ax.plot(x, [c["lat_p99_ms"] for c in row], label="kvd p99", marker="o", color="tab:blue", linestyle=":")
        if all("b_lat_p50_ms" in c for c in row):
            ax.plot(x, [c["b_lat_p50_ms"] for c in row], label="plain NIXL p50", **STYLE["b"])
            ax.plot(x, [c["b_lat_p99_ms"] for c in row], label="plain NIXL p99", marker="s", color="tab:orange",
                    linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(x, [str(v) for v in x])
        ax.set_title(f"{nb} x {_kib(res['block_len'])} blocks per request")
        ax.set_xlabel("concurrent requests")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("request latency, ms")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("Completion latency vs concurrency, one peer (benchmark 4)")
    fig.tight_layout()
    fig.savefig(out / "latency_vs_concurrency.png", dpi=110)
    plt.close(fig)


def step_cost(res: dict, out: Path) -> None:
    cases = res["cases"]
    x = list(range(len(cases)))
    fig, ax = plt.subplots(figsize=(6, 3.8))
    if all("held_p50_us" in c for c in cases):
        ax.plot(x, [c["held_p50_us"] for c in cases], marker="s", color="tab:green", label="held in flight, p50")
        ax.plot(x, [c["held_p99_us"] for c in cases], marker="s", color="tab:green", linestyle=":",
                label="held in flight, p99")
    if all("held_b2b_p50_us" in c for c in cases):
        ax.plot(x, [c["held_b2b_p50_us"] for c in cases], marker="^", color="tab:olive",
                label="held, steps back to back (no sleep), p50")
    ax.plot(x, [c["p50_us"] for c in cases], marker="o", color="tab:blue", label="starting+ending every step, p50")
    ax.plot(x, [c["p99_us"] for c in cases], marker="o", color="tab:blue", linestyle=":",
            label="starting+ending every step, p99")
    ax.axhline(30, color="tab:green", linewidth=0.8, alpha=0.6)
    ax.axhline(200, color="tab:red", linewidth=0.8, alpha=0.6)
    ax.text(x[-1], 30, " goal p50", va="bottom", ha="right", fontsize=7)
    ax.text(x[-1], 200, " goal p99", va="bottom", ha="right", fontsize=7)
    if "unary_getstats" in res:
        ax.axhline(res["unary_getstats"]["p50_us"], color="gray", linestyle="--", linewidth=0.8,
                   label="one blocking unary RPC, p50")
    ax.set_yscale("log")
    ax.set_xticks(x, [str(c["inflight"]) for c in cases])
    ax.set_xlabel("loads in flight")
    ax.set_ylabel("shim time per engine step, us")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Engine-step cost of the shim (benchmark 2)")
    fig.tight_layout()
    fig.savefig(out / "step_cost_vs_inflight.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=Path("docs/perf-results"))
    ap.add_argument("--out", type=Path, default=Path("docs/img"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    done = []
    for name, fn in (("dataplane.json", throughput), ("scale.json", latency), ("step.json", step_cost)):
        res = _load(args.results, name)
        if res is not None:
            fn(res, args.out)
            done.append(name)
    print(f"plots from {', '.join(done) or 'nothing'} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
