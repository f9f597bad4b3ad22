"""``EngineClient``: an engine worker's gRPC client of its node's kvd daemon.

The engine's step must never wait on the network (a unary call over a Unix
socket costs about 0.8 ms here, see ``notes/nixl.md``). So:

- ``register`` / ``unregister`` / ``get_stats`` are blocking unary RPCs with a
  timeout, meant for startup and shutdown only.
- Everything per step goes through ONE long-lived bidirectional ``Session``
  stream, run by a background daemon thread: ``load`` / ``hold`` / ``release``
  / ``abort_load`` only append a command to a thread-safe outgoing queue (the stream's request
  iterator reads it), and the thread that reads the stream's responses pushes
  events into a local queue that ``drain_events`` empties. Neither touches the
  network.

Guarantees to the caller (what ``kvd.shim.vllm`` relies on):

- Exactly one terminal event per accepted ``load``: ``recv_done`` or
  ``load_failed`` (``failed_block_ids`` = the local block ids). A
  ``CommandRejected`` for a load becomes a ``load_failed``.
- Exactly one terminal event per accepted ``hold``: ``send_done``. A
  ``CommandRejected`` for a hold becomes ``send_done(released=True)``.
- Late, duplicate or unknown events from the daemon are dropped (logged), so
  the engine never sees a request finish twice.
- Every wait has a deadline. A load with no answer by its timeout plus
  ``load_grace_s`` fails locally; a hold with no answer by its lease plus
  ``hold_grace_s`` ends locally as ``send_done(expired=True)``. A timeout or
  lease of 0 means "the daemon's default" (``kvd serve --transfer-timeout-s``
  / ``--lease-s``), which the client cannot know: it then waits
  ``unknown_timeout_wait_s`` / ``unknown_lease_wait_s`` before giving up
  locally. Deadlines are checked in ``drain_events`` (no timer thread).
  Failing a load locally is the last resort: the daemon should have answered
  first, with its own reason, after aborting its transfer.
- When the stream breaks (daemon restart, socket gone) every load that was sent
  on it is reported failed at once (the daemon's transfer state is gone), the
  thread reconnects with exponential backoff (with jitter), re-registers the
  worker's regions (``ALREADY_EXISTS`` means the daemon kept them: fine) and
  reopens the session. Holds sent on the old stream are sent again with their
  remaining lease, so blocks are never freed *earlier* than the lease the
  daemon was promised; commands queued meanwhile go out on the new stream.
  A re-registration the daemon accepts as new (it had dropped the worker, or
  restarted) calls ``on_register`` with its response *before* the held
  blocks are sent again: a staged shim maps the new staging mirrors there and
  copies the held blocks into them (``kvd.shim.staging``).
- ``AbortLoad`` has no answer event: it only tells the prefill side to free a
  request's blocks now (a decode request aborted before its load).
- Block ids are always per KV-cache group (``kvd.requests.BlockGroups``;
  one group without vLLM's hybrid memory allocator): ``load(LoadRequest)``,
  ``hold(request_id, groups)``. A ``load_failed`` names them flat, as vLLM's
  load errors do.

Addresses: ``unix:///abs/path.sock``, ``unix:relative.sock``, a bare path
(``/run/kvd/engine.sock``, made ``unix://``), or ``host:port``.
"""

from __future__ import annotations

import heapq
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import grpc

from kvd import tracepoints as tp
from kvd.client.commands import Command, Hold, Lazy, Load, Stream, abort_cmd, hold_ended, load_failed, release_cmd
from kvd.requests import BlockGroups, LoadRequest
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

log = logging.getLogger("kvd.client")

#: Default bound on one gRPC message either way (bytes). A RegisterEngine of a
#: few thousand regions is tens of kB; stats and events are far smaller.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class EngineClientError(RuntimeError):
    """A blocking RPC failed; the message names the RPC and the gRPC status."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


def normalize_address(address: str) -> str:
    """A gRPC target for a daemon address (see the module docstring).

    Raises:
        ValueError: empty address.
    """
    address = address.strip()
    if not address:
        raise ValueError("empty kvd daemon address")
    if address.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith(("/", ".")) or address.endswith(".sock"):
        return "unix://" + os.path.abspath(address)
    return address


class EngineClient:
    """Client of one daemon's ``kvd.v1.EngineService`` for one engine worker.

    Args:
        address: the daemon's engine socket (see :func:`normalize_address`).
        max_message_bytes: max send/receive message size set on the channel.
        default_load_timeout_s: a load's timeout when the caller gives 0;
            0 = the daemon's default (seconds).
        default_lease_s: a hold's lease when the caller gives 0; 0 = the
            daemon's default (seconds).
        unknown_timeout_wait_s, unknown_lease_wait_s: how long to wait locally
            for a load / hold whose timeout / lease is the daemon's default.
            Never free blocks before the daemon might end their lease: the
            lease default is the daemon's cap on leases (``max_lease_s``, 1 h).
        load_grace_s: extra local wait past a load's timeout before failing it
            here (the daemon should answer first, with its own reason).
        hold_grace_s: extra local wait past a lease before ending it here.
        backoff_initial_s, backoff_max_s: reconnect backoff (doubles, jittered).
        reregister_timeout_s: timeout of each RegisterEngine on reconnect.

    Thread model: any thread may call the non-blocking methods; one background
    thread (``kvd-session``) owns the stream. Call :meth:`close` at shutdown.
    """

    def __init__(
        self,
        address: str,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        default_load_timeout_s: float = 0.0,
        default_lease_s: float = 0.0,
        unknown_timeout_wait_s: float = 120.0,
        unknown_lease_wait_s: float = 3600.0,
        load_grace_s: float = 5.0,
        hold_grace_s: float = 5.0,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 2.0,
        reregister_timeout_s: float = 5.0,
    ):
        self.address = normalize_address(address)
        self.max_message_bytes = int(max_message_bytes)
        self.default_load_timeout_s = default_load_timeout_s
        self.load_grace_s = load_grace_s
        self.default_lease_s = default_lease_s
        self.unknown_timeout_wait_s = unknown_timeout_wait_s
        self.unknown_lease_wait_s = unknown_lease_wait_s
        self.hold_grace_s = hold_grace_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.reregister_timeout_s = reregister_timeout_s
        options = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            # The channel's own reconnect; our loop backs off on top of it.
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", int(backoff_max_s * 1000)),
        ]
        self._channel = grpc.insecure_channel(self.address, options=options)
        self._stub = pb_grpc.EngineServiceStub(self._channel)

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._outq: deque[Command] = deque()  # built into commands by the sender thread
        self._events: deque[pb.SessionEvent] = deque()
        self._loads: dict[str, Load] = {}
        self._holds: dict[str, Hold] = {}
        self._deadlines: list[tuple[float, str, str]] = []  # (deadline, "load"|"hold", request id)

        self._register_request: pb.RegisterEngineRequest | None = None
        self._worker: pb.EngineWorker | None = None
        # The last registration's token: sent in OpenSession and UnregisterEngine
        # (a daemon with require_session_token refuses them without it).
        self._session_token = ""
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._opened = threading.Event()
        self._call: grpc.Call | None = None
        #: The daemon's ``SessionOpened`` of the current (or last) stream.
        self.session_info: pb.SessionOpened | None = None
        #: Streams opened so far (1 after the first session; +1 per reconnect).
        self.sessions_opened = 0
        #: ``engine=<id> rank=<r>``: starts every log line about this worker.
        self.label = "engine=? rank=?"
        #: Called (session thread) with the response of every re-registration
        #: the daemon accepted as new, before the stream reopens and held
        #: blocks are sent again. When it raises, the registration is undone
        #: (logged) and the reconnect retried.
        self.on_register: Callable[[pb.RegisterEngineResponse], None] | None = None
        #: Called with the request before every RegisterEngine (first, replacing,
        #: re-registering); may edit it in place: the memfd path hands its fds
        #: over again there (``kvd.client.fd_handover``: ids are one-use). What
        #: it raises becomes an EngineClientError.
        self.before_register: Callable[[pb.RegisterEngineRequest], None] | None = None

    # ------------------------------------------------------------ unary RPCs
    def _unary(self, name: str, method, request, timeout_s: float, wait_for_ready: bool = True):
        try:
            return method(request, timeout=timeout_s, wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            details = e.details() if hasattr(e, "details") else str(e)
            raise EngineClientError(
                f"{name} to kvd at {self.address} failed: {code.name if code else '?'}: {details}", code
            ) from None

    def register(
        self,
        request: pb.RegisterEngineRequest,
        *,
        timeout_s: float = 30.0,
        replace_existing: bool = True,
    ) -> pb.RegisterEngineResponse:
        """Registers this worker's KV regions (blocking; startup only).

        Waits up to ``timeout_s`` for the daemon to come up. The request is
        kept and sent again after every reconnect.

        Args:
            replace_existing: on ``ALREADY_EXISTS`` (a previous run of this
                engine died without unregistering), unregister the stale
                registration and register again.

        Raises:
            EngineClientError: the daemon refused or could not be reached.
        """
        self._register_request = request
        self._worker = request.worker
        self.label = f"engine={request.worker.engine_id} rank={request.worker.tp_rank}"
        try:
            return self._send_register(request, timeout_s)
        except EngineClientError as e:
            if e.code != grpc.StatusCode.ALREADY_EXISTS or not replace_existing:
                raise
        log.warning(
            "kvd already has engine %s rank %d registered (a previous run?); replacing it",
            request.worker.engine_id, request.worker.tp_rank,
        )
        self.unregister(timeout_s=timeout_s)
        return self._send_register(request, timeout_s)

    def _send_register(self, request: pb.RegisterEngineRequest, timeout_s: float) -> pb.RegisterEngineResponse:
        """RegisterEngine, after ``before_register`` (the memory handover's
        fd ids are fresh for each registration); keeps the answer's
        ``session_token`` for the session and for unregistering."""
        if self.before_register is not None:
            try:
                self.before_register(request)
            except Exception as e:
                raise EngineClientError(f"RegisterEngine to kvd at {self.address}: {e}") from e
        response = self._unary("RegisterEngine", self._stub.RegisterEngine, request, timeout_s)
        self._session_token = response.session_token
        return response

    def unregister(self, *, timeout_s: float = 5.0) -> pb.UnregisterEngineResponse:
        """Releases this worker's leases and registrations (blocking; shutdown).

        Raises:
            EngineClientError: not registered here, or the daemon is unreachable.
        """
        if self._worker is None:
            raise EngineClientError("unregister before register")
        return self._unary(
            "UnregisterEngine", self._stub.UnregisterEngine,
            pb.UnregisterEngineRequest(worker=self._worker, session_token=self._session_token), timeout_s,
            wait_for_ready=False,
        )

    def get_stats(self, *, timeout_s: float = 5.0, wait_for_ready: bool = True) -> pb.StatsResponse:
        """The daemon's ``GetStats`` (blocking; startup and tools only).

        ``peer_address`` in it is the ``host:port`` remote daemons use, which
        the prefill scheduler puts in ``kv_transfer_params``.

        Raises:
            EngineClientError: the daemon is unreachable within ``timeout_s``.
        """
        return self._unary("GetStats", self._stub.GetStats, pb.StatsRequest(), timeout_s, wait_for_ready)

    get_info = get_stats

    # --------------------------------------------------------------- session
    def start_session(self) -> None:
        """Starts the background session thread (after :meth:`register`).

        Returns at once; :meth:`wait_opened` waits for the daemon's answer.
        """
        if self._worker is None:
            raise EngineClientError("start_session before register")
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kvd-session", daemon=True)
        self._thread.start()

    def wait_opened(self, timeout_s: float) -> bool:
        """True once a session is open (waits at most ``timeout_s``)."""
        return self._opened.wait(timeout_s)

    @property
    def connected(self) -> bool:
        """True while a session stream is open."""
        return self._opened.is_set()

    def load(self, req: LoadRequest) -> None:
        """Queues a ``LoadBlocks`` of ``req`` (decode side; non-blocking, no I/O).

        Its answer comes out of :meth:`drain_events` as ``recv_done`` or
        ``load_failed`` (naming every local block of every group). A second
        load with the same ``request_id`` while the first is pending is
        ignored (logged). ``req`` is kept as given (frozen; its lists must not
        change after the call) and sent again on no other stream: a load lost
        with its stream fails. ``req.timeout_s`` 0: ``default_load_timeout_s``.
        """
        timeout_s = req.timeout_s if req.timeout_s > 0 else self.default_load_timeout_s
        wait_s = (timeout_s if timeout_s > 0 else self.unknown_timeout_wait_s) + self.load_grace_s
        rid = req.request_id
        with self._cond:
            if rid in self._loads:
                log.warning("kvd %s request=%s: load already pending; duplicate ignored", self.label, rid)
                return
            if self._closing.is_set():
                self._events.append(load_failed(rid, req.local_block_ids, "kvd client closed"))
                return
            deadline = time.monotonic() + wait_s
            ld = Load(req, timeout_s, deadline)
            self._loads[rid] = ld
            heapq.heappush(self._deadlines, (deadline, "load", rid))
            self._enqueue(ld)

    def hold(self, request_id: str, groups: BlockGroups, *, lease_s: float = 0.0) -> None:
        """Queues a ``HoldBlocks`` of ``groups`` (block ids per KV-cache group;
        prefill side; non-blocking, no I/O).

        Its end comes out of :meth:`drain_events` as ``send_done``. The
        groups are copied once (they are sent again after a reconnect).
        ``lease_s`` 0: ``default_lease_s``, else the daemon's default.
        """
        lease = lease_s if lease_s > 0 else max(self.default_lease_s, 0.0)
        groups = [list(g) for g in groups]  # the protobuf is built by the sender thread (Hold.build)
        wait_s = lease if lease > 0 else self.unknown_lease_wait_s
        with self._cond:
            if request_id in self._holds:
                log.warning("kvd %s request=%s: already held; duplicate ignored", self.label, request_id)
                return
            if self._closing.is_set():
                self._events.append(hold_ended(request_id, expired=True))
                return
            now = time.monotonic()
            h = Hold(request_id, lease, groups, now + wait_s, now + wait_s + self.hold_grace_s)
            self._holds[request_id] = h
            heapq.heappush(self._deadlines, (h.deadline, "hold", request_id))
            self._enqueue(h)

    def release(self, request_id: str) -> None:
        """Queues a ``ReleaseBlocks`` (end a lease now; non-blocking, no I/O)."""
        cmd = Lazy(release_cmd, request_id)
        with self._cond:
            self._enqueue(cmd)

    def abort_load(
        self,
        request_id: str,
        *,
        remote_engine_id: str,
        remote_address: str,
        remote_request_id: str,
        remote_tp_size: int = 1,
    ) -> None:
        """Queues an ``AbortLoad`` (decode side; non-blocking, no I/O).

        For a request that will never load (aborted before its load, or its
        whole prompt is in the local prefix cache): the daemon tells the
        prefill workers to free ``remote_request_id``'s blocks now rather than
        at lease expiry. No event answers it. Dropped (logged) after
        :meth:`close`; a command queued while the stream is down goes out on
        the next one.
        """
        cmd = Lazy(abort_cmd, request_id, remote_engine_id, remote_address, remote_request_id, remote_tp_size)
        with self._cond:
            if self._closing.is_set():
                log.info("kvd %s request=%s: client closed; abort of %s not sent (the remote lease bounds it)",
                         self.label, request_id, remote_request_id)
                return
            self._enqueue(cmd)

    def _enqueue(self, cmd: Command) -> None:
        """Under the lock: queues ``cmd`` for the stream. Wakes the stream's
        sender only when the queue was empty (it waits only then): a step that
        queues many commands wakes that thread once, not once per command
        (each wake-up costs the engine's thread a GIL hand-off,
        docs/PERFORMANCE.md "engine step")."""
        if not self._outq:
            self._outq.append(cmd)
            self._cond.notify_all()
        else:
            self._outq.append(cmd)

    def drain_events(self) -> list[pb.SessionEvent]:
        """Every event queued since the last call (non-blocking, no I/O).

        Also ends, locally, loads and holds whose deadline has passed.
        Events: ``recv_done``, ``load_failed``, ``send_done`` (see the module
        docstring for the guarantees).
        """
        deadlines, events = self._deadlines, self._events
        if deadlines and deadlines[0][0] <= time.monotonic():
            self._expire(time.monotonic())
        if not events:
            return []
        out = []
        while True:
            try:
                out.append(events.popleft())
            except IndexError:
                return out

    def pending(self) -> tuple[int, int]:
        """(loads awaiting an answer, holds awaiting their end)."""
        with self._lock:
            return len(self._loads), len(self._holds)

    def close(self, *, timeout_s: float = 2.0) -> None:
        """Stops the session thread and closes the channel (waits <= ``timeout_s``).

        Loads still pending are reported failed in the event queue.
        """
        self._closing.set()
        with self._cond:
            self._cond.notify_all()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            for rid, ld in list(self._loads.items()):
                self._events.append(load_failed(rid, ld.req.local_block_ids, "kvd client closed"))
            self._loads.clear()
        self._channel.close()

    # ------------------------------------------------------------- internals
    def _expire(self, now: float) -> None:
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                deadline, kind, rid = heapq.heappop(self._deadlines)
                if kind == "load":
                    ld = self._loads.get(rid)
                    if ld is not None and ld.deadline == deadline:
                        del self._loads[rid]
                        log.warning("kvd %s request=%s: load had no answer from the daemon in time; failed locally", self.label, rid)
                        self._events.append(load_failed(rid, ld.req.local_block_ids, "timeout: no answer from kvd"))
                else:
                    h = self._holds.get(rid)
                    if h is not None and h.deadline == deadline:
                        del self._holds[rid]
                        log.warning("kvd %s request=%s: lease over with no answer from the daemon; ended locally", self.label, rid)
                        self._events.append(hold_ended(rid, expired=True))

    def _mark_sent(self, cmd: Command, stream: Stream) -> bool:
        """Under the lock: records ``cmd`` as sent on ``stream``; False = drop it."""
        if type(cmd) is Load:
            if self._loads.get(cmd.req.request_id) is not cmd:
                return False  # ended locally (deadline) before it went out
            cmd.stream = stream.epoch
        elif type(cmd) is Hold:
            if self._holds.get(cmd.request_id) is not cmd:
                return False
            cmd.stream = stream.epoch
        return True

    def _commands(self, stream: Stream) -> Iterator[pb.SessionCommand]:
        """The request iterator of one stream (consumed by a gRPC thread)."""
        yield pb.SessionCommand(open=pb.OpenSession(worker=self._worker, session_token=self._session_token))
        with self._lock:
            now = time.monotonic()
            again = []
            for rid, h in self._holds.items():
                if h.stream is not None and h.stream != stream.epoch and h.lease_deadline > now:
                    h.stream = stream.epoch
                    # the remaining lease; a daemon-default lease starts again
                    lease = h.lease_deadline - now if h.lease_s > 0 else 0.0
                    again.append(pb.SessionCommand(hold=h.hold_message(lease)))
        if again:
            log.info("kvd %s: holding %d leases again after reconnecting", self.label, len(again))
        yield from again
        while True:
            with self._cond:
                while not self._outq and not stream.done and not self._closing.is_set():
                    self._cond.wait(0.5)
                if stream.done or self._closing.is_set():
                    return
                # Everything queued, in one hold of the lock (fewer lock hand-offs
                # with the engine thread queuing more).
                batch = []
                while self._outq:
                    cmd = self._outq.popleft()
                    if self._mark_sent(cmd, stream):
                        batch.append(cmd)
            # Built here, outside the lock: the engine thread never waits for it.
            for cmd in batch:
                try:
                    built = cmd.build()
                except (TypeError, ValueError) as e:  # arguments protobuf refuses: the load fails here
                    self._refuse(cmd, e)
                    continue
                yield built

    def _refuse(self, cmd: Command, error: Exception) -> None:
        """A command whose arguments cannot be put on the wire: its load fails
        (its hold ends) locally, as a daemon rejection would end it."""
        log.error("kvd %s: command not sent: %s: %s", self.label, type(error).__name__, error)
        with self._lock:
            if type(cmd) is Load and self._loads.get(cmd.req.request_id) is cmd:
                del self._loads[cmd.req.request_id]
                self._events.append(load_failed(cmd.req.request_id, cmd.req.local_block_ids,
                                                f"invalid command: {error}"))
            elif type(cmd) is Hold and self._holds.get(cmd.request_id) is cmd:
                del self._holds[cmd.request_id]
                self._events.append(hold_ended(cmd.request_id, released=True))

    def _on_event(self, event: pb.SessionEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "opened":
            self.session_info = event.opened
            self.sessions_opened += 1
            self._opened.set()
            log.info("kvd %s: session open (agent %s, daemon %s)", self.label, event.opened.agent_name,
                     event.opened.daemon_version)
            return
        with self._lock:
            if kind == "recv_done" or kind == "load_failed":
                rid = getattr(event, kind).request_id
                tp.hit(tp.RECEIVED, rid, kind)
                if self._loads.pop(rid, None) is not None:
                    self._events.append(event)
                else:
                    log.debug("kvd %s request=%s: %s for a load not pending here; dropped", self.label, rid, kind)
            elif kind == "send_done":
                rid = event.send_done.request_id
                if self._holds.pop(rid, None) is not None:
                    self._events.append(event)
                else:
                    log.debug("kvd %s request=%s: send_done for a hold not held here; dropped", self.label, rid)
            elif kind == "rejected":
                rid, reason = event.rejected.request_id, event.rejected.reason
                ld = self._loads.pop(rid, None)
                if ld is not None:
                    self._events.append(load_failed(rid, ld.req.local_block_ids, f"rejected: {reason}"))
                elif self._holds.pop(rid, None) is not None:
                    log.warning("kvd %s request=%s: hold rejected: %s; blocks released", self.label, rid, reason)
                    self._events.append(hold_ended(rid, released=True))
                else:
                    log.warning("kvd %s request=%s: command rejected: %s", self.label, rid or "-", reason)
            else:
                log.warning("kvd %s: unknown session event %r ignored", self.label, kind)

    def _fail_stream(self, stream: Stream, reason: str) -> None:
        """The stream ended: fail every load that went out on it."""
        with self._cond:
            stream.done = True
            self._cond.notify_all()
            lost = [rid for rid, ld in self._loads.items() if ld.stream == stream.epoch]
            for rid in lost:
                ld = self._loads.pop(rid)
                self._events.append(load_failed(rid, ld.req.local_block_ids, f"kvd session lost: {reason}"))
        if lost:
            log.warning("kvd %s: session lost (%s): loads in flight reported failed: %s", self.label, reason,
                        ", ".join(lost))

    def _reregister(self) -> None:
        if self._register_request is None:
            return
        try:
            response = self._send_register(self._register_request, self.reregister_timeout_s)
        except EngineClientError as e:
            if e.code != grpc.StatusCode.ALREADY_EXISTS:
                raise
            return  # the daemon kept the registration (and its staging mirrors)
        if self.on_register is not None:
            try:
                self.on_register(response)
            except Exception as e:
                # Undo the registration, so that the next try registers anew and
                # calls on_register again (an ALREADY_EXISTS would skip it).
                log.exception("kvd %s: on_register after re-registering failed; unregistering", self.label)
                try:
                    self.unregister(timeout_s=self.reregister_timeout_s)
                except EngineClientError as e2:
                    log.warning("kvd %s: unregister after a failed on_register: %s", self.label, e2)
                raise EngineClientError(f"on_register: {type(e).__name__}: {e}") from e

    def _run(self) -> None:
        backoff = self.backoff_initial_s
        epoch = 0
        first = True
        while not self._closing.is_set():
            if not first:
                try:
                    self._reregister()
                except EngineClientError as e:
                    log.warning("kvd %s: reconnect: %s; retrying in about %.2f s", self.label, e, backoff)
                    self._closing.wait(backoff * (0.5 + random.random() / 2))
                    backoff = min(backoff * 2, self.backoff_max_s)
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
                code = e.code() if hasattr(e, "code") else None
                reason = f"{code.name if code else '?'}: {e.details() if hasattr(e, 'details') else e}"
            except Exception as e:  # never let the thread die silently
                reason = f"{type(e).__name__}: {e}"
                log.exception("kvd %s: session thread error", self.label)
            finally:
                self._opened.clear()
                self._call = None
                self._fail_stream(stream, reason)
            if self._closing.is_set():
                break
            log.warning("kvd %s: session lost (%s); reconnecting in about %.2f s", self.label, reason, backoff)
            self._closing.wait(backoff * (0.5 + random.random() / 2))
            backoff = min(backoff * 2, self.backoff_max_s)
