"""Peer access: mutual TLS, the shared token, and loopback-only
without either. Certificates come from a throwaway CA made here.

Daemons for the module, started together: a mutual-TLS pair, a token pair,
and two with no authentication on 0.0.0.0 (one opted out with peer_insecure).
"""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.core.state import PROTOCOL_VERSION
from kvd.daemon.peer_auth import HEADER, PeerAuth
from kvd.v1 import kvd_pb2 as pb
from kvd.testing.fakes import FakePeer
from kvd.testing.sessions import Engine, KvShape, event_kind
from kvd.testing.daemons import start_daemons, stop_daemons
from kvd.testing.security import Pki
from kvd.testing.util import peer_token_file

SHAPE = KvShape(num_layers=2, num_blocks=16, block_len=2048)
TOKEN = b"kvd-test-token-" + b"0123456789abcdef" * 2
HANDSHAKE = "/kvd.v1.PeerService/Handshake"
NOBODY_HERE = pb.HandshakeRequest(engine_id="nobody-here", protocol_version=PROTOCOL_VERSION).SerializeToString()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peer")
    pki = Pki(str(tmp / "pki"))
    tok = ("--peer-token-file", peer_token_file(tmp, TOKEN.decode()))
    names = ["tls_p", "tls_d", "tok_p", "tok_d", "open", "insecure"]
    daemons = start_daemons(
        (str(tmp), "tls_p", *pki.flags("tls-p")),
        (str(tmp), "tls_d", *pki.flags("tls-d")),
        (str(tmp), "tok_p", *tok),
        (str(tmp), "tok_d", *tok),
        (str(tmp), "open", "--peer-listen", "0.0.0.0:0"),
        (str(tmp), "insecure", "--peer-listen", "0.0.0.0:0", "--peer-insecure", "true"),
    )
    e = dict(zip(names, daemons))
    e["pki"] = pki
    yield e
    stop_daemons(daemons)


def _transfer(p, d, tag: str):
    """Prefill on ``p`` holds three blocks, decode on ``d`` loads them; the decode event."""
    src, dst = Engine(p, f"P{tag}", SHAPE, seed=1), Engine(d, f"D{tag}", SHAPE, seed=2)
    try:
        src.hold("r", [1, 2, 3])
        dst.load("l", [4, 5, 6], src, [1, 2, 3], "r", timeout_s=10)
        ev = dst.wait("l", 30)
        same = dst.same_blocks([4, 5, 6], src, [1, 2, 3])
        return ev, same
    finally:
        src.close()
        dst.close()


def _handshake(channel, metadata=(), body=NOBODY_HERE):
    """A raw Handshake of ``body`` (bytes); ``(status name, details, trailing metadata)``."""
    call = channel.unary_unary(HANDSHAKE).with_call
    try:
        _, c = call(body, timeout=5, metadata=metadata)
        return "OK", "", dict(c.trailing_metadata())
    except grpc.RpcError as e:
        return e.code().name, e.details(), dict(e.trailing_metadata() or ())


def _still_serving(*daemons) -> None:
    for d in daemons:
        assert d.proc.poll() is None and d.stats().daemon_version


# ------------------------------------------------------------------ mutual TLS
def test_mutual_tls_daemons_transfer(env):
    ev, same = _transfer(env["tls_p"], env["tls_d"], "tls")
    assert event_kind(ev) == "recv_done" and same, ev
    assert "authentication: mutual TLS" in env["tls_p"].log()


def test_a_peer_without_a_valid_certificate_is_refused(env, tmp_path):
    p, pki = env["tls_p"], env["pki"]
    ca = open(pki.ca, "rb").read()
    rogue = Pki(str(tmp_path / "rogue"), "rogue-ca")
    rogue_cert, rogue_key = rogue.issue("intruder")
    good_cert, good_key = pki.issue("client")
    read = lambda path: open(path, "rb").read()  # noqa: E731
    cases = {
        "plaintext": grpc.insecure_channel(p.peer_address),
        "no client certificate": grpc.secure_channel(p.peer_address, grpc.ssl_channel_credentials(ca)),
        "certificate of another CA": grpc.secure_channel(p.peer_address, grpc.ssl_channel_credentials(
            ca, read(rogue_key), read(rogue_cert))),
    }
    for what, ch in cases.items():
        code, msg, _ = _handshake(ch)
        assert code == "UNAVAILABLE" and msg, (what, code, msg)
        ch.close()
    # The same call with a certificate of the cluster's CA reaches the service.
    ch = grpc.secure_channel(p.peer_address, grpc.ssl_channel_credentials(ca, read(good_key), read(good_cert)))
    code, msg, _ = _handshake(ch)
    assert code == "NOT_FOUND" and "nobody-here" in msg, (code, msg)
    ch.close()
    _still_serving(p)


def test_daemons_with_other_credentials_cannot_read_each_others_blocks(env):
    # A token daemon (no certificate) reading from a TLS daemon, and back.
    for p, d in ((env["tls_p"], env["tok_d"]), (env["tok_p"], env["tls_d"])):
        ev, _ = _transfer(p, d, f"x{p.proc.pid}")
        assert event_kind(ev) == "load_failed" and ev.load_failed.reason.startswith("handshake"), ev
        assert list(ev.load_failed.failed_block_ids) == [4, 5, 6]
    _still_serving(env["tls_p"], env["tls_d"], env["tok_p"], env["tok_d"])


# ------------------------------------------------------------------ the token
def test_token_daemons_transfer(env):
    ev, same = _transfer(env["tok_p"], env["tok_d"], "tok")
    assert event_kind(ev) == "recv_done" and same, ev
    assert "authentication: token" in env["tok_p"].log()


def test_a_peer_without_the_token_is_refused_and_health_needs_none(env):
    p = env["tok_p"]
    ch = grpc.insecure_channel(p.peer_address)
    h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="kvd.v1.PeerService"), timeout=5)
    assert h.status == health_pb2.HealthCheckResponse.SERVING  # probes work without the token

    code, msg, _ = _handshake(ch)
    assert code == "UNAUTHENTICATED" and f"missing {HEADER}" in msg, (code, msg)
    wrong, _ = PeerAuth(token=b"not-the-cluster-token-0123456789").call_metadata(HANDSHAKE, p.peer_address, NOBODY_HERE)
    code, msg, _ = _handshake(ch, wrong)
    assert code == "UNAUTHENTICATED" and "bad peer token proof" in msg, (code, msg)

    auth = PeerAuth(token=TOKEN)
    md, _ = auth.call_metadata(HANDSHAKE, p.peer_address, NOBODY_HERE)
    code, msg, _ = _handshake(ch, md)
    assert code == "NOT_FOUND", (code, msg)      # authenticated: the service answered (errors carry no proof)
    code, msg, _ = _handshake(ch, md)            # the same header again
    assert code == "UNAUTHENTICATED" and "replayed" in msg, (code, msg)

    relayed, _ = auth.call_metadata(HANDSHAKE, "10.9.9.9:7700", NOBODY_HERE)  # made for another daemon
    code, msg, _ = _handshake(ch, relayed)
    assert code == "UNAUTHENTICATED" and "addressed to 10.9.9.9:7700" in msg, (code, msg)

    auth_then = PeerAuth(token=TOKEN)
    real_time = time.time
    try:
        time.time = lambda: real_time() - 3600  # a header from an hour ago
        old, _ = auth_then.call_metadata(HANDSHAKE, p.peer_address, NOBODY_HERE)
    finally:
        time.time = real_time
    code, msg, _ = _handshake(ch, old)
    assert code == "UNAUTHENTICATED" and "too old" in msg, (code, msg)
    ch.close()
    _still_serving(p)


def test_an_answer_from_a_daemon_that_cannot_prove_the_token_is_not_used(env):
    d = env["tok_d"]
    fake = FakePeer(lambda request, context: pb.HandshakeResponse(agent_metadata=b"x" * 64, agent_name="forged"))
    dst = Engine(d, "Dfake", SHAPE)
    agents = d.stats().remote_agents
    try:
        dst.load("l", [1], None, [1], "r", remote_engine_id="P", remote_address=fake.address, timeout_s=10)
        ev = dst.wait("l", 30)
        assert event_kind(ev) == "load_failed" and "did not prove the shared peer token" in ev.load_failed.reason
        assert fake.calls == 1
        assert d.stats().remote_agents == agents  # the forged agent metadata never reached NIXL
    finally:
        dst.close()
        fake.stop()
    _still_serving(d)


# ------------------------------------------------------------- neither: loopback
def _listening(port: int) -> set[str]:
    """What TCP ``port`` listens on: ``"loopback"`` and/or ``"any"`` (IPv4 or IPv6)."""
    names = {"0100007F": "loopback", "0000000000000000FFFF00000100007F": "loopback",
             "00000000000000000000000001000000": "loopback",
             "00000000": "any", "00000000000000000000000000000000": "any"}
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":
                out.add(names.get(addr, addr))
    return out


def test_without_tls_or_token_the_peer_port_binds_loopback_only(env):
    d = env["open"]
    host, port = d.peer_address.rsplit(":", 1)
    assert host == "127.0.0.1"
    assert _listening(int(port)) == {"loopback"}
    assert "binding 127.0.0.1:0 instead of 0.0.0.0:0" in d.log()


def test_peer_insecure_opts_out_with_a_loud_warning(env):
    d = env["insecure"]
    port = int(d.peer_address.rsplit(":", 1)[1])
    assert _listening(port) == {"any"}
    assert "WARNING" in d.log() and "NO authentication (peer_insecure = true)" in d.log()
