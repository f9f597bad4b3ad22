"""Events the core sends to an engine worker's session, and core errors.

The gRPC adapter (``kvd.daemon.engine_service``) turns each into a
``kvd.v1.SessionEvent``; the core itself knows nothing of gRPC.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum


class CoreError(Exception):
    """Base of the typed errors the core raises; the adapter maps each to a status."""


class NotFound(CoreError):
    """An engine worker, region or request the caller named does not exist."""


class InvalidArgument(CoreError):
    """The caller's input is malformed or out of range."""


class AlreadyExists(CoreError):
    """The engine worker is registered already."""


class ResourceExhausted(CoreError):
    """A daemon-wide or per-uid cap (``kvd.core.limits.Limits``) is reached."""


class Incompatible(CoreError):
    """Two workers cannot exchange blocks (hash, version or layout mismatch)."""


class PeerUnavailable(CoreError):
    """A remote daemon could not be reached or answered with an error.

    ``transient``: the peer was unreachable or slow (gRPC UNAVAILABLE or
    DEADLINE_EXCEEDED), so a second try may succeed; False for answers that
    will not change (a peer that cannot prove the shared token, say).
    """

    def __init__(self, message: str = "", transient: bool = False):
        super().__init__(message)
        self.transient = transient


class WriteEnded(PeerUnavailable):
    """Push, source side: the push failed and no WRITE of it goes on (none
    was posted, or the one posted has ended: NIXL reported it). gRPC
    ABORTED, so the reader knows it need not stop one (``kvd.core.settle``);
    an UNAVAILABLE (a cut, an older source) leaves that unknown."""


class PeerBusy(PeerUnavailable):
    """A remote daemon refused the call for want of room (gRPC
    RESOURCE_EXHAUSTED: a cap, a full replay window): it did nothing of it."""


class PermissionDenied(CoreError):
    """The caller may not touch what it named (another process's memory)."""


@dataclass
class RecvDone:
    """Decode side: every block of ``request_id`` arrived (units: bytes, seconds)."""

    request_id: str
    bytes: int
    num_blocks: int
    num_descriptors: int
    duration_s: float
    post_duration_s: float = 0.0  # inside NIXL's post calls (NIXL telemetry's postDuration); 0 in push mode


class FailureKind(str, Enum):
    """Why a load failed, in a small fixed set: the ``reason`` label of
    ``kvd_transfer_failures_total`` and the first word of a ``LoadFailed``'s
    message."""

    INVALID = "invalid"            # the load's own input (block ids, TP size, too many blocks)
    BUSY = "busy"                  # too many loads in flight for the worker
    INCOMPATIBLE = "incompatible"  # no transfer plan joins the two layouts / TP sizes
    HANDSHAKE = "handshake"        # the peer could not be reached, refused, or is incompatible
    NOT_HELD = "not_held"          # the source holds no lease on those blocks for the request
    NIXL = "nixl"                  # NIXL refused to post a transfer
    TRANSFER = "transfer"          # a posted READ ended in error
    TIMEOUT = "timeout"            # the load's deadline passed
    PUSH = "push"                  # push mode: the source's WRITE failed
    DRAINING = "draining"          # the daemon is shutting down (a load that came in meanwhile)
    SHUTDOWN = "shutdown"          # the daemon stopped before the load finished
    UNREGISTERED = "unregistered"  # the local worker was unregistered meanwhile
    INTERNAL = "internal"          # a bug, or peer input no check foresaw


@dataclass
class LoadFailed:
    """Decode side: the load failed; ``failed_block_ids`` are local block ids
    (flat, as vLLM's ``get_block_ids_with_load_errors`` takes them)."""

    request_id: str
    failed_block_ids: list[int] = field(default_factory=list)
    reason: str = ""
    kind: FailureKind = FailureKind.INTERNAL


@dataclass
class SendDone:
    """Prefill side: the lease of ``request_id`` ended; vLLM may free the blocks."""

    request_id: str
    expired: bool = False
    released: bool = False


@dataclass
class LeaseRenewed:
    """Prefill side: a reader renewed the lease of ``request_id``; it now ends
    in ``left_s`` seconds at the latest (the engine client moves its own
    last-resort deadline of the hold by it)."""

    request_id: str
    left_s: float


@dataclass
class CommandRejected:
    """A session command was refused (bad block id, unknown request...)."""

    request_id: str
    reason: str


Event = RecvDone | LoadFailed | SendDone | LeaseRenewed | CommandRejected


#: What one block id of a queued LoadFailed holds (bytes): a list slot (8)
#: and, past 256, an int object of its own (28), with the list's slack.
#: Counted at 8, the 64 MiB default let one session hold ~300 MiB (a
#: session that never read, 8 LoadBlocks of 1M bad ids each: RSS +291 MiB a
#: worker, 4.7x what was counted; attacker review).
ID_BYTES = 40


def event_bytes(ev: Event) -> int:
    """What ``ev`` costs queued, roughly (bytes): its strings,
    :data:`ID_BYTES` per block id and a fixed 128 for the object. A
    LoadFailed repeats every block id of its load, so counting events alone
    does not bound memory (measured: a session that never read, fed
    LoadBlocks of a million bad ids, took the daemon from 86 to 885 MiB RSS
    under a count-only cap)."""
    n = 128 + len(ev.request_id)
    if isinstance(ev, LoadFailed):
        n += ID_BYTES * len(ev.failed_block_ids) + len(ev.reason)
    elif isinstance(ev, CommandRejected):
        n += len(ev.reason)
    return n


class EventQueue:
    """A worker session's queued events, with their :func:`event_bytes` summed
    (``nbytes``); a deque's ``append``/``popleft``/``clear``/``len``."""

    def __init__(self):
        self._q: deque = deque()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self):
        return iter(self._q)

    def append(self, ev: Event) -> None:
        self._q.append(ev)
        self.nbytes += event_bytes(ev)

    def popleft(self) -> Event:
        ev = self._q.popleft()
        self.nbytes -= event_bytes(ev)
        return ev

    def clear(self) -> None:
        self._q.clear()
        self.nbytes = 0
