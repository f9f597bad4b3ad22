"""Bad input to EngineService gets a status with a message; the daemon keeps serving."""

from __future__ import annotations

import os

import grpc
import pytest

from kvd.v1 import kvd_pb2 as pb
from kvd.testing.sessions import KvShape, Session, one_group, register_request
from kvd.testing.shm import ShmSegment

SHAPE = KvShape(num_layers=1, num_blocks=8, block_len=1024)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """One daemon for the whole module: every test also proves it still serves."""
    from kvd.testing.daemons import start_daemon

    d = start_daemon(str(tmp_path_factory.mktemp("bad")), "kvd")
    yield d
    assert d.stop() == 0


def _code(fn):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def _still_serving(daemon):
    assert daemon.stats().daemon_version
    assert daemon.proc.poll() is None


def test_region_larger_than_segment_is_invalid_argument(daemon):
    seg = ShmSegment(SHAPE.size // 2)
    try:
        req = register_request("e", SHAPE, seg)
        code, msg = _code(lambda: daemon.stub().RegisterEngine(req, timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "past its segment" in msg
        # Claiming a segment bigger than the shm object is refused too.
        req.segments[0].size = SHAPE.size
        code, msg = _code(lambda: daemon.stub().RegisterEngine(req, timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "the object has" in msg
        _still_serving(daemon)
        assert daemon.stats().engines == 0
    finally:
        seg.close()


@pytest.mark.parametrize("name", ["../etc/passwd", "/a/b", "", "x" * 300])
def test_bad_segment_name_is_invalid_argument(daemon, name):
    req = pb.RegisterEngineRequest(
        worker=pb.EngineWorker(engine_id="e", tp_rank=0, tp_size=1), layout=SHAPE.layout(),
        segments=[pb.Segment(kind=pb.MEMORY_KIND_SHM, name=name, size=SHAPE.size)], regions=SHAPE.regions(),
        data_path=pb.DATA_PATH_DIRECT)
    code, _ = _code(lambda: daemon.stub().RegisterEngine(req, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    _still_serving(daemon)


def test_bad_layouts_are_invalid_argument(daemon):
    seg = ShmSegment(SHAPE.size)
    try:
        for mutate, words in [
            (lambda r: setattr(r.layout, "num_blocks", 0), "num_blocks"),
            (lambda r: setattr(r.layout, "kv_layout", 0), "kv_layout"),
            (lambda r: setattr(r.worker, "tp_rank", 3), "tp_rank"),
            (lambda r: setattr(r.regions[0], "segment_index", 7), "segment_index"),
            (lambda r: setattr(r.regions[0], "block_stride", 1), "block_stride"),
            (lambda r: setattr(r.segments[0], "kind", pb.MEMORY_KIND_UNSPECIFIED), "MEMORY_KIND_SHM"),
            (lambda r: setattr(r.segments[0], "kind", pb.MEMORY_KIND_CUDA_IPC), "CUDA IPC"),  # no GPU / no handle
        ]:
            req = register_request("e", SHAPE, seg)
            mutate(req)
            code, msg = _code(lambda: daemon.stub().RegisterEngine(req, timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (words, code, msg)
            assert words in msg
        _still_serving(daemon)
    finally:
        seg.close()


def test_registering_twice_is_already_exists(daemon):
    seg = ShmSegment(SHAPE.size)
    try:
        daemon.stub().RegisterEngine(register_request("e", SHAPE, seg), timeout=10)
        code, _ = _code(lambda: daemon.stub().RegisterEngine(register_request("e", SHAPE, seg), timeout=10))
        assert code == grpc.StatusCode.ALREADY_EXISTS
        daemon.stub().UnregisterEngine(pb.UnregisterEngineRequest(worker=pb.EngineWorker(engine_id="e")), timeout=10)
        assert daemon.stats().engines == 0
    finally:
        seg.close()


def test_unknown_engine_is_not_found(daemon):
    code, msg = _code(lambda: daemon.stub().UnregisterEngine(
        pb.UnregisterEngineRequest(worker=pb.EngineWorker(engine_id="ghost")), timeout=10))
    assert code == grpc.StatusCode.NOT_FOUND and "ghost" in msg
    with pytest.raises(grpc.RpcError) as e:
        Session(daemon, "ghost")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "ghost" in e.value.details()
    _still_serving(daemon)


def test_out_of_range_block_ids_fail_the_request_not_the_daemon(daemon):
    seg = ShmSegment(SHAPE.size)
    try:
        daemon.stub().RegisterEngine(register_request("e2", SHAPE, seg), timeout=10)
        s = Session(daemon, "e2")
        s.send(hold=pb.HoldBlocks(request_id="h1", groups=one_group([1, 8])))
        ev = s.next()
        assert ev.WhichOneof("event") == "rejected" and "block id 8 out of range" in ev.rejected.reason
        s.send(load=pb.LoadBlocks(request_id="l1", local_groups=one_group([-1 & 0xFFFFFFFF]), remote_engine_id="x",
                                  remote_address="127.0.0.1:1", remote_groups=one_group([0]), remote_tp_size=1))
        ev = s.next()
        assert ev.WhichOneof("event") == "load_failed" and "out of range" in ev.load_failed.reason
        s.send(load=pb.LoadBlocks(request_id="l2", local_groups=one_group([1, 2]), remote_engine_id="x",
                                  remote_address="127.0.0.1:1", remote_groups=one_group([0]), remote_tp_size=1))
        ev = s.next()
        assert ev.WhichOneof("event") == "load_failed" and list(ev.load_failed.failed_block_ids) == [1, 2]
        # An unreachable peer fails only that request, within the handshake deadline.
        s.send(load=pb.LoadBlocks(request_id="l3", local_groups=one_group([3]), remote_engine_id="x",
                                  remote_address="127.0.0.1:1", remote_groups=one_group([0]), remote_tp_size=1,
                                  timeout_s=2))
        ev = s.next(15)
        assert ev.WhichOneof("event") == "load_failed" and "handshake" in ev.load_failed.reason
        s.send(release=pb.ReleaseBlocks(request_id="nope"))
        assert s.next().WhichOneof("event") == "rejected"
        s.close()
        _still_serving(daemon)
        assert daemon.stats().inflight_transfers == 0
    finally:
        seg.close()


@pytest.mark.parametrize("scheme", ["unix-abstract", "unix"])
def test_a_peer_address_is_dialed_as_host_and_port_never_as_a_grpc_scheme(daemon, scheme, tmp_path):
    """A load's (or an abort's) ``remote_address`` is the peer's ``host:port``,
    named by an engine or an API client's ``kv_transfer_params``: gRPC read
    ``unix-abstract:7777`` as a target scheme, and the daemon connected to
    the local abstract socket ``7777`` (attacker review); ``unix:/path``
    the same for a socket file. Dialed by DNS name, it reaches nothing and
    the load fails."""
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if scheme == "unix-abstract":
        name = f"kvdtest{os.getpid()}"
        listener.bind("\0" + name)
    else:
        name = str(tmp_path / "peer.sock")
        listener.bind(name)
    listener.listen(8)
    listener.settimeout(0.5)
    seg = ShmSegment(SHAPE.size)
    try:
        daemon.stub().RegisterEngine(register_request(f"e-{scheme}", SHAPE, seg), timeout=10)
        s = Session(daemon, f"e-{scheme}")
        s.send(load=pb.LoadBlocks(request_id="l1", local_groups=one_group([3]), remote_engine_id="x",
                                  remote_address=f"{scheme}:{name}", remote_groups=one_group([0]), remote_tp_size=1,
                                  timeout_s=2))
        ev = s.next(15)
        assert ev.WhichOneof("event") == "load_failed", ev
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing dialed the socket
        s.close()
        _still_serving(daemon)
    finally:
        listener.close()
        seg.close()
