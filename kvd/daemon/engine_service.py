"""``kvd.v1.EngineService``: the local engines' side of the daemon (Unix socket).

Every call arrives through the gate (kvd/daemon/local_gate.py), which knows
the calling process's kernel credentials and has refused callers that are not
admitted. Here each registration is bound to its caller (docs/SECURITY.md):

- RegisterEngine maps only segments the caller could read and write itself,
  and returns a random ``session_token``;
- OpenSession and UnregisterEngine for that worker are accepted with that
  token (from a process of the same uid, or root), or without it from the
  very process that registered (same pid; when the daemon cannot see the
  caller's pid, another container's, the same uid), unless
  ``require_session_token``;
- UnregisterEngine is also accepted from the same uid when the registering
  process is gone or the worker has no session (an engine restarting and
  replacing its stale registration);
- commands on a session act on that session's worker only.
Anything else is PERMISSION_DENIED with a message naming both parties.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets

import grpc

from kvd import __version__
from kvd import tracepoints as tp
from kvd.core import cuda_ipc
from kvd.core import events as ev
from kvd.core.limits import BOUNDS
from kvd.core.memory import MEMFD_KIND
from kvd.core.node import Node
from kvd.core.state import PEER_CALLER, Owner, Segment, Worker, WorkerKey
from kvd.daemon.call_refusal import Refused
from kvd.daemon.convert import (
    event_to_pb,
    groups_from_pb,
    layout_from_pb,
    load_from_pb,
    region_from_pb,
    renewals_from_pb,
    renewed_to_pb,
)
from kvd.daemon.fd_channel import ClaimError, FdTable
from kvd.daemon.logs import Throttles
from kvd.daemon.status import build_stats, handover_of
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

log = logging.getLogger("kvd.engine")

# The id fields each session command has, of those bounded by
# BOUNDS.max_id_bytes, in the order they are checked. Per kind: asking a
# protobuf message for a field it lacks raises (getattr's default catches
# it), and the three a HoldBlocks lacks cost ~5 of the check's 7 us (a loop
# of 200,000).
_ID_FIELDS = {
    f.name: tuple(n for n in ("request_id", "remote_request_id", "remote_engine_id", "remote_address")
                  if n in f.message_type.fields_by_name)
    for f in pb.SessionCommand.DESCRIPTOR.oneofs_by_name["command"].fields
}


def _staging_segments(worker: Worker) -> list[pb.Segment]:
    """The mirrors of a staged worker, for the shim: shm names, or (VRAM)
    the CUDA IPC handles of the daemon's own allocations."""
    mem = worker.mem
    if not mem.staged:
        return []
    if mem.memory == "VRAM":
        return [pb.Segment(kind=pb.MEMORY_KIND_CUDA_IPC, handle=m.handle, device=m.device, size=m.size,
                           device_uuid=cuda_ipc.uuid_of(m.device))
                for m in mem.mappings]
    return [pb.Segment(kind=pb.MEMORY_KIND_SHM, name=n, size=m.size) for n, m in zip(mem.staging, mem.mappings)]


class EngineService(pb_grpc.EngineServiceServicer):
    """Adapts EngineService RPCs onto :class:`kvd.core.node.Node`.

    Every core error becomes a gRPC status with the core's message; a bad
    command on the session stream becomes a ``CommandRejected`` event and the
    stream goes on.

    Args:
        callers: ``context -> Caller | None``, the kernel credentials of an
            RPC's caller (``Gate.caller``).
        require_session_token: refuse OpenSession / UnregisterEngine without
            the registration's token.
        require_memfd: refuse named shm segments in RegisterEngine (memory
            handed over as sealed memfds only; docs/SECURITY.md).
        fds: fds handed over on the fd side channel, claimed by RegisterEngine.
    """

    def __init__(self, node: Node, backends: list[str] | None = None, callers=None,
                 require_session_token: bool = False, fds: FdTable | None = None, require_memfd: bool = False):
        self.node = node
        self.backends = list(backends or [])
        self._renew_refusals = Throttles(log)  # a line a second per caller uid: one may repeat them at will
        self.metrics_address = ""      # host:port of /metrics, for GetStats
        self.command_socket = ""       # the command socket's path ("" off), for GetStats
        self.callers = callers or (lambda context: None)
        self.require_session_token = require_session_token
        self.require_memfd = require_memfd
        self.fds = fds if fds is not None else FdTable()  # the fd side channel's unclaimed fds

    def _refuse_while_draining(self) -> None:
        if self.node.draining:  # set by the server at SIGTERM
            raise Refused(grpc.StatusCode.UNAVAILABLE, "daemon is draining (shutting down)")

    def _caller(self, context):
        c = self.callers(context)
        if c is None:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, "kvd: caller unknown (not through the engine socket)")
        return c

    def _authorize(self, key: WorkerKey, caller, token: str, what: str, takeover: bool = False) -> None:
        """Raises ev.PermissionDenied unless ``caller`` may drive or drop worker ``key``
        (registered: the caller checked ``node.worker`` first)."""
        w = self.node.workers.get(key)
        o = w.owner if w is not None else None
        label = f"engine {key[0]!r} rank {key[1]}"
        if o is None:
            raise ev.PermissionDenied(f"{what}: {label} has no known owner")
        same_user = caller.uid in (o.uid, 0)
        if token:
            if same_user and hmac.compare_digest(token.encode("utf-8", "surrogateescape"), o.token.encode()):
                return
            raise ev.PermissionDenied(f"{what}: session_token does not match the registration of {label} "
                                      f"(registered by {o}; caller {caller})")
        same_process = caller.pid == o.pid  # both 0: the daemon sees neither pid (another container)
        if same_user and same_process and not self.require_session_token:
            return
        if takeover and same_user:
            gone = o.pid > 0 and not os.path.exists(f"/proc/{o.pid}")
            if gone or not w.session.streams:
                log.info("%s: %s by %s, replacing the registration of %s (%s)", w.label, what, caller, o,
                         "process gone" if gone else "no session")
                return
        why = ("session_token required (require_session_token)" if self.require_session_token and same_process
               else "send the session_token its RegisterEngine returned")
        raise ev.PermissionDenied(f"{what}: {label} was registered by another process ({o}; caller "
                                  f"{caller}): {why}")

    async def RegisterEngine(self, request: pb.RegisterEngineRequest, context) -> pb.RegisterEngineResponse:
        """Registers one engine worker (TP rank): maps its segments, makes its NIXL
        agent and registers its memory; returns a fresh ``session_token`` for its
        Session/UnregisterEngine, the agent name, this daemon's peer address and
        the data path chosen (STAGED with its mirror segments, or DIRECT).

        gRPC status: UNAVAILABLE while draining; PERMISSION_DENIED for a caller
        not come through the engine socket or a segment it cannot read and write;
        INVALID_ARGUMENT for bad ids, layout, regions, a missing or short segment,
        or a segment kind other than SHM/CUDA_IPC on the direct path;
        FAILED_PRECONDITION for a named shm segment under ``require_memfd``;
        ALREADY_EXISTS when ``(engine_id, tp_rank)`` is registered (core errors
        mapped by ``convert.status_of``). MEMFD segments name fds handed over
        on the fd side channel (``kvd.daemon.fd_channel``): an id that cannot
        be claimed, or an fd that is not a memfd sealed against shrinking, is
        INVALID_ARGUMENT."""
        with self.fds.claiming() as claim:  # the fds this call claims are closed when it ends
            return await self._register(request, context, claim)

    async def _register(self, request: pb.RegisterEngineRequest, context, claim) -> pb.RegisterEngineResponse:
        self._refuse_while_draining()
        caller = self._caller(context)
        w = request.worker
        staged = request.data_path == pb.DATA_PATH_STAGED or (
            request.data_path == pb.DATA_PATH_AUTO and any(not (s.name or s.fd_id) for s in request.segments))
        if request.data_path == pb.DATA_PATH_AUTO and any(s.kind == pb.MEMORY_KIND_CUDA_IPC for s in request.segments):
            staged = None  # GPU memory: the core chooses (kvd.core.path_select)
        segments = []
        for i, s in enumerate(request.segments):
            if s.kind == pb.MEMORY_KIND_MEMFD and not staged:
                try:
                    segments.append(Segment(s.fd_id, s.size, MEMFD_KIND, fd=claim(s.fd_id, caller.uid)))
                except ClaimError as e:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"segment {i}: {e}") from None
                continue
            if s.kind == pb.MEMORY_KIND_CUDA_IPC:
                segments.append(Segment(s.name, s.size, cuda_ipc.KIND, bytes(s.handle), s.device,
                                        device_uuid=bytes(s.device_uuid)))
                continue
            if not staged and s.kind != pb.MEMORY_KIND_SHM:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"segment {i}: only MEMORY_KIND_SHM, MEMORY_KIND_MEMFD and MEMORY_KIND_CUDA_IPC are "
                              f"supported by this daemon (or data_path STAGED)")
            if self.require_memfd and s.name and not staged:
                # A named object can be shrunk by its engine under the daemon's
                # mapping (SIGBUS in the daemon); a sealed memfd cannot.
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"segment {i}: named shm segment {s.name!r} refused: this daemon requires memory "
                              f"handed over as a sealed memfd (require_memfd); the kvd shim does so where "
                              f"memfd_create and F_SEAL_SHRINK work")
            segments.append(Segment(s.name, s.size))
        token = secrets.token_hex(16)
        owner = Owner(caller.uid, caller.gid, frozenset(caller.gids), caller.pid, token)
        try:
            worker = await self.node.register(
                w.engine_id, w.tp_rank, w.tp_size,
                layout_from_pb(request.layout), segments,
                [region_from_pb(r) for r in request.regions],
                model=request.model, compat_extra=request.compat_extra, staged=staged,
                owner_pid=request.owner_pid, owner=owner,
            )
        except ev.CoreError as e:
            raise Refused.of(e) from None
        log.info("%s registered by %s (memory handed over as %s)", worker.label, caller, handover_of(worker))
        return pb.RegisterEngineResponse(
            session_token=token,
            agent_name=worker.agent.name, peer_address=self.node.peer_address,
            compat_hash=worker.compat_hash, registered_bytes=worker.mem.registered_bytes,
            data_path=pb.DATA_PATH_STAGED if worker.mem.staged else pb.DATA_PATH_DIRECT,
            staging_segments=_staging_segments(worker),
        )

    async def UnregisterEngine(self, request: pb.UnregisterEngineRequest, context) -> pb.UnregisterEngineResponse:
        """Drops worker ``(engine_id, tp_rank)``: fails its loads, ends its leases,
        frees its NIXL state; returns the number of leases released.

        gRPC status: NOT_FOUND for a worker not registered; PERMISSION_DENIED for
        a caller not come through the engine socket, a ``session_token`` that
        does not match (or another user's), or, without a token, a caller that
        is not the registering process (or ``require_session_token`` is set),
        unless a same-user caller takes over an owner that is gone or has no
        session."""
        caller = self._caller(context)
        key = (request.worker.engine_id, request.worker.tp_rank)
        try:
            self.node.worker(*key)
            self._authorize(key, caller, request.session_token, "UnregisterEngine", takeover=True)
            n = await self.node.unregister(key)
        except ev.CoreError as e:
            raise Refused.of(e) from None
        return pb.UnregisterEngineResponse(released_leases=n)

    async def GetStats(self, request, context) -> pb.StatsResponse:
        """This daemon's ``StatsResponse`` (workers, leases, transfers, peer and
        metrics addresses, draining flag; ``build_stats``). Never aborts; read by
        ``kvd status`` and by the shim for the peer address.

        Worker rows (engine ids, compatibility hashes, agent names) only for
        the caller's own workers (same uid); root and the daemon's own uid see
        every one. Another user's engine id and hash are what a cross-user
        READ would need (docs/SECURITY.md)."""
        return build_stats(self.node, draining=self.node.draining, backends=self.backends,
                           metrics_address=self.metrics_address, visible=self._visible(self.callers(context)),
                           command_socket=self.command_socket)

    async def RenewLeases(self, request: pb.RenewLeasesRequest, context) -> pb.RenewLeasesResponse:
        """Decode side, from an engine's scheduler: renews leases of prefill
        engine ``remote_engine_id`` at ``remote_address`` (PeerService.Renew,
        or this daemon's own holds), within the call's deadline and at most
        ``handshake_timeout_s``. One result per renewal, same order.

        Admitted like every call on the engine socket (the gate); the prefill
        daemon renews only leases that hold the named blocks of the named
        requests (the claim rule, docs/SECURITY.md).

        gRPC status: INVALID_ARGUMENT past the bounds (renewals per call,
        block ids, id length) or for an empty engine id or address; NOT_FOUND
        when the prefill daemon has no such engine; UNAVAILABLE when it
        cannot be asked."""
        caller = self._caller(context)
        PEER_CALLER.set(caller.uid)  # this call's own task: a renewal to a new address spends its caller's turns
        try:
            if not request.remote_engine_id or not request.remote_address:
                raise ev.InvalidArgument("renew: remote_engine_id and remote_address are required")
            longest = max(len(request.remote_engine_id.encode()), len(request.remote_address.encode()))
            if longest > BOUNDS.max_id_bytes:
                raise ev.InvalidArgument(f"renew: engine id or address longer than {BOUNDS.max_id_bytes} bytes")
            left = context.time_remaining()
            timeout_s = min(self.node.limits.handshake_timeout_s, left if left is not None else float("inf"))
            results = await self.node.renew_at(request.remote_address, request.remote_engine_id,
                                               renewals_from_pb(request.renewals,
                                                                self.node.limits.max_blocks_per_request), timeout_s)
        except ev.CoreError as e:
            # A line a second per caller uid (kernel-checked, so one uid's
            # refusals cannot hide another's), as the command socket's.
            self._renew_refusals.info(caller.uid, "renew of %d leases of engine %s at %s refused: %s",
                                      len(request.renewals), request.remote_engine_id, request.remote_address, e)
            raise Refused.of(e) from None
        return pb.RenewLeasesResponse(results=renewed_to_pb(results))

    @staticmethod
    def _visible(caller):
        """Which workers' rows ``caller`` sees (None: all of them)."""
        if caller is not None and caller.uid in (0, os.getuid()):
            return None
        uid = caller.uid if caller is not None else None
        return lambda w: uid is not None and w.owner is not None and w.owner.uid == uid

    async def Session(self, request_iterator, context):
        """One worker's command/event stream; the first command must be ``open``
        (the session's rules: :meth:`session_events`; a refusal ends the
        stream with its status)."""
        async with contextlib.aclosing(self.session_events(request_iterator, lambda: self.callers(context))) as events:
            async for event in events:
                yield event

    async def session_events(self, commands, caller, write_event=None, drop=None):
        """The session of one worker, whatever carries it (the gRPC stream
        above, or the command socket, ``kvd.daemon.command_socket``): reads
        ``commands`` (an async iterator of ``SessionCommand``; the first must
        be ``open``), runs them on the worker it opens and yields the
        ``SessionEvent`` s for its engine, ``opened`` first, until
        ``commands`` ends; then detaches the worker (``Node.detach``).

        ``caller()``: the ``Caller`` of the session (None: not through the gate).

        Two shortcuts a transport may offer, each saving a round of this
        generator's task per command or event (docs/PERFORMANCE.md, "sixth
        round"): ``commands.run_direct(handler)`` (the command socket's
        reader) hands every command after ``open`` to ``handler`` as it is
        read and returns a future done when the commands end; and
        ``write_event(SessionEvent) -> bool`` writes an event at once
        (False: not now, it is queued and yielded here), used while this is
        the worker's only session; ``drop()`` ends the transport at once when
        the session is dropped for not reading its events (its writer may be
        waiting for the engine to read, and this generator with it).

        Raises:
            Refused: INVALID_ARGUMENT (no OpenSession within
                ``BOUNDS.open_session_timeout_s`` seconds, the commands ended
                before one, or the first command is another), UNAVAILABLE
                (draining), PERMISSION_DENIED (caller unknown, or not the
                worker's: ``_authorize``), NOT_FOUND
                (worker not registered), RESOURCE_EXHAUSTED (more than
                ``max_queued_event_bytes`` or ``BOUNDS.max_pending_events``
                of events left unread).
        """
        it = commands.__aiter__()
        try:
            async with asyncio.timeout(BOUNDS.open_session_timeout_s):
                first = await it.__anext__()
        except TimeoutError:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"session: no OpenSession within {BOUNDS.open_session_timeout_s:g} s") from None
        except StopAsyncIteration:  # the engine closed its side (its write side, or all) first
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                 "session: the engine ended its commands before an OpenSession") from None
        if first.WhichOneof("command") != "open":
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "session: the first command must be OpenSession")
        if self.node.draining:  # set by the server at SIGTERM
            raise Refused(grpc.StatusCode.UNAVAILABLE, "daemon is draining (shutting down)")
        c = caller()
        if c is None:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                                 "kvd: caller unknown (not through the engine socket)")
        key = (first.open.worker.engine_id, first.open.worker.tp_rank)
        try:
            self.node.worker(*key)
            self._authorize(key, c, first.open.session_token, "OpenSession")
            w = await self.node.attach(*key)
        except ev.CoreError as e:
            raise Refused.of(e) from None
        # A line a second per worker: its engine may open and close sessions
        # in a loop (1,461 lines a second, attacker review).
        self.node.rt.lines.info(("session opened", w.key), "session opened: %s", w.label)
        reader = sink = None
        try:
            limits = self.node.rt.limits
            yield pb.SessionEvent(opened=pb.SessionOpened(
                agent_name=w.agent.name, daemon_version=__version__, transfer_timeout_s=limits.transfer_timeout_s,
                max_transfer_timeout_s=limits.max_transfer_timeout_s))
            direct = getattr(it, "run_direct", None)
            if direct is not None:
                reader = direct(lambda cmd: self._run_command(w, cmd, c.uid))
            else:
                reader = asyncio.get_running_loop().create_task(self._read_commands(w, it, c.uid))
            events, wakeup = w.session.events, w.session.wakeup
            if write_event is not None:

                def sink(e: ev.Event) -> bool:
                    tp.hit(tp.EVENT, e.request_id)
                    return write_event(event_to_pb(e))

            # The reader's end wakes this loop too: one Event to wait on, no
            # waiter task and asyncio.wait per event (two loop rounds less).
            reader.add_done_callback(lambda _: wakeup.set())
            while True:
                while events:
                    e = events.popleft()
                    tp.hit(tp.EVENT, e.request_id)
                    yield event_to_pb(e)
                if w.session.overflowed:
                    if drop is not None and w.session.on_overflow is not drop:
                        # Its events overflowed before the writer was set up
                        # here (a burst of commands read at once): the
                        # connection ends now too, as it does after.
                        drop()
                    raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         f"session dropped: more than {w.session.overflowed} of events "
                                         f"queued unread")
                if sink is not None and w.session.streams == 1 and w.session.sink is None:
                    # Nothing queued and this the worker's only session: later
                    # events are written at once (again, after a second
                    # session came and went, or after the socket was full).
                    w.session.sink = sink
                    w.session.on_overflow = drop
                if reader.done():
                    break
                wakeup.clear()
                await wakeup.wait()
        finally:
            if sink is not None and w.session.sink is sink:
                w.session.sink = None
            if drop is not None and w.session.on_overflow is drop:
                w.session.on_overflow = None
            if reader is not None:
                reader.cancel()
            await self.node.detach(w)
            self.node.rt.lines.info(("session closed", w.key), "session closed: %s", w.label)

    async def _read_commands(self, w: Worker, it, uid: int) -> None:
        """Runs the session's commands on ``w`` (opened by a caller of ``uid``)
        until they end or one ends the session (``_run_command``)."""
        async for cmd in it:
            if not self._run_command(w, cmd, uid):
                return

    def _run_command(self, w: Worker, cmd: pb.SessionCommand, uid: int) -> bool:
        """Runs one session command on ``w`` (opened by a caller of ``uid``);
        a bad one is rejected (an event), never a broken stream. Returns
        False when the session must read no more (its worker is gone)."""
        node = self.node
        limit = BOUNDS.max_id_bytes
        kind = cmd.WhichOneof("command")
        if w.session.overflowed:
            return False  # dropped for not reading its events: no more of its commands run
        if node.workers.get(w.key) is not w:
            # Unregistered, or registered again (another Worker, this
            # session's one is freed): its commands would reach freed NIXL
            # handles (a released descriptor list in make_prepped_xfer).
            node.reject(w, "", "worker unregistered")
            return False
        c = getattr(cmd, kind) if kind else None
        # A str of n characters encodes to at most 4n bytes: most need no encode.
        long_id = next((f for f in _ID_FIELDS.get(kind, ())
                        if len(v := getattr(c, f)) > limit >> 2 and len(v.encode()) > limit), None)
        if long_id:
            node.reject(w, getattr(c, "request_id", ""), f"{kind}: {long_id} longer than {limit} bytes")
        elif kind == "load":
            tp.hit(tp.SESSION_READ, c.request_id)
            req = load_from_pb(c)
            cap = node.limits.max_inflight_per_worker
            if w.loads_started + len(w.inflight) >= cap:
                # Failed before a task exists: a flood of loads costs no task
                # each (a task may first wait on a name lookup, Node.load).
                node.rt.fail_load(w, req.request_id, req.local_block_ids, ev.FailureKind.BUSY,
                                  f"busy: {w.loads_started} loads starting and {len(w.inflight)} reading "
                                  f"(max_inflight_per_worker {cap})", req.remote_address)
                return True
            invalid = node.pull.refusal(w, req)  # here, not in the task: its cost is the command's
            if invalid:
                node.rt.fail_load(w, req.request_id, req.local_block_ids, ev.FailureKind.INVALID, invalid,
                                  req.remote_address)
                return True
            refused, counted = node.rt.load_ids.take(w, req)
            if refused:
                node.rt.fail_load(w, req.request_id, req.local_block_ids, ev.FailureKind.BUSY, refused,
                                  req.remote_address)
                return True
            # The session's epoch now: a load that starts after its session
            # ended is dropped (Pull.load), whatever order the loop runs it in.
            task = asyncio.get_running_loop().create_task(node.load(w, req, w.session.epoch, uid=uid))
            w.loads_started += 1
            node.rt.load_ids.started(w, counted, task, lambda: setattr(w, "loads_started", w.loads_started - 1))
        elif kind == "hold":
            node.hold(w, c.request_id, groups_from_pb(c.groups), c.lease_s)
        elif kind == "release":
            node.release(w, c.request_id)
        elif kind == "abort_load":
            self._abort(w, c, uid)
        else:
            node.reject(w, "", f"unexpected command {kind!r} on an open session")
        return True

    def _abort(self, w: Worker, c: pb.AbortLoad, uid: int) -> None:
        """Starts an AbortLoad in one of the daemon's abort slots
        (``kvd.core.aborts``: ``Limits.max_aborts`` in all,
        ``max_aborts_per_uid`` per caller uid); with none free it is rejected.
        Each may wait a handshake timeout on an unreachable peer, so
        unbounded they pile up as tasks."""
        node = self.node
        if c.remote_tp_size > BOUNDS.max_tp_size:  # here, not in the task: no slot, no line per command
            node.reject(w, c.request_id, f"abort_load: remote TP size {c.remote_tp_size} exceeds "
                                         f"{BOUNDS.max_tp_size}")
            return
        refused = node.rt.aborts.start(uid, lambda: node.abort_load(
            w, c.request_id, c.remote_engine_id, c.remote_address, c.remote_request_id, c.remote_tp_size))
        if refused:
            node.reject(w, c.request_id, f"abort_load: {refused}")
