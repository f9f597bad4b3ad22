"""Push mode (``Limits.transfer_mode = "push"``), both sides.

- Reader (decode) side, :meth:`Push.load`: after the checks of the pull path
  (``kvd.core.pull``), asks each source rank it reads from to WRITE into its
  blocks (``PeerService.Push``) and sends the others a bare notification
  (``PeerService.Notify``).
- Source (prefill) side, :meth:`Push.push`: WRITEs blocks its engine holds
  for the request into the reader's blocks; a WRITE done counts as one
  reader's notification of the lease, as a READ's would in pull mode.

The WRITEs in flight are polled by the progress loop (:meth:`Push.poll_writes`).
"""

from __future__ import annotations

import asyncio
import time

from kvd.core import plan
from kvd.core.events import (
    FailureKind,
    Incompatible,
    InvalidArgument,
    NotFound,
    PeerUnavailable,
    PermissionDenied,
    RecvDone,
)
from kvd.core.holds import Holds
from kvd.core.layout import LayoutError
from kvd.core.limits import BOUNDS
from kvd.core.nixl_agent import NixlError
from kvd.core.peers import Peers, check_peer
from kvd.core.runtime import Runtime
from kvd.core.state import PushOrder, PushResult, Worker
from kvd.requests import LoadRequest, flat


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
        self.writes: dict[int, tuple[Worker, object, asyncio.Future, float]] = {}

    async def load(self, w: Worker, req: LoadRequest, remote_tp: int, read_from: list[int], notify: list[int],
                   started: float, deadline: float) -> tuple[FailureKind, str] | None:
        """Reader side: each source rank in ``read_from`` WRITEs into our
        blocks; the others in ``notify`` get a bare notification. Emits
        ``RecvDone``; returns ``(kind, reason)`` of a failure instead (the
        caller ends the load)."""
        me = await self.peers.describe(w)
        heads, mla = w.layout.model_kv_heads(w.tp_size), w.layout.kv_layout == "MLA"
        link = self.peers.link

        async def one(p: int):
            expected = plan.expected_notifications(p, remote_tp, w.tp_size, heads, mla)
            left = max(0.1, deadline - time.monotonic())
            if p not in read_from:
                await link.notify(req.remote_address, req.remote_engine_id, p, req.remote_request_id, expected, left)
                return None
            order = PushOrder(req.remote_engine_id, p, req.remote_request_id, req.remote_groups, me, w.key[1],
                              req.local_groups, expected, left)
            try:
                return await link.push(req.remote_address, order, left)
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
                return await link.push(req.remote_address, order, order.timeout_s)

        try:
            results = await asyncio.wait_for(asyncio.gather(*(one(p) for p in notify)),
                                             max(0.1, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return FailureKind.TIMEOUT, "timeout: push not done by the deadline"
        except (Incompatible, NotFound, PeerUnavailable, InvalidArgument) as e:
            return FailureKind.PUSH, f"push: {e}"
        if not self.rt.registered(w):
            return None
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
        done, as a READ's notification would in pull mode.

        Raises:
            NotFound: no such worker, or no lease for ``order.request_id``.
            InvalidArgument: block ids out of range, malformed reader.
            Incompatible: the layouts cannot be combined.
            PeerUnavailable: the WRITE failed or missed its deadline.
        """
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
        r = w.pairs.readers.get(reader.agent_name)
        if r is None:
            try:
                # For a reader, "local" lists are ours (source rows), "remote" the reader's.
                r = await self.peers.pair(w, reader, order.reader_tp_rank, we_read=False, address="",
                                          engine_id=reader.agent_name)
            except NixlError as e:
                raise InvalidArgument(f"push: reader agent metadata rejected: {e}") from None
            w.pairs.readers[reader.agent_name] = r
        try:
            dst_idx, src_idx = plan.chunk_indices(order.reader_groups, order.source_groups, r.num_regions,
                                                  r.layout.num_blocks, w.layout.num_blocks, r.k, r.C,
                                                  r.region_groups)
        except LayoutError as e:
            raise InvalidArgument(f"push: {e}") from None
        local, remote = r.lists  # one read: the NIXL thread may swap in prepared lists
        try:
            handle, state = await self.rt.nixl(w.agent.post, "WRITE", local, src_idx, remote, dst_idx, b"")
        except NixlError as e:
            raise PeerUnavailable(f"push: {e}") from None
        fut = asyncio.get_running_loop().create_future()
        timeout = self.rt.timeout(order.timeout_s)
        self.writes[id(handle)] = (w, handle, fut, time.monotonic() + timeout)
        self.rt.kick.set()
        if state == "ERR":
            fut.set_result("ERR")
        st = await fut
        if st != "DONE":
            w.pairs.readers.pop(reader.agent_name, None)
            w.pairs.retired.append(r)
            raise PeerUnavailable(f"push: WRITE to {reader.agent_name} {st}")
        nbytes = r.transfer_bytes(order.source_groups)
        self.holds.notify(order.engine_id, order.tp_rank, order.request_id, order.expected_notifications)
        return PushResult(nbytes, len(src_idx), time.monotonic() - t0)

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
