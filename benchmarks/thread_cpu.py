"""Per-thread CPU of running processes over a window, from /proc (no profiler).

    .venv/bin/python benchmarks/thread_cpu.py SECONDS NAME=PID [NAME=PID ...]

Prints, per process and thread (name from /proc/PID/task/TID/comm), user and
system CPU as a % of the window's wall time, and context switches
(voluntary: the thread blocked; involuntary: it was preempted).
"""

from __future__ import annotations

import os
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")


def snap(pid: int) -> dict[int, tuple[str, int, int, int, int]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                st = f.read()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
            sw = {}
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if "ctxt_switches" in line:
                        k, v = line.split(":")
                        sw[k] = int(v)
        except OSError:
            continue
        fields = st[st.rindex(")") + 2:].split()
        out[int(tid)] = (comm, int(fields[11]), int(fields[12]), sw.get("voluntary_ctxt_switches", 0),
                         sw.get("nonvoluntary_ctxt_switches", 0))
    return out


def main(argv: list[str]) -> int:
    secs = float(argv[0])
    procs = [(a.split("=")[0], int(a.split("=")[1])) for a in argv[1:]]
    before = {name: snap(pid) for name, pid in procs}
    la0 = open("/proc/loadavg").read().split()[:3]
    t0 = time.monotonic()
    time.sleep(secs)
    wall = time.monotonic() - t0
    after = {name: snap(pid) for name, pid in procs}
    print(f"window {wall:.1f} s, load average {' '.join(la0)} -> {' '.join(open('/proc/loadavg').read().split()[:3])}")
    for name, _ in procs:
        rows = []
        for tid, (comm, u1, s1, v1, n1) in after[name].items():
            if tid not in before[name]:
                continue
            _, u0, s0, v0, n0 = before[name][tid]
            rows.append((100 * (u1 - u0) / HZ / wall, 100 * (s1 - s0) / HZ / wall, (v1 - v0) / wall, (n1 - n0) / wall,
                         comm, tid))
        rows.sort(reverse=True, key=lambda r: r[0] + r[1])
        tot = sum(r[0] + r[1] for r in rows)
        print(f"{name}: {tot:.1f} % of a core in all")
        print(f"  {'thread':<20} {'user %':>7} {'sys %':>7} {'vol cs/s':>9} {'invol cs/s':>10}")
        for u, s, v, n, comm, tid in rows:
            if u + s + v > 0:
                print(f"  {comm + ' ' + str(tid):<20} {u:7.1f} {s:7.1f} {v:9.0f} {n:10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
