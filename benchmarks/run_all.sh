#!/bin/sh
# Runs benchmarks 1-5 as docs/PERFORMANCE.md reports them, then the plots and tables.
# Results (JSON) go to $OUT (default docs/perf-results), figures to docs/img.
# Variant A/Bs (benchmarks.variants) are run by hand, see docs/PERFORMANCE.md.
# About 20 minutes on the 2-core reference machine; run it when `uptime` shows
# the machine otherwise idle (each benchmark interleaves its cases, but a
# loaded machine still widens every spread).
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/perf-results}
mkdir -p "$OUT"
uptime
$PY -m benchmarks.dataplane --reps 9 --json "$OUT/dataplane.json"
$PY -m benchmarks.dataplane --reps 9 --nixl-num-threads 0 --nixl-pthr-delay-us 1000 --json "$OUT/dataplane_b_tuned.json"
$PY -m benchmarks.latency --reps 300 --json "$OUT/latency.json"
$PY -m benchmarks.trace --reps 100 --json "$OUT/trace.json"
$PY -m benchmarks.engine_step --json "$OUT/step.json"
$PY -m benchmarks.scale --json "$OUT/scale.json"
$PY -m benchmarks.baseline_nixl_connector --rounds 2 --reps 4 --json "$OUT/engines.json"
$PY -m benchmarks.plots --results "$OUT" --out docs/img
# The tables of these results; docs/PERFORMANCE.md is written by hand from
# them (it quotes and compares figures run by run: re-read it against these).
$PY -m benchmarks.report --results "$OUT" --out "$OUT/tables.md"
uptime
