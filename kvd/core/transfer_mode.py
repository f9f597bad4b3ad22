"""Pull or push, per load (``Limits.transfer_mode``).

A load either READs the source's blocks (pull: the decode daemon's NIXL
agent reads) or asks the source daemon to WRITE them (push,
``kvd.core.push``). Both move the same bytes; they differ in what a dying
reader does to the source. Over UCX's TCP transport a READ is UCX's software
GET, which the source's UCX answers with sends of its own, and UCX 1.23 (in
nixl 1.5.1) crashes the source (SIGSEGV in ``uct_tcp_ep_pending_purge`` ->
``ucp_request_send_state_ff``) when the reader vanishes while those sends
wait. Measured here, 128 MiB loads: a reader daemon SIGKILLed 20 ms into a
READ killed the source in 3 of 4 runs with ``UCX_TLS=tcp`` on loopback and 4
of 4 across a veth; push mode's WRITEs (UCT's TCP PUT) 0 of 8; pull over
UCX's same-host transports (CMA) 0 of 4 (tests/test_reliability_tcp.py).

``auto`` (the default) therefore reads where UCX reads natively and pushes
where a READ would be TCP's software GET:

- ``UCX_TLS`` leaves UCX only TCP (:func:`tcp_emulated_reads`): push, every
  load (same-host daemons talk TCP too then);
- else, with no RDMA device on this host (``/sys/class/infiniband`` empty or
  missing, where the kernel lists InfiniBand, RoCE and EFA devices): pull
  from a daemon of this host (UCX's shared memory or CMA), push from any
  other (TCP is all that reaches it);
- else (an RDMA device): pull.

A source's handshake also says how a READ from it travels, by its own
``UCX_TLS`` and devices (:meth:`TransferModes.read_transport`,
``HandshakeResponse.read_transport``): a source whose ``UCX_TLS`` leaves
only TCP is pushed from wherever it is, and one with no RDMA device is
pushed from when it is another host's, whatever this host has. A load that
learns this in its own handshake is made a push before any READ
(``Pull``); later loads from that address decide at once.

``pull`` and ``push`` fix the mode for every load, as before. A push sends
the source the decode worker's agent metadata, so it goes only to a callee
that proved itself (``kvd.daemon.peer_client``); that rule is the same in
every mode.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import os
import socket
import time
from collections import OrderedDict
from typing import Callable

from kvd.addresses import split_host_port
from kvd.core.own_addresses import RESOLVE_TIMEOUT_S, is_host_address

MODES = ("auto", "pull", "push")

# UCX transports with a native GET between hosts (InfiniBand/RoCE verbs and
# their accelerated variants); "ib" names them all, "all" lets UCX pick them.
_RDMA_TLS = ("rc", "dc", "ud")

RDMA_CLASS = "/sys/class/infiniband"

# Which hosts are this one's, remembered per host string (an API request
# names it, so the memory is bounded) for this long, seconds: a name's
# addresses may change.
HOST_CACHE_S = 60.0
HOST_CACHE_MAX = 1024

# Name lookups under way at once (each holds a thread of the loop's default
# executor until the C library answers, whatever the timeout): past it, a
# load from a name not looked up yet is a push, unlooked. A request names
# the host, so names that never answer could otherwise take every thread.
MAX_LOOKUPS = 4

#: What a handshake may say of how a READ from its daemon travels
#: (``HandshakeResponse.read_transport``; anything else, or "", is unknown).
READ_TRANSPORTS = ("native", "tcp", "tcp-between-hosts")

#: Source addresses whose handshake said a READ from them is TCP's,
#: remembered (a request names the address, so the memory is bounded).
SOURCES_MAX = 1024


def tcp_emulated_reads(environ=os.environ) -> bool:
    """True when ``UCX_TLS`` leaves UCX only TCP between hosts: a list that
    names ``tcp`` and no RDMA transport (same-host ones like ``sm``/``cma``
    at most), or an exclusion (``^...``) of every RDMA one (``ib``, or each
    of ``rc``, ``dc``, ``ud``) that keeps ``tcp``. A peer's READ from this
    daemon is then UCX's software GET (see the module docstring for what
    that does to the source). False when ``UCX_TLS`` is unset or ``all``:
    UCX then uses RDMA where the hosts have it (:func:`rdma_devices` tells
    whether this one does)."""
    value = environ.get("UCX_TLS", "").strip().lower()
    exclude = value.startswith("^")
    names = [t.strip().split(":")[0] for t in value.lstrip("^").split(",") if t.strip()]
    if not names:
        return False

    def rdma(n: str) -> bool:
        return n in ("ib", "all") or any(n == r or n.startswith(r + "_") for r in _RDMA_TLS)

    if exclude:  # UCX takes every transport but these
        every_rdma_out = "ib" in names or all(r in names for r in _RDMA_TLS)
        return every_rdma_out and "tcp" not in names and "all" not in names
    return "tcp" in names and not any(rdma(n) for n in names)


def rdma_devices(path: str = RDMA_CLASS) -> list[str]:
    """The RDMA devices the kernel lists on this host (``mlx5_0``,
    ``efa_0``...), sorted; empty where there are none or no such directory
    (a container without ``/sys``'s class tree sees none)."""
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _host_of(address: str) -> str:
    """The host of ``host:port`` without brackets or an IPv6 zone.

    Raises:
        ValueError: not ``host:port``."""
    return split_host_port(address)[0].strip("[]").split("%")[0]


class TransferModes:
    """Decides, per load, whether it is a pull or a push.

    Args:
        setting: ``"auto"``, ``"pull"`` or ``"push"`` (``Limits.transfer_mode``).
        environ: where ``UCX_TLS`` is read (the daemon's environment, which
            its NIXL agents' UCX reads too).
        devices: lists this host's RDMA devices (:func:`rdma_devices`).
        said: called with a host and whether it is this one's each time
            :meth:`pushes` looks a host up (the daemon logs it, throttled).
        serves_pushes: whether this daemon serves other daemons' pushes
            (``Limits.serve_pushes``: :meth:`describe` says it when not, and
            PeerService.Push reads it here).

    Raises:
        ValueError: ``setting`` is none of :data:`MODES`.
    """

    def __init__(self, setting: str = "auto", environ=os.environ,
                 devices: Callable[[], list[str]] = rdma_devices,
                 said: Callable[[str, bool], None] | None = None, serves_pushes: bool = True) -> None:
        if setting not in MODES:
            raise ValueError(f"transfer mode {setting!r} is not {' | '.join(MODES)}")
        self.setting = setting
        self.serves_pushes = serves_pushes
        self.tcp_only = tcp_emulated_reads(environ)
        self.ucx_tls = environ.get("UCX_TLS", "")
        self.rdma = devices() if not self.tcp_only else []  # in every mode: handshakes tell peers
        # The read_transport values of sources every READ from which is TCP's
        # software GET here, wherever they are: "tcp", and with an RDMA
        # device here "tcp-between-hosts" (a source with none is another host).
        self.tcp_reads_said = frozenset({"tcp", "tcp-between-hosts"} if self.rdma else {"tcp"})
        # The answer when no address is needed to give it; None: by source.
        if setting != "auto":
            self.fixed: bool | None = setting == "push"
        else:
            self.fixed = True if self.tcp_only else None
        self._hosts: dict[str, tuple[bool, float]] = {}  # host -> (this host's, when looked up)
        # address -> a handshake's read_transport other than "native"
        self._sources: OrderedDict[str, str] = OrderedDict()
        self._said = said
        self._lookups = 0  # name lookups whose thread has not returned

    def describe(self) -> str:
        """One line for the startup log: the mode and why, and whether this
        daemon serves pushes when it does not."""
        if self.serves_pushes:
            return self._describe()
        return self._describe() + "; serves no pushes (serve_pushes = false)"

    def _describe(self) -> str:
        if self.setting != "auto":
            return f"transfer mode {self.setting} (set)"
        if self.tcp_only:
            return (f"transfer mode auto: push for every load (UCX_TLS={self.ucx_tls} leaves UCX only TCP, "
                    "over which a READ is UCX's software GET)")
        if self.rdma:
            return (f"transfer mode auto: pull (RDMA devices here: {', '.join(self.rdma[:4])}), push from a "
                    "source whose handshake says a READ from it is TCP's")
        return ("transfer mode auto: pull from daemons of this host, push from other hosts (no RDMA device "
                f"in {RDMA_CLASS}: a READ between hosts would be UCX's software GET over TCP) and from a source "
                "whose handshake says a READ from it is TCP's")

    def warning(self) -> str | None:
        """What to tell an operator who fixed ``pull`` where reads between
        hosts are TCP's software GET; None otherwise."""
        if self.setting != "pull":
            return None
        if self.tcp_only:
            why = f"UCX_TLS={self.ucx_tls} leaves UCX only TCP between hosts"
        elif not self.rdma:
            why = f"this host has no RDMA device ({RDMA_CLASS}): UCX reaches other hosts over TCP"
        else:
            return None
        return (f"{why}: a pull-mode READ is then UCX's software GET, and UCX 1.23 crashes the daemon read from "
                "(SIGSEGV) when its reader dies in the middle of one; set transfer_mode = auto (the default) "
                "or push, whose WRITEs do not (docs/OPERATIONS.md, \"Known problems\")")

    def read_transport(self) -> str:
        """How a READ from this daemon travels (one of
        :data:`READ_TRANSPORTS`), for its handshake answers: "tcp" when
        ``UCX_TLS`` leaves only TCP, "tcp-between-hosts" with no RDMA device
        here, else "native"."""
        if self.tcp_only:
            return "tcp"
        return "native" if self.rdma else "tcp-between-hosts"

    def no_warm_up_from(self) -> frozenset[str]:
        """The ``read_transport`` values of sources whose loads ``auto``
        makes pushes wherever they are (so a pair with one READs nothing,
        not even its warm-up page): ``tcp_reads_said``. Empty for a set
        mode."""
        return self.tcp_reads_said if self.setting == "auto" else frozenset()

    def learn(self, address: str, transport: str) -> bool:
        """Remembers what a handshake with the daemon at ``address`` said of
        how a READ from it travels (``HandshakeResult.read_transport``; ""
        or "native": nothing to remember), for :meth:`pushes`. At most
        :data:`SOURCES_MAX` addresses, the least recently learned
        forgotten first (a load from one forgotten learns again from its
        pair, before any READ). True when that is news (:meth:`pushes` may
        answer otherwise now)."""
        if transport == "tcp" or transport == "tcp-between-hosts":
            if self._sources.get(address) == transport:
                return False
            self._sources.pop(address, None)
            if len(self._sources) >= SOURCES_MAX:
                self._sources.popitem(last=False)
            self._sources[address] = transport
            return True
        # It says otherwise now (another engine there, or its daemon restarted with RDMA allowed).
        return self._sources.pop(address, None) is not None

    def known(self, address: str, said: str | None = None) -> bool | None:
        """What :meth:`pushes` answers for ``address`` without looking a host
        name up: True (a push), False (a pull), or None where it would look
        one up first (a host not met, or met over ``HOST_CACHE_S`` ago).
        ``said``: a pair's own ``read_transport`` with that daemon, taken
        instead of what :meth:`learn` remembers (a load learns it before
        any READ), so that ``kvd status`` shows what a load from it ends up
        as; None: what is remembered (:meth:`pushes`' first step)."""
        if self.fixed is not None:
            return self.fixed
        if said is None:
            said = self._sources.get(address) if self._sources else None
        elif said != "tcp" and said != "tcp-between-hosts":
            said = None  # "native", or unknown: nothing that makes it a push
        if said == "tcp":
            return True
        if self.rdma and said is None:
            return False  # RDMA here, and the source said nothing else (or has not been met)
        try:
            host = _host_of(address)
        except ValueError:
            return True
        seen = self._hosts.get(host)
        if seen is not None and time.monotonic() - seen[1] < HOST_CACHE_S:
            return not seen[0]
        return None

    async def pushes(self, address: str) -> bool:
        """True when the load from the daemon at ``address`` (``host:port``,
        as a request names it) is a push. Under ``auto``: a source whose
        handshake said every READ from it is TCP's (:meth:`learn`) is
        pushed from; with an RDMA device here, any other source is pulled
        from unless its handshake said it has none, and then it is judged
        by host as when this host has none: a host is this one's when every
        address it resolves to is a loopback one or an address of this
        host. A host name is resolved
        off the event loop, within ``RESOLVE_TIMEOUT_S``, at most
        :data:`MAX_LOOKUPS` at once; one that does not resolve (in time, or
        at all) counts as another host's for this load only: a push is the
        safe choice, and dialing it fails the load anyway. Answers are
        remembered per host for ``HOST_CACHE_S``. The answer is about the
        address named: one of this host's that forwards to another (a proxy,
        a Kubernetes NodePort) counts as this host's. Never raises."""
        answer = self.known(address)
        if answer is not None:
            return answer
        host = _host_of(address)
        now = time.monotonic()
        local = await self._this_host(host)
        if local is None:
            return True
        if len(self._hosts) >= HOST_CACHE_MAX:
            self._hosts.clear()
        self._hosts[host] = (local, now)
        if self._said is not None:
            self._said(host, local)
        return not local

    async def _this_host(self, host: str) -> bool | None:
        """Whether every address ``host`` (an IP or a name) resolves to is a
        loopback one or one of this host's; None when a name did not
        resolve in time, or could not be looked up now."""
        try:
            ips = [ipaddress.ip_address(host)]
        except ValueError:
            if host.lower().rstrip(".") == "localhost":  # RFC 6761: loopback, whatever a resolver says
                return True
            if self._lookups >= MAX_LOOKUPS:
                return None
            self._lookups += 1
            lookup = asyncio.get_running_loop().run_in_executor(
                None, functools.partial(socket.getaddrinfo, host, None, type=socket.SOCK_STREAM))
            lookup.add_done_callback(self._lookup_ended)
            try:
                async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                    infos = await asyncio.shield(lookup)
            except (OSError, TimeoutError, UnicodeError):
                return None
            ips = [ipaddress.ip_address(i[4][0].split("%")[0]) for i in infos]
        mapped = [ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip for ip in ips]
        return bool(mapped) and all(ip.is_loopback or ip.is_unspecified or is_host_address(ip) for ip in mapped)

    def _lookup_ended(self, lookup: asyncio.Future) -> None:
        self._lookups -= 1
        if not lookup.cancelled():
            lookup.exception()  # retrieved: a name that failed after its timeout is no error to log

