"""Who owns a loopback caller's socket (kvd.daemon.peer_local): real TCP
sockets, the owner read from /proc/net/tcp{,6} as the daemon reads it."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys

import pytest

from kvd.daemon.peer_local import LocalPeerGate, _proc_owners, parse_peer, socket_owners
from kvd.testing.security import NOBODY


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
        assert socket_owners(ip, port, server_port) == [os.geteuid()]
        assert _proc_owners(ip, port, server_port) == [os.geteuid()]  # the fallback agrees
        # Only sockets connected to the daemon's port count.
        assert socket_owners(ip, port, server_port ^ 1) == []
        gate = LocalPeerGate(lambda: server_port)
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
            assert socket_owners(ipaddress.ip_address("127.0.0.1"), port, srv.getsockname()[1]) == [NOBODY]
            why = LocalPeerGate(lambda: srv.getsockname()[1]).refusal(f"ipv4:127.0.0.1:{port}")
            assert why and f"uid {NOBODY}" in why and "peer_token_file" in why
            # The daemon's uid is admitted: a daemon of that user may call.
            assert LocalPeerGate(lambda: srv.getsockname()[1], uid=NOBODY).refusal(f"ipv4:127.0.0.1:{port}") is None
        finally:
            p.stdin.close()
            p.wait(10)


def test_a_caller_from_another_host_is_not_looked_up_as_local():
    # peer_insecure: remote hosts stay admitted (no credential configured means every host is trusted).
    assert LocalPeerGate(lambda: 7700).refusal("ipv4:192.0.2.7:40000") is None


def test_a_caller_that_dialed_an_address_no_lookup_guesses_is_found_all_the_same():
    """A wildcard listener dialed at 127.0.0.5: the caller's side is
    127.0.0.1 -> 127.0.0.5, which the exact lookups (listen IPs, the caller's
    own, loopback) miss; /proc/net/tcp finds it."""
    with socket.create_server(("0.0.0.0", 0)) as srv, socket.create_connection(("127.0.0.5", srv.getsockname()[1])) as c:
        ip, port = c.getsockname()
        assert socket_owners(ipaddress.ip_address(ip), port, srv.getsockname()[1]) == [os.geteuid()]
