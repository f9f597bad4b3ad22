"""``kvd.v1.PeerService``: what remote daemons ask of this one (TCP)."""

from __future__ import annotations

import logging

from kvd.core import events as ev
from kvd.core.limits import BOUNDS
from kvd.core.node import Node
from kvd.core.state import PushOrder
from kvd.daemon.call_refusal import Refused
from kvd.daemon.convert import (
    groups_from_pb,
    handshake_from_pb,
    handshake_to_pb,
    holds_to_pb,
    renewals_from_pb,
    renewed_to_pb,
)
from kvd.daemon.logs import Throttled
from kvd.logtext import clip
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

log = logging.getLogger("kvd.peer")

#: Characters of a peer-chosen id a log line shows (an engine id is at most
#: ``BOUNDS.max_engine_id_chars`` when registered; a peer may send any).
LOGGED_ID_CHARS = 256



# Holds polls refused (RESOURCE_EXHAUSTED past the polls waiting on an
# engine, INVALID_ARGUMENT): a follower may send them as fast as it likes,
# each was a WARNING line (measured: 877 in 3 s from one client).
_holds_refused = Throttled(log)


class PeerService(pb_grpc.PeerServiceServicer):
    """Answers handshakes (our worker's NIXL agent metadata and layout), and in
    push mode writes held blocks into a reader's blocks.

    Callers are authenticated before a method runs (mutual TLS on the port,
    the token by ``PeerAuthInterceptor``; kvd/daemon/peer_auth.py)."""

    def __init__(self, node: Node):
        self.node = node
        self._refusals = Throttled(log)

    def _refused(self, context, what: str, request, e: ev.CoreError) -> Refused:
        """``e`` as the call's refusal, logged."""
        rank = f" rank={request.tp_rank}" if hasattr(request, "tp_rank") else ""  # Renew names no rank
        # A peer chooses the engine id (and the error may quote it): the log line is clipped
        # (an admitted peer's refused calls wrote multi-MiB lines, attacker review).
        # And at most one a second, with the count: a peer may repeat them at will.
        # A handshake for a worker not registered (any more) is the race of an
        # engine stopping or restarting while a reader pairs: INFO (a demo's
        # teardown showed it as a WARNING in a run that passed).
        say = self._refusals.info if what == "handshake" and isinstance(e, ev.NotFound) else self._refusals.warning
        say("%s from %s for engine=%s%s refused: %s", what, context.peer(), clip(request.engine_id, LOGGED_ID_CHARS),
            rank, clip(str(e), 4 * LOGGED_ID_CHARS))
        return Refused.of(e)

    async def Handshake(self, request: pb.HandshakeRequest, context) -> pb.HandshakeResponse:
        """Describes local worker ``(engine_id, tp_rank)`` to a remote daemon: NIXL
        agent metadata, layout, regions and their base addresses.

        gRPC status: NOT_FOUND for a worker not registered here;
        FAILED_PRECONDITION for another ``protocol_version`` or a ``compat_hash``
        that differs from the worker's."""
        try:
            hs = await self.node.handshake_info(request.engine_id, request.tp_rank, request.compat_hash,
                                                request.protocol_version)
        except ev.CoreError as e:
            raise self._refused(context, "handshake", request, e) from None
        resp = handshake_to_pb(hs)
        resp.holds_epoch = self.node.holds_epoch(request.engine_id)
        return resp

    async def Push(self, request: pb.PushRequest, context) -> pb.PushResponse:
        """Push mode, source side: WRITEs the blocks this worker holds for
        ``request_id`` into the reader's blocks; returns bytes written,
        descriptors and duration (seconds).

        gRPC status: NOT_FOUND for a worker not registered here or no blocks
        held for the request; INVALID_ARGUMENT for blocks not held, too many
        blocks, an ``expected_notifications`` outside 1..65536 or reader agent
        metadata NIXL rejects; ABORTED when the WRITE to the reader failed
        (or could not be posted) and has ended;
        RESOURCE_EXHAUSTED for a new reader while each of the worker's
        ``BOUNDS.max_push_readers`` readers has a WRITE in flight;
        FAILED_PRECONDITION for every push when ``serve_pushes`` is false,
        before the request is looked at (so the answer says nothing of what
        this daemon holds)."""
        try:
            if not self.node.modes.serves_pushes:
                raise ev.Incompatible("this daemon serves no pushes (serve_pushes = false): set transfer_mode = "
                                      "pull on the decode daemon that asked")
            order = PushOrder(
                engine_id=request.engine_id, tp_rank=request.tp_rank, request_id=request.request_id,
                source_groups=groups_from_pb(request.source_groups),
                reader=handshake_from_pb(request.reader), reader_tp_rank=request.reader_tp_rank,
                reader_groups=groups_from_pb(request.reader_groups),
                expected_notifications=request.expected_notifications, timeout_s=request.timeout_s,
            )
            r = await self.node.push(order)
        except ev.CoreError as e:
            raise self._refused(context, "push", request, e) from None
        return pb.PushResponse(bytes=r.bytes, num_descriptors=r.num_descriptors, duration_s=r.duration_s)

    async def Notify(self, request: pb.NotifyRequest, context) -> pb.NotifyResponse:
        """A reader is done with ``request_id`` on worker ``(engine_id, tp_rank)``
        (push mode's bare notification); the hold is freed once
        ``expected_notifications`` readers have notified. A notification for an
        unknown request is kept (it may arrive before its hold).

        gRPC status: INVALID_ARGUMENT for a ``request_id`` over ``BOUNDS.max_id_bytes``
        bytes or ``expected_notifications`` outside 1..65536; NOT_FOUND for a
        worker not registered here."""
        try:
            if len(request.request_id.encode()) > BOUNDS.max_id_bytes:
                # An unknown request's notification is kept (it may beat its hold).
                raise ev.InvalidArgument(f"notify: request_id longer than {BOUNDS.max_id_bytes} bytes")
            self.node.notify(request.engine_id, request.tp_rank, request.request_id,
                             request.expected_notifications)
        except ev.CoreError as e:
            raise self._refused(context, "notify", request, e) from None
        return pb.NotifyResponse()

    async def Claim(self, request: pb.ClaimRequest, context) -> pb.ClaimResponse:
        """A reader's claim before its READs: answers once worker
        ``(engine_id, tp_rank)`` holds ``groups`` for ``request_id``, waiting
        up to ``wait_s`` (capped) for the hold (``kvd.core.holds.Holds.claim``).

        gRPC status: NOT_FOUND for a worker not registered here;
        PERMISSION_DENIED when no lease covers those blocks; INVALID_ARGUMENT
        for too many blocks or a ``request_id`` over ``BOUNDS.max_id_bytes``;
        RESOURCE_EXHAUSTED when it would wait while too many claims, or
        claims of too many block ids, wait here (``BOUNDS.max_waiting_claims``,
        ``max_waiting_claim_ids``)."""
        try:
            if len(request.request_id.encode()) > BOUNDS.max_id_bytes:
                raise ev.InvalidArgument(f"claim: request_id longer than {BOUNDS.max_id_bytes} bytes")
            await self.node.claim(request.engine_id, request.tp_rank, request.request_id,
                                  groups_from_pb(request.groups), request.wait_s)
        except ev.CoreError as e:
            raise self._refused(context, "claim", request, e) from None
        return pb.ClaimResponse()

    async def Holds(self, request: pb.HoldsRequest, context) -> pb.HoldsResponse:
        """A reader daemon follows the holds of engine ``engine_id``
        (``kvd.core.hold_feed``): the leases started or ended after change
        ``after`` of feed ``epoch``, waiting up to ``wait_s`` (capped) for one.

        gRPC status: NOT_FOUND for an engine with no worker here;
        INVALID_ARGUMENT for an ``engine_id`` over ``BOUNDS.max_id_bytes``
        bytes; RESOURCE_EXHAUSTED when too many polls wait on that engine."""
        try:
            if len(request.engine_id.encode()) > BOUNDS.max_id_bytes or len(request.epoch) > 64:
                raise ev.InvalidArgument("holds: engine_id or epoch too long")
            answer = await self.node.follow_holds(request.engine_id, request.epoch, request.after, request.wait_s)
        except ev.NotFound as e:
            # A follower of an engine gone from here asks again after a backoff
            # until its own pairs with it go: not worth a warning each time.
            log.debug("holds from %s for engine=%s: %s", context.peer(), request.engine_id, e)
            raise Refused.of(e) from None
        except ev.CoreError as e:
            _holds_refused.warning("holds from %s for engine=%.128r refused: %s", context.peer(), request.engine_id,
                                   e)
            raise Refused.of(e) from None
        return holds_to_pb(answer)

    async def Renew(self, request: pb.RenewRequest, context) -> pb.RenewResponse:
        """A reader's daemon renews leases of engine ``engine_id``'s workers
        while the reader's requests wait (``kvd.core.holds.Holds.renew``): one
        result per renewal, ``reason="not_held"`` for a request whose lease
        does not hold the named blocks (a peer renews only leases it could
        claim: another engine's, or other blocks, are not renewed).

        gRPC status: NOT_FOUND for an engine not registered here;
        INVALID_ARGUMENT for more than ``BOUNDS.max_renewals_per_call``
        renewals, more than ``max_blocks_per_request`` block ids in all, or a
        request id empty or over ``BOUNDS.max_id_bytes`` bytes."""
        try:
            results = self.node.renew(request.engine_id,
                                      renewals_from_pb(request.renewals, self.node.limits.max_blocks_per_request))
        except ev.CoreError as e:
            raise self._refused(context, "renew", request, e) from None
        return pb.RenewResponse(results=renewed_to_pb(results))
