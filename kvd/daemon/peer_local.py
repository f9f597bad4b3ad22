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
mapped into the daemon's user namespace. gRPC tells the caller's side of
the connection (its ``ip:port``) but not the address it dialed, and a
wildcard listener answers every address of this host (all of 127/8): two
sockets may share the caller's ``ip:port`` (``SO_REUSEADDR``, which gRPC
sets on its client sockets, lets another user bind a trusted socket's port)
and differ only in the destination. So every socket of this host whose
local end is the caller's ``ip:port`` and whose remote end is an address
and port this listener accepts counts, and the call is admitted only when
each of them is root's or the daemon's uid: a shared port with another
user's socket on it is refused (fail closed; the trusted socket's next
connection gets another port). Sockets no process holds any more
(TIME_WAIT, orphans: inode 0, reported as uid 0) cannot receive an answer
and do not count. They are found

- first with sock_diag(7) over netlink (``SOCK_DIAG_BY_FAMILY``,
  ``inet_diag_req_v2``): on a listener of given IPs (loopback, the default)
  an exact lookup of each 4-tuple (one hash probe in the kernel, ~0.01 ms
  here: a 4-tuple is unique); on a wildcard listener a dump of IPv4 and
  IPv6 sockets (dual-stack ones, which gRPC makes, are IPv6 with
  IPv4-mapped addresses) that the kernel filters by both ports
  (``inet_diag_dump_icsk``) but walks its whole established hash for
  (here 262,144 buckets: 3-4 ms a family, 18 under load), so it runs off
  the event loop;
- else by reading ``/proc/net/tcp`` and ``/proc/net/tcp6``
  (proc_net_tcp: the ``uid`` and ``inode`` columns), the same sockets at the
  cost of formatting the kernel's whole socket table (measured here:
  6-8 ms per file with 40 sockets open).

Every call is checked: a connection's port may be reused by another process
once it closes.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import ipaddress
import logging
import os
import socket
import struct

import grpc

from kvd.core.own_addresses import OwnAddresses, is_host_address
from kvd.daemon.call_refusal import Refused
from kvd.daemon.local_gate import wrap_handler
from kvd.daemon.logs import Throttled

log = logging.getLogger("kvd.peer")

PEER_SERVICE_PREFIX = "/kvd.v1.PeerService/"
TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
# include/net/tcp_states.h: every state of a socket a process may hold and
# read an answer on; not LISTEN, TIME_WAIT or the request sockets of a
# listener (SYN_RECV, NEW_SYN_RECV).
TCP_TIME_WAIT, TCP_SYN_RECV, TCP_LISTEN, TCP_NEW_SYN_RECV = 6, 3, 10, 12
HELD_STATES = frozenset(range(1, 13)) - {TCP_TIME_WAIT, TCP_SYN_RECV, TCP_LISTEN, TCP_NEW_SYN_RECV}
# linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_NOCOOKIE = 0xFFFFFFFF

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
# (local ip, remote ip, uid, inode) of one TCP socket, IPv4-mapped addresses as IPv4
Sock = tuple[IP, IP, int, int]


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


def _plain(ip: IP) -> IP:
    """``ip``, or the IPv4 address an IPv4-mapped one maps."""
    return ip if isinstance(ip, ipaddress.IPv4Address) else (ip.ipv4_mapped or ip)


def _sock_diag(family: int, sport: int, dport: int, src: IP | None = None, dst: IP | None = None,
               states: frozenset[int] = HELD_STATES) -> list[Sock]:
    """TCP sockets of ``family`` in this network namespace, in ``states``
    (default :data:`HELD_STATES`), whose local port is ``sport`` and remote
    port ``dport`` (0: any, for a dump): the one socket whose 4-tuple is ``src:sport -> dst:dport``
    when both addresses are given (an exact lookup: one hash probe in the
    kernel), else every one (a dump, which the kernel filters by both ports
    while walking its whole table). Raises OSError when netlink sock_diag
    cannot be used."""
    def addr(ip: IP | None) -> bytes:
        return bytes(16) if ip is None else ip.packed.ljust(16, b"\0")

    exact = src is not None and dst is not None
    sockid = struct.pack("!HH16s16s", sport, dport, addr(src), addr(dst))
    sockid += struct.pack("=III", 0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)  # any interface, no cookie
    req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, sum(1 << s for s in states)) + sockid
    flags = NLM_F_REQUEST if exact else NLM_F_REQUEST | NLM_F_DUMP
    msg = struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, flags, 1, 0) + req
    found: list[Sock] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as s:
        s.settimeout(1.0)
        s.send(msg)
        while True:
            data = s.recv(1 << 16)
            if not data:
                raise OSError(errno.EPROTO, "sock_diag answer ended early")
            off = 0
            while off + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, off)
                if length < 16:
                    raise OSError(errno.EPROTO, "malformed sock_diag answer")
                if kind == NLMSG_DONE:
                    return found
                if kind == NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", data, off + 16)
                    if err == -errno.ENOENT and exact:  # no such socket
                        return found
                    raise OSError(-err, os.strerror(-err))
                if kind == SOCK_DIAG_BY_FAMILY:
                    # inet_diag_msg: family, state, timer, retrans, sockid (sport, dport,
                    # src[16], dst[16], if, cookie[2]), expires, rqueue, wqueue, uid, inode
                    body = off + 16
                    # An IPv4 lookup also finds a dual-stack socket: an IPv6 one, IPv4-mapped addresses.
                    sock_family, state = struct.unpack_from("=BB", data, body)
                    width = 4 if sock_family == socket.AF_INET else 16
                    uid, inode = struct.unpack_from("=II", data, body + 4 + 48 + 12)
                    if state in states:  # an exact lookup answers in any state
                        found.append((_plain(ipaddress.ip_address(data[body + 8:body + 8 + width])),
                                      _plain(ipaddress.ip_address(data[body + 24:body + 24 + width])), uid, inode))
                    if exact:
                        return found
                off += (length + 3) & ~3


def _proc_sockets(port: int, server_port: int, tables=TCP_TABLES,
                  states: frozenset[int] = HELD_STATES) -> list[Sock] | None:
    """As a :func:`_sock_diag` dump, both families, from /proc/net/tcp{,6}
    (``server_port`` 0: any remote port); None when neither table can be read."""
    found: list[Sock] = []
    read_any = False
    for path in tables:
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        read_any = True
        for line in lines:
            parts = line.split()  # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if len(parts) < 10:
                continue
            (local, lport), (remote, rport) = (x.rsplit(":", 1) for x in parts[1:3])
            if int(lport, 16) != port or (server_port and int(rport, 16) != server_port) \
                    or int(parts[3], 16) not in states:
                continue
            found.append((_proc_ip(local), _proc_ip(remote), int(parts[7]), int(parts[9])))
    return found if read_any else None


def _proc_ip(word: str) -> IP:
    """An address of /proc/net/tcp{,6}: 32-bit words of the address, each printed as a host-order integer."""
    raw = bytes.fromhex(word)
    packed = b"".join(struct.pack("=I", w) for w in struct.unpack(f">{len(raw) // 4}I", raw))
    return _plain(ipaddress.ip_address(packed))


def _listener_sockets(ip: IP, port: int, own: OwnAddresses) -> list[Sock]:
    """sock_diag's sockets from ``ip:port`` to ``own``'s listener (OSError
    as :func:`_sock_diag`): exact lookups when it listens on given IPs (a
    4-tuple is unique); on a wildcard (or an unknown listen IP) every socket
    from ``ip:port`` to its port, by dumps of both families (a dual-stack
    socket, as gRPC makes, is an IPv6 one with IPv4-mapped addresses)."""
    if own.wildcard or not own.listen_ips:
        return _sock_diag(socket.AF_INET, port, own.port) + _sock_diag(socket.AF_INET6, port, own.port)
    src = _plain(ip)
    found: list[Sock] = []
    for dst in own.listen_ips:
        if src.version == dst.version:  # IPv4 here also finds an IPv4-mapped socket, by its IPv4 4-tuple
            found += _sock_diag(socket.AF_INET if src.version == 4 else socket.AF_INET6, port, own.port, src, dst)
    return found


def socket_owners(ip: IP, port: int, own: OwnAddresses) -> list[int] | None:
    """Uids of the sockets of this host a process holds whose local end is
    ``ip:port`` and whose remote end is an address ``own``'s listener
    accepts, on its port (the caller's socket is one of them; on a
    wildcard listener others may share its ``ip:port``). ``[]`` when there
    is none; None when neither sock_diag nor /proc can be read."""
    try:
        socks = _listener_sockets(ip, port, own)
    except OSError as e:
        log.debug("sock_diag lookup failed (%s); reading /proc/net/tcp", e)
        socks = _proc_sockets(port, own.port)
    return None if socks is None else held_by(socks, ip, own)


LISTENING = frozenset({TCP_LISTEN})


def listener_owners(ip: IP, port: int) -> list[int] | None:
    """Uids of this network namespace's TCP listeners that may accept a
    connection to ``ip:port``: those bound to ``ip`` itself or to a wildcard
    address (``0.0.0.0``; ``::``, which a dual-stack socket also serves IPv4
    on). ``[]`` when there is none; None when neither sock_diag nor /proc
    can be read. Counting every candidate fails closed: one of another user
    among them refuses the address (:func:`dial_address`)."""
    target = _plain(ip)
    try:
        socks = (_sock_diag(socket.AF_INET, port, 0, states=LISTENING)
                 + _sock_diag(socket.AF_INET6, port, 0, states=LISTENING))
    except OSError as e:
        log.debug("sock_diag dump of listeners failed (%s); reading /proc/net/tcp", e)
        socks = _proc_sockets(port, 0, states=LISTENING)
    if socks is None:
        return None
    return [uid for local, _, uid, _ in socks if local == target or local.is_unspecified]


class DialRefused(Exception):
    """With no peer credential, this address is not one to send a handshake
    or a push to; the message says why. ``unreachable``: nothing there to
    talk to (the name does not resolve, nothing listens), as a failed
    connection would have said."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


def dial_address(address: str, insecure: bool, uid: int | None = None) -> str:
    """The ``ip:port`` to dial for a handshake or a push to ``address``
    (``host:port``, named by a load's ``kv_transfer_params``) when no peer
    credential authenticates the callee. A push's request carries this
    daemon's worker's NIXL agent metadata and region addresses (what an
    agent needs to READ and WRITE that worker's memory); a handshake's
    answer carries the callee's, which this daemon's NIXL agent loads (and
    UCX's parser of the address in it crashed the daemon on some bytes:
    attacker review).

    As :class:`LocalPeerGate` admits callers: the first of the addresses
    ``host`` resolves to where something listens must be this host's, and
    every listener that could take a connection there
    (:func:`listener_owners`) root's or the daemon's uid (``uid``, default
    the effective one); an address of another host passes only with
    ``insecure`` (``peer_insecure``: the operator trusts every host that
    reaches the peer port, which may handshake for the same metadata). The
    caller dials the IP returned, not the name again:
    gRPC resolves names with its own resolver, which may answer otherwise
    (``localhost`` gave ``::1`` first there, and a DNS name may change
    between two lookups; attacker review). A wildcard IP (``0.0.0.0``,
    ``::``) is a bind address, never dialed. Blocking (name resolution,
    sock_diag): run it off the loop.

    Raises:
        DialRefused: the reason.
    """
    host, _, port_text = address.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        raise DialRefused(f"{address!r} is not host:port") from None
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise DialRefused(f"{host!r} does not resolve ({e})", unreachable=True) from None
    admitted = {0, os.geteuid() if uid is None else uid}
    idle: list[str] = []
    for *_, sockaddr in infos:
        ip = _plain(ipaddress.ip_address(sockaddr[0].split("%")[0]))
        if ip.is_unspecified:
            raise DialRefused(f"{ip} is a bind address, not one to dial")
        if not ip.is_loopback and not is_host_address(ip):
            if insecure:
                return _dialed(ip, port)
            raise DialRefused(f"{ip} is not an address of this host; with no peer credential (peer_tls_*, "
                              f"peer_token_file) this daemon talks only to daemons of this host (or set "
                              f"peer_insecure to trust every host)")
        owners = listener_owners(ip, port)
        if owners is None:
            raise DialRefused("cannot tell who listens there (no sock_diag, no /proc/net/tcp)")
        if not owners:
            idle.append(_dialed(ip, port))  # not dialed: the next address of the name, if any
            continue
        foreign = sorted(set(owners) - admitted)
        if foreign:
            raise DialRefused(f"{ip}:{port} is served by uid {foreign[0]}; with no peer credential (peer_tls_*, "
                              f"peer_token_file) this daemon talks only to daemons run by root or uid "
                              f"{max(admitted)}")
        return _dialed(ip, port)
    raise DialRefused(f"nothing listens on {', '.join(idle) or address}", unreachable=True)


def _dialed(ip: IP, port: int) -> str:
    """``ip:port``, brackets around an IPv6 address."""
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def held_by(socks: list[Sock], ip: IP, own: OwnAddresses) -> list[int]:
    """Uids of those of ``socks`` whose local IP is ``ip``, that a process
    still holds (inode not 0) and that reach ``own``'s listener."""
    src = _plain(ip)
    anywhere = not own.wildcard and not own.listen_ips  # a listen host name: every destination counts
    return [uid for local, dst, uid, inode in socks if local == src and inode and (anywhere or own.accepts(dst))]


async def parse_request(parse, data: bytes, context):
    """``data`` (a unary call's request bytes) parsed with the handler's
    deserializer ``parse`` (None: the bytes), once the caller has passed its
    check: gRPC would parse it before any interceptor's code runs, and a
    message of empty repeated submessages takes ~16x its bytes parsed (upb:
    24 MiB -> ~370 MiB), for a caller that is then refused. Aborts
    INVALID_ARGUMENT when ``data`` is not the method's message."""
    if parse is None:
        return data
    try:
        return parse(data)
    except Exception as e:  # google.protobuf DecodeError; what gRPC would answer INTERNAL
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"kvd: the request is not a valid message ({e})") from None


def check_then_parse(handler, check):
    """``handler`` (unary-unary) with ``await check(context)`` before its
    request is parsed (:func:`parse_request`) and its behavior runs."""
    parse, behavior = handler.request_deserializer, handler.unary_unary

    async def handle(data, context):
        await check(context)
        result = behavior(await parse_request(parse, data, context), context)
        return await result if inspect.isawaitable(result) else result

    return handler._replace(request_deserializer=None, unary_unary=handle)


class LocalPeerGate(grpc.aio.ServerInterceptor):
    """Refuses PeerService calls from sockets of this host that belong to
    neither root nor the daemon's uid (UNAUTHENTICATED); health and
    reflection pass (probes). Installed only when no peer credential is
    configured (kvd/daemon/server.py).

    Args:
        own: this daemon's listener (``Node.own``; its port and IPs are known
            once PeerService is bound).
        uid: the daemon's uid (default: its effective uid).
    """

    def __init__(self, own: OwnAddresses, uid: int | None = None):
        self.own = own
        self.uid = os.geteuid() if uid is None else uid
        self.admitted = {0, self.uid}
        self._refused = Throttled(log)

    def refusal(self, peer: str) -> str | None:
        """Why a call from gRPC peer ``peer`` is refused, or None to admit it."""
        parsed = parse_peer(peer)
        if parsed is None:
            return f"peer {peer!r} is not a TCP address"
        ip, port = parsed
        plain = _plain(ip)
        if not plain.is_loopback and not is_host_address(plain):
            return None  # another host: only with peer_insecure, which admits every host
        owners = socket_owners(ip, port, self.own)
        if owners is None:
            return "cannot tell which user called (no sock_diag, no /proc/net/tcp)"
        if not owners:
            return f"no socket of this host is {peer}"
        foreign = sorted(set(owners) - self.admitted)
        if foreign:
            shared = " (or another socket on its address and port)" if len(owners) > 1 else ""
            return (f"the calling socket{shared} belongs to uid {foreign[0]}; with no peer credential (peer_tls_*, "
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
            # A dump walks the kernel's whole socket table (3-4 ms a family
            # here, 262144 hash buckets): off the event loop.
            dump = self.own.wildcard or not self.own.listen_ips
            why = await asyncio.to_thread(self.refusal, context.peer()) if dump else self.refusal(context.peer())
            if why:
                self._refused.warning("peer call %s from %s refused: %s", method, context.peer(), why)
                raise Refused(grpc.StatusCode.UNAUTHENTICATED, f"kvd: {why}")

        if handler.request_streaming or handler.response_streaming:
            return wrap_handler(handler, check)
        return check_then_parse(handler, check)
