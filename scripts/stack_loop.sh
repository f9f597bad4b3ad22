#!/usr/bin/env bash
# Starts the three heterogeneous-TP stacks of real vLLM-CPU engines N times
# and prints pass/fail per start: P TP 1 -> D TP 2 (tests/test_vllm_e2e.py,
# -k tp1_to_tp2 and the tp_ tests of its pd_tp stack), P TP 2 -> D TP 1
# (tests/test_vllm_e2e_tp2to1.py) and MLA P TP 1 -> D TP 2
# (tests/test_vllm_e2e_mla.py -k tp1_to_tp2). Each start is its own pytest
# run with -x (a fresh stack: daemons, engines, first contact between them).
#
# Usage: scripts/stack_loop.sh [N]     (N defaults to 1; about 1-2 min per
# start on a 2-core machine). Run from the repository root; logs go to
# ${STACK_LOOP_DIR:-/tmp/kvd-stack-loop}/<stack>-<i>.log and each start's run
# directory (the daemons' and engines' logs) to <stack>-<i>/; the exit
# status is 0 only when every start passed.
set -u
n=${1:-1}
case $n in ''|*[!0-9]*) echo "usage: $0 [N]" >&2; exit 64 ;; esac
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
out=${STACK_LOOP_DIR:-/tmp/kvd-stack-loop}
mkdir -p "$out"
stacks=(
  "tp1to2|tests/test_vllm_e2e.py|tp1_to_tp2 or tp_stats or tp_stopped"
  "tp2to1|tests/test_vllm_e2e_tp2to1.py|"
  "mla_tp1to2|tests/test_vllm_e2e_mla.py|mla_tp1_to_tp2"
)
failed=0
for i in $(seq 1 "$n"); do
  for s in "${stacks[@]}"; do
    IFS='|' read -r name file expr <<<"$s"
    log="$out/$name-$i.log"
    t0=$SECONDS
    rm -rf "$out/$name-$i"
    args=(-m pytest "$file" -x -q -p no:cacheprovider --basetemp "$out/$name-$i")
    [ -n "$expr" ] && args+=(-k "$expr")
    (cd "$root" && PYTHONPATH="$root" "$py" "${args[@]}") >"$log" 2>&1
    rc=$?
    summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error)" "$log" | tail -1 | tr -d '=')
    if [ $rc -eq 0 ]; then verdict=pass; else verdict=FAIL; failed=$((failed + 1)); fi
    printf '%-4s %-11s start %d/%d  %4d s  %s  (%s)\n' "$verdict" "$name" "$i" "$n" $((SECONDS - t0)) \
      "${summary:-rc $rc}" "$log"
  done
done
echo "$failed failed of $((n * ${#stacks[@]})) starts"
[ $failed -eq 0 ]
