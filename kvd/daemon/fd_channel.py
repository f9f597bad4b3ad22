"""The fd side channel: engines hand the daemon their KV cache memory as fds.

gRPC carries no file descriptors, so a sealed memfd (``kvd.shim.memory.memfd``)
reaches the daemon over a second Unix socket beside the engine socket
(``kvd.fd_wire``: the format; ``kvd.fd_wire.fd_socket_path``: the path),
with ``SCM_RIGHTS`` (unix(7)). The daemon answers one id per fd; the engine
names those ids in ``RegisterEngine`` (``MEMORY_KIND_MEMFD``), where
``EngineService`` claims them (:meth:`FdTable.claim`) and the core maps the
fds (``kvd.core.memory.FdMapping``, which checks the seals).

Admission and bounds, as the engine socket's (``kvd.daemon.local_gate``):

- the socket has the engine socket's mode (0660) and group; every
  connection's caller is read from the kernel (``SO_PEERCRED``,
  ``SO_PEERGROUPS``) and admitted by the same ``Policy``; a caller not
  admitted gets a refusal and its fds are closed unread (the kernel closes
  fds still queued on a socket that is closed);
- connections open at once are capped (``max_connections``, and
  ``max_per_uid`` per caller uid: one user cannot keep the others' engines
  from handing their memory over); one that sends
  nothing within ``timeout_s`` is closed; one message per connection, of at
  most ``kvd.fd_wire.MAX_MESSAGE_BYTES`` bytes and ``kvd.fd_wire.MAX_FDS``
  fds (a truncated message or ancillary buffer is refused: the kernel has
  closed the fds that did not fit);
- fds received and not yet claimed are capped per uid (``max_pending_per_uid``)
  and overall (``max_pending``), and closed ``claim_timeout_s`` after they
  arrived;
- an fd that is not shared memory (``F_GET_SEALS`` fails: a file, a pipe,
  a socket) is refused at once, the request's fds closed: one of a FUSE
  mount could otherwise hold the event loop in a later ``fstat``;
- an id is claimed once, by the uid that sent its fd.

Every refusal is an answer with a message (``kvd.fd_wire.encode_answer``)
and a throttled log line; the daemon keeps serving.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvd import fd_wire as wire
from kvd.core.memory import SegmentError, memfd_seals
from kvd.daemon.local_gate import Policy, bind_side_socket, peer_credentials, unlink_own
from kvd.daemon.logs import Throttled

log = logging.getLogger("kvd.fd_channel")

_FD_BYTES = array.array("i").itemsize
#: The most fds one message can carry (Linux ``SCM_MAX_FD``,
#: include/net/scm.h). Room for them all is read: fds that do not fit are
#: dropped by the kernel inside ``recvmsg``, on the event loop, and a drop
#: may wait (an attacker review's 65th fd, a lingering TCP socket, held the
#: loop 15 s); read, they go to the closer thread with the refusal.
SCM_MAX_FD = 253


class ClaimError(LookupError):
    """An fd id that cannot be claimed (unknown, expired, claimed, another
    uid's); the message says which, without telling another uid's ids apart."""


@dataclass
class _Pending:
    fd: int
    uid: int
    pid: int
    deadline: float  # time.monotonic() seconds


class FdTable:
    """Fds received and not yet claimed, by id (no I/O but ``os.close``).

    Args:
        claim_timeout_s: seconds an fd waits for its ``RegisterEngine``.
        max_pending: fds held at once, all callers.
        max_pending_per_uid: fds held at once per caller uid.
    """

    def __init__(self, claim_timeout_s: float = 30.0, max_pending: int = 512, max_pending_per_uid: int = 256):
        self.claim_timeout_s = claim_timeout_s
        self.max_pending = max_pending
        self.max_pending_per_uid = max_pending_per_uid
        self._pending: dict[str, _Pending] = {}
        self.expired = 0  # fds closed unclaimed at their deadline
        # How claimed-and-done and expired fds are closed: the channel sets
        # its closer thread's (the last close of a populated memfd frees its
        # pages inside close(): 0.17 s a GiB on the loop, attacker review).
        self.close_fd: Callable[[int], None] = _close

    def __len__(self) -> int:
        return len(self._pending)

    def room_for(self, uid: int, n: int) -> str:
        """"" when ``n`` more fds of ``uid`` fit, else why not (for the refusal)."""
        self.expire()
        if len(self._pending) + n > self.max_pending:
            return f"the daemon holds {len(self._pending)} unclaimed fds (at most {self.max_pending})"
        mine = sum(1 for p in self._pending.values() if p.uid == uid)
        if mine + n > self.max_pending_per_uid:
            return f"uid {uid} has {mine} unclaimed fds (at most {self.max_pending_per_uid})"
        return ""

    def add(self, fds: list[int], uid: int, pid: int) -> list[str]:
        """Takes ownership of ``fds`` (sent by ``uid``/``pid``); returns their ids."""
        deadline = time.monotonic() + self.claim_timeout_s
        ids = []
        for fd in fds:
            fd_id = secrets.token_hex(wire.ID_CHARS // 2)
            self._pending[fd_id] = _Pending(fd, uid, pid, deadline)
            ids.append(fd_id)
        return ids

    def claim(self, fd_id: str, uid: int) -> int:
        """The fd of ``fd_id``, which the caller now owns (and closes).

        Raises:
            ClaimError: unknown, expired or already claimed, or sent by
                another uid (root may claim any).
        """
        self.expire()
        p = self._pending.get(fd_id)
        if p is None or (uid != 0 and p.uid != uid):
            raise ClaimError(f"fd id {fd_id[:8]}...: unknown, already claimed, expired (fds wait "
                             f"{self.claim_timeout_s:g} s) or sent by another user")
        del self._pending[fd_id]
        return p.fd

    @contextlib.contextmanager
    def claiming(self):
        """``with table.claiming() as claim:``: ``claim(fd_id, uid)`` as
        :meth:`claim`; every fd claimed through it is closed when the block
        ends, however it ends (the mappings made meanwhile hold the pages)."""
        taken: list[int] = []

        def claim(fd_id: str, uid: int) -> int:
            taken.append(self.claim(fd_id, uid))
            return taken[-1]

        try:
            yield claim
        finally:
            for fd in taken:
                self.close_fd(fd)

    def expire(self, now: float | None = None) -> int:
        """Closes the fds past their deadline; returns how many."""
        now = time.monotonic() if now is None else now
        late = [k for k, p in self._pending.items() if p.deadline <= now]
        for k in late:
            self.close_fd(self._pending.pop(k).fd)
        if late:
            self.expired += len(late)
            log.info("fd channel: closed %d fd(s) not claimed within %g s", len(late), self.claim_timeout_s)
        return len(late)

    def close(self) -> None:
        """Closes every fd held (daemon shutdown)."""
        for p in self._pending.values():
            _close(p.fd)
        self._pending.clear()


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def received_fds(ancdata) -> list[int]:
    """Every fd in the ``SCM_RIGHTS`` items of ``recvmsg``'s ancillary data."""
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[: len(data) - len(data) % _FD_BYTES])
            fds.extend(a)
    return fds


#: Closes of callers' fds and connections waiting on the closer thread past
#: which the channel stops accepting until they are done (each holds a
#: daemon fd; a connection may also hold the fds still queued on it).
MAX_PENDING_CLOSES = 256


class _Closer:
    """Closes what callers sent (fds, and connections with fds still queued
    on them) on a thread of its own. A close can wait: the last reference to
    a TCP socket with ``SO_LINGER`` and unsent data waits out the linger,
    a FUSE file's close waits for its server's FLUSH answer; on the event
    loop either held every engine up as long as the caller liked (9-15 s
    measured, attacker review). ``pending``: closes not done yet;
    ``on_idle`` (called on the closer thread) when they fall under half of
    ``MAX_PENDING_CLOSES``."""

    def __init__(self, on_idle=None):
        self.pending = 0
        self.on_idle = on_idle
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def close(self, obj) -> None:
        """Closes ``obj`` (an fd number or a socket) on the closer thread, or
        runs it there (a callable that closes what it holds)."""
        with self._lock:
            self.pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvd-fd-closer", daemon=True)
                self._thread.start()
        self._calls.put(obj)

    def _run(self) -> None:
        while True:
            obj = self._calls.get()
            try:
                if isinstance(obj, int):
                    os.close(obj)
                elif callable(obj):
                    obj()
                else:
                    obj.close()
            except OSError:
                pass
            except Exception:  # a bug: said, and the thread goes on closing
                log.exception("fd channel: closing failed")
            del obj
            with self._lock:
                self.pending -= 1
                idle = self.pending == MAX_PENDING_CLOSES // 2
            if idle and self.on_idle is not None:
                self.on_idle()


class FdChannel:
    """The fd side channel's socket (see the module).

    Args:
        path: its socket (``kvd.fd_wire.fd_socket_path(engine_socket)``).
        policy: who is admitted (the engine socket's ``Policy``).
        group: gid of the socket file (None: the daemon's group).
        table: where received fds wait for their claim.
        max_connections: connections open at once, all callers.
        max_per_uid: connections open at once per caller uid.
        timeout_s: seconds a connection may take to send its request.

    ``open()`` binds and starts accepting (on the running loop); ``close()``
    stops, removes the socket and closes every unclaimed fd. ``refused``
    counts refusals; ``accepted`` counts fds taken.
    """

    def __init__(self, path: str, policy: Policy, group: int | None = None, table: FdTable | None = None, *,
                 max_connections: int = 64, max_per_uid: int = 16, timeout_s: float = 5.0):
        self.path = path
        self.policy = policy
        self.group = group
        self.table = table or FdTable()
        self.max_connections = max_connections
        self.max_per_uid = max_per_uid
        self._open_by_uid: collections.Counter[int] = collections.Counter()
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file bound
        self._conns: dict[int, tuple[socket.socket, asyncio.TimerHandle, int]] = {}  # fd -> (conn, timer, uid)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self.refused = 0
        self.accepted = 0
        self._warn = Throttled(log)
        self._closer = _Closer(self._closer_idle)
        self.table.close_fd = self._closer.close
        self._accepting = False

    async def open(self) -> None:
        """Binds ``path`` (mode 0660, ``group``) and starts accepting.
        Raises OSError when it cannot be bound or given to the group."""
        s, self._bound = bind_side_socket(self.path, socket.SOCK_SEQPACKET, self.group, 128, "fd channel")
        self._sock = s
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(s.fileno(), self._accept)
        self._accepting = True
        self._tick()

    def _closer_idle(self) -> None:
        """Closer thread: its backlog is down; accepting again (on the loop)."""
        try:
            self._loop.call_soon_threadsafe(self._resume_accept)
        except RuntimeError:  # the loop is closed
            pass

    def _resume_accept(self) -> None:
        if not self._accepting and self._sock is not None:
            self._accepting = True
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def _tick(self) -> None:
        self.table.expire()
        self._expiry = self._loop.call_later(max(0.5, self.table.claim_timeout_s / 4), self._tick)

    def _accept(self) -> None:
        while True:
            if self._closer.pending >= MAX_PENDING_CLOSES:
                # Closes of what callers sent wait (a close that blocks on
                # the closer thread): no more connections, and their fds,
                # until they are done; callers wait in the listen backlog.
                self._accepting = False
                self._loop.remove_reader(self._sock.fileno())
                self._warn.warning("fd channel: %d closes of callers' fds pending (one is slow to close); "
                                   "not accepting until they are done", self._closer.pending)
                if self._closer.pending < MAX_PENDING_CLOSES // 2:  # done meanwhile: on_idle may have passed
                    self._resume_accept()
                return
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: the daemon keeps serving
                self._warn.warning("fd channel: accept failed: %s", e)
                return
            conn.setblocking(False)
            try:
                pid, uid, gid, gids = peer_credentials(conn)
            except OSError as e:
                self._refuse(conn, f"cannot read the caller's credentials ({e})")
                continue
            who = f"pid {pid or '?'} uid {uid} gid {gid}"
            if len(self._conns) >= self.max_connections:
                self._refuse(conn, f"{who}: {len(self._conns)} fd channel connections open (at most "
                                   f"{self.max_connections}); try again")
                continue
            if not self.policy.admits(uid, gids):
                self._refuse(conn, f"{who} is not admitted on the engine socket (admitted: "
                                   f"{self.policy.describe()}; daemon settings allowed_uids, allowed_gids)")
                continue
            if self._open_by_uid[uid] >= self.max_per_uid:
                self._refuse(conn, f"{who}: uid {uid} has {self._open_by_uid[uid]} fd channel connections open "
                                   f"(at most {self.max_per_uid}); try again")
                continue
            self._wait(conn, pid, uid, who)

    def _wait(self, conn: socket.socket, pid: int, uid: int, who: str) -> None:
        """Counts ``conn`` open for ``uid`` and waits (``timeout_s``) for its request."""
        fd = conn.fileno()
        self._conns[fd] = (conn, self._loop.call_later(self.timeout_s, self._timed_out, fd, who), uid)
        self._open_by_uid[uid] += 1
        self._loop.add_reader(fd, self._receive, fd, pid, uid, who)

    def _timed_out(self, fd: int, who: str) -> None:
        conn = self._drop(fd)
        if conn is not None:
            self._refuse(conn, f"{who} sent no request within {self.timeout_s:g} s")

    def _drop(self, fd: int) -> socket.socket | None:
        entry = self._conns.pop(fd, None)
        if entry is None:
            return None
        conn, timer, uid = entry
        timer.cancel()
        self._loop.remove_reader(fd)
        self._open_by_uid[uid] -= 1
        if self._open_by_uid[uid] <= 0:
            del self._open_by_uid[uid]
        return conn

    def _receive(self, fd: int, pid: int, uid: int, who: str) -> None:
        conn = self._drop(fd)
        if conn is None:
            return
        try:
            data, anc, flags, _ = conn.recvmsg(wire.MAX_MESSAGE_BYTES, socket.CMSG_SPACE(SCM_MAX_FD * _FD_BYTES),
                                               socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):  # woken without data: wait again
            self._wait(conn, pid, uid, who)
            return
        except OSError as e:
            self._refuse(conn, f"{who}: cannot read the request ({e})")
            return
        fds = received_fds(anc)
        why = self._check(data, flags, fds, uid)
        if why:
            for f in fds:
                self._closer.close(f)  # not memfds: their close may wait (_Closer)
            self._refuse(conn, f"{who}: {why}")
            return
        ids = self.table.add(fds, uid, pid)
        self.accepted += len(fds)
        log.debug("fd channel: %d fd(s) from %s", len(fds), who)
        self._answer(conn, wire.encode_answer(ids))

    def _check(self, data: bytes, flags: int, fds: list[int], uid: int) -> str:
        """"" for a good request, else why it is refused."""
        if not data:
            return "connection closed without a request"
        if flags & socket.MSG_TRUNC:
            return f"request longer than {wire.MAX_MESSAGE_BYTES} bytes"
        if flags & socket.MSG_CTRUNC or len(fds) > wire.MAX_FDS:
            return f"more than {wire.MAX_FDS} fds in one request"
        try:
            nfds = wire.parse_request(data)
        except wire.WireError as e:
            return str(e)
        if nfds != len(fds):
            return f"request header announces {nfds} fds, {len(fds)} came with it"
        for i, f in enumerate(fds):
            # Only shared memory is kept (its seals are read without asking a
            # filesystem); anything else never enters the table.
            try:
                memfd_seals(f, f"fd {i} of the request")
            except SegmentError as e:
                return str(e)
        return self.table.room_for(uid, nfds)

    def _refuse(self, conn: socket.socket, why: str) -> None:
        self.refused += 1
        self._warn.warning("fd channel: refused: %s", why)
        answer = wire.encode_answer(refused=f"kvd: {why}")

        def refuse() -> None:  # on the closer thread: fds dropped there may take their time
            # What the caller sent already is read first: a socket closed with
            # a message unread resets the caller's, whose read then fails
            # (ECONNRESET) before it sees the answer. Read without room for
            # fds: the kernel drops them (here, not on the event loop).
            for _ in range(4):
                try:
                    conn.recv(wire.MAX_MESSAGE_BYTES, socket.MSG_DONTWAIT)
                except OSError:
                    break  # nothing (more) there
            self._answer_now(conn, answer)

        self._closer.close(refuse)

    def _answer(self, conn: socket.socket, data: bytes) -> None:
        """Sends ``data`` and closes ``conn``, on the closer thread (fds still
        queued on it are dropped with it)."""
        self._closer.close(lambda: self._answer_now(conn, data))

    @staticmethod
    def _answer_now(conn: socket.socket, data: bytes) -> None:
        try:
            conn.send(data)  # small: fits the socket buffer, never blocks
        except OSError:
            pass  # the engine hung up: nothing to tell
        conn.close()

    async def close(self) -> None:
        """Stops accepting; closes open connections and unclaimed fds; removes the socket."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        for fd in list(self._conns):
            conn = self._drop(fd)
            if conn is not None:
                self._closer.close(conn)
        if self._sock is not None:
            if self._accepting:
                self._loop.remove_reader(self._sock.fileno())
            self._accepting = False
            self._sock.close()
            self._sock = None
            unlink_own(self.path, self._bound, "fd channel")
        self.table.close()
