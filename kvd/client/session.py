"""The session thread of an ``EngineClient``: one ``Session`` stream at a time,
reopened after every break.

Per stream: the request iterator sends ``OpenSession``, then the holds of the
last stream again (``Pending.holds_again``), then every command queued, built
outside the lock; the thread reads the daemon's events and files them
(``Pending.on_answer``). When the stream breaks, its loads fail
(``Pending.fail_stream``); the thread waits a jittered, doubling backoff,
re-registers the worker (the client's ``reregister``) and opens the next.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterator

import grpc

from kvd.client.channel import EngineClientError, rpc_status
from kvd.client.commands import Stream
from kvd.client.pending import Pending
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

log = logging.getLogger("kvd.client")


class SessionLoop:
    """The background thread (``kvd-session``) that owns the session stream.

    Args:
        stub: the client's ``EngineService`` stub.
        pending: the client's book of commands and events.
        open_session: the ``OpenSession`` of the next stream (the worker and
            the last registration's session token).
        reregister: registers the worker again before a new stream; raises
            ``EngineClientError`` to retry after the backoff.
        backoff_initial_s, backoff_max_s: reconnect backoff (seconds; doubles,
            jittered to 50..100 %, back to the initial value once a stream opens).
    """

    def __init__(
        self,
        stub: pb_grpc.EngineServiceStub,
        pending: Pending,
        *,
        open_session: Callable[[], pb.OpenSession],
        reregister: Callable[[], None],
        backoff_initial_s: float,
        backoff_max_s: float,
    ):
        self._stub = stub
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
        #: Streams opened so far (1 after the first session; +1 per reconnect).
        self.sessions_opened = 0

    def start(self) -> None:
        """Starts the thread (once; a second call does nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvd-session", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """After ``pending.closing`` is set: cancels the stream and waits for
        the thread (at most ``timeout_s`` seconds)."""
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _commands(self, stream: Stream) -> Iterator[pb.SessionCommand]:
        """The request iterator of one stream (consumed by a gRPC thread)."""
        yield pb.SessionCommand(open=self._open_session())
        again = self._pending.holds_again(stream)
        if again:
            log.info("kvd %s: holding %d leases again after reconnecting", self._pending.label, len(again))
        yield from again
        while True:
            batch = self._pending.next_batch(stream)
            if batch is None:
                return
            # Built here, outside the lock: the engine thread never waits for it.
            for cmd in batch:
                try:
                    built = cmd.build()
                except (TypeError, ValueError) as e:  # arguments protobuf refuses: the load fails here
                    self._pending.refuse(cmd, e)
                    continue
                yield built

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
                    log.warning("kvd %s: reconnect: %s; retrying in about %.2f s", self._pending.label, e, backoff)
                    backoff = self._backoff(backoff)
                    continue
            first = False
            epoch += 1
            stream = Stream(epoch)
            reason = "the daemon ended the session"
            try:
                call = self._stub.Session(self._commands(stream), wait_for_ready=False)
                self._call = call
                for event in call:
                    if event.WhichOneof("event") == "opened":
                        backoff = self.backoff_initial_s
                    self._on_event(event)
            except grpc.RpcError as e:
                reason = rpc_status(e)[1]
            except Exception as e:  # never let the thread die silently
                reason = f"{type(e).__name__}: {e}"
                log.exception("kvd %s: session thread error", self._pending.label)
            finally:
                self.opened.clear()
                self._call = None
                self._pending.fail_stream(stream, reason)
            if closing.is_set():
                break
            log.warning("kvd %s: session lost (%s); reconnecting in about %.2f s", self._pending.label, reason, backoff)
            backoff = self._backoff(backoff)
