"""The command socket's wire format: a session's commands and events as frames.

Next to the engine socket the daemon listens on a third Unix socket
(:func:`command_socket_path`, ``SOCK_STREAM``) that carries one engine
worker's session without gRPC: the same ``kvd.v1`` messages as the
``EngineService.Session`` stream, ``SessionCommand`` engine -> daemon and
``SessionEvent`` daemon -> engine, each one frame:

- a 4-byte little-endian length (:data:`HEADER`), then that many bytes of
  the serialized message; a length of 0 is an empty message.

The first command is ``open`` (``OpenSession``), as on the stream; the
daemon answers ``opened``, or refuses with one ``rejected`` event whose
reason starts with the gRPC status name the stream would have ended with
(``PERMISSION_DENIED: ...``) and closes the connection. A frame longer than
the daemon's ``max_message_bytes`` closes the connection the same way.
Closing the socket ends the session (either side), as the end of the stream
does. docs/PERFORMANCE.md ("Design note: the engine <-> daemon command path
without gRPC per load") measured why a socket: one round trip ~10 us
against ~180 us for a gRPC bidi stream.

A neutral leaf module (as ``kvd.fd_wire``): imports nothing of kvd's, so the
engine side (``kvd.client.command_socket``) and the daemon
(``kvd.daemon.command_socket``) share one definition.
"""

from __future__ import annotations

import struct

HEADER = struct.Struct("<I")  # frame length in bytes
SUFFIX = ".cmd"


# gRPC's status names (grpc/include/grpc/status.h): a session refusal's
# reason starts with one and ": ".
STATUS_NAMES = frozenset({
    "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
    "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"})


def refusal(request_id: str, reason: str) -> tuple[str, str] | None:
    """``(status name, details)`` when a ``rejected`` event of
    ``request_id`` / ``reason`` is the daemon refusing or ending the session
    (no request id, a reason starting ``"STATUS_NAME: "``); None for a
    command's rejection."""
    name, sep, details = reason.partition(": ")
    if request_id or not sep or name not in STATUS_NAMES:
        return None
    return name, details


class FrameError(ValueError):
    """A frame this format refuses (longer than allowed); the message says
    how. ``payloads``: the whole frames read before it, in order (handled
    as if read before it)."""

    def __init__(self, message: str, payloads: list[bytes] | None = None):
        super().__init__(message)
        self.payloads = payloads or []


def command_socket_path(engine_socket: str) -> str:
    """The command socket for the engine socket ``engine_socket`` (a path,
    ``unix:PATH`` or ``unix://PATH``): the same path plus ``.cmd``, in the
    same directory, so it has the same reach as the engine socket."""
    for prefix in ("unix://", "unix:"):
        if engine_socket.startswith(prefix):
            engine_socket = engine_socket[len(prefix):]
            break
    return engine_socket + SUFFIX


def frame(payload: bytes) -> bytes:
    """One frame: ``payload`` (a serialized message) after its length."""
    return HEADER.pack(len(payload)) + payload


class Deframer:
    """Cuts a byte stream into frame payloads.

    Args:
        max_frame_bytes: the longest payload accepted (bytes).
    """

    __slots__ = ("max_frame_bytes", "_buf")

    def __init__(self, max_frame_bytes: int):
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes received and not yet part of a whole frame."""
        return len(self._buf)

    def clear(self) -> None:
        """Drops the bytes of an unfinished frame (the connection is gone):
        the buffer's memory goes now, not when a reference cycle through the
        connection is collected."""
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The payloads completed by ``data``, in order (a partial frame waits
        for the next call).

        Raises:
            FrameError: a frame announces more than ``max_frame_bytes``
                (checked as soon as its header is in, before its payload);
                its ``payloads`` are the whole frames before it. The stream
                is out of step after it: the connection is not read again.
        """
        buf = self._buf
        buf += data
        out = []
        pos, n = 0, len(buf)
        size = HEADER.size
        while n - pos >= size:
            (length,) = HEADER.unpack_from(buf, pos)
            if length > self.max_frame_bytes:
                del buf[:]
                raise FrameError(f"frame of {length} bytes, more than {self.max_frame_bytes} (max_message_bytes)",
                                 out)
            if n - pos - size < length:
                break
            out.append(bytes(buf[pos + size:pos + size + length]))
            pos += size + length
        if pos:
            del buf[:pos]
        return out
