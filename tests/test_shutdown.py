"""Life-cycle as systemd and Kubernetes see it: sd_notify READY/STOPPING, and
SIGTERM draining (health NOT_SERVING, no new work, loads in flight finished or
failed within the grace period, everything released, exit 0)."""

from __future__ import annotations

import os
import signal
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.daemon.sdnotify import Notifier
from kvd.v1 import kvd_pb2 as pb
from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import KvShape, Session, one_group, register_request
from kvd.testing.shm import ShmSegment
from kvd.testing.util import free_port

SHAPE = KvShape(num_layers=1, num_blocks=8, block_len=1024)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _health(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _blackhole() -> socket.socket:
    """A loopback TCP port that accepts connections and never answers: a
    handshake with it hangs until its deadline."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _load(request_id: str, hole: socket.socket) -> dict:
    return dict(load=pb.LoadBlocks(
        request_id=request_id, local_groups=one_group([1, 2]), remote_engine_id="prefill-e",
        remote_address=f"127.0.0.1:{hole.getsockname()[1]}", remote_groups=one_group([1, 2]),
        remote_request_id="remote-" + request_id, remote_tp_size=1))


def test_sd_notify_ready_after_startup_and_stopping_at_sigterm(tmp_path):
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(path)
        systemd.settimeout(30)
        d = start_daemon(str(tmp_path), "kvd", env={"NOTIFY_SOCKET": path})
        try:
            ready = dict(line.split("=", 1) for line in systemd.recv(4096).decode().splitlines())
            assert ready["READY"] == "1" and ready["MAINPID"] == str(d.proc.pid)
            assert "serving" in ready["STATUS"]
            assert _health(f"unix:{d.socket}") == SERVING  # READY means serving
            d.proc.send_signal(signal.SIGTERM)
            stopping = dict(line.split("=", 1) for line in systemd.recv(4096).decode().splitlines())
            assert stopping["STOPPING"] == "1" and "draining" in stopping["STATUS"]
            assert d.proc.wait(20) == 0
        finally:
            d.stop()


def test_sd_notify_watchdog_keep_alives_while_serving(tmp_path):
    """A unit with WatchdogSec= (deploy/systemd/kvd.service) gets WATCHDOG=1
    every third of WATCHDOG_USEC from the daemon's event loop once it is
    ready; none for a WATCHDOG_PID of another process (sd_watchdog_enabled(3))."""
    from kvd.config import watchdog_seconds

    assert watchdog_seconds({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert watchdog_seconds({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 30.0
    assert watchdog_seconds({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) == 0.0
    assert watchdog_seconds({"WATCHDOG_USEC": "x"}) == watchdog_seconds({}) == 0.0
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(path)
        systemd.settimeout(30)
        d = start_daemon(str(tmp_path), "kvd", env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "600000"})
        try:
            assert b"READY=1" in systemd.recv(4096)
            got = [systemd.recv(4096) for _ in range(3)]  # 0.2 s apart
            assert got == [b"WATCHDOG=1"] * 3, got
            d.proc.send_signal(signal.SIGTERM)
            assert d.proc.wait(20) == 0
        finally:
            d.stop()


def test_sd_notify_abstract_socket_and_no_socket():
    name = f"@kvd-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind("\0" + name[1:])
        systemd.settimeout(5)
        assert Notifier(name).ready("up")
        assert b"READY=1" in systemd.recv(4096)
    assert Notifier("").ready("up") is False  # not under systemd: a no-op
    assert Notifier("/nonexistent/notify.sock").stopping("x") is False  # logged, never raised


def test_sigterm_drains_then_exits_0_with_nothing_left(tmp_path):
    shm_before = _shm_names()
    mport = free_port()
    d = start_daemon(str(tmp_path), "kvd", "--grace-s", "20", "--handshake-timeout-s", "3",
                     "--metrics-port", str(mport), "--metrics-host", "127.0.0.1")
    seg = ShmSegment(SHAPE.size)
    hole = _blackhole()
    s = None
    try:
        seg.array[:] = 7
        d.stub().RegisterEngine(register_request("decode-e", SHAPE, seg), timeout=30)
        with open(f"/proc/{d.proc.pid}/maps") as f:
            assert seg.path in f.read()  # the daemon maps the engine's KV cache
        s = Session(d, "decode-e")
        s.send(**_load("in-flight", hole))  # hangs in its handshake for 3 s
        time.sleep(0.3)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)

        # Draining: probes see NOT_SERVING on both ports, for every service.
        deadline = time.monotonic() + 5
        while _health(f"unix:{d.socket}") != NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for service in ("", "kvd.v1.EngineService", "kvd.v1.PeerService"):
            assert _health(f"unix:{d.socket}", service) == NOT_SERVING
            assert _health(d.peer_address, service) == NOT_SERVING
        # No new work: registrations and sessions are refused, loads fail at once.
        seg2 = ShmSegment(SHAPE.size)
        try:
            with pytest.raises(grpc.RpcError) as e:
                d.stub().RegisterEngine(register_request("late-e", SHAPE, seg2), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        finally:
            seg2.close()
        with pytest.raises(grpc.RpcError) as e:
            Session(d, "decode-e")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        s.send(**_load("too-late", hole))
        ev = s.next(5)
        assert ev.WhichOneof("event") == "load_failed" and ev.load_failed.request_id == "too-late"
        assert "draining" in ev.load_failed.reason and list(ev.load_failed.failed_block_ids) == [1, 2]

        # The load in flight ends within the grace period (its handshake
        # deadline) and the engine hears it on its still-open session.
        ev = s.next(10)
        assert ev.WhichOneof("event") == "load_failed" and ev.load_failed.request_id == "in-flight"
        assert ev.load_failed.reason.startswith("handshake")

        assert d.proc.wait(15) == 0
        assert time.monotonic() - t0 < 12  # did not sit out the 20 s grace
    finally:
        if s is not None:
            s.close()
        hole.close()
        d.stop()
    log = d.log()
    assert "unregistered engine=decode-e rank=0 (daemon shutting down)" in log
    assert "kvd stopped" in log
    assert not os.path.exists(d.socket)                       # socket removed
    with pytest.raises(OSError):                              # metrics endpoint closed
        socket.create_connection(("127.0.0.1", mport), timeout=1).close()
    # Nothing of the daemon's (or UCX's) left in /dev/shm (kvdtest_* are test
    # segments, this test's and those of tests running beside it), and the
    # engine's own segment is still there, untouched.
    assert {n for n in _shm_names() - shm_before if not n.startswith("kvdtest_")} == set()
    assert os.path.exists(seg.path) and bytes(seg.mm[:4]) == b"\x07" * 4
    seg.close()


def test_loads_still_in_flight_after_the_grace_period_are_failed(tmp_path):
    d = start_daemon(str(tmp_path), "kvd", "--grace-s", "0.5", "--handshake-timeout-s", "30")
    seg = ShmSegment(SHAPE.size)
    hole = _blackhole()
    peer = f"127.0.0.1:{hole.getsockname()[1]}"
    s = None
    try:
        d.stub().RegisterEngine(register_request("decode-e", SHAPE, seg), timeout=30)
        s = Session(d, "decode-e")
        s.send(**_load("stuck", hole))
        time.sleep(0.3)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(15) == 0
        assert time.monotonic() - t0 < 8
        # The session ended: the engine's client fails every load that was on it.
        ev = s.next(5)
        assert isinstance(ev, grpc.RpcError)
    finally:
        if s is not None:
            s.close()
        hole.close()
        d.stop()
        seg.close()
    log = d.log()
    # Named with its peer, though it was still handshaking (OPERATIONS.md: every failure names its peer).
    assert f"request=stuck peer={peer}: load failed: shutdown" in log, log[-3000:]
    assert "draining: waiting up to" in log and "1 load(s) under way" in log
    assert log.count("request=stuck") == 1  # logged once
    assert not os.path.exists(d.socket)


def test_daemon_shutdown_unlinks_segments_of_dead_engines_only(tmp_path):
    """An engine that died (its owner_pid is gone) less than detach_grace_s
    before the daemon stops: the daemon unlinks its segments at shutdown; a
    live engine's segments are left alone."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    d = start_daemon(str(tmp_path), "kvd", "--detach-grace-s", "600")
    gone, alive = ShmSegment(SHAPE.size), ShmSegment(SHAPE.size)
    try:
        for name, seg, pid in (("dead-e", gone, dead.pid), ("live-e", alive, os.getpid())):
            req = register_request(name, SHAPE, seg)
            req.owner_pid = pid
            d.stub().RegisterEngine(req, timeout=10)
        assert d.stop(signal.SIGTERM) == 0
        assert not os.path.exists(gone.path), "the dead engine's segment was left in /dev/shm"
        assert os.path.exists(alive.path), "a live engine's segment was unlinked"
        assert "engine process %d is gone" % dead.pid in d.log()
    finally:
        gone.close()
        alive.close()
        if d.proc.poll() is None:
            d.stop(signal.SIGKILL)
