"""What every room of the core shares: bounds, counters, the registered
workers, the NIXL thread, event delivery and the metrics hook.

One ``Runtime`` per daemon, made by ``kvd.core.node.Node`` and handed to each
room (``registry``, ``peers``, ``holds``, ``pull``, ``push``, ``progress``);
the rooms keep no state of their own beyond what they name.

Every NIXL call runs on one thread (``kvd-nixl``), or, for a small READ's
post while that thread is idle, on the event loop itself
(``Runtime.nixl_now``): no two NIXL calls ever overlap. More threads
would not run NIXL work side by side: NIXL's Python binding holds the GIL
through most native calls (measured: a Python thread that yields in a loop
ran 320 times during a 415 ms ``prep_xfer_dlist`` of 2M rows, 4,539 times
during a sleep as long), so a long call stops the whole daemon whichever
thread makes it; ``transfer()`` is the exception (during a 256 MiB
shared-memory READ's post, 60-96 ms, another thread ran 60-84 % as often
as during a sleep: ``benchmarks/gil_transfer.py``), which is why only
small READs are posted on the loop. What keeps handshakes and answers from waiting is that no
call on a request's path is long: descriptor lists are bounded per pair
(``Bounds.max_prepped_rows``), a handshake answer needs no NIXL call, and
the ranks of a remote engine are handshaken in parallel (``kvd.core.peers``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Callable

from kvd.core.aborts import AbortSlots
from kvd.core.events import Event, FailureKind, LoadFailed, NotFound
from kvd.core.hold_feed import HoldFeeds
from kvd.core.leases import EarlyBudget
from kvd.core.limits import BOUNDS, Limits
from kvd.core.load_ids import LoadIds
from kvd.core.nixl_agent import NixlAgent
from kvd.core.state import Counters, Worker, WorkerKey, overflow
from kvd.core.throttle import Throttled, Throttles
from kvd.logtext import clip

log = logging.getLogger("kvd.core")

# A load's failure reason goes to the log and to its engine (``LoadFailed``);
# some quote a peer's or an engine's text. Reasons kvd writes are under a few
# hundred characters; a peer's 16 MiB field once made each a 16 MiB line and
# event (attacker review).
MAX_REASON_CHARS = 4096


def _resolve(fut: asyncio.Future, ok: bool, value) -> None:
    if not fut.cancelled():  # an awaiting task cancelled meanwhile: the call ran anyway
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)


class NixlThread:
    """The one thread that makes every NIXL call, in submission order.

    :meth:`call` hands it ``fn(*args)`` and returns an asyncio future the
    event loop resolves; a call whose future is cancelled before it starts
    is skipped (as ``run_in_executor`` does), one already running finishes
    and its result is dropped. A queue and ``call_soon_threadsafe`` instead of
    ``loop.run_in_executor``: one hand-off each way, without a
    ``concurrent.futures.Future`` chained to the asyncio one (measured here
    with uvloop, a no-op call's round trip: median ~45 us through a
    one-thread ``ThreadPoolExecutor``, ~18 us this way; a small load makes
    two to four such calls on each daemon).
    """

    def __init__(self, name: str = "kvd-nixl"):
        self._name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()  # start/stop only
        # Calls queued or running on the thread (or running inline), under
        # ``_busy_lock``: :meth:`try_now` runs one only when it is 0, so no
        # two calls ever overlap and submission order holds.
        self._busy = 0
        self._busy_lock = threading.Lock()
        # The call running on the thread and when it started (time.monotonic),
        # None between calls: read by the stall watch's thread (:meth:`current`).
        self._current: tuple[Callable, float] | None = None

    def current(self) -> tuple[str, float] | None:
        """The call the thread is inside now: ``(its name, when it started:
        time.monotonic() seconds)``, or None when it waits for one. Safe from
        any thread (one reference read). A call run inline (:meth:`try_now`)
        is the event loop's, watched as the loop is."""
        c = self._current
        if c is None:
            return None
        fn, t0 = c
        return getattr(fn, "__qualname__", None) or repr(fn), t0

    def call(self, fn, *args) -> asyncio.Future:
        """Queues ``fn(*args)``; the future holds its result or its error.

        Raises:
            RuntimeError: after :meth:`shutdown` (as an executor would).
        """
        if self._thread is None:
            self._start()  # the first call; raises after shutdown
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._busy_lock:
            self._busy += 1
        self._calls.put((loop, fut, fn, args))
        return fut

    def try_now(self, fn, *args) -> tuple[bool, object]:
        """Runs ``fn(*args)`` on the calling thread (the event loop's) when
        the NIXL thread has nothing queued or running: ``(True, result)``;
        else runs nothing: ``(False, None)``, and the caller uses
        :meth:`call`. Errors raised by ``fn`` propagate.

        Why: a small READ's post takes tens of microseconds, and the two
        thread hand-offs around it cost more than the call (each a wake-up;
        docs/PERFORMANCE.md, "sixth round"). Running it here keeps the rules
        of the thread: one call at a time (``_busy``), in submission order.

        Raises:
            RuntimeError: after :meth:`shutdown`.
        """
        if self._closed:
            raise RuntimeError("the NIXL thread is shut down")
        with self._busy_lock:
            if self._busy:
                return False, None
            self._busy = 1
        try:
            return True, fn(*args)
        finally:
            with self._busy_lock:
                self._busy -= 1

    def _start(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the NIXL thread is shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            loop, fut, fn, args = item
            if fut.cancelled():
                # Its awaiting task was cancelled before the call started: the
                # call is skipped, as an executor skips a cancelled work item
                # (e.g. a post whose load was given up must not go out).
                with self._busy_lock:
                    self._busy -= 1
                continue
            self._current = (fn, time.monotonic())
            try:
                value, ok = fn(*args), True
            except BaseException as e:  # handed to the awaiting task, as an executor does
                value, ok = e, False
            self._current = None
            with self._busy_lock:
                self._busy -= 1
            try:
                loop.call_soon_threadsafe(_resolve, fut, ok, value)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass
            del item, fut, value

    def shutdown(self) -> None:
        """Runs the calls already queued, then stops the thread; later calls raise."""
        with self._lock:
            self._closed = True
            t, self._thread = self._thread, None
        if t is not None:
            self._calls.put(None)
            t.join()


class Runtime:
    """Shared state of one daemon's core.

    Args:
        limits: deadlines and bounds.
        on_event: hook ``(name, fields)`` for metrics: ``transfer`` (bytes,
            seconds, descs), ``failure`` (kind: a ``FailureKind``),
            ``handshake`` (seconds), ``register`` (engine).
    """

    def __init__(self, limits: Limits, on_event: Callable[[str, dict], None] | None = None):
        self.limits = limits
        self.on_event = on_event or (lambda name, fields: None)
        self.dropped_warning = Throttled(log)
        #: Per-request lines an engine or a peer may repeat at will, at most
        #: one a second per (site, worker) with the count (kvd.core.throttle).
        self.lines = Throttles(log)
        self.workers: dict[WorkerKey, Worker] = {}
        self.counters = Counters()
        self.feeds = HoldFeeds()  # each engine's lease starts and ends, for reader daemons (PeerService.Holds)
        self.aborts = AbortSlots(limits)  # early-free notifications in flight (AbortLoad, empty loads)
        self.load_ids = LoadIds(limits)  # block ids of loads in flight, per worker and uid, capped
        self.early_budget = EarlyBudget()  # notifications before their hold, all workers together
        self.started = time.monotonic()
        # NIXL transfer handles not released yet (still in progress: a READ
        # given up at its deadline or at its session's end whose bytes may
        # still arrive): the next poll tries again; ``leaked_handles`` in stats.
        self.zombies: list[tuple[NixlAgent, object]] = []
        # Warm-up READs of new pairs still in progress (``kvd.core.peers``):
        # ``(agent, handle, give-up time)``. Apart from ``zombies``: their
        # bytes can land only in the agent's scratch page, so they are given
        # up by force at their time and never make a worker's end wait.
        self.warm_ups: list[tuple[NixlAgent, object, float]] = []
        # Workers unregistered while a READ was in progress whose NIXL agent
        # could not be destroyed (a handle still bound to it): their mappings
        # are kept (a late byte lands in memory still theirs, never in a freed
        # or reused mapping) until it is (``Registry.free_quarantined``).
        self.quarantine: list[Worker] = []
        # Push mode, source side: WRITEs in flight out of a worker's memory,
        # id(handle) -> (source worker, handle, future of its end state,
        # deadline) (``kvd.core.push``). Here, not in Push: a worker whose
        # WRITE runs may not have its memory unmapped (``Registry``).
        self.writes: dict[int, tuple[Worker, object, asyncio.Future, float]] = {}
        self.kick = asyncio.Event()  # wakes the progress loop (a transfer was posted)
        self._inline_bytes = 0  # bytes posted on the loop in its current pass (nixl_now)
        self.draining = False  # set at SIGTERM: no new loads or sessions, no second tries
        self.closing = False
        self._nixl = NixlThread()

    def nixl(self, fn, *args) -> asyncio.Future:
        """Queues ``fn(*args)`` on the NIXL thread now; the future (await it)
        holds its result or its error. Cancelling the future before the
        call starts skips it (``NixlThread.call``).

        Raises:
            RuntimeError: after :meth:`shutdown`.
        """
        return self._nixl.call(fn, *args)

    def nixl_now(self, nbytes: int, fn, *args) -> tuple[bool, object]:
        """Runs ``fn(*args)``, a READ's post moving ``nbytes``, here on the
        event loop when the NIXL thread is idle (``NixlThread.try_now``: no
        hand-off, no wake-up): ``(True, result)``; ``(False, None)`` when the
        thread is busy or this pass of the loop has posted its share
        (``BOUNDS.inline_bytes_per_pass``): then use :meth:`nixl`. For short
        calls only, never one that releases the GIL for long (a READ's post
        or a same-node copy's memmove of more than
        ``BOUNDS.inline_post_max_bytes``): the loop would wait where the
        thread lets it run."""
        cost = max(nbytes, BOUNDS.inline_post_min_bytes)
        if self._inline_bytes and self._inline_bytes + cost > BOUNDS.inline_bytes_per_pass:
            return False, None
        ran, value = self._nixl.try_now(fn, *args)
        if ran:
            if not self._inline_bytes:
                asyncio.get_running_loop().call_soon(self._new_pass)  # runs in the loop's next pass
            self._inline_bytes += cost
        return ran, value

    def _new_pass(self) -> None:
        self._inline_bytes = 0

    def shutdown(self) -> None:
        """Stops the NIXL thread (after its last call)."""
        self._nixl.shutdown()

    def nixl_call(self) -> tuple[str, float] | None:
        """The NIXL thread's call now, ``(name, time.monotonic() at its
        start)``, or None (``NixlThread.current``); safe from any thread."""
        return self._nixl.current()

    def timeout(self, timeout_s: float) -> float:
        """A request's timeout (seconds): the daemon default for 0, negative or NaN; capped."""
        if not timeout_s > 0:
            return self.limits.transfer_timeout_s
        return min(timeout_s, self.limits.max_transfer_timeout_s)

    def worker(self, engine_id: str, tp_rank: int) -> Worker:
        """The registered worker ``(engine_id, tp_rank)``.

        Raises:
            NotFound: no such worker on this daemon.
        """
        w = self.workers.get((engine_id, tp_rank))
        if w is None:
            raise NotFound(f"engine {engine_id!r} rank {tp_rank} is not registered with this daemon")
        return w

    def registered(self, w: Worker) -> bool:
        """True while ``w`` itself is registered: a worker unregistered and
        registered again under the same key is another object, and the old
        one's NIXL state is freed (its commands must not reach NIXL)."""
        return self.workers.get(w.key) is w

    def emit(self, w: Worker, ev: Event) -> None:
        """Queues ``ev`` for ``w``'s session, or writes it at once through the
        session's ``sink`` when one is set and nothing is queued. Past
        ``BOUNDS.max_pending_events`` queued, the oldest event is dropped
        for a session gone (reconnecting), and an open session is dropped;
        so it is past ``Limits.max_queued_event_bytes``
        (``kvd.core.state.overflow``)."""
        events = w.session.events
        sink = w.session.sink
        if sink is not None and not events:
            try:
                if sink(ev):
                    return  # written to the engine's socket already (its order kept: nothing was queued)
            except Exception:  # emit never raises: the event is queued, the session's task writes it
                w.session.sink = w.session.on_overflow = None
                self.dropped_warning.warning("%s: writing an event failed; queued instead", w.label)
                log.debug("event writer failed", exc_info=True)
        if len(events) >= BOUNDS.max_pending_events and w.session.streams:
            # An open session that reads too slowly ends (its engine learns
            # at once: loads failed, reconnect) rather than lose events unseen.
            overflow(w, f"{BOUNDS.max_pending_events} events (a bound of kvd)")
        elif len(events) >= BOUNDS.max_pending_events:
            dropped = events.popleft()
            # One line a second at most: a session that never reads, fed
            # events by others, must not turn each into a log line.
            self.dropped_warning.warning("%s: event queue full, dropped %s", w.label, dropped)
        events.append(ev)
        if events.nbytes > self.limits.max_queued_event_bytes:
            overflow(w, f"max_queued_event_bytes {self.limits.max_queued_event_bytes}")
        w.session.wakeup.set()

    def fail_load(self, w: Worker, request_id: str, block_ids: list[int], kind: FailureKind, reason: str,
                  peer: str = "") -> None:
        """Ends a load as failed: counted, logged (the engine's own invalid
        or busy loads at most once a second, with the count of the others),
        reported to metrics, and
        ``LoadFailed`` naming ``block_ids`` (local, flat) queued for the engine.
        ``reason`` starts with ``kind``'s word (``"timeout: ..."``); it is
        cut to ``MAX_REASON_CHARS`` (with the length it had), wherever its
        text came from."""
        reason = clip(reason, MAX_REASON_CHARS)
        self.counters.transfers_failed += 1
        # One line a second per kind and worker: an engine may send bad loads,
        # or loads from a dead peer, at will (reviews measured 1M lines for
        # 1M loads, and 1,757 a second from a refused address); the metric
        # kvd_transfer_failures_total counts every one.
        self.lines.warning((kind, w.key), "%s request=%s peer=%s: load failed: %s", w.label, request_id,
                           peer or "?", reason)
        self.on_event("failure", {"kind": kind})
        self.emit(w, LoadFailed(request_id, block_ids, reason, kind))

    def release_handle(self, agent: NixlAgent, handle, settled: bool = False) -> None:
        """NIXL thread: releases a transfer handle that has ended, or keeps it
        (still in progress, or refused) for the next poll; ``settled`` as in
        :meth:`NixlAgent.release`."""
        if not agent.release(handle, settled):
            self.zombies.append((agent, handle))

    def warm_up_posted(self, agent: NixlAgent, handle, state: str) -> None:
        """NIXL thread: a warm-up READ was posted: released now when it is
        DONE or ERR, else kept in ``warm_ups`` until it is, or until
        ``handshake_timeout_s`` from now (a peer that answered and then
        froze: the READ would never end)."""
        if state == "PROC":
            self.warm_ups.append((agent, handle, time.monotonic() + self.limits.handshake_timeout_s))
        else:
            agent.release(handle, settled=True)

    def release_warm_ups(self, now: float, agent: NixlAgent | None = None) -> None:
        """NIXL thread: releases the warm-up READs (of ``agent`` only, if
        given: by force, as its agent is about to be destroyed) that ended
        or whose time is up (by force: nothing but a scratch page is at stake)."""
        for item in list(self.warm_ups):
            a, h, until = item
            if agent is not None and a is not agent:
                continue
            if agent is not None or now >= until:
                if agent is None:
                    # UCX never wired the pair up: its loads' READs may stall too.
                    log.warning("%s: warm-up READ not done after %.0f s (handshake_timeout_s); given up",
                                a.name, self.limits.handshake_timeout_s)
                a.release(h, settled=True)
                self.warm_ups.remove(item)
            elif a.release(h):
                self.warm_ups.remove(item)
                took = now - (until - self.limits.handshake_timeout_s)
                if took > 1.0:  # a slow wire-up: the pair's first loads were slow too
                    log.info("%s: warm-up READ ended %.1f s after its post", a.name, took)

    def release_zombies(self, agent: NixlAgent | None = None) -> int:
        """NIXL thread: releases the handles in ``zombies`` (of ``agent``
        only, if given) whose transfers have ended; returns how many of them
        are left. Removes entries one by one: the event loop may append
        meanwhile (``Pull.expire``), and no append may be lost, since a lost
        one would let its worker's memory be freed under a READ."""
        left = 0
        for item in list(self.zombies):
            a, h = item
            if agent is not None and a is not agent:
                continue
            if a.release(h):
                self.zombies.remove(item)
            else:
                left += 1
        return left
