"""``require_memfd``: a daemon that takes KV caches only as sealed memfds
(docs/SECURITY.md): a named shm segment, which its engine could shrink
under the daemon's mapping, is refused with a status naming the setting."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from kvd.testing.daemons import start_daemon
from kvd.testing.processes import child_env
from kvd.testing.sessions import Engine, KvShape, event_kind, register_request
from kvd.testing.shm import ShmSegment

SHAPE = KvShape(num_layers=2, num_blocks=8, block_len=1024)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(str(tmp_path_factory.mktemp("memfd")), "kvd", "--require-memfd", "true")
    yield d
    assert d.stop() == 0


def test_a_named_segment_is_refused_naming_the_setting(daemon):
    seg = ShmSegment(SHAPE.size)
    try:
        with pytest.raises(grpc.RpcError) as e:
            daemon.stub().RegisterEngine(register_request("named", SHAPE, seg), timeout=30)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value
        assert "require_memfd" in e.value.details() and seg.name in e.value.details()
    finally:
        seg.close()
    assert daemon.stats().engines == 0  # nothing registered, still serving


def test_sealed_memfds_are_taken_and_copied(daemon):
    p = Engine(daemon, "p-memfd", SHAPE, seed=5, memfd=True)
    d = Engine(daemon, "d-memfd", SHAPE, memfd=True)
    try:
        p.hold("r", [1, 2])
        d.load("x", [3, 4], p, [1, 2], "r")
        assert event_kind(d.wait("x")) == "recv_done"
        assert d.same_blocks([3, 4], p, [1, 2])
    finally:
        p.close()
        d.close()


def test_the_setting_is_in_serve_help():
    r = subprocess.run([sys.executable, "-m", "kvd.cli", "serve", "--help"], capture_output=True, text=True,
                       timeout=60, env=child_env())
    assert r.returncode == 0 and "--require-memfd" in r.stdout and "sealed memfd" in r.stdout
