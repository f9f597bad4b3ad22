"""Markdown tables of docs/PERFORMANCE.md from the benchmarks' JSON results.

    .venv/bin/python benchmarks/report.py --results docs/perf-results

Prints one section per result file found (dataplane.json, dataplane_b_tuned.json,
latency.json, variants_*.json, step.json, scale.json, engines.json), each with
the command that made it and the load average around it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvd.bench import common as cm  # noqa: E402


def _load(p: Path):
    return json.loads(p.read_text()) if p.exists() else None


def _meta(res: dict) -> str:
    la0 = res.get("loadavg_start") or res.get("machine", {}).get("loadavg_start")
    la1 = res.get("loadavg_end")
    fmt = lambda la: "/".join(f"{x:.1f}" for x in la) if la else "?"  # noqa: E731
    cmd = res.get("command", "")
    return f"`{cmd}` (load average {fmt(la0)} at the start, {fmt(la1)} at the end)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=Path("docs/perf-results"))
    args = ap.parse_args(argv)
    d = args.results
    from kvd.bench import dataplane, scale, step, variants

    for name in ("dataplane.json", "dataplane_b_tuned.json"):
        r = _load(d / name)
        if r:
            print(f"### {name}\n\n{_meta(r)}\n\n{dataplane.table(r, markdown=True)}\n")
            print(f"goals: {dataplane.goals(r)}\n")
    r = _load(d / "latency.json")
    if r:
        print(f"### latency.json\n\n{_meta(r)}\n\n{dataplane.latency_table(r, markdown=True)}\n")
    for p in sorted(d.glob("variants_*.json")):
        r = _load(p)
        print(f"### {p.name}\n\n{_meta(r)}\n\n{variants.table(r, markdown=True)}\n")
    r = _load(d / "step.json")
    if r:
        print(f"### step.json\n\n{_meta(r)}\n\n{step.table(r, markdown=True)}\n")
    r = _load(d / "scale.json")
    if r:
        print(f"### scale.json\n\n{_meta(r)}\n\n{scale.table(r, markdown=True)}\n")
    r = _load(d / "engines.json")
    if r:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import baseline_nixl_connector as b

        summary = {int(k): v for k, v in r["summary"].items()}
        print(f"### engines.json\n\n`{r.get('command', '')}` (load average at the end "
              f"{'/'.join(f'{float(x):.1f}' for x in r.get('loadavg_end', []))})\n\n{b.table(summary, markdown=True)}\n")
        for n, row in summary.items():
            if "ttft_pd_ratio_per_round" in row:
                print(f"- {n} tokens: TTFT P/D kvd/nixl per round "
                      f"{[round(x, 2) for x in row['ttft_pd_ratio_per_round']]}, e2e "
                      f"{[round(x, 2) for x in row['e2e_pd_ratio_per_round']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
