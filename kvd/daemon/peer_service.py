"""``kvd.v1.PeerService``: what remote daemons ask of this one (TCP)."""

from __future__ import annotations

import logging

from kvd import __version__
from kvd.core import events as ev
from kvd.core.node import HandshakeResult, Node
from kvd.daemon.convert import layout_to_pb, region_to_pb, status_of
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

log = logging.getLogger("kvd.peer")


class PeerService(pb_grpc.PeerServiceServicer):
    """Answers handshakes: our worker's NIXL agent metadata and layout."""

    def __init__(self, node: Node):
        self.node = node

    async def Handshake(self, request: pb.HandshakeRequest, context) -> pb.HandshakeResponse:
        try:
            hs = await self.node.handshake_info(request.engine_id, request.tp_rank, request.compat_hash,
                                                request.protocol_version)
        except ev.CoreError as e:
            log.warning("handshake from %s for engine=%s rank=%d refused: %s",
                        context.peer(), request.engine_id, request.tp_rank, e)
            await context.abort(status_of(e), str(e))
        return handshake_to_pb(hs)


def handshake_to_pb(hs: HandshakeResult) -> pb.HandshakeResponse:
    return pb.HandshakeResponse(
        agent_metadata=hs.agent_metadata, agent_name=hs.agent_name, layout=layout_to_pb(hs.layout),
        regions=[region_to_pb(r) for r in hs.regions], region_base_addrs=hs.region_bases,
        compat_hash=hs.compat_hash, daemon_version=hs.daemon_version, protocol_version=hs.protocol_version,
        tp_size=hs.tp_size,
    )
