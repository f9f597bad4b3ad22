"""Benchmark 5, real engines: vLLM's built-in NixlConnector vs kvd on the same P/D flow.

Starts the demo's P/D pair (kvd.testing.vllm_engines.PDStack) with ``--connector nixl`` (the
baseline kvd must beat) and ``kvd`` in turn, ``--rounds`` times each,
alternating (nixl, kvd, then kvd, nixl, ...) so that both see the machine's
load alike; one stack at a time (two engines take ~6.6 GB). Each round uses
fresh prompts (the same for both connectors), so D never hits its prefix
cache. For each prompt length (default: short = 16, 512 and 2048 tokens):

- TTFT non-disaggregated: P alone, streaming, prefix cache bypassed
  (``cache_salt``), seconds to the first token;
- TTFT disaggregated: P request (max_tokens=1) + D's time to first token
  (streaming), as a client behind the toy proxy sees it;
- transfer: bytes moved into D and the transfer time as the connector reports
  it (NixlConnector: D's ``vllm:nixl_xfer_time_seconds`` / ``_bytes_transferred``;
  kvd: D daemon's ``bytes_read`` and ``kvd_transfer_duration_seconds``);
- end to end: 16 greedy tokens through P/D, and whether they equal the
  non-disaggregated output.

Medians over every round's prompts; the ratios kvd / NixlConnector of the
TTFT P/D and the e2e P/D latency (goal <= 1.0). Run::

    .venv/bin/python benchmarks/baseline_nixl_connector.py --rounds 2 --reps 4 --json /tmp/pd-bench.json

Results and the machine: docs/PERFORMANCE.md ("Real engines").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from kvd.demo import run, tiny_model
from kvd.testing import proxy
from kvd.testing.util import free_port
from kvd.testing.vllm_engines import PDStack


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def bench_connector(connector: str, model_dir: Path, lengths: list[int], reps: int,
                    seed: int, workdir: Path, warmup: int = 2, engine_args: list[str] | None = None) -> dict:
    """One stack of ``connector``: ``reps`` fresh prompts per length (the same
    prompts for both connectors when ``seed`` is the same); raw figures."""
    metrics_ports = {"P": free_port(), "D": free_port()} if connector == "kvd" else {}
    st = PDStack(model_dir=model_dir, run_dir=workdir / connector, connector=connector,
                       log=lambda m: print(f"  [{connector}] {m}", flush=True),
                       metrics_ports=metrics_ports, engine_args=list(engine_args or []))
    out: dict = {"connector": connector, "lengths": {}}
    with st:
        out["stack_start_s"] = st.timings["stack_start_s"]
        meter = run.Meter(st)
        # warm both engines and the transfer path (handshake, first-use costs)
        for i, prompt in enumerate(run.make_prompts(model_dir, [64] * warmup, seed + 999)):
            proxy.pd_complete(st.p.url, st.d.url, run.request_body(prompt, 2))
            proxy.complete(st.p.url, dict(run.request_body(prompt, 2), cache_salt=f"w{i}-{time.time_ns()}"))
        for li, n in enumerate(lengths):
            prompts = run.make_prompts(model_dir, [n] * (2 * reps), seed + 1000 * (li + 1))
            raw = {k: [] for k in ("ttft_alone", "ttft_pd", "p_s", "d_first", "xfer_s", "xfer_bytes", "e2e_pd",
                                   "e2e_alone", "external")}
            matches = 0
            for r in range(reps):
                # TTFT: one fresh prompt through P alone, another through P/D
                first, _ = proxy.first_token_s(
                    st.p.url, dict(run.request_body(prompts[2 * r], 1),
                                   cache_salt=f"ttft-{li}-{r}-{time.time_ns()}"))
                raw["ttft_alone"].append(first)
                pt, dt, tot = proxy.pd_first_token_s(st.p.url, st.d.url,
                                                     run.request_body(prompts[2 * r + 1], 1))
                raw["p_s"].append(pt)
                raw["d_first"].append(dt)
                raw["ttft_pd"].append(tot)
            for r in range(reps):
                # 16 greedy tokens through P/D, with transfer counters, then the
                # reference on P alone (fresh salt). Reuses the TTFT-alone prompts:
                # D has not seen them.
                rep = run.run_one(st, meter, r, prompts[2 * r])
                run.reference(st, rep, prompts[2 * r])
                raw["xfer_s"].append(rep.transfer_s)
                raw["xfer_bytes"].append(rep.bytes)
                raw["e2e_pd"].append(rep.prefill_s + rep.decode_s)
                raw["e2e_alone"].append(rep.reference_s)
                matches += rep.match
                raw["external"].append(rep.external_tokens)
            out["lengths"][n] = dict(raw=raw, matches=matches, reps=reps)
            print(f"  [{connector}] {n:5d} tok: TTFT P/D {_median(raw['ttft_pd']) * 1e3:7.1f} ms, "
                  f"16 tok P/D {_median(raw['e2e_pd']) * 1e3:.0f} ms, match {matches}/{reps}", flush=True)
    return out


def summarize(rounds: list[dict], lengths: list[int]) -> dict:
    """Medians per connector and length over every round, and kvd / nixl ratios
    (of the medians, and the median of the per-round ratios)."""
    out: dict = {}
    for n in lengths:
        row: dict = {"prompt_tokens": n}
        for c in ("nixl", "kvd"):
            xs = [r[c]["lengths"][n] for r in rounds if c in r]
            if not xs:
                continue
            cat = lambda k: [v for x in xs for v in x["raw"][k]]  # noqa: E731
            row[c] = {
                "ttft_alone_ms": _median(cat("ttft_alone")) * 1e3,
                "ttft_pd_ms": _median(cat("ttft_pd")) * 1e3,
                "pd_prefill_ms": _median(cat("p_s")) * 1e3,
                "pd_decode_first_ms": _median(cat("d_first")) * 1e3,
                "transfer_ms": _median(cat("xfer_s")) * 1e3,
                "transfer_bytes": _median(cat("xfer_bytes")),
                "e2e_16tok_pd_ms": _median(cat("e2e_pd")) * 1e3,
                "e2e_16tok_alone_ms": _median(cat("e2e_alone")) * 1e3,
                "external_tokens": _median(cat("external")),
                "matches": f"{sum(x['matches'] for x in xs)}/{sum(x['reps'] for x in xs)}",
            }
        if "nixl" in row and "kvd" in row:
            for k in ("ttft_pd_ms", "e2e_16tok_pd_ms", "pd_decode_first_ms"):
                row[f"{k}_kvd_over_nixl"] = row["kvd"][k] / row["nixl"][k]
            paired = [( _median(r["kvd"]["lengths"][n]["raw"]["ttft_pd"]) / _median(r["nixl"]["lengths"][n]["raw"]["ttft_pd"]),
                        _median(r["kvd"]["lengths"][n]["raw"]["e2e_pd"]) / _median(r["nixl"]["lengths"][n]["raw"]["e2e_pd"]))
                      for r in rounds if "kvd" in r and "nixl" in r]
            row["ttft_pd_ratio_per_round"] = [a for a, _ in paired]
            row["e2e_pd_ratio_per_round"] = [b for _, b in paired]
        out[n] = row
    return out


def table(summary: dict, markdown: bool = False) -> str:
    from kvd.bench.common import fmt_table

    rows = []
    for n, row in summary.items():
        for c in ("nixl", "kvd"):
            if c not in row:
                continue
            x = row[c]
            rows.append([n, c, f"{x['ttft_alone_ms']:.1f}", f"{x['ttft_pd_ms']:.1f}", f"{x['pd_prefill_ms']:.1f}",
                         f"{x['pd_decode_first_ms']:.1f}", f"{x['transfer_ms']:.2f}",
                         f"{x['transfer_bytes'] / 1024:.0f}", f"{x['e2e_16tok_pd_ms']:.0f}",
                         f"{x['e2e_16tok_alone_ms']:.0f}", x["matches"],
                         f"{row['ttft_pd_ms_kvd_over_nixl']:.2f}" if c == "kvd" and "ttft_pd_ms_kvd_over_nixl" in row else "",
                         f"{row['e2e_16tok_pd_ms_kvd_over_nixl']:.2f}" if c == "kvd" and "e2e_16tok_pd_ms_kvd_over_nixl" in row else ""])
    return fmt_table(["tokens", "connector", "TTFT alone ms", "TTFT P/D ms", "P ms", "D first ms", "xfer ms",
                      "xfer KiB", "e2e 16 tok P/D ms", "alone ms", "match", "TTFT kvd/nixl", "e2e kvd/nixl"],
                     rows, markdown)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connector", nargs="+", choices=("nixl", "kvd"), default=["nixl", "kvd"])
    ap.add_argument("--lengths", default="16,512,2048", help="prompt tokens (default: short, 512, 2048)")
    ap.add_argument("--reps", type=int, default=4, help="prompts per length per round")
    ap.add_argument("--rounds", type=int, default=2,
                    help="stacks per connector, alternating (nixl, kvd, kvd, nixl, ...): interleaved side by side")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kvd-bench"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    model_dir = tiny_model.build(quiet=True)
    from kvd.bench.common import loadavg, machine

    info = machine()
    t0 = time.time()
    rounds, failures = [], []
    for r in range(args.rounds):
        order = list(args.connector) if r % 2 == 0 else list(reversed(args.connector))
        res = {}
        for c in order:
            print(f"round {r + 1}/{args.rounds}: {c} (load average {loadavg()})", flush=True)
            # the same prompts for both connectors in a round, new ones each round
            try:
                res[c] = bench_connector(c, model_dir, lengths, args.reps, args.seed + 100_000 * r, args.workdir,
                                         engine_args=["--max-model-len", str(args.max_model_len)])
            except Exception as e:  # a stack that fails is reported, the other rounds still count
                print(f"round {r + 1}: {c} failed: {type(e).__name__}: {e}", flush=True)
                failures.append({"round": r + 1, "connector": c, "error": f"{type(e).__name__}: {e}"[:2000]})
        if all(c in res for c in args.connector):
            rounds.append(res)
    summary = summarize(rounds, lengths)
    print(f"\nload average at the end: {loadavg()}, {time.time() - t0:.0f} s; {len(rounds)} complete round(s), "
          f"failures: {failures or 'none'}")
    print(table(summary))
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "engines", "machine": info, "rounds": rounds, "failures": failures,
                                         "summary": summary, "loadavg_end": loadavg(), "seconds": time.time() - t0,
                                         "command": " ".join(["benchmarks/baseline_nixl_connector.py",
                                                              *(argv if argv is not None else sys.argv[1:])])},
                                        indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
