"""Attack 8: a peer's NIXL agent metadata whose UCX worker address has a
version UCX does not know.

NIXL hands each backend's connection info from a peer's metadata to the
backend; UCX's address parser reads the version from the address's first
byte and, for any version but 0 and 1, stops the process on an assertion
kept in release builds (UCX ``ucp_address_unpack_header``). Found by an
attacker review: one changed byte of real metadata, answered to a decode
daemon's handshake by whatever listens at the source address a request
names (``kv_transfer_params``, from the API), or sent in a ``Push``'s
reader description, killed the daemon with SIGABRT and with it every
engine it served.

Promised now (``kvd.core.nixl_agent.metadata_problem``, checked with the
rest of a peer's description and again before every ``add_remote_agent``):
such metadata is refused with a message naming the version, the load or
push fails, the daemon keeps serving.

A second review found other bytes of the address that crash UCX's parser
(segfaults), which no check of kvd's can list. So a decode daemon with no
peer credential takes a handshake answer only from a daemon of this host
run by root or its own uid (``kvd.daemon.peer_local.dial_address``, as a
push already was): before, any local user's listener (or any host) that a
request's ``kv_transfer_params`` named got the handshake and its answer was
loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvd.core.nixl_agent import MAX_METADATA_BACKENDS, metadata_problem
from kvd.core.state import PROTOCOL_VERSION
from kvd.testing.daemons import start_daemon
from kvd.testing.nixl_peer import ucx_info_offset, with_ucx_version
from kvd.testing.processes import child_env
from kvd.testing.sessions import Engine, KvShape, event_kind
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

SHAPE = KvShape(num_layers=2, num_blocks=16, block_len=4096)




def test_metadata_problem_passes_real_metadata_and_names_an_unknown_ucx_address_version(real_md):
    assert metadata_problem(real_md) is None
    for v in range(16):
        problem = metadata_problem(with_ucx_version(real_md, v))
        if v in (0, 1):
            assert problem is None, (v, problem)
        else:
            assert problem is not None and f"version {v}" in problem, (v, problem)


def test_metadata_problem_refuses_a_backend_list_it_cannot_walk(real_md):
    conns = real_md.index(b"Conns")
    count_at = conns + len(b"Conns") + 8
    for count in (0, MAX_METADATA_BACKENDS + 1, 2 ** 64 - 1):
        forged = real_md[:count_at] + count.to_bytes(8, "little") + real_md[count_at + 8:]
        assert "backends" in (metadata_problem(forged) or ""), count
    # Cut anywhere from the backend list to the end of the UCX address.
    end = ucx_info_offset(real_md) + int.from_bytes(real_md[ucx_info_offset(real_md) - 8:ucx_info_offset(real_md)],
                                                    "little")
    for cut in range(conns, end + 1):
        assert metadata_problem(real_md[:cut]) is not None, cut
    assert metadata_problem(b"nixlSerDes|Agent") is not None
    assert metadata_problem(b"") is not None


# In a child (the abort would take pytest with it): a kvd NIXL agent given
# metadata whose UCX address has version 15. Before the check, UCX's
# assertion killed the child with SIGABRT inside add_remote_agent.
_ADD_REMOTE = textwrap.dedent("""
    import sys
    from kvd.core.nixl_agent import NixlAgent, NixlError
    md = bytes.fromhex(sys.stdin.read())
    agent = NixlAgent("attack8-loader")
    try:
        agent.add_remote(md)
        print("LOADED")
    except NixlError as e:
        print("REFUSED", e)
    agent.close()
""")


def test_an_agent_refuses_to_load_metadata_with_an_unknown_ucx_address_version_and_lives(real_md):
    bad = with_ucx_version(real_md, 15)
    p = subprocess.run([sys.executable, "-c", _ADD_REMOTE], input=bad.hex(), capture_output=True, text=True,
                       timeout=120, env=child_env())
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert "REFUSED" in p.stdout and "version 15" in p.stdout, p.stdout


class HostileHandshake:
    """A PeerService on loopback that answers every handshake with
    ``metadata`` (echoing the caller's compatibility hash, so the rest of
    the description passes): what any host a request's ``kv_transfer_params``
    name can serve."""

    def __init__(self, metadata: bytes, name: str):
        regions = SHAPE.regions()
        base = 0x10000000

        class Servicer(pb_grpc.PeerServiceServicer):
            def Handshake(self, request, context):
                return pb.HandshakeResponse(
                    agent_metadata=metadata, agent_name=name, layout=SHAPE.layout(), regions=regions,
                    region_base_addrs=[base + r.offset for r in regions], compat_hash=request.compat_hash,
                    daemon_version="0", protocol_version=PROTOCOL_VERSION, tp_size=1, memory="DRAM")

            def Claim(self, request, context):
                return pb.ClaimResponse()

        self.server = grpc.server(ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_PeerServiceServicer_to_server(Servicer(), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def close(self) -> None:
        self.server.stop(grace=0.5).wait()


def test_a_handshake_answer_with_an_unknown_ucx_address_version_fails_the_load_and_the_daemon_serves_on(
        tmp_path, real_md):
    d = start_daemon(str(tmp_path), "reader", log_level="info")
    reader = Engine(d, "reader-ucxver", SHAPE)
    source = Engine(d, "source-ucxver", SHAPE, seed=3)
    peer = HostileHandshake(with_ucx_version(real_md, 15), "attack8-real-agent")
    try:
        reader.load("bad", [1], None, [1], "bad", timeout_s=10, remote_engine_id="hostile",
                    remote_address=peer.address)
        ev = reader.wait("bad", 30)
        assert event_kind(ev) == "load_failed" and "UCX worker address has version 15" in ev.load_failed.reason, ev
        assert d.proc.poll() is None
        source.hold("real", [5])
        reader.load("real", [6], source, [5], "real", timeout_s=10)
        ev = reader.wait("real", 30)
        assert event_kind(ev) == "recv_done" and reader.same_blocks([6], source, [5]), ev
        assert d.stats().engines == 2
    finally:
        peer.close()
        reader.close()
        source.close()
        assert d.stop() == 0


def test_a_push_whose_reader_has_an_unknown_ucx_address_version_is_refused_and_the_daemon_serves_on(
        tmp_path, real_md):
    d = start_daemon(str(tmp_path), "source", log_level="info")
    e = Engine(d, "push-ucxver", SHAPE, seed=2)
    ch = grpc.insecure_channel(d.peer_address)
    stub = pb_grpc.PeerServiceStub(ch)
    try:
        e.hold("req", [1], lease_s=600)
        e.held("req", [1])
        real = stub.Handshake(pb.HandshakeRequest(engine_id=e.engine_id, tp_rank=0,
                                                  compat_hash=e.registered.compat_hash,
                                                  protocol_version=PROTOCOL_VERSION), timeout=10)
        desc = pb.HandshakeResponse()
        desc.CopyFrom(real)
        desc.agent_metadata, desc.agent_name, desc.warm_up_addr = (with_ucx_version(real_md, 15),
                                                                   "attack8-real-agent", 0)
        with pytest.raises(grpc.RpcError) as err:
            stub.Push(pb.PushRequest(engine_id=e.engine_id, tp_rank=0, request_id="req",
                                     source_groups=[pb.BlockIds(ids=[1])], reader=desc, reader_tp_rank=0,
                                     reader_groups=[pb.BlockIds(ids=[5])], expected_notifications=1,
                                     timeout_s=5), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "version 15" in err.value.details(), err.value.details()
        assert d.proc.poll() is None
        again = stub.Handshake(pb.HandshakeRequest(engine_id=e.engine_id, tp_rank=0,
                                                   compat_hash=e.registered.compat_hash,
                                                   protocol_version=PROTOCOL_VERSION), timeout=10)
        assert again.agent_metadata == real.agent_metadata
    finally:
        ch.close()
        e.close()
        assert d.stop() == 0


# As uid 65534 after its imports: a PeerService on loopback answering every
# handshake with the metadata on stdin (echoing the compatibility hash);
# prints its port, then "ASKED" on each handshake it gets.
_OTHER_USERS_PEER = textwrap.dedent("""
    import os, sys, time
    from concurrent.futures import ThreadPoolExecutor
    import grpc
    from kvd.core.state import PROTOCOL_VERSION
    from kvd.testing.sessions import KvShape
    from kvd.v1 import kvd_pb2 as pb, kvd_pb2_grpc as pb_grpc
    md = bytes.fromhex(sys.stdin.readline().strip())
    shape = KvShape(num_layers=2, num_blocks=16, block_len=4096)
    regions = shape.regions()
    class Servicer(pb_grpc.PeerServiceServicer):
        def Handshake(self, request, context):
            print("ASKED", flush=True)
            return pb.HandshakeResponse(agent_metadata=md, agent_name="attack8-real-agent", layout=shape.layout(),
                                        regions=regions, region_base_addrs=[0x10000000 + r.offset for r in regions],
                                        compat_hash=request.compat_hash, daemon_version="0",
                                        protocol_version=PROTOCOL_VERSION, tp_size=1, memory="DRAM")
    # Everything gRPC imports lazily is loaded while root: as another user a
    # checkout in a directory only root may enter (a fresh clone's) is unreadable.
    "x".encode("idna")
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PeerServiceServicer_to_server(Servicer(), server)
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    print("PORT", server.add_insecure_port("127.0.0.1:0"), flush=True)  # the listener is uid 65534's
    server.start()
    time.sleep(120)
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the listener as another user")
def test_with_no_credential_a_handshake_goes_to_no_other_users_listener(tmp_path, real_md):
    d = start_daemon(str(tmp_path), "reader", log_level="info")
    reader = Engine(d, "reader-dial", SHAPE)
    source = Engine(d, "source-dial", SHAPE, seed=3)
    peer = subprocess.Popen([sys.executable, "-c", _OTHER_USERS_PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        peer.stdin.write(real_md.hex() + "\n")
        peer.stdin.flush()
        line = peer.stdout.readline()
        if not line.startswith("PORT "):
            peer.kill()
            err = peer.communicate()[1] or ""
            if "ImportError" in err or "PermissionError" in err:
                pytest.skip(f"uid 65534 cannot import this checkout's packages: {err.strip().splitlines()[-1:]}")
            raise AssertionError(f"the listener did not start: {err[-3000:]}")
        address = f"127.0.0.1:{int(line.split()[1])}"
        reader.load("other", [1], None, [1], "other", timeout_s=10, remote_engine_id="hostile",
                    remote_address=address)
        ev = reader.wait("other", 30)
        assert event_kind(ev) == "load_failed" and "served by uid 65534" in ev.load_failed.reason, ev
        assert "handshake not sent" in ev.load_failed.reason, ev
        # The daemon's own engines still pair with each other.
        source.hold("real", [5])
        reader.load("real", [6], source, [5], "real", timeout_s=10)
        ev = reader.wait("real", 30)
        assert event_kind(ev) == "recv_done" and reader.same_blocks([6], source, [5]), ev
    finally:
        peer.kill()
        out = "" if peer.stdout.closed else peer.communicate()[0]
        reader.close()
        source.close()
        assert d.stop() == 0
    assert "ASKED" not in out, "another user's listener got a handshake"
