"""Refused gRPC calls (``kvd.daemon.call_refusal``): the caller gets the
status and details the daemon chose, and nothing of a refused call is left
in reference cycles, so its request is freed when the call ends, not at
the garbage collector's next collection (with ``context.abort()``, grpc.aio
1.85 keeps each refused call's frames, and so its request, in a cycle).

Real grpc.aio servers and channels on loopback, with the daemon's own
interceptors and PeerService; the node behind PeerService is a stub that
has no workers (every Handshake is refused NOT_FOUND)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.core import events as ev
from kvd.daemon.call_refusal import MAX_DETAILS_BYTES, Refused, RefusalInterceptor, fit_details
from kvd.daemon.health import MAX_SERVICE_NAME_CHARS, Health
from kvd.daemon.peer_service import PeerService
from kvd.daemon.wire_shape import ShapeInterceptor, peer_shape
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

CALLS = 20
BIG = 256 << 10  # bytes of each refused request: what must not wait for a collection


class _NoWorkers:
    """The part of ``kvd.core.node.Node`` a refused Handshake reaches."""

    async def handshake_info(self, engine_id, tp_rank, compat_hash, protocol_version):
        raise ev.NotFound(f"handshake: no worker engine={engine_id} rank={tp_rank} here")  # quoted whole, as Node


@pytest.fixture
def collector_off():
    """No automatic collection during the test: what the calls leave in
    cycles is still there when the test collects."""
    gc.collect()
    gc.disable()
    yield
    gc.set_debug(0)
    gc.garbage.clear()
    gc.enable()


def _cyclic_garbage() -> list:
    """What a collection finds unreachable now (kept for inspection)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def _refused_calls(interceptors, servicer, call):
    """``CALLS`` calls ``await call(channel)`` to a server with ``servicer``
    (a PeerService, or a ``grpc.health.v1`` servicer) behind
    ``interceptors``; returns each call's ``(code, details)`` and the cyclic
    garbage the calls left."""
    server = grpc.aio.server(interceptors=interceptors, options=[("grpc.max_receive_message_length", 4 << 20)])
    if isinstance(servicer, health_pb2_grpc.HealthServicer):
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    else:
        pb_grpc.add_PeerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    answers = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for i in range(CALLS + 1):
                if i == 1:  # the first call set up the channel and the server's method table
                    answers.clear()
                    _cyclic_garbage()
                try:
                    await call(channel)
                    answers.append((grpc.StatusCode.OK, ""))
                except grpc.aio.AioRpcError as e:
                    answers.append((e.code(), e.details()))
            garbage = _cyclic_garbage()
    finally:
        await server.stop(None)
    return answers, garbage


def _daemon_interceptors():
    """The peer server's chain without a credential check (``kvd.daemon.server``)."""
    return [RefusalInterceptor(), ShapeInterceptor(functools.partial(peer_shape, max_blocks_per_request=4096))]


def _handshake(channel):
    return pb_grpc.PeerServiceStub(channel).Handshake(pb.HandshakeRequest(engine_id="e" * BIG, tp_rank=0))


def _requests_in(garbage) -> int:
    return sum(isinstance(o, pb.HandshakeRequest) for o in garbage)


def test_a_handler_refusal_reaches_the_caller_and_leaves_no_request_in_a_cycle(collector_off):
    answers, garbage = asyncio.run(_refused_calls(_daemon_interceptors(), PeerService(_NoWorkers()), _handshake))
    # The details quote a 256 KiB id: cut, or the client would drop the
    # call's trailers (over 16 KiB) and see RESOURCE_EXHAUSTED instead.
    assert {code for code, _ in answers} == {grpc.StatusCode.NOT_FOUND}
    cut = f"...({len('handshake: no worker engine= rank=0 here') + BIG} characters)"
    assert all(d.startswith("handshake: no worker engine=eeeeeeee") and d.endswith(cut) for _, d in answers)
    assert all(len(d) == MAX_DETAILS_BYTES for _, d in answers)
    assert _requests_in(garbage) == 0


def _encoded(details: str) -> int:
    """Bytes of ``details`` percent-encoded as gRPC sends them (grpc-message)."""
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in details.encode())


@pytest.mark.parametrize(("text", "kept"), [
    ("a" * 10, "whole"), ("ok: 50% done", "whole"), ("bad \udc80 surrogate", "escaped"),
    ("\U0001F600" * 1000, "cut"), ("€" * 5000, "cut"), ("%" * 3000, "cut"), ("\n\x00" * 2000, "cut"),
    ("x" * (1 << 20), "cut")])
def test_details_fit_the_trailer_whatever_they_quote(text, kept):
    details = fit_details(text)
    assert _encoded(details) <= MAX_DETAILS_BYTES
    if kept == "whole":
        assert details == text
    elif kept == "escaped":
        assert details == "bad \\udc80 surrogate"
    else:
        assert details.startswith(text[:10]) and details.endswith(f"...({len(text)} characters)")


@pytest.mark.parametrize("char", ["\U0001F600", "€", "%"], ids=["4-byte", "3-byte", "percent"])
def test_a_refusal_quoting_an_id_of_wide_characters_still_reaches_the_caller(char):
    def handshake(channel):
        return pb_grpc.PeerServiceStub(channel).Handshake(pb.HandshakeRequest(engine_id=char * 4000, tp_rank=0))

    answers, _ = asyncio.run(_refused_calls(_daemon_interceptors(), PeerService(_NoWorkers()), handshake))
    assert {code for code, _ in answers} == {grpc.StatusCode.NOT_FOUND}, answers[0]
    assert all(d.startswith(f"handshake: no worker engine={char * 3}") for _, d in answers)


def test_an_interceptor_refusal_before_parsing_leaves_no_request_bytes_in_a_cycle(collector_off):
    junk = b"\xff" * BIG  # not a protobuf encoding: the shape walk refuses it unparsed

    def raw_handshake(channel):
        return channel.unary_unary("/kvd.v1.PeerService/Handshake")(junk)

    answers, garbage = asyncio.run(_refused_calls(_daemon_interceptors(), PeerService(_NoWorkers()), raw_handshake))
    assert {code for code, _ in answers} == {grpc.StatusCode.INVALID_ARGUMENT}
    assert all(details.startswith("kvd: ") for _, details in answers)
    # bytes are not tracked by the collector: they hang off what it found (a frame's locals, a tuple)
    held = [r for o in garbage for r in gc.get_referents(o) if isinstance(r, bytes) and len(r) >= BIG]
    assert held == []


@contextlib.asynccontextmanager
async def _health_stub(health: Health):
    """A health stub of ``health`` served by a real grpc.aio server behind
    the daemon's ``RefusalInterceptor``."""
    server = grpc.aio.server(interceptors=[RefusalInterceptor()])
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield health_pb2_grpc.HealthStub(channel)
    finally:
        await server.stop(None)


def test_health_check_of_an_unknown_service_leaves_no_request_in_a_cycle(collector_off):
    """grpc's own health servicer aborts: the daemon's raises (probes reach
    health with no credential, so anyone who reaches a port may send these)."""
    health = Health()
    asyncio.run(health.set("kvd.v1.PeerService", health_pb2.HealthCheckResponse.SERVING))

    def check(channel):
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="s" * BIG))

    answers, garbage = asyncio.run(_refused_calls([RefusalInterceptor()], health, check))
    assert {code for code, _ in answers} == {grpc.StatusCode.NOT_FOUND}
    assert all(d.startswith("health: no service 'ssss") for _, d in answers)
    assert sum(isinstance(o, health_pb2.HealthCheckRequest) for o in garbage) == 0

    async def known_and_watched():
        async with _health_stub(health) as stub:
            known = [(await stub.Check(health_pb2.HealthCheckRequest(service=s))).status
                     for s in ("", "kvd.v1.PeerService")]
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="not.Here"))
            first = await watch.read()
            watch.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Watch(health_pb2.HealthCheckRequest(service="w" * (MAX_SERVICE_NAME_CHARS + 1))).read()
        return known, first.status, e.value.code()

    serving = health_pb2.HealthCheckResponse.SERVING
    assert asyncio.run(known_and_watched()) == (
        [serving, serving], health_pb2.HealthCheckResponse.SERVICE_UNKNOWN, grpc.StatusCode.INVALID_ARGUMENT)


def test_a_service_set_after_graceful_shutdown_stays_unknown_and_is_refused_by_raising():
    """grpc ignores a ``set`` after ``enter_graceful_shutdown``; so does the
    daemon's servicer: the name is not remembered, and a ``Check`` of it is
    refused by the daemon's raise (its message), never by grpc's abort."""
    health = Health()

    async def run():
        await health.set("kvd.v1.PeerService", health_pb2.HealthCheckResponse.SERVING)
        await health.enter_graceful_shutdown()
        await health.set("late.Service", health_pb2.HealthCheckResponse.SERVING)
        async with _health_stub(health) as stub:
            known = (await stub.Check(health_pb2.HealthCheckRequest(service="kvd.v1.PeerService"))).status
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Check(health_pb2.HealthCheckRequest(service="late.Service"))
        return known, e.value.code(), e.value.details()

    known, code, details = asyncio.run(run())
    assert known == health_pb2.HealthCheckResponse.NOT_SERVING
    assert code == grpc.StatusCode.NOT_FOUND and details.startswith("health: no service 'late.Service'"), details


def test_context_abort_the_control_leaves_each_refused_request_in_a_cycle(collector_off):
    """Why the interceptor exists, on the pinned grpcio: the same refusal by
    ``context.abort()`` leaves the requests for a collection (if a grpcio
    upgrade makes this fail, ``context.abort()`` may be fine again)."""

    class Aborting(pb_grpc.PeerServiceServicer):
        async def Handshake(self, request, context):
            await context.abort(grpc.StatusCode.NOT_FOUND, "no worker")

    answers, garbage = asyncio.run(_refused_calls([], Aborting(), _handshake))
    assert {code for code, _ in answers} == {grpc.StatusCode.NOT_FOUND}
    assert _requests_in(garbage) >= CALLS // 2


def test_a_stream_refused_after_some_items_delivers_them_then_the_status():
    async def stream(requests, context):
        async for r in requests:
            if r == b"stop":
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "kvd: told to stop")
            yield b"echo " + r

    async def run():
        handler = grpc.stream_stream_rpc_method_handler(stream)
        server = grpc.aio.server(interceptors=[RefusalInterceptor()])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {"S": handler})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        got = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.stream_stream("/t.T/S")(iter([b"a", b"b", b"stop", b"never"]))
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for item in call:
                        got.append(item)
        finally:
            await server.stop(None)
        return got, e.value

    got, e = asyncio.run(run())
    assert got == [b"echo a", b"echo b"]
    assert (e.code(), e.details()) == (grpc.StatusCode.FAILED_PRECONDITION, "kvd: told to stop")


def test_a_unary_refusal_from_a_sync_behavior_and_a_pass_through_answer():
    def behavior(request, context):
        if request == b"no":
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, "kvd: not you")
        return b"yes " + request

    async def run():
        server = grpc.aio.server(interceptors=[RefusalInterceptor()])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "t.T", {"U": grpc.unary_unary_rpc_method_handler(behavior)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                ok = await channel.unary_unary("/t.T/U")(b"please")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await channel.unary_unary("/t.T/U")(b"no")
        finally:
            await server.stop(None)
        return ok, e.value

    ok, e = asyncio.run(run())
    assert ok == b"yes please"
    assert (e.code(), e.details()) == (grpc.StatusCode.PERMISSION_DENIED, "kvd: not you")


def test_open_health_watches_are_capped_per_server(monkeypatch):
    """Health needs no credential and a Watch lasts as long as its caller
    likes (~26 KB each: 20,000 from one process took a daemon +522 MB,
    attacker review): past ``MAX_WATCHES`` open, one more is refused; one
    that ends makes room."""
    from kvd.daemon import health as health_module

    monkeypatch.setattr(health_module, "MAX_WATCHES", 2)

    async def run():
        server = grpc.aio.server(interceptors=[RefusalInterceptor()])
        health_pb2_grpc.add_HealthServicer_to_server(Health(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                watches = [stub.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(2)]
                first = [(await w.read()).status for w in watches]
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Watch(health_pb2.HealthCheckRequest(service="")).read()
                watches[0].cancel()
                for _ in range(100):  # the server sees the cancel
                    try:
                        again = await stub.Watch(health_pb2.HealthCheckRequest(service="")).read()
                        break
                    except grpc.aio.AioRpcError:
                        await asyncio.sleep(0.02)
                for w in watches:
                    w.cancel()
        finally:
            await server.stop(None)
        return first, e.value.code(), again.status

    serving = health_pb2.HealthCheckResponse.SERVING
    assert asyncio.run(run()) == ([serving, serving], grpc.StatusCode.RESOURCE_EXHAUSTED, serving)
