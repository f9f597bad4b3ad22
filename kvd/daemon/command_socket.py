"""The command socket: an engine worker's session without gRPC.

Beside the engine socket (``kvd.command_wire.command_socket_path``) the
daemon accepts Unix stream connections that each carry one session in
frames (``kvd.command_wire``: a length, then a ``SessionCommand`` or a
``SessionEvent``). A load's two hops between engine and daemon then cost a
socket write and one wake-up each, instead of the gRPC stream's sender and
poller threads and the gate's relay (docs/PERFORMANCE.md, "Design note: the
engine <-> daemon command path without gRPC per load": ~10 us against
~180 us a round trip).

The session's rules are not repeated here: every connection runs
``EngineService.session_events``, the same code as the gRPC ``Session``
stream. What this module adds is the transport, with the gate's admission
and bounds:

- the socket has the engine socket's mode (0660) and group; each
  connection's caller is read from the kernel (``SO_PEERCRED``,
  ``SO_PEERGROUPS``) once, at accept, and counted against the same caps
  (``Gate.admit``: ``max_engine_connections``, ``..._per_uid``: one count
  for both sockets); one that sends nothing within ``engine_idle_timeout_s``
  is closed; a caller the ``Policy`` does not admit gets one ``rejected``
  event naming the policy and is closed, as the gate answers
  PERMISSION_DENIED;
- a frame longer than ``max_message_bytes`` or one that is not a
  ``SessionCommand`` closes the connection after a ``rejected`` event saying
  so (the session's worker is detached, as when a stream breaks);
- a session refusal (``Refused``: the status the stream would end
  with) is a ``rejected`` event whose reason starts with the status name,
  then the close;
- commands read ahead of the session's opening are bounded (reading pauses
  above ``max_message_bytes`` of them or ``_MAX_AHEAD_COMMANDS``); once it
  is open each runs as it is read, at most ``_PASS_COMMANDS`` of one
  connection per pass of the event loop and :data:`PASS_BUDGET_S` of
  commands per pass across all connections, then in turns by caller uid
  (:class:`_Turns`; reading pauses meanwhile);
  events are written while the socket takes them (those of one pass of
  the event loop together, at its end: one write), else wait in the
  worker's own queue (bounded by ``max_queued_event_bytes``) while the
  socket's write buffer is full, as they wait behind gRPC's flow control on
  the stream.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import time
import traceback
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from kvd import tracepoints as tp
from kvd.command_wire import Deframer, FrameError, frame
from kvd.core.limits import Limits
from kvd.daemon import wire_shape
from kvd.daemon.call_refusal import Refused
from kvd.daemon.engine_service import EngineService
from kvd.daemon.h2_refusal import LINGER_S, PREFACE, Refusal
from kvd.daemon.local_gate import Caller, Gate, bind_side_socket, unlink_own
from kvd.daemon.logs import Throttled, Throttles
from kvd.v1 import kvd_pb2 as pb

log = logging.getLogger("kvd.command_socket")

WHAT = "command socket"
_FAILED = Throttled(log)
_WRITE_HIGH = 1 << 20  # bytes of events queued on one connection before the session waits for the engine
# Commands read ahead of the session's opening (it may wait for an earlier
# session's READs to settle): a parsed command takes ~100 times its bytes on
# the wire (an empty one: 6 bytes, ~650 parsed), so bytes alone do not bound it.
_MAX_AHEAD_COMMANDS = 4096
# Commands of one connection run per pass of the event loop once its session
# is open; the rest wait for the next pass (fairness between engines).
_PASS_COMMANDS = 128
# Event frames written in one pass of the loop are sent together, at its end
# (one write, one wake-up of the engine's reader) unless they reach this
# many bytes first. Measured: a write per event cost the source daemon ~40
# and the decode daemon ~20 us of its CPU per one-block load with 64 in
# flight, most of it the wake-up of the engine's thread, not the bytes
# (cProfile; docs/PERFORMANCE.md, "Per-load cost, ninth round").
_COALESCE_BYTES = 64 << 10
# Bytes of unfinished frames one caller uid may have waiting, all its
# connections together, in max_message_bytes: a frame waits whole before it
# is parsed, and an engine that starts large frames and never finishes them
# held +1.6 GiB with 32 connections (attacker review; up to
# max_engine_connections_per_uid x max_message_bytes before). Past it the
# connection that brought the bytes is closed (RESOURCE_EXHAUSTED).
PARTIAL_FRAMES_PER_UID = 2
# Seconds of commands run in one pass of the event loop, all connections
# together; past it the connections with commands left take turns in the
# next passes, one command each, round-robin by caller uid (_Turns). A count
# per connection alone let one uid's 30 connections, each sending a
# LoadBlocks of 200,000 bad ids (~45 ms of the loop to refuse), stall every
# engine: another session's round trip ~1 ms -> 1.4 s, `kvd health` past
# its 2 s deadline (attacker review).
PASS_BUDGET_S = 0.005
# Turns that took longer than this are followed by as long a pause (_Turns._drain), up to _MAX_IDLE_S.
_IDLE_AFTER_S = 0.001
_MAX_IDLE_S = 0.05


class _Turns:
    """Whose commands run when more are waiting than one pass of the loop
    has room for (daemon-wide).

    A connection runs its commands as they are read while no connection
    waits and this pass has spent less than :data:`PASS_BUDGET_S` on
    commands (the first command of a pass always runs: a command is not
    split). Past that it waits here: each later pass gives turns of one
    command, round-robin over the caller uids waiting, then over that
    uid's connections, until the pass's budget is spent. So what any
    caller uid's commands cost, other uids' sessions wait at most about
    one of its commands per turn of theirs, and the loop's timers, gRPC
    calls and health checks run between passes.
    """

    def __init__(self, budget_s: float = PASS_BUDGET_S):
        self.budget_s = budget_s
        self._waiting: collections.OrderedDict[int, collections.deque[_Commands]] = collections.OrderedDict()
        self._pass_end: float | None = None  # when this pass's budget is spent (None: no command ran yet)
        self._drain_due = False

    def may_run(self) -> bool:
        """True when a command read now may run now (nobody waits, budget left)."""
        if self._waiting:
            return False
        end = self._pass_end
        if end is None:
            self._pass_end = time.monotonic() + self.budget_s
            asyncio.get_running_loop().call_soon(self._new_pass)
            return True
        return time.monotonic() < end

    def wait(self, uid: int, commands: _Commands) -> None:
        """``commands`` (of caller ``uid``) has commands left: it runs them in turns."""
        self._waiting.setdefault(uid, collections.deque()).append(commands)
        if not self._drain_due:
            self._drain_due = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _new_pass(self) -> None:
        self._pass_end = None

    def _drain(self) -> None:
        self._drain_due = False
        start = time.monotonic()
        end = start + self.budget_s
        waiting = self._waiting
        while waiting:
            uid, queue = next(iter(waiting.items()))
            commands = queue.popleft()
            try:
                more = commands.run_turn()
            except Exception:  # a bug: that connection's commands end, the turns go on (none may hang)
                _FAILED.warning("%s: a turn of commands failed; that session's commands end\n%s", WHAT,
                                traceback.format_exc())
                commands.abort()
                more = False
            if more:
                queue.append(commands)
            if queue:
                waiting.move_to_end(uid)
            else:
                del waiting[uid]
            if time.monotonic() >= end:
                break
        if waiting:
            # The next turns after as long as these took: commands that wait
            # get at most about half of the loop; the load tasks they
            # started, timers and gRPC calls run in between.
            self._drain_due = True
            spent = time.monotonic() - start
            if spent > _IDLE_AFTER_S:
                # At most _MAX_IDLE_S: a second-long command does not hold
                # every waiting command a second more.
                asyncio.get_running_loop().call_later(min(spent, _MAX_IDLE_S), self._drain)
            else:
                asyncio.get_running_loop().call_soon(self._drain)


def _rejected(reason: str) -> bytes:
    return frame(pb.SessionEvent(rejected=pb.CommandRejected(reason=reason)).SerializeToString())


class _Commands:
    """The commands of one connection as an async iterator (what
    ``session_events`` reads until the session is open), then handed to the
    session's handler as they are read (:meth:`run_direct`); ends when the
    engine closes or the frames go bad.

    Frames wait as bytes and are parsed as they run: a parsed command takes
    ~100 times its bytes on the wire (an empty one: 6 bytes, ~650 parsed),
    so what one read brings (up to 256 KiB) stays 256 KiB while it waits.
    A frame that is not a ``SessionCommand``, or holds more than an
    engine's command can (``kvd.daemon.wire_shape``), calls ``on_bad(why)``."""

    def __init__(self, transport: asyncio.Transport, max_ahead_bytes: int,
                 on_bad: Callable[[str], None] = lambda why: None, shape: wire_shape.Shape | None = None,
                 turns: _Turns | None = None, uid: int = -1):
        self._transport = transport
        self._turns = turns or _Turns()
        self._uid = uid
        self._shape = shape or wire_shape.engine_shape(pb.SessionCommand.DESCRIPTOR, Limits.max_blocks_per_request)
        self._max_ahead = max_ahead_bytes
        self._on_bad = on_bad
        self._queue: collections.deque[tuple[bytes, int]] = collections.deque()  # (frame payload, bytes)
        self._bytes = 0
        self._paused = False
        self._ended = False
        self._waiter: asyncio.Future | None = None
        self._direct: Callable[[pb.SessionCommand], bool] | None = None
        self._done: asyncio.Future | None = None  # run_direct's: done when the commands end
        self._scheduled = False  # a _run is due in the loop's next pass
        self._in_pass = 0  # commands run in this pass of the loop

    def run_direct(self, handler: Callable[[pb.SessionCommand], bool]) -> asyncio.Future:
        """From now on every command goes to ``handler`` as soon as its frame
        is read (``data_received``), in order, the ones read ahead first: no
        round of a reader task per command (measured: docs/PERFORMANCE.md,
        "sixth round"). At most ``_PASS_COMMANDS`` per pass of the loop:
        past them this connection's reading pauses and the rest run in later
        passes, other connections' reads and timers served in between (one
        engine's flood of commands does not hold up every other session).
        ``handler`` returns False to read no more (the session ends).
        Returns a future done when the commands end (EOF and every command
        run; a bad frame, the connection lost or dropped: :meth:`abort`;
        that False); cancelling it stops the handler too."""
        self._done = asyncio.get_running_loop().create_future()
        self._direct = handler
        self._run()
        return self._done

    def _run(self) -> None:
        """Runs queued commands, at most ``_PASS_COMMANDS`` now and while the
        pass has room (:class:`_Turns`); past either the rest wait."""
        self._scheduled = False
        done, handler, queue, turns = self._done, self._direct, self._queue, self._turns
        while queue and handler is not None and not done.done():
            if self._in_pass >= _PASS_COMMANDS:
                self._wait(asyncio.get_running_loop().call_soon, self._run)
                return
            if not turns.may_run():
                self._wait(turns.wait, self._uid, self)
                return
            if not self._in_pass:
                asyncio.get_running_loop().call_soon(self._new_pass)  # before the _run above, if one is due
            self._in_pass += 1
            if not self._run_one(handler):
                return
            handler = self._direct  # None once the handler said stop
        self._settle()

    def run_turn(self) -> bool:
        """One queued command (a turn :class:`_Turns` gives); True when more
        wait to run (this connection takes another turn)."""
        self._scheduled = False
        if self._runnable() and not self._run_one(self._direct):
            return False
        if self._runnable():
            self._scheduled = True
            return True
        self._settle()
        return False

    def _runnable(self) -> bool:
        """Commands queued, and the session still takes them."""
        return bool(self._queue) and self._direct is not None and not self._done.done()

    def _wait(self, schedule, *args) -> None:
        """Commands left for a later pass: reading pauses meanwhile."""
        self._scheduled = True
        schedule(*args)
        if not self._paused:
            self._paused = True
            self._transport.pause_reading()

    def _run_one(self, handler: Callable[[pb.SessionCommand], bool]) -> bool:
        """Parses and runs the oldest queued command; False on bad input (the connection is ending)."""
        payload, size = self._queue.popleft()
        self._bytes -= size
        cmd = self._parse(payload)
        if cmd is None:
            return False  # bad input: the connection is ending (on_bad)
        self._call(handler, cmd)
        return True

    def _settle(self) -> None:
        """Nothing left to run now: reading resumes; the commands end after EOF."""
        if self._direct is None or self._done.done():
            self._queue.clear()
            self._bytes = 0
        if self._paused and not self._transport.is_closing():
            self._paused = False
            self._transport.resume_reading()
        if self._ended and not self._queue:
            self._finish()

    def _new_pass(self) -> None:
        self._in_pass = 0

    def _parse(self, payload: bytes) -> pb.SessionCommand | None:
        """The command in ``payload``; None (and ``on_bad``) when it is not one."""
        cmd = pb.SessionCommand()
        try:
            wire_shape.check(payload, pb.SessionCommand.DESCRIPTOR, self._shape)  # before a parse that could cost seconds
            cmd.ParseFromString(payload)
        except wire_shape.ShapeError as e:
            self._on_bad(f"a frame past an engine's bounds ({e})")
            self.abort()
            return None
        except DecodeError as e:
            self._on_bad(f"a frame that is not a SessionCommand ({e})")
            self.abort()  # what came after it does not run
            return None
        return cmd

    def _call(self, handler: Callable[[pb.SessionCommand], bool], cmd: pb.SessionCommand) -> None:
        try:
            keep = handler(cmd)
        except Exception as e:  # a bug: this session ends, the daemon keeps serving
            # Throttled: an engine that can trigger it reconnects and does it again.
            _FAILED.warning("%s: a session command failed (%s: %s); session ended\n%s", WHAT, type(e).__name__, e,
                            traceback.format_exc())
            keep = False
        if not keep:
            self._direct = None  # later frames are read and dropped until the session closes the connection
            self._finish()

    def _finish(self) -> None:
        d = self._done
        if d is not None and not d.done():
            d.set_result(None)

    def put(self, payload: bytes, size: int) -> None:
        """Queues one frame's payload (``size`` bytes); runs it now when the
        session is open and this pass of the loop has room."""
        self._queue.append((payload, size))
        self._bytes += size
        if self._done is not None:  # the session is open: run now, unless this pass had its share
            if not self._scheduled:
                self._run()
            return
        if (self._bytes > self._max_ahead or len(self._queue) > _MAX_AHEAD_COMMANDS) and not self._paused:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def end(self) -> None:
        """No more commands come (EOF): the ones queued still run, then the
        commands end."""
        self._ended = True
        if self._done is not None and not self._queue:
            self._finish()
        self._wake()

    def abort(self) -> None:
        """The connection is gone: what is queued is dropped and the
        commands end now."""
        self._queue.clear()
        self._bytes = 0
        self._direct = None
        self._ended = True
        self._finish()
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def __aiter__(self):
        return self

    async def __anext__(self) -> pb.SessionCommand:
        while True:
            while not self._queue:
                if self._ended:
                    raise StopAsyncIteration
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            payload, size = self._queue.popleft()
            self._bytes -= size
            if self._paused and self._bytes <= self._max_ahead // 2 and len(self._queue) <= _MAX_AHEAD_COMMANDS // 2:
                self._paused = False
                self._transport.resume_reading()
            cmd = self._parse(payload)
            if cmd is not None:
                return cmd


class _Connection(asyncio.Protocol):
    """One engine's connection: admitted, deframed, served by ``session_events``."""

    def __init__(self, owner: "CommandSocket"):
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.caller: Caller | None = None
        self.deframer = Deframer(owner.max_message_bytes)
        self.commands: _Commands | None = None
        self.task: asyncio.Task | None = None
        self.idle: asyncio.TimerHandle | None = None
        self._drained: asyncio.Future | None = None
        # Event frames of this pass of the loop, not written yet (_flush).
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._flush_at: asyncio.Handle | None = None
        self._spoke = False  # its first 4 bytes read (a frame's length, or a gRPC client's preface)
        self._head = b""  # the first bytes, while fewer than 4 that could be the preface's
        self._partial_bytes = 0  # of an unfinished frame, counted in owner.partial
        self._lingering: asyncio.TimerHandle | None = None  # _linger's bound
        self.refusal: Refusal | None = None  # a gRPC client's (_refuse_grpc)

    def connection_made(self, transport) -> None:
        self.transport = transport
        # Paused until admitted (as the gate's connections are): a refused
        # one is closed unread (uvloop closes it only then).
        transport.pause_reading()
        owner = self.owner
        caller = owner.gate.admit(transport, WHAT)
        if caller is None:
            return
        self.caller = caller
        if not caller.admitted:
            transport.write(_rejected(f"PERMISSION_DENIED: {owner.gate.not_admitted(caller, WHAT)}"))
            transport.close()
            return
        transport.set_write_buffer_limits(high=_WRITE_HIGH)
        self.idle = asyncio.get_running_loop().call_later(owner.gate.idle_timeout_s, self._idle)
        self.commands = _Commands(transport, owner.max_message_bytes, self._bad_input, owner.shape, owner.turns,
                                  caller.uid)
        self.task = asyncio.get_running_loop().create_task(self._serve(self.commands))
        owner.connections.add(self)
        transport.resume_reading()

    def _idle(self) -> None:
        self.idle = None
        if not self.transport.is_closing():
            self.owner.gate.refuse("idle", "%s: %s sent nothing in %g s (engine_idle_timeout_s); connection "
                                   "closed", WHAT, self.caller, self.owner.gate.idle_timeout_s)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        tp.hit(tp.GATE_IN)  # as the gate's relay marks a command's bytes arriving (benchmarks.trace)
        if self.refusal is not None:
            self.idle = self.refusal.feed_keeping(data, self.idle)
            return
        if self.idle is not None:  # the engine spoke
            self.idle.cancel()
            self.idle = None
        if self.commands is None:
            return  # refused: closing
        if not self._spoke:
            data, self._head = self._head + data, b""
            if len(data) < 4 and PREFACE.startswith(data):
                # Too few to tell a gRPC preface sent in pieces from a frame's
                # length; the deframer would wait for the 4 bytes as well.
                self._head = data
                return
            self._spoke = True
            if data.startswith(PREFACE[:4]):  # not a frame of 541,676,112 bytes: a gRPC client
                self._refuse_grpc(data)
                return
        try:
            payloads, bad = self.deframer.feed(data), None
            if self._partial(self.deframer.buffered):
                return
        except FrameError as e:
            # The frames before it are put as if read before it (they run as
            # far as this pass's share goes; the abort then drops the rest, as
            # it drops anything queued). A str: the exception would hold this
            # frame, and the read's bytes, in a reference cycle.
            payloads, bad = e.payloads, str(e)
        for p in payloads:  # parsed as each runs (_Commands)
            commands = self.commands
            if commands is None:
                return  # one was bad: the connection is closing
            commands.put(p, len(p))
        if bad is not None:
            self._bad_input(bad)

    def _refuse_grpc(self, data: bytes) -> None:
        """A gRPC client dialed the command socket (``kvd status --socket
        X.cmd``, grpcurl): its first call is answered FAILED_PRECONDITION
        naming the engine socket (``h2_refusal.Refusal``), then the
        connection closes; before, it read the preface as a frame of
        541,676,112 bytes and the client saw only "Failed parsing HTTP/2"."""
        self.owner.warn.warning("%s: %s is a gRPC client; answered with the engine socket's path", WHAT,
                                self.caller)
        # No session: it would answer in frames and close before the refusal
        # is sent. Its cancellation must not be lost to the commands' end in
        # the same pass (Python 3.11's wait_for lost it: the session's first
        # wait is asyncio.timeout, in its own task).
        self.task.cancel()
        self.commands.abort()
        self.commands = None
        loop = asyncio.get_running_loop()
        self.refusal = Refusal(self.transport, grpc.StatusCode.FAILED_PRECONDITION,
                               f"kvd: this is a daemon's command socket, which serves no gRPC: its engine "
                               f"socket is {self.owner.gate.path}", loop.call_later)
        self.refusal.feed(data)
        if not self.refusal.done:  # one that never sends its call is closed as a silent engine is
            self.idle = loop.call_later(self.owner.gate.idle_timeout_s, self._idle)

    def _partial(self, nbytes: int) -> bool:
        """Counts this connection's bytes of an unfinished frame (``nbytes``
        now) against its uid's budget (``PARTIAL_FRAMES_PER_UID``); True when
        that is passed and the connection is closing."""
        owner, uid = self.owner, self.caller.uid
        total = owner.partial.get(uid, 0) + nbytes - self._partial_bytes
        self._partial_bytes = nbytes
        if total:
            owner.partial[uid] = total
        else:
            owner.partial.pop(uid, None)
        limit = PARTIAL_FRAMES_PER_UID * owner.max_message_bytes
        if total <= limit:
            return False
        self._bad_input(f"unfinished frames: uid {uid}'s connections hold {total} bytes of frames not yet whole, "
                        f"more than {limit} ({PARTIAL_FRAMES_PER_UID} x max_message_bytes)")
        return True

    def _bad_input(self, why: str) -> None:
        if self.commands is None:
            return
        # Its unfinished frame counts no more: while it lingers it held its
        # uid's budget, and every other connection of the uid was refused
        # next (attacker review).
        self.deframer.clear()
        if self.caller is not None:
            self._partial(0)
        self.owner.warn.warning("%s: %s sent %s; connection closed", WHAT, self.caller, why)
        self.commands.abort()  # what came after it does not run
        self.commands = None
        code = "RESOURCE_EXHAUSTED" if "max_message_bytes" in why else "INVALID_ARGUMENT"
        self._flush()  # the events before it, then the rejection
        self.transport.write(_rejected(f"{code}: {why}"))
        self._linger()

    def _closing(self) -> bool:
        """True once nothing more may be written: the transport is closing,
        or half-closed after a bad frame's rejection (:meth:`_linger`; a
        write then raises RuntimeError, which ended the session's task with
        the refused frame held in its exception's frames, attacker review)."""
        return self._lingering is not None or self.transport.is_closing()

    def _linger(self) -> None:
        """Half-closes after what was written, then reads and drops whatever
        still comes until the engine closes or ``LINGER_S`` passes: a close
        with bytes unread resets the connection, and an engine still sending
        (the rest of a frame too large) lost the rejection to ECONNRESET."""
        t = self.transport
        if t.is_closing() or not t.can_write_eof():
            t.close()
            return
        t.write_eof()
        self._lingering = asyncio.get_running_loop().call_later(LINGER_S, t.abort)  # abort: it may never read
        t.resume_reading()  # paused while commands waited ahead of the session: drain

    def eof_received(self):
        if self.refusal is not None:
            self.refusal.eof()
            return False
        if self._lingering is not None:
            return False  # the engine is done: closed
        if self.commands is not None:
            self.commands.end()
        return True  # half-close: the events still go out until the session ends

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        d, self._drained = self._drained, None
        if d is not None and not d.done():
            d.set_result(None)

    def connection_lost(self, exc) -> None:
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None
        if self.refusal is not None:
            self.refusal.close()  # its linger timer
        if self._lingering is not None:
            self._lingering.cancel()
        if self.caller is not None:
            self.owner.gate.leave(self.caller.uid)
            self._partial(0)
        # An unfinished frame's bytes go now: the commands hold this
        # connection (their on_bad) and it them, a cycle that kept up to
        # max_message_bytes per closed connection until the collector ran
        # (6.3 GiB after an attack's connections had all closed: attacker review).
        self.deframer.clear()
        if self.commands is not None:
            self.commands.abort()  # the session ends: what is queued does not run (as gRPC cancels a stream)
            self.commands = None
        self._discard_out()
        self.resume_writing()
        if self.task is not None:
            self.task.cancel()  # as gRPC cancels a stream's handler when its client goes
        self.owner.connections.discard(self)

    def _write_event(self, e: pb.SessionEvent) -> bool:
        """Takes ``e`` for the socket (the session's direct ``write_event``):
        the first event of a pass of the loop is written at once, the later
        ones of the same pass together at its end (:meth:`_flush`), or at
        once past ``_COALESCE_BYTES``; False, taking nothing, while the
        socket's buffer is over ``_WRITE_HIGH`` or the connection is closing
        (the event is then queued).

        Why the first at once: a lone load's event waited for the rest of
        its pass (the load task's end, other callbacks), 0.10-0.15 ms of a
        small load's ~2.2-3.5 ms here (``benchmarks.trace``, leg "event built
        -> its bytes written"); a burst still costs two writes, not one per
        event (docs/PERFORMANCE.md, "ninth round")."""
        if self._drained is not None or self._closing():
            return False
        data = frame(e.SerializeToString())
        self._out.append(data)
        self._out_bytes += len(data)
        if self._flush_at is None:
            self._flush()
            # Marks the pass: events until its end are written together.
            self._flush_at = asyncio.get_running_loop().call_soon(self._flush)
        elif self._out_bytes >= _COALESCE_BYTES:
            self._flush()
        return True

    def _flush(self) -> None:
        """Writes the event frames taken this pass (one write); before any
        other write on the connection, so events keep their order."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        if not self._out:
            return
        out, n = self._out, len(self._out)
        self._out, self._out_bytes = [], 0
        t = self.transport
        if self._closing():
            return
        try:
            t.write(out[0] if n == 1 else b"".join(out))
        except Exception as e:  # not seen from uvloop's open transports; never lose events unseen
            # The engine must learn these events are gone: the connection
            # breaks, its loads fail and it reconnects (as for a dropped session).
            self.owner.warn.warning("%s: writing events to %s failed (%s: %s); connection ended", WHAT,
                                    self.caller, type(e).__name__, e)
            t.abort()
            return
        for _ in range(n):
            tp.hit(tp.GATE_OUT)

    def _discard_out(self) -> None:
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        self._out, self._out_bytes = [], 0

    def _drop(self) -> None:
        """The session was dropped for not reading its events: the
        connection ends now (its unread bytes dropped; the engine sees it
        break, fails its loads and reconnects), not once the engine reads."""
        self.owner.warn.warning("%s: %s does not read its events; connection ended", WHAT, self.caller)
        self._discard_out()
        if self.commands is not None:
            self.commands.abort()
            self.commands = None  # the rest of this read is not queued
        self.transport.abort()

    async def _serve(self, commands: _Commands) -> None:
        t = self.transport
        try:
            async with contextlib.aclosing(self.owner.service.session_events(
                    commands, lambda: self.caller, self._write_event, self._drop)) as events:
                async for e in events:
                    if self._closing():
                        break  # the engine is gone, or a bad frame's rejection went: the session ends
                    self._flush()
                    t.write(frame(e.SerializeToString()))
                    tp.hit(tp.GATE_OUT)
                    if self._drained is not None:
                        await self._drained
        except Refused as r:
            # Any admitted uid may open sessions it cannot have as fast as it
            # connects: 24k lines of 4 KiB in 10 s (attacker review). None
            # for a connection that sent nothing (a look at the server's
            # credentials: kvd health/status named this socket) or a gRPC
            # client's (_refuse_grpc's line says it): "the engine ended its
            # commands" read as a fault to a new user.
            if self._spoke and self.refusal is None:
                self.owner.refusals.info(self.caller.uid if self.caller else None, "%s: session of %s refused: %s",
                                         WHAT, self.caller, r)
            self._flush()
            if not self._closing():
                t.write(_rejected(str(r)))
        except Exception:  # the daemon keeps serving; this connection ends
            log.exception("%s: session of %s failed", WHAT, self.caller)
        try:
            self._flush()
        finally:
            if self._lingering is None:  # a rejection's close is _linger's
                t.close()


class CommandSocket:
    """The command socket (see the module).

    Args:
        path: its socket (``kvd.command_wire.command_socket_path(engine_socket)``).
        gate: the engine socket's gate: admission (``Policy``), the connection
            caps and their counts, the refusal counters.
        service: the ``EngineService`` whose ``session_events`` serves each connection.
        max_message_bytes: the longest frame accepted (the engine server's
            ``max_message_bytes``).

    ``open()`` binds and starts accepting (on the running loop); ``close()``
    stops, closes every connection (their sessions end) and removes the socket
    if it is still the file bound here.
    """

    def __init__(self, path: str, gate: Gate, service: EngineService, max_message_bytes: int):
        self.path = path
        self.gate = gate
        self.service = service
        self.max_message_bytes = max_message_bytes
        # What one command may hold, counted before it is parsed (kvd.daemon.wire_shape).
        self.shape = wire_shape.engine_shape(pb.SessionCommand.DESCRIPTOR,
                                             service.node.limits.max_blocks_per_request)
        self.connections: set[_Connection] = set()
        self.partial: dict[int, int] = {}  # bytes of unfinished frames per caller uid (PARTIAL_FRAMES_PER_UID)
        self.turns = _Turns()  # commands past a pass's budget, in turns by caller uid
        self.warn = Throttled(log)
        self.refusals = Throttles(log)  # sessions refused (Refused), a line a second per caller uid
        self._server: asyncio.AbstractServer | None = None
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file bound

    async def open(self) -> None:
        """Binds ``path`` (mode 0660, the gate's group) and starts accepting.
        A socket file left there is replaced (the engine socket's check has
        run: no daemon serves here). Raises OSError when it cannot be bound
        or given to the group."""
        # Commands carry no fds (local_gate.refuse_passed_fds says why).
        s, self._bound = bind_side_socket(self.path, socket.SOCK_STREAM, self.gate.group, 1024, WHAT,
                                          passes_fds=False)
        self._server = await asyncio.get_running_loop().create_unix_server(lambda: _Connection(self), sock=s)

    async def close(self) -> None:
        """Stops accepting, closes every connection, removes the socket."""
        if self._server is None:
            return
        self._server.close()
        self._server = None
        for c in list(self.connections):
            try:
                c._flush()
            finally:
                c.transport.close()
        unlink_own(self.path, self._bound, WHAT)

