"""The daemon's client of remote daemons' PeerService (one channel per address).

Implements ``kvd.core.node.PeerLink``: every gRPC error becomes the core's
typed error, with the peer's address and message.
"""

from __future__ import annotations

import grpc

from kvd import __version__
from kvd.config import MAX_MESSAGE_BYTES
from kvd.core import events as ev
from kvd.core.node import PROTOCOL_VERSION, HandshakeResult, PushOrder, PushResult
from kvd.daemon.convert import groups_to_pb, handshake_from_pb, handshake_to_pb
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def _error(address: str, e: grpc.aio.AioRpcError) -> ev.CoreError:
    msg = f"{address}: {e.code().name}: {e.details()}"
    return {
        grpc.StatusCode.NOT_FOUND: ev.NotFound,
        grpc.StatusCode.FAILED_PRECONDITION: ev.Incompatible,
        grpc.StatusCode.INVALID_ARGUMENT: ev.InvalidArgument,
    }.get(e.code(), ev.PeerUnavailable)(msg)


class PeerClient:
    """Handshake, push and notify calls to remote daemons."""

    def __init__(self):
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> pb_grpc.PeerServiceStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = ch
        return pb_grpc.PeerServiceStub(ch)

    async def handshake(self, address: str, engine_id: str, tp_rank: int, compat_hash: str,
                        timeout_s: float) -> HandshakeResult:
        """Handshake with ``address`` for its worker ``(engine_id, tp_rank)``."""
        req = pb.HandshakeRequest(engine_id=engine_id, tp_rank=tp_rank, daemon_version=__version__,
                                  compat_hash=compat_hash, protocol_version=PROTOCOL_VERSION)
        try:
            r = await self._stub(address).Handshake(req, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _error(address, e) from None
        return handshake_from_pb(r)

    async def push(self, address: str, order: PushOrder, timeout_s: float) -> PushResult:
        """Asks ``address`` to WRITE ``order``'s blocks; returns when done."""
        req = pb.PushRequest(
            engine_id=order.engine_id, tp_rank=order.tp_rank, request_id=order.request_id,
            source_groups=groups_to_pb(order.source_block_ids), reader=handshake_to_pb(order.reader),
            reader_tp_rank=order.reader_tp_rank, reader_groups=groups_to_pb(order.reader_block_ids),
            expected_notifications=order.expected_notifications, timeout_s=order.timeout_s,
        )
        try:
            r = await self._stub(address).Push(req, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _error(address, e) from None
        return PushResult(r.bytes, r.num_descriptors, r.duration_s)

    async def notify(self, address: str, engine_id: str, tp_rank: int, request_id: str, expected: int,
                     timeout_s: float) -> None:
        """Tells ``address`` that one reader is done with ``request_id`` on that rank."""
        req = pb.NotifyRequest(engine_id=engine_id, tp_rank=tp_rank, request_id=request_id,
                               expected_notifications=expected)
        try:
            await self._stub(address).Notify(req, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _error(address, e) from None

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
