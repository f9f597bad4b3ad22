"""gRPC reflection on the peer port, bounded (``kvd.daemon.reflection``).

Reflection answers every caller, before any credential. Found by an
attacker review: grpc's own servicer kept any number of streams open
(20,000 from one local user: +533 MB) and echoed each request in its
answer, up to the server's message limit (four streams of three 60 MB
requests, answers unread: 1.29 GB). Promised now: at most
``MAX_STREAMS`` open streams a server, requests of at most
``MAX_REQUEST_BYTES``; the rest refused with a status, reflection still
answering within them.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2 as pb
from grpc_reflection.v1alpha import reflection_pb2_grpc as pb_grpc

from kvd.daemon.reflection import MAX_REQUEST_BYTES, MAX_STREAMS
from kvd.testing.daemons import start_daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(str(tmp_path_factory.mktemp("reflection")), "R")
    yield d
    assert d.stop() == 0


class OpenStream:
    """A reflection stream on ``channel`` that asked for the service list
    and stays open until :meth:`close`."""

    def __init__(self, channel: grpc.Channel):
        self._done = threading.Event()

        def requests():
            yield pb.ServerReflectionRequest(list_services="")
            self._done.wait(60)

        self.answers = pb_grpc.ServerReflectionStub(channel).ServerReflectionInfo(requests(), timeout=90)

    def first(self) -> pb.ServerReflectionResponse:
        return next(self.answers)

    def close(self) -> None:
        self._done.set()
        for _ in self.answers:
            pass


def _services(answer: pb.ServerReflectionResponse) -> set[str]:
    return {s.name for s in answer.list_services_response.service}


def test_a_reflection_request_over_the_bound_ends_its_stream_and_reflection_answers_on(daemon):
    with grpc.insecure_channel(daemon.peer_address, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        stub = pb_grpc.ServerReflectionStub(ch)
        big = pb.ServerReflectionRequest(host="h" * (4 << 20), file_by_filename="kvd.proto")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ServerReflectionInfo(iter([big]), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert str(MAX_REQUEST_BYTES) in err.value.details()
        answers = list(stub.ServerReflectionInfo(iter([pb.ServerReflectionRequest(list_services="")]), timeout=30))
        assert "kvd.v1.PeerService" in _services(answers[0])


def test_reflection_streams_past_the_bound_are_refused_and_one_closed_makes_room(daemon):
    with grpc.insecure_channel(daemon.peer_address) as ch:
        streams = []
        try:
            for _ in range(MAX_STREAMS):
                s = OpenStream(ch)
                streams.append(s)
                assert "kvd.v1.PeerService" in _services(s.first())
            extra = OpenStream(ch)
            with pytest.raises(grpc.RpcError) as err:
                extra.first()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
            streams.pop().close()
            again = OpenStream(ch)
            streams.append(again)
            assert "kvd.v1.PeerService" in _services(again.first())
        finally:
            for s in streams:
                s.close()
