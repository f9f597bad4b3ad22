#!/usr/bin/env bash
# py-spy profiles of the kvd daemons and the engine-side client during small
# loads: benchmarks/profile.sh MODE OUTDIR [SECONDS] [RATE]
#   MODE: latency (16 x 64 KiB, 10 ms apart) or dataplane (1 and 16 x 64 KiB, back to back)
# One process is sampled at a time (2 cores: py-spy --native costs CPU), each
# twice: --idle (every thread every tick: what it waits on) and without
# (on-CPU samples only). Raw collapsed stacks, then profile_summary.py.
set -euo pipefail
MODE=$1; OUT=$2; SECS=${3:-15}; RATE=${4:-100}
cd "$(dirname "$0")/.."
PY=.venv/bin/python; SPY=.venv/bin/py-spy
mkdir -p "$OUT"
pidf=$(mktemp -u /tmp/kvd-prof-XXXXXX.json)
TOTAL=$((5 * SECS + 32))
$PY -m benchmarks.profile_small --mode "$MODE" --seconds "$TOTAL" --pidfile "$pidf" --json "$OUT/$MODE.run.json" \
    > "$OUT/$MODE.run.log" 2>&1 &
drv=$!
for _ in $(seq 240); do [ -f "$pidf" ] && break; sleep 0.5; done
pid() { $PY -c "import json,sys; print(json.load(open('$pidf'))['$1'])"; }
D=$(pid D); P=$(pid P); C=$(pid client)
echo "$MODE: P=$P D=$D client=$C load $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/$MODE.pids.txt"
rec() {  # who pid kind flags...
  local who=$1 p=$2 kind=$3; shift 3
  $SPY record --pid "$p" --rate "$RATE" --duration "$SECS" --threads --native --format raw \
      -o "$OUT/$MODE-$who-$kind.txt" "$@" 2>&1 | grep -E "Samples|Error" | sed "s/^/$who $kind: /" || true
  echo "  load $(cut -d' ' -f1-3 /proc/loadavg) after $who $kind" | tee -a "$OUT/$MODE.pids.txt"
}
cp /proc/$D/maps "$OUT/$MODE-D.maps"; cp /proc/$P/maps "$OUT/$MODE-P.maps"; cp /proc/$C/maps "$OUT/$MODE-client.maps"
$PY -m benchmarks.thread_cpu 10 P=$P D=$D client=$C > "$OUT/$MODE-threads.txt" 2>&1 || true
rec D "$D" idle --idle
rec D "$D" cpu
$SPY dump --pid "$D" --native > "$OUT/$MODE-D-dump.txt" 2>&1 || true
rec client "$C" idle --idle
rec client "$C" cpu
$SPY dump --pid "$C" --native > "$OUT/$MODE-client-dump.txt" 2>&1 || true
rec P "$P" cpu
wait $drv || true
rm -f "$pidf"
