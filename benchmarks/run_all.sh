#!/bin/sh
# Runs benchmarks 1-5 as docs/PERFORMANCE.md reports them, then the plots.
# Results (JSON) go to $OUT (default docs/perf-results), figures to docs/img.
# About an hour on the 2-core reference machine; run it when `uptime` shows
# the machine otherwise idle (each benchmark interleaves its cases, but a
# loaded machine still widens every spread).
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/perf-results}
mkdir -p "$OUT"
uptime
$PY benchmarks/dataplane.py --json "$OUT/dataplane.json"
$PY benchmarks/latency.py --json "$OUT/latency.json"
$PY benchmarks/engine_step.py --json "$OUT/step.json"
$PY benchmarks/scale.py --json "$OUT/scale.json"
$PY benchmarks/baseline_nixl_connector.py --rounds 2 --reps 4 --json "$OUT/engines.json"
$PY benchmarks/plots.py --results "$OUT" --out docs/img
uptime
