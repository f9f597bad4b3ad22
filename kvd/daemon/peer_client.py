"""The daemon's client of remote daemons' PeerService (one channel per address)."""

from __future__ import annotations

import grpc

from kvd import __version__
from kvd.config import MAX_MESSAGE_BYTES
from kvd.core import events as ev
from kvd.core.node import PROTOCOL_VERSION, HandshakeResult
from kvd.daemon.convert import layout_from_pb, region_from_pb
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class PeerClient:
    """Performs handshakes with remote daemons; an async ``HandshakeFn``."""

    def __init__(self):
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> pb_grpc.PeerServiceStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = ch
        return pb_grpc.PeerServiceStub(ch)

    async def __call__(self, address: str, engine_id: str, tp_rank: int, compat_hash: str,
                       timeout_s: float) -> HandshakeResult:
        """Handshake with ``address`` for its worker ``(engine_id, tp_rank)``.

        Raises:
            ev.NotFound, ev.Incompatible: the peer refused, with its message.
            ev.PeerUnavailable: unreachable or past ``timeout_s`` seconds.
        """
        req = pb.HandshakeRequest(engine_id=engine_id, tp_rank=tp_rank, daemon_version=__version__,
                                  compat_hash=compat_hash, protocol_version=PROTOCOL_VERSION)
        try:
            r = await self._stub(address).Handshake(req, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            msg = f"{address}: {e.code().name}: {e.details()}"
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise ev.NotFound(msg) from None
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise ev.Incompatible(msg) from None
            raise ev.PeerUnavailable(msg) from None
        return HandshakeResult(
            agent_metadata=r.agent_metadata, agent_name=r.agent_name, layout=layout_from_pb(r.layout),
            regions=[region_from_pb(x) for x in r.regions], region_bases=list(r.region_base_addrs),
            compat_hash=r.compat_hash, daemon_version=r.daemon_version, protocol_version=r.protocol_version,
            tp_size=r.tp_size or 1,
        )

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
