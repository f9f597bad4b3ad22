"""Engine side of the fd side channel: hands KV cache fds to the local daemon.

gRPC carries no file descriptors, so the engine passes its sealed memfds
(``kvd.shim.memory.memfd``) over the daemon's fd side channel (format and
path: ``kvd.fd_wire``) with ``SCM_RIGHTS`` and gets one id per fd back, which
it names in ``RegisterEngineRequest`` (``Segment.fd_id``). The ids are good
for one registration: :func:`hand_over` runs again before every
``RegisterEngine`` (a daemon restarted knows no ids of the old one).

An engine may start before its daemon: the first registration passes a
``deadline`` and the handover waits for the side channel until then (the
engine's ``kvd_connect_timeout_s``, shared with the ``RegisterEngine`` that
follows), trying again while nobody listens there (:data:`RETRY_FIRST_S`
doubling to :data:`RETRY_MAX_S`). The fds are only sent on a connection the
daemon accepted, once per request, whatever the tries before.
"""

from __future__ import annotations

import array
import errno
import logging
import socket
import time

from kvd import fd_wire as wire
from kvd.client.channel import (DENIED, NOT_LISTENING, beside_engine_socket, check_daemon_serves, denied_message,
                                is_impostor, no_daemon_message, unix_path)

log = logging.getLogger("kvd.client")

#: Pause after the first try that found no daemon listening, doubled after
#: each one up to :data:`RETRY_MAX_S` (seconds): a daemon starts in a few
#: seconds (NIXL, UCX), and one try a second keeps a long wait cheap.
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 1.0


class HandoverError(RuntimeError):
    """The daemon refused the fds or could not be reached; the message says why."""


def hand_over(engine_socket: str, fds: list[int], timeout_s: float = 10.0, *,
              deadline: float | None = None) -> list[str]:
    """Passes ``fds`` to the daemon of ``engine_socket`` (its engine socket
    path or ``unix:`` address); returns their ids, in order.

    The fds stay open here (the daemon receives duplicates). More than
    ``kvd.fd_wire.MAX_FDS`` go in several requests.

    ``deadline`` (``time.monotonic()`` seconds): until when to wait for a
    daemon that is not listening yet (no side channel socket, or nobody
    accepting on it), trying again with a short backoff and saying so once
    (INFO); each request's own ``timeout_s`` ends there too. None: one try.

    Raises:
        HandoverError: no side channel (an older daemon, or none; with a
            ``deadline``: none by then, naming ``engine_socket``), any other
            error connecting (permission denied: at once, naming the
            socket's owner and mode and this uid), a refusal (its
            message), or no answer within ``timeout_s`` seconds per request.
    """
    path = wire.fd_socket_path(beside_engine_socket(engine_socket))
    wait = _Wait(engine_socket, deadline)
    ids: list[str] = []
    for i in range(0, len(fds), wire.MAX_FDS):
        ids += _request(path, fds[i:i + wire.MAX_FDS], timeout_s, wait)
    return ids


class _Wait:
    """The wait of one :func:`hand_over` for its daemon to listen: the pause
    before the next try, and the one log line."""

    def __init__(self, engine_socket: str, deadline: float | None):
        self.engine_socket = engine_socket
        self.deadline = deadline
        self.started = time.monotonic()
        self.pause = RETRY_FIRST_S
        self.logged = False

    def timeout(self, timeout_s: float) -> float:
        """A request's timeout: ``timeout_s``, cut at the deadline."""
        if self.deadline is None:
            return timeout_s
        return max(min(timeout_s, self.deadline - time.monotonic()), 0.001)

    def again(self, error: OSError) -> bool:
        """After a failed ``connect()``: waits and returns True when trying
        again is worth it, False when ``error`` is the answer (not a daemon
        still starting, or no deadline). Raises HandoverError at the deadline."""
        if self.deadline is None or error.errno not in NOT_LISTENING:
            return False
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise HandoverError(no_daemon_message(self.engine_socket, self.deadline - self.started))
        if not self.logged:
            self.logged = True
            log.info("kvd: waiting up to %g s for the kvd daemon at %s to start", round(left, 1),
                     unix_path(self.engine_socket) or self.engine_socket)
        time.sleep(min(self.pause, left))
        self.pause = min(self.pause * 2, RETRY_MAX_S)
        return True


def _connect(path: str, timeout_s: float, wait: _Wait) -> socket.socket:
    """A connection to the side channel at ``path`` served by the daemon
    (:func:`kvd.client.channel.check_daemon_serves`: the fds are the KV cache
    itself, and another user could have bound the path in a shared
    directory before the daemon started), tried again as ``wait`` says;
    every socket of a failed try is closed. Raises OSError
    (``PermissionError``: another user serves it)."""
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.settimeout(wait.timeout(timeout_s))
            s.connect(path)
            check_daemon_serves(s, path)
            return s
        except OSError as e:
            s.close()
            if not wait.again(e):  # another user serving it (no errno) is not waited out
                raise


def _request(path: str, fds: list[int], timeout_s: float, wait: _Wait) -> list[str]:
    try:
        s = _connect(path, timeout_s, wait)
    except OSError as e:
        if is_impostor(e):  # another user serves the path
            raise HandoverError(f"kvd fd channel {e}; the KV cache memory was not handed over (is another "
                                f"user's process bound there before the daemon?)") from None
        if e.errno in DENIED:  # the socket's owner and mode, and this engine's uid: what to change
            raise HandoverError(denied_message(path, e, "the kvd fd channel")) from None
        if e.errno in (errno.ENOENT, errno.ECONNREFUSED):  # the daemon's side sockets go with it
            raise HandoverError(f"no kvd daemon serves its fd channel {path} ({e.strerror}): is the daemon "
                                f"running?") from None
        raise HandoverError(f"kvd fd channel {path}: {e.strerror or e}") from None
    with s:
        try:
            try:
                s.sendmsg([wire.encode_request(len(fds))],
                          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
            except (BrokenPipeError, ConnectionResetError) as e:
                # Refused at once (not admitted, a cap): the daemon answered
                # and closed before the request went; its answer says why.
                data = _answer_left(s)
                if data is None:
                    raise e from None
            else:
                data = s.recv(wire.ANSWER.size + wire.MAX_MESSAGE_BYTES)
        except OSError as e:
            raise HandoverError(f"kvd fd channel {path}: {e.strerror or e}") from None
    try:
        ids, refused = wire.parse_answer(data)
    except wire.WireError as e:
        raise HandoverError(f"kvd fd channel {path}: {e}") from None
    if refused:
        raise HandoverError(f"kvd fd channel {path} refused the fds: {refused}")
    if len(ids) != len(fds):
        raise HandoverError(f"kvd fd channel {path}: {len(ids)} ids for {len(fds)} fds")
    return ids


def _answer_left(s: socket.socket) -> bytes | None:
    """The daemon's answer still queued on ``s`` after it closed, or None."""
    try:
        s.settimeout(0.5)
        return s.recv(wire.ANSWER.size + wire.MAX_MESSAGE_BYTES) or None
    except OSError:
        return None
