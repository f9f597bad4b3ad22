#!/bin/sh
# Runs benchmarks 1-5 as docs/PERFORMANCE.md reports them, then the plots.
# Results (JSON) go to $OUT (default docs/perf-results), figures to docs/img.
# Variant A/Bs (kvd.bench.variants) are run by hand, see docs/PERFORMANCE.md.
# About 20 minutes on the 2-core reference machine; run it when `uptime` shows
# the machine otherwise idle (each benchmark interleaves its cases, but a
# loaded machine still widens every spread).
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/perf-results}
mkdir -p "$OUT"
uptime
$PY benchmarks/dataplane.py --reps 9 --json "$OUT/dataplane.json"
$PY benchmarks/dataplane.py --reps 9 --nixl-num-threads 0 --nixl-pthr-delay-us 1000 --json "$OUT/dataplane_b_tuned.json"
$PY benchmarks/latency.py --reps 300 --json "$OUT/latency.json"
$PY -m kvd.bench.trace --reps 100 --json "$OUT/trace.json"
$PY benchmarks/engine_step.py --json "$OUT/step.json"
$PY benchmarks/scale.py --json "$OUT/scale.json"
$PY benchmarks/baseline_nixl_connector.py --rounds 2 --reps 4 --json "$OUT/engines.json"
$PY benchmarks/plots.py --results "$OUT" --out docs/img
# docs/PERFORMANCE.md = the hand-written text of benchmarks/PERFORMANCE.md.in + these tables
# (the text quotes figures: re-read it against the new tables).
$PY benchmarks/report.py --results "$OUT" --fill benchmarks/PERFORMANCE.md.in --out docs/PERFORMANCE.md
uptime
