"""``serve_pushes = false``: a prefill daemon refuses every ``PeerService.Push``
before it looks at the order (no reader's agent metadata loaded, no
connection to a reader made), the decode daemon's load fails naming the
setting, and reads from it go on as before. Real daemons, NIXL and gRPC."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import Engine, KvShape, event_kind
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

SHAPE = KvShape(num_blocks=16)


def test_a_daemon_set_to_serve_no_pushes_refuses_them_and_still_serves_reads(tmp_path):
    src_d = start_daemon(str(tmp_path), "p", "--serve-pushes", "false")
    pusher_d = start_daemon(str(tmp_path), "dpush", "--transfer-mode", "push")
    reader_d = start_daemon(str(tmp_path), "dpull", "--transfer-mode", "pull")
    try:
        assert "serves no pushes (serve_pushes = false)" in src_d.log()
        stats = src_d.stats()  # what kvd status shows
        assert "serves no pushes" in stats.transfer_mode and stats.refuses_pushes
        assert not reader_d.stats().refuses_pushes
        src = Engine(src_d, "p", SHAPE, seed=7)
        pusher = Engine(pusher_d, "dpush", SHAPE)
        src.hold("r1", [1, 2, 3])
        pusher.load("r1", [4, 5, 6], src, [1, 2, 3], "r1", timeout_s=10)
        ev = pusher.wait("r1", 15)
        assert event_kind(ev) == "load_failed", ev
        assert "FAILED_PRECONDITION" in ev.load_failed.reason and "serve_pushes = false" in ev.load_failed.reason
        assert sorted(ev.load_failed.failed_block_ids) == [4, 5, 6]
        # Refused before the reader was looked at: none was loaded.
        assert src_d.stats().remote_agents == 0
        # The hold is untouched, and a decode daemon that READs gets it.
        reader = Engine(reader_d, "dpull", SHAPE)
        reader.load("r1", [7, 8, 9], src, [1, 2, 3], "r1", timeout_s=10)
        assert event_kind(reader.wait("r1", 15)) == "recv_done"
        assert reader.same_blocks([7, 8, 9], src, [1, 2, 3])
        for e in (reader, pusher, src):
            e.close()
        assert src_d.proc.poll() is None
    finally:
        for d in (reader_d, pusher_d, src_d):
            d.stop()


def test_the_refusal_names_nothing_the_daemon_holds(tmp_path):
    """A push for an engine that is not registered gets the same answer as
    one for an engine that is: the refusal comes before any lookup."""
    src_d = start_daemon(str(tmp_path), "p", "--serve-pushes", "false")
    try:
        src = Engine(src_d, "p", SHAPE)
        src.hold("r1", [1])
        stub = pb_grpc.PeerServiceStub(grpc.insecure_channel(src_d.peer_address))
        answers = []
        for engine_id in ("no-such-engine", "p"):
            with pytest.raises(grpc.RpcError) as e:
                stub.Push(pb.PushRequest(engine_id=engine_id, request_id="r1", source_groups=[pb.BlockIds(ids=[1])],
                                         reader=pb.HandshakeResponse(agent_name="x", agent_metadata=b"m"),
                                         reader_groups=[pb.BlockIds(ids=[2])], expected_notifications=1,
                                         timeout_s=5.0), timeout=10)
            answers.append((e.value.code(), e.value.details()))
        assert answers[0] == answers[1] and answers[0][0] == grpc.StatusCode.FAILED_PRECONDITION, answers
        assert "serve_pushes = false" in answers[0][1]
        src.close()
        assert src_d.proc.poll() is None
    finally:
        src_d.stop()


def test_serve_pushes_is_a_setting(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    run = lambda *a: subprocess.run([sys.executable, "-m", "kvd.cli", "serve", *a], capture_output=True, text=True,
                                    timeout=60, env=env)
    r = run("--print-config", "--serve-pushes", "false")
    assert r.returncode == 0 and "serve_pushes = false" in r.stdout, r.stdout + r.stderr
    assert "serve_pushes = true  # default" in run("--print-config").stdout
    r = run("--serve-pushes", "maybe", "--engine-socket", str(tmp_path / "e.sock"))
    assert r.returncode == 64 and "serve" in r.stderr and "Traceback" not in r.stderr, r.stderr
