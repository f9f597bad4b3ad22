"""Who owns a loopback caller's socket (kvd.daemon.peer_local): real TCP
sockets, the owner read by sock_diag and from /proc/net/tcp{,6} as the
daemon reads it."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys

import pytest

from kvd.core.own_addresses import OwnAddresses
from kvd.daemon.peer_local import LocalPeerGate, _proc_sockets, held_by, parse_peer, socket_owners
from kvd.testing.security import NOBODY


def listener(host: str, port: int) -> OwnAddresses:
    """What the daemon knows of its PeerService listener bound to ``host:port``."""
    own = OwnAddresses()
    own.listening(host, port)
    return own


def owners_by_proc(ip: str, port: int, own: OwnAddresses) -> list[int]:
    """socket_owners' answer from /proc/net/tcp{,6}, its fallback."""
    return held_by(_proc_sockets(port, own.port), ipaddress.ip_address(ip), own)


@pytest.mark.parametrize("peer, want", [
    ("ipv4:127.0.0.1:5000", ("127.0.0.1", 5000)),
    ("ipv6:[::1]:5001", ("::1", 5001)),
    ("ipv6:%5B::ffff:127.0.0.1%5D:5002", ("::ffff:127.0.0.1", 5002)),
    ("unix:/run/kvd/engine.sock", None),
    ("ipv4:not-an-ip:1", None),
])
def test_grpc_peer_strings_are_parsed(peer, want):
    got = parse_peer(peer)
    assert got == (None if want is None else (ipaddress.ip_address(want[0]), want[1]))


@pytest.mark.parametrize("family, host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_the_owner_of_a_connected_socket_is_the_uid_that_made_it(family, host):
    try:
        srv = socket.create_server((host, 0), family=family)
    except OSError as e:
        pytest.skip(f"no {host}: {e}")
    server_port = srv.getsockname()[1]
    with srv, socket.create_connection(srv.getsockname()[:2]) as c:
        ip = ipaddress.ip_address(host)
        port = c.getsockname()[1]
        peer = f"ipv4:{host}:{port}" if family == socket.AF_INET else f"ipv6:[{host}]:{port}"
        own = listener(host, server_port)
        assert socket_owners(ip, port, own) == [os.geteuid()]
        assert owners_by_proc(host, port, own) == [os.geteuid()]  # the fallback agrees
        # Only sockets connected to the daemon's listener count.
        assert socket_owners(ip, port, listener(host, server_port ^ 1)) == []
        gate = LocalPeerGate(own)
        assert gate.refusal(peer) is None
    # Gone (closed, or TIME_WAIT, which /proc prints as uid 0): a loopback caller not found is refused.
    assert "no socket" in gate.refusal(peer)


_CONNECT_AS = r"""
import os, socket, sys
port, uid = int(sys.argv[1]), int(sys.argv[2])
"x".encode("idna")  # loaded while root: as another user this interpreter's files may be unreadable
os.setgroups([]); os.setgid(uid); os.setuid(uid)
c = socket.create_connection(("127.0.0.1", port))
print(c.getsockname()[1], flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_a_socket_of_another_uid_is_refused_and_named():
    with socket.create_server(("127.0.0.1", 0)) as srv:
        p = subprocess.Popen([sys.executable, "-c", _CONNECT_AS, str(srv.getsockname()[1]), str(NOBODY)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            port = int(p.stdout.readline())
            own = listener("127.0.0.1", srv.getsockname()[1])
            assert socket_owners(ipaddress.ip_address("127.0.0.1"), port, own) == [NOBODY]
            why = LocalPeerGate(own).refusal(f"ipv4:127.0.0.1:{port}")
            assert why and f"uid {NOBODY}" in why and "peer_token_file" in why
            # The daemon's uid is admitted: a daemon of that user may call.
            assert LocalPeerGate(own, uid=NOBODY).refusal(f"ipv4:127.0.0.1:{port}") is None
        finally:
            p.stdin.close()
            p.wait(10)


def test_a_caller_from_another_host_is_not_looked_up_as_local():
    # peer_insecure: remote hosts stay admitted (no credential configured means every host is trusted).
    assert LocalPeerGate(listener("0.0.0.0", 7700)).refusal("ipv4:192.0.2.7:40000") is None


def test_a_caller_that_dialed_any_loopback_address_of_a_wildcard_listener_is_found():
    """A wildcard listener dialed at 127.0.0.5 (any of 127/8 reaches it):
    the caller's side is 127.0.0.1 -> 127.0.0.5, found by the dump."""
    with socket.create_server(("0.0.0.0", 0)) as srv, socket.create_connection(("127.0.0.5", srv.getsockname()[1])) as c:
        ip, port = c.getsockname()
        own = listener("0.0.0.0", srv.getsockname()[1])
        assert socket_owners(ipaddress.ip_address(ip), port, own) == [os.geteuid()]
        assert owners_by_proc(ip, port, own) == [os.geteuid()]
        # A listener on one IP is reached at that IP only: this socket is not its caller.
        assert socket_owners(ipaddress.ip_address(ip), port, listener("127.0.0.1", own.port)) == []


def _sharing(port: int, dst: str, server_port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.connect((dst, server_port))
    return s


def test_every_socket_sharing_the_callers_address_and_port_counts_on_a_wildcard_listener():
    """Two sockets bound to one 127.0.0.1 port (SO_REUSEADDR, as gRPC's
    client sockets) dial the wildcard listener at two addresses: gRPC tells
    only the caller's ``ip:port``, so both owners count (with another
    user's among them the call is refused: test_security_attack2)."""
    with socket.create_server(("0.0.0.0", 0)) as srv:
        server_port = srv.getsockname()[1]
        with _sharing(0, "127.0.0.1", server_port) as a:
            port = a.getsockname()[1]
            try:
                b = _sharing(port, "127.0.0.2", server_port)
            except OSError as e:
                pytest.skip(f"cannot share the port here: {e}")
            with b:
                own = listener("0.0.0.0", server_port)
                ip = ipaddress.ip_address("127.0.0.1")
                assert socket_owners(ip, port, own) == [os.geteuid()] * 2
                assert owners_by_proc("127.0.0.1", port, own) == [os.geteuid()] * 2
                # A listener on 127.0.0.1 is reached by one of them only: the exact 4-tuple.
                assert socket_owners(ip, port, listener("127.0.0.1", server_port)) == [os.geteuid()]


def test_a_dual_stack_socket_as_grpc_makes_is_found_on_a_listener_of_one_ipv4_address():
    """gRPC's client sockets are IPv6 ones with IPv4-mapped addresses: the
    exact IPv4 lookup finds them, and sock_diag answers in IPv6 form."""
    with socket.create_server(("127.0.0.1", 0)) as srv, socket.socket(socket.AF_INET6) as c:
        try:
            c.connect(("::ffff:127.0.0.1", srv.getsockname()[1]))
        except OSError as e:
            pytest.skip(f"no dual-stack sockets here: {e}")
        port = c.getsockname()[1]
        own = listener("127.0.0.1", srv.getsockname()[1])
        for ip in ("127.0.0.1", "::ffff:127.0.0.1"):  # as gRPC's peer string may spell it
            assert socket_owners(ipaddress.ip_address(ip), port, own) == [os.geteuid()]
        assert owners_by_proc("127.0.0.1", port, own) == [os.geteuid()]


def test_a_localhost_listener_is_reached_on_both_loopbacks():
    """gRPC binds every address ``localhost`` resolves to: a caller on
    ``::1`` reaches a ``localhost`` listener as one on 127.0.0.1 does."""
    try:
        srv = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError as e:
        pytest.skip(f"no ::1: {e}")
    with srv, socket.create_connection(("::1", srv.getsockname()[1])) as c:
        own = listener("localhost", srv.getsockname()[1])
        assert own.accepts(ipaddress.ip_address("::1")) and own.accepts(ipaddress.ip_address("127.0.0.1"))
        assert socket_owners(ipaddress.ip_address("::1"), c.getsockname()[1], own) == [os.geteuid()]
        assert socket_owners(ipaddress.ip_address("::1"), c.getsockname()[1], listener("127.0.0.1", own.port)) == []
