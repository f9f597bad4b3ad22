"""Markdown tables of docs/PERFORMANCE.md from the benchmarks' JSON results.

    .venv/bin/python benchmarks/report.py --results docs/perf-results

Prints one section per result file found (dataplane.json, dataplane_b_tuned.json,
latency.json, variants_*.json, step.json, scale.json, engines.json), each with
the command that made it and the load average around it. docs/PERFORMANCE.md
is written by hand from these (its figures are quoted and compared, run by
run); ``benchmarks/run_all.sh`` writes them to ``docs/perf-results/tables.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvd.bench import common as cm


def _load(p: Path):
    return json.loads(p.read_text()) if p.exists() else None


def _meta(res: dict) -> str:
    la0 = res.get("loadavg_start") or res.get("machine", {}).get("loadavg_start")
    la1 = res.get("loadavg_end")
    fmt = lambda la: "/".join(f"{x:.1f}" for x in la) if la else "?"  # noqa: E731
    cmd = res.get("command", "")
    return f"`{cmd}` (load average {fmt(la0)} at the start, {fmt(la1)} at the end)"


def tables(d: Path) -> dict[str, str]:
    """Markdown of each result file in ``d``, by file name."""
    from benchmarks import latency, scale, variants
    from kvd.bench import dataplane, step

    out: dict[str, str] = {}
    for name in ("dataplane.json", "dataplane_b_tuned.json"):
        r = _load(d / name)
        if r:
            g = dataplane.goals(r)
            out[name] = (f"{_meta(r)}\n\n{dataplane.table(r, markdown=True)}\n\n(a)/(b) >= 0.97 in "
                         f"{g['a_over_b_cells_met']} cells from 64 KiB blocks up; (a)/(c) >= 0.7 in "
                         f"{g['a_over_c_cells_met']} cells.")
    r = _load(d / "latency.json")
    if r:
        out["latency.json"] = f"{_meta(r)}\n\n{_md_lines(latency.latency_table(r, markdown=True))}"
    r = _load(d / "trace.json")
    if r:
        rows = [[k, f"{v:.3f}", f"{r['legs_p90_ms'][k]:.3f}"] for k, v in r["legs_ms"].items()]
        out["trace.json"] = (f"{_meta(r)}\n\n{cm.fmt_table(['leg', 'p50 ms', 'p90 ms'], rows, True)}\n\n"
                             f"{r['done_at_post']}/{r['reps']} READs were done when the post returned.")
    for p in sorted(d.glob("variants_*.json")):
        r = _load(p)
        out[p.name] = f"{_meta(r)}\n\n{_md_lines(variants.table(r, markdown=True))}"
    r = _load(d / "step.json")
    if r:
        out["step.json"] = f"{_meta(r)}\n\n{_md_lines(step.table(r, markdown=True))}"
    r = _load(d / "scale.json")
    if r:
        out["scale.json"] = f"{_meta(r)}\n\n{_md_lines(scale.table(r, markdown=True))}"
    r = _load(d / "engines.json")
    if r:
        from benchmarks import baseline_nixl_connector as b

        summary = {int(k): v for k, v in r["summary"].items()}
        text = (f"`{r.get('command', '')}` (load average at the end "
                f"{'/'.join(f'{float(x):.1f}' for x in r.get('loadavg_end', []))}; "
                f"{len(r.get('rounds', []))} complete round(s))\n\n{b.table(summary, markdown=True)}\n")
        for n, row in summary.items():
            if "ttft_pd_ratio_per_round" in row:
                text += (f"\n- {n} tokens: TTFT P/D kvd/NixlConnector per round "
                         f"{[round(x, 2) for x in row['ttft_pd_ratio_per_round']]}, e2e per round "
                         f"{[round(x, 2) for x in row['e2e_pd_ratio_per_round']]}")
        for f in r.get("failures", []):
            text += f"\n- round {f['round']}: {f['connector']} failed: {f['error'][:300]}"
        out["engines.json"] = text
    return out


def _md_lines(t: str) -> str:
    """A table followed by plain lines: the lines become their own paragraph."""
    lines = t.split("\n")
    table = [x for x in lines if x.startswith("|")]
    rest = [x for x in lines if not x.startswith("|")]
    return "\n".join(table) + ("\n\n" + "\n".join(f"{x}  " for x in rest) if rest else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=Path("docs/perf-results"))
    ap.add_argument("--out", type=Path, default=None, help="write the tables here (default: stdout)")
    args = ap.parse_args(argv)
    text = "".join(f"### {name}\n\n{table}\n\n" for name, table in tables(args.results).items())
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
