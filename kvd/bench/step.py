"""Benchmark 2 in ``kvd bench``: the shim's cost per engine step, run as a
subprocess of :mod:`benchmarks.engine_step`, and its table and goals.

Why a subprocess of a module outside the package: the benchmark plays a vLLM
engine in process (vLLM's own ``Scheduler`` and two worker-side
``KvdConnector``s), and inside kvd only the vLLM shim package may import
vllm (docs/DESIGN.md, dependency rules); the harness lives in
``benchmarks/``, next to the other full-size benchmarks. So this part of
``kvd bench`` needs a kvd source checkout (where ``benchmarks/`` is) and
vLLM; without either it is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

from kvd.bench import common as cm
from kvd.testing.processes import KVD_ROOT, child_env


def unavailable() -> str | None:
    """Why benchmark 2 cannot run here (None when it can): no vLLM, or no
    ``benchmarks/`` next to the kvd package (an installed wheel)."""
    for mod in ("vllm", "transformers"):
        if importlib.util.find_spec(mod) is None:
            return f"vLLM is not installed (no module {mod!r}; pip install -e '.[vllm]')"
    if not (KVD_ROOT / "benchmarks" / "engine_step.py").is_file():
        return f"it needs a kvd source checkout (no {KVD_ROOT / 'benchmarks'})"
    return None


def run(inflight=(0, 16, 256), steps: int = 400, warmup: int = 30, unary_n: int = 200,
        progress: bool = True) -> dict:
    """Runs ``python -m benchmarks.engine_step`` (from the checkout's root) for
    the ``inflight`` counts with ``steps`` timed and ``warmup`` untimed steps
    per case and ``unary_n`` GetStats calls; returns its JSON results (us per
    step: :func:`table`). Raises RuntimeError with the tail of its output
    when it fails."""
    fd, path = tempfile.mkstemp(prefix="kvd-bench-step-", suffix=".json")
    os.close(fd)
    argv = [sys.executable, "-m", "benchmarks.engine_step", "--inflight", ",".join(map(str, inflight)),
            "--steps", str(steps), "--warmup", str(warmup), "--unary", str(unary_n), "--json", path]
    if not progress:
        argv.append("--no-progress")
    try:
        r = subprocess.run(argv, cwd=KVD_ROOT, env=child_env(), stdout=subprocess.PIPE, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"benchmarks.engine_step exited {r.returncode}:\n{r.stdout[-3000:]}")
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def table(res: dict, markdown: bool = False) -> str:
    """Benchmark 2's cases as a text (or ``markdown``) table (us per step), with
    the back-to-back, idle-penalty control, GetStats and least-squares notes."""
    rows = [[c["inflight"], f"{c.get('held_p50_us', float('nan')):.0f}", f"{c.get('held_p99_us', float('nan')):.0f}",
             f"{c.get('held_cpu_p50_us', float('nan')):.0f}",
             f"{c['inflight_mean']:.0f}", f"{c.get('loads_started_per_step', 0):.1f}", f"{c['p50_us']:.0f}",
             f"{c['p90_us']:.0f}", f"{c['p99_us']:.0f}", f"{c['sched_p50_us']:.0f}", f"{c['worker_p50_us']:.0f}",
             f"{c.get('cpu_p50_us', float('nan')):.0f}", f"{c.get('cpu_p99_us', float('nan')):.0f}"]
            for c in res["cases"]]
    u = res.get("unary_getstats")
    t = cm.fmt_table(["in flight", "held p50 us", "held p99 us", "held CPU p50", "churn: mean in flight",
                      "loads/step", "p50 us", "p90 us", "p99 us", "sched p50", "worker p50", "CPU p50", "CPU p99"],
                     rows, markdown)
    b2b = [c for c in res["cases"] if "held_b2b_p50_us" in c]
    if b2b:
        t += ("\nheld, steps back to back (no forward pass between them): p50 / p99 us: "
              + ", ".join(f"{c['inflight']} in flight {c['held_b2b_p50_us']:.0f} / {c['held_b2b_p99_us']:.0f}"
                          for c in b2b))
    pen = [c["idle_penalty"] for c in b2b if c.get("idle_penalty")]
    if pen:
        t += ("\ncontrol, no kvd code: a few us of Python (a dict and list workout) takes "
              + ", ".join(f"{p['after_sleep_p50_us']:.1f}" for p in pen) + " us p50 right after the forward's sleep, "
              + ", ".join(f"{p['hot_p50_us']:.1f}" for p in pen) + " us when run again at once")
    if u:
        t += f"\nblocking unary GetStats over the Unix socket: p50 {u['p50_us']:.0f} us, p99 {u['p99_us']:.0f} us"
    for c in res["cases"]:
        if "fit_fixed_us" in c:
            t += (f"\n{c['inflight']} in flight: {c['loads_started_per_step']:.1f} loads started and "
                  f"{c['loads_finished_per_step']:.1f} finished per step; CPU per step ~ "
                  f"{c['fit_fixed_us']:.0f} us + {c['fit_per_load_started_us']:.1f} us per load started + "
                  f"{c['fit_per_load_finished_us']:.1f} us per load finished (least squares)")
        if "fit_net_fixed_us" in c:
            t += (f"\n{c['inflight']} in flight, less the harness's own timing "
                  f"({c['harness_cpu_per_call_us']:.2f} us of CPU per timed call, a wrapped no-op's median; "
                  f"{c['timed_calls_per_step']:.1f} timed calls per step, "
                  f"{c['calls_per_load_started']:.1f} per load started): CPU per step ~ "
                  f"{c['fit_net_fixed_us']:.0f} us + {c['fit_net_per_load_started_us']:.1f} us per load started + "
                  f"{c['fit_net_per_load_finished_us']:.1f} us per load finished")
    return t


#: The fast path's engine-step goals: the shim's held step at most this many
#: us (p50) above the no-kvd control run right after the same sleep (what
#: this machine charges the first code after a sleep, ~30 us measured:
#: docs/PERFORMANCE.md section 2), and at most this many us of the engine
#: thread's CPU per load started (least squares over the steps, less the
#: harness's own timing: ``benchmarks.engine_step._Timer``).
HELD_OVER_CONTROL_US = 10.0
CPU_PER_LOAD_STARTED_US = 15.0


def goals(res: dict) -> dict:
    """Goals of benchmark 2, from :func:`run`'s results (us).

    - p50 <= 30 us, p99 <= 200 us (docs/DESIGN.md): ``held_met`` with loads
      held in flight (none starting or ending), ``met`` with loads starting
      and ending every step;
    - the fast path's: ``held_over_control_us``, the worst held p50 less the
      control's after-sleep p50 of the same case, against
      :data:`HELD_OVER_CONTROL_US` (``held_over_control_met``); and
      ``cpu_per_load_started_us``, the worst case's least-squares CPU per
      load started less the harness's own CPU per timed call
      (``fit_net_per_load_started_us``; results made before that
      correction have only the raw fit, which is used then), against
      :data:`CPU_PER_LOAD_STARTED_US` (``cpu_per_load_met``), with that
      case's raw fit (``cpu_per_load_started_raw_us``), the harness's CPU
      per timed call (``harness_cpu_per_call_us``) and its timed calls per
      load started (``calls_per_load_started``), NaN where not measured.
      NaN and not met when the run has no such case (no forward sleep, or
      no case where loads started and ended).
    """
    h = [c for c in res["cases"] if "held_p50_us" in c]
    over = [c["held_p50_us"] - c["idle_penalty"]["after_sleep_p50_us"] for c in h if c.get("idle_penalty")]
    nan = float("nan")

    def judged(c: dict) -> float:
        return c.get("fit_net_per_load_started_us", c["fit_per_load_started_us"])

    worst = max((c for c in res["cases"] if "fit_per_load_started_us" in c), key=judged, default={})
    worst_over = max(over, default=nan)
    worst_per_load = judged(worst) if worst else nan
    return dict(p50_max_us=max(c["p50_us"] for c in res["cases"]), p99_max_us=max(c["p99_us"] for c in res["cases"]),
                met=all(c["p50_us"] <= 30 and c["p99_us"] <= 200 for c in res["cases"]),
                held_p50_max_us=max((c["held_p50_us"] for c in h), default=float("nan")),
                held_p99_max_us=max((c["held_p99_us"] for c in h), default=float("nan")),
                held_met=bool(h) and all(c["held_p50_us"] <= 30 and c["held_p99_us"] <= 200 for c in h),
                held_over_control_us=worst_over, held_over_control_met=worst_over <= HELD_OVER_CONTROL_US,
                cpu_per_load_started_us=worst_per_load, cpu_per_load_met=worst_per_load <= CPU_PER_LOAD_STARTED_US,
                cpu_per_load_started_raw_us=worst.get("fit_per_load_started_us", nan),
                harness_cpu_per_call_us=worst.get("harness_cpu_per_call_us", nan),
                calls_per_load_started=worst.get("calls_per_load_started", nan))


def goals_text(g: dict) -> str:
    """The fast path's two engine-step goals of :func:`goals` as one line; the
    CPU per load started as judged (less the harness's own timing) and as
    measured, when the results have both."""
    per_load = f"{g['cpu_per_load_started_us']:.1f} us"
    own = g.get("harness_cpu_per_call_us", float("nan"))
    if own == own:  # not NaN: the results have the net fit
        per_load += (f" less the harness's own timing, {own:.2f} us x {g['calls_per_load_started']:.1f} "
                     f"timed calls a load; {g['cpu_per_load_started_raw_us']:.1f} us as measured")
    return (f"goal held step <= control + {HELD_OVER_CONTROL_US:.0f} us p50: "
            f"{'met' if g['held_over_control_met'] else 'NOT met'} (+{g['held_over_control_us']:.1f} us); "
            f"goal engine CPU per load started <= {CPU_PER_LOAD_STARTED_US:.0f} us: "
            f"{'met' if g['cpu_per_load_met'] else 'NOT met'} ({per_load})")
