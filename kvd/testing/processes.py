"""Child processes of a harness: each in its own session (hence its own
process group), its output in ``<run dir>/<name>.log``, waited for with a
deadline, and stopped, with its whole group, whatever happened.

When a child dies or is not ready in time, :class:`ChildFailed` carries the
tail of its log. :meth:`ProcessSet.close` stops every group (SIGTERM to the
leader, then SIGKILL after a grace period) and removes the POSIX shared
memory objects (``/dev/shm``) that the run's processes created and left
behind (:class:`kvd.testing.shm.ShmTracker`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvd.testing.shm import ShmTracker, pids_in_groups, proc_stat
from kvd.testing.util import tail

# The directory holding the kvd package: children (daemons, engines that
# import kvd.shim.vllm) get it on PYTHONPATH, so this tree's code runs even
# where kvd is not installed.
KVD_ROOT = Path(__file__).resolve().parents[2]

# Command prefix with the effect of die_with_parent and no preexec_fn: sets
# PR_SET_PDEATHSIG (kept across exec) and execs the rest of the command line.
DIE_WITH_PARENT = (sys.executable, "-S", "-c",
                   "import ctypes, os, signal, sys; ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM, 0, 0, 0); "
                   "os.execvp(sys.argv[1], sys.argv[1:])")


def die_with_parent() -> None:
    """preexec_fn: SIGTERM the child when the harness process dies (even
    killed), so no daemon outlives a run (Linux PR_SET_PDEATHSIG).

    Not for children of a process that uses gRPC: a ``preexec_fn`` makes
    ``subprocess`` fork() instead of vfork(), and gRPC's fork handlers can then
    abort the child (seen here: SIGABRT, "epoll_wait error: Bad file
    descriptor"). Prefix the command with :data:`DIE_WITH_PARENT` instead.
    PR_SET_PDEATHSIG fires when the *thread* that started the child ends:
    start children from a thread that lives as long as they should.
    """
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


def set_autogroup_nice(pid: int, nice: int) -> bool:
    """Sets the nice value of ``pid``'s autogroup (``/proc/<pid>/autogroup``,
    sched(7)): the weight of its whole session against other sessions'.

    With autogroups on (``/proc/sys/kernel/sched_autogroup_enabled``), every
    child started in its own session is its own scheduling group, and a
    thread's own nice weighs it only within that group: ``nice -n 5`` on an
    engine does not put it below a daemon started in another session; this
    does. Raising it needs no privilege for a process of one's own uid;
    lowering it needs CAP_SYS_NICE. Returns False where it cannot be set (no autogroups,
    the process gone, not permitted)."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
        return True
    except OSError:
        return False


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` plus ``env``, with :data:`KVD_ROOT` first on PYTHONPATH."""
    full = {**os.environ, **(env or {})}
    pp = full.get("PYTHONPATH", "")
    full["PYTHONPATH"] = str(KVD_ROOT) + (os.pathsep + pp if pp else "")
    return full


class ChildFailed(RuntimeError):
    """A child process exited or did not become ready before its deadline;
    ``log_tail`` is the end of its log."""

    def __init__(self, name: str, what: str, log_tail: str):
        super().__init__(f"{name}: {what}\n--- last lines of {name}'s log ---\n{log_tail}")
        self.name = name
        self.what = what
        self.log_tail = log_tail


@dataclass
class Child:
    """A started child process (daemon or engine): its name, argv, log file,
    Popen handle, start time (monotonic seconds) and free-form ``meta``."""
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    meta: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        """The child's process id (also its process group id)."""
        return self.proc.pid

    def alive(self) -> bool:
        """True while the process has not exited."""
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the child's log."""
        return tail(self.log_path, lines)

    def fail(self, what: str) -> ChildFailed:
        """A :class:`ChildFailed` for this child saying ``what``, with its log tail (to raise)."""
        return ChildFailed(self.name, what, self.log_tail())


class ProcessSet:
    """Owns a run's children; a context manager that always cleans up.
    ``run_dir`` (created) holds the logs; ``log`` gets one-line notes."""

    def __init__(self, run_dir: Path, log: Callable[[str], None] = print):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self._pgids: set[int] = set()
        self._log = log
        self.shm = ShmTracker(lambda: set(self._pgids))
        self._closed = False

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None, wave: int | None = None) -> Child:
        """Starts ``argv`` in a new session, output to ``<run dir>/<name>.log``,
        environment :func:`child_env` (``env`` on top). Raises OSError when
        the program cannot be run.

        ``wave``: ``close()`` stops higher waves first, one wave at a time
        (default: its start index, i.e. reverse start order). The demo puts
        the daemons in wave 0 and the engines in wave 1, so the engines
        unregister from live daemons.
        """
        log_path = self.run_dir / f"{name}.log"
        full_env = child_env(env)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        logf = open(log_path, "ab", buffering=0)
        log_offset = logf.tell()  # where this child's lines start (the log may hold an earlier run's)
        logf.write(("$ " + " ".join(argv) + "\n").encode())
        try:
            proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=full_env, cwd=str(cwd or self.run_dir), start_new_session=True)
        finally:
            logf.close()
        self._pgids.add(proc.pid)  # new session: pgid == pid
        child = Child(name, list(argv), log_path, proc)
        child.meta["wave"] = len(self.children) if wave is None else wave
        child.meta["log_offset"] = log_offset
        self.children.append(child)
        return child

    def wait_ready(self, child: Child, check: Callable[[], bool], timeout_s: float,
                   interval_s: float = 0.5, what: str = "ready") -> float:
        """Polls ``check()`` (an exception counts as not ready) until it
        returns True. Returns the seconds waited. Raises ``ChildFailed`` when
        the child exits or ``timeout_s`` seconds pass."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while True:
            if not child.alive():
                raise child.fail(f"exited with code {child.proc.returncode} before {what}")
            try:
                if check():
                    return time.monotonic() - t0
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise child.fail(f"not {what} after {timeout_s:.0f} s")
            time.sleep(interval_s)

    def discard(self, child: Child, grace_s: float = 10.0) -> None:
        """Stops ``child``'s process group and forgets it (a failed start
        tried again: :meth:`check_alive` must not report it). Its shared
        memory objects are still cleaned at :meth:`close`."""
        self.stop(child, grace_s)
        self.children.remove(child)

    def check_alive(self) -> None:
        """Raises ChildFailed for the first child that has exited."""
        for c in self.children:
            if not c.alive():
                raise c.fail(f"exited unexpectedly with code {c.proc.returncode}")

    def stop(self, child: Child, grace_s: float = 10.0) -> None:
        """Stops ``child``'s process group (SIGTERM, then SIGKILL after ``grace_s`` seconds)."""
        stop_groups([child.pid], [child.proc], grace_s)

    def close(self, grace_s: float = 10.0) -> tuple[list[str], list[str]]:
        """Stops every child (highest wave first) and cleans /dev/shm; returns
        ``(removed, left_alone)`` shm names. A second call does nothing."""
        if self._closed:
            return [], []
        self._closed = True
        try:
            self.shm.sample()
        except Exception:
            pass
        for w in sorted({c.meta.get("wave", 0) for c in self.children}, reverse=True):
            group = [c for c in self.children if c.meta.get("wave", 0) == w]
            stop_groups([c.pid for c in group], [c.proc for c in group], grace_s)
        return self.shm.cleanup()

    def __enter__(self) -> "ProcessSet":
        return self

    def __exit__(self, *exc) -> None:
        removed, _ = self.close()
        if removed:
            self._log(f"removed {len(removed)} leftover /dev/shm object(s) of this run")


#: Seconds a Python resource tracker of a stopped group may take to unlink
#: what its processes left, once they are killed (:func:`stop_groups`).
TRACKER_GRACE_S = 3.0


def _is_resource_tracker(pid: int) -> bool:
    """``pid`` runs Python's ``multiprocessing.resource_tracker``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    state = proc_stat(pid)[:1]
    return bool(state) and state[0] != b"Z"


def stop_groups(pgids: list[int], procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERMs each group's leader, waits up to ``grace_s`` seconds for the
    whole groups to exit, then SIGKILLs whatever is left in them: Python's
    resource trackers last, given up to :data:`TRACKER_GRACE_S` to unlink
    what the rest registered.

    Only the leader gets SIGTERM: it shuts its own children down in order
    (vLLM's api_server stops its engine core and workers; torch_shm_manager
    then unlinks the workers' shared memory). Signalling the whole group at
    once would kill those helpers before they clean up.
    """
    for pgid in pgids:
        try:
            os.kill(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        for p in procs:
            p.poll()
        if not pids_in_groups(pgids):
            break
        time.sleep(0.2)
    # Python's resource trackers last: each unlinks the named semaphores its
    # processes registered (vLLM's, ``/dev/shm/sem.mp-*``) once the last of
    # them is gone, and it ignores SIGTERM; killed with its group, it left
    # them behind (an interrupted demo: two a run).
    trackers = [pid for pid in pids_in_groups(pgids) if _is_resource_tracker(pid)]
    for pid in pids_in_groups(pgids):
        if pid not in trackers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + TRACKER_GRACE_S
    while trackers and time.monotonic() < deadline:
        trackers = [pid for pid in trackers if _alive(pid)]
        time.sleep(0.05)
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    # Grandchildren re-parented to init die with SIGKILL too; give the kernel
    # a moment so that their mappings are gone before /dev/shm is cleaned.
    deadline = time.monotonic() + 5
    while pids_in_groups(pgids) and time.monotonic() < deadline:
        time.sleep(0.1)
