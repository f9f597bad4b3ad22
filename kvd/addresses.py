"""``host:port`` addresses (and Unix socket names): the one parser and joiner every layer uses.

A neutral leaf (imports nothing of kvd's): the daemon's settings
(``kvd.config``: ``peer_listen``, ``peer_advertise``, ``warm_peers``) and the
engine shim (``kvd.shim.vllm``: ``kvd_peer_address``, P's
``kv_transfer_params``) read addresses with the same rules. An IPv6 host is
written in brackets (``[::1]:7700``, RFC 3986 section 3.2.2), as gRPC
targets spell it.
"""

from __future__ import annotations

import ipaddress
import socket


def _quoted(text: str, limit: int = 200) -> str:
    """``repr(text)``, cut at ``limit`` characters with the length it had: a
    100,000-character value was quoted whole in its error (attacker review).
    ``kvd.logtext.clip``'s rule, written here: this leaf imports nothing of kvd's."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}...({len(text)} characters)"


def split_host_port(address: str, key: str = "address", *, min_port: int = 0) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``, brackets removed.

    Args:
        address: the text to parse.
        key: what the address is (a setting's name), first in every message.
        min_port: lowest port accepted: 0 where 0 means "any free port" (a
            listen address), 1 for an address to dial.

    Raises:
        ValueError: no host or no ``:port``, a port that is not a decimal
            number, or one outside ``min_port..65535``; the message starts
            with ``key``.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{key}: expected host:port, got {_quoted(address)}")
    if not (port.isascii() and port.isdigit()):
        raise ValueError(f"{key}: port {_quoted(port)} is not a number")
    p = int(port)
    if not min_port <= p <= 65535:
        raise ValueError(f"{key}: port {p} out of range {min_port}..65535")
    return host.strip("[]"), p


def join_host_port(host: str, port: int | str) -> str:
    """``(host, port)`` -> ``"host:port"``, brackets around an IPv6 host."""
    host = str(host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{int(port)}"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def metrics_url(address: str) -> str:
    """The metrics URL for the bound ``host:port`` ``address``; for a
    wildcard host (``0.0.0.0``, ``::``), which is no address to fetch from,
    the URL with ``<this host>`` and what it is bound to (a new user tried
    ``curl http://0.0.0.0:9400/metrics`` from another machine)."""
    host, _, port = address.rpartition(":")
    if host.strip("[]") in ("0.0.0.0", "::", ""):
        return f"http://<this host>:{port}/metrics (every address, bound to {address})"
    return f"http://{address}/metrics"


def ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP a literal ``host`` names (brackets and an IPv6 zone dropped;
    the short IPv4 forms the C resolver takes, ``127.1``, ``0``, too), or
    None for a host name."""
    host = host.strip("[]").split("%")[0]
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def is_wildcard(host: str) -> bool:
    """True for a wildcard IP in any form (``0.0.0.0``, ``::``,
    ``::ffff:0.0.0.0``, ``0``): a bind address, which dialed reaches this
    host, whatever listens there."""
    ip = ip_of(host)
    if ip is None:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_unspecified or (mapped is not None and mapped.is_unspecified)


def socket_file(text: str) -> str:
    """The file of a Unix socket named as a path, ``unix:PATH`` or
    ``unix://PATH`` (gRPC's forms, which ``kvd health`` prints and the
    connector's ``kvd_socket`` takes): ``unix:///run/kvd/engine.sock`` ->
    ``/run/kvd/engine.sock``; a path is returned as it is."""
    for prefix in ("unix://", "unix:"):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text
