"""The daemon's client of remote daemons' PeerService (one channel per address).

Implements ``kvd.core.state.PeerLink``: every gRPC error becomes the core's
typed error, with the peer's address and message. With ``PeerAuth``
(kvd/daemon/peer_auth.py) its channels use mutual TLS and/or carry the token
proof, and an answer whose sender did not prove the token is not used.
"""

from __future__ import annotations

import asyncio
import functools
import time

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from kvd import __version__
from kvd.addresses import is_wildcard
from kvd.config import MAX_MESSAGE_BYTES
from kvd.core import events as ev
from kvd.core import hold_feed
from kvd.core.hold_feed import HoldsAnswer
from kvd.core.hold_mirror import MAX_EPOCH_CHARS, MAX_GROUPS, MAX_IDS, BadAnswer
from kvd.core.peers import MAX_AGENT_NAME_CHARS
from kvd.core.limits import BOUNDS, Limits
from kvd.core.state import PEER_CALLER, PROTOCOL_VERSION, HandshakeResult, PushOrder, PushResult
from kvd.daemon.convert import (
    groups_to_pb,
    handshake_from_pb,
    handshake_to_pb,
    holds_from_pb,
    renewals_to_pb,
    renewed_from_pb,
)
from kvd.daemon import wire_shape
from kvd.daemon.peer_auth import PeerAuth, PeerAuthError
from kvd.daemon.peer_local import DialRefused, dial_address
from kvd.daemon import unreachable
from kvd.daemon.unreachable import FirstContacts, Unreachable
from kvd.requests import LeaseRenewal, RenewResult
from kvd.v1 import kvd_pb2 as pb

SERVICE = "/kvd.v1.PeerService/"
#: The peer port's gRPC health check (an empty HealthCheckRequest: the server as a whole).
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
#: A probe of a peer that did not answer waits at most this long, seconds.
PROBE_TIMEOUT_S = 2.0
#: Codes that say nothing of whether the peer is there (kvd.daemon.unreachable).
_NO_OUTCOME = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                         grpc.StatusCode.INTERNAL})


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list:
    """gRPC channel options for peer calls: send and receive limits of
    ``max_message_bytes`` bytes."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


CHANNEL_OPTIONS = channel_options()

# Peer addresses come from requests (kv_transfer_params): channels are kept
# for the BOUNDS.max_peer_channels most recently used ones only, and a
# channel whose peer could not be reached is closed (measured: 3,000 distinct
# dead addresses kept 3,000 channels reconnecting forever, +20 MiB RSS per
# 1,000 and a busy CPU).


def _error(address: str, e: grpc.aio.AioRpcError) -> ev.CoreError:
    msg = f"{address}: {e.code().name}: {e.details()}"
    kind = {
        grpc.StatusCode.NOT_FOUND: ev.NotFound,
        grpc.StatusCode.FAILED_PRECONDITION: ev.Incompatible,
        grpc.StatusCode.INVALID_ARGUMENT: ev.InvalidArgument,
        grpc.StatusCode.PERMISSION_DENIED: ev.PermissionDenied,
        grpc.StatusCode.ABORTED: ev.WriteEnded,
        grpc.StatusCode.RESOURCE_EXHAUSTED: ev.PeerBusy,
    }.get(e.code())
    if kind is not None:
        return kind(msg)
    return ev.PeerUnavailable(msg, transient=e.code() in (grpc.StatusCode.UNAVAILABLE,
                                                            grpc.StatusCode.DEADLINE_EXCEEDED))


def _check_holds(m: pb.HoldsResponse) -> pb.HoldsResponse:
    """``m`` if it is within what a source answers (``kvd.core.hold_feed``:
    changes, KV-cache groups, block ids), counted before it is converted:
    each group becomes an array (~2-6 us and ~120 bytes each), and a hostile
    source's answer of 8.4M empty groups held the event loop 35 s and kept
    1.7 GB; an epoch of at most ``MAX_EPOCH_CHARS`` characters. Raises BadAnswer."""
    if len(m.epoch) > MAX_EPOCH_CHARS:
        raise BadAnswer(f"an epoch of {len(m.epoch)} characters (at most {MAX_EPOCH_CHARS})")
    if len(m.changes) > hold_feed.MAX_CHANGES_PER_ANSWER:
        raise BadAnswer(f"{len(m.changes)} changes in one answer")
    # One walk of the changes (each step makes wrapper objects: ~1 us a
    # change, a reader's every followed hold), refused as soon as the groups
    # pass either bound; the ids of the changes walked by then are counted
    # too (at most MAX_GROUPS_PER_ANSWER + MAX_GROUPS groups: a refusal of
    # 4,096 changes of 5 empty groups took 9.3 ms against 1.7 with a first
    # walk for the groups alone, less than converting an answer it accepts;
    # attacker review).
    groups = ids = 0
    for c in m.changes:
        gs = c.groups
        n = len(gs)
        if n > MAX_GROUPS:
            raise BadAnswer(f"{n} KV-cache groups")
        groups += n
        if groups > hold_feed.MAX_GROUPS_PER_ANSWER:
            raise BadAnswer(f"{groups} KV-cache groups in one answer")
        for g in gs:
            ids += len(g.ids)
    if ids > MAX_IDS:
        raise BadAnswer(f"{ids} block ids in one answer")
    return m


class PeerClient:
    """Handshake, push, notify, claim and renew calls to remote daemons.

    Args:
        auth: TLS material and token (None: plaintext, no token).
        max_message_bytes: gRPC message cap either way.
        max_blocks_per_request: the daemon's setting; bounds the shape of
            an answer before it is parsed (``kvd.daemon.wire_shape.peer_shape``).
        insecure: ``peer_insecure``: with no credential, pushes may go to
            other hosts (:meth:`push`).
    """

    def __init__(self, auth: PeerAuth | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 max_blocks_per_request: int = Limits.max_blocks_per_request, insecure: bool = False):
        self._answer_shape = functools.partial(wire_shape.peer_shape, max_blocks_per_request=max_blocks_per_request)
        self._channels: dict[str, grpc.aio.Channel] = {}  # least recently used first
        # Long polls of followed holds (Holds) on channels of their own, with
        # their own connections (gRPC shares a subchannel, and its reconnect
        # backoff, between channels to one address unless told not to): a poll
        # retried while a peer restarts would otherwise fail the handshake with
        # the new daemon at once (seen: "Connection refused" after it was up).
        self._poll_channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task] = set()
        #: addresses that did not answer: one probe at a time of each (kvd.daemon.unreachable)
        self.unreachable = Unreachable(self._probe, BOUNDS.max_peer_channels)
        #: contacts with addresses that never answered take turns (kvd.daemon.unreachable)
        self.first_contacts = FirstContacts()
        self.auth = auth or PeerAuth()
        self.insecure = insecure
        # A subchannel of its own per channel, as the polls': from gRPC's
        # global pool a new channel to a restarted peer took over the old
        # connection's reconnect back-off ("Connection refused" for 1-2.6 s
        # after the peer was back, review of the unreachable-peer gate).
        self.options = [*channel_options(max_message_bytes), ("grpc.use_local_subchannel_pool", 1)]
        # A poll's answer is bounded by the source (kvd.core.hold_feed): one
        # larger is refused by gRPC before it is parsed (a hostile source's
        # answer was parsed and converted up to the 64 MiB message cap).
        self.poll_options = [*channel_options(min(max_message_bytes, hold_feed.MAX_ANSWER_WIRE_BYTES)),
                             ("grpc.use_local_subchannel_pool", 1)]

    def _channel(self, address: str, pool: dict[str, grpc.aio.Channel]) -> grpc.aio.Channel:
        ch = pool.pop(address, None)
        if ch is None:
            ch = self.auth.channel(address, self.poll_options if pool is self._poll_channels else self.options)
        pool[address] = ch
        while len(pool) > BOUNDS.max_peer_channels:
            self._forget(next(iter(pool)), pool)
        return ch

    def _forget(self, address: str, pool: dict[str, grpc.aio.Channel]) -> None:
        """Closes ``address``'s channel; calls still on it get a few seconds to end."""
        ch = pool.pop(address, None)
        if ch is not None:
            task = asyncio.get_running_loop().create_task(ch.close(grace=5.0))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _admit(self, address: str, timeout_s: float, gated: bool = True) -> tuple[float, object]:
        """A first contact's admission (:class:`FirstContacts`) for the
        caller uid of this task (``PEER_CALLER``); ``gated``: an address the
        unreachable gate holds goes by its probe instead. Returns ``(seconds
        left, ticket)``; end the ticket with ``first_contacts.ended``."""
        if gated:
            return await self.first_contacts.admit(address, timeout_s, PEER_CALLER.get(),
                                                   self.unreachable.__contains__)
        return await self.first_contacts.admit(address, timeout_s, PEER_CALLER.get())

    async def _call(self, address: str, name: str, request, timeout_s: float, poll: bool = False,
                    admitted: bool = False):
        """One authenticated unary call (:meth:`_send`), a first contact's
        turn taken first where ``address`` is not proven
        (:class:`FirstContacts`; ``admitted``: its caller took it, for the
        name the address was dialed by)."""
        ticket = None
        if not admitted and not self.first_contacts.proven(address):
            timeout_s, ticket = await self._admit(address, timeout_s)
        try:
            return await self._send(address, name, request, timeout_s, poll)
        finally:
            self.first_contacts.ended(ticket)

    async def _send(self, address: str, name: str, request, timeout_s: float, poll: bool):
        """One authenticated unary call; gRPC and proof errors become core errors.

        Sent and received as bytes: the token's MAC covers the request's bytes
        and the callee's proof the answer's, checked before it is parsed.
        ``poll``: on the long polls' own channel to ``address``. ``request``:
        the message, or a function of the seconds left once the call may go
        that makes it (a claim's wait at the source).

        Calls other than polls and pushes to an address whose last call
        failed ``UNAVAILABLE`` wait for a probe of it first
        (:mod:`kvd.daemon.unreachable`); every call's outcome marks or
        unmarks its address; an answer only a kvd daemon gives proves it
        (:class:`FirstContacts`).
        """
        if not poll and name != "Push" and address in self.unreachable:
            started = time.monotonic()
            await self.unreachable.admit(address, timeout_s)
            timeout_s = max(0.01, timeout_s - (time.monotonic() - started))
        if callable(request):
            request = request(timeout_s)
        body = request.SerializeToString()
        md, proof = self.auth.call_metadata(SERVICE + name, address, body)
        pool = self._poll_channels if poll else self._channels
        try:
            call = self._channel(address, pool).unary_unary(SERVICE + name)(body, timeout=timeout_s, metadata=md)
            raw = await call
            self.unreachable.answered(address)
            self.auth.check_proof(await call.trailing_metadata(), proof, raw)
            self.first_contacts.answered(address)
            answer = getattr(pb, f"{name}Response")
            # The answering server may be anything a load names (kv_transfer_params):
            # walked before it is parsed (kvd.daemon.wire_shape).
            wire_shape.check(raw, answer.DESCRIPTOR, self._answer_shape(answer.DESCRIPTOR))
            return answer.FromString(raw)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self._forget(address, pool)
                self.unreachable.failed(address)
            elif e.code() not in _NO_OUTCOME:
                self.unreachable.answered(address)  # the peer's own error: it is there
                self.first_contacts.answered_with(address, e.code())
            raise _error(address, e) from None
        except PeerAuthError as e:
            raise ev.PeerUnavailable(f"{address}: {e}") from None
        except DecodeError as e:
            raise ev.PeerUnavailable(f"{address}: unreadable {name} answer: {e}") from None
        except wire_shape.ShapeError as e:
            if name == "Holds":  # as its counts past the bounds (_check_holds): a broken or hostile source
                raise BadAnswer(f"answer refused: {e}") from None
            raise ev.PeerUnavailable(f"{address}: {name} answer refused: {e}") from None

    async def _probe(self, address: str, timeout_s: float) -> str:
        """Whether the peer at ``address`` (marked: its last call failed
        ``UNAVAILABLE``) is back: its gRPC health check, which a daemon
        answers at once, within ``timeout_s`` seconds (at most
        ``PROBE_TIMEOUT_S``). Any answer but NOT_SERVING (a draining
        daemon's, whose calls fail ``UNAVAILABLE``, or one that lost its
        CUDA context: a restart follows either), a refusal included, says it
        is back; UNAVAILABLE, and UNKNOWN, INTERNAL, CANCELLED or a
        DEADLINE_EXCEEDED sent before this side's deadline (a peer or a
        proxy failing) fail it; this side's own deadline is no outcome. See
        :data:`kvd.daemon.unreachable.Probe`."""
        timeout_s = max(0.01, min(timeout_s, PROBE_TIMEOUT_S))
        ticket = None
        if not self.first_contacts.proven(address):  # a probe is a contact too: its turn is taken
            try:
                timeout_s, ticket = await self._admit(address, timeout_s, gated=False)
            except ev.PeerUnavailable as e:
                return str(e)
        try:
            return await self._health(address, timeout_s)
        finally:
            self.first_contacts.ended(ticket)

    async def _health(self, address: str, timeout_s: float) -> str:
        """:meth:`_probe`'s health check, its turn taken."""
        started = time.monotonic()
        try:
            raw = await self._channel(address, self._channels).unary_unary(HEALTH_CHECK)(b"", timeout=timeout_s)
            status = health_pb2.HealthCheckResponse.FromString(raw).status
            self.first_contacts.answered(address)  # a server answered (its daemon may be draining)
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:  # draining: its calls answer UNAVAILABLE
                return f"{address}: UNAVAILABLE: its health is NOT_SERVING (draining, or failed)"
            return unreachable.ANSWERED
        except DecodeError:
            return unreachable.ANSWERED  # something answered there (not a daemon: it proves nothing)
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                self._forget(address, self._channels)
                return f"{address}: UNAVAILABLE: {e.details()}"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started >= 0.9 * timeout_s:
                return unreachable.NO_OUTCOME  # this side's own deadline: it said nothing
            if code in _NO_OUTCOME:  # at once, from there: a peer, or a proxy in front of it, failing
                return f"{address}: {code.name}: {e.details()} (its health check)"
            self.first_contacts.answered_with(address, code)
            return unreachable.ANSWERED

    async def handshake(self, address: str, engine_id: str, tp_rank: int, compat_hash: str,
                        timeout_s: float) -> HandshakeResult:
        """Handshake with ``address`` for its worker ``(engine_id, tp_rank)``.

        With no peer credential, only with a daemon of this host run by
        root or this daemon's uid (:func:`kvd.daemon.peer_local.dial_address`,
        as a push and as callers are admitted), dialed at the IP checked: the
        answer's NIXL agent metadata is loaded into this daemon's agent, and
        UCX crashed the process on some malformed worker addresses in it (a
        segfault in ``add_remote_agent``, attacker review), so it is taken
        only from a daemon a credential or this host vouches for. With a
        credential, the answer must carry its proof (``_call``).

        Raises:
            PeerUnavailable: refused (the reason), or the call failed.
        """
        req = pb.HandshakeRequest(engine_id=engine_id, tp_rank=tp_rank, daemon_version=__version__,
                                  compat_hash=compat_hash, protocol_version=PROTOCOL_VERSION)
        ticket, dial = None, address
        try:
            if not self.first_contacts.proven(address):  # before the look at this host's daemons, too
                timeout_s, ticket = await self._admit(address, timeout_s)
            if address in self.unreachable:  # likewise; the gate's probe takes the turn (not behind this one)
                self.first_contacts.ended(ticket)
                ticket = None
                started = time.monotonic()
                await self.unreachable.admit(address, timeout_s)
                timeout_s = max(0.01, timeout_s - (time.monotonic() - started))
            if not self.auth.tls and not self.auth.token:
                dial = await self._local_dial(address, "handshake not sent (its answer's NIXL agent metadata would "
                                                       "be loaded here)", unreachable_as_call=True)
            raw = await self._call(dial, "Handshake", req, timeout_s, admitted=True)
        finally:
            self.first_contacts.ended(ticket)
            if dial != address and self.first_contacts.proven(dial):  # answered there, as dialed
                self.first_contacts.answered(address)
        return handshake_from_pb(raw)

    async def _local_dial(self, address: str, what: str, unreachable_as_call: bool = False) -> str:
        """With no peer credential: the IP to dial for ``address``
        (:func:`kvd.daemon.peer_local.dial_address`, found off the event loop).

        Raises:
            PeerUnavailable: ``"<address>: <what>: <why>"``; with
                ``unreachable_as_call``, nothing there to talk to reads as
                the call's failed connection would (``UNAVAILABLE``).
        """
        try:
            return await asyncio.to_thread(dial_address, address, self.insecure)
        except DialRefused as e:
            if unreachable_as_call and e.unreachable:
                self.unreachable.failed(address)  # its next handshakes wait for a probe, as a call's would
                raise ev.PeerUnavailable(f"{address}: UNAVAILABLE: {e}") from None
            raise ev.PeerUnavailable(f"{address}: {what}: {e}") from None

    async def push(self, address: str, order: PushOrder, timeout_s: float) -> PushResult:
        """Asks ``address`` to WRITE ``order``'s blocks; returns when done.

        The request carries this daemon's worker's NIXL agent metadata and
        region addresses (``order.reader``): what an agent needs to READ and
        WRITE that worker's memory. ``address`` comes from a load's
        ``kv_transfer_params`` (an API client's input), so the callee proves
        itself first (:meth:`_push_callee`); before, whatever listened
        there got the metadata and read and overwrote the decode engine's
        blocks (attacker review; the token's proof was checked on the answer,
        after the request had gone).

        Raises:
            PeerUnavailable: the callee did not prove itself, or the call failed.
            NotFound, InvalidArgument, ...: the callee's refusal (``_error``).
        """
        ticket = None
        try:
            if not self.first_contacts.proven(address):
                timeout_s, ticket = await self._admit(address, timeout_s)
            dial = await self._push_callee(address, order, timeout_s)
        finally:
            self.first_contacts.ended(ticket)  # not held through the WRITEs: the callee answered, or not
        req = pb.PushRequest(
            engine_id=order.engine_id, tp_rank=order.tp_rank, request_id=order.request_id,
            source_groups=groups_to_pb(order.source_groups), reader=handshake_to_pb(order.reader),
            reader_tp_rank=order.reader_tp_rank, reader_groups=groups_to_pb(order.reader_groups),
            expected_notifications=order.expected_notifications, timeout_s=order.timeout_s,
        )
        order.sent = True
        r = await self._call(dial, "Push", req, timeout_s, admitted=True)
        return PushResult(r.bytes, r.num_descriptors, r.duration_s)

    async def _push_callee(self, address: str, order: PushOrder, timeout_s: float) -> str:
        """The address to send a push for ``address`` to, once its callee may
        be told this worker's agent metadata.

        - Mutual TLS: ``address`` once the channel is ready (the TLS
          handshake checks the callee's certificate, for the host dialed,
          before any byte of a request goes).
        - Token: ``address``, after a ``Handshake`` with the source worker
          whose answer carries the callee's proof (:meth:`PeerAuth.check_proof`):
          only a daemon that knows the token, and takes the address it was
          dialed by for its own, answers one. One more round trip per push.
        - Neither: the IP that :func:`kvd.daemon.peer_local.dial_address`
          checked (this host's listeners of root or this uid, as callers are
          admitted), found off the event loop.

        A wildcard host (``0.0.0.0``, ``::``) is refused in every mode: it
        dials this host, whatever listens on that port here.

        Raises:
            PeerUnavailable: refused, or the handshake failed or was not proved.
            NotFound: the callee does not know the source worker.
        """
        host = address.rpartition(":")[0].strip("[]")
        if is_wildcard(host):
            raise ev.PeerUnavailable(f"{address}: push not sent: {host} is a bind address, not one to dial")
        if self.auth.tls:
            # The TLS handshake checks the callee; a push is "sent" (a WRITE
            # may follow, kvd.core.settle) only once it is done: a listener
            # that never answers gets nothing, and stops no agent.
            ch = self._channel(address, self._channels)
            state = ch.get_state(try_to_connect=True)
            try:
                async with asyncio.timeout(timeout_s):
                    while state != grpc.ChannelConnectivity.READY:
                        if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:  # as the call would: at once
                            self._forget(address, self._channels)
                            raise ev.PeerUnavailable(f"{address}: UNAVAILABLE: push not sent: no connection")
                        await ch.wait_for_state_change(state)
                        state = ch.get_state(try_to_connect=True)
            except TimeoutError:
                raise ev.PeerUnavailable(f"{address}: push not sent: no TLS connection within "
                                         f"{timeout_s:.1f} s") from None
            self.first_contacts.answered(address)  # its TLS handshake: a server with a certificate we trust
            return address
        if self.auth.token:
            req = pb.HandshakeRequest(engine_id=order.engine_id, tp_rank=order.tp_rank, daemon_version=__version__,
                                      protocol_version=PROTOCOL_VERSION)
            await self._call(address, "Handshake", req, timeout_s, admitted=True)
            return address
        return await self._local_dial(address, "push not sent (it would hand over this worker's NIXL agent metadata)")

    async def notify(self, address: str, engine_id: str, tp_rank: int, request_id: str, expected: int,
                     timeout_s: float) -> None:
        """Tells ``address`` that one reader is done with ``request_id`` on that rank."""
        req = pb.NotifyRequest(engine_id=engine_id, tp_rank=tp_rank, request_id=request_id,
                               expected_notifications=expected)
        await self._call(address, "Notify", req, timeout_s)

    async def claim(self, address: str, engine_id: str, tp_rank: int, request_id: str, groups,
                    wait_s: float, timeout_s: float) -> None:
        """Returns once ``address``'s worker holds ``groups`` for ``request_id``
        (``kvd.core.holds.Holds.claim``); PermissionDenied when it does not.
        ``wait_s`` is cut to the call's time left, less 0.1 s, when it goes:
        a claim that first waited for a probe of its address
        (:meth:`_call`) must not ask the source to wait past its own
        deadline (the answer would be a timeout, not ``not_held``)."""
        pb_groups = groups_to_pb(groups)

        def request(left_s: float) -> pb.ClaimRequest:
            return pb.ClaimRequest(engine_id=engine_id, tp_rank=tp_rank, request_id=request_id, groups=pb_groups,
                                   wait_s=min(wait_s, max(0.0, left_s - 0.1)))

        await self._call(address, "Claim", request, timeout_s)

    async def holds(self, address: str, engine_id: str, epoch: str, after: int, wait_s: float,
                    timeout_s: float) -> HoldsAnswer:
        """One poll of the holds of ``address``'s engine ``engine_id`` after
        change ``after`` of feed ``epoch`` (``kvd.core.hold_feed``), waiting
        there up to ``wait_s`` seconds for one."""
        req = pb.HoldsRequest(engine_id=engine_id, epoch=epoch, after=after, wait_s=wait_s)
        return holds_from_pb(_check_holds(await self._call(address, "Holds", req, timeout_s, poll=True)))

    async def holds_agent(self, address: str, engine_id: str, tp_rank: int, timeout_s: float) -> tuple[str, str]:
        """The NIXL agent name of worker ``(engine_id, tp_rank)`` at the daemon
        that answers this daemon's polls of ``address`` (a Handshake on the
        polls' own channel), and the epoch of that engine's hold feed there
        (``HandshakeResponse.holds_epoch``). The polls have a connection of their own, and
        an address may reach several daemons (a load balancer, a DNS name of
        several records): a follow lets loads skip the claim only where its
        pairs are with these very agents (``kvd.core.hold_mirror``).
        Measured before: behind an address that sent each connection to the
        next of two daemons, a reader READ engine ``e``'s blocks on one
        daemon with a hold of the same engine id on the other
        (tests/test_security_attack6.py).

        Raises:
            InvalidArgument: the answer's epoch or agent name is longer than
                ``MAX_EPOCH_CHARS`` or ``MAX_AGENT_NAME_CHARS``.
        """
        req = pb.HandshakeRequest(engine_id=engine_id, tp_rank=tp_rank, daemon_version=__version__,
                                  protocol_version=PROTOCOL_VERSION)
        r = await self._call(address, "Handshake", req, timeout_s, poll=True)
        if len(r.holds_epoch) > MAX_EPOCH_CHARS or len(r.agent_name) > MAX_AGENT_NAME_CHARS:
            raise ev.InvalidArgument(f"{address}: a handshake answer with an epoch of {len(r.holds_epoch)} and an "
                                     f"agent name of {len(r.agent_name)} characters (at most {MAX_EPOCH_CHARS} and "
                                     f"{MAX_AGENT_NAME_CHARS})")
        return r.agent_name, r.holds_epoch

    async def renew(self, address: str, engine_id: str, renewals: list[LeaseRenewal],
                    timeout_s: float) -> list[RenewResult]:
        """Renews ``address``'s leases of engine ``engine_id`` named in
        ``renewals`` (``kvd.core.holds.Holds.renew``); one result per renewal,
        same order. A peer answering another count is PeerUnavailable."""
        req = pb.RenewRequest(engine_id=engine_id, renewals=renewals_to_pb(renewals))
        r = await self._call(address, "Renew", req, timeout_s)
        if len(r.results) != len(renewals):
            raise ev.PeerUnavailable(f"{address}: {len(r.results)} renewal results for {len(renewals)} renewals")
        return renewed_from_pb(r.results)

    async def close(self) -> None:
        for pool in (self._channels, self._poll_channels):
            for ch in pool.values():
                await ch.close()
            pool.clear()
        for task in list(self._closing):
            await task
