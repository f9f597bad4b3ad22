"""What an ``EngineClient`` waits on: its loads and holds, their local
deadlines, the commands queued for the session stream and the events queued
for the engine.

The engine's threads queue commands and drain events; the session thread
(``kvd.client.session``) takes the commands and files the daemon's answers.
One lock guards it all and nothing here does I/O, so the engine's step never
waits on the network. The rules kept here are the client's guarantees
(``kvd.client.engine_client``): one terminal event per accepted load or
hold, late or duplicate answers dropped, every wait bounded by a deadline.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque

from kvd import tracepoints as tp
from kvd.client.commands import Command, Hold, Load, Stream, abort_cmd, hold_ended, load_failed
from kvd.logtext import clip
from kvd.requests import BlockGroups, InvalidLoad, LoadRequest
from kvd.v1 import kvd_pb2 as pb

log = logging.getLogger("kvd.client")

#: Request ids a lost session's warning names (then the count of the rest).
LOST_IDS_SHOWN = 8


class Pending:
    """The loads and holds of one client awaiting their end, and its two queues.

    Attributes:
        cond: the lock (a ``threading.Condition``) over everything below; the
            session thread waits on it for commands.
        closing: set by ``EngineClient.close``: no load or hold is accepted
            after it (each ends at once, locally).
        label: ``engine=<id> rank=<r>``, first in every log line.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.closing = threading.Event()
        self.label = "engine=? rank=?"
        self._outq: deque[Command] = deque()  # built into commands by the sender thread
        self._events: deque[pb.SessionEvent] = deque()
        self._loads: dict[str, Load] = {}
        self._holds: dict[str, Hold] = {}
        self._deadlines: list[tuple[float, str, str]] = []  # (deadline, "load"|"hold", request id)

    # ------------------------------------------------------ engine's threads
    def add_load(self, req: LoadRequest, timeout_s: float, wait_s: float) -> None:
        """Queues a load sent with ``timeout_s``, failed here if no answer
        comes within ``wait_s`` seconds (a duplicate request id is ignored)."""
        rid = req.request_id
        with self.cond:
            if rid in self._loads:
                log.warning("kvd %s request=%s: load already pending; duplicate ignored", self.label, rid)
                return
            if self.closing.is_set():
                self._events.append(load_failed(rid, req.local_block_ids, "kvd client closed"))
                return
            deadline = time.monotonic() + wait_s
            ld = Load(req, timeout_s, deadline)
            self._loads[rid] = ld
            heapq.heappush(self._deadlines, (deadline, "load", rid))
            self._enqueue(ld)

    def add_hold(self, request_id: str, lease_s: float, groups: BlockGroups, wait_s: float, grace_s: float) -> None:
        """Queues a hold of ``lease_s`` (0: the daemon's default) whose lease
        ends, here, ``wait_s`` seconds from now; ended here ``grace_s`` later
        if no answer came (a duplicate request id is ignored)."""
        with self.cond:
            if request_id in self._holds:
                log.warning("kvd %s request=%s: already held; duplicate ignored", self.label, request_id)
                return
            if self.closing.is_set():
                self._events.append(hold_ended(request_id, expired=True))
                return
            now = time.monotonic()
            h = Hold(request_id, lease_s, groups, now + wait_s, now + wait_s + grace_s)
            self._holds[request_id] = h
            heapq.heappush(self._deadlines, (h.deadline, "hold", request_id))
            self._enqueue(h)

    def queue(self, cmd: Command, *, unless_closing: bool = False) -> bool:
        """Queues a command without local state; False (not queued) when
        ``unless_closing`` and the client is closing."""
        with self.cond:
            if unless_closing and self.closing.is_set():
                return False
            self._enqueue(cmd)
            return True

    def _enqueue(self, cmd: Command) -> None:
        """Under the lock: queues ``cmd`` for the stream. Wakes the stream's
        sender only when the queue was empty (it waits only then): a step that
        queues many commands wakes that thread once, not once per command
        (each wake-up costs the engine's thread a GIL hand-off,
        docs/PERFORMANCE.md "engine step")."""
        if not self._outq:
            self._outq.append(cmd)
            self.cond.notify_all()
        else:
            self._outq.append(cmd)

    def drain(self) -> list[pb.SessionEvent]:
        """Every event queued since the last call, after ending locally the
        loads and holds whose deadline has passed. The engine's step calls it:
        no lock is taken when nothing is due (``deque`` appends and pops are
        thread-safe)."""
        deadlines, events = self._deadlines, self._events
        if deadlines and deadlines[0][0] <= time.monotonic():
            self._expire(time.monotonic())
        if not events:
            return []
        out = []
        while True:
            try:
                out.append(events.popleft())
            except IndexError:
                return out

    def counts(self) -> tuple[int, int]:
        """(loads awaiting an answer, holds awaiting their end)."""
        with self.cond:
            return len(self._loads), len(self._holds)

    def fail_loads(self, reason: str) -> None:
        """Every pending load fails with ``reason`` (the client closed)."""
        with self.cond:
            for rid, ld in list(self._loads.items()):
                self._events.append(load_failed(rid, ld.req.local_block_ids, reason))
            self._loads.clear()

    def wake(self) -> None:
        """Wakes the session thread waiting for commands (to see ``closing``)."""
        with self.cond:
            self.cond.notify_all()

    def _expire(self, now: float) -> None:
        with self.cond:
            while self._deadlines and self._deadlines[0][0] <= now:
                deadline, kind, rid = heapq.heappop(self._deadlines)
                if kind == "load":
                    ld = self._loads.get(rid)
                    if ld is not None and ld.deadline == deadline:
                        del self._loads[rid]
                        log.warning("kvd %s request=%s: load had no answer from the daemon in time; failed locally",
                                    self.label, rid)
                        self._events.append(load_failed(rid, ld.req.local_block_ids, "timeout: no answer from kvd"))
                else:
                    h = self._holds.get(rid)
                    if h is not None and h.deadline == deadline:
                        del self._holds[rid]
                        log.warning("kvd %s request=%s: lease over with no answer from the daemon; ended locally",
                                    self.label, rid)
                        self._events.append(hold_ended(rid, expired=True))

    # -------------------------------------------------------- session thread
    def holds_again(self, stream: Stream) -> list[pb.SessionCommand]:
        """The holds sent on an earlier stream whose lease is not over, marked
        sent on ``stream``: each with its remaining lease (a daemon-default
        lease starts again), so blocks are never freed earlier than promised."""
        with self.cond:
            now = time.monotonic()
            again = []
            for h in self._holds.values():
                if h.stream is not None and h.stream != stream.epoch and h.lease_deadline > now:
                    h.stream = stream.epoch
                    lease = h.lease_deadline - now if h.lease_s > 0 else 0.0
                    again.append(pb.SessionCommand(hold=h.hold_message(lease)))
        return again

    def next_batch(self, stream: Stream) -> list[Command] | None:
        """Waits for commands; returns all queued, marked sent on ``stream``,
        or None once ``stream`` ended or the client is closing."""
        with self.cond:
            while not self._outq and not stream.done and not self.closing.is_set():
                self.cond.wait(0.5)
            if stream.done or self.closing.is_set():
                return None
            # Everything queued, in one hold of the lock (fewer lock hand-offs
            # with the engine thread queuing more).
            batch = []
            while self._outq:
                cmd = self._outq.popleft()
                if self._mark_sent(cmd, stream):
                    batch.append(cmd)
            return batch

    def _mark_sent(self, cmd: Command, stream: Stream) -> bool:
        """Under the lock: records ``cmd`` as sent on ``stream``; False = drop it."""
        if type(cmd) is Load:
            if self._loads.get(cmd.req.request_id) is not cmd:
                return False  # ended locally (deadline) before it went out
            cmd.stream = stream.epoch
        elif type(cmd) is Hold:
            if self._holds.get(cmd.request_id) is not cmd:
                return False
            cmd.stream = stream.epoch
        return True

    def refuse(self, cmd: Command, error: Exception) -> pb.SessionCommand | None:
        """A command whose arguments cannot be put on the wire: its load fails
        (its hold ends) locally, as a daemon rejection would end it.

        A deferred load that resolved to :class:`~kvd.requests.InvalidLoad`
        fails with its reason, logged as a warning (its fields came from an
        API request, not from a bug here); returns the ``AbortLoad`` to
        send in its place when the error names the prefill side
        (``InvalidLoad.abort``), else None."""
        abort = None
        if isinstance(error, InvalidLoad):
            reason = str(error)
            log.warning("kvd %s request=%s: load not sent: %s", self.label, cmd.req.request_id, reason)
            if error.abort is not None:
                a = error.abort
                try:
                    abort = abort_cmd(a.request_id, a.remote_engine_id, a.remote_address, a.remote_request_id,
                                      a.remote_tp_size)
                except (TypeError, ValueError) as e:  # fields protobuf refuses: nobody to tell
                    log.warning("kvd %s request=%s: the prefill side is not told to free: %s", self.label,
                                a.request_id, e)
        elif isinstance(error, (TypeError, ValueError)):
            reason = f"invalid command: {error}"
            log.error("kvd %s: command not sent: %s: %s", self.label, type(error).__name__, error)
        else:  # a bug, not the arguments: with its traceback
            reason = f"internal: {type(error).__name__}: {error}"
            log.error("kvd %s: command not sent", self.label, exc_info=error)
        with self.cond:
            if type(cmd) is Load and self._loads.get(cmd.req.request_id) is cmd:
                del self._loads[cmd.req.request_id]
                self._events.append(load_failed(cmd.req.request_id, cmd.req.local_block_ids, reason))
            elif type(cmd) is Hold and self._holds.get(cmd.request_id) is cmd:
                del self._holds[cmd.request_id]
                self._events.append(hold_ended(cmd.request_id, released=True))
        return abort

    def on_answer(self, event: pb.SessionEvent, kind: str) -> None:
        """Files the daemon's ``recv_done``, ``load_failed``, ``send_done``,
        ``renewed`` or ``rejected`` (``kind``): queued for the engine when it
        ends a pending load or hold, dropped (logged) otherwise; a rejection
        ends its load (``load_failed``) or its hold
        (``send_done(released=True)``); ``renewed`` only moves a hold's local
        deadline (never queued)."""
        with self.cond:
            if kind == "recv_done" or kind == "load_failed":
                rid = getattr(event, kind).request_id
                tp.hit(tp.RECEIVED, rid, kind)
                if self._loads.pop(rid, None) is not None:
                    self._events.append(event)
                else:
                    log.debug("kvd %s request=%s: %s for a load not pending here; dropped", self.label, rid, kind)
            elif kind == "send_done":
                rid = event.send_done.request_id
                if self._holds.pop(rid, None) is not None:
                    self._events.append(event)
                else:
                    log.debug("kvd %s request=%s: send_done for a hold not held here; dropped", self.label, rid)
            elif kind == "renewed":
                # A reader renewed the lease at the daemon: the local last
                # resort (lease + grace) moves with it, never earlier.
                h = self._holds.get(event.renewed.request_id)
                end = time.monotonic() + event.renewed.left_s
                if h is not None and end > h.lease_deadline:
                    grace = h.deadline - h.lease_deadline
                    h.lease_deadline, h.deadline = end, end + grace
                    heapq.heappush(self._deadlines, (h.deadline, "hold", h.request_id))
            elif kind == "rejected":
                rid, reason = event.rejected.request_id, event.rejected.reason
                ld = self._loads.pop(rid, None)
                if ld is not None:
                    self._events.append(load_failed(rid, ld.req.local_block_ids, f"rejected: {reason}"))
                elif self._holds.pop(rid, None) is not None:
                    log.warning("kvd %s request=%s: hold rejected: %s; blocks released", self.label, rid, reason)
                    self._events.append(hold_ended(rid, released=True))
                else:
                    log.warning("kvd %s request=%s: command rejected: %s", self.label, rid or "-", reason)
            else:
                log.warning("kvd %s: unknown session event %r ignored", self.label, kind)

    def fail_stream(self, stream: Stream, reason: str) -> None:
        """``stream`` ended: every load that went out on it fails (the daemon's
        transfer state is gone); the sender of that stream stops."""
        with self.cond:
            stream.done = True
            self.cond.notify_all()
            lost = [rid for rid, ld in self._loads.items() if ld.stream == stream.epoch]
            for rid in lost:
                ld = self._loads.pop(rid)
                self._events.append(load_failed(rid, ld.req.local_block_ids, f"kvd session lost: {reason}"))
        if lost:
            # A few ids, and the count: request ids are up to 1 KiB each, and
            # 4,096 loads in flight made a 30 KB line (attacker review).
            shown = ", ".join(clip(rid, 64) for rid in lost[:LOST_IDS_SHOWN])
            log.warning("kvd %s: session lost (%s): %d load(s) in flight reported failed: %s%s", self.label,
                        reason, len(lost), shown, f" and {len(lost) - LOST_IDS_SHOWN} more"
                        if len(lost) > LOST_IDS_SHOWN else "")
