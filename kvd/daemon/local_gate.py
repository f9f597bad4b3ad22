"""Who may use the engine socket: kernel credentials of every local caller.

gRPC (grpcio 1.85) does not tell a server who is on the other end of a Unix
socket: ``context.peer()`` is ``"unix:"`` and the auth context is empty, and
``local_server_credentials(UDS)`` never calls ``SO_PEERCRED`` (grpc/grpc
#15511, #28755). So the daemon does not let gRPC accept engine connections
itself:

- ``Gate`` owns the engine socket (mode 0660, group ``engine_socket_group``).
  For each connection it accepts it reads the caller's credentials from the
  kernel (``SO_PEERCRED``: pid, uid, gid at ``connect()``; ``SO_PEERGROUPS``:
  its supplementary groups), decides admission once (``Policy``), and relays
  the bytes to the gRPC server, which listens on a socket in a private
  directory (mode 0700) no other user can reach.
- The relay connection to gRPC is bound to a fresh abstract socket name,
  which gRPC reports as the call's peer (``unix-abstract:kvd-...``): that name
  maps each call back to its caller's credentials (``Gate.caller``). Names
  are 128 random bits: every local user can read bound abstract names in
  ``/proc/net/unix``, and a predictable next name could be bound first
  (``EADDRINUSE``) to refuse every engine. A name that is taken anyway is
  replaced by another (``RELAY_BIND_TRIES``). A call from a peer the gate does
  not know is refused. Only the daemon's uid (and root) can reach the private
  socket at all.
- A caller that is not admitted never reaches gRPC: the gate answers its
  first call itself with PERMISSION_DENIED and a message (``Refusal``: a
  minimal HTTP/2 exchange, RFC 9113, in gRPC's trailers-only form), closes
  the connection (a lingering close, ``h2_refusal.LINGER_S``), logs it (throttled) and counts it
  (``kvd_engine_connections_refused_total{reason}``).
- Connections are capped overall (``max_engine_connections``) and per caller
  uid (``max_engine_connections_per_uid``), admitted or not: one past a cap is
  closed at once. A connection that sends no byte within
  ``engine_idle_timeout_s`` is closed (a gRPC client sends its preface at once).
- ``AdmissionInterceptor`` refuses every RPC of a connection the gate did not
  make (or of a caller not admitted, should one get there) with
  PERMISSION_DENIED, before any handler runs. EngineService binds
  registrations and sessions to the caller (``kvd/daemon/engine_service.py``).

The relay costs one extra copy of each message through the event loop (a few
tens of microseconds on the session stream; bulk KV data never goes through
gRPC).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import inspect
import logging
import os
import secrets
import shutil
import socket
import stat
import struct
import tempfile
from dataclasses import dataclass

import grpc

from kvd import tracepoints as tp
from kvd.daemon.call_refusal import Refused, behavior_of
from kvd.daemon.h2_refusal import Refusal
from kvd.daemon.logs import Throttled

log = logging.getLogger("kvd.gate")

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13+
SOCKET_MODE = 0o660
_RELAY_BUFFER = 1 << 20  # bytes queued towards one side before reading from the other pauses
RELAY_BIND_TRIES = 8     # relay names tried before one connection is given up (a taken name is replaced)
REFUSED_REASONS = ("not_admitted", "max_engine_connections", "max_engine_connections_per_uid", "idle",
                   "credentials", "relay")


#: socket(7) SO_PASSRIGHTS (Linux 6.16): 0 makes the kernel refuse fds sent
#: to a socket (the sender's sendmsg fails EPERM); accepted sockets inherit it.
SO_PASSRIGHTS = getattr(socket, "SO_PASSRIGHTS", 83)


def refuse_passed_fds(sock: socket.socket) -> bool:
    """Sets ``SO_PASSRIGHTS`` 0 on ``sock`` (a listener: its connections
    inherit it); False where the kernel lacks it (before Linux 6.16).

    Why: an fd a caller attaches to any byte it sends is dropped by the
    kernel inside the daemon's read, and when that is the last reference
    to a TCP socket with ``SO_LINGER`` and unsent data, or a FUSE file, the
    drop waits in the daemon's thread (an attacker review held the event
    loop 9-15 s this way, as a caller not even admitted). The engine and
    command sockets carry no fds; only the fd side channel takes them."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 0)
        return True
    except OSError:
        return False


def bind_side_socket(path: str, kind: int, group: int | None, backlog: int, what: str, *,
                     passes_fds: bool = True) -> tuple[socket.socket, tuple[int, int]]:
    """Binds a Unix socket of ``kind`` (``SOCK_STREAM``, ``SOCK_SEQPACKET``)
    beside the engine socket, with its mode (:data:`SOCKET_MODE`) and
    ``group``, listening and non-blocking; ``(socket, (st_dev, st_ino) of the
    file bound)``, the identity :func:`unlink_own` checks. A socket file left
    at ``path`` is replaced (the engine socket's check has run: no daemon
    serves here). ``passes_fds`` False: :func:`refuse_passed_fds` before
    ``listen()``, so that no connection accepted takes fds (one made between
    the two kept them: an attacker review won that race at a restart). Raises
    OSError, naming ``what``, when ``path`` exists and is not a socket, or it
    cannot be bound or given to the group."""
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"{what}: {path} exists and is not a socket; refusing to replace it")
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, kind)
    identity = None
    try:
        s.bind(path)
        st = os.lstat(path)
        identity = (st.st_dev, st.st_ino)
        os.chmod(path, SOCKET_MODE)  # not connectable before listen(): who may connect is set first
        if group is not None:
            os.chown(path, -1, group)
        if not passes_fds:
            refuse_passed_fds(s)
        s.listen(backlog)
        s.setblocking(False)
    except BaseException:
        s.close()
        if identity is not None:
            unlink_own(path, identity, what)
        raise
    return s, identity


def unlink_own(path: str, identity: tuple[int, int] | None, what: str) -> None:
    """Unlinks ``path`` only if it is the socket file this daemon bound (same
    device and inode, ``identity``): once removed, another daemon may have
    bound the path (a clean-up of /run, an operator), and its socket is not
    ours to remove."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if identity != (st.st_dev, st.st_ino):
        log.info("%s %s is not the one this daemon bound (another daemon's?): left in place", what, path)
        return
    os.unlink(path)


def relay_name() -> str:
    """A fresh abstract socket name for one relay connection: 128 random bits,
    which no other user can guess from the names it sees in /proc/net/unix."""
    return f"kvd-{secrets.token_hex(16)}"


def bind_relay(sock: socket.socket) -> str:
    """Binds ``sock`` to a fresh abstract name (``relay_name``) and returns it;
    a name someone else holds (``EADDRINUSE``) is replaced by another, up to
    ``RELAY_BIND_TRIES`` times. Raises OSError when none could be bound."""
    for _ in range(RELAY_BIND_TRIES):
        name = relay_name()
        try:
            sock.bind("\0" + name)
            return name
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
    raise OSError(errno.EADDRINUSE, f"no free relay name after {RELAY_BIND_TRIES} tries")


@dataclass(frozen=True)
class Caller:
    """A local process on the engine socket, as the kernel describes it.

    ``pid`` is 0 when the caller lives in a PID namespace the daemon cannot
    see (another container); ``gids`` holds its primary and supplementary
    groups.
    """

    pid: int
    uid: int
    gid: int
    gids: frozenset[int]
    admitted: bool = False

    def __str__(self) -> str:
        return f"pid {self.pid or '?'} uid {self.uid} gid {self.gid}"


@dataclass(frozen=True)
class Policy:
    """Admission on the engine socket: root, the daemon's uid, ``uids``, or any of ``gids``."""

    uids: frozenset[int]
    gids: frozenset[int]

    @classmethod
    def make(cls, allowed_uids=(), allowed_gids=()) -> "Policy":
        """The admission policy: root and the daemon's own uid always, plus
        ``allowed_uids``; any of ``allowed_gids`` (numeric ids)."""
        return cls(frozenset({0, os.geteuid(), *allowed_uids}), frozenset(allowed_gids))

    def admits(self, uid: int, gids: frozenset[int]) -> bool:
        """True when ``uid`` is admitted or shares a group with ``gids``."""
        return uid in self.uids or bool(gids & self.gids)

    def describe(self) -> str:
        """The admitted uids and gids, for error messages and logs."""
        gids = ", ".join(map(str, sorted(self.gids))) or "none"
        return f"uids {', '.join(map(str, sorted(self.uids)))}; gids {gids}"


def peer_credentials(sock) -> tuple[int, int, int, frozenset[int]]:
    """``(pid, uid, gid, gids)`` of the process at the other end of a Unix socket."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    gids = {gid}
    for n in (64, 65536):
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * n)
        except OSError:
            continue  # ERANGE: more groups than fit; or a kernel without it
        gids.update(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
        break
    return pid, uid, gid, frozenset(gids)


class _Relay(asyncio.Protocol):
    """One side of a relayed connection: what it receives, the other side writes."""

    #: When this side is lost, the other is aborted (its queued bytes
    #: dropped) rather than closed once they are written.
    abort_other = False

    def __init__(self, on_lost=None):
        self.transport: asyncio.Transport | None = None
        self.other: "_Relay | None" = None
        self.on_lost = on_lost
        self.pending: list[bytes] = []   # received before the other side exists
        self.eof = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=_RELAY_BUFFER)

    def pair(self, other: "_Relay") -> None:
        """Joins two sides; what either received before is passed on."""
        self.other, other.other = other, self
        for a, b in ((self, other), (other, self)):
            for data in a.pending:
                b.transport.write(data)
            a.pending.clear()
            if a.eof and b.transport.can_write_eof():
                b.transport.write_eof()
            a.transport.resume_reading()
        if self.eof and other.eof:
            self.transport.close()
            other.transport.close()

    def data_received(self, data: bytes) -> None:
        tp.hit(tp.GATE_IN if type(self) is _Front else tp.GATE_OUT)  # no request id: bytes of HTTP/2 frames
        if self.other is None:
            self.pending.append(data)
            self.transport.pause_reading()
        else:
            self.other.transport.write(data)

    def eof_received(self):
        self.eof = True
        other = self.other
        if other is None:
            return True  # pair() passes it on
        if other.transport.can_write_eof():
            other.transport.write_eof()
        if other.eof:
            # Both ways ended: nothing more can pass, so close both (a
            # transport kept open after its EOF is closed by nobody else: a
            # client gone and gRPC's end closed left both relay sockets open,
            # counted against max_engine_connections_per_uid, for good).
            other.transport.close()
            return False  # closes this transport
        return True  # half-close: keep sending the other way

    def pause_writing(self) -> None:  # the other side reads faster than we can write: slow it
        if self.other is not None:
            self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None:
            self.other.transport.resume_reading()

    def connection_lost(self, exc) -> None:
        if self.on_lost is not None:
            self.on_lost()
            self.on_lost = None
        other = self.other
        if other is not None and other.transport is not None:
            if self.abort_other:
                other.transport.abort()
            else:
                other.transport.close()


# ------------------------------------------------------------------ the gate
class _Front(_Relay):
    """The engine's side: identified and counted, then paired with a
    connection to gRPC (admitted) or answered by the gate itself (refused)."""

    # The engine is gone: nobody reads gRPC's answers. A close would wait to
    # write the requests still queued towards gRPC, which stops reading them
    # while its own answers pile up unread (the gRPC side is paused while the
    # engine's side is full): a caller that pipelined ~47,000 GetStats
    # without reading, then hung up, left that connection open for good
    # (+2 fds, +106 MiB RSS) and the daemon deaf to SIGTERM (gRPC's stop
    # waits for it). Aborted, gRPC sees the connection reset and drops the
    # calls, as when an engine dies.
    abort_other = True

    def __init__(self, gate: "Gate"):
        super().__init__()
        self.gate = gate
        self.uid: int | None = None   # set while counted among the gate's open connections
        self.idle: asyncio.TimerHandle | None = None
        self.refusal: Refusal | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        transport.pause_reading()
        self.gate._accept(self, transport)

    def data_received(self, data: bytes) -> None:
        if self.refusal is not None:
            self.idle = self.refusal.feed_keeping(data, self.idle)
            return
        if self.idle is not None:  # the caller spoke
            self.idle.cancel()
            self.idle = None
        super().data_received(data)

    def eof_received(self):
        if self.refusal is not None:
            self.refusal.eof()
            return False
        return super().eof_received()

    def connection_lost(self, exc) -> None:
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None
        if self.refusal is not None:
            self.refusal.close()
        self.gate._closed(self)
        super().connection_lost(exc)


class Gate:
    """The engine socket: accepts, identifies, bounds and relays local callers.

    Args:
        path: the engine socket (``engine_socket``).
        policy: who is admitted.
        group: gid of the socket file (None: the daemon's group).
        max_connections: connections open at once, all callers
            (``max_engine_connections``).
        max_per_uid: connections open at once per caller uid
            (``max_engine_connections_per_uid``).
        idle_timeout_s: a connection that sends nothing this long (seconds)
            is closed; so is a refused one not answered by then
            (``engine_idle_timeout_s``).

    ``start()`` makes the private gRPC socket and returns its target
    (``unix:/.../grpc.sock``) for the server to bind; ``open()`` then binds the
    public socket; ``close()`` removes both (the socket only while it is the
    one this gate bound). ``refused`` counts closed connections by reason
    (``REFUSED_REASONS``); ``collect()`` gives them to Prometheus.
    """

    def __init__(self, path: str, policy: Policy, group: int | None = None, *, max_connections: int = 1024,
                 max_per_uid: int = 128, idle_timeout_s: float = 10.0):
        self.path = path
        self.policy = policy
        self.group = group
        self.max_connections = max_connections
        self.max_per_uid = max_per_uid
        self.idle_timeout_s = idle_timeout_s
        self.private_dir = ""
        self.passrights_refused = False  # SO_PASSRIGHTS 0 on the engine socket (refuse_passed_fds)
        self.internal = ""
        self._server: asyncio.AbstractServer | None = None
        self._bound: tuple[int, int] | None = None   # (st_dev, st_ino) of the socket file we bound
        self._callers: dict[str, Caller] = {}
        self._tasks: set[asyncio.Task] = set()
        self.open_by_uid: collections.Counter[int] = collections.Counter()
        self.open_connections = 0
        self.refused = dict.fromkeys(REFUSED_REASONS, 0)
        self._warn = {r: Throttled(log) for r in REFUSED_REASONS}

    def start(self) -> str:
        """Makes the private directory and returns the gRPC server's target."""
        parent = os.path.dirname(os.path.abspath(self.path))
        base = os.path.basename(self.path)
        self._sweep(parent, base)
        self.private_dir = tempfile.mkdtemp(prefix=f".{base}.", dir=parent)  # mode 0700
        self.internal = os.path.join(self.private_dir, "grpc.sock")
        if len(os.fsencode(self.internal)) > 107:
            os.rmdir(self.private_dir)
            self.private_dir = tempfile.mkdtemp(prefix="kvd-")
            self.internal = os.path.join(self.private_dir, "grpc.sock")
        return f"unix:{self.internal}"

    @staticmethod
    def _sweep(parent: str, base: str) -> None:
        """Removes private directories a killed daemon of this socket left (ours only)."""
        try:
            names = os.listdir(parent)
        except OSError:
            return
        for n in names:
            if not n.startswith(f".{base}."):
                continue
            p = os.path.join(parent, n)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not _alive(os.path.join(p, "grpc.sock")):
                shutil.rmtree(p, ignore_errors=True)

    async def open(self) -> None:
        """Binds the engine socket (mode 0660, its group) and starts accepting."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound = False
        try:
            s.bind(self.path)
            bound = True
            st = os.lstat(self.path)
            self._bound = (st.st_dev, st.st_ino)
            # Not connectable before listen(): set who may connect first.
            os.chmod(self.path, SOCKET_MODE)
            if self.group is not None:
                try:
                    os.chown(self.path, -1, self.group)
                except OSError as e:
                    raise OSError(f"cannot give the engine socket {self.path} to group {self.group} "
                                  f"(engine_socket_group; the daemon must be root or a member): "
                                  f"{e.strerror or e}") from None
            self.passrights_refused = refuse_passed_fds(s)
            s.listen(1024)
            s.setblocking(False)
        except BaseException:
            s.close()
            if bound:
                self._unlink_own()
            raise
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._accepted, sock=s)

    def _accepted(self) -> _Relay:
        return _Front(self)

    def refuse(self, reason: str, msg: str, *args) -> None:
        """Counts a closed connection under ``reason`` (``REFUSED_REASONS``) and
        logs ``msg % args`` (throttled per reason)."""
        self.refused[reason] += 1
        self._warn[reason].warning(msg, *args)

    def admit(self, transport, what: str = "engine socket") -> Caller | None:
        """Identifies a new connection on ``what`` (the engine socket or the
        command socket, ``kvd.daemon.command_socket``) and counts it against
        ``max_connections`` and ``max_per_uid``: its ``Caller`` (admitted or
        not: :meth:`not_admitted` refuses it), to be given back with
        :meth:`leave`; None when it was refused and closed (credentials
        unreadable, a cap reached)."""
        try:
            pid, uid, gid, gids = peer_credentials(transport.get_extra_info("socket"))
        except OSError as e:
            self.refuse("credentials", "%s: cannot read the caller's credentials (%s); "
                                        "connection closed", what, e)
            transport.close()
            return None
        caller = Caller(pid, uid, gid, gids, self.policy.admits(uid, gids))
        if self.open_connections >= self.max_connections:
            self.refuse("max_engine_connections", "%s: %s refused: %d connections open "
                         "(max_engine_connections); connection closed", what, caller, self.open_connections)
            transport.close()
            return None
        if self.open_by_uid[uid] >= self.max_per_uid:
            self.refuse("max_engine_connections_per_uid", "%s: %s refused: uid %d has %d "
                         "connections open (max_engine_connections_per_uid); connection closed",
                         what, caller, uid, self.open_by_uid[uid])
            transport.close()
            return None
        self.open_by_uid[uid] += 1
        self.open_connections += 1
        return caller

    def leave(self, uid: int) -> None:
        """A connection counted by :meth:`admit` for ``uid`` closed."""
        self.open_by_uid[uid] -= 1
        if self.open_by_uid[uid] <= 0:
            del self.open_by_uid[uid]
        self.open_connections -= 1

    def not_admitted(self, caller: Caller, what: str = "engine socket") -> str:
        """Logs and counts the refusal of ``caller``, not admitted; returns
        the message its refusal carries."""
        self.refuse("not_admitted", "%s: %s is not admitted (admitted: %s; settings "
                     "allowed_uids, allowed_gids); its connection is refused and closed",
                     what, caller, self.policy.describe())
        return (f"kvd: {caller} is not admitted on the engine socket (admitted: "
                f"{self.policy.describe()}; daemon settings allowed_uids, allowed_gids)")

    def _accept(self, front: _Front, transport) -> None:
        """Identifies and counts a new connection; refuses it, or starts its relay."""
        caller = self.admit(transport)
        if caller is None:
            return
        front.uid = caller.uid
        loop = asyncio.get_running_loop()
        front.idle = loop.call_later(self.idle_timeout_s, self._idle, front, transport, caller)
        if not caller.admitted:
            front.refusal = Refusal(transport, grpc.StatusCode.PERMISSION_DENIED, self.not_admitted(caller),
                                    loop.call_later)
            transport.resume_reading()
            return
        task = loop.create_task(self._connect(front, transport, caller))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _idle(self, front: _Front, transport, caller: Caller) -> None:
        front.idle = None
        if not transport.is_closing():
            self.refuse("idle", "engine socket: %s sent nothing (or was not answered) in %g s "
                         "(engine_idle_timeout_s); connection closed", caller, self.idle_timeout_s)
            if front.refusal is not None:
                front.refusal.close()  # drops what a caller that never reads left unsent
            else:
                transport.close()

    def _closed(self, front: _Front) -> None:
        if front.uid is not None:
            self.leave(front.uid)
            front.uid = None

    async def _connect(self, front: _Relay, transport, caller: Caller) -> None:
        back_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            name = bind_relay(back_sock)
            back_sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(back_sock, self.internal)
            # The private directory sits next to the engine socket, where the
            # socket's group may rename entries: relay only to ourselves.
            if peer_credentials(back_sock)[0] != os.getpid():
                raise OSError(f"{self.internal} is not this daemon's socket any more")
        except OSError as e:
            back_sock.close()
            self.refuse("relay", "engine socket: relay to gRPC failed: %s", e)
            transport.close()
            return
        if transport.is_closing():
            back_sock.close()
            return
        self._callers[name] = caller

        def forget() -> None:
            self._callers.pop(name, None)

        # Either side that ends first forgets the name: when the engine hangs
        # up, before the relay socket (and so its name) is closed.
        back = _Relay(on_lost=forget)
        front.on_lost = forget
        try:
            await asyncio.get_running_loop().create_unix_connection(lambda: back, sock=back_sock)
        except OSError as e:
            forget()
            back_sock.close()
            self.refuse("relay", "engine socket: relay to gRPC failed: %s", e)
            transport.close()
            return
        if transport.is_closing():  # the engine hung up meanwhile
            back.transport.close()
            return
        front.pair(back)

    def caller(self, context) -> Caller | None:
        """The caller of an RPC on the engine server (None: not through the gate)."""
        peer = context.peer() or ""
        if not peer.startswith("unix-abstract:"):
            return None
        return self._callers.get(peer.removeprefix("unix-abstract:"))

    async def close(self) -> None:
        """Stops accepting; removes the engine socket (while it is still the
        one this gate bound) and the private directory."""
        if self._server is not None:
            self._server.close()
            self._server = None
        self._unlink_own()
        if self.private_dir:
            shutil.rmtree(self.private_dir, ignore_errors=True)

    def _unlink_own(self) -> None:
        """Unlinks ``path`` only if it is the socket file this gate bound (:func:`unlink_own`)."""
        unlink_own(self.path, self._bound, "engine socket")
        self._bound = None

    def collect(self):
        """Prometheus collector (``registry.register(gate)``):
        ``kvd_engine_connections`` (open now) and
        ``kvd_engine_connections_refused_total{reason}`` (closed by the gate)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily("kvd_engine_connections", "Connections open on the engine socket",
                                value=self.open_connections)
        refused = CounterMetricFamily("kvd_engine_connections_refused", "Engine socket connections the gate "
                                      "closed, by reason", labels=["reason"])
        for reason, n in dict(self.refused).items():
            refused.add_metric([reason], n)
        yield refused


def _alive(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(0.5)
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


class AdmissionInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC on the engine server whose caller the gate did not admit."""

    def __init__(self, gate: Gate):
        self.gate = gate

    async def intercept_service(self, continuation, details):
        """Wraps every engine-server handler so that it first aborts with
        PERMISSION_DENIED when the caller did not come through the engine socket
        or is not admitted by the gate's policy."""
        handler = await continuation(details)
        if handler is None:
            return None
        gate = self.gate

        async def check(context) -> None:
            c = gate.caller(context)
            if c is None:
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, "kvd: connection not made through the engine socket")
            if not c.admitted:
                raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                              f"kvd: {c} is not admitted on the engine socket (admitted: "
                              f"{gate.policy.describe()}; daemon settings allowed_uids, allowed_gids)")

        return wrap_handler(handler, check)


def wrap_handler(handler, check):
    """``handler`` with ``await check(context)`` before its behavior runs."""
    kind, behavior = behavior_of(handler)
    if inspect.isasyncgenfunction(behavior):
        async def wrapped(request, context):
            await check(context)
            async for item in behavior(request, context):
                yield item
    elif inspect.isgeneratorfunction(behavior):
        async def wrapped(request, context):
            await check(context)
            for item in behavior(request, context):
                yield item
    else:
        async def wrapped(request, context):
            await check(context)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
    return handler._replace(**{kind: wrapped})
