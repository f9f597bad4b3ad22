"""Push mode (the loads ``kvd.core.transfer_mode`` makes pushes), both sides.

- Reader (decode) side, :meth:`Push.load`: after the checks of the pull path
  (``kvd.core.pull``), asks each source rank it reads from to WRITE into its
  blocks (``PeerService.Push``) and sends the others a bare notification
  (``PeerService.Notify``).
- Source (prefill) side, :meth:`Push.push`: WRITEs blocks its engine holds
  for the request into the reader's blocks; a WRITE done counts as one
  reader's notification of the lease, as a READ's would in pull mode.

The WRITEs in flight are polled by the progress loop (:meth:`Push.poll_writes`).

The readers a source worker WRITEs to (``WorkerPairs.readers``: each a peer
agent loaded into its agent, a UCX endpoint, ~1 fd, and the pair's
descriptor lists) are capped (``BOUNDS.max_push_readers``: the least
recently used one no push is using makes room, and pairs again on its next
push; with every one in use the push is refused) and released when no push
has used them for ``Limits.peer_idle_s`` (``kvd.core.liveness``). A reader
is released as a retired remote is (``WorkerPairs.retired``, freed on the
NIXL thread by the progress loop), never while a push uses it: one dropped
then (its WRITE failed) waits until its last WRITE has ended. Before, every
reader stayed for the worker's life: a hostile peer naming a new reader in
each push loaded 2,000 agents in 18 s (+1 fd each), and at
``RLIMIT_NOFILE`` 1024 every peer call was refused (docs/SECURITY.md).
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvd.core import plan
from kvd.core.events import (
    FailureKind,
    Incompatible,
    InvalidArgument,
    NotFound,
    PeerBusy,
    PeerUnavailable,
    PermissionDenied,
    RecvDone,
    ResourceExhausted,
    WriteEnded,
)
from kvd.core.holds import Holds
from kvd.core.layout import LayoutError
from kvd.core.limits import BOUNDS
from kvd.core.nixl_agent import NixlError
from kvd.core.peers import Peers, check_peer
from kvd.core.runtime import Runtime
from kvd.core.state import HandshakeResult, PushOrder, PushResult, RemoteWorker, Worker
from kvd.core.throttle import Throttled
from kvd.requests import LoadRequest, flat

log = logging.getLogger("kvd.core")


def retire_reader(w: Worker, r: RemoteWorker, why: str, level: int = logging.INFO) -> bool:
    """Stops WRITEing to push reader ``r`` of ``w``, no push using it
    (``RemoteWorker.pushes`` 0): it leaves ``w.pairs.readers`` for
    ``w.pairs.retired``, whose NIXL state (peer agent, UCX endpoint, lists)
    the progress loop frees on the NIXL thread. Returns False, doing
    nothing, when ``r`` is not ``w``'s reader any more or a push uses it."""
    if r.pushes or w.pairs.readers.get(r.agent_name) is not r:
        return False
    del w.pairs.readers[r.agent_name]
    w.pairs.retired.append(r)
    log.log(level, "%s: released push reader %s (%s)", w.label, r.agent_name, why)
    return True


def retire_idle_readers(w: Worker, now: float, idle_s: float) -> int:
    """Releases ``w``'s push readers no push has used for ``idle_s``
    seconds (``now``: monotonic seconds), as :func:`retire_reader`;
    returns how many."""
    idle = [r for r in w.pairs.readers.values() if not r.pushes and now - r.last_used > idle_s]
    return sum(retire_reader(w, r, f"no push used it for {idle_s:.0f} s (peer_idle_s)") for r in idle)


# A Push answered with one of these did nothing more (PushOrder.settled):
# refused before any WRITE, or its WRITE ended (WriteEnded).
_REFUSED = (Incompatible, NotFound, InvalidArgument, ResourceExhausted, PermissionDenied, PeerBusy, WriteEnded)


class Push:
    """Both sides of push mode.

    Args:
        rt: the core's shared state.
        peers: pairs with readers, and the link to source daemons.
        holds: the leases a WRITE done notifies.
    """

    def __init__(self, rt: Runtime, peers: Peers, holds: Holds):
        self.rt = rt
        self.peers = peers
        self.holds = holds
        # WRITEs in flight: id(handle) -> (source worker, handle, future of its end state, deadline)
        self.writes = rt.writes
        # Readers dropped while a push used them (a WRITE failed): id(reader)
        # -> (worker, reader, the worker's agent then); each goes to its
        # worker's retired list when its last push ends (``_done_with``).
        self._draining: dict[int, tuple[Worker, RemoteWorker, object]] = {}
        self._pairing: dict[int, int] = {}  # id(worker) -> readers being paired (they count against the cap)
        # A reader released at the cap is said at most once a minute: a peer
        # naming a new reader per push would otherwise write a line a push.
        self._evicted_warning = Throttled(log, interval_s=60.0)

    async def load(self, w: Worker, req: LoadRequest, remote_tp: int, read_from: list[int], notify: list[int],
                   started: float, deadline: float, epoch: int) -> tuple[FailureKind, str] | None:
        """Reader side: each source rank in ``read_from`` WRITEs into our
        blocks; the others in ``notify`` get a bare notification. Emits
        ``RecvDone``; returns ``(kind, reason)`` of a failure instead (the
        caller ends the load). Each order asked is in
        ``w.pushes[req.request_id]`` (the caller made the entry and removes
        it). ``epoch``: the worker's session epoch the load belongs to; no
        order is sent once that session has ended (its engine has counted
        the load failed and may reuse the blocks), and then nothing is
        emitted."""
        me = await self.peers.describe(w)
        heads, mla = w.layout.model_kv_heads(w.tp_size), w.layout.kv_layout == "MLA"
        link = self.peers.link
        orders = w.pushes.setdefault(req.request_id, [])

        def ended() -> bool:
            return w.session.epoch != epoch or not self.rt.registered(w)

        # A rank's push failed: no order goes out after it. Filled by the
        # failing rank itself, in the same step (a sibling's claim answered
        # in that step must not send its order).
        failed: list[BaseException] = []
        sending: dict[asyncio.Task, PushOrder] = {}

        async def push(order: PushOrder):
            if ended() or failed:
                return None
            order.settled = False
            try:
                result = await link.push(req.remote_address, order, order.timeout_s)
            except _REFUSED:
                order.settled = True  # the source refused it, or says its WRITE has ended
                raise
            order.settled = True
            return result

        async def one(p: int):
            try:
                return await rank(p)
            except Exception as e:  # not a cancellation (a BaseException)
                failed.append(e)
                raise

        async def rank(p: int):
            expected = plan.expected_notifications(p, remote_tp, w.tp_size, heads, mla)
            left = max(0.1, deadline - time.monotonic())
            if p not in read_from:
                await link.notify(req.remote_address, req.remote_engine_id, p, req.remote_request_id, expected, left)
                return None
            order = PushOrder(req.remote_engine_id, p, req.remote_request_id, req.remote_groups, me, w.key[1],
                              req.local_groups, expected, left)
            orders.append(order)
            sending[asyncio.current_task()] = order
            try:
                return await push(order)
            except NotFound:
                # The hold may still be on its way: vLLM answers P's HTTP
                # request a step before its connector sends the hold, and a
                # router that sends D at once (vllm-router,
                # tests/test_routers_multi.py) has us ask first. Wait for it
                # as a pull reader does (Claim), then ask once more.
                wait_s = min(BOUNDS.max_claim_wait_s, max(0.0, deadline - time.monotonic() - 0.1))
                try:
                    await link.claim(req.remote_address, req.remote_engine_id, p, req.remote_request_id,
                                     req.remote_groups, wait_s, max(0.1, deadline - time.monotonic()))
                except PermissionDenied:
                    pass  # asked once more all the same: the source's answer names its reason
                order.timeout_s = max(0.1, deadline - time.monotonic())
                return await push(order)

        # On one rank's failure the others are waited for, not cancelled: a
        # source's WRITE goes on whatever its caller does, and one that ends
        # in time needs no agent replacement (kvd.core.settle). Before, the
        # first failure ended the load at once, and a sibling's WRITE landed
        # (or its order went out) after the load had failed (an attacker
        # review: 300 ms of WRITE after LoadFailed).
        # A rank with no order out (a notification, a claim waiting for its
        # hold) is cancelled instead: nothing of it can land.
        tasks = [asyncio.ensure_future(one(p)) for p in notify]
        try:
            async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                if failed:
                    for t in tasks:
                        if not t.done() and not getattr(sending.get(t), "sent", False):
                            t.cancel()
                    await asyncio.wait(tasks)
        except TimeoutError:
            return FailureKind.TIMEOUT, "timeout: push not done by the deadline"
        finally:
            for t in tasks:
                t.cancel()  # past the deadline (or this load cancelled): each order's sent and settled are final after
            await asyncio.gather(*tasks, return_exceptions=True)
        if failed:
            if isinstance(failed[0], (*_REFUSED, PeerUnavailable)):
                return FailureKind.PUSH, f"push: {failed[0]}"
            # Not raised: the caller stops any WRITE still unanswered
            # before the load fails (an attacker review: a raised error
            # skipped that).
            log.error("%s request=%s: push failed unexpectedly", w.label, req.request_id, exc_info=failed[0])
            return FailureKind.INTERNAL, f"internal: {type(failed[0]).__name__}: {failed[0]}"
        if ended():
            return None
        results = [t.result() for t in tasks]
        done = [r for r in results if r is not None]
        nbytes, ndescs = sum(r.bytes for r in done), sum(r.num_descriptors for r in done)
        dur = time.monotonic() - started
        self.rt.counters.bytes_read += nbytes
        self.rt.counters.transfers_done += 1
        self.rt.on_event("transfer", {"bytes": nbytes, "seconds": dur, "descs": ndescs})
        self.rt.emit(w, RecvDone(req.request_id, nbytes, len(req.local_block_ids), ndescs, dur))
        return None

    async def push(self, order: PushOrder) -> PushResult:
        """Source side: WRITE a held request's blocks into a reader.

        Counts as one reader's notification of the lease once the WRITE is
        done, as a READ's notification would in pull mode. The reader is
        paired on its first push and kept (at most
        ``BOUNDS.max_push_readers`` per worker, see the module docstring).
        A call cancelled (its caller gone) still waits here for its WRITE's
        end before the reader may be released, and then notifies nothing.

        Raises:
            NotFound: no such worker, or no lease for ``order.request_id``.
            InvalidArgument: block ids out of range, malformed reader.
            Incompatible: the layouts cannot be combined.
            WriteEnded: nothing was posted (the post failed, the worker's
                agent was replaced while pairing), or the WRITE ended
                failed or past its deadline (gRPC ABORTED: the reader then
                knows no byte of it comes any more).
            ResourceExhausted: a new reader, and each of the worker's
                ``BOUNDS.max_push_readers`` readers is in use by a push.
        """
        abandoned: list[bool] = []
        task = asyncio.ensure_future(self._push(order, abandoned))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved, if nobody awaits it
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            abandoned.append(True)
            raise

    async def _push(self, order: PushOrder, abandoned: list[bool]) -> PushResult:
        """:meth:`push`, shielded from its caller's cancellation: the reader
        is in use (``RemoteWorker.pushes``) until the WRITE has ended."""
        w = self.rt.worker(order.engine_id, order.tp_rank)
        if order.request_id not in w.leases.leases:
            raise NotFound(f"engine {order.engine_id!r} rank {order.tp_rank} holds no blocks for request "
                           f"{order.request_id!r}")
        if not 0 < order.expected_notifications <= BOUNDS.max_notifications:
            raise InvalidArgument(f"push: expected_notifications must be in 1..{BOUNDS.max_notifications}")
        limit = self.rt.limits.max_blocks_per_request  # as for a load
        if max(len(flat(order.source_groups)), len(flat(order.reader_groups))) > limit:
            raise InvalidArgument(f"push: more than {limit} blocks")
        if not w.leases.covers(order.request_id, order.source_groups):
            # Push is the one mode where the source moves the bytes: it writes
            # only blocks its engine holds for that request (docs/SECURITY.md).
            raise InvalidArgument(f"push: blocks not held for request {order.request_id!r}")
        t0 = time.monotonic()
        reader = order.reader
        check_peer(w, reader, "push")
        r = await self._take_reader(w, reader, order.reader_tp_rank)
        try:
            try:
                dst_idx, src_idx = plan.chunk_indices(order.reader_groups, order.source_groups, r.num_regions,
                                                      r.layout.num_blocks, w.layout.num_blocks, r.k, r.C,
                                                      r.region_groups)
            except LayoutError as e:
                raise InvalidArgument(f"push: {e}") from None
            local, remote = r.lists  # one read: the NIXL thread may swap in prepared lists

            def post():  # NIXL thread
                if r.freed:  # its worker's agent was replaced meanwhile (Registry.replace_agent)
                    raise NixlError(f"reader {r.agent_name} released")
                return w.agent.post("WRITE", local, src_idx, remote, dst_idx, b"")

            try:
                handle, state = await self.rt.nixl(post)
            except NixlError as e:
                raise WriteEnded(f"push: {e}") from None  # nothing posted
            fut = asyncio.get_running_loop().create_future()
            timeout = self.rt.timeout(order.timeout_s)
            self.writes[id(handle)] = (w, handle, fut, time.monotonic() + timeout)
            self.rt.kick.set()
            if state == "ERR":
                fut.set_result("ERR")
            st = await fut  # set once poll_writes has released the handle: the WRITE has ended
            if st != "DONE":
                self._drop(w, r, f"WRITE {st}")
                raise WriteEnded(f"push: WRITE to {reader.agent_name} {st}")  # its handle released: ended
        finally:
            self._done_with(w, r)
        nbytes = r.transfer_bytes(order.source_groups)
        if not abandoned:
            self.holds.notify(order.engine_id, order.tp_rank, order.request_id, order.expected_notifications)
        return PushResult(nbytes, len(src_idx), time.monotonic() - t0)

    async def _take_reader(self, w: Worker, hs: HandshakeResult, rank: int) -> RemoteWorker:
        """``w``'s reader of agent ``hs.agent_name``, paired now if it is
        new (making room first, :meth:`_make_room`), marked in use by one
        more push (release with :meth:`_done_with`).

        Raises:
            InvalidArgument: NIXL refused the reader's agent metadata.
            Incompatible: the layouts cannot be combined.
            ResourceExhausted: no room (:meth:`_make_room`).
            NotFound, PeerUnavailable: ``w`` unregistered, or its agent
                replaced, while pairing.
        """
        r = w.pairs.readers.get(hs.agent_name)
        if r is None:
            self._make_room(w)
            agent, key = w.agent, id(w)
            self._pairing[key] = self._pairing.get(key, 0) + 1
            try:
                # For a reader, "local" lists are ours (source rows), "remote" the reader's.
                r = await self.peers.pair(w, hs, rank, we_read=False, address="", engine_id=hs.agent_name)
            except NixlError as e:
                raise InvalidArgument(f"push: reader agent metadata rejected: {e}") from None
            finally:
                self._pairing[key] -= 1
                if not self._pairing[key]:
                    del self._pairing[key]
            if not self.rt.registered(w):
                raise NotFound(f"{w.label} unregistered while pairing push reader {hs.agent_name}")
            if w.agent is not agent:  # its state went with the old agent
                raise WriteEnded(f"push: {w.label}'s NIXL agent replaced while pairing {hs.agent_name}")
            other = w.pairs.readers.get(hs.agent_name)
            if other is not None:  # paired by another push meanwhile: one is kept (the agent is shared)
                w.pairs.retired.append(r)
                r = other
            else:
                w.pairs.readers[hs.agent_name] = r
        r.pushes += 1
        r.last_used = time.monotonic()
        return r

    def _make_room(self, w: Worker) -> None:
        """Room for one more reader of ``w`` under ``BOUNDS.max_push_readers``
        (readers, those being paired and those dropped whose last WRITE has
        not ended all count): the least recently used reader no push is
        using is released (:func:`retire_reader`).

        Raises:
            ResourceExhausted: every reader is in use by a push.
        """
        cap = BOUNDS.max_push_readers
        while (len(w.pairs.readers) + self._pairing.get(id(w), 0)
               + sum(1 for x, _, _ in self._draining.values() if x is w)) >= cap:
            idle = [r for r in w.pairs.readers.values() if not r.pushes]
            if not idle:
                raise ResourceExhausted(f"push: {w.label} has {cap} push readers (BOUNDS.max_push_readers), each "
                                        "in use by a push; try again once one has ended")
            lru = min(idle, key=lambda r: r.last_used)
            retire_reader(w, lru, f"least recently used of {cap}, BOUNDS.max_push_readers", logging.DEBUG)
            self._evicted_warning.warning("%s: push reader %s released to stay within BOUNDS.max_push_readers "
                                          "(%d; it pairs again on its next push): more readers than that, or a "
                                          "peer naming a new one per push", w.label, lru.agent_name, cap)

    def _drop(self, w: Worker, r: RemoteWorker, why: str) -> None:
        """A WRITE to reader ``r`` failed: the next push pairs again. ``r``
        is released now if no other push uses it, else once the last one
        has ended (:meth:`_done_with`). ``r.pushes`` counts the caller's."""
        if w.pairs.readers.get(r.agent_name) is not r:
            return  # released already (its agent replaced, its worker gone, another failure)
        del w.pairs.readers[r.agent_name]
        log.info("%s: dropped push reader %s (%s)", w.label, r.agent_name, why)
        self._draining[id(r)] = (w, r, w.agent)

    def _done_with(self, w: Worker, r: RemoteWorker) -> None:
        """One push fewer uses reader ``r``; a dropped reader goes to the
        retired ones with its last push (unless its worker's agent was
        replaced meanwhile: its state went with it). A worker unregistered
        meanwhile is quarantined while this push's WRITE ran
        (``Registry._free_worker``); its retired readers are freed with it."""
        r.pushes -= 1
        if r.pushes:
            return
        entry = self._draining.pop(id(r), None)
        if entry is not None and entry[2] is w.agent and not r.freed:
            w.pairs.retired.append(r)

    def poll_writes(self, now: float) -> list[tuple[asyncio.Future, str]]:
        """NIXL thread: the WRITEs that ended (or passed their deadline),
        released, as ``(future, end state)`` for :meth:`complete`."""
        done = []
        for key, (w, h, fut, deadline) in list(self.writes.items()):
            st = w.agent.state(h)
            if st == "PROC" and now < deadline:
                continue
            self.writes.pop(key, None)
            self.rt.release_handle(w.agent, h)
            done.append((fut, st if st != "PROC" else "past its deadline"))
        return done

    @staticmethod
    def complete(done: list[tuple[asyncio.Future, str]]) -> None:
        """Event loop: wakes each WRITE's :meth:`push` with its end state."""
        for fut, st in done:
            if not fut.done():
                fut.set_result(st)
