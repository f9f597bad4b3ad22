"""Scheduling gaps of an idle process: is this machine giving a daemon CPU?

A kvd daemon mostly sleeps and must run within milliseconds of a wake-up
(a handshake, a READ's completion). On a 2-core machine running vLLM TP
engines, the daemons' threads were seen runnable and given no CPU for
seconds (docs/PERFORMANCE.md, "One wire-up at a time"). This probe measures
that without kvd: a heartbeat that sleeps ``--tick-ms`` and notes every gap
past ``--report-s``, with where the machine's CPUs went over the gap
(``/proc/stat``: user, nice, system, idle, iowait, steal ticks).

Two modes:

- ``watch`` (default): runs until interrupted or ``--seconds``, printing
  each long gap; start it beside the workload to judge (a vLLM stack,
  ``scripts/stack_loop.sh``).
- ``spin``: starts ``--spinners`` processes at nice ``--nice``, each in its
  own session, spinning on ``sched_yield`` (``--how yield``, as vLLM's
  shm_broadcast readers do) or on nothing (``--how busy``), and watches for
  ``--seconds``: does a plain spinner starve a nice-0 process here?

Prints one line per long gap and a summary (ticks seen, longest gap, p99).
Measured here: ``spin`` with 4 or 16 spinners, either way, longest gap
50-70 ms (at most 20 ms past the 50 ms tick); ``watch`` beside
``scripts/stack_loop.sh 10``, gaps up to 24.7 s with the CPUs all busy
(nice + system) and none idle. Each spinner runs in its own session: with
autogroups on, each is its own scheduling group, so ``--nice`` weighs
nothing against the heartbeat (sched(7)).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
SPIN = {"yield": "import os\nwhile True: os.sched_yield()", "busy": "while True: pass"}


def cpu_ticks() -> list[int]:
    """The machine's CPU time so far, clock ticks per :data:`FIELDS`."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:1 + len(FIELDS)]]


def watch(seconds: float, tick_s: float, report_s: float) -> list[float]:
    """Heartbeat for ``seconds`` (0: until interrupted); prints each gap
    over ``report_s``; returns every gap, seconds."""
    gaps: list[float] = []
    end = time.monotonic() + seconds if seconds > 0 else float("inf")
    last, last_cpu = time.monotonic(), cpu_ticks()
    try:
        while time.monotonic() < end:
            time.sleep(tick_s)
            now, now_cpu = time.monotonic(), cpu_ticks()
            gap = now - last
            gaps.append(gap)
            if gap > report_s:
                d = dict(zip(FIELDS, (b - a for a, b in zip(last_cpu, now_cpu))))
                print(f"{datetime.datetime.now():%H:%M:%S.%f} gap {gap:.2f} s; CPU ticks over it: "
                      + ", ".join(f"{k} {d[k]}" for k in ("user", "nice", "system", "idle", "iowait", "steal")),
                      flush=True)
            last, last_cpu = now, now_cpu
    except KeyboardInterrupt:
        pass
    return gaps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sched_gaps", description=__doc__,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("mode", nargs="?", choices=("watch", "spin"), default="watch")
    ap.add_argument("--seconds", type=float, default=0.0, help="how long (0: watch until interrupted; spin: 20)")
    ap.add_argument("--tick-ms", type=float, default=50.0, help="the heartbeat's sleep, ms")
    ap.add_argument("--report-s", type=float, default=1.0, help="print gaps longer than this, seconds")
    ap.add_argument("--spinners", type=int, default=4, help="spin: processes spinning")
    ap.add_argument("--nice", type=int, default=5, help="spin: their nice value (the vLLM stacks use 5)")
    ap.add_argument("--how", choices=tuple(SPIN), default="yield", help="spin: sched_yield or a bare loop")
    a = ap.parse_args(argv)
    procs = []
    seconds = a.seconds or (20.0 if a.mode == "spin" else 0.0)
    if a.mode == "spin":
        for _ in range(a.spinners):
            procs.append(subprocess.Popen(["nice", "-n", str(a.nice), sys.executable, "-c", SPIN[a.how]],
                                          start_new_session=True))
    try:
        gaps = sorted(watch(seconds, a.tick_ms / 1000, a.report_s))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    if gaps:
        print(f"{len(gaps)} ticks of {a.tick_ms:g} ms, longest gap {gaps[-1]:.3f} s, "
              f"p99 {gaps[int(len(gaps) * 0.99)]:.3f} s, gaps over {a.report_s:g} s: "
              f"{sum(g > a.report_s for g in gaps)}"
              + (f" ({a.spinners} spinners, {a.how}, nice {a.nice})" if procs else ""))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
