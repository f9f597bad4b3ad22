"""The session thread of an ``EngineClient``: one session at a time,
reopened after every break.

A session runs on the daemon's command socket (``kvd.client.command_socket``:
frames on a Unix socket, no gRPC per command) when the daemon offers one and
the client allows it (``command_socket``), else on the gRPC ``Session``
stream; both carry the same messages and end the same ways, and each new
session tries the command socket again. Per session: ``OpenSession``, then
the holds of the last session again (``Pending.holds_again``), then every
command queued, built outside the lock (by gRPC's request iterator, or by the
``kvd-session-send`` thread on the socket); this thread reads the daemon's
events and files them (``Pending.on_answer``). When the session breaks, its
loads fail (``Pending.fail_stream``); the thread waits a jittered, doubling
backoff, re-registers the worker (the client's ``reregister``) and opens the
next.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator

import grpc
from google.protobuf.message import DecodeError

from kvd.client.channel import EngineClientError, rpc_status
from kvd.client.command_socket import CommandConnection
from kvd.client.commands import Stream
from kvd.command_wire import FrameError, refusal
from kvd.client.pending import Pending
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

log = logging.getLogger("kvd.client")

#: Seconds between two log lines of reconnects that keep failing (the first is logged at once).
RECONNECT_LOG_S = 60.0


class SessionLoop:
    """The background thread (``kvd-session``) that owns the session stream.

    Args:
        stub: the client's ``EngineService`` stub for a call made now (the
            client replaces its channel when a look finds no daemon there).
        pending: the client's book of commands and events.
        open_session: the ``OpenSession`` of the next stream (the worker and
            the last registration's session token).
        reregister: registers the worker again before a new stream; raises
            ``EngineClientError`` to retry after the backoff.
        backoff_initial_s, backoff_max_s: reconnect backoff (seconds; doubles,
            jittered to 50..100 %, back to the initial value once a stream opens).
        address: the daemon's engine socket (a ``normalize_address`` result),
            whose command socket is tried first; "" or ``command_socket``
            False: the gRPC stream only.
        max_message_bytes: the longest event frame accepted on the command socket.
        connect_timeout_s: seconds a connection to the command socket may take.
    """

    def __init__(
        self,
        stub: Callable[[], pb_grpc.EngineServiceStub],
        pending: Pending,
        *,
        open_session: Callable[[], pb.OpenSession],
        reregister: Callable[[], None],
        backoff_initial_s: float,
        backoff_max_s: float,
        address: str = "",
        command_socket: bool = True,
        max_message_bytes: int = 16 * 1024 * 1024,
        connect_timeout_s: float = 5.0,
    ):
        self._stub = stub
        self._command_address = address if command_socket and address.startswith("unix:") else ""
        self._max_message_bytes = max_message_bytes
        self._connect_timeout_s = connect_timeout_s
        self._conn: CommandConnection | None = None
        self._sender: threading.Thread | None = None
        self._pending = pending
        self._open_session = open_session
        self._reregister = reregister
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.opened = threading.Event()
        self._call: grpc.Call | None = None
        self._thread: threading.Thread | None = None
        #: The daemon's ``SessionOpened`` of the current (or last) stream.
        self.session_info: pb.SessionOpened | None = None
        # Failed reconnects in a row, since when, and when last logged (_reconnect_failed).
        self._fails = 0
        self._failing_since = self._logged_at = 0.0
        #: Streams opened so far (1 after the first session; +1 per reconnect).
        self.sessions_opened = 0
        #: "socket" or "grpc": what carries the current (or last) session.
        self.transport = ""

    def start(self) -> None:
        """Starts the thread (once; a second call does nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvd-session", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """After ``pending.closing`` is set: cancels the stream and waits for
        the thread (at most ``timeout_s`` seconds)."""
        call, conn = self._call, self._conn
        if call is not None:
            call.cancel()
        if conn is not None:
            conn.shutdown()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _batches(self, stream: Stream) -> Iterator[list[pb.SessionCommand]]:
        """What one session sends, a batch at a time: ``OpenSession``, the
        holds again, then every command queued (consumed by one thread)."""
        yield [pb.SessionCommand(open=self._open_session())]
        again = self._pending.holds_again(stream)
        if again:
            log.info("kvd %s: holding %d leases again after reconnecting", self._pending.label, len(again))
            yield again
        while True:
            batch = self._pending.next_batch(stream)
            if batch is None:
                return
            built = []
            # Built here, outside the lock: the engine thread never waits for it.
            for cmd in batch:
                try:
                    built.append(cmd.build())
                except Exception as e:  # noqa: BLE001 - arguments protobuf refuses, a deferred load's refusal:
                    # that command fails here; none may end the session of every other command.
                    abort = self._pending.refuse(cmd, e)
                    if abort is not None:  # its source is known: it frees its blocks now
                        built.append(abort)
            if built:
                yield built

    def _commands(self, stream: Stream) -> Iterator[pb.SessionCommand]:
        """The request iterator of one gRPC stream (consumed by a gRPC thread)."""
        for batch in self._batches(stream):
            yield from batch

    def _send(self, conn: CommandConnection, stream: Stream) -> None:
        """The ``kvd-session-send`` thread of one command-socket session."""
        try:
            for batch in self._batches(stream):
                conn.send(batch)
        except OSError as e:
            log.debug("kvd %s: command socket send: %s", self._pending.label, e)
        except Exception:  # never let the thread die silently
            log.exception("kvd %s: session sender error", self._pending.label)
        conn.shutdown()  # the reader ends too: the session is over

    def _connect(self) -> CommandConnection | None:
        """A connection to the daemon's command socket, or None: not allowed,
        or not offered (the gRPC stream carries this session)."""
        if not self._command_address:
            return None
        try:
            return CommandConnection.connect(self._command_address, max_message_bytes=self._max_message_bytes,
                                             timeout_s=self._connect_timeout_s)
        except PermissionError as e:  # another user's socket at the path (CommandConnection.connect)
            log.warning("kvd %s: %s; session on the gRPC stream", self._pending.label, e)
            return None
        except OSError as e:
            log.info("kvd %s: no command socket (%s): session on the gRPC stream", self._pending.label,
                     e.strerror or e)
            return None

    def _socket_events(self, conn: CommandConnection, stream: Stream) -> Iterator[pb.SessionEvent]:
        """The events of one command-socket session. Raises ``SessionEnded``
        with the daemon's reason when it refused or ended the session."""
        sender = threading.Thread(target=self._send, args=(conn, stream), name="kvd-session-send", daemon=True)
        sender.start()
        self._sender = sender
        for event in conn.events():
            kind = event.WhichOneof("event")
            if kind == "rejected" and refusal(event.rejected.request_id, event.rejected.reason):
                # The daemon refused (before "opened") or ended the session:
                # the stream's status as text ("RESOURCE_EXHAUSTED: ...");
                # the close follows.
                raise SessionEnded(event.rejected.reason)
            if kind != "opened" and not self.opened.is_set():
                raise SessionEnded(f"first event is {kind!r}, not 'opened'")
            yield event

    def _on_event(self, event: pb.SessionEvent) -> None:
        kind = event.WhichOneof("event")
        if kind != "opened":
            self._pending.on_answer(event, kind)
            return
        self.session_info = event.opened
        self.sessions_opened += 1
        self.opened.set()
        log.info("kvd %s: session open (agent %s, daemon %s)", self._pending.label, event.opened.agent_name,
                 event.opened.daemon_version)

    def _backoff(self, backoff: float) -> float:
        """Waits about ``backoff`` seconds (jittered; ends early on close);
        returns the next backoff."""
        self._pending.closing.wait(backoff * (0.5 + random.random() / 2))
        return min(backoff * 2, self.backoff_max_s)

    def _reconnect_failed(self, error: EngineClientError) -> None:
        """Logs a failed reconnect: the first of a run at WARNING, then at
        most one line each :data:`RECONNECT_LOG_S` with the count (a daemon
        stopped for an hour made ~2,400 lines an hour, one per try)."""
        now = time.monotonic()
        self._fails += 1
        if self._fails == 1:
            self._failing_since = self._logged_at = now
            log.warning("kvd %s: reconnect: %s; retrying every %.2f s or less, said again every %g s while it "
                        "fails", self._pending.label, error, self.backoff_max_s, RECONNECT_LOG_S)
        elif now - self._logged_at >= RECONNECT_LOG_S:
            self._logged_at = now
            log.warning("kvd %s: reconnect: still failing after %d tries over %.0f s: %s", self._pending.label,
                        self._fails, now - self._failing_since, error)

    def _run(self) -> None:
        closing = self._pending.closing
        backoff = self.backoff_initial_s
        epoch = 0
        first = True
        while not closing.is_set():
            if not first:
                try:
                    self._reregister()
                except EngineClientError as e:
                    self._reconnect_failed(e)
                    backoff = self._backoff(backoff)
                    continue
                if self._fails:
                    log.info("kvd %s: reconnected after %d failed tries over %.1f s", self._pending.label,
                             self._fails, time.monotonic() - self._failing_since)
                    self._fails = 0
            first = False
            epoch += 1
            stream = Stream(epoch)
            reason = "the daemon ended the session"
            conn = self._connect()
            self.transport = "socket" if conn is not None else "grpc"
            try:
                if conn is not None:
                    self._conn = conn
                    events = self._socket_events(conn, stream)
                else:
                    events = self._call = self._stub().Session(self._commands(stream), wait_for_ready=False)
                for event in events:
                    if event.WhichOneof("event") == "opened":
                        backoff = self.backoff_initial_s
                    self._on_event(event)
            except grpc.RpcError as e:
                reason = rpc_status(e)[1]
            except SessionEnded as e:
                reason = str(e)
            except (OSError, FrameError, DecodeError) as e:
                reason = f"command socket: {e}"
            except Exception as e:  # never let the thread die silently
                reason = f"{type(e).__name__}: {e}"
                log.exception("kvd %s: session thread error", self._pending.label)
            finally:
                self.opened.clear()
                self._call = None
                if closing.is_set():  # EngineClient.close ended it, not the daemon
                    reason = "the engine closed its client"
                self._pending.fail_stream(stream, reason)
                if conn is not None:
                    self._end_socket(conn)
            if closing.is_set():
                break
            log.warning("kvd %s: session lost (%s); reconnecting in about %.2f s", self._pending.label, reason, backoff)
            backoff = self._backoff(backoff)

    def _end_socket(self, conn: CommandConnection) -> None:
        """After ``fail_stream`` (its sender sees the session done): ends the
        connection, waits for the sender, closes the socket."""
        conn.shutdown()
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.join(5.0)
        self._conn = None
        conn.close()


class SessionEnded(Exception):
    """The daemon refused or ended a command-socket session; the message is
    its reason (the status name of the gRPC stream's end, then the details)."""
