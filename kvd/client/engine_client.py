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
  / ``--lease-s``). A load's is the one the daemon said when the session
  opened (``SessionOpened.transfer_timeout_s``, and its cap on any timeout,
  ``max_transfer_timeout_s``), so a load queued while the daemon is down
  fails at that plus ``load_grace_s``; before any session, or from a daemon
  that does not say, the client waits ``unknown_timeout_wait_s``. A hold's
  lease default may be renewed up to the daemon's caps, so the client waits
  ``unknown_lease_wait_s`` for it before giving up locally. Deadlines are
  checked in ``drain_events`` (no timer thread).
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
  copies the held blocks into them (``kvd.shim.memory.staged``).
- ``renew_leases`` (the decode scheduler, while a request waits to load) is
  a unary RPC that does not block: it returns a future the caller looks at
  on a later step.
- ``AbortLoad`` has no answer event: it only tells the prefill side to free a
  request's blocks now (a decode request aborted before its load).
- Block ids are always per KV-cache group (``kvd.requests.BlockGroups``;
  one group without vLLM's hybrid memory allocator): ``load(LoadRequest)``,
  ``hold(request_id, groups)``. A ``load_failed`` names them flat, as vLLM's
  load errors do.

Where each part lives: this module is the API (unary RPCs, queuing, close);
``kvd.client.channel`` the daemon address, the channel and
:class:`EngineClientError`; ``kvd.client.pending`` the loads and holds awaited,
their deadlines and the two queues; ``kvd.client.session`` the thread that owns
the stream and reconnects; ``kvd.client.commands`` the commands themselves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import grpc

from kvd.client.channel import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DENIED,
    NOT_LISTENING,
    EngineClientError,
    EngineSocketDenied,
    call_unary,
    denied_message,
    is_impostor,
    no_daemon_message,
    normalize_address,
    open_channel,
    probe_unix_socket,
    rpc_status,
    unix_path,
)
from kvd.client.commands import Lazy, abort_cmd, release_cmd
from kvd.client.pending import Pending
from kvd.client.session import SessionLoop
from kvd.requests import BlockGroups, DeferredLoad, LeaseRenewal, LoadRequest, RenewResult
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "EngineClient", "EngineClientError", "EngineSocketDenied",
           "normalize_address"]

log = logging.getLogger("kvd.client")

#: While no daemon listens on the engine socket, a blocking call looks at it
#: again after this long (seconds), then twice as long each time up to
#: :data:`PROBE_MAX_S` (:meth:`EngineClient._wait_connected`).
PROBE_FIRST_S = 0.1
PROBE_MAX_S = 1.0


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
        command_socket: run the session on the daemon's command socket when
            it offers one (``kvd.client.command_socket``); False: on the gRPC
            ``Session`` stream always.

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
        command_socket: bool = True,
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
        # A Unix socket's path is looked at before every call (_wait_connected,
        # _check_server), which then waits itself; gRPC waits only for other
        # addresses (a TCP port cannot be looked at for its server's uid).
        self._path = unix_path(self.address)
        self._channel_lock = threading.Lock()
        self._channel = open_channel(self.address, max_message_bytes=self.max_message_bytes,
                                     backoff_max_s=backoff_max_s)
        self._stub = pb_grpc.EngineServiceStub(self._channel)
        # Whether a call was made on the channel since it was opened: a look
        # that finds no daemon replaces only a used one (_retire_channel).
        self._channel_used = False
        self._looking_after_renewal = threading.Lock()  # held while a look runs
        self._pending = Pending()
        self._register_request: pb.RegisterEngineRequest | None = None
        self._worker: pb.EngineWorker | None = None
        # The last registration's token: sent in OpenSession and UnregisterEngine
        # (a daemon with require_session_token refuses them without it).
        self._session_token = ""
        self._session = SessionLoop(
            self._stub_for_call, self._pending, open_session=self._open_session, reregister=self._reregister,
            backoff_initial_s=backoff_initial_s, backoff_max_s=backoff_max_s, address=self.address,
            command_socket=command_socket, max_message_bytes=self.max_message_bytes,
            connect_timeout_s=reregister_timeout_s)
        #: Called (session thread) with the response of every re-registration
        #: the daemon accepted as new, before the stream reopens and held
        #: blocks are sent again. When it raises, the registration is undone
        #: (logged) and the reconnect retried.
        self.on_register: Callable[[pb.RegisterEngineResponse], None] | None = None
        #: Called as ``before_register(request, deadline)`` before every
        #: RegisterEngine (first, replacing, re-registering); may edit the
        #: request in place: the memfd path hands its fds over again there
        #: (``kvd.client.fd_handover``: ids are one-use). ``deadline``
        #: (``time.monotonic()`` seconds): until when it may wait for a daemon
        #: that is not up yet, the end of :meth:`register`'s ``timeout_s``,
        #: which the RegisterEngine after it shares; None on a re-registration
        #: (one try: the session loop tries again with its backoff). What it
        #: raises becomes an EngineClientError.
        self.before_register: Callable[[pb.RegisterEngineRequest, float | None], None] | None = None

    @property
    def label(self) -> str:
        """``engine=<id> rank=<r>``: starts every log line about this worker."""
        return self._pending.label

    @property
    def session_info(self) -> pb.SessionOpened | None:
        """The daemon's ``SessionOpened`` of the current (or last) stream."""
        return self._session.session_info

    @property
    def sessions_opened(self) -> int:
        """Streams opened so far (1 after the first session; +1 per reconnect)."""
        return self._session.sessions_opened

    # ------------------------------------------------------------ unary RPCs
    def register(
        self,
        request: pb.RegisterEngineRequest,
        *,
        timeout_s: float = 30.0,
        replace_existing: bool = True,
    ) -> pb.RegisterEngineResponse:
        """Registers this worker's KV regions (blocking; startup only).

        Waits up to ``timeout_s`` for the daemon to come up (an engine may
        start first): ``before_register`` (the memfd handover) and
        RegisterEngine share that one deadline, as does a replacement. The
        request is kept and sent again after every reconnect.

        Args:
            replace_existing: on ``ALREADY_EXISTS`` (a previous run of this
                engine died without unregistering), unregister the stale
                registration and register again.

        Raises:
            EngineClientError: the daemon refused or could not be reached
                (none up within ``timeout_s``: the message says so and names
                the engine socket).
            EngineSocketDenied: this process's user may not connect to the
                engine socket (its mode or owner, or a directory on its path):
                at once, not at ``timeout_s``; the message names the socket,
                its owner and mode and this process's uid.
        """
        self._register_request = request
        self._worker = request.worker
        self._pending.label = f"engine={request.worker.engine_id} rank={request.worker.tp_rank}"
        deadline = time.monotonic() + timeout_s
        try:
            return self._send_register(request, deadline, wait=True)
        except EngineClientError as e:
            if e.code != grpc.StatusCode.ALREADY_EXISTS or not replace_existing:
                raise
        log.warning(
            "kvd already has engine %s rank %d registered (a previous run?); replacing it",
            request.worker.engine_id, request.worker.tp_rank,
        )
        self.unregister(timeout_s=_left(deadline))
        return self._send_register(request, deadline, wait=True)

    def _send_register(self, request: pb.RegisterEngineRequest, deadline: float, *,
                       wait: bool) -> pb.RegisterEngineResponse:
        """RegisterEngine by ``deadline`` (``time.monotonic()``), after
        ``before_register`` (the memory handover's fd ids are fresh for each
        registration; ``wait``: it may wait for the daemon until
        ``deadline``); keeps the answer's ``session_token`` for the session
        and for unregistering."""
        started = time.monotonic()

        def before() -> None:  # each try: the fds' ids were for the try that failed
            if self.before_register is not None:
                try:
                    self.before_register(request, deadline if wait else None)
                except Exception as e:
                    raise EngineClientError(f"RegisterEngine to kvd at {self.address}: {e}") from e

        try:
            response = self._waiting("RegisterEngine", request, deadline, again=wait, before=before)
        except EngineClientError as e:
            if wait and e.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                raise self._unreachable(e, deadline - started) from None
            raise
        self._session_token = response.session_token
        return response

    def _waiting(self, name: str, request, deadline: float, *, again: bool = True,
                 before: Callable[[], None] | None = None):
        """The unary call ``name`` by ``deadline`` (``time.monotonic()``),
        each try after ``before`` and a look at the engine socket
        (:meth:`_wait_connected`); tried again where :meth:`_again` says
        (``again``: at all). Raises the last try's ``EngineClientError``."""
        tries = 0
        while True:
            if before is not None:
                before()
            self._wait_connected(name, deadline)
            try:
                return self._unary(name, request, _left(deadline), wait=True)
            except EngineClientError as e:
                if not (again and self._again(e, deadline, tries)):
                    raise
                tries += not e.daemon_gone

    def _unary(self, name: str, request, timeout_s: float, *, wait: bool):
        """The unary call ``name`` (an ``EngineService`` method) with a
        deadline of ``timeout_s`` seconds, on the current channel, after the
        caller's look at the engine socket. ``wait``: the caller
        waits for the daemon; on a Unix socket its looks did, and gRPC's
        ``wait_for_ready`` is not asked (a call queued on it went to
        whatever gRPC's own reconnect reached next: the look's race, attacker
        review); elsewhere gRPC waits.

        Raises:
            EngineClientError: the call failed (its status);
                ``daemon_gone`` when it was UNAVAILABLE and no daemon was at
                the engine socket after it (:meth:`_look_after_failure`).
        """
        stub = self._stub_for_call()
        try:
            return call_unary(self.address, name, getattr(stub, name), request, timeout_s,
                              wait_for_ready=wait and self._path is None)
        except EngineClientError as e:
            if e.code == grpc.StatusCode.UNAVAILABLE:
                e.daemon_gone = self._look_after_failure()
            raise

    def _stub_for_call(self) -> pb_grpc.EngineServiceStub:
        """The stub of the current channel, for a call made now (after a
        look at the engine socket). Also the session loop's, for its gRPC
        stream."""
        with self._channel_lock:
            self._channel_used = True
            return self._stub

    def _retire_channel(self) -> None:
        """A look found no daemon at the engine socket (nobody listens, or
        another user's server): the channel, if a call used it, is closed
        and a new one opened for the next call. A channel whose connect
        failed reconnects in the background on its own backoff (gRPC's
        TRANSIENT_FAILURE), to whatever serves the path then, a connection
        no look checked, which the next call would use once its look saw
        the path empty or the real daemon back (attacker review: another
        user's listener bound in a restart's gap got a later call's session
        token). Closing it stops that and cancels what is in flight on it,
        which no daemon there would answer."""
        with self._channel_lock:
            if not self._channel_used or self._pending.closing.is_set():
                return  # nothing sent on it yet, or closed (close() ends the channel)
            old = self._channel
            self._channel = open_channel(self.address, max_message_bytes=self.max_message_bytes,
                                         backoff_max_s=self.backoff_max_s)
            self._stub = pb_grpc.EngineServiceStub(self._channel)
            self._channel_used = False
        old.close()
        log.info("kvd %s: the channel used at %s is closed (no daemon there now, or its connect failed); the next "
                 "call opens a new one", self.label, self.address)

    def _look_after_failure(self) -> bool:
        """After a call failed UNAVAILABLE: one look at the engine socket.
        True (and the channel retired) when no daemon answers there
        (:func:`_no_daemon`). A daemon that answers UNAVAILABLE itself
        (draining, a prefill peer it cannot ask) leaves the channel alone,
        and with it a session stream on it; so does a look that cannot tell
        (a full backlog)."""
        if self._path is None:
            return False
        if not _no_daemon(probe_unix_socket(self.address)):
            return False
        self._retire_channel()
        return True

    def _again(self, error: EngineClientError, deadline: float, tries: int) -> bool:
        """Whether a call that waits for the daemon until ``deadline``
        (``time.monotonic()``) tries again after ``error`` (a failed
        :meth:`_unary`; ``tries``: the retries made so far where the daemon
        was there): while no daemon was at the
        engine socket after it (``daemon_gone``: the daemon went away after
        the look), to wait for one; and once where the daemon was there
        again (a restart between the look and gRPC's connect), on a new
        channel: the old one, its connect failed, fails calls at once
        until its own backoff has passed (gRPC's TRANSIENT_FAILURE), and a
        daemon that answered UNAVAILABLE itself (draining) says so again."""
        if error.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() >= deadline:
            return False
        if error.daemon_gone:
            return True
        if tries > 0 or self._path is None:
            return False
        self._retire_channel()  # the failed call used it
        return True

    def _look_after_renewal(self) -> None:
        """:meth:`_look_after_failure` off gRPC's callback thread (a channel is
        not closed from its own callback), one at a time."""
        # gRPC calls renewals' callbacks on its own threads, several at once.
        if not self._looking_after_renewal.acquire(blocking=False):
            return

        def look() -> None:
            try:
                self._look_after_failure()
            finally:
                self._looking_after_renewal.release()
        threading.Thread(target=look, name="kvd-look", daemon=True).start()

    def _wait_connected(self, name: str, deadline: float) -> None:
        """Before a call that waits for the daemon: looks at the engine socket itself (one
        ``connect()``, closed at once) until it accepts or ``deadline``
        (``time.monotonic()``), :data:`PROBE_FIRST_S` apart at first, then
        twice as long each time up to :data:`PROBE_MAX_S`. A daemon that is
        up accepts the first look (one ``connect()``, tens of us). Nothing
        for an address that is no Unix socket (the call waits alone).

        gRPC's wait-for-ready only waits: a ``connect()`` denied for
        permission puts the channel in TRANSIENT_FAILURE and a wait-for-ready
        call stays queued through it until its deadline (gRPC's
        doc/wait-for-ready.md); the look tells permission denied, which
        waiting never cures. No connectivity watch on the channel
        (``grpc.channel_ready_future``): its polling thread outlives its
        cancel and raises "Channel closed!" once the channel is closed
        (grpc's ``_channel._poll_connectivity``), a traceback in the engine's
        log.

        Raises:
            EngineSocketDenied: connecting to the engine socket is denied to
                this user (``name``: the call, for the message).
            EngineClientError: PERMISSION_DENIED, the engine socket's server
                may not be taken for the daemon
                (:func:`kvd.client.channel.server_refusal`);
                DEADLINE_EXCEEDED, nobody listened there by ``deadline``
                (the call is not made: :meth:`_not_listening`); UNAVAILABLE, no
                connection it took by ``deadline`` (a full backlog), so its
                server was never checked.
        """
        path = unix_path(self.address)
        if path is None:
            return
        pause = PROBE_FIRST_S
        started = time.monotonic()
        while True:
            why = probe_unix_socket(self.address)
            if _no_daemon(why):
                self._retire_channel()
            if is_impostor(why):
                # In a directory others may write, another user could have
                # bound the engine socket before the daemon started and would
                # get the registration and the session (attacker review).
                raise self._impostor(name, why)
            if why is not None and why.errno in DENIED:
                raise EngineSocketDenied(f"{name} to kvd at {self.address}: {denied_message(path, why)}",
                                         grpc.StatusCode.UNAVAILABLE)
            left = deadline - time.monotonic()
            if why is None:  # accepted, and its server may be the daemon
                return
            if left <= 0:
                if why.errno in NOT_LISTENING:
                    # Its deadline passed waiting, as the call's own would have.
                    raise self._not_listening(name, time.monotonic() - started, grpc.StatusCode.DEADLINE_EXCEEDED)
                # A full backlog (a connect that timed out) or another error:
                # who serves the socket is not known, and gRPC's own connect
                # may reach whoever accepts later (attacker review: a squatter
                # that filled its backlog got the RegisterEngine).
                raise self._unchecked(name, why)
            time.sleep(min(pause, left))
            pause = min(pause * 2, PROBE_MAX_S)

    def _check_server(self, name: str) -> None:
        """Before a call that does not wait for the daemon (``UnregisterEngine``,
        ``RenewLeases``, ``GetStats`` without waiting): one look at the
        engine socket (a ``connect()``, tens of us), as
        :meth:`_wait_connected` makes before the waiting ones. gRPC
        reconnects to whatever serves the path after a daemon restart, and
        these calls carry the session token and request ids.

        Raises:
            EngineClientError: PERMISSION_DENIED, the engine socket's server
                may not be taken for the daemon; UNAVAILABLE, the look's
                ``connect()`` did not complete (a full backlog), so its
                server was not checked; UNAVAILABLE, nobody listens there
                (:meth:`_not_listening`).
            EngineSocketDenied: connecting there is denied to this user: what
                is there now is not what the call may reach (attacker review:
                another user's socket of mode 000 at the path passed the look,
                and was opened to gRPC's connect a moment after).
        """
        if self._path is None:
            return
        why = probe_unix_socket(self.address)
        if why is None:
            return
        if _no_daemon(why):
            self._retire_channel()
        if is_impostor(why):
            raise self._impostor(name, why)
        if why.errno in NOT_LISTENING:
            raise self._not_listening(name, 0.0, grpc.StatusCode.UNAVAILABLE)
        if why.errno in DENIED:
            raise EngineSocketDenied(f"{name} to kvd at {self.address}: {denied_message(self._path, why)}",
                                     grpc.StatusCode.UNAVAILABLE)
        raise self._unchecked(name, why)

    def _not_listening(self, name: str, waited_s: float, code: grpc.StatusCode) -> EngineClientError:
        """``code`` for call ``name`` (DEADLINE_EXCEEDED after a wait of
        ``waited_s`` seconds, else UNAVAILABLE): nobody listens on the engine
        socket, so the call is not made. Made anyway, it would fail the same way and
        leave gRPC reconnecting in the background to whatever binds the path
        next, a connection no look of this client has checked, which the
        next calls would use (attacker review: another user's listener, bound
        in the gap of a daemon restart, got the session token and renewals)."""
        return EngineClientError(f"{name} to kvd at {self.address}: {no_daemon_message(self.address, waited_s)}",
                                 code)

    def _impostor(self, name: str, why: OSError) -> EngineClientError:
        """PERMISSION_DENIED for call ``name``: the engine socket's server may
        not be taken for the daemon (``why``, from the look)."""
        return EngineClientError(f"{name} to kvd at {self.address}: {why}", grpc.StatusCode.PERMISSION_DENIED)

    def _unchecked(self, name: str, why: OSError) -> EngineClientError:
        """UNAVAILABLE for call ``name``: the look's ``connect()`` failed
        (``why``: a full backlog, a timeout), so who serves the socket is
        not known and the call is not made."""
        return EngineClientError(f"{name} to kvd at {self.address}: the engine socket did not take a connection "
                                 f"({why.strerror or why}), so who serves it was not checked: not used",
                                 grpc.StatusCode.UNAVAILABLE)

    def _unreachable(self, error: EngineClientError, waited_s: float) -> EngineClientError:
        """``error`` (RegisterEngine waited in vain), saying why when the
        engine socket tells: nobody listens there (the same words as the
        memfd handover's), or connecting is denied (permission: the daemon's
        socket changed after :meth:`_wait_connected` looked), or refused."""
        why = probe_unix_socket(self.address)
        if why is None:
            return error
        if why.errno in NOT_LISTENING:
            text = f"RegisterEngine to kvd at {self.address}: {no_daemon_message(self.address, waited_s)}"
        elif why.errno in DENIED:
            path = unix_path(self.address) or self.address
            return EngineSocketDenied(f"RegisterEngine to kvd at {self.address}: {denied_message(path, why)}",
                                      error.code)
        else:
            text = f"{error} (connecting to the engine socket: {why.strerror or why})"
        return EngineClientError(text, error.code)

    def unregister(self, *, timeout_s: float = 5.0) -> pb.UnregisterEngineResponse:
        """Releases this worker's leases and registrations (blocking; shutdown).

        Raises:
            EngineClientError: not registered here, the daemon is
                unreachable, or the engine socket's server is not the
                daemon's (:meth:`_check_server`).
        """
        if self._worker is None:
            raise EngineClientError("unregister before register")
        self._check_server("UnregisterEngine")
        request = pb.UnregisterEngineRequest(worker=self._worker, session_token=self._session_token)
        return self._unary("UnregisterEngine", request, timeout_s, wait=False)

    def get_stats(self, *, timeout_s: float = 5.0, wait_for_ready: bool = True) -> pb.StatsResponse:
        """The daemon's ``GetStats`` (blocking; startup and tools only).

        ``peer_address`` in it is the ``host:port`` remote daemons use, which
        the prefill scheduler puts in ``kv_transfer_params``.

        Raises:
            EngineClientError: the daemon is unreachable within ``timeout_s``,
                or the engine socket's server is not the daemon's (checked
                before the call either way).
            EngineSocketDenied: with ``wait_for_ready``, this process's user
                may not connect to the engine socket: at once (see
                :meth:`register`).
        """
        if not wait_for_ready:
            self._check_server("GetStats")
            return self._unary("GetStats", pb.StatsRequest(), timeout_s, wait=False)
        return self._waiting("GetStats", pb.StatsRequest(), time.monotonic() + timeout_s)

    def renew_leases(self, remote_engine_id: str, remote_address: str, renewals: list[LeaseRenewal], *,
                     timeout_s: float = 10.0) -> Future[list[RenewResult]]:
        """Asks the daemon to renew prefill leases of engine
        ``remote_engine_id`` at ``remote_address`` (``RenewLeases``; at most
        ``kvd.requests.MAX_RENEWALS_PER_CALL`` renewals). Needs no
        registration: the decode scheduler calls it.

        Does not block (but for one ``connect()`` to the engine socket,
        :meth:`_check_server`): the future's result is one
        :class:`RenewResult` per renewal, same order, within ``timeout_s``
        seconds; its exception an :class:`EngineClientError` naming the
        status (the daemon could not ask the prefill daemon, refused the
        batch, or the engine socket's server is not the daemon's).
        """
        request = pb.RenewLeasesRequest(remote_engine_id=remote_engine_id, remote_address=remote_address,
                                        renewals=[pb.LeaseRenewal(request_id=r.request_id,
                                                                  groups=[pb.BlockIds(ids=g) for g in r.groups])
                                                  for r in renewals])
        out: Future[list[RenewResult]] = Future()
        out.set_running_or_notify_cancel()
        try:
            self._check_server("RenewLeases")
        except EngineClientError as e:
            out.set_exception(e)
            return out

        def done(call) -> None:
            try:
                r = call.result()
            except grpc.RpcError as e:
                code, text = rpc_status(e)
                if code == grpc.StatusCode.UNAVAILABLE:
                    self._look_after_renewal()
                out.set_exception(EngineClientError(f"RenewLeases to kvd at {self.address} failed: {text}", code))
                return
            out.set_result([RenewResult(x.request_id, x.left_s, x.reason) for x in r.results])

        self._stub_for_call().RenewLeases.future(request, timeout=timeout_s).add_done_callback(done)
        return out

    # --------------------------------------------------------------- session
    def start_session(self) -> None:
        """Starts the background session thread (after :meth:`register`).

        Returns at once; :meth:`wait_opened` waits for the daemon's answer.
        """
        if self._worker is None:
            raise EngineClientError("start_session before register")
        self._session.start()

    def wait_opened(self, timeout_s: float) -> bool:
        """True once a session is open (waits at most ``timeout_s``)."""
        return self._session.opened.wait(timeout_s)

    @property
    def connected(self) -> bool:
        """True while a session stream is open."""
        return self._session.opened.is_set()

    def load(self, req: LoadRequest | DeferredLoad) -> None:
        """Queues a ``LoadBlocks`` of ``req`` (decode side; non-blocking, no I/O).

        Its answer comes out of :meth:`drain_events` as ``recv_done`` or
        ``load_failed`` (naming every local block of every group). A second
        load with the same ``request_id`` while the first is pending is
        ignored (logged). ``req`` is kept as given (frozen; its lists must not
        change after the call) and sent again on no other stream: a load lost
        with its stream fails. ``req.timeout_s`` 0: ``default_load_timeout_s``.

        A :class:`~kvd.requests.DeferredLoad` is resolved on the sender
        thread as its command is built, not here; one that raises
        ``InvalidLoad`` (or any other exception) fails with that reason
        through :meth:`drain_events`, as a daemon rejection would, and an
        ``InvalidLoad`` naming its source sends an ``AbortLoad`` instead.
        """
        timeout_s = req.timeout_s if req.timeout_s > 0 else self.default_load_timeout_s
        self._pending.add_load(req, timeout_s, self._daemon_timeout(timeout_s) + self.load_grace_s)

    def _daemon_timeout(self, timeout_s: float) -> float:
        """Seconds by which the daemon answers a load of ``timeout_s`` (0:
        its default): as the last session's ``SessionOpened`` said (the
        default, and the cap on any), else ``timeout_s``, or
        ``unknown_timeout_wait_s`` for 0. A daemon down when the load is
        queued (its engine socket gone) then fails it at its own default,
        not at ``unknown_timeout_wait_s`` (120 s by default: a decode request
        hung that long while its node's daemon was stopped)."""
        info = self._session.session_info
        if timeout_s > 0:
            cap = info.max_transfer_timeout_s if info is not None else 0.0
            return cap if 0 < cap < timeout_s else timeout_s
        said = info.transfer_timeout_s if info is not None else 0.0
        return said if said > 0 else self.unknown_timeout_wait_s

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
        self._pending.add_hold(request_id, lease, groups, wait_s, self.hold_grace_s)

    def release(self, request_id: str) -> None:
        """Queues a ``ReleaseBlocks`` (end a lease now; non-blocking, no I/O)."""
        self._pending.queue(Lazy(release_cmd, request_id))

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
        if not self._pending.queue(cmd, unless_closing=True):
            log.info("kvd %s request=%s: client closed; abort of %s not sent (the remote lease bounds it)",
                     self.label, request_id, remote_request_id)

    def drain_events(self) -> list[pb.SessionEvent]:
        """Every event queued since the last call (non-blocking, no I/O).

        Also ends, locally, loads and holds whose deadline has passed.
        Events: ``recv_done``, ``load_failed``, ``send_done`` (see the module
        docstring for the guarantees).
        """
        return self._pending.drain()

    def pending(self) -> tuple[int, int]:
        """(loads awaiting an answer, holds awaiting their end)."""
        return self._pending.counts()

    def close(self, *, timeout_s: float = 2.0) -> None:
        """Stops the session thread and closes the channel (waits <= ``timeout_s``).

        Loads still pending are reported failed in the event queue.
        """
        self._pending.closing.set()
        self._pending.wake()
        self._session.stop(timeout_s)
        self._pending.fail_loads("kvd client closed")
        with self._channel_lock:
            self._channel.close()

    # ------------------------------------------------------------- internals
    def _open_session(self) -> pb.OpenSession:
        return pb.OpenSession(worker=self._worker, session_token=self._session_token)

    def _reregister(self) -> None:
        """Before a new stream (session thread): registers the worker again.
        ``ALREADY_EXISTS`` means the daemon kept the registration (and its
        staging mirrors); a new one goes through ``on_register``, undone when
        that raises. Raises EngineClientError (the loop retries)."""
        if self._register_request is None:
            return
        try:
            response = self._send_register(self._register_request, time.monotonic() + self.reregister_timeout_s,
                                           wait=False)
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


def _no_daemon(why: OSError | None) -> bool:
    """True when a look's answer (:func:`probe_unix_socket`) says the daemon
    is not what a connect there reaches now: nobody listens, another user's
    server, or a socket this user may not connect to."""
    return why is not None and (is_impostor(why) or why.errno in NOT_LISTENING or why.errno in DENIED)


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic()``), at least 1 ms: a
    call made past it then fails DEADLINE_EXCEEDED at once."""
    return max(deadline - time.monotonic(), 0.001)
