"""How an engine's commands leave on the command socket (``SessionLoop.flush``).

The engine's thread writes its commands itself, without waiting: when the
daemon does not read (a stalled daemon, a full socket) what the socket does
not take is left to the session's sender thread, and nothing is lost,
repeated or reordered. Against a real Unix socket served by the test, which
reads only when told to.
"""

from __future__ import annotations

import socket
import threading
import time

from kvd.client.pending import Pending
from kvd.client.session import SessionLoop
from kvd.command_wire import Deframer, command_socket_path, frame
from kvd.requests import LoadRequest
from kvd.v1 import kvd_pb2 as pb

BLOCKS = 4000  # ~16 KB a command: 60 of them fill a Unix socket's buffers several times


class CommandServer:
    """A command socket that answers OpenSession, then reads commands only
    once :attr:`reading` is set."""

    def __init__(self, engine_socket: str):
        self.path = command_socket_path(engine_socket)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(1)
        self.reading = threading.Event()
        self.commands: list[pb.SessionCommand] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        self.conn = conn
        deframer = Deframer(1 << 24)
        opened = False
        while True:
            if opened:
                self.reading.wait()
            data = conn.recv(1 << 16)
            if not data:
                return
            for p in deframer.feed(data):
                cmd = pb.SessionCommand()
                cmd.ParseFromString(p)
                self.commands.append(cmd)
                if cmd.WhichOneof("command") == "open" and not opened:
                    opened = True
                    conn.sendall(frame(pb.SessionEvent(opened=pb.SessionOpened(agent_name="a")).SerializeToString()))

    def close(self) -> None:
        self.reading.set()
        try:
            self.conn.close()
        except AttributeError:
            pass
        self.sock.close()


def _session(tmp_path) -> tuple[SessionLoop, Pending, CommandServer]:
    engine_socket = str(tmp_path / "engine.sock")
    server = CommandServer(engine_socket)
    pending = Pending()
    loop = SessionLoop(None, pending, open_session=lambda: pb.OpenSession(worker=pb.EngineWorker(engine_id="e")),
                       reregister=lambda: None, backoff_initial_s=0.05, backoff_max_s=0.1,
                       address=f"unix:{engine_socket}")
    loop.start()
    assert loop.opened.wait(5)
    deadline = time.monotonic() + 5
    while loop._direct is None and time.monotonic() < deadline:  # the sender sent OpenSession first
        time.sleep(0.005)
    assert loop._direct is not None, "the session never let the engine's thread write"
    return loop, pending, server


def _load(rid: str) -> LoadRequest:
    return LoadRequest(rid, [list(range(BLOCKS))], "p", "127.0.0.1:1", [list(range(BLOCKS))], f"p-{rid}")


def _stop(loop: SessionLoop, pending: Pending, server: CommandServer) -> None:
    pending.closing.set()
    pending.wake()
    server.close()
    loop.stop(5)


def test_a_stalled_daemon_never_blocks_the_engine_and_loses_no_command(tmp_path):
    loop, pending, server = _session(tmp_path)
    try:
        done = threading.Event()

        def engine_step() -> None:
            for i in range(60):
                pending.add_load(_load(f"r{i}"), 30.0, 60.0)
                loop.flush()
            done.set()

        engine = threading.Thread(target=engine_step, daemon=True)
        engine.start()
        # The daemon reads nothing: the engine's 60 commands (~1 MB) do not
        # fit in the socket, and still every flush returns.
        assert done.wait(10), "a flush waited for the daemon to read"
        conn, _ = loop._direct
        assert conn.backlog or pending._outq, "the test did not fill the socket (raise BLOCKS)"
        server.reading.set()
        deadline = time.monotonic() + 10
        while len(server.commands) < 61 and time.monotonic() < deadline:
            time.sleep(0.01)
        got = [c.load.request_id for c in server.commands[1:]]
        assert got == [f"r{i}" for i in range(60)]  # each once, in order
        assert all(len(c.load.local_groups[0].ids) == BLOCKS for c in server.commands[1:])
    finally:
        _stop(loop, pending, server)


def test_a_command_left_unflushed_still_goes_out(tmp_path):
    """``batch_commands``: a caller that never flushes is late, not lost
    (the sender thread looks every 0.5 s)."""
    loop, pending, server = _session(tmp_path)
    server.reading.set()
    try:
        pending.add_load(_load("late"), 30.0, 60.0)  # no flush
        deadline = time.monotonic() + 5
        while len(server.commands) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [c.load.request_id for c in server.commands[1:]] == ["late"]
    finally:
        _stop(loop, pending, server)
