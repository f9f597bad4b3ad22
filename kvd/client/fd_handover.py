"""Engine side of the fd side channel: hands KV cache fds to the local daemon.

gRPC carries no file descriptors, so the engine passes its sealed memfds
(``kvd.shim.memory.memfd``) over the daemon's fd side channel (format and
path: ``kvd.fd_wire``) with ``SCM_RIGHTS`` and gets one id per fd back, which
it names in ``RegisterEngineRequest`` (``Segment.fd_id``). The ids are good
for one registration: :func:`hand_over` runs again before every
``RegisterEngine`` (a daemon restarted knows no ids of the old one).
"""

from __future__ import annotations

import array
import socket

from kvd import fd_wire as wire


class HandoverError(RuntimeError):
    """The daemon refused the fds or could not be reached; the message says why."""


def hand_over(engine_socket: str, fds: list[int], timeout_s: float = 10.0) -> list[str]:
    """Passes ``fds`` to the daemon of ``engine_socket`` (its engine socket
    path or ``unix:`` address); returns their ids, in order.

    The fds stay open here (the daemon receives duplicates). More than
    ``kvd.fd_wire.MAX_FDS`` go in several requests.

    Raises:
        HandoverError: no side channel (an older daemon, or none), a refusal
            (its message), or no answer within ``timeout_s`` seconds per request.
    """
    path = wire.fd_socket_path(engine_socket)
    ids: list[str] = []
    for i in range(0, len(fds), wire.MAX_FDS):
        ids += _request(path, fds[i:i + wire.MAX_FDS], timeout_s)
    return ids


def _request(path: str, fds: list[int], timeout_s: float) -> list[str]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(path)
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
