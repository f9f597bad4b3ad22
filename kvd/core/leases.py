"""Leases: prefill blocks held for remote readers (docs/DESIGN.md, protocol step 1/4).

One ``LeaseTable`` per prefill worker. A lease ends when every expected reader
has notified (a READ's notification, or an abort's bare notification), when
the engine releases it, or when it expires; each end is reported once.

Notifications name the request and how many reader ranks will notify this
source rank for it (``"<request id>:<expected>"``, heterogeneous TP), one
such piece per load a READ carries, each after its length (a reader posts
the small READs of several loads as one transfer, ``kvd.core.pull``); a
notification that arrives before its hold is kept for ``early_s`` seconds.

A reader still waiting to read (vLLM's decode request queued on D) renews
the lease (``renew``: PeerService.Renew from its daemon, as vLLM's
NixlConnector sends heartbeats, ``nixl/base_worker.py`` ``_handle_heartbeat``):
each renewal moves the deadline to a full lease from now, never past the
lease's start plus the life cap (``Limits.max_lease_life_s``), so a reader
that never reads cannot pin the blocks for longer than that.

Costs (the progress loop expires leases every few milliseconds): expiry is
a heap of deadlines, compacted when ended or renewed leases' entries
outnumber the live ones (before, each hold+release or renewal left an entry
until its first deadline, up to ``max_lease_s``: +16 MiB per 15,000 pairs
with no lease live); early notifications are kept in deadline order (one
``early_s`` for all), so expiring them looks only at the expired ones
(before, 65,536 of them were scanned on every poll: 55 % of a core idle),
in an ``OrderedDict``, whose oldest entry is found in O(1) (a plain dict's
first key is found by scanning the slots freed at its front: once the table
was full each further notification cost ~38 us, and expiring 65,536 at once
took 3 s of the event loop).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvd.core.limits import BOUNDS


def notif_message(request_id: str, expected: int) -> bytes:
    """The notification piece a reader sends a source rank for
    ``request_id``: its length (2 bytes, big-endian), then
    ``"<request id>:<expected>"`` (UTF-8). Pieces concatenate: the
    notification of a READ that carries several loads is theirs joined.
    The length, not a separator, ends a piece: a request id is an engine's
    string and may hold any character (a separator inside one would let an
    engine name another request's lease)."""
    piece = f"{request_id}:{expected}".encode()
    return len(piece).to_bytes(2, "big") + piece


def parse_notif(msg: bytes) -> list[tuple[str, int]] | None:
    """The ``(request id, expected notifications)`` of each piece of ``msg``
    (:func:`notif_message`), or None if any is malformed, longer than any
    request id a daemon accepts and its count, or there are more than
    ``BOUNDS.max_loads_per_read`` pieces: the notification is then ignored
    whole (a peer that sends it is hostile or broken)."""
    if len(msg) > BOUNDS.max_loads_per_read * (2 + BOUNDS.max_notif_bytes):
        return None
    out = []
    at, end = 0, len(msg)
    while at < end:
        n = int.from_bytes(msg[at:at + 2], "big")
        piece = msg[at + 2:at + 2 + n]
        at += 2 + n
        if len(piece) != n or not 0 < n <= BOUNDS.max_notif_bytes or len(out) == BOUNDS.max_loads_per_read:
            return None
        try:
            rid, sep, count = piece.decode().rpartition(":")
        except UnicodeDecodeError:
            return None
        # isascii: "²".isdigit() is true and int("²") raises.
        if not sep or not rid or not (count.isascii() and count.isdigit()) \
                or not 0 < int(count) <= BOUNDS.max_notifications:
            return None
        out.append((rid, int(count)))
    return out or None


def notif_pieces(msg: bytes) -> int:
    """How many pieces :func:`parse_notif` walks in ``msg`` (at least 1, at
    most ``BOUNDS.max_loads_per_read`` + 1), reading only their lengths:
    what a malformed notification cost to find so, for the progress loop's
    budget (a hostile peer's 63 good pieces and a bad last one cost 64)."""
    n = at = 0
    while at < len(msg) and n <= BOUNDS.max_loads_per_read:
        at += 2 + int.from_bytes(msg[at:at + 2], "big")
        n += 1
    return max(n, 1)


@dataclass
class Lease:
    """Blocks of one request held until ``deadline`` (monotonic seconds).

    ``groups``: block ids per KV-cache group, int32 (4 bytes an id: a
    Python list took ~10 MiB per 1M ids, found by an attacker review).
    ``start``: when the first hold came (monotonic seconds), from which the
    life cap of renewals counts; ``length``: the lease the engine asked for
    (seconds), what one renewal grants from its own time."""

    request_id: str
    groups: list[np.ndarray]
    deadline: float
    notified: int = 0
    start: float = 0.0
    length: float = 0.0
    told: float = 0.0  # the deadline the engine last learned: its hold's, or one a LeaseRenewed named
    renewals_told: int = 0  # LeaseRenewed events sent for it

    @property
    def num_blocks(self) -> int:
        """Block ids held, all groups together."""
        return sum(map(len, self.groups))


#: Groups of at most this many block ids are compared in Python. numpy's
#: isin costs ~16 us on a hot loop here and ~150 us on a daemon's loop woken
#: for one load (a same-node claim, measured with benchmarks.trace); a list
#: or a set of 64 ints ~1 us. Larger groups stay in numpy (one pass in C).
SMALL_GROUP_IDS = 64


def groups_cover(groups, held: list[np.ndarray]) -> bool:
    """True when, for every KV-cache group ``g``, every block id of
    ``groups[g]`` is in ``held[g]``, and ``held`` has at least as many groups.

    ``groups``: block ids per group (lists of ints, a reader's request);
    ``held``: a lease's ids per group (int arrays). A reader may take a
    subset of a group (vLLM's decode side drops the blocks its prefix cache
    has); the common case is the whole group in order, checked first.
    """
    if len(groups) > len(held):
        return False
    for g, h in zip(groups, held):
        n = len(h)
        if n <= SMALL_GROUP_IDS and len(g) <= SMALL_GROUP_IDS:
            hl = h.tolist()
            if (isinstance(g, list) and hl == g) or set(hl).issuperset(g):
                continue
            return False
        if len(g) == n and np.array_equal(g, h):
            continue
        if not np.isin(np.asarray(g, dtype=np.int64), h).all():
            return False
    return True


def _compact(groups) -> list[np.ndarray]:
    return [np.asarray(g, dtype=np.int32) for g in groups]


@dataclass(eq=False)
class EarlyBudget:
    """The early notifications of every lease table of a daemon, counted
    together (``used``) against ``limit``
    (``BOUNDS.max_early_notifications``). When a table takes one more and
    the budget is spent, an entry goes: the taker's own oldest while it
    keeps at least a fair share (``limit`` / tables), else the oldest of the
    table that keeps the most. A flood aimed at one worker thus evicts its
    own entries, and other workers keep theirs down to a fair share each.
    A count of entries, each an id of at most ``BOUNDS.max_id_bytes``.
    Costs O(1) a notification, O(tables) for a table under its share while
    the budget is spent (measured by an attacker review: the fullest table
    looked up at every notification took 4.5 us with 64 tables, against
    0.6 with one)."""

    limit: int = BOUNDS.max_early_notifications
    used: int = 0
    tables: dict[int, LeaseTable] = field(default_factory=dict)  # id(table) -> table, while it is in use

    def make_room(self, taker: LeaseTable) -> None:
        """Evicts until one more entry of ``taker`` fits."""
        while self.used >= self.limit:
            if len(taker.early) * max(1, len(self.tables)) >= self.limit:
                victim = taker
            else:
                victim = max(self.tables.values(), key=lambda t: len(t.early), default=taker)
            if not victim.early:
                return
            victim.early.popitem(last=False)
            self.used -= 1


@dataclass
class LeaseTable:
    """The leases of one prefill worker.

    Args:
        early_s: how long a notification that beat its hold is kept (seconds).
        max_early: bound on such notifications, a count (the oldest is dropped).
        budget: the daemon's bound on them over all its tables
            (:class:`EarlyBudget`); None: this table's ``max_early`` only.

    ``held_blocks``: block ids of every live lease, all groups together
    (what ``Limits.max_held_blocks_per_worker`` bounds, ``kvd.core.holds``).
    ``on_change``: called ``(request_id, groups)`` when a lease starts and
    ``(request_id, None)`` when it ends, however it ends (its worker's hold
    feed, ``kvd.core.hold_feed``).
    """

    early_s: float = 120.0
    max_early: int = 65536
    leases: dict[str, Lease] = field(default_factory=dict)
    # rid -> (count, expected, deadline), oldest deadline first
    early: OrderedDict[str, tuple[int, int, float]] = field(default_factory=OrderedDict)
    held_blocks: int = 0
    on_change: Callable[[str, list[np.ndarray] | None], None] | None = None
    budget: EarlyBudget | None = None
    _heap: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.budget is not None:
            self.budget.tables[id(self)] = self

    def _early_spent(self, n: int) -> None:
        """``n`` early entries added (or, negative, removed): the budget's count."""
        if self.budget is not None:
            self.budget.used += n

    def __len__(self) -> int:
        return len(self.leases)

    def _push(self, deadline: float, request_id: str) -> None:
        """A heap entry for a lease's deadline; the heap is rebuilt from the
        live leases when stale entries (ended, or renewed past) dominate."""
        heapq.heappush(self._heap, (deadline, request_id))
        if len(self._heap) > 2 * len(self.leases) + 64:
            self._heap = [(lease.deadline, rid) for rid, lease in self.leases.items()]
            heapq.heapify(self._heap)

    def hold(self, request_id: str, groups: list[list[int]], deadline: float, now: float) -> str:
        """Starts or renews a lease.

        Returns ``"held"``, ``"renewed"``, ``"done"`` (every reader notified
        already) or ``"conflict"`` (a lease of other blocks exists).
        """
        old = self.leases.get(request_id)
        groups = _compact(groups)
        if old is not None:
            if len(old.groups) != len(groups) or not all(map(np.array_equal, old.groups, groups)):
                return "conflict"
            if deadline > old.deadline:
                old.deadline = deadline
                self._push(deadline, request_id)
            old.told = max(old.told, deadline)  # the engine's own hold says so
            return "renewed"
        lease = Lease(request_id, groups, deadline, start=now, length=deadline - now, told=deadline)
        early = self.early.pop(request_id, None)
        if early is not None:
            self._early_spent(-1)
            lease.notified = early[0]
            if lease.notified >= early[1]:
                return "done"
        self.leases[request_id] = lease
        self.held_blocks += lease.num_blocks
        self._push(deadline, request_id)
        if self.on_change is not None:
            self.on_change(request_id, lease.groups)
        return "held"

    def _end(self, request_id: str) -> Lease | None:
        """Removes a lease (None when there is none)."""
        lease = self.leases.pop(request_id, None)
        if lease is not None:
            self.held_blocks -= lease.num_blocks
            if self.on_change is not None:
                self.on_change(request_id, None)
        return lease

    def clear(self) -> None:
        """Drops every lease and early notification (the worker is
        unregistered), and leaves the daemon's budget."""
        if self.on_change is not None:
            for rid in self.leases:
                self.on_change(rid, None)
        self.leases.clear()
        self.held_blocks = 0
        self._early_spent(-len(self.early))
        self.early.clear()
        if self.budget is not None:
            self.budget.tables.pop(id(self), None)

    def notify(self, request_id: str, expected: int, now: float) -> bool:
        """One reader notified; True when that ends the lease."""
        lease = self.leases.get(request_id)
        if lease is None:
            # Re-inserted at the end: the dict stays in deadline order, oldest first.
            old = self.early.pop(request_id, None)
            count = 0 if old is None else old[0]
            if old is not None:
                self._early_spent(-1)
            if len(self.early) >= self.max_early:
                self.early.popitem(last=False)
                self._early_spent(-1)
            if self.budget is not None:
                self.budget.make_room(self)
            self.early[request_id] = (count + 1, expected, now + self.early_s)
            self._early_spent(1)
            return False
        lease.notified += 1
        if lease.notified >= expected:
            self._end(request_id)
            return True
        return False

    def covers(self, request_id: str, groups: list[list[int]]) -> bool:
        """True when a live lease of ``request_id`` holds every block of
        ``groups`` (per KV-cache group; a reader may take a subset: vLLM's
        decode side drops the blocks its local prefix cache already has)."""
        lease = self.leases.get(request_id)
        return lease is not None and groups_cover(groups, lease.groups)

    def renew(self, request_id: str, groups: list[list[int]], now: float, max_life_s: float) -> float | None:
        """A reader renews the lease of ``request_id`` on ``groups`` (a subset
        per group, as a claim names them: :meth:`covers`). Returns the seconds
        left after the renewal, or None when no live lease covers ``groups``
        or ``groups`` names no block (a renewal needs more than the request
        id: a claim of nothing reads nothing, a renewal of nothing would pin
        every block).

        The deadline becomes ``now + length`` (the lease the engine asked
        for), capped at ``start + max(max_life_s, length)``: a renewal never
        shortens a lease, and never extends it past the cap.
        """
        if not any(len(g) for g in groups) or not self.covers(request_id, groups):
            return None
        lease = self.leases[request_id]
        deadline = min(now + lease.length, lease.start + max(max_life_s, lease.length))
        if deadline > lease.deadline:
            lease.deadline = deadline
            self._push(deadline, request_id)
        return max(0.0, lease.deadline - now)

    def tell(self, request_id: str, step_s: float) -> bool:
        """True when ``request_id``'s engine should learn its new deadline
        (which then counts as learned): the first time a renewal moved it,
        and then each time it has moved at least ``step_s`` seconds past the
        one last learned. Renewals come a third of a lease apart from each
        reader, but anyone who may renew can send them as fast as it likes,
        and the engine needs to hear of a few only."""
        lease = self.leases.get(request_id)
        if lease is None or lease.deadline <= lease.told:
            return False
        if lease.renewals_told and lease.deadline - lease.told < step_s:
            return False
        lease.told = lease.deadline
        lease.renewals_told += 1
        return True

    def release(self, request_id: str) -> bool:
        """Ends a lease now; False when there is none."""
        return self._end(request_id) is not None

    def expire(self, now: float) -> list[str]:
        """Ends and returns every lease whose deadline has passed."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, rid = heapq.heappop(self._heap)
            lease = self.leases.get(rid)
            if lease is None or lease.deadline > now:
                continue  # ended already, or renewed (a later entry stands)
            self._end(rid)
            out.append(rid)
        early, gone = self.early, 0
        while early:
            rid = next(iter(early))  # the linked list's head: O(1), unlike a plain dict's
            if early[rid][2] > now:
                break
            del early[rid]
            gone += 1
        self._early_spent(-gone)
        return out
