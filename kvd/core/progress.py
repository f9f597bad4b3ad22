"""Progress: the loop that drives every transfer to its end.

Each round polls NIXL on the NIXL thread (:meth:`Progress.poll`: READs and
WRITEs that ended, notifications received, handles left to release, retired
remotes no load uses any more), then, on the event loop, hands each result
to its room (``pull``, ``push``, ``holds``), expires leases and loads past
their deadlines, and drops workers detached past ``Limits.detach_grace_s``.
It polls every ``Limits.poll_busy_s`` while transfers are in flight and
something moved lately, ``Limits.poll_idle_s`` otherwise, or at once when a
post kicks it. Between the two, a busy poll waits :data:`BACKOFF_FRACTION`
of the time since the last thing moved (a post, a transfer ended, a
notification): a transfer that stalls (a peer stopped; a WRITE to a reader
frozen with ``SIGSTOP``, measured here) cost the daemon ~80 % of a core in
2,000 polls a second until its deadline, while a long transfer that ends
is seen at most that fraction of its time late.

Notifications are handled at most :data:`NOTIFS_PER_PASS` a pass, the rest
kept for the next passes (which come at once) up to :data:`MAX_BACKLOG` /
:data:`MAX_BACKLOG_BYTES`, the excess dropped and counted: NIXL hands over
everything queued in one call, and a hostile peer that loaded a source's
agent metadata could send bare notifications faster than one pass handled
them (414k in 10 s held the event loop 9.7 s and grew RSS by 800 MB).

The excess is dropped on the NIXL thread, in :meth:`Progress.poll`, as a
count: nothing bounds what NIXL queues between two polls (its UCX progress
thread appends every notification that arrives to an unbounded list, which
``get_new_notifs`` hands over whole, as Python bytes: NIXL 1.5 has no call
that takes part of it or refuses a sender), so what the daemon holds is the
flood's rate times the time between polls, and a poll must cost little per
notification to keep that time short. Measured here (2 cores): NIXL's
progress thread ~1.1 us of CPU per 1,000-byte notification received, the
poll's ``get_new_notifs`` ~0.5-0.7 us; dropping each on the event loop as
well (~1-2 us more) let a 240k/s flood outrun the polls, which then took
seconds each and found ever more queued (RSS +0.8-2.4 GB).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from kvd.core import nixl_agent
from kvd.core.events import NotFound
from kvd.core.holds import Holds
from kvd.core.peers import Peers
from kvd.core.pull import Pull
from kvd.core.push import Push
from kvd.core.registry import Registry
from kvd.core.runtime import Runtime
from kvd.core.state import WorkerKey
from kvd.core.throttle import Throttled

log = logging.getLogger("kvd.core")

#: Notification pieces handled in one pass of the loop (a notification
#: holds one per load its READ carried, at most
#: ``BOUNDS.max_loads_per_read``): each is parsed and looked up in its
#: worker's lease table, ~3 us with a 1,000-byte id and the early table
#: full (measured here): ~3 ms a pass.
NOTIFS_PER_PASS = 1024
#: Notifications received and not handled yet, at most (count), and their
#: messages' bytes at most: an honest burst is far smaller (one a reader's
#: READ, ~100 bytes); a flood past either is dropped, each one counted (a
#: reader's dropped notification leaves its lease to end at its deadline).
MAX_BACKLOG = 65536
MAX_BACKLOG_BYTES = 16 << 20
#: A busy poll's wait, as a fraction of the time since anything last moved
#: (between ``Limits.poll_busy_s`` and ``Limits.poll_idle_s``): a transfer
#: still running after 100 ms is polled every 1 ms, after 0.5 s every 5 ms.
#: 0: every ``poll_busy_s``, as before.
BACKOFF_FRACTION = 0.01


class Progress:
    """The progress loop of one daemon (:meth:`start` / :meth:`stop`)."""

    def __init__(self, rt: Runtime, registry: Registry, peers: Peers, holds: Holds, pull: Pull, push: Push):
        self.rt = rt
        self.registry = registry
        self.peers = peers
        self.holds = holds
        self.pull = pull
        self.push = push
        self._task: asyncio.Task | None = None
        self._notifs: deque = deque()  # (worker, remote agent, message), oldest first
        self._notif_bytes = 0  # bytes of the messages in _notifs
        # Since start, past MAX_BACKLOG / MAX_BACKLOG_BYTES: GetStats' notifications_dropped,
        # kvd_notifications_dropped_total, a `kvd status` line when nonzero.
        self.notifs_dropped = 0
        self._dropped_warning = Throttled(log, interval_s=10.0)
        self._release_now = False  # READs ended this pass, in Runtime.zombies (reads_ended)
        self._moved_at = 0.0  # when a post, an ended transfer or a notification was last seen (_wait_s)

    def start(self) -> None:
        """Starts the loop on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvd-progress")

    async def stop(self) -> None:
        """Stops the loop (after its current round)."""
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    def poll(self):
        """NIXL thread: ``(writes ended, results)``; each result is ``(worker,
        None | agent name, "STATES" | "NOTIF" | "DROPPED", states | message |
        count)``: ``"STATES"`` maps each transfer handle of the worker's loads
        in flight to its NIXL state, ``"DROPPED"`` counts one remote agent's
        notifications of this poll that did not fit the backlog (:meth:`_take`).

        It releases no handle of a load: the event loop owns ``load.parts``
        and gives an ended READ's handle to ``Runtime.zombies``, released at
        the next poll (:meth:`reads_ended`). Released here, a handle a
        session's end read from the parts on the loop meanwhile went to the
        zombies as well and was released twice: a coalesced READ is a part
        of several loads, and this thread saw only those not yet taken."""
        self.rt.release_zombies()
        nixl_agent.destroy_deferred(time.monotonic())
        if self.rt.warm_ups:
            self.rt.release_warm_ups(time.monotonic())
        writes = self.push.poll_writes(time.monotonic())
        done = []
        # The loop changes the backlog only between polls.
        room = [MAX_BACKLOG - len(self._notifs), MAX_BACKLOG_BYTES - self._notif_bytes]
        for w in list(self.rt.workers.values()):
            # A coalesced READ is a part of each load it carries
            # (kvd.core.coalesce): polled once. Alive: only this thread
            # releases handles, and those the loop gave up only from here.
            states: dict = {}
            for load in list(w.inflight.values()):
                for h, _ in list(load.parts):
                    if h not in states:
                        states[h] = w.agent.state(h)
            if states:
                done.append((w, None, "STATES", states))
            if w.pairs.retired:
                self.peers.free_unused_retired(w)
            notifs = w.agent.notifs()
            if notifs:
                room = self._take(w, notifs, done, room)
        return writes, done

    def _take(self, w, notifs: dict, done: list, room: list) -> list:
        """NIXL thread: appends to ``done`` the notifications of ``notifs``
        (``{remote agent: [message, ...]}``, what NIXL handed over) that fit
        the backlog's ``room`` (``[count, bytes]`` left, updated), and for
        each remote agent the count of the rest as one ``"DROPPED"`` result.

        The excess is dropped here, before the event loop sees it, at no
        Python cost per notification: handling each on the loop only to drop
        it (~1 us) made a pass as slow as the flood was big, and NIXL queues
        everything that arrives meanwhile (its list is not bounded)."""
        count, nbytes = room
        for agent_name, msgs in notifs.items():
            kept = 0
            for m in msgs[:count]:
                if len(m) > nbytes:
                    break
                nbytes -= len(m)
                done.append((w, agent_name, "NOTIF", m))
                kept += 1
            count -= kept
            if kept < len(msgs):
                done.append((w, agent_name, "DROPPED", len(msgs) - kept))
        return [count, nbytes]

    async def _loop(self) -> None:
        rt = self.rt
        while not rt.closing:
            try:
                writes, results = await rt.nixl(self.poll)
            except Exception:
                log.exception("progress poll failed")
                writes, results = [], []
            now = time.monotonic()
            self.push.complete(writes)
            for w, a, st, extra in results:
                if st == "NOTIF":
                    self._keep(w, a, extra)
                elif st == "DROPPED":
                    self._drop(w, a, extra)
                elif st == "STATES" and rt.registered(w):
                    self.reads_ended(w, extra, now)
            # The last poll's entries hold handles (a STATES dict): kept past
            # this pass they would keep a quarantined worker's agent alive
            # until the next poll with results (an attacker review: 40 s).
            results = w = a = extra = None
            if writes or self._notifs or self._release_now:
                self._moved_at = now
            self.handle_notifs(NOTIFS_PER_PASS)
            self.expire(now)
            if rt.quarantine:
                await self.registry.free_quarantined()
            if self._notifs or self._release_now:
                # More to handle, or READs that ended to release: poll again
                # at once (awaiting the NIXL thread yields the loop).
                self._release_now = False
                continue
            busy = bool(self.push.writes) or any(w.inflight for w in rt.workers.values())
            if rt.kick.is_set():
                # A post kicked it during this pass (a push's post runs on the
                # NIXL thread, often beside the poll): cleared below, it would
                # otherwise go unseen and the first wait after a quiet spell
                # be 1 % of that spell, up to poll_idle_s (an attacker review:
                # a push's end seen ~5 ms late, 8 of 11 times).
                self._moved_at = now
            rt.kick.clear()
            try:
                async with asyncio.timeout(self._wait_s(now) if busy else rt.limits.poll_idle_s):
                    await rt.kick.wait()
                self._moved_at = time.monotonic()  # a post kicked it
            except TimeoutError:
                pass

    def _wait_s(self, now: float) -> float:
        """Seconds a busy poll waits for a kick: ``poll_busy_s`` while
        things move, growing with the quiet (:data:`BACKOFF_FRACTION`) up to
        ``poll_idle_s``."""
        lim = self.rt.limits
        return max(lim.poll_busy_s, min(lim.poll_idle_s, (now - self._moved_at) * BACKOFF_FRACTION))

    def reads_ended(self, w, states: dict, now: float) -> None:
        """Event loop: ``states`` (handle -> NIXL state, a poll's) applied to
        ``w``'s loads in flight: an ended READ leaves the parts of every load
        it carries and goes to ``Runtime.zombies`` once (released by the next
        poll, which comes at once); a load whose READ failed is told
        (``Pull.read_failed``), one with no part left ends (``Pull.finish``).
        A handle not in ``states`` (posted since the poll) stays."""
        ended: dict = {}
        for rid, load in list(w.inflight.items()):
            running = []
            for h, r in load.parts:
                st = states.get(h, "PROC")
                if st == "PROC":
                    running.append((h, r))
                    continue
                ended[h] = None
                if st != "DONE":
                    self.pull.read_failed(w, rid, r)
            if len(running) != len(load.parts):
                load.parts = running
                if not running:
                    self.pull.finish(w, rid, now)
        if ended:
            self.rt.zombies.extend((w.agent, h) for h in ended)
            self._release_now = True  # the next poll, at once, releases them

    def _keep(self, w, remote_agent: str, msg: bytes) -> None:
        """Queues a notification for :meth:`handle_notifs`, or drops and
        counts it past :data:`MAX_BACKLOG` / :data:`MAX_BACKLOG_BYTES`."""
        if len(self._notifs) >= MAX_BACKLOG or self._notif_bytes + len(msg) > MAX_BACKLOG_BYTES:
            self._drop(w, remote_agent, 1)
            return
        self._notifs.append((w, remote_agent, msg))
        self._notif_bytes += len(msg)

    def _drop(self, w, remote_agent: str, n: int) -> None:
        """Counts ``n`` notifications from ``remote_agent`` dropped past the
        backlog (a log line at most every 10 s)."""
        self.notifs_dropped += n
        self._dropped_warning.warning(
            "%s: notification from %s dropped (%d at once): %d waiting already (%d bytes; at most %d, %d bytes); "
            "%d dropped since start", w.label, remote_agent, n, len(self._notifs), self._notif_bytes,
            MAX_BACKLOG, MAX_BACKLOG_BYTES, self.notifs_dropped)

    def handle_notifs(self, limit: int) -> int:
        """Hands the notifications kept, oldest first, to their worker's
        leases (a worker unregistered since: dropped uncounted) until
        ``limit`` pieces (``Holds.on_notif``; a count) are handled; returns
        how many notifications were taken."""
        q, rt = self._notifs, self.rt
        n = pieces = 0
        while q and pieces < limit:
            w, a, msg = q.popleft()
            n += 1
            self._notif_bytes -= len(msg)
            pieces += self.holds.on_notif(w, a, msg) if rt.registered(w) else 1
        return n

    def expire(self, now: float) -> None:
        """Leases and loads past their deadlines; workers detached too long."""
        self.holds.expire(now)
        self.pull.expire(now)
        grace = self.rt.limits.detach_grace_s
        for w in list(self.rt.workers.values()):
            s = w.session
            if s.detached_since is not None and not s.streams and now - s.detached_since > grace:
                s.detached_since = None
                asyncio.get_running_loop().create_task(self._drop_detached(w.key))

    async def _drop_detached(self, key: WorkerKey) -> None:
        try:
            await self.registry.unregister(key, reason=f"no session for {self.rt.limits.detach_grace_s:.0f} s",
                                           engine_gone=True)
        except NotFound:
            pass  # unregistered meanwhile
