"""The session commands an ``EngineClient`` queues, and the events it makes
itself (a load failed here, a hold ended here).

Each command keeps what the engine gave, as given; its ``SessionCommand`` is
built by the stream's sender thread (``build``), off the engine's step
(measured: building the protobuf cost the engine ~15 us per load).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd import tracepoints as tp
from kvd.requests import BlockGroups, LoadRequest
from kvd.v1 import kvd_pb2 as pb


def _groups_pb(groups: BlockGroups) -> list[dict]:
    """``groups`` as the initializers of ``repeated BlockIds`` (a message's
    keyword argument): dicts, not a message each, and the whole command
    made in one constructor call: 5.1 against 7.6 us a one-block load
    (upb, measured here; the sender thread builds every load and hold)."""
    return [{"ids": g} for g in groups]


class Load:
    """A load accepted by ``EngineClient.load``: its request, as given (a
    ``LoadRequest``, or a deferred load resolved when the command is
    built), and its state here."""

    __slots__ = ("req", "timeout_s", "deadline", "stream", "_cmd")

    def __init__(self, req: LoadRequest, timeout_s: float, deadline: float):
        self.req = req
        self.timeout_s = timeout_s      # the request's, or the client's default for 0
        self.deadline = deadline        # time.monotonic(); fail locally after it
        self.stream: int | None = None  # epoch of the stream it was sent on
        self._cmd: pb.SessionCommand | None = None

    def build(self) -> pb.SessionCommand:
        """The ``SessionCommand`` of this load (built once). A deferred load
        (not a ``LoadRequest``, see ``EngineClient.load``) is resolved here,
        on the sender thread; its ``InvalidLoad`` (or any other exception)
        propagates, and the caller fails that load alone
        (``Pending.refuse``)."""
        if self._cmd is None:
            r = self.req
            if type(r) is not LoadRequest:
                r = r.resolve()
            tp.hit(tp.SENT, r.request_id)
            self._cmd = pb.SessionCommand(load={
                "request_id": r.request_id, "local_groups": _groups_pb(r.local_groups),
                "remote_engine_id": r.remote_engine_id, "remote_address": r.remote_address,
                "remote_groups": _groups_pb(r.remote_groups), "remote_request_id": r.remote_request_id,
                "remote_tp_size": r.remote_tp_size, "timeout_s": self.timeout_s})
        return self._cmd


class Hold:
    """A hold accepted by ``EngineClient.hold`` (its command built by the sender thread, as a load's)."""

    __slots__ = ("request_id", "lease_deadline", "deadline", "stream", "lease_s", "groups", "_cmd")

    def __init__(self, request_id: str, lease_s: float, groups: BlockGroups, lease_deadline: float, deadline: float):
        self.request_id = request_id
        self.lease_s = lease_s
        self.groups = groups
        self.lease_deadline = lease_deadline  # monotonic end of the lease (or of the local wait for a default one)
        self.deadline = deadline              # lease_deadline + grace: end it locally
        self.stream: int | None = None
        self._cmd: pb.SessionCommand | None = None

    def hold_message(self, lease_s: float) -> pb.HoldBlocks:
        """A ``HoldBlocks`` of these blocks with ``lease_s``."""
        return pb.HoldBlocks(request_id=self.request_id, lease_s=lease_s, groups=_groups_pb(self.groups))

    def build(self) -> pb.SessionCommand:
        """The ``SessionCommand`` of this hold (built once)."""
        if self._cmd is None:
            self._cmd = pb.SessionCommand(hold={"request_id": self.request_id, "lease_s": self.lease_s,
                                                "groups": _groups_pb(self.groups)})
        return self._cmd


class Lazy:
    """A command without local state (release, abort): built by the sender thread."""

    __slots__ = ("make", "args")

    def __init__(self, make, *args):
        self.make = make
        self.args = args

    def build(self) -> pb.SessionCommand:
        """The ``SessionCommand``."""
        return self.make(*self.args)


def release_cmd(request_id: str) -> pb.SessionCommand:
    return pb.SessionCommand(release=pb.ReleaseBlocks(request_id=request_id))


def abort_cmd(request_id: str, engine: str, address: str, remote_rid: str, tp_size: int) -> pb.SessionCommand:
    """An ``AbortLoad``: the prefill engine ``engine`` at daemon ``address``
    frees ``remote_rid``'s blocks now (nobody will read them)."""
    return pb.SessionCommand(abort_load=pb.AbortLoad(
        request_id=request_id, remote_engine_id=engine, remote_address=address,
        remote_request_id=remote_rid, remote_tp_size=tp_size))


@dataclass
class Stream:
    """One session stream: its epoch, and whether it ended."""

    epoch: int
    done: bool = False


Command = Load | Hold | Lazy


def load_failed(request_id: str, local_block_ids: list[int], reason: str) -> pb.SessionEvent:
    """A ``load_failed`` made here (no answer from the daemon, the session
    lost, a rejection, the client closed)."""
    return pb.SessionEvent(load_failed=pb.LoadFailed(
        request_id=request_id, failed_block_ids=local_block_ids, reason=reason))


def hold_ended(request_id: str, *, expired: bool = False, released: bool = False) -> pb.SessionEvent:
    """A ``send_done`` made here (the lease over with no answer, a rejection)."""
    return pb.SessionEvent(send_done=pb.SendDone(request_id=request_id, expired=expired, released=released))
