"""gRPC server reflection (grpc.reflection.v1alpha, both servers), bounded.

Reflection, like health, answers every caller that reaches a port, before
any credential (``grpcurl``, a mesh's tooling). grpc's own servicer keeps a
stream open as long as its caller likes and echoes every request back in
its answer (``original_request``), and the server's message limit is kvd's
``max_message_bytes``. Measured by an attacker review on the peer port
(any local user, no token): 20,000 open streams took the daemon from 86 to
619 MB; four streams each sending three 60 MB requests and reading no
answer took it to 1.29 GB, held while the streams stayed open. A
reflection request names a file or a symbol: at most
:data:`MAX_REQUEST_BYTES` are answered, and at most :data:`MAX_STREAMS`
streams are open on one server."""

from __future__ import annotations

from collections.abc import AsyncIterable, Sequence

import grpc
from grpc_reflection.v1alpha import reflection_pb2 as pb
from grpc_reflection.v1alpha import reflection_pb2_grpc as pb_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer

from kvd.daemon.call_refusal import Refused

#: Open reflection streams on one server; past it a new one is refused
#: RESOURCE_EXHAUSTED. Tools open one per session.
MAX_STREAMS = 64
#: Largest reflection request answered (bytes): a file or symbol name and
#: the host, far below this for kvd's services.
MAX_REQUEST_BYTES = 4096


class BoundedReflection(ReflectionServicer):
    """grpc's asyncio reflection servicer for ``service_names``, with a
    stream past :data:`MAX_STREAMS` open refused RESOURCE_EXHAUSTED and a
    request over :data:`MAX_REQUEST_BYTES` ending its stream
    INVALID_ARGUMENT (its answer would echo it)."""

    def __init__(self, service_names: Sequence[str]):
        super().__init__(service_names)
        self._open = 0

    async def ServerReflectionInfo(self, request_iterator: AsyncIterable[pb.ServerReflectionRequest],
                                   context) -> AsyncIterable[pb.ServerReflectionResponse]:
        """grpc's answers, one per request, within the bounds above."""
        if self._open >= MAX_STREAMS:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"reflection: {MAX_STREAMS} streams are open on this port already, the most it keeps")
        self._open += 1
        try:
            async for answer in super().ServerReflectionInfo(_bounded(request_iterator), context):
                yield answer
        finally:
            self._open -= 1


async def _bounded(requests: AsyncIterable[pb.ServerReflectionRequest]) -> AsyncIterable[pb.ServerReflectionRequest]:
    async for request in requests:
        size = request.ByteSize()
        if size > MAX_REQUEST_BYTES:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"reflection: a request of {size} bytes (at most {MAX_REQUEST_BYTES})")
        yield request


def enable(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Adds :class:`BoundedReflection` of ``service_names`` to ``server``
    (in place of grpc's ``enable_server_reflection``)."""
    pb_grpc.add_ServerReflectionServicer_to_server(BoundedReflection(service_names), server)
