"""The daemon's gRPC health service (grpc.health.v1, both servers): grpc's
own asyncio servicer, with its refusals raised as
:class:`kvd.daemon.call_refusal.Refused`.

Health answers every caller that reaches a port, before any credential
(probes carry none: docs/SECURITY.md), and is not walked for shape. grpc's
``Check`` refuses a service it does not know with ``context.abort()``,
which left each refused request in a reference cycle until a garbage
collection (``kvd.daemon.call_refusal``): measured by an attacker review,
150 ``Check`` calls naming a 32 MiB service took the daemon's peak RSS to
2.9 GB. And an open ``Watch`` keeps the name it watches: one past any
service's is refused."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from kvd.daemon.call_refusal import Refused
from kvd.logtext import clip

# Longer than any service name of this daemon ("kvd.v1.EngineService").
MAX_SERVICE_NAME_CHARS = 256


class Health(HealthServicer):
    """grpc's ``HealthServicer`` (grpcio-health-checking's asyncio one):
    ``Check`` of a service never set answers NOT_FOUND, as grpc's does, by
    raising; ``Watch`` of a name over :data:`MAX_SERVICE_NAME_CHARS`
    characters is refused INVALID_ARGUMENT."""

    def __init__(self) -> None:
        super().__init__()
        self._named = {""}  # grpc's servicer starts with "" SERVING

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        """Sets ``service``'s status (grpc's ``set``), remembering the name."""
        self._named.add(service)
        await super().set(service, status)

    async def Check(self, request: health_pb2.HealthCheckRequest, context) -> health_pb2.HealthCheckResponse:
        """The status of ``request.service``; NOT_FOUND for one never set."""
        if request.service not in self._named:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"health: no service {clip(request.service, 64)!r} here")
        return await super().Check(request, context)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:
        """grpc's ``Watch`` (SERVICE_UNKNOWN for a name never set, then each
        change); INVALID_ARGUMENT for a name past the bound."""
        if len(request.service) > MAX_SERVICE_NAME_CHARS:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"health: a service name of {len(request.service)} characters (at most "
                          f"{MAX_SERVICE_NAME_CHARS})")
        await super().Watch(request, context)
