"""Which peer addresses name this very daemon, however they are spelt.

A load's ``remote_address`` comes from ``kv_transfer_params`` (an API
request). This daemon is reached by its advertised address
(``Node.peer_address``), but also by ``localhost:PORT``,
``[::ffff:127.0.0.1]:PORT``, ``0.0.0.0:PORT`` or, when it listens on a
wildcard, any address of this host with its port. A load naming it by another
spelling must still be a same-node load (the same-node rules:
``kvd.core.local_copy``, and a claim answered by this daemon's own holds,
``kvd.core.holds``), so the address is resolved to this daemon's listener
first (:meth:`OwnAddresses.canonical`) and replaced by the advertised one.

An address counts as this daemon's when its port is the port PeerService
bound and one of the IPs its host resolves to is accepted by that listener:
the listen IP itself, or, for a wildcard listener, a loopback IP or an IP of
this host (the kernel's route to it leaves from that very address). Linux
routes a connection to the unspecified address (``0.0.0.0``, ``::``) to
loopback, so those count as loopback. Host names are resolved off the event
loop (``getaddrinfo``, what gRPC's resolver asks too), within
:data:`RESOLVE_TIMEOUT_S`; a name that does not resolve in time is left as
it is (the load then dials it, and the claim is asked of whoever answers).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from kvd.addresses import split_host_port

# A name a request carries is resolved within this (seconds); gRPC would
# resolve it when dialing anyway.
RESOLVE_TIMEOUT_S = 2.0

IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def _plain(ip: IP) -> IP:
    """IPv4-mapped IPv6 as IPv4; the unspecified address as loopback."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified:
        return ipaddress.ip_address("127.0.0.1" if ip.version == 4 else "::1")
    return ip


def is_host_address(ip: IP) -> bool:
    """True when ``ip`` is an address of this host: a connected UDP socket
    (which sends nothing) to it leaves from it."""
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((str(ip), 9))
            return ipaddress.ip_address(s.getsockname()[0].split("%")[0]) == ip
    except OSError:
        return False


class OwnAddresses:
    """This daemon's PeerService listener, and the addresses that reach it.

    ``advertised``: the ``host:port`` put in ``kv_transfer_params``;
    :meth:`listening` records the bound host and port (the server calls it
    once bound).
    """

    def __init__(self) -> None:
        self.advertised = ""
        self.port = 0
        # The IPs a listener on one host is bound to: gRPC binds every address
        # a name resolves to, both loopbacks for ``localhost``.
        self.listen_ips: tuple[IP, ...] = ()
        self.wildcard = False
        self.dual_stack = False

    def listening(self, host: str, port: int) -> None:
        """PeerService is bound to ``host`` (an IP, ``0.0.0.0``, ``::``,
        ``localhost``) and TCP ``port``."""
        self.port = port
        host = host.strip("[]")  # as split_host_port gives it, or a bracketed IPv6
        if host in ("", "0.0.0.0", "::"):
            self.wildcard, self.dual_stack, self.listen_ips = True, host != "0.0.0.0", ()
            return
        self.wildcard = False
        if host == "localhost":
            self.listen_ips = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))
            return
        try:
            self.listen_ips = (_plain(ipaddress.ip_address(host)),)
        except ValueError:
            self.listen_ips = ()

    def accepts(self, ip: IP) -> bool:
        """True when a connection to ``ip`` on the bound port reaches this listener."""
        ip = _plain(ip)
        if self.wildcard:
            if ip.version == 6 and not self.dual_stack:
                return False
            return ip.is_loopback or is_host_address(ip)
        return ip in self.listen_ips

    async def canonical(self, address: str) -> str:
        """``advertised`` when ``address`` reaches this daemon's PeerService,
        else ``address`` unchanged (also when it is no ``host:port``)."""
        if not address or address == self.advertised or not self.port:
            return address
        try:
            host, port = split_host_port(address)
        except ValueError:
            return address
        if port != self.port:
            return address
        try:
            ips = [ipaddress.ip_address(host.split("%")[0])]
        except ValueError:
            try:
                async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                    infos = await asyncio.get_running_loop().getaddrinfo(host, self.port, type=socket.SOCK_STREAM)
            except (OSError, TimeoutError, UnicodeError):
                return address
            ips = [ipaddress.ip_address(i[4][0].split("%")[0]) for i in infos]
        return self.advertised if any(self.accepts(ip) for ip in ips) else address
