"""Push mode hands the source this worker's NIXL agent metadata only after
the callee proved itself.

A decode daemon in push mode sends ``PushRequest.reader`` (its worker's
agent metadata and region addresses: what a NIXL agent needs to READ and
WRITE that worker's memory) to the address a load's ``kv_transfer_params``
name, an API client's input. An attacker review had a server with no token
(and, with no credential configured, any listener) receive it, then read
and overwrite the decode engine's blocks with its own NIXL agent. Now
(``kvd.daemon.peer_client.PeerClient.push``): with a token, a Handshake
whose answer carries the callee's proof comes first; with no credential,
the address must be a listener of this host run by root or the daemon's
uid (``kvd.daemon.peer_local.dial_address``), and the push is sent to
the IP that was checked, not to the name again.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
from concurrent import futures

import grpc
import pytest

from kvd.daemon.peer_local import DialRefused, listener_owners, dial_address
from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import Engine, KvShape, event_kind
from kvd.testing.util import peer_token_file

SHAPE = KvShape(num_layers=1, num_blocks=16, block_len=4096)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a listener as another user")


class _Recorder(grpc.GenericRpcHandler):
    """A PeerService impostor: records every method called and fails it."""

    def __init__(self):
        self.methods: list[str] = []

    def service(self, details):
        self.methods.append(details.method)

        def fail(_request, context):
            context.abort(grpc.StatusCode.UNAVAILABLE, "busy")

        return grpc.unary_unary_rpc_method_handler(fail)


def _token(tmp_path, name: str, text: str) -> str:
    return peer_token_file(tmp_path, text, name)


def test_with_a_token_no_push_reaches_a_callee_that_cannot_prove_it(tmp_path):
    """The impostor (no token) is asked a Handshake, cannot prove the token
    in its answer, and never gets the Push that carries the metadata."""
    rec = _Recorder()
    srv = grpc.server(futures.ThreadPoolExecutor(2), handlers=[rec])
    port = srv.add_insecure_port("127.0.0.2:0")
    srv.start()
    d = start_daemon(str(tmp_path), "decode", "--transfer-mode", "push",
                     "--peer-token-file", _token(tmp_path, "token", "t" * 40))
    dec = None
    try:
        dec = Engine(d, "dec", SHAPE, memfd=True)
        dec.load("api-req", [1], None, [1], "p-req", remote_engine_id="p", remote_address=f"127.0.0.2:{port}",
                 timeout_s=10)
        ev = dec.wait("api-req", 30)
        assert event_kind(ev) == "load_failed" and ev.load_failed.reason.startswith("push:"), ev
        assert "/kvd.v1.PeerService/Push" not in rec.methods, rec.methods
        assert rec.methods and set(rec.methods) == {"/kvd.v1.PeerService/Handshake"}, rec.methods
    finally:
        if dec is not None:
            dec.close()
        srv.stop(0)
        assert d.stop() == 0


def test_with_a_token_an_honest_push_moves_the_blocks(tmp_path):
    tok = _token(tmp_path, "token", "s" * 40)
    p = start_daemon(str(tmp_path), "prefill", "--peer-token-file", tok)
    d = start_daemon(str(tmp_path), "decode", "--transfer-mode", "push", "--peer-token-file", tok)
    src = dec = None
    try:
        src, dec = Engine(p, "src", SHAPE, seed=5), Engine(d, "dec", SHAPE)
        src.hold("r1", [3, 4])
        dec.load("r1", [6, 7], src, [3, 4], "r1", timeout_s=20)
        ev = dec.wait("r1", 30)
        assert event_kind(ev) == "recv_done", ev
        assert dec.same_blocks([6, 7], src, [3, 4])
    finally:
        for e in (dec, src):
            if e is not None:
                e.close()
        assert d.stop() == 0 and p.stop() == 0


@needs_root
def test_with_no_credential_no_push_goes_to_another_users_listener(tmp_path):
    """No credential (the loopback default): the impostor is another local
    user's listener. The daemon does not connect to it at all."""
    from kvd.testing.security import COUNTING_LISTENER, NOBODY

    lis = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
                            "-I", "-c", COUNTING_LISTENER, "tcp", "127.0.0.2"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    d = start_daemon(str(tmp_path), "decode", "--transfer-mode", "push")
    dec = None
    try:
        port = json.loads(lis.stdout.readline())["port"]
        dec = Engine(d, "dec", SHAPE, memfd=True)
        dec.load("api-req", [1], None, [1], "p-req", remote_engine_id="p", remote_address=f"127.0.0.2:{port}",
                 timeout_s=10)
        ev = dec.wait("api-req", 30)
        assert event_kind(ev) == "load_failed", ev
        assert f"served by uid {NOBODY}" in ev.load_failed.reason, ev.load_failed.reason
        lis.stdin.write("\n")
        lis.stdin.flush()
        assert json.loads(lis.stdout.readline()) == {"connections": 0, "bytes": 0}
    finally:
        if dec is not None:
            dec.close()
        if lis.poll() is None:
            lis.kill()
        lis.wait()
        assert d.stop() == 0


def _refusal(address: str, insecure: bool = False, uid: int | None = None) -> str | None:
    try:
        dial_address(address, insecure, uid)
    except DialRefused as e:
        return str(e)
    return None


def test_the_callee_check_without_a_credential():
    """Unit: what :func:`dial_address` admits and dials (its sock_diag
    and /proc lookups are real)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert listener_owners(ipaddress.ip_address("127.0.0.1"), port) == [os.geteuid()]
        assert dial_address(f"127.0.0.1:{port}", insecure=False) == f"127.0.0.1:{port}"
        # A name is dialed as the IP checked, never resolved again by gRPC's
        # own resolver (which answered ::1 first for localhost: attacker review).
        assert dial_address(f"localhost:{port}", insecure=False) == f"127.0.0.1:{port}"
        # Another uid's: as if the daemon ran as someone else.
        other = os.geteuid() + 1
        why = _refusal(f"127.0.0.1:{port}", uid=other)
        assert (why is None) == (os.geteuid() == 0), why  # root's listener is admitted for any daemon
        if why is not None:
            assert f"served by uid {os.geteuid()}" in why
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]  # bound, not listening
        assert _refusal(f"127.0.0.1:{free}") == f"nothing listens on 127.0.0.1:{free}"
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never this host's.
    assert "not an address of this host" in _refusal("192.0.2.7:5000")
    assert dial_address("192.0.2.7:5000", insecure=True) == "192.0.2.7:5000"
    # A wildcard dials this host, whatever listens there: never, even with peer_insecure.
    for wildcard in ("0.0.0.0:5000", "[::]:5000", "[::ffff:0.0.0.0]:5000"):
        assert "is a bind address" in _refusal(wildcard, insecure=True), wildcard
    assert "is not host:port" in _refusal("nohost")


def test_a_push_naming_a_wildcard_address_is_refused_in_every_mode(tmp_path):
    """``0.0.0.0:P`` reaches this host: with a token, a local user holding
    port P could relay the Handshake and the Push to a source that took its
    own wildcard bind address for the address it was dialed by (attacker
    review). The decode side never dials it; the source no longer accepts a
    token proof made out to it."""
    d = start_daemon(str(tmp_path), "decode", "--transfer-mode", "push",
                     "--peer-token-file", _token(tmp_path, "token", "w" * 40))
    dec = None
    try:
        dec = Engine(d, "dec", SHAPE)
        for i, host in enumerate(("0.0.0.0", "[::]", "[::ffff:0.0.0.0]", "0")):
            dec.load(f"api-{i}", [1], None, [1], "p-req", remote_engine_id="p", remote_address=f"{host}:7700",
                     timeout_s=10)
            ev = dec.wait(f"api-{i}", 30)
            assert event_kind(ev) == "load_failed" and "is a bind address" in ev.load_failed.reason, (host, ev)
    finally:
        if dec is not None:
            dec.close()
        assert d.stop() == 0


def test_a_source_bound_to_a_wildcard_takes_no_token_proof_made_out_to_it(tmp_path):
    """The callee's own addresses for token proofs: its advertised address
    and a listen address that is not a wildcard."""
    from kvd.daemon.peer_auth import PeerAuth
    from kvd.daemon.peer_client import PeerClient
    from kvd.testing.util import free_port

    tok = "v" * 40
    port = free_port()
    p = start_daemon(str(tmp_path), "prefill", "--peer-token-file", _token(tmp_path, "token", tok),
                     "--peer-listen", f"0.0.0.0:{port}", "--peer-advertise", f"127.0.0.1:{port}")
    src = None
    try:
        src = Engine(p, "src", SHAPE)
        import asyncio

        from kvd.core import events as ev

        async def handshake(address: str):
            client = PeerClient(PeerAuth(token=tok.encode()))
            try:
                return await client.handshake(address, "src", 0, "", 10)
            finally:
                await client.close()

        assert asyncio.run(handshake(f"127.0.0.1:{port}")).agent_name
        with pytest.raises(ev.PeerUnavailable, match="UNAUTHENTICATED"):
            asyncio.run(handshake(f"0.0.0.0:{port}"))
    finally:
        if src is not None:
            src.close()
        assert p.stop() == 0
