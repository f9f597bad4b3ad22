"""The daemon's gRPC health service (grpc.health.v1, both servers): grpc's
own asyncio servicer, with its refusals raised as
:class:`kvd.daemon.call_refusal.Refused`.

Health answers every caller that reaches a port, before any credential
(probes carry none: docs/SECURITY.md), and is not walked for shape. grpc's
``Check`` refuses a service it does not know with ``context.abort()``,
which left each refused request in a reference cycle until a garbage
collection (``kvd.daemon.call_refusal``): measured by an attacker review,
150 ``Check`` calls naming a 32 MiB service took the daemon's peak RSS to
2.9 GB. And an open ``Watch`` lasts as long as its caller keeps it, with
the name it watches: a name longer than any service's
(:data:`MAX_SERVICE_NAME_CHARS`) is refused, and so is a watch past
:data:`MAX_WATCHES` open on one server."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from kvd.daemon.call_refusal import Refused
from kvd.logtext import clip

# Longer than any service name of this daemon ("kvd.v1.EngineService").
MAX_SERVICE_NAME_CHARS = 256
# Open Watch streams on one server: each costs the daemon ~26 KB and lasts
# as long as its caller likes (an attacker review opened 20,000 on the
# peer port from one process: +522 MB). Probes use Check; a few watchers
# (a service mesh's) are what an honest node has.
MAX_WATCHES = 1024


class Health(HealthServicer):
    """grpc's ``HealthServicer`` (grpcio-health-checking's asyncio one):
    ``Check`` of a service never set answers NOT_FOUND, as grpc's does, by
    raising; ``Watch`` of a name over :data:`MAX_SERVICE_NAME_CHARS`
    characters is refused INVALID_ARGUMENT, and one past
    :data:`MAX_WATCHES` open RESOURCE_EXHAUSTED."""

    def __init__(self) -> None:
        super().__init__()
        self._named = {""}  # grpc's servicer starts with "" SERVING
        self._watching = 0
        self._closing = False

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        """Sets ``service``'s status (grpc's ``set``), remembering the name;
        ignored after :meth:`enter_graceful_shutdown`, as grpc ignores it
        (a name remembered then would reach grpc's aborting ``Check``)."""
        if self._closing:
            return
        self._named.add(service)
        await super().set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good (grpc's); later sets are ignored."""
        self._closing = True
        await super().enter_graceful_shutdown()

    async def Check(self, request: health_pb2.HealthCheckRequest, context) -> health_pb2.HealthCheckResponse:
        """The status of ``request.service``; NOT_FOUND for one never set."""
        if request.service not in self._named:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"health: no service {clip(request.service, 64)!r} here")
        return await super().Check(request, context)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:
        """grpc's ``Watch`` (SERVICE_UNKNOWN for a name never set, then each
        change); INVALID_ARGUMENT for a name past the bound,
        RESOURCE_EXHAUSTED while :data:`MAX_WATCHES` are open."""
        if len(request.service) > MAX_SERVICE_NAME_CHARS:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"health: a service name of {len(request.service)} characters (at most "
                          f"{MAX_SERVICE_NAME_CHARS})")
        if self._watching >= MAX_WATCHES:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"health: {MAX_WATCHES} watches are open on this port already, the most it keeps; use Check")
        self._watching += 1
        try:
            await super().Watch(request, context)
        finally:
            self._watching -= 1
