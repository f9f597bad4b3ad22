"""``kvd.v1.EngineService``: the local engines' side of the daemon (Unix socket)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvd import __version__
from kvd.core import events as ev
from kvd.core.node import Node, Segment, flat
from kvd.daemon.convert import event_to_pb, groups_from_pb, layout_from_pb, region_from_pb, status_of
from kvd.daemon.status import build_stats
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

log = logging.getLogger("kvd.engine")


class EngineService(pb_grpc.EngineServiceServicer):
    """Adapts EngineService RPCs onto :class:`kvd.core.node.Node`.

    Every core error becomes a gRPC status with the core's message; a bad
    command on the session stream becomes a ``CommandRejected`` event and the
    stream goes on.
    """

    def __init__(self, node: Node, on_event=None, backends: list[str] | None = None):
        self.node = node
        self.draining = False          # set by the server at SIGTERM: refuse new work
        self.on_event = on_event or (lambda name, fields: None)  # metrics hook (Metrics.on_event)
        self.backends = list(backends or [])
        self.metrics_address = ""      # host:port of /metrics, for GetStats

    async def _refuse_while_draining(self, context) -> None:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "daemon is draining (shutting down)")

    async def RegisterEngine(self, request: pb.RegisterEngineRequest, context) -> pb.RegisterEngineResponse:
        await self._refuse_while_draining(context)
        w = request.worker
        staged = request.data_path == pb.DATA_PATH_STAGED or (
            request.data_path == pb.DATA_PATH_AUTO and any(not s.name for s in request.segments))
        segments = []
        for i, s in enumerate(request.segments):
            if not staged and s.kind != pb.MEMORY_KIND_SHM:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"segment {i}: only MEMORY_KIND_SHM is supported by this daemon "
                                    f"(or data_path STAGED)")
            segments.append(Segment(s.name, s.size))
        try:
            worker = await self.node.register(
                w.engine_id, w.tp_rank, w.tp_size,
                layout_from_pb(request.layout), segments,
                [region_from_pb(r) for r in request.regions],
                model=request.model, compat_extra=request.compat_extra, staged=staged,
                owner_pid=request.owner_pid,
            )
        except ev.CoreError as e:
            await context.abort(status_of(e), str(e))
        return pb.RegisterEngineResponse(
            agent_name=worker.agent.name, peer_address=self.node.peer_address,
            compat_hash=worker.compat_hash, registered_bytes=worker.registered_bytes,
            data_path=pb.DATA_PATH_STAGED if staged else pb.DATA_PATH_DIRECT,
            staging_segments=[pb.Segment(kind=pb.MEMORY_KIND_SHM, name=n, size=m.size)
                              for n, m in zip(worker.staging, worker.mappings)],
        )

    async def UnregisterEngine(self, request: pb.UnregisterEngineRequest, context) -> pb.UnregisterEngineResponse:
        try:
            n = await self.node.unregister((request.worker.engine_id, request.worker.tp_rank))
        except ev.CoreError as e:
            await context.abort(status_of(e), str(e))
        return pb.UnregisterEngineResponse(released_leases=n)

    async def GetStats(self, request, context) -> pb.StatsResponse:
        return build_stats(self.node, draining=self.draining, backends=self.backends,
                           metrics_address=self.metrics_address)

    async def Session(self, request_iterator, context):
        """One worker's command/event stream; the first command must be ``open``."""
        it = request_iterator.__aiter__()
        try:
            first = await asyncio.wait_for(it.__anext__(), timeout=30.0)
        except (StopAsyncIteration, asyncio.TimeoutError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session: no OpenSession within 30 s")
        if first.WhichOneof("command") != "open":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session: the first command must be OpenSession")
        await self._refuse_while_draining(context)
        try:
            w = self.node.attach(first.open.worker.engine_id, first.open.worker.tp_rank)
        except ev.CoreError as e:
            await context.abort(status_of(e), str(e))
        log.info("session opened: %s", w.label)
        yield pb.SessionEvent(opened=pb.SessionOpened(agent_name=w.agent.name, daemon_version=__version__))
        reader = asyncio.get_running_loop().create_task(self._read_commands(w, it))
        try:
            while True:
                while w.events:
                    yield event_to_pb(w.events.popleft())
                if reader.done():
                    break
                w.wakeup.clear()
                waiter = asyncio.ensure_future(w.wakeup.wait())
                await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
        finally:
            reader.cancel()
            self.node.detach(w)
            log.info("session closed: %s", w.label)

    async def _read_commands(self, w, it) -> None:
        node = self.node
        async for cmd in it:
            kind = cmd.WhichOneof("command")
            if w.key not in node.workers:
                node._emit(w, ev.CommandRejected("", "worker unregistered"))
                return
            if kind == "load":
                c = cmd.load
                if self.draining:
                    reason = "draining: daemon is shutting down"
                    log.warning("%s request=%s peer=%s: load failed: %s", w.label, c.request_id,
                                c.remote_address, reason)
                    self.on_event("failure", {"reason": reason})
                    node._emit(w, ev.LoadFailed(c.request_id, flat(groups_from_pb(c.local_block_ids, c.local_groups)),
                                                reason))
                    continue
                asyncio.get_running_loop().create_task(node.load(
                    w, c.request_id, groups_from_pb(c.local_block_ids, c.local_groups), c.remote_engine_id,
                    c.remote_address, groups_from_pb(c.remote_block_ids, c.remote_groups), c.remote_request_id,
                    c.remote_tp_size, c.timeout_s,
                ))
            elif kind == "hold":
                node.hold(w, cmd.hold.request_id, groups_from_pb(cmd.hold.block_ids, cmd.hold.groups), cmd.hold.lease_s)
            elif kind == "release":
                node.release(w, cmd.release.request_id)
            elif kind == "abort_load":
                c = cmd.abort_load
                asyncio.get_running_loop().create_task(node.abort_load(
                    w, c.request_id, c.remote_engine_id, c.remote_address, c.remote_request_id, c.remote_tp_size))
            else:
                node._emit(w, ev.CommandRejected("", f"unexpected command {kind!r} on an open session"))
