"""Attacker scenarios against real daemons, second review: the loopback
caller check of PeerService (kvd.daemon.peer_local), hostile peer
descriptions (kvd.core.peers), leases and claims (kvd.core.holds).

Each test runs the hostile sequence and asserts what docs/SECURITY.md
promises: regression guards of defences that held, and of the fixes of what
the review found open (a scenario still open would be marked xfail(strict),
its reason saying what happens instead).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.core.state import PROTOCOL_VERSION
from kvd.testing.daemons import start_daemon
from kvd.testing.nixl_peer import PEER_AGENT
from kvd.testing.processes import child_env
from kvd.testing.security import NOBODY, reachable_dir
from kvd.testing.sessions import Engine, KvShape
from kvd.testing.util import wait_until

SHAPE = KvShape(num_layers=2, num_blocks=16, block_len=4096)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a caller as another user")

# As uid argv[3] (after the imports): a TCP socket bound to 127.0.0.1:argv[4]
# (0: any port) with SO_REUSEADDR, connected to argv[5]:argv[1], and a
# gRPC channel relayed through it (gRPC cannot bind a client's port) that
# asks PeerService.Handshake for engine argv[2]. Prints one JSON line.
_HANDSHAKE_FROM_PORT = r"""
import json, os, socket, sys, threading
import grpc
from kvd.core.state import PROTOCOL_VERSION
from kvd.v1 import kvd_pb2 as pb, kvd_pb2_grpc as pb_grpc
port, engine_id, uid, src_port, dst = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
"x".encode("idna")  # loaded while root: as another user this interpreter's files may be unreadable
os.setgroups([]); os.setgid(uid); os.setuid(uid)
out = {}
up = socket.socket()
up.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    up.bind(("127.0.0.1", src_port))
    up.connect((dst, port))
except OSError as e:
    print(json.dumps({"ok": False, "code": "SOCKET", "details": str(e)}), flush=True)
    sys.exit(0)
out["src"] = list(up.getsockname())
relay = socket.create_server(("127.0.0.1", 0))
def pump(a, b):
    try:
        while (data := a.recv(65536)):
            b.sendall(data)
    except OSError:
        pass
def serve():
    c, _ = relay.accept()
    threading.Thread(target=pump, args=(c, up), daemon=True).start()
    pump(up, c)
threading.Thread(target=serve, daemon=True).start()
stub = pb_grpc.PeerServiceStub(grpc.insecure_channel(f"127.0.0.1:{relay.getsockname()[1]}"))
try:
    r = stub.Handshake(pb.HandshakeRequest(engine_id=engine_id, protocol_version=PROTOCOL_VERSION), timeout=10)
    out.update(ok=True, metadata_bytes=len(r.agent_metadata), regions=len(r.region_base_addrs))
except grpc.RpcError as e:
    out.update(ok=False, code=e.code().name, details=e.details())
print(json.dumps(out), flush=True)
"""


def _handshake_as(uid: int, port: int, engine_id: str, src_port: int, dst: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _HANDSHAKE_FROM_PORT, str(port), engine_id, str(uid), str(src_port),
                        dst], capture_output=True, text=True, timeout=60, env=child_env())
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if not lines and ("ImportError" in r.stderr or "PermissionError" in r.stderr):
        # gRPC imports parts of itself lazily, after the setuid: a virtualenv
        # in a directory only root may enter (mktemp's 0700, a fresh clone)
        # is not readable to the other user.
        pytest.skip(f"uid {uid} cannot import this checkout's packages: {r.stderr.strip().splitlines()[-1:]}")
    assert lines, r.stderr[-3000:]
    return json.loads(lines[-1])


def _client_ports(server_port: int, uid: int) -> list[int]:
    """Local ports of ESTABLISHED loopback sockets of ``uid`` connected to
    ``server_port`` (/proc/net/tcp{,6}: what any local user can read)."""
    ports = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.read().splitlines()[1:]:
                p = line.split()
                local, remote = p[1], p[2]
                if (p[3] == "01" and int(p[7]) == uid and int(remote.rsplit(":", 1)[1], 16) == server_port
                        and local.rsplit(":", 1)[0][-8:] == "0100007F"):
                    ports.append(int(local.rsplit(":", 1)[1], 16))
    return ports


@pytest.fixture(scope="module")
def insecure(tmp_path_factory):
    """A daemon with no credential on a wildcard listener (``peer_insecure``):
    every host is trusted, local callers still only as root or its uid."""
    d = start_daemon(reachable_dir(), "wild", "--peer-listen", "0.0.0.0:0", "--peer-insecure", "true")
    v = Engine(d, "victim-wild", SHAPE, seed=7)
    yield d, v
    v.close()
    assert d.stop() == 0


@needs_root
def test_on_a_wildcard_listener_a_local_user_dialing_another_loopback_address_is_refused(insecure):
    """Regression guard: uid NOBODY dials 127.0.0.2 (not the advertised or
    the listen address, which is 0.0.0.0); its socket is still found."""
    d, v = insecure
    port = int(d.peer_address.rsplit(":", 1)[1])
    out = _handshake_as(NOBODY, port, v.engine_id, 0, "127.0.0.2")
    if out["code"] == "SOCKET":
        pytest.skip(f"127.0.0.2 not reachable here: {out['details']}")
    assert not out["ok"] and out["code"] == "UNAUTHENTICATED", out


@needs_root
def test_a_local_user_sharing_the_port_of_a_trusted_client_socket_gets_no_handshake(insecure):
    """A local user binds the local port of a root (or daemon-uid) gRPC
    client socket with SO_REUSEADDR (gRPC sets it on its client sockets)
    and dials the wildcard listener at 127.0.0.2: gRPC tells the daemon the
    caller's ip:port only, which both sockets share; the call is refused,
    not taken for the trusted socket's owner."""
    d, v = insecure
    port = int(d.peer_address.rsplit(":", 1)[1])
    # A trusted client of the peer port (another daemon of this uid, `kvd health`): a plain gRPC channel.
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        ports = [p for p in _client_ports(port, os.geteuid()) if p != port]
        assert ports, "the trusted channel's socket is not in /proc/net/tcp{,6}"
        out = _handshake_as(NOBODY, port, v.engine_id, ports[0], "127.0.0.2")
        if out.get("code") == "SOCKET":
            pytest.skip(f"cannot share the port here: {out['details']}")
        assert not out["ok"], (f"uid {NOBODY} got {out['metadata_bytes']} B of agent metadata and "
                               f"{out['regions']} region addresses from {out['src']}")
        assert out["code"] == "UNAUTHENTICATED", out


# ---------------------------------------------------------------- hostile peers
class HostilePeer:
    """A PeerService on loopback that describes a NIXL agent of its own
    (another process, ``self.agent``) as engine ``engine_id`` laid out like
    ``shape`` and grants every claim: what any local user, or any host an
    API client names in ``kv_transfer_params``, can serve."""

    def __init__(self, shape: KvShape, compat_hash: str, name: str = "hostile-agent", env: dict | None = None):
        from concurrent.futures import ThreadPoolExecutor

        from kvd.v1 import kvd_pb2 as pb
        from kvd.v1 import kvd_pb2_grpc as pb_grpc

        self.agent = subprocess.Popen([sys.executable, "-c", PEER_AGENT, name, str(shape.size)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(env))
        for line in self.agent.stdout:
            if line.startswith("MD "):
                break
        else:
            raise RuntimeError("the peer agent did not start")
        _, md, base = line.split()
        regions = shape.regions()
        self.answer = pb.HandshakeResponse(
            agent_metadata=bytes.fromhex(md), agent_name=name, layout=shape.layout(), regions=regions,
            region_base_addrs=[int(base) + r.offset for r in regions], compat_hash=compat_hash,
            daemon_version="0", protocol_version=PROTOCOL_VERSION, tp_size=1, memory="DRAM")
        peer = self

        class Servicer(pb_grpc.PeerServiceServicer):
            def Handshake(self, request, context):
                return peer.answer

            def Claim(self, request, context):
                return pb.ClaimResponse()

        self.server = grpc.server(ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_PeerServiceServicer_to_server(Servicer(), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def close(self) -> None:
        self.server.stop(grace=0.5).wait()
        self.agent.kill()
        self.agent.wait()


@pytest.mark.parametrize("tls", ["default", "tcp"])
def test_a_read_from_a_frozen_peer_fails_at_its_deadline_and_lands_nothing_after(tmp_path, tls):
    """A hostile peer grants the claim, then its agent stops (SIGSTOP: no
    UCX progress on its side; an honest peer starved or paused looks the
    same) while the reader's READ is posted. The load must fail at its
    deadline (vLLM then reuses the blocks); when the peer resumes, none of
    its bytes may land in those blocks any more. With UCX's default
    transports on one host (shared memory / CMA) the reader pulls the bytes
    itself before the deadline; with ``tcp`` the peer sends them, late."""
    import signal
    import time

    from kvd.testing.sessions import event_kind

    env = {"UCX_TLS": "tcp"} if tls == "tcp" else None
    d = start_daemon(str(tmp_path), "kvd", "--transfer-mode", "pull", env=env)  # a READ: pull, over TCP too
    reader = Engine(d, "reader-frozen", SHAPE)
    peer = HostilePeer(SHAPE, reader.registered.compat_hash, env=env)
    try:
        os.kill(peer.agent.pid, signal.SIGSTOP)
        reader.load("frozen", [1, 2], None, [1, 2], "frozen", timeout_s=2, remote_engine_id="hostile",
                    remote_address=peer.address)
        ev = reader.wait("frozen", 30)
        assert event_kind(ev) == "load_failed" and "timeout" in ev.load_failed.reason, ev
        landed_before = bool(reader.kv[:, [1, 2]].any())
        time.sleep(1)
        reader.kv[:, [1, 2]] = 0  # vLLM reuses the failed blocks: new KV is written into them
        os.kill(peer.agent.pid, signal.SIGCONT)
        # The peer's progress thread runs again: late bytes land within
        # milliseconds when they land at all; 10 s is the bound of "never".
        wait_until(lambda: reader.kv[:, [1, 2]].any(), 10)
        assert not reader.kv[:, [1, 2]].any(), (
            f"the frozen peer's bytes landed in blocks reported failed (some already before: {landed_before})")
        assert d.proc.poll() is None and d.stats().engines == 1
    finally:
        reader.close()
        peer.close()
        assert d.stop() == 0


@pytest.mark.parametrize("end", [
    "session",
    "unregister",
])
def test_a_read_from_a_frozen_peer_lands_nothing_after_its_session_ended(tmp_path, end):
    """As above over UCX's tcp transport, but the reader's session ends
    while the READ is posted (the engine restarts its stream; or drops the
    worker). The daemon cancels the READ and closes the stream only once
    none can land (docs/SECURITY.md); a new session opens after that. When
    the peer resumes, none of its bytes may land in the reader's blocks, and
    the daemon keeps serving."""
    import signal
    import time

    from kvd.testing.sessions import Session

    env = {"UCX_TLS": "tcp"}
    d = start_daemon(str(tmp_path), "kvd", "--transfer-mode", "pull", env=env)  # a READ: pull, over TCP too
    reader = Engine(d, "reader-ended", SHAPE)
    peer = HostilePeer(SHAPE, reader.registered.compat_hash, env=env)
    again = bystander = None
    try:
        os.kill(peer.agent.pid, signal.SIGSTOP)
        reader.load("ended", [1, 2], None, [1, 2], "ended", timeout_s=60, remote_engine_id="hostile",
                    remote_address=peer.address)
        deadline = time.monotonic() + 20
        while d.stats().inflight_transfers == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.stats().inflight_transfers == 1  # the READ is posted
        if end == "session":
            reader.session.close()
            again = Session(d, reader.engine_id)  # opens once the old session's READs are settled
        else:
            reader.close(unregister=True)
            # Another engine registers next: its mapping in the daemon may take the freed addresses.
            bystander = Engine(d, "bystander", SHAPE)
        os.kill(peer.agent.pid, signal.SIGCONT)

        def landed() -> bool:  # the peer's progress thread runs again: within ms, when at all
            if d.proc.poll() is not None:
                return True
            if end == "session":
                return bool(reader.kv[:, [1, 2]].any())
            return bool((bystander.kv == 0xAB).any())

        wait_until(landed, 10)
        assert d.proc.poll() is None, f"daemon exited {d.proc.poll()}"
        if end == "session":
            assert not reader.kv[:, [1, 2]].any(), "the frozen peer's bytes landed after the session ended"
        else:
            assert not (bystander.kv == 0xAB).any(), "the frozen peer's bytes landed in another engine's blocks"
        assert d.stats().engines == 1
    finally:
        for x in (again, bystander):
            if x is not None:
                x.close()
        if reader.kv is not None:
            reader.close()
        peer.close()
        assert d.stop() == 0


def test_a_worker_dropped_before_its_pairs_lists_are_prepared_leaves_the_daemon_serving(tmp_path):
    """kvd.core.peers prepares a pair's descriptor lists PREP_DELAY_S after
    its handshake, on the NIXL thread. The reader is dropped (its agent
    destroyed) and registered again under the same key inside that second:
    the late preparation must touch neither the freed agent nor the new
    worker, and a load of the new worker from the same peer works."""
    import time

    from kvd.core.peers import PREP_DELAY_S
    from kvd.testing.sessions import event_kind

    d = start_daemon(str(tmp_path), "kvd")
    reader = Engine(d, "reader-prep", SHAPE)
    peer = HostilePeer(SHAPE, reader.registered.compat_hash)
    try:
        reader.load("first", [1], None, [1], "first", timeout_s=20, remote_engine_id="hostile",
                    remote_address=peer.address)
        assert event_kind(reader.wait("first", 30)) == "recv_done"
        assert d.stats().dlists_preparing >= 1, "the lists were prepared before the worker could be dropped"
        reader.close()
        reader = Engine(d, "reader-prep", SHAPE)
        time.sleep(PREP_DELAY_S + 0.5)  # the first pair's preparation has run (or been skipped) by now
        assert d.proc.poll() is None
        reader.load("second", [2], None, [2], "second", timeout_s=20, remote_engine_id="hostile",
                    remote_address=peer.address)
        assert event_kind(reader.wait("second", 30)) == "recv_done"
        assert (reader.kv[:, 2] == 0xAB).all()
        assert d.stats().engines == 1
    finally:
        reader.close()
        peer.close()
        assert d.stop() == 0


def test_nixl_refuses_rows_between_two_registrations_of_a_peer(tmp_path):
    """The handshake checks a peer's description by its edge rows only
    (``RowMap.edges``): every row of a region lies between its first and last
    block, but a peer with two registrations could describe a region that
    starts in one, ends in the other and strides through the gap. What stops
    it is NIXL checking each row against the remote agent's registrations,
    at preparation and at ``initialize_xfer`` (measured: NIXL_ERR_NOT_FOUND
    both ways; a row straddling a registration's end too)."""
    import ctypes
    import mmap

    import numpy as np

    from kvd.core.nixl_agent import NixlAgent, NixlError, Unprepped

    page = 1 << 16
    reader, source = NixlAgent("gap-reader"), NixlAgent("gap-source")
    src = mmap.mmap(-1, 3 * page)
    dst = mmap.mmap(-1, page)
    src_base = ctypes.addressof(ctypes.c_char.from_buffer(src))
    dst_base = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    source.register_dram(src_base, page)
    source.register_dram(src_base + 2 * page, page)  # the middle page is not registered
    reader.register_dram(dst_base, page)
    name = reader.add_remote(source.metadata())

    def rows(*addrs):
        return np.array([[a, 4096, 0] for a in addrs], dtype=np.int64)

    reader.release_dlist(reader.prep_remote(name, rows(src_base, src_base + 3 * page - 4096)))  # the edges pass
    for bad in (src_base + page + 4096, src_base + page - 2048):  # in the gap; straddling the first's end
        with pytest.raises(NixlError, match="NOT_FOUND"):
            reader.prep_remote(name, rows(bad))
        with pytest.raises(NixlError, match="NOT_FOUND"):
            reader.post("READ", Unprepped(lambda idx: rows(dst_base)), np.array([0]),
                        Unprepped(lambda idx, bad=bad: rows(bad), agent=name), np.array([0]), b"x")
    assert dst[:] == bytes(page)  # nothing was read
    reader.remove_remote(name)



def _load_via(reader: Engine, peer: HostilePeer, rid: str):
    reader.load(rid, [1], None, [1], rid, timeout_s=10, remote_engine_id="hostile", remote_address=peer.address)
    return reader.wait(rid, 30)


def test_a_peer_describing_an_agent_named_like_the_reader_is_refused(tmp_path):
    """A hostile peer learns the reader's agent name (NIXL notifications and
    UCX wire-up carry it) and answers a handshake with a real agent of that
    name. NIXL refuses an agent named like the one loading it
    (``loadRemoteMD``: NIXL_ERR_INVALID_PARAM): the load fails at its
    handshake, the reader keeps working."""
    from kvd.testing.sessions import event_kind

    d = start_daemon(str(tmp_path), "kvd")
    reader = Engine(d, "reader-self", SHAPE)
    source = Engine(d, "source-self", SHAPE, seed=3)
    peer = HostilePeer(SHAPE, reader.registered.compat_hash, name=reader.registered.agent_name)
    try:
        ev = _load_via(reader, peer, "self")
        assert event_kind(ev) == "load_failed" and "handshake" in ev.load_failed.reason, ev
        source.hold("real", [5])
        reader.load("real", [6], source, [5], "real", timeout_s=10)
        ev = reader.wait("real", 30)
        assert event_kind(ev) == "recv_done" and reader.same_blocks([6], source, [5]), ev
        assert d.proc.poll() is None and d.stats().engines == 2
    finally:
        peer.close()
        reader.close()
        source.close()
        assert d.stop() == 0


def test_a_peer_squatting_another_engines_agent_name_does_not_keep_the_reader_from_it(tmp_path):
    """A hostile peer (any local user can listen on loopback; a request's
    ``kv_transfer_params`` name it) answers with a real agent of its own
    named like the victim's (``kvd-<engine>-r<rank>-<random>``: from a
    notification, a log, ``kvd status`` of a shared user). The name is
    one of the reader's daemon's own agents: refused at the handshake. Then
    the reader's first real load from the victim (the NIXL path: named shm)
    works."""
    from kvd.testing.sessions import event_kind

    d = start_daemon(str(tmp_path), "kvd")
    reader = Engine(d, "reader-squat", SHAPE)
    victim = Engine(d, "victim-squat", SHAPE, seed=3)
    peer = HostilePeer(SHAPE, reader.registered.compat_hash, name=victim.registered.agent_name)
    try:
        ev = _load_via(reader, peer, "squat")
        assert event_kind(ev) == "load_failed" and "this daemon's agent" in ev.load_failed.reason, ev
        victim.hold("real", [5])
        reader.load("real", [6], victim, [5], "real", timeout_s=10)
        ev = reader.wait("real", 30)
        assert event_kind(ev) == "recv_done", ev
        assert reader.same_blocks([6], victim, [5])
    finally:
        peer.close()
        reader.close()
        victim.close()
        assert d.stop() == 0


@pytest.mark.parametrize("holder", ["moved_on", "still_there"])
def test_an_agent_name_loaded_from_one_peer_is_not_taken_over_by_another(tmp_path, holder):
    """Across daemons: a hostile peer answers first with an agent named like
    the victim's (on another daemon), and the reader loads it (its own
    memory, granted). When the victim's real daemon then describes its agent
    by that name, the peer that introduced the name is asked again: once it
    describes another agent its remote is retired and the real load works;
    while it still describes the name, the newcomer is refused, naming the
    holder (without a peer credential this daemon cannot tell which of two
    peers lies: docs/SECURITY.md), and the holder keeps its agent."""
    from kvd.testing.sessions import event_kind
    from kvd.v1 import kvd_pb2 as pb

    d = start_daemon(str(tmp_path), "reader")
    src = start_daemon(str(tmp_path), "source")
    reader = Engine(d, "reader-taken", SHAPE)
    victim = Engine(src, "victim-taken", SHAPE, seed=3)
    peer = HostilePeer(SHAPE, reader.registered.compat_hash, name=victim.registered.agent_name)
    try:
        assert event_kind(_load_via(reader, peer, "first")) == "recv_done"  # the peer's own memory
        if holder == "moved_on":
            moved = pb.HandshakeResponse()
            moved.CopyFrom(peer.answer)
            moved.agent_name = "kvd-hostile-r0-another"
            peer.answer = moved
        victim.hold("real", [5])
        reader.load("real", [6], victim, [5], "real", timeout_s=10)
        ev = reader.wait("real", 30)
        if holder == "moved_on":
            assert event_kind(ev) == "recv_done", ev
            assert reader.same_blocks([6], victim, [5])
        else:
            assert event_kind(ev) == "load_failed" and peer.address in ev.load_failed.reason, ev
            victim.release("real")
            assert event_kind(_load_via(reader, peer, "again")) == "recv_done"  # the holder's remote still works
        assert d.proc.poll() is None and d.stats().engines == 1
    finally:
        peer.close()
        reader.close()
        victim.close()
        assert d.stop() == 0 and src.stop() == 0
