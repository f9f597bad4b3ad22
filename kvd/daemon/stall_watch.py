"""Says when the daemon's event loop stops running, and what every thread did.

A stalled event loop answers nothing: engines' sessions, peers' handshakes
and health checks all wait. Stalls of tens of seconds were seen on a 2-core
machine while vLLM TP engines ran beside the daemons, with nothing in the
log to say where the time went; this watch then showed the daemons' threads
given no CPU at all while the machine's CPUs were all busy with the engines
(docs/PERFORMANCE.md, "Daemons given no CPU"). Two parts:

- A task wakes every :data:`TICK_S` seconds. When it wakes more than
  :data:`WARN_S` late, it logs a WARNING: how late, the process's CPU seconds
  over the gap and each thread's (``/proc/self/task/<tid>/stat``, by Python
  thread name where there is one), and where the machine's CPUs went
  (``/proc/stat``). Little CPU over a long gap means the daemon waited: on
  a lock or the GIL (held by a thread blocked in a native call) when the
  machine had idle CPU, for a CPU when it had none; one thread's seconds
  mean it ran.
- A watchdog thread (``kvd-stall-dump``): when the loop has not ticked for
  ``stall_dump_s`` seconds, it writes every Python thread's stack to stderr
  (the daemon's log) once per stall: which call each thread is in. It is
  plain text, also under ``log_format = "json"``. It takes the GIL to read
  the frames (``sys._current_frames``), so a stall that holds the GIL in a
  native call gets no dump (the WARNING above still says which thread ran).
  ``faulthandler.dump_traceback_later`` did this without the GIL until a
  daemon died or hung in the middle of such a dump: on a loaded machine,
  its timer ran out while the process was stopped, and at SIGCONT its
  thread walked the main thread's frames while that thread ran again
  (CPython's GIL-free walk is best-effort).

- The same thread watches the NIXL thread (``nixl_call``): a call it has
  been inside for ``stall_dump_s`` seconds is logged at WARNING, naming the
  call, with every thread's stack, once per call (and when it returns). The
  loop runs on meanwhile, but every load, handshake and registration that
  needs NIXL waits (``kvd.core.runtime``: one thread makes every NIXL call),
  and nothing else said which call held it: a hung UCX connection looks like
  loads timing out one by one.

Every tick's lateness also goes to ``on_tick`` (the daemon's
``kvd_event_loop_lag_seconds`` histogram and ``kvd_event_loop_stalls_total``),
and :meth:`StallWatch.tick_age` tells, from any thread, how long ago the
loop last ticked: the metrics thread serves it as
``kvd_event_loop_tick_age_seconds``, which grows while a stall lasts (the
lag histogram learns of a stall only once it ends).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger("kvd.stall")

TICK_S = 1.0
WARN_S = 2.0   # a wake this late (seconds past its time) is logged
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu() -> dict[int, tuple[str, float]]:
    """Each thread of this process: ``{tid: (name, CPU seconds)}``; the name
    is the Python thread's where one runs there, else the kernel's ``comm``
    (gRPC's, UCX's and NIXL's own threads). Empty where ``/proc`` is not
    readable."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/self/task/{t}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        # comm is in parentheses and may hold spaces: fields after the last ')'.
        end = raw.rfind(b")")
        comm = raw[raw.find(b"(") + 1:end].decode(errors="replace")
        rest = raw[end + 2:].split()
        utime, stime = int(rest[11]), int(rest[12])   # fields 14 and 15 of proc(5)
        tid = int(t)
        out[tid] = (names.get(tid, comm), (utime + stime) / _CLK_TCK)
    return out


_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_cpu() -> tuple[int, ...]:
    """The machine's CPU time so far, in clock ticks, from the ``cpu`` line
    of ``/proc/stat`` (fields as :data:`_STAT_FIELDS`); empty where it is
    not readable."""
    try:
        with open("/proc/stat", "rb") as f:
            first = f.readline().split()
    except OSError:
        return ()
    return tuple(int(x) for x in first[1:1 + len(_STAT_FIELDS)])


def describe_machine(before: tuple[int, ...], after: tuple[int, ...]) -> str:
    """Where the machine's CPUs went between two :func:`machine_cpu`
    snapshots, in percent of all CPUs: ``"user 1 %, nice 60 %, system 39 %,
    idle 0 %, iowait 0 %, steal 0 %"``. With idle near 0 and this process
    given nothing, other processes had every CPU (vLLM TP engines on a
    2-core machine did: docs/PERFORMANCE.md, "Daemons given no CPU")."""
    if not before or len(before) != len(after):
        return "not known"
    d = dict(zip(_STAT_FIELDS, (b - a for a, b in zip(before, after))))
    total = sum(d.values()) or 1
    return ", ".join(f"{k} {100 * d[k] / total:.0f} %" for k in ("user", "nice", "system", "idle", "iowait", "steal"))


def describe_gap(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                 top: int = 6) -> str:
    """The threads that ran between two :func:`thread_cpu` snapshots, most
    CPU first: ``"kvd-nixl 12.30 s, MainThread 0.10 s, ..."`` (at most
    ``top``; threads with no tick of CPU are left out)."""
    used = []
    for tid, (name, cpu) in after.items():
        d = cpu - before.get(tid, (name, 0.0))[1]
        if d > 0:
            used.append((d, name, tid))
    used.sort(reverse=True)
    if not used:
        return "no thread ran"
    return ", ".join(f"{name}[{tid}] {d:.2f} s" for d, name, tid in used[:top])


class StallWatch:
    """The event-loop stall watch of one daemon (:meth:`start`, :meth:`stop`).

    Args:
        stall_dump_s: seconds without a tick after which every thread's
            Python stack is written to stderr (``faulthandler``); 0: no dump,
            the late-wake WARNING only.
        tick_s, warn_s: the tick interval (at most a quarter of
            ``stall_dump_s``) and the lateness logged (seconds).
        on_tick: called on the loop after every tick with
            ``(late_s, stalled)``: seconds past its time, and whether it
            was late enough to be logged (``warn_s``). Must not raise.
        nixl_call: the NIXL thread's call now, ``(name, time.monotonic()
            at its start)`` or None (``Runtime.nixl_call``); called from the
            watch's own thread. None, or ``stall_dump_s`` 0: not watched.
    """

    def __init__(self, stall_dump_s: float, tick_s: float = TICK_S, warn_s: float = WARN_S,
                 on_tick: Callable[[float, bool], None] | None = None,
                 nixl_call: Callable[[], tuple[str, float] | None] | None = None):
        self.stall_dump_s = stall_dump_s
        self.nixl_call = nixl_call
        self.nixl_stalls = 0  # NIXL calls logged as stuck
        # Ticks (and the watchdog's checks) well inside the dump's bound.
        self.tick_s = min(tick_s, stall_dump_s / 4) if stall_dump_s > 0 else tick_s
        self.warn_s = warn_s
        self.on_tick = on_tick
        self.stalls = 0          # late wakes logged
        self.longest_s = 0.0     # the longest, seconds past its time
        self._task: asyncio.Task | None = None
        self._dumper: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ticked: float | None = None  # time.monotonic() of the last tick (or the start)

    def tick_age(self) -> float:
        """Seconds since the loop last ticked (0 before :meth:`start` and after :meth:`stop`):
        about ``tick_s`` at most while it runs, more while it is stalled.
        Safe from any thread (one float read)."""
        t = self._ticked
        return 0.0 if t is None else max(0.0, time.monotonic() - t)

    def start(self) -> None:
        """Starts the watch on the running event loop."""
        self._ticked = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvd-stall-watch")
        if self.stall_dump_s > 0:
            self._stopping.clear()
            self._dumper = threading.Thread(target=self._watch_dog, name="kvd-stall-dump", daemon=True)
            self._dumper.start()

    async def stop(self) -> None:
        """Stops the watch and disarms the dump; :meth:`tick_age` reads 0
        from now on (a loop no longer watched is not a stalled one)."""
        self._ticked = None
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._stopping.set()
        if self._dumper is not None:
            self._dumper.join(5.0)
            self._dumper = None

    def _watch_dog(self) -> None:
        """The ``kvd-stall-dump`` thread: every ``tick_s``, a loop that has not
        ticked for ``stall_dump_s`` gets its threads' stacks dumped, once per stall."""
        dumped = None  # the tick (its time) whose stall was dumped
        stuck = None  # the NIXL call (name, start) logged as stuck
        while not self._stopping.wait(self.tick_s):
            t = self._ticked
            if t is not None and t != dumped and time.monotonic() - t >= self.stall_dump_s:
                dumped = t
                dump_stacks(f"the event loop has not run for {time.monotonic() - t:.1f} s "
                            f"(stall_dump_s {self.stall_dump_s:g})")
            if self.nixl_call is not None:
                stuck = self._watch_nixl(stuck)

    def _watch_nixl(self, stuck: tuple[str, float] | None) -> tuple[str, float] | None:
        """One look at the NIXL thread: a call inside for ``stall_dump_s`` is
        logged with every thread's stack (once); the end of the call last
        logged is said. Returns the call logged as stuck now (or None)."""
        call = self.nixl_call()
        now = time.monotonic()
        if stuck is not None and call != stuck:
            log.warning("the NIXL thread's %s returned after about %.1f s", stuck[0], now - stuck[1])
            stuck = None
        if call is not None and stuck is None and now - call[1] >= self.stall_dump_s:
            stuck = call
            self.nixl_stalls += 1
            why = (f"the NIXL thread has been inside {call[0]} for {now - call[1]:.1f} s (stall_dump_s "
                   f"{self.stall_dump_s:g}): every load, handshake and registration that needs NIXL waits")
            log.warning("%s; each thread's Python stack follows in the log", why)
            dump_stacks(why)
        return stuck

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        cpu = os.times()
        threads = thread_cpu()
        machine = machine_cpu()
        while True:
            due = loop.time() + self.tick_s
            await asyncio.sleep(self.tick_s)
            late = max(0.0, loop.time() - due)
            if self._ticked is not None:  # not stopped meanwhile
                self._ticked = time.monotonic()
            if self.on_tick is not None:
                self.on_tick(late, late > self.warn_s)
            now_cpu, now_threads, now_machine = os.times(), thread_cpu(), machine_cpu()
            if late > self.warn_s:
                self.stalls += 1
                self.longest_s = max(self.longest_s, late)
                log.warning(
                    "event loop stalled %.1f s (nothing served meanwhile): process CPU %.2f s user, "
                    "%.2f s system over the last %.1f s; threads that ran: %s; the machine's CPUs: %s%s",
                    late, now_cpu.user - cpu.user, now_cpu.system - cpu.system, self.tick_s + late,
                    describe_gap(threads, now_threads), describe_machine(machine, now_machine),
                    (f"; each thread's Python stack is written to the log once a stall passes "
                     f"{self.stall_dump_s:g} s (stall_dump_s)" if 0 < self.stall_dump_s <= late else ""))
            cpu, threads, machine = now_cpu, now_threads, now_machine


def dump_stacks(why: str, out=None) -> None:
    """Writes every Python thread's stack (most recent call first), by
    thread name, to ``out`` (stderr), headed by ``why``; never raises."""
    out = out or sys.stderr
    try:
        names = {t.ident: t.name for t in threading.enumerate()}
        lines = [f"Stall: {why}; every thread's Python stack:"]
        for ident, frame in sys._current_frames().items():
            lines.append(f"Thread {names.get(ident, '?')} (0x{ident:x}) (most recent call first):")
            for fs in reversed(traceback.extract_stack(frame)):
                lines.append(f'  File "{fs.filename}", line {fs.lineno} in {fs.name}')
        out.write("\n".join(lines) + "\n")
        out.flush()
    except Exception:  # stderr closed: the WARNING still goes to the log
        pass
