"""Engine side of the command socket: one session in frames, without gRPC.

The daemon offers it beside its engine socket (``kvd.command_wire``: the
path and the frames); ``kvd.client.session`` uses it when it is there and
the gRPC ``Session`` stream otherwise (an older daemon, or one with
``command_socket = false``). What goes over it is what goes over the
stream: ``SessionCommand`` s out, ``SessionEvent`` s in.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator

from kvd.client.channel import beside_engine_socket, check_daemon_serves
from kvd.command_wire import Deframer, command_socket_path, frame
from kvd.v1 import kvd_pb2 as pb

_RECV_BYTES = 1 << 16


class CommandConnection:
    """One connection to a daemon's command socket.

    :meth:`send` (one thread) and :meth:`events` (another) may run at once;
    :meth:`shutdown` from any thread ends both; :meth:`close` once neither runs.
    """

    def __init__(self, sock: socket.socket, max_message_bytes: int):
        self._sock = sock
        self._max = max_message_bytes

    @classmethod
    def connect(cls, engine_socket: str, *, max_message_bytes: int, timeout_s: float) -> "CommandConnection":
        """Connects to the command socket of ``engine_socket`` (a path or
        ``unix:`` address) within ``timeout_s`` seconds.

        The socket's server must be the daemon: its kernel credentials
        (``SO_PEERCRED``) name root or this process's own uid, or another
        uid in a directory only it may write
        (:func:`kvd.client.channel.server_refusal`). Where the daemon offers no command socket (an
        older daemon, ``command_socket = false``, a restart) and the engine
        socket's directory is writable by others, another user could bind
        the path and read the session's token and commands, and forge its
        events; such a socket is refused and the session stays on gRPC.

        Raises:
            OSError: no command socket there (``FileNotFoundError``,
                ``ConnectionRefusedError``: the daemon offers none), it
                cannot be reached, or ``PermissionError``: another user serves it.
        """
        path = command_socket_path(beside_engine_socket(engine_socket))
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(timeout_s)
            s.connect(path)
            check_daemon_serves(s, path)
            s.settimeout(None)
        except BaseException:
            s.close()
            raise
        return cls(s, max_message_bytes)

    def send(self, commands: Iterable[pb.SessionCommand]) -> None:
        """Writes ``commands``, in order, in one ``sendall`` (blocks while the
        daemon's socket buffer is full). Raises OSError once the connection
        is closed or broken."""
        self._sock.sendall(b"".join(frame(c.SerializeToString()) for c in commands))

    def events(self) -> Iterator[pb.SessionEvent]:
        """The daemon's events until it closes the connection (or
        :meth:`close` is called here).

        Raises:
            kvd.command_wire.FrameError: a frame over ``max_message_bytes``.
            google.protobuf.message.DecodeError: a frame that is not a ``SessionEvent``.
            OSError: the connection broke.
        """
        deframer = Deframer(self._max)
        while True:
            data = self._sock.recv(_RECV_BYTES)
            if not data:
                return
            for payload in deframer.feed(data):
                event = pb.SessionEvent()
                event.ParseFromString(payload)
                yield event

    def shutdown(self) -> None:
        """Ends the connection both ways: a blocked ``send`` raises, ``events``
        ends; the daemon sees the session end (any thread)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already ended by the daemon

    def close(self) -> None:
        """Closes the socket (after :meth:`shutdown`, once no thread uses it)."""
        self._sock.close()
