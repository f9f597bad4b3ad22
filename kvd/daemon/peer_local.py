"""Who may call PeerService from this host when no peer credential is configured.

With neither mutual TLS nor a token (the default), PeerService listens on
loopback only (kvd/daemon/server.py), but every local user can reach
loopback, and a handshake's answer (NIXL agent metadata, region addresses)
is what a NIXL agent needs to READ or WRITE the registered memory. So a
caller whose TCP socket is on this host (found in this network namespace's
``/proc/net/tcp`` or ``/proc/net/tcp6``) is admitted only when that socket
belongs to root or to the daemon's own uid: two daemons of one user on one
node (the demo, the tests) still talk, another user's process or daemon gets
UNAUTHENTICATED. A caller not found there is on another host (possible only
with ``peer_insecure``, which trusts every host that reaches the port) and
is admitted as before; one from a loopback address that is not found is
refused (its socket is gone, or it is not on this host's loopback).

The owner is the socket's ``sk_uid`` as ``/proc/net/tcp`` prints it
(proc_net_tcp(7): the ``uid`` column, the effective uid that created the
socket, mapped into the reader's user namespace). Only ESTABLISHED rows
count: a TIME_WAIT row prints uid 0. Every call is checked (a connection's
port may be reused by another process once it closes); a lookup reads both
files, about 150 bytes per socket on the host.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import struct

import grpc

from kvd.daemon.local_gate import wrap_handler
from kvd.daemon.logs import Throttled

log = logging.getLogger("kvd.peer")

PEER_SERVICE_PREFIX = "/kvd.v1.PeerService/"
TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
ESTABLISHED = "01"  # TCP_ESTABLISHED in include/net/tcp_states.h, as /proc/net/tcp prints it


def parse_peer(peer: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int] | None:
    """``(ip, port)`` of a gRPC peer string (``ipv4:127.0.0.1:5000``,
    ``ipv6:[::1]:5000``, ``ipv6:%5B::1%5D:5000``); None for anything else
    (``unix:``)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.replace("%5B", "[").replace("%5D", "]").rpartition(":")
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0]), int(port)
    except ValueError:
        return None


def _hex_forms(ip, port: int) -> list[str]:
    """How ``ip:port`` appears in /proc/net/tcp (IPv4) and tcp6 (IPv6 and
    IPv4-mapped): 32-bit words in host byte order, then the port, in hex."""
    v4 = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip
    forms = []
    if isinstance(v4, ipaddress.IPv4Address):
        forms.append("%08X" % struct.unpack("=I", v4.packed))
        v6 = ipaddress.IPv6Address(f"::ffff:{v4}").packed
    else:
        v6 = ip.packed
    forms.append("".join("%08X" % w for w in struct.unpack("=4I", v6)))
    return [f"{f}:{port:04X}" for f in forms]


def socket_owners(ip, port: int, server_port: int, tables=TCP_TABLES) -> list[int] | None:
    """Uids of the ESTABLISHED sockets on this host whose local address is
    ``ip:port`` and whose remote port is ``server_port`` (the caller's side
    of a connection to this daemon). ``[]`` when none is found; None when no
    table could be read (no /proc)."""
    wanted = set(_hex_forms(ip, port))
    owners: list[int] = []
    read_any = False
    for path in tables:
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            continue
        read_any = True
        if not any(w in text for w in wanted):
            continue
        for line in text.splitlines()[1:]:
            parts = line.split()
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
            if len(parts) < 8 or parts[1] not in wanted or parts[3] != ESTABLISHED:
                continue
            if int(parts[2].rpartition(":")[2], 16) == server_port:
                owners.append(int(parts[7]))
    return owners if read_any else None


class LocalPeerGate(grpc.aio.ServerInterceptor):
    """Refuses PeerService calls from sockets of this host that belong to
    neither root nor the daemon's uid (UNAUTHENTICATED); health and
    reflection pass (probes). Installed only when no peer credential is
    configured (kvd/daemon/server.py).

    Args:
        port: returns the peer port this daemon bound (a callable: known after bind).
        uid: the daemon's uid (default: its effective uid).
    """

    def __init__(self, port, uid: int | None = None):
        self.port = port
        self.uid = os.geteuid() if uid is None else uid
        self.admitted = {0, self.uid}
        self._refused = Throttled(log)

    def refusal(self, peer: str) -> str | None:
        """Why a call from gRPC peer ``peer`` is refused, or None to admit it."""
        parsed = parse_peer(peer)
        if parsed is None:
            return f"peer {peer!r} is not a TCP address"
        ip, port = parsed
        owners = socket_owners(ip, port, self.port())
        if owners is None:
            return "cannot read /proc/net/tcp to tell which user called"
        if not owners:
            if ip.is_loopback or (isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped
                                  and ip.ipv4_mapped.is_loopback):
                return f"no socket of this host is {peer}"
            return None  # another host: only with peer_insecure, which admits every host
        foreign = sorted(set(owners) - self.admitted)
        if foreign:
            return (f"the calling socket belongs to uid {foreign[0]}; with no peer credential (peer_tls_*, "
                    f"peer_token_file) only root and the daemon's uid {self.uid} may call "
                    f"PeerService from this host")
        return None

    async def intercept_service(self, continuation, details):
        """Wraps PeerService handlers so that each first checks the caller's
        socket owner (:meth:`refusal`), aborting with UNAUTHENTICATED."""
        handler = await continuation(details)
        if handler is None or not details.method.startswith(PEER_SERVICE_PREFIX):
            return handler
        method = details.method.rsplit("/", 1)[-1]

        async def check(context) -> None:
            why = self.refusal(context.peer())
            if why:
                self._refused.warning("peer call %s from %s refused: %s", method, context.peer(), why)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"kvd: {why}")

        return wrap_handler(handler, check)

