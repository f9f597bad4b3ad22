"""Coalesced READs: the small READs of several loads go out as one NIXL transfer.

NIXL's CPU cost is per transfer far more than per descriptor: 64 one-block
READs of 4 KiB cost the reader ~40 us and the source ~22 us of CPU a load
as 64 transfers with a notification each, ~3 and ~1 us as one transfer with
one notification (two plain NIXL processes, kvd's agent settings;
``python -m benchmarks.native_floor``, docs/PERFORMANCE.md "coalesced
READs"). A decode daemon that serves many small loads at once (TP ranks,
concurrent requests) pays the first figure for each unless it joins them.

So a load whose plan reads from one source rank and notifies only that one,
with a READ of at most ``BOUNDS.inline_post_max_bytes``, joins the open batch
of its worker's agent, source and descriptor lists (:meth:`CoalescedReads.read`).
The batch goes out once the loads already queued on the event loop have run
(its first load yields the loop once, then posts it): one transfer of every member's descriptors, whose
notification is the members' pieces joined (``kvd.core.leases``), at most
``BOUNDS.max_loads_per_read`` loads and ``inline_post_max_bytes`` bytes; a
load that does not fit opens the next batch. A load alone goes out the same
way, one pass of the loop later than it would have alone.

What stays per load, as for a READ of its own (``kvd.core.pull``):

- each load's answer, ``RecvDone`` or ``LoadFailed``, and its source's
  lease, ended by its own piece of the notification;
- the loads are put in flight (``Worker.inflight``) in the callback that saw
  the post, with no ``await`` in between: a session that ends afterwards
  finds them there (``Pull.cancel``); no load's task ever holds the handle;
- the READ in progress is a part of each load it carries (the same handle in
  each ``InflightLoad.parts``): the progress loop polls and releases it once
  (``kvd.core.progress``); a load past its deadline ends the others it
  shares a READ with (``Pull.expire``): NIXL cannot stop a READ for one of
  the loads it carries, and no byte may land after a load was said failed;
  they fail with it (not tried again: the READ may have notified the source
  already, and a second READ's notification would count twice there);
- the event loop owns the parts: the poll (NIXL thread) reads states, the
  loop takes an ended READ out of every load it carries and hands it to
  ``Runtime.zombies`` once (``Progress.reads_ended``), so a session's end,
  which takes its loads' parts on the loop, never holds a released handle;
- a post that fails (an error, or ``ERR``) fails every load it carries, each
  then tried again once after a new handshake, as a READ of its own is
  (no notification went out: NIXL sends it only for a READ done); a
  second try is always posted alone (its deadline is its first try's).

Every member comes from the same worker (the batch key is its agent), so
one engine's loads never share a transfer, a notification or a failure with
another engine's.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import numpy as np

from kvd.core.events import FailureKind
from kvd.core.limits import BOUNDS
from kvd.core.runtime import Runtime
from kvd.core.state import InflightLoad, RemoteWorker, Worker
from kvd.requests import LoadRequest

log = logging.getLogger("kvd.core")

#: Outcomes of :meth:`CoalescedReads.read`, each with its value.
INFLIGHT = "inflight"  # posted and in progress: the load is in Worker.inflight now; value: post seconds, its share
DONE = "done"          # moved inside the post: the caller answers RecvDone; value: post seconds, its share
FAILED = "failed"      # the post returned ERR; value: (FailureKind, reason)
DROPPED = "dropped"    # the worker's session ended before the post: nothing posted for it; value: None


@dataclass(slots=True)
class _Member:
    req: LoadRequest
    lidx: np.ndarray
    ridx: np.ndarray
    msg: bytes
    nbytes: int
    started: float
    deadline: float
    retry: bool
    fut: asyncio.Future


@dataclass(slots=True)
class _Batch:
    key: tuple
    w: Worker
    r: RemoteWorker
    local: object
    remote: object
    epoch: int
    members: list[_Member] = field(default_factory=list)
    nbytes: int = 0


class CoalescedReads:
    """The open batches of one daemon (see the module).

    Args:
        rt: the core's shared state.
        post: ``Pull._post``: posts one transfer, ``(handle, state,
            seconds inside the post)``; raises ``NixlError``.
    """

    def __init__(self, rt: Runtime, post):
        self.rt = rt
        self._post = post
        self._open: dict[tuple, _Batch] = {}

    @staticmethod
    def fits(read_from: list[int], notify: list[int], nbytes: int) -> bool:
        """Whether a load may join a batch: one source rank read and no
        other notified, a READ of at most ``BOUNDS.inline_post_max_bytes``
        (``nbytes``: its bytes)."""
        return len(read_from) == 1 and list(notify) == list(read_from) and nbytes <= BOUNDS.inline_post_max_bytes

    async def read(self, w: Worker, epoch: int, r: RemoteWorker, local, remote, req: LoadRequest,
                   lidx: np.ndarray, ridx: np.ndarray, msg: bytes, nbytes: int, started: float, deadline: float,
                   retry: bool) -> tuple[str, object]:
        """Adds ``req``'s READ (descriptor indices ``lidx`` into ``local``,
        ``ridx`` into ``remote``, ``r``'s prepared or unprepared lists;
        ``nbytes`` bytes; notification piece ``msg``) to the open batch of
        ``w``, ``r`` and those lists; returns ``(outcome, value)`` (this
        module's ``INFLIGHT``, ``DONE``, ``FAILED``, ``DROPPED``) once the
        batch is posted. Raises what the post raised (``NixlError``, or a
        bug's error). ``started``, ``deadline`` (monotonic seconds) and
        ``retry`` are the load's, for its ``InflightLoad``.

        The load that opens a batch leads it: it yields the loop once (the
        loads of this pass join meanwhile), then posts the batch itself and,
        when the post ran on the loop, goes on without waiting again. A load
        alone so waits one pass of the loop more than it did alone (a task
        that awaits a future another callback resolves waited two)."""
        key = (id(w.agent), id(r), id(local), id(remote))
        b = self._open.get(key)
        leader = b is None or len(b.members) >= BOUNDS.max_loads_per_read \
            or b.nbytes + nbytes > BOUNDS.inline_post_max_bytes or b.epoch != epoch
        if leader:
            b = self._open[key] = _Batch(key, w, r, local, remote, epoch)
        fut = asyncio.get_running_loop().create_future()
        b.members.append(_Member(req, lidx, ridx, msg, nbytes, started, deadline, retry, fut))
        b.nbytes += nbytes
        if leader:
            try:
                await asyncio.sleep(0)
            finally:  # cancelled too: the others must not wait for ever
                self._flush(b)
        return await fut

    def _flush(self, b: _Batch) -> None:
        """Posts batch ``b``: here on the loop when the NIXL thread is idle
        (``Runtime.nixl_now``), else on the NIXL thread."""
        if self._open.get(b.key) is b:
            del self._open[b.key]
        members = [m for m in b.members if not m.fut.done()]  # a member's task cancelled (the daemon stopping)
        if not members:
            return
        if b.w.session.epoch != b.epoch:
            return _resolve(members, DROPPED, None)
        try:
            one = len(members) == 1
            lidx = members[0].lidx if one else np.concatenate([m.lidx for m in members])
            ridx = members[0].ridx if one else np.concatenate([m.ridx for m in members])
            msg = members[0].msg if one else b"".join(m.msg for m in members)
            args = (members[0].req.request_id, b.w.agent, b.r, "READ", b.local, lidx, b.remote, ridx, msg)
            ran, res = self.rt.nixl_now(b.nbytes, self._post, *args, 0.0)
        except Exception as e:  # NixlError, or a bug: each member's load ends with it
            return _fail(members, e)
        if ran:
            self._answer(b, members, res)
        else:
            asyncio.get_running_loop().create_task(self._post_on_thread(b, members, args))

    async def _post_on_thread(self, b: _Batch, members: list[_Member], args: tuple) -> None:
        try:
            res = await self.rt.nixl(self._post, *args, BOUNDS.post_spin_s)
        except Exception as e:  # each member's load ends with it
            return _fail(members, e)
        except asyncio.CancelledError:  # the daemon stopping: no member may wait for ever
            _fail(members, RuntimeError("the post was cancelled"))
            raise
        self._answer(b, members, res)

    def _answer(self, b: _Batch, members: list[_Member], res: tuple) -> None:
        """:meth:`_posted`, whose error (a bug) still answers each member:
        this runs outside any load's task, whose catch-all would have."""
        try:
            self._posted(b, members, res)
        except Exception as e:
            log.exception("coalesced READ of %d load(s): answering the post failed", len(members))
            handle = res[0]
            held = any(any(h == handle for h, _ in getattr(b.w.inflight.get(m.req.request_id), "parts", ()))
                       for m in members)
            if handle is not None and not held:  # a READ in no load's parts: given up here, once
                self.rt.zombies.append((b.w.agent, handle))
            _fail(members, e)  # those not answered yet (one in flight is answered when its READ ends)

    def _posted(self, b: _Batch, members: list[_Member], res: tuple) -> None:
        """Batch ``b`` was posted (``res``: ``Pull._post``'s answer): its
        loads in flight, done, failed or dropped, all in this callback."""
        handle, state, post_s = res
        self.rt.counters.coalesced_reads += 1
        w, share = b.w, post_s / len(members)
        if state == "ERR":
            self.rt.zombies.append((w.agent, handle))  # ended: the next poll releases it
            return _resolve(members, FAILED, (FailureKind.NIXL, "nixl: transfer post returned ERR"))
        if w.session.epoch != b.epoch:  # the session ended while the post waited for the NIXL thread
            if handle is not None:
                self.rt.zombies.append((w.agent, handle))  # Pull.cancel's settling waits for it
            return _resolve(members, DROPPED, None)
        if handle is None:
            return _resolve(members, DONE, share)
        for m in members:
            w.inflight[m.req.request_id] = InflightLoad(m.req, [(handle, b.r)], m.started, m.deadline, m.nbytes,
                                                        len(m.lidx), m.retry, post_s=share)
        self.rt.kick.set()
        _resolve(members, INFLIGHT, share)


def _resolve(members: list[_Member], outcome: str, value) -> None:
    for m in members:
        if not m.fut.done():
            m.fut.set_result((outcome, value))


def _fail(members: list[_Member], e: Exception) -> None:
    for m in members:
        if not m.fut.done():
            m.fut.set_exception(e)
