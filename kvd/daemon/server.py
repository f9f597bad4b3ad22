"""The daemon's life: ``serve()`` = ``startup()`` -> ``main_loop()`` -> ``shutdown()``.

- ``EngineService`` (+ Health, reflection) on a Unix socket, for local engines,
  behind the gate that admits callers by their kernel credentials
  (``kvd/daemon/local_gate.py``);
- ``PeerService`` (+ Health, reflection) on TCP, for remote daemons, with
  mutual TLS and/or a token (``kvd/daemon/peer_auth.py``); with neither it
  binds loopback only unless ``peer_insecure``, and admits callers on this
  host only from sockets of root or the daemon's uid
  (``kvd/daemon/peer_local.py``; docs/SECURITY.md);
- both on one ``grpc.aio`` event loop run by uvloop; NIXL calls run on the
  core's NIXL thread.
Startup ends with sd_notify ``READY=1`` (systemd ``Type=notify``).
Shutdown (SIGTERM/SIGINT) is ordered: sd_notify ``STOPPING=1``, health
NOT_SERVING on both ports, refuse new registrations, sessions and loads, wait
up to ``grace_s`` for loads in flight (handshakes and READs; each one still
running then is logged and counted as failed, and the engine's session ends,
which fails it on the engine side), stop the servers, unregister every worker
(NIXL deregistration, unmap), stop the metrics endpoint, remove the socket.
A second SIGTERM/SIGINT skips the rest of the grace period. Held prefill
leases are not waited for: a reader that has not read them by then gets a
load error and its engine recomputes. SIGHUP is logged and changes nothing
(no reload). A failed startup releases what it made (servers, socket, private
directory, metrics endpoint, NIXL agents) before the error propagates: bad
TLS files and unknown NIXL backends raise ConfigError (``kvd serve`` exit 64).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import ipaddress
import logging
import os
import shutil
import signal
import socket
import stat
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection as grpc_reflection

from kvd import __version__
from kvd.addresses import ip_of, is_loopback, is_wildcard, join_host_port, metrics_url
from kvd.config import MAX_MESSAGE_BYTES, Config, ConfigError, parse_host_port, resolve_gid, resolve_uid
from kvd.core.events import FailureKind
from kvd.core.limits import Limits
from kvd.core.node import Node
from kvd.daemon import heap, reflection
from kvd.daemon.call_refusal import RefusalInterceptor
from kvd.daemon.early_stop import take_stops
from kvd.daemon.engine_service import EngineService
from kvd.daemon.command_socket import CommandSocket
from kvd.daemon.fd_channel import FdChannel
from kvd.daemon.health import Health
from kvd.daemon.local_gate import AdmissionInterceptor, Gate, Policy
from kvd.daemon.metrics import Metrics
from kvd.daemon.peer_auth import PeerAuth, PeerAuthInterceptor, secret_file_warnings
from kvd.daemon.peer_local import LocalPeerGate
from kvd.daemon.sdnotify import Notifier
from kvd.daemon.stall_watch import StallWatch
from kvd.daemon.wire_shape import ShapeInterceptor, engine_shape, peer_shape
from kvd.daemon.peer_client import PeerClient
from kvd.daemon.peer_service import PeerService
from kvd.command_wire import command_socket_path
from kvd.fd_wire import fd_socket_path
from kvd.v1 import kvd_pb2, kvd_pb2_grpc

log = logging.getLogger("kvd.server")


#: HTTP/2 streams one engine socket connection may have open at once
#: (SETTINGS_MAX_CONCURRENT_STREAMS). Unbounded (gRPC's default), a caller
#: that pipelines unary calls and never reads the answers makes gRPC keep
#: every answer: ~47,000 GetStats on one connection held +106 MiB of RSS;
#: with 1,024, 60,000 cost +21 MiB (256: +7). Past the bound, grpc-python's
#: client queues a call for a slot (or, for calls sent before it learnt the
#: bound, fails it UNAVAILABLE); each engine client's channel has a
#: connection of its own (``kvd.client.channel.open_channel``), so the bound
#: is per engine worker: far above what one uses (a session stream, a
#: renewal or stats call now and then). It does not bound a request still arriving: gRPC buffers each
#: open stream's message, up to max_message_bytes, before any handler runs
#: (docs/SECURITY.md, "Not bounded yet"). The peer port keeps gRPC's
#: default: a reader daemon's one channel to a source carries a claim per
#: load that waits (up to max_workers x max_inflight_per_worker).
ENGINE_MAX_STREAMS = 1024


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES, max_streams: int | None = None) -> list:
    """gRPC server options: message size limit both ways (bytes), at most
    ``max_streams`` streams open per connection (None: gRPC's default, no
    bound), and no SO_REUSEPORT, so a second daemon cannot bind the same
    port."""
    opts = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    if max_streams is not None:
        opts.append(("grpc.max_concurrent_streams", max_streams))
    return opts



def bind_failure(host: str, port: int) -> str | None:
    """Why the TCP address ``host:port`` cannot be bound (None: a plain
    socket binds it), for a startup error: gRPC's own error says only
    "Failed to bind to address" and prints a line of its own first, so a
    plain socket tries the same bind (``strerror``: "Address already in
    use", "Cannot assign requested address" for an address not on this
    host). A name that resolves to several addresses (``localhost``: ::1
    and 127.0.0.1 on many hosts) is tried at each, as gRPC binds each: one
    in use anywhere is a failure (gRPC would bind the others, and a peer
    dialing the name could reach whoever holds that one); one this host
    lacks is not, unless it lacks them all."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot resolve {host!r}: {e.strerror or e}"
    addrs = list(dict.fromkeys((i[0], i[1], i[2], i[4]) for i in infos))
    errors = []
    for family, kind, proto, sockaddr in addrs:
        try:
            with socket.socket(family, kind, proto) as s:
                # As gRPC binds: SO_REUSEADDR, so that a restart's port with
                # connections still in TIME_WAIT binds (gRPC's does).
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(sockaddr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return e.strerror or str(e)
            errors.append(e.strerror or str(e))
    return errors[0] if len(errors) == len(addrs) else None


def _side_socket_of(path: str) -> str:
    """`` (the command socket of the daemon on X)`` when ``path`` is the
    command socket or fd side channel (``kvd.command_wire``,
    ``kvd.fd_wire``: the engine socket's path plus ``.cmd`` or ``.fd``) of
    an engine socket X that exists; else ""."""
    for suffix, name in ((".cmd", "command socket"), (".fd", "fd side channel")):
        base = path.removesuffix(suffix)
        if base != path and os.path.exists(base):
            return f" (the {name} of the daemon on {base})"
    return ""


def make_socket_dir(path: str) -> str | None:
    """Makes the directory of the engine socket ``path`` (and its parents).
    Returns the first directory it made (the others are under it), or None
    when the directory was there.

    An existing directory of another user (not root, not this daemon's
    uid) is refused: that user may remove or replace the daemon's sockets
    in it at any time (attacker review: a squatter's ``/tmp/kvd``, which a
    root daemon then bound its sockets in). One every user may write with
    no sticky bit is used, with a WARNING (the same; a Kubernetes emptyDir
    is one, where every container runs as one uid).

    Raises:
        OSError: naming ``engine_socket``: a parent is a file ("is not a
            directory"), the directory cannot be made (its ``strerror``),
            or it belongs to another user.
    """
    parent = os.path.dirname(os.path.abspath(path))
    top = parent  # the first directory to be made (its parents exist)
    while not os.path.exists(os.path.dirname(top)) and os.path.dirname(top) != top:
        top = os.path.dirname(top)
    existed = os.path.isdir(parent)
    try:
        os.makedirs(parent, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        # Name what is in the way: the deepest existing ancestor, a file.
        blocker = parent
        while not os.path.exists(blocker) and os.path.dirname(blocker) != blocker:
            blocker = os.path.dirname(blocker)
        raise OSError(f"engine_socket: {blocker} is not a directory (on the way to {path})") from None
    except OSError as e:
        hint = ""
        if e.errno in (errno.EACCES, errno.EPERM):
            # A user's `kvd serve` with the default /run/kvd/engine.sock (root's, or the unit's RuntimeDirectory).
            hint = (f" (give this daemon --engine-socket in a directory this user may write, e.g. "
                    f"$XDG_RUNTIME_DIR/kvd/engine.sock, or create {top} for it as root)")
        raise OSError(f"engine_socket: cannot create directory {parent}: {e.strerror or e}{hint}") from None
    st = os.stat(parent)
    me = os.geteuid()
    if st.st_uid not in (0, me):
        raise OSError(f"engine_socket: {parent} belongs to uid {st.st_uid}, neither root nor this daemon's uid {me}: "
                      f"that user could remove or replace the daemon's sockets there; use a directory of root or of "
                      f"uid {me} (/run/kvd)")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        log.warning("engine_socket: every user may write %s (mode %04o, no sticky bit) and so remove or replace the "
                    "daemon's sockets there; engines of another uid will not use them (docs/SECURITY.md)", parent,
                    stat.S_IMODE(st.st_mode))
    if not existed:
        # Said: an operator finds a directory the unit or chart did not make,
        # with the daemon's umask (who may enter it decides who reaches the socket).
        st = os.stat(top)
        log.info("engine_socket: created directory %s (mode %04o, uid %d, gid %d)", parent if top == parent
                 else f"{parent} (from {top} down)", stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
        return top
    return None


def remove_made_dirs(top: str, parent: str) -> None:
    """Removes ``parent`` and its ancestors up to ``top`` (directories
    :func:`make_socket_dir` made) while they are empty: a failed startup
    leaves none of them behind. A directory something was put in stays, and
    so do all when ``top``'s own parent is writable by others (``/tmp``):
    removed, ``top`` could be made there by another user before the daemon's
    restart, which would then refuse it as another user's (attacker review:
    a ``/tmp/kvd`` the daemon removed at its stop was taken in the gap)."""
    shared = os.path.dirname(top)
    try:
        mode = os.stat(shared).st_mode
    except OSError:
        mode = 0
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.info("engine_socket: kept directory %s (made at startup): others may write %s, so the daemon does "
                 "not remove it (another user could take the name before a restart, which would then refuse it); "
                 "rmdir it yourself once no daemon will use it", top, shared)
        return
    d = parent
    while True:
        try:
            os.rmdir(d)
        except OSError:
            return  # not empty (someone else's now), or gone
        log.info("engine_socket: removed directory %s (made at startup)", d)  # as its making was said
        if d == top or os.path.dirname(d) == d:
            return
        d = os.path.dirname(d)


def routable_address(port: int) -> str:
    """``host:port`` with a non-loopback address of this host, for a wildcard
    ``peer_listen`` with no ``peer_advertise``: the source address the kernel
    would use for an outbound route (a UDP ``connect()``, which sends
    nothing), else what the host name resolves to, else ``127.0.0.1``."""
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET, "10.254.254.254"),
                          (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                addr = s.getsockname()[0]
        except OSError:
            continue
        if not is_loopback(addr) and not ipaddress.ip_address(addr.split("%")[0]).is_unspecified:
            return join_host_port(addr, port)
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    for family, *_, sockaddr in sorted(infos, key=lambda i: i[0] != socket.AF_INET):
        addr = sockaddr[0]
        if not is_loopback(addr) and not addr.startswith("fe80:"):
            return join_host_port(addr, port)
    return f"127.0.0.1:{port}"


ENGINE_SERVICE = kvd_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
PEER_SERVICE = kvd_pb2.DESCRIPTOR.services_by_name["PeerService"].full_name


class Server:
    """One kvd daemon process. ``asyncio.run(Server(cfg).serve())``."""

    def __init__(self, config: Config):
        self.config = config.validate()
        self.peer_auth = PeerAuth.from_config(config)
        self.peer_client = PeerClient(self.peer_auth, config.max_message_bytes, config.max_blocks_per_request,
                                      insecure=config.peer_insecure)
        self.gate: Gate | None = None
        self.fd_channel: FdChannel | None = None  # beside the engine socket (kvd.daemon.fd_channel)
        self.command_socket: CommandSocket | None = None  # sessions without gRPC (kvd.daemon.command_socket)
        self.node: Node | None = None
        self.metrics: Metrics | None = None
        self.should_exit = asyncio.Event()
        self.force_exit = asyncio.Event()
        self.peer_port = 0
        self.notifier = Notifier(config.notify_socket)
        self._watchdog: asyncio.Task | None = None  # systemd's keep-alive (_keep_alive)
        self._unhealthy = ""  # why health went NOT_SERVING for good (a lost CUDA context); "" while healthy
        self.stall_watch: StallWatch | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._made_dir: str | None = None  # the first socket directory startup made (make_socket_dir)
        self._serving = False  # startup is done: a stop is then "shutting down", not "during startup"
        self._stop_signal = ""  # the name of the first SIGTERM/SIGINT taken, once one is

    async def serve(self) -> None:
        """Runs the daemon: startup, serve until SIGTERM/SIGINT, shutdown. A
        failed startup releases what it made (``_release``) and re-raises;
        either way the socket directories startup made go when empty."""
        try:
            await self.startup()
        except BaseException as e:
            said = isinstance(e, Exception) and not isinstance(e, ConfigError)  # kvd serve prints a ConfigError
            if said:  # before the release's own lines (directories removed), which follow from it
                log.error("startup failed: %s", e)
            await self._release()
            self._remove_made_dirs()
            if said:
                raise StartupFailed(str(e)) from e
            raise
        heap.settle()  # startup's objects frozen: full collections walk only what serving made (kvd.daemon.heap)
        try:
            await self.main_loop()
        finally:
            await self.shutdown()
            self._remove_made_dirs()  # as a failed startup: a stopped daemon leaves no empty directory it made
            log.info("kvd stopped")  # last: after everything it made is gone

    def _remove_made_dirs(self) -> None:
        if self._made_dir is not None:
            remove_made_dirs(self._made_dir, os.path.dirname(os.path.abspath(self.config.engine_socket)))

    async def startup(self) -> None:
        """Binds the peer port, the engine socket and the metrics endpoint, starts
        the services and tells systemd READY; SIGTERM and SIGINT are handled
        from its start (a stop asked meanwhile stops the daemon once started,
        and the log and READY's STATUS say so). Raises
        OSError when a port or socket cannot be bound, the engine socket path is
        not a socket or another daemon serves on it; ConfigError for a NIXL
        backend that cannot be used."""
        cfg = self.config
        for w in cfg.warnings + secret_file_warnings(cfg):  # first: before anything is bound or served
            log.warning("%s", w)
        # Before anything is bound: a stop asked while the daemon starts (a
        # supervisor's SIGTERM, a SIGINT once the engine socket exists) stops
        # it once started, through the same shutdown. Handlers added at the
        # end left a window where SIGTERM's default action killed it with its
        # sockets and directories left, and a SIGINT was lost (a shell without
        # job control starts background processes with SIGINT ignored): a
        # test's daemon ran on, once in a fresh clone.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.handle_exit, sig)
        for sig in take_stops():  # asked before the loop ran (kvd serve's imports: kvd.daemon.early_stop)
            self.handle_exit(sig)
        host, port = parse_host_port(cfg.peer_listen, "peer_listen")
        limits = Limits(lease_s=cfg.lease_s, max_lease_life_s=cfg.max_lease_life_s,
                        transfer_timeout_s=cfg.transfer_timeout_s, handshake_timeout_s=cfg.handshake_timeout_s,
                        detach_grace_s=cfg.detach_grace_s,
                        transfer_mode=cfg.transfer_mode, serve_pushes=cfg.serve_pushes,
                        same_node_copy=cfg.same_node_copy,
                        vet_peer_metadata=cfg.vet_peer_metadata and bool(
                            cfg.peer_token_file or cfg.peer_tls_cert or cfg.peer_insecure),
                        copy_threads=cfg.copy_threads,
                        follow_holds=cfg.follow_holds,
                        max_inflight_per_worker=cfg.max_inflight_per_worker,
                        max_load_block_ids_per_worker=cfg.max_load_block_ids_per_worker,
                        max_load_block_ids_per_uid=cfg.max_load_block_ids_per_uid,
                        max_blocks_per_request=cfg.max_blocks_per_request,
                        max_leases_per_worker=cfg.max_leases_per_worker,
                        max_held_blocks_per_worker=cfg.max_held_blocks_per_worker, poll_busy_s=cfg.poll_busy_s,
                        poll_idle_s=cfg.poll_idle_s,
                        warm_peers=tuple(tuple(e.split("/", 1)) for e in cfg.warm_peers),
                        max_queued_event_bytes=cfg.max_queued_event_bytes, max_workers=cfg.max_workers,
                        max_workers_per_uid=cfg.max_workers_per_uid, max_descriptors=cfg.max_descriptors,
                        max_descriptors_per_uid=cfg.max_descriptors_per_uid,
                        max_host_bytes_per_uid=cfg.max_host_bytes_per_uid,
                        max_device_bytes_per_uid=cfg.max_device_bytes_per_uid, max_aborts=cfg.max_aborts,
                        max_handshakes=cfg.max_handshakes, max_handshakes_per_uid=cfg.max_handshakes_per_uid,
                        max_aborts_per_uid=cfg.max_aborts_per_uid, peer_check_s=cfg.peer_check_s,
                        peer_dead_s=cfg.peer_dead_s, peer_idle_s=cfg.peer_idle_s)
        options = server_options(cfg.max_message_bytes)
        self._loop = asyncio.get_running_loop()
        self.metrics = Metrics(self._stats_threadsafe)
        self._check_backends()
        self.node = Node(limits, peers=self.peer_client, backends=cfg.backends, on_event=self.metrics.on_event)
        self.node.local_copy.on_cuda_lost = self._cuda_lost
        policy = Policy.make([resolve_uid(u) for u in cfg.allowed_uids], [resolve_gid(g) for g in cfg.allowed_gids])
        self.gate = Gate(cfg.engine_socket, policy,
                         resolve_gid(cfg.engine_socket_group) if cfg.engine_socket_group else None,
                         max_connections=cfg.max_engine_connections,
                         max_per_uid=cfg.max_engine_connections_per_uid, idle_timeout_s=cfg.engine_idle_timeout_s)
        self.metrics.registry.register(self.gate)
        self.metrics.registry.register(self.peer_client.unreachable)
        self.metrics.registry.register(self.peer_client.first_contacts)
        self.fd_channel = FdChannel(fd_socket_path(cfg.engine_socket), policy, self.gate.group)
        self.engine_service = EngineService(self.node, backends=cfg.backends,
                                            callers=self.gate.caller,
                                            require_session_token=cfg.require_session_token,
                                            require_memfd=cfg.require_memfd,
                                            fds=self.fd_channel.table)
        if cfg.command_socket:
            self.command_socket = CommandSocket(command_socket_path(cfg.engine_socket), self.gate,
                                                self.engine_service, cfg.max_message_bytes)
            self.engine_service.command_socket = command_socket_path(cfg.engine_socket)

        # Peer side (TCP).
        host = self._peer_host(host, port)
        auth = self.peer_auth
        # First (outermost): answers what the others and the handlers refuse
        # (kvd.daemon.call_refusal: a refused request is freed when its call ends).
        interceptors = [RefusalInterceptor()]
        if auth.token:
            interceptors.append(PeerAuthInterceptor(auth, self._own_addresses))
        if not auth.secured:
            # Loopback is every local user's: only root's and our uid's sockets
            # may call (kvd.daemon.peer_local, docs/SECURITY.md).
            interceptors.append(LocalPeerGate(self.node.own))
        # Last: a request is walked once its caller has been checked.
        interceptors.append(ShapeInterceptor(functools.partial(
            peer_shape, max_blocks_per_request=cfg.max_blocks_per_request)))
        self.peer_server = grpc.aio.server(options=options, interceptors=interceptors)
        kvd_pb2_grpc.add_PeerServiceServicer_to_server(PeerService(self.node), self.peer_server)
        self.peer_health = self._add_health_and_reflection(self.peer_server, PEER_SERVICE)
        bind = join_host_port(host, port)
        creds = auth.server_credentials()
        # A fixed port is tried with a plain socket first: a port in use is
        # then told in kvd's words only (gRPC logs its own E-line before
        # failing). The same bind as gRPC's (no SO_REUSEPORT: server_options).
        why = bind_failure(host, port) if port else None
        self.peer_port = 0
        if why is None:
            try:
                self.peer_port = (self.peer_server.add_secure_port(bind, creds) if creds is not None
                                  else self.peer_server.add_insecure_port(bind))
            except RuntimeError:  # grpc.aio: "Failed to bind to address ...", no reason given
                pass
        if self.peer_port == 0:
            why = why or bind_failure(host, port) or "gRPC could not bind it"
            hint = (" (another kvd? give this one its own port: --peer-listen HOST:PORT, port 0 picks one)"
                    if "in use" in why else "")
            raise OSError(f"peer_listen: cannot bind PeerService to {bind}: {why}{hint}")
        adv = cfg.peer_advertise
        if not adv and host in ("0.0.0.0", "::", ""):
            adv = routable_address(self.peer_port)
            log.warning("peer_listen %s is a wildcard and peer_advertise is unset: advertising %s to remote "
                        "daemons%s; set peer_advertise to the address they should dial", cfg.peer_listen, adv,
                        " (no other address found: remote daemons cannot reach it)"
                        if adv.startswith("127.") else "")
        adv = adv or join_host_port(host, self.peer_port)  # "[::1]:port": what a dialer parses
        if auth.token and not auth.tls and ip_of(adv.rpartition(":")[0]) is None:
            # The token proves the daemon that answers, not the connection: a
            # reader's resolver may give an address of the name this daemon
            # does not listen on (gRPC answers ::1 first for "localhost"),
            # where another user of that host could relay the calls and read
            # them (attacker review).
            log.warning("peer_advertise %s is a host name: peers dial whatever their resolver gives for it, and "
                        "with a token and no TLS another user of a host where it names an address this daemon does "
                        "not listen on could relay and read the calls; advertise an IP address, or use mutual TLS",
                        adv)
        self.node.peer_address = adv
        self.node.listening(host, self.peer_port)
        self._bound = join_host_port(host, self.peer_port)
        # For GetStats (kvd status): what the "authentication:" of the serving line says, and
        # where, so that a daemon left unauthenticated (a misspelt token setting) shows it later.
        self.node.peer_auth, self.node.peer_listen = auth.mode(is_loopback(host)), self._bound

        # Engine side (Unix socket, through the gate).
        sock = cfg.engine_socket
        self._made_dir = make_socket_dir(sock)
        if os.path.lexists(sock):
            if not stat.S_ISSOCK(os.lstat(sock).st_mode):
                # Never delete what is not a socket (a typo could name a file).
                raise OSError(f"engine_socket: {sock} exists and is not a socket; refusing to replace it")
            if self._socket_alive(sock):
                raise OSError(f"another daemon is serving on {sock}{_side_socket_of(sock)}: stop it, or give this "
                              f"daemon its own engine_socket")
            os.unlink(sock)
            log.info("engine_socket: replaced %s, left by a daemon that stopped without removing it (nothing "
                     "listened on it)", sock)
        self.engine_server = grpc.aio.server(options=server_options(cfg.max_message_bytes, ENGINE_MAX_STREAMS),
                                             interceptors=[RefusalInterceptor(), AdmissionInterceptor(self.gate),
                                                           ShapeInterceptor(functools.partial(
                                                               engine_shape,
                                                               max_blocks_per_request=cfg.max_blocks_per_request))])
        kvd_pb2_grpc.add_EngineServiceServicer_to_server(self.engine_service, self.engine_server)
        self.engine_health = self._add_health_and_reflection(self.engine_server, ENGINE_SERVICE)
        try:
            internal = self.gate.start()
        except OSError as e:  # the gate's private directory beside the socket: name the setting, not it
            raise OSError(f"engine_socket: cannot create the socket in {os.path.dirname(os.path.abspath(sock))}: "
                          f"{e.strerror or e}") from None
        if self.engine_server.add_insecure_port(internal) == 0:
            raise OSError(f"cannot bind EngineService to {internal}")

        await self.peer_server.start()
        await self.engine_server.start()
        if self.command_socket is not None:
            # Before the engine socket: an engine that reaches the daemon finds it.
            await self.command_socket.open()
        await self.gate.open()
        self._gate_open = True
        await self.fd_channel.open()
        self.node.start()
        self.stall_watch = StallWatch(cfg.stall_dump_s, nixl_call=self.node.rt.nixl_call)
        self.stall_watch.on_tick = self.metrics.watch_loop(self.stall_watch.tick_age)
        self.metrics.watch_nixl(self.node.rt.nixl_call)
        self.stall_watch.start()
        metrics_at = ""
        if cfg.metrics_port:
            try:
                mport = self.metrics.serve(cfg.metrics_port, cfg.metrics_host)
            except OSError as e:
                # A busy port is the host's state, not a bad setting: exit 1
                # (systemd retries); an address not on this host names metrics_host.
                key = ("metrics_host" if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL
                       else "metrics_port")
                hint = (" (another kvd? give each daemon its own --metrics-port; 0 turns metrics off)"
                        if e.errno == errno.EADDRINUSE else "")
                raise OSError(f"{key}: cannot serve metrics on {join_host_port(cfg.metrics_host, cfg.metrics_port)}: "
                              f"{e.strerror or e}{hint}") from None
            metrics_at = join_host_port(cfg.metrics_host, mport)  # [::1]:port: a URL's form
            self.engine_service.metrics_address = metrics_at
        for health in (self.peer_health, self.engine_health):
            for svc in ("", ENGINE_SERVICE, PEER_SERVICE):
                await health.set(svc, health_pb2.HealthCheckResponse.SERVING)
        # Ours, not UCX's (it may take SIGHUP when an agent is made) nor the
        # default action (exit): there is nothing to reload.
        loop.add_signal_handler(signal.SIGHUP, self.handle_hup)
        # A stop asked during startup (handle_exit said so) is acted on now:
        # the line says the daemon started, not that it serves on. One that
        # landed since the last await has not reached handle_exit yet: uvloop
        # reads a signal's wakeup byte in one loop iteration and calls its
        # handler in the next.
        for _ in range(2):
            await asyncio.sleep(0)
        stopping = self.should_exit.is_set()
        log.info("kvd %s %s: engines on unix:%s (admitted: %s), peers on %s (advertised %s, "
                 "authentication: %s), NIXL backends %s%s", __version__,
                 f"started, and stops now ({self._stop_signal} received during startup)" if stopping else "serving",
                 sock, policy.describe(), self._bound, adv, self._auth_said(auth, host),
                 ",".join(cfg.backends),
                 (f", metrics on {metrics_url(metrics_at)}" if metrics_at else "")
                 + (f", warm peers {','.join(cfg.warm_peers)}" if cfg.warm_peers else ""))
        self._serving = True
        modes = self.node.modes
        log.info("%s", modes.describe())
        if self.node.peers.vet is not None:
            log.info("peer agent metadata: each new one is loaded in a throwaway process first "
                     "(vet_peer_metadata; UCX crashes on some malformed worker addresses)")
        if (warning := modes.warning()) is not None:
            log.warning("%s", warning)
        if not self.gate.passrights_refused:
            log.info("this kernel has no SO_PASSRIGHTS (Linux 6.16): an fd a caller attaches to bytes it sends on "
                     "the engine or command socket is dropped in the daemon's read, which a socket or file made "
                     "to close slowly can hold up (docs/SECURITY.md)")
        # READY=1 even when stopping: systemd fails a Type=notify unit whose
        # main process exits before READY=1 ("Failed with result
        # 'protocol'"), and Restart=on-failure would start again a daemon
        # asked to stop; STOPPING=1 follows at once (shutdown). A stop that
        # systemd itself asked leaves the unit deactivating, where READY=1
        # changes nothing.
        self.notifier.ready(f"started; stopping ({self._stop_signal} received during startup)" if stopping
                            else f"serving: engines on unix:{sock}, peers on {adv}")
        if self.notifier.enabled and cfg.watchdog_s > 0:
            self._watchdog = asyncio.get_running_loop().create_task(self._keep_alive(cfg.watchdog_s))

    def _auth_said(self, auth: PeerAuth, host: str) -> str:
        """The serving line's ``authentication:``: the mode, and for none
        whether PeerService is loopback only or open to any host
        (``peer_insecure``), which "none" alone did not tell apart."""
        if auth.secured:
            return auth.describe()
        return "none, loopback only" if is_loopback(host) else "none, peer_insecure = true"

    def _peer_host(self, host: str, port: int) -> str:
        """The host PeerService binds: loopback when it has no authentication
        and the operator did not opt out (``peer_insecure``)."""
        if self.peer_auth.secured or is_loopback(host):
            return host
        if self.config.peer_insecure:
            log.warning("SECURITY: PeerService on %s has NO authentication (peer_insecure = true): any host "
                        "that reaches this port can read and overwrite every KV cache registered here. "
                        "Configure mutual TLS (peer_tls_*) or peer_token_file (docs/SECURITY.md).",
                        self.config.peer_listen)
            return host
        loopback = "::1" if ":" in host else "127.0.0.1"
        log.warning("SECURITY: PeerService has no authentication (no peer_tls_*, no peer_token_file): binding "
                    "%s instead of %s, so remote daemons cannot reach this one. Configure mutual TLS or a "
                    "token (docs/SECURITY.md), or set peer_insecure = true to serve unauthenticated peers.",
                    join_host_port(loopback, port), self.config.peer_listen)
        return loopback

    def _own_addresses(self) -> set[str]:
        """The ``host:port`` names remote daemons may address this one by
        (token proofs): the advertised address and the listen address, but
        not a wildcard one (``0.0.0.0:P``, ``[::]:P``): a daemon that dials
        that reaches its own host, where any user holding port P could
        relay the call here and read the answer (attacker review: a push's
        metadata through such a relay)."""
        return {a for a in (self.node.peer_address if self.node else "", getattr(self, "_bound", ""))
                if a and not is_wildcard(a.rpartition(":")[0])}

    def _check_backends(self) -> None:
        from kvd.core.nixl_agent import NixlAgent, NixlBackendUnavailable

        # Fail at startup, naming the backend, rather than at first registration.
        # A name NIXL has no plugin for is a configuration error (exit 64);
        # one that fails to initialise is not (exit 1: the host may change).
        try:
            NixlAgent(f"kvd-startup-probe-{os.getpid()}", self.config.backends)
        except NixlBackendUnavailable as e:
            raise self.config._error("backends", str(e)) from None

    @staticmethod
    def _socket_alive(path: str) -> bool:
        """True unless nothing listens at the Unix socket ``path`` (connect
        refused, or the file gone). A listener of another socket type
        (``EPROTOTYPE``: a daemon's ``.fd`` side channel is SOCK_SEQPACKET),
        a full backlog or no answer in 0.5 s count as alive: the stream-only
        check took another daemon's live ``.fd`` socket for a stale one and
        replaced it (a new-user trial)."""
        import socket

        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(0.5)
            s.connect(path)
            return True
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True
        finally:
            s.close()

    def _add_health_and_reflection(self, server, service: str) -> Health:
        health = Health()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        reflection.enable(
            (service, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, grpc_reflection.SERVICE_NAME),
            server,
        )
        return health

    def handle_hup(self) -> None:
        """SIGHUP: logged, nothing else (the daemon keeps serving)."""
        log.warning("SIGHUP: kvd has no reload; settings change on restart")

    def handle_exit(self, sig) -> None:
        """SIGTERM/SIGINT handler: the first asks for a graceful shutdown (drain up
        to ``grace_s`` seconds; one during startup, once started), a second stops
        waiting for transfers in flight."""
        name = signal.Signals(sig).name
        if self.should_exit.is_set():
            log.warning("received %s again: not waiting for transfers in flight", name)
            self.force_exit.set()
            return
        self._stop_signal = name
        if self._serving:
            log.info("received %s, shutting down (grace %.1f s)", name, self.config.grace_s)
        else:  # startup goes on to its end, then stops: a daemon half made would leave its sockets
            log.info("received %s during startup: stopping once started (grace %.1f s)", name, self.config.grace_s)
        self.should_exit.set()

    def _stats_threadsafe(self) -> dict:
        """``Node.stats()`` computed on the event loop, for callers on other
        threads (the metrics HTTP thread): the core's dicts change only there."""
        loop, node = self._loop, self.node
        if node is None or loop is None or loop.is_closed():
            return {}
        try:
            if asyncio.get_running_loop() is loop:
                return node.stats()
        except RuntimeError:
            pass

        async def snap() -> dict:
            return node.stats()

        return asyncio.run_coroutine_threadsafe(snap(), loop).result(timeout=2.0)

    async def _keep_alive(self, watchdog_s: float) -> None:
        """systemd's watchdog (a unit with ``WatchdogSec=``): ``WATCHDOG=1``
        every third of ``watchdog_s`` seconds, from the event loop, while the
        daemon is healthy. A loop that hangs sends none, and systemd restarts
        the daemon once ``watchdog_s`` passes without one; a lost CUDA
        context ends them at once (:meth:`_cuda_lost`)."""
        while not self._unhealthy:
            self.notifier.watchdog()
            await asyncio.sleep(watchdog_s / 3)

    def _cuda_lost(self, reason: str) -> None:
        """The core's copy lost this process's CUDA context (every later CUDA
        call fails, only a new process recovers): health goes NOT_SERVING on
        both ports, so that a liveness probe restarts the daemon, and under
        systemd with a watchdog (``WatchdogSec=``, deploy/systemd/kvd.service)
        the watchdog fires now (``WATCHDOG=trigger``: ``Restart=on-failure``
        restarts it). Until then it serves what it can (DRAM engines)."""
        self._unhealthy = reason
        watched = self._watchdog is not None

        async def unhealthy():
            for health in (getattr(self, "peer_health", None), getattr(self, "engine_health", None)):
                if health is not None:
                    for svc in ("", ENGINE_SERVICE, PEER_SERVICE):
                        await health.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)
            log.error("health is NOT_SERVING: the CUDA context is lost (%s); %s", reason,
                      "systemd's watchdog restarts the daemon" if watched else "restart the daemon")
            if watched:
                self.notifier.watchdog_trigger(f"CUDA context lost: {reason}")

        asyncio.ensure_future(unhealthy())

    async def main_loop(self) -> None:
        """Waits until a signal asks the daemon to stop."""
        await self.should_exit.wait()

    async def shutdown(self) -> None:
        """Drains: refuses new registrations and sessions (UNAVAILABLE), health goes
        NOT_SERVING, waits up to ``grace_s`` seconds for loads in flight (less
        after a second signal), logs the rest as failed, then releases everything
        and ignores further signals."""
        self.notifier.stopping(f"draining (grace {self.config.grace_s:g} s)")
        node = getattr(self, "node", None)
        if node is not None:
            node.draining = True  # one flag: the engine service reads it too

        def in_flight() -> list[tuple[str, str, str]]:
            return node.loads_in_flight() if node is not None else []

        for health in (getattr(self, "peer_health", None), getattr(self, "engine_health", None)):
            if health is not None:
                await health.enter_graceful_shutdown()
        deadline = time.monotonic() + self.config.grace_s
        next_note = 0.0
        while (left := in_flight()) and time.monotonic() < deadline and not self.force_exit.is_set():
            if time.monotonic() >= next_note:
                log.info("draining: waiting up to %.1f s for %d load(s) under way (handshaking, claiming or "
                         "reading)", deadline - time.monotonic(), len(left))
                next_note = time.monotonic() + 1.0
            await asyncio.sleep(0.05)
        for label, rid, peer in in_flight():
            # The engine learns it when its session ends (the shim fails every
            # load that went out on a lost stream); the core drops the READ.
            log.warning("%s request=%s peer=%s: load failed: shutdown: daemon stopped before it finished",
                        label, rid, peer or "?")
            self.metrics.on_event("failure", {"kind": FailureKind.SHUTDOWN})
        await self._release(grace=1.0)
        # Shutdown is done: a late SIGTERM/SIGINT (a second `systemctl stop`,
        # a supervisor's retry) must not turn exit 0 into "killed by signal"
        # while the interpreter tears down.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)

    async def _release(self, grace: float | None = None) -> None:
        """Stops the servers, unregisters every worker, stops the metrics
        endpoint and removes the engine socket and the private directory:
        whatever startup made so far (also after a failed startup)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.stall_watch is not None:
            await self.stall_watch.stop()
        for name in ("engine_server", "peer_server"):
            srv = getattr(self, name, None)
            if srv is not None:
                await srv.stop(grace=grace)
        if self.command_socket is not None:
            await self.command_socket.close()  # its socket; every session on it ends (the engine sees EOF)
        if self.node:
            await self.node.close()
        await self.peer_client.close()
        if self.metrics is not None:
            self.metrics.stop()
        if self.fd_channel is not None:
            await self.fd_channel.close()  # its socket and every fd not claimed
        if self.gate is not None:
            if getattr(self, "_gate_open", False):
                await self.gate.close()  # the socket and the private directory
            elif self.gate.private_dir:
                # Never the socket path: it may be another daemon's, or no socket.
                shutil.rmtree(self.gate.private_dir, ignore_errors=True)


class StartupFailed(Exception):
    """The daemon could not start (a port or socket taken, a NIXL backend
    that fails to load); the cause is logged ("startup failed: ...")
    before what startup made is released. ``kvd serve`` exits 1."""


def run(config: Config) -> None:
    """Runs the daemon until SIGTERM/SIGINT, on uvloop. A fatal signal
    (SIGSEGV, SIGABRT: a crash in native code, NIXL's or UCX's) writes every
    thread's Python stack to stderr first (``faulthandler``)."""
    import faulthandler

    import uvloop

    faulthandler.enable()

    uvloop.run(Server(config).serve())
