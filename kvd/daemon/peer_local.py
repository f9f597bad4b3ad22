"""Who may call PeerService from this host when no peer credential is configured.

With neither mutual TLS nor a token (the default), PeerService listens on
loopback only (kvd/daemon/server.py), but every local user can reach
loopback, and a handshake's answer (NIXL agent metadata, region addresses)
is what a NIXL agent needs to READ or WRITE the registered memory. So a
caller whose TCP socket is on this host is admitted only when that socket
belongs to root or to the daemon's own uid: two daemons of one user on one
node (the demo, the tests) still talk, another user's process or daemon gets
UNAUTHENTICATED. A caller from an address that is not this host's is on
another host (possible only with ``peer_insecure``, which trusts every host
that reaches the port) and is admitted as before; a caller of this host
whose socket is not found is refused (it is gone, or in another network
namespace).

The owner is the socket's ``sk_uid``: the effective uid that created it,
mapped into the daemon's user namespace. It is looked up by the caller's
side of the connection (local = the caller's ``ip:port``, remote = this
daemon's port), ESTABLISHED only (a TIME_WAIT entry reports uid 0):

- first with an exact ``SOCK_DIAG_BY_FAMILY`` request over netlink
  (sock_diag(7), ``inet_diag_req_v2`` with the full 4-tuple: one hash lookup
  in the kernel, ~0.1 ms here), for each address the caller may have dialed
  (this daemon's listen and advertised IPs, the caller's own, loopback);
- else by reading ``/proc/net/tcp`` and ``/proc/net/tcp6``
  (proc_net_tcp: the ``uid`` column), which finds any address but costs
  the walk of the kernel's whole socket hash (measured here: 6-8 ms per
  file with 40 sockets open).

Every call is checked: a connection's port may be reused by another process
once it closes.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import struct

import grpc

from kvd.addresses import split_host_port
from kvd.core.own_addresses import is_host_address
from kvd.daemon.local_gate import wrap_handler
from kvd.daemon.logs import Throttled

log = logging.getLogger("kvd.peer")

PEER_SERVICE_PREFIX = "/kvd.v1.PeerService/"
TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
TCP_ESTABLISHED = 1  # include/net/tcp_states.h
# linux/sock_diag.h, linux/inet_diag.h
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
INET_DIAG_NOCOOKIE = 0xFFFFFFFF

IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_peer(peer: str) -> tuple[IP, int] | None:
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


def _v4(ip: IP) -> ipaddress.IPv4Address | None:
    """``ip`` as IPv4 (itself, or the address an IPv4-mapped one maps), else None."""
    if isinstance(ip, ipaddress.IPv4Address):
        return ip
    return ip.ipv4_mapped


def _diag(family: int, src: IP, sport: int, dst: IP, dport: int) -> tuple[int, int] | None:
    """``(state, uid)`` of the TCP socket whose local end is ``src:sport``
    and remote end ``dst:dport`` (an exact sock_diag lookup), or None when
    there is none. Raises OSError when netlink sock_diag cannot be used."""
    def addr(ip: IP) -> bytes:
        return ip.packed.ljust(16, b"\0")

    sockid = struct.pack("!HH16s16s", sport, dport, addr(src), addr(dst))
    sockid += struct.pack("=III", 0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)  # any interface, no cookie
    req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    msg = struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + req
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as s:
        s.settimeout(1.0)
        s.send(msg)
        data = s.recv(1 << 16)
    if len(data) < 20:
        raise OSError(errno.EPROTO, "short sock_diag answer")
    (kind,) = struct.unpack_from("=H", data, 4)
    if kind != SOCK_DIAG_BY_FAMILY:  # NLMSG_ERROR: ENOENT when no such socket
        (err,) = struct.unpack_from("=i", data, 16)
        if err == -errno.ENOENT:
            return None
        raise OSError(-err, os.strerror(-err))
    # inet_diag_msg: family, state, timer, retrans, sockid (48 bytes), expires, rqueue, wqueue, uid, inode
    (state,) = struct.unpack_from("=B", data, 17)
    (uid,) = struct.unpack_from("=I", data, 16 + 4 + 48 + 12)
    return state, uid


def _proc_owners(ip: IP, port: int, server_port: int, tables=TCP_TABLES) -> list[int] | None:
    """Uids of the ESTABLISHED sockets whose local end is ``ip:port`` and
    whose remote port is ``server_port``, from /proc/net/tcp{,6}; None when
    neither table can be read."""
    v4 = _v4(ip)
    words = [("%08X" % struct.unpack("=I", v4.packed)) if v4 else None,
             "".join("%08X" % w for w in struct.unpack(
                 "=4I", (ipaddress.IPv6Address(f"::ffff:{v4}") if v4 else ip).packed))]
    wanted = {f"{w}:{port:04X}" for w in words if w}
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
            parts = line.split()  # sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
            if (len(parts) >= 8 and parts[1] in wanted and int(parts[3], 16) == TCP_ESTABLISHED
                    and int(parts[2].rpartition(":")[2], 16) == server_port):
                owners.append(int(parts[7]))
    return owners if read_any else None


def socket_owners(ip: IP, port: int, server_port: int, server_ips=()) -> list[int] | None:
    """Uids of the caller's socket(s) on this host: local end ``ip:port``,
    remote end this daemon's ``server_port`` on one of ``server_ips`` (the
    addresses it may have been dialed at; the caller's own address and
    loopback are tried too). ``[]`` when none is found; None when neither
    sock_diag nor /proc can be read."""
    v4 = _v4(ip)
    loop = [ipaddress.ip_address("127.0.0.1")] if v4 else [ipaddress.ip_address("::1")]
    dsts = list(dict.fromkeys([*server_ips, ip, *loop]))
    try:
        for dst in dsts:
            dst4 = _v4(dst)
            if v4 and dst4:  # IPv4, or an IPv4-mapped socket: found by its IPv4 4-tuple
                found = _diag(socket.AF_INET, v4, port, dst4, server_port)
            elif not v4 and not dst4:
                found = _diag(socket.AF_INET6, ip, port, dst, server_port)
            else:
                continue
            if found is not None and found[0] == TCP_ESTABLISHED:
                return [found[1]]
    except OSError as e:
        log.debug("sock_diag lookup failed (%s); reading /proc/net/tcp", e)
    return _proc_owners(ip, port, server_port)


class LocalPeerGate(grpc.aio.ServerInterceptor):
    """Refuses PeerService calls from sockets of this host that belong to
    neither root nor the daemon's uid (UNAUTHENTICATED); health and
    reflection pass (probes). Installed only when no peer credential is
    configured (kvd/daemon/server.py).

    Args:
        port: returns the peer port this daemon bound (a callable: known after bind).
        addresses: returns the ``host:port`` names it is bound and advertised at.
        uid: the daemon's uid (default: its effective uid).
    """

    def __init__(self, port, addresses=lambda: (), uid: int | None = None):
        self.port = port
        self.addresses = addresses
        self.uid = os.geteuid() if uid is None else uid
        self.admitted = {0, self.uid}
        self._refused = Throttled(log)

    def _server_ips(self) -> list[IP]:
        ips = []
        for a in self.addresses():
            try:
                ip = ipaddress.ip_address(split_host_port(a)[0])
            except ValueError:
                continue
            if not ip.is_unspecified:
                ips.append(ip)
        return ips

    def refusal(self, peer: str) -> str | None:
        """Why a call from gRPC peer ``peer`` is refused, or None to admit it."""
        parsed = parse_peer(peer)
        if parsed is None:
            return f"peer {peer!r} is not a TCP address"
        ip, port = parsed
        plain = _v4(ip) or ip
        if not plain.is_loopback and not is_host_address(plain):
            return None  # another host: only with peer_insecure, which admits every host
        owners = socket_owners(ip, port, self.port(), self._server_ips())
        if owners is None:
            return "cannot tell which user called (no sock_diag, no /proc/net/tcp)"
        if not owners:
            return f"no socket of this host is {peer}"
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
