"""In-process fakes of kvd's gRPC services, for scenarios the real daemon
does not produce on demand: a daemon that takes 1 s per command, one that
never answers, one that rejects, one that answers twice, one that is stopped
and restarted (:class:`FakeDaemon`); a peer daemon that forges its
handshake (:class:`FakePeer`), one that hangs (:func:`blackhole`) or is not
there (:func:`closed_address`).

A fake is never the only test of a path that can run for real: the real
daemon's tests use :mod:`kvd.testing.daemons`.
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from kvd import fd_wire
from kvd.testing.sessions import MESSAGE_OPTIONS
from kvd.testing.util import free_port
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

# The peer address every fake registration answers (nothing listens there).
PEER_ADDRESS = "127.0.0.1:47001"


class FakeEngineService(pb_grpc.EngineServiceServicer):
    """Answers commands after ``delay_s`` each, as ``load_mode``/``hold_mode`` say.

    load_mode: ``answer`` (recv_done), ``fail`` (load_failed), ``reject``
    (rejected), ``never`` (silence), ``twice`` (recv_done two times).
    hold_mode: ``never`` (lease kept until release), ``done`` (send_done at
    once), ``expire`` (send_done(expired) at once).

    ``RenewLeases`` is recorded (``renewals``) and answered renewed with
    ``renew_left_s`` seconds left, or ``not_held`` for request ids in
    ``not_held``.

    A registration with ``DATA_PATH_STAGED`` gets real staging mirrors (one
    new POSIX shm object per segment, ``/kvdtest_<pid>_stage_*``, unlinked by
    :meth:`unlink_staging`), as the real daemon makes them.
    """

    def __init__(self, delay_s: float = 0.0, load_mode: str = "answer", hold_mode: str = "never"):
        self.delay_s = delay_s
        self.load_mode = load_mode
        self.hold_mode = hold_mode
        self.lock = threading.Lock()
        self.registers: list[pb.RegisterEngineRequest] = []
        self.unregisters: list[pb.UnregisterEngineRequest] = []
        self.commands: list[pb.SessionCommand] = []
        self.sessions = 0
        self.staging: list[str] = []  # shm names of every mirror made
        self.renewals: list[pb.RenewLeasesRequest] = []
        self.renew_left_s = 0.9
        self.not_held: set[str] = set()

    def RegisterEngine(self, request, context):
        with self.lock:
            self.registers.append(request)
        resp = pb.RegisterEngineResponse(
            agent_name="fake-agent", peer_address=PEER_ADDRESS, compat_hash="0" * 16,
            registered_bytes=sum(s.size for s in request.segments), data_path=pb.DATA_PATH_DIRECT,
        )
        if request.data_path == pb.DATA_PATH_STAGED:
            resp.data_path = pb.DATA_PATH_STAGED
            for seg in request.segments:
                name = f"/kvdtest_{os.getpid()}_stage_{uuid.uuid4().hex[:8]}"
                fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.ftruncate(fd, seg.size)
                finally:
                    os.close(fd)
                with self.lock:
                    self.staging.append(name)
                resp.staging_segments.append(pb.Segment(kind=pb.MEMORY_KIND_SHM, name=name, size=seg.size))
        return resp

    def unlink_staging(self) -> None:
        """Unlinks every staging mirror made so far."""
        with self.lock:
            names, self.staging = self.staging, []
        for name in names:
            try:
                os.unlink("/dev/shm" + name)
            except FileNotFoundError:
                pass

    def UnregisterEngine(self, request, context):
        with self.lock:
            self.unregisters.append(request)
        return pb.UnregisterEngineResponse(released_leases=0)

    def RenewLeases(self, request, context):
        with self.lock:
            self.renewals.append(request)
            gone = set(self.not_held)
        return pb.RenewLeasesResponse(results=[
            pb.LeaseRenewed(request_id=r.request_id, reason="not_held") if r.request_id in gone
            else pb.LeaseRenewed(request_id=r.request_id, left_s=self.renew_left_s) for r in request.renewals])

    def renewed_ids(self) -> list[list[str]]:
        """The request ids of each RenewLeases call, in arrival order."""
        with self.lock:
            return [[r.request_id for r in c.renewals] for c in self.renewals]

    def GetStats(self, request, context):
        return pb.StatsResponse(peer_address=PEER_ADDRESS, daemon_version="fake", sessions=self.sessions)

    def Session(self, request_iterator, context):
        first = next(request_iterator)
        if first.WhichOneof("command") != "open":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first command must be open")
        with self.lock:
            self.sessions += 1
        yield pb.SessionEvent(opened=pb.SessionOpened(agent_name="fake-agent", daemon_version="fake"))
        for cmd in request_iterator:
            with self.lock:
                self.commands.append(cmd)
            if self.delay_s:
                time.sleep(self.delay_s)
            yield from self._respond(cmd)

    def _respond(self, cmd):
        kind = cmd.WhichOneof("command")
        if kind == "load":
            rid = cmd.load.request_id
            local = [b for g in cmd.load.local_groups for b in g.ids]
            n = len(local)
            if self.load_mode in ("answer", "twice"):
                for _ in range(2 if self.load_mode == "twice" else 1):
                    yield pb.SessionEvent(recv_done=pb.RecvDone(
                        request_id=rid, num_blocks=n, bytes=n * 1024, num_descriptors=2 * n, duration_s=0.001 * n,
                        post_duration_s=0.0005 * n))
            elif self.load_mode == "fail":
                yield pb.SessionEvent(load_failed=pb.LoadFailed(
                    request_id=rid, failed_block_ids=local, reason="fake failure"))
            elif self.load_mode == "reject":
                yield pb.SessionEvent(rejected=pb.CommandRejected(request_id=rid, reason="fake rejection"))
        elif kind == "hold" and self.hold_mode in ("done", "expire"):
            yield pb.SessionEvent(send_done=pb.SendDone(request_id=cmd.hold.request_id,
                                                        expired=self.hold_mode == "expire"))
        elif kind == "release":
            yield pb.SessionEvent(send_done=pb.SendDone(request_id=cmd.release.request_id, released=True))

    def received(self, kind: str) -> list:
        """The messages of the ``kind`` commands that arrived (``load``:
        ``LoadBlocks``, ``hold``, ``abort_load``, ...), in arrival order."""
        with self.lock:
            return [getattr(c, kind) for c in self.commands if c.WhichOneof("command") == kind]

    def count(self, kind: str) -> int:
        """How many commands of ``kind`` (``load``, ``hold``, ...) arrived."""
        return len(self.received(kind))


class FakeDaemon:
    """A :class:`FakeEngineService` served on ``socket``; restartable."""

    def __init__(self, socket: str, **kwargs):
        self.socket = socket
        self.service = FakeEngineService(**kwargs)
        self.server: grpc.Server | None = None

    def start(self) -> FakeDaemon:
        """Serves on ``socket`` (a stale socket file is removed first), and
        the memory handover's fd side channel beside it (``kvd.fd_wire``:
        every fd is accepted and kept, ``self.fds`` by id); returns self."""
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        self.server = grpc.server(ThreadPoolExecutor(max_workers=16))
        pb_grpc.add_EngineServiceServicer_to_server(self.service, self.server)
        self.server.add_insecure_port(f"unix://{self.socket}")
        self.server.start()
        self._start_fd_channel()
        return self

    def _start_fd_channel(self) -> None:
        path = fd_wire.fd_socket_path(self.socket)
        if os.path.exists(path):
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(path)
        listener.listen(16)
        self._fd_listener = listener
        if not hasattr(self, "fds"):
            self.fds: dict[str, int] = {}

        def serve() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return  # closed by stop()
                with conn:
                    data, anc, _, _ = conn.recvmsg(fd_wire.MAX_MESSAGE_BYTES,
                                                   socket.CMSG_SPACE(fd_wire.MAX_FDS * 4))
                    fds = [f for lvl, typ, raw in anc if lvl == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS
                           for f in array.array("i", raw[: len(raw) - len(raw) % 4])]
                    ids = [uuid.uuid4().hex for _ in fds]
                    self.fds.update(zip(ids, fds))
                    conn.send(fd_wire.encode_answer(ids))

        threading.Thread(target=serve, name="fake-fd-channel", daemon=True).start()

    def stop(self) -> None:
        """Stops serving (restartable); the staging mirrors made so far stay."""
        if self.server is not None:
            self.server.stop(grace=None).wait(5)
            self.server = None
        listener = getattr(self, "_fd_listener", None)
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            listener.close()
            self._fd_listener = None
            try:
                os.unlink(fd_wire.fd_socket_path(self.socket))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Stops, closes the fds it was handed and unlinks every staging mirror it made."""
        self.stop()
        for fd in getattr(self, "fds", {}).values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.service.unlink_staging()


def wait_events(client, predicate, timeout_s: float = 5.0, poll_s: float = 0.01) -> list:
    """Drains ``client`` until ``predicate(all events so far)``; returns them."""
    events: list = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events.extend(client.drain_events())
        if predicate(events):
            return events
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s; events so far: {events}")


def kinds(events) -> list[str]:
    """The event kind (``recv_done``, ``send_done``, ...) of each SessionEvent."""
    return [e.WhichOneof("event") for e in events]


class FakePeer:
    """An in-process ``PeerService`` on ``127.0.0.1:<free port>`` that answers
    every handshake with ``respond(request, context)`` (a forged
    ``HandshakeResponse``, or ``context.abort(...)``). Counts the calls.
    ``claims_to``: a real daemon's peer address that answers the reader's
    ``Claim`` on the hold (a relay in front of that daemon); without it a
    claim is UNIMPLEMENTED, as from a daemon that predates claims.
    ``notify(request, context)``: answers ``Notify`` (None: UNIMPLEMENTED)."""

    def __init__(self, respond, claims_to: str = "", notify=None):
        self.respond = respond
        self.calls = 0
        self.notifies = 0  # Notify calls answered or under way
        peer = self
        real = pb_grpc.PeerServiceStub(grpc.insecure_channel(claims_to)) if claims_to else None

        class _Servicer(pb_grpc.PeerServiceServicer):
            def Handshake(self, request, context):
                peer.calls += 1
                return peer.respond(request, context)

            def Notify(self, request, context):
                if notify is None:
                    context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
                peer.notifies += 1
                return notify(request, context)

            def Claim(self, request, context):
                if real is None:
                    context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
                try:
                    return real.Claim(request, timeout=context.time_remaining())
                except grpc.RpcError as e:
                    context.abort(e.code(), e.details())

        self.server = grpc.server(ThreadPoolExecutor(max_workers=4), options=MESSAGE_OPTIONS)
        pb_grpc.add_PeerServiceServicer_to_server(_Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def stop(self) -> None:
        """Stops serving (0.5 s grace)."""
        self.server.stop(grace=0.5).wait()


@contextlib.contextmanager
def blackhole():
    """``host:port`` of a TCP listener that accepts connections and never answers
    (a peer daemon that hangs: every handshake with it can only time out)."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    conns, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join(2)
        for c in conns:
            c.close()
        srv.close()


def closed_address() -> str:
    """``127.0.0.1:<port>`` where nothing listens (connection refused)."""
    return f"127.0.0.1:{free_port()}"
