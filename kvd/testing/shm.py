"""POSIX shared memory for harnesses: segments that stand in for an engine's
KV cache, and the bookkeeping that removes what a run's processes left in
``/dev/shm``.

Shared memory attribution (:class:`ShmTracker`): other programs on the node
may create ``/dev/shm`` objects while a run goes on, so only objects that (a)
did not exist when the run started, (b) were seen mapped or open by one of
the run's processes (sampled once a second), or carry one of their pids in
their name (``/torch_<pid>_...``), and (c) are no longer in use by any live
process are removed.
"""

from __future__ import annotations

import glob
import mmap
import os
import re
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

SHM_DIR = Path("/dev/shm")


class ShmSegment:
    """A POSIX shm object made by the harness (an engine's KV cache stand-in).

    ``name`` is ``/<prefix>_<pid>_<random>`` (the pid lets
    :func:`cleanup_segments` find the leftovers of dead processes), ``size``
    its length in bytes, ``mm`` its mapping and ``array`` a uint8 view.
    Raises OSError when /dev/shm is full or not writable. Close with
    :meth:`close` (unmaps and unlinks).
    """

    def __init__(self, size: int, prefix: str = "kvdtest"):
        self.name = f"/{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.path = str(SHM_DIR) + self.name
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self.array = np.frombuffer(self.mm, dtype=np.uint8)

    def fill(self, seed: int) -> None:
        """Writes bytes unique per 8-byte word and per ``seed`` (touches every
        page; a few hundred ms for 512 MiB, where random bytes take seconds),
        so that a transfer can be checked byte for byte."""
        words = self.size // 8
        w = np.frombuffer(self.mm, dtype=np.uint64, count=words)
        w[:] = np.arange(words, dtype=np.uint64)
        w *= np.uint64(0x9E3779B97F4A7C15)
        w ^= np.uint64((seed * 0xD6E8FEB86659FD93) & 0xFFFFFFFFFFFFFFFF)
        del w
        self.array[words * 8:] = seed & 0xFF

    def close(self) -> None:
        """Drops the array view, unmaps (unless a view is still exported) and
        unlinks the /dev/shm file."""
        self.array = None
        try:
            self.mm.close()
        except BufferError:
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@contextmanager
def segments(*sizes: int, prefix: str = "kvdtest"):
    """One :class:`ShmSegment` per size (bytes), closed on exit whatever happened."""
    segs = [ShmSegment(s, prefix) for s in sizes]
    try:
        yield segs
    finally:
        for s in segs:
            s.close()


def cleanup_segments(prefix: str = "kvdtest") -> list[str]:
    """Removes ``/dev/shm/<prefix>_<pid>_*`` whose creating process is gone
    (engine processes a scenario killed on purpose cannot clean up after
    themselves); returns the paths removed."""
    removed = []
    for path in glob.glob(f"{SHM_DIR}/{prefix}_*"):
        m = re.match(rf".*/{prefix}_(\d+)_", path)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def maps_of(pid: int) -> str:
    """``/proc/<pid>/maps``: what the process has mapped (shm segments show as /dev/shm/<name>)."""
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def shm_in_use_by(pid: int) -> set[str]:
    """Names (without ``/dev/shm/``) of the shm objects that ``pid`` maps or
    holds open; empty when the process is gone or not readable."""
    names: set[str] = set()
    prefix = str(SHM_DIR) + "/"
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            for line in f:
                idx = line.find(prefix.encode())
                if idx >= 0:
                    path = line[idx:].decode("utf-8", errors="replace").rstrip("\n")
                    names.add(path.removesuffix(" (deleted)")[len(prefix):])
    except OSError:
        pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                names.add(target[len(prefix):].removesuffix(" (deleted)"))
    except OSError:
        pass
    return names


def _list_shm() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


def _proc_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def proc_stat(pid: int) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state,
    ppid, pgrp, ...); [] when ``pid`` is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return []
    return data[data.rindex(b")") + 2:].split()  # comm may hold spaces and parentheses


def _pgid_of(pid: int) -> int | None:
    fields = proc_stat(pid)
    return int(fields[2]) if len(fields) > 2 else None


def pids_in_groups(pgids: Iterable[int]) -> list[int]:
    """Live pids whose process group is one of ``pgids``."""
    groups = set(pgids)
    if not groups:
        return []
    return [pid for pid in _proc_pids() if _pgid_of(pid) in groups]


class ShmTracker:
    """Tracks the /dev/shm objects a set of process groups creates (rules in
    the module docstring); ``pgids_fn()`` names the groups at each sample.
    A background thread samples every ``interval_s`` seconds until
    :meth:`stop` or :meth:`cleanup`."""

    def __init__(self, pgids_fn: Callable[[], Iterable[int]], interval_s: float = 1.0):
        self.before = _list_shm()
        self._pgids_fn = pgids_fn
        self._interval = interval_s
        self.ours: set[str] = set()
        self.pids_seen: set[int] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="kvd-shm-tracker", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        """Records the pids in the watched process groups and the /dev/shm names
        they hold that were not there before the run."""
        pids = pids_in_groups(self._pgids_fn())
        new_names: set[str] = set()
        for pid in pids:
            new_names |= shm_in_use_by(pid)
        with self._lock:
            self.pids_seen.update(pids)
            self.ours |= {n for n in new_names if n not in self.before}

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.sample()
            except Exception:  # never let the sampler kill the run
                pass

    def stop(self) -> None:
        """Stops the background sampler (waits up to 5 s)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def cleanup(self) -> tuple[list[str], list[str]]:
        """Removes the run's leftover objects. Returns ``(removed, left_alone)`` names."""
        self.stop()
        added = _list_shm() - self.before
        with self._lock:
            ours = set(self.ours)
            pid_strs = {str(p) for p in self.pids_seen}
        in_use: set[str] = set()
        for pid in _proc_pids():
            if pid != os.getpid():
                in_use |= shm_in_use_by(pid)
        removed, left = [], []
        for name in sorted(added):
            mine = name in ours or bool(set(re.findall(r"\d+", name)) & pid_strs)
            if mine and name not in in_use:
                try:
                    os.unlink(SHM_DIR / name)
                    removed.append(name)
                except FileNotFoundError:
                    pass
                except OSError:
                    left.append(name)
            else:
                left.append(name)
        return removed, left
