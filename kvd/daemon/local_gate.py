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
  maps each call back to its caller's credentials (``Gate.caller``). Names are
  never reused; a call from a peer the gate does not know is refused. Only
  the daemon's uid (and root) can reach the private socket at all.
- ``AdmissionInterceptor`` refuses every RPC of a caller not admitted (or of
  a connection the gate did not make) with PERMISSION_DENIED and a message,
  before any handler runs. EngineService binds registrations and sessions to
  the caller (``kvd/daemon/engine_service.py``).

The relay costs one extra copy of each message through the event loop (a few
tens of microseconds on the session stream; bulk KV data never goes through
gRPC).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
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

log = logging.getLogger("kvd.gate")

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13+
SOCKET_MODE = 0o660
_RELAY_BUFFER = 1 << 20  # bytes queued towards one side before reading from the other pauses


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

    def data_received(self, data: bytes) -> None:
        tp.hit(tp.GATE_IN if type(self) is _Front else tp.GATE_OUT)  # no request id: bytes of HTTP/2 frames
        if self.other is None:
            self.pending.append(data)
            self.transport.pause_reading()
        else:
            self.other.transport.write(data)

    def eof_received(self):
        if self.other is None:
            self.eof = True
        elif self.other.transport.can_write_eof():
            self.other.transport.write_eof()
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
        if self.other is not None and self.other.transport is not None:
            self.other.transport.close()


class _Front(_Relay):
    """The engine's side: identified, then paired with a connection to gRPC."""

    def __init__(self, gate: "Gate"):
        super().__init__()
        self.gate = gate

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        transport.pause_reading()
        task = asyncio.get_running_loop().create_task(self.gate._connect(self, transport))
        self.gate._tasks.add(task)
        task.add_done_callback(self.gate._tasks.discard)


class Gate:
    """The engine socket: accepts, identifies and relays local callers.

    Args:
        path: the engine socket (``engine_socket``).
        policy: who is admitted.
        group: gid of the socket file (None: the daemon's group).

    ``start()`` makes the private gRPC socket and returns its target
    (``unix:/.../grpc.sock``) for the server to bind; ``open()`` then binds the
    public socket; ``close()`` removes both.
    """

    def __init__(self, path: str, policy: Policy, group: int | None = None):
        self.path = path
        self.policy = policy
        self.group = group
        self.private_dir = ""
        self.internal = ""
        self._server: asyncio.AbstractServer | None = None
        self._callers: dict[str, Caller] = {}
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._tag = f"kvd-{os.getpid()}-{secrets.token_hex(6)}"

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
            # Not connectable before listen(): set who may connect first.
            os.chmod(self.path, SOCKET_MODE)
            if self.group is not None:
                try:
                    os.chown(self.path, -1, self.group)
                except OSError as e:
                    raise OSError(f"cannot give the engine socket {self.path} to group {self.group} "
                                  f"(engine_socket_group; the daemon must be root or a member): "
                                  f"{e.strerror or e}") from None
            s.listen(1024)
            s.setblocking(False)
        except BaseException:
            s.close()
            if bound:
                os.unlink(self.path)
            raise
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._accepted, sock=s)

    def _accepted(self) -> _Relay:
        return _Front(self)

    async def _connect(self, front: _Relay, transport) -> None:
        try:
            sock = transport.get_extra_info("socket")
            pid, uid, gid, gids = peer_credentials(sock)
        except OSError as e:
            log.warning("engine socket: cannot read the caller's credentials (%s); connection closed", e)
            transport.close()
            return
        caller = Caller(pid, uid, gid, gids, self.policy.admits(uid, gids))
        if not caller.admitted:
            log.warning("engine socket: %s is not admitted (admitted: %s; settings allowed_uids, allowed_gids); "
                        "its calls are refused", caller, self.policy.describe())
        name = f"{self._tag}-{next(self._ids)}"
        back_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            back_sock.bind("\0" + name)
            back_sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(back_sock, self.internal)
            # The private directory sits next to the engine socket, where the
            # socket's group may rename entries: relay only to ourselves.
            if peer_credentials(back_sock)[0] != os.getpid():
                raise OSError(f"{self.internal} is not this daemon's socket any more")
        except OSError as e:
            back_sock.close()
            log.warning("engine socket: relay to gRPC failed: %s", e)
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
            log.warning("engine socket: relay to gRPC failed: %s", e)
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
        """Stops accepting; removes the engine socket and the private directory."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for p in (self.path,):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        if self.private_dir:
            shutil.rmtree(self.private_dir, ignore_errors=True)


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
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    "kvd: connection not made through the engine socket")
            if not c.admitted:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"kvd: {c} is not admitted on the engine socket (admitted: "
                                    f"{gate.policy.describe()}; daemon settings allowed_uids, allowed_gids)")

        return wrap_handler(handler, check)


def wrap_handler(handler, check):
    """``handler`` with ``await check(context)`` before its behavior runs."""
    kind = ("unary_unary" if not handler.request_streaming and not handler.response_streaming else
            "unary_stream" if handler.response_streaming and not handler.request_streaming else
            "stream_unary" if not handler.response_streaming else "stream_stream")
    behavior = getattr(handler, kind)
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
