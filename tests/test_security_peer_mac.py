"""The peer token's MAC covers the message (docs/SECURITY.md, "Peers: shared
token"): a relay on the path cannot swap a request's body or a handshake
answer, an old (v1) header is refused with a reason, and the replay window
never forgets a live nonce. Real token daemons; the relay is a gRPC server
that forwards raw bytes and metadata."""

from __future__ import annotations

import hashlib
import hmac
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvd.core.state import PROTOCOL_VERSION
from kvd.daemon import peer_auth
from kvd.daemon.peer_auth import HEADER, PeerAuth, PeerAuthError, ReplayWindowFull
from kvd.v1 import kvd_pb2 as pb
from kvd.testing.daemons import start_daemons, stop_daemons
from kvd.testing.sessions import Engine, KvShape, event_kind
from kvd.testing.util import free_port

SHAPE = KvShape(num_layers=2, num_blocks=16, block_len=2048)
TOKEN = b"kvd-test-token-" + b"0123456789abcdef" * 2
NOTIFY = "/kvd.v1.PeerService/Notify"


class Relay:
    """A host on the path at ``address``: forwards every call to ``upstream``
    (bytes, the ``x-kvd-*`` metadata both ways) and, while ``tamper`` is
    set, changes each HandshakeResponse's ``daemon_version``."""

    def __init__(self, port: int, upstream: str):
        self.address = f"127.0.0.1:{port}"
        self.tamper = False
        self.calls = 0
        self.channel = grpc.insecure_channel(upstream)
        relay = self

        class Forward(grpc.GenericRpcHandler):
            def service(self, details):
                md = [(k, v) for k, v in details.invocation_metadata if k.startswith("x-kvd")]

                def handle(body, context):
                    relay.calls += 1
                    try:
                        raw, call = relay.channel.unary_unary(details.method).with_call(body, metadata=md,
                                                                                         timeout=10)
                    except grpc.RpcError as e:
                        context.abort(e.code(), e.details())
                    context.send_initial_metadata(call.initial_metadata())
                    context.set_trailing_metadata(call.trailing_metadata())
                    if relay.tamper and details.method.endswith("/Handshake"):
                        answer = pb.HandshakeResponse.FromString(raw)
                        answer.daemon_version = "relayed"
                        raw = answer.SerializeToString()
                    return raw

                return grpc.unary_unary_rpc_method_handler(handle)

        self.server = grpc.server(ThreadPoolExecutor(max_workers=4), handlers=[Forward()])
        assert self.server.add_insecure_port(self.address) == port
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=0.5).wait()
        self.channel.close()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mac")
    token = tmp / "token"
    token.write_bytes(TOKEN + b"\n")
    tok = ("--peer-token-file", str(token))
    relay_port = free_port()
    # The prefill daemon advertises the relay's address: decode daemons dial
    # the relay, which is on the path to the real daemon.
    p, d = start_daemons((str(tmp), "p", *tok, "--peer-advertise", f"127.0.0.1:{relay_port}"), (str(tmp), "d", *tok))
    listen = p.log().split("peers on ", 1)[1].split(" ", 1)[0]  # the port it bound: the relay's upstream
    relay = Relay(relay_port, listen)
    yield {"p": p, "d": d, "relay": relay, "listen": listen}
    relay.stop()
    stop_daemons([p, d])


def _call(address: str, method: str, body: bytes, metadata) -> tuple[str, str, bytes, dict]:
    ch = grpc.insecure_channel(address)
    try:
        raw, c = ch.unary_unary(method).with_call(body, metadata=metadata, timeout=10)
        return "OK", "", raw, dict(c.trailing_metadata())
    except grpc.RpcError as e:
        return e.code().name, e.details(), b"", {}
    finally:
        ch.close()


def test_a_relay_that_changes_a_handshake_answer_is_caught_and_a_faithful_one_works(env):
    p, d, relay = env["p"], env["d"], env["relay"]
    for tag, tamper in (("tampered", True), ("faithful", False)):
        relay.tamper = tamper
        calls = relay.calls
        src, dst = Engine(p, f"P-{tag}", SHAPE, seed=1), Engine(d, f"D-{tag}", SHAPE, seed=2)
        try:
            src.hold("r", [1, 2, 3])
            dst.load("l", [4, 5, 6], src, [1, 2, 3], "r", timeout_s=10)
            ev = dst.wait("l", 30)
            assert relay.calls > calls  # the handshake went through the relay
            if tamper:
                assert event_kind(ev) == "load_failed", ev
                assert "did not prove the shared peer token for this answer" in ev.load_failed.reason, ev
            else:
                assert event_kind(ev) == "recv_done" and dst.same_blocks([4, 5, 6], src, [1, 2, 3]), ev
        finally:
            src.close()
            dst.close()
    assert p.stats().daemon_version and d.stats().daemon_version


def test_a_captured_header_cannot_carry_another_body(env):
    p, listen = env["p"], env["listen"]
    address = p.peer_address  # the address the prefill daemon answers to
    auth = PeerAuth(token=TOKEN)
    e = Engine(p, "notified", SHAPE)
    try:
        e.hold("mine", [1])
        e.hold("other", [2])
        mine, other = (pb.NotifyRequest(engine_id="notified", request_id=r, expected_notifications=1)
                       .SerializeToString() for r in ("mine", "other"))
        md, proof = auth.call_metadata(NOTIFY, address, mine)
        code, msg, _, _ = _call(listen, NOTIFY, other, md)  # a relay swaps the body under the header
        assert code == "UNAUTHENTICATED" and "message was changed" in msg, (code, msg)
        md, proof = auth.call_metadata(NOTIFY, address, mine)
        code, msg, raw, trailing = _call(listen, NOTIFY, mine, md)
        assert code == "OK", (code, msg)
        auth.check_proof(trailing.items(), proof, raw)  # the answer is signed over its bytes, for this call
        with pytest.raises(PeerAuthError, match="for this answer"):
            auth.check_proof(trailing.items(), proof, raw + b"\x08\x01")
        # Only the notified request's lease ended; the swapped-in one is still held.
        ev = e.wait("mine")
        assert event_kind(ev) == "send_done" and not ev.send_done.expired, ev
        assert e.take_any(0.5) is None
    finally:
        e.close()
    assert p.stats().daemon_version


def test_an_old_v1_header_is_refused_naming_the_version(env):
    p, listen = env["p"], env["listen"]
    body = pb.HandshakeRequest(engine_id="nobody-here", protocol_version=PROTOCOL_VERSION).SerializeToString()
    ts, nonce = str(int(time.time())), "ab" * 16
    fields = ("kvd-peer-call", "/kvd.v1.PeerService/Handshake", p.peer_address, ts, nonce)
    mac = hmac.new(TOKEN, "\n".join(fields).encode(), hashlib.sha256).hexdigest()  # v1: no body in the MAC
    code, msg, _, _ = _call(listen, "/kvd.v1.PeerService/Handshake", body,
                            ((HEADER, f"v1 {p.peer_address} {ts} {nonce} {mac}"),))
    assert code == "UNAUTHENTICATED" and "v1" in msg and "requires v2" in msg and "upgrade" in msg, (code, msg)


def test_the_replay_window_refuses_new_calls_rather_than_forget_a_live_nonce(monkeypatch):
    now = [1_000_000.0]
    monkeypatch.setattr(peer_auth.time, "time", lambda: now[0])
    client, server = PeerAuth(token=TOKEN), PeerAuth(token=TOKEN, max_nonces=3)
    addresses = {"10.0.0.5:7700"}

    def call():
        md, _ = client.call_metadata(NOTIFY, "10.0.0.5:7700", b"body")
        return lambda: server.check_call(NOTIFY, md, addresses, b"body")

    first, *more = [call() for _ in range(3)]
    first()
    for c in more:
        c()
    with pytest.raises(ReplayWindowFull):
        call()()                      # a fourth live nonce: refused...
    with pytest.raises(PeerAuthError, match="replayed"):
        first()                       # ...and the first is still remembered
    now[0] += 2 * peer_auth.WINDOW_S - 1
    with pytest.raises(PeerAuthError, match="replayed|too old"):
        first()                       # a header that can still pass the time check is never forgotten
    now[0] += 2
    call()()                          # once they could not pass it any more, room again
