"""Hold feeds: the source side of a reader daemon's copy of the holds.

A READ of another engine's blocks waits for that engine's consent, its
*hold* (docs/SECURITY.md). Asking for it per load (``PeerService.Claim``)
costs a round trip between the daemons on every load: measured 1.5-3 ms of
a 16 x 64 KiB load of ~4-5 ms on this machine, with the hold placed before
the load, and the largest share of the reader's CPU per one-block load
(docs/PERFORMANCE.md, "Per-load cost"). Instead, a reader daemon *follows*
the holds of each remote engine it has paired with (``PeerService.Holds``,
a long poll, ``kvd.core.hold_mirror``): this daemon lists, in order, every
lease of that engine's workers that starts or ends, and the reader READs
without a claim the blocks its copy shows held. A lease ends here (the
readers notified, the engine released it, it expired, the worker
unregistered) as before; the change reaches a follower one answer later.

One :class:`HoldFeed` per engine id with a worker here. Its changes are
numbered from 1 within an *epoch* (random, new whenever the feed is made
again: a restart, or the engine's last worker gone and registered again);
a follower that names another epoch, or a change older than those kept,
starts over from the current one. Its reset lists every lease live then
(a *snapshot*, when it fits in one answer): without it, a lease made before
the reset never reached the copy, and a follower could not tell such a
lease from one whose start was still on its way, so for a second after
each (re)start its loads claimed every hold the copy did not show yet
(measured: 1-3 of 20 `kvd bench` throughput rounds, 64 claims each,
~100 ms against ~15 ms; docs/PERFORMANCE.md, "Per-load cost, eighth round").

Costs on the hold path: one tuple appended per lease started or ended (the
lease's own id arrays, not copies) and one wake-up of the followers'
pending polls.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvd.core.events import NotFound, ResourceExhausted

#: Changes kept per feed; a follower further behind starts over.
CHANGES_KEPT = 8192
#: Block ids the kept changes may name in all (4 bytes each: 16 MiB); the
#: oldest are dropped first. A started lease's ids are its lease's own
#: arrays, so this bounds only what ended leases leave behind.
MAX_KEPT_IDS = 1 << 22
#: Block ids in one answer (a uint32 varint is at most 5 bytes: ~5 MiB, under
#: the peer channel's 64 MiB message cap); the rest comes in the next one.
MAX_IDS_PER_ANSWER = 1 << 20
#: Changes in one answer.
MAX_CHANGES_PER_ANSWER = 4096
#: KV-cache groups in one answer, all changes together (each is a message
#: of its own on the wire and an array at the reader), and the bytes one
#: answer may take on the wire, estimated (:meth:`HoldChange.sizes`).
#: A change past either still goes alone (one lease: at most
#: ``max_blocks_per_request`` ids, 4 bytes each below 2^28). The reader
#: refuses more groups than this, and answers over ``MAX_ANSWER_WIRE_BYTES``
#: (``kvd.daemon.peer_client``): before, it parsed and converted any answer
#: up to the 64 MiB message cap, and a hostile source's 17.6 MiB answer of
#: 131,072 leases x 64 empty groups held its event loop 35 s and kept
#: 1.7 GB (attacker review, tests/test_security_attack6.py).
MAX_GROUPS_PER_ANSWER = 16384
MAX_ANSWER_BYTES = 4 << 20
#: Largest answer a reader receives (bytes): a budget-full answer, or one
#: lease of 1M block ids (``Limits.max_blocks_per_request``'s default) alone.
MAX_ANSWER_WIRE_BYTES = 8 << 20
#: Longest wait of one poll (seconds): a follower trusts its copy only while
#: answers keep coming (``kvd.core.hold_mirror.FRESH_S``).
MAX_WAIT_S = 2.0
#: Polls waiting on one feed at once (each is a pending gRPC call here).
MAX_WAITING = 256


class HoldChange:
    """One lease of ``request_id`` on TP rank ``tp_rank`` started (``groups``:
    its block ids per KV-cache group, int arrays) or ended (``groups`` None);
    ``seq``: its number in its feed. Not to be changed once made.

    A plain class with slots, not a frozen dataclass: a reader makes one
    per lease start or end it follows, and the dataclass's ``__init__`` and
    ``__post_init__`` took 2.2 us of the 6.2 a change cost to convert
    (measured here; 0.2-0.3 now).

    Its sizes (:meth:`sizes`) are counted once, when first read (a source
    reads them at once, a reader never): every
    answer's bounds check reads them (:func:`_within_answer`), and summing
    the groups there again took ~6 % of the source daemon's samples with 64
    one-block loads in flight (py-spy; docs/PERFORMANCE.md, "Per-load
    cost, ninth round")."""

    __slots__ = ("seq", "tp_rank", "request_id", "groups", "_sizes")

    def __init__(self, seq: int, tp_rank: int, request_id: str, groups: tuple[np.ndarray, ...] | None):
        self.seq = seq
        self.tp_rank = tp_rank
        self.request_id = request_id
        self.groups = groups
        self._sizes: tuple[int, int, int] | None = None

    def __repr__(self) -> str:
        return f"HoldChange(seq={self.seq}, tp_rank={self.tp_rank}, request_id={self.request_id!r}, " \
               f"groups={self.groups!r})"

    def sizes(self) -> tuple[int, int, int]:
        """``(ids, groups, wire bytes)``, counted once: block ids and KV-cache
        groups, all groups together (0 and 0 for an end), and an upper bound
        of the change's size in an answer (bytes: a block id is a varint of
        at most 5 bytes, a group's header at most 6)."""
        if self._sizes is None:
            groups = self.groups
            ids = 0 if groups is None else sum(map(len, groups))
            ngroups = 0 if groups is None else len(groups)
            self._sizes = (ids, ngroups, 32 + len(self.request_id.encode()) + 6 * ngroups + 5 * ids)
        return self._sizes


@dataclass(frozen=True)
class HoldsAnswer:
    """What a poll gets: the feed's ``epoch``, the ``seq`` of the last change
    in ``changes`` (or the feed's last one), whether the follower must start
    over (``reset``), and the changes in order. A reset with ``snapshot``
    lists instead every lease live at ``seq`` (starts, in no order): the
    follower's copy is then whole from the reset on; without it, the copy
    lacks the leases made before ``seq``."""

    epoch: str
    seq: int
    reset: bool
    changes: tuple[HoldChange, ...]
    snapshot: bool = False


def _within_answer(changes, whole: bool) -> list[HoldChange] | None:
    """The first of ``changes`` that fit in one answer (at least one); with
    ``whole``, all of them, or None when they do not all fit."""
    out: list[HoldChange] = []
    ids = groups = size = 0
    for ch in changes:
        n, g, b = ch.sizes()
        if out and (len(out) >= MAX_CHANGES_PER_ANSWER or ids + n > MAX_IDS_PER_ANSWER
                    or groups + g > MAX_GROUPS_PER_ANSWER or size + b > MAX_ANSWER_BYTES):
            if whole:
                return None
            break
        out.append(ch)
        ids += n
        groups += g
        size += b
    return out


class HoldFeed:
    """The changes of one engine's leases, all its TP ranks together (event loop only)."""

    def __init__(self, engine_id: str):
        self.engine_id = engine_id
        self.epoch = secrets.token_hex(8)
        self.seq = 0
        self.changes: deque[HoldChange] = deque()
        self.kept_ids = 0
        self.waiting = 0
        self.closed = False
        # The live leases, by (tp_rank, request_id): a reset's snapshot. The
        # entries are the changes' own objects (no copy of their ids).
        self.live: dict[tuple[int, str], HoldChange] = {}
        self._changed = asyncio.Event()

    def record(self, tp_rank: int, request_id: str, groups: list[np.ndarray] | None) -> None:
        """A lease of ``request_id`` on ``tp_rank`` started (its ``groups``) or
        ended (None); wakes every waiting poll."""
        self.seq += 1
        ch = HoldChange(self.seq, tp_rank, request_id, None if groups is None else tuple(groups))
        self.changes.append(ch)
        self.kept_ids += ch.sizes()[0]
        if groups is None:
            self.live.pop((tp_rank, request_id), None)
        else:
            self.live[(tp_rank, request_id)] = ch
        while len(self.changes) > CHANGES_KEPT or self.kept_ids > MAX_KEPT_IDS:
            self.kept_ids -= self.changes.popleft().sizes()[0]
        self._wake()

    def close(self) -> None:
        """The engine's last worker is gone: waiting polls answer now (reset)."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        # Set, not replaced: a poll that waits makes a fresh event when it
        # finds this one set (wait_answer); one per change cost ~1 us a hold.
        self._changed.set()

    @property
    def first_seq(self) -> int:
        """The oldest change kept (``seq + 1`` when none is)."""
        return self.seq - len(self.changes) + 1

    def answer(self, epoch: str, after: int) -> HoldsAnswer | None:
        """The changes after ``after`` of ``epoch``; a reset when the follower
        cannot continue from there; None when there is nothing new yet."""
        if self.closed or epoch != self.epoch or after > self.seq or after < self.first_seq - 1:
            return self._reset()
        if after == self.seq:
            return None
        # The changes after ``after``, walked from the nearer end of the
        # deque: from the front, a follower near the newest change made every
        # poll step over all the older ones kept (up to CHANGES_KEPT), ~290 us
        # an answer with 64 loads in flight (cProfile; docs/PERFORMANCE.md,
        # "Per-load cost, ninth round").
        n = self.seq - after
        start = len(self.changes) - n
        if n <= start:
            new = list(itertools.islice(reversed(self.changes), n))
            new.reverse()
        else:
            new = itertools.islice(self.changes, start, start + MAX_CHANGES_PER_ANSWER)
        out = _within_answer(new, whole=False)
        return HoldsAnswer(self.epoch, out[-1].seq, False, tuple(out))

    def _reset(self) -> HoldsAnswer:
        """A reset at the current change, with the snapshot of the live
        leases when it fits in one answer (the bounds of any answer:
        ``MAX_CHANGES_PER_ANSWER`` and the others); without one past them
        (the follower's loads claim the leases made before it, as they did
        before snapshots) or once the engine is gone."""
        if not self.closed:
            out = _within_answer(self.live.values(), whole=True)
            if out is not None:
                return HoldsAnswer(self.epoch, self.seq, True, tuple(out), snapshot=True)
        return HoldsAnswer(self.epoch, self.seq, True, ())

    async def wait_answer(self, epoch: str, after: int, wait_s: float) -> HoldsAnswer:
        """:meth:`answer`, waiting up to ``wait_s`` seconds (capped at
        ``MAX_WAIT_S``; NaN or negative: no wait) for a change; an empty
        answer at the end of the wait.

        Raises:
            ResourceExhausted: ``MAX_WAITING`` polls wait on this feed already.
        """
        got = self.answer(epoch, after)
        if got is not None:
            return got
        wait_s = min(wait_s, MAX_WAIT_S) if wait_s > 0 else 0.0
        if wait_s > 0:
            if self.waiting >= MAX_WAITING:
                raise ResourceExhausted(f"holds: {MAX_WAITING} polls wait on engine {self.engine_id!r} already")
            self.waiting += 1
            if self._changed.is_set():  # set before answer() above, which saw it: stale
                self._changed = asyncio.Event()
            try:
                async with asyncio.timeout(wait_s):
                    await self._changed.wait()
            except TimeoutError:
                pass
            finally:
                self.waiting -= 1
        return self.answer(epoch, after) or HoldsAnswer(self.epoch, self.seq, False, ())


class HoldFeeds:
    """Every engine's feed on this daemon (``Runtime.feeds``).

    The registry names a recorder per worker (:meth:`recorder`, handed to
    its ``LeaseTable``) and drops an engine's feed with its last worker
    (:meth:`drop`); PeerService.Holds reads them (:meth:`poll`).
    """

    def __init__(self) -> None:
        self.feeds: dict[str, HoldFeed] = {}
        # Answers made for followers' polls since start, every engine
        # together (``holds_answers_sent`` in stats): one increment per
        # answer, nothing per lease.
        self.answers_sent = 0

    def recorder(self, engine_id: str, tp_rank: int):
        """The ``LeaseTable.on_change`` of worker ``(engine_id, tp_rank)``."""

        def record(request_id: str, groups: list[np.ndarray] | None) -> None:
            self._feed(engine_id).record(tp_rank, request_id, groups)

        return record

    def _feed(self, engine_id: str) -> HoldFeed:
        """``engine_id``'s feed, made now if it has none yet (an engine
        registered here with no lease yet)."""
        feed = self.feeds.get(engine_id)
        if feed is None:
            feed = self.feeds[engine_id] = HoldFeed(engine_id)
        return feed

    def epoch(self, engine_id: str) -> str:
        """The epoch of ``engine_id``'s feed (call only for an engine registered here)."""
        return self._feed(engine_id).epoch

    def drop(self, engine_id: str) -> None:
        """The engine has no worker here any more: its feed ends (a follower
        starts over, in a new epoch, if the engine registers again)."""
        feed = self.feeds.pop(engine_id, None)
        if feed is not None:
            feed.close()

    async def poll(self, engine_id: str, registered: bool, epoch: str, after: int, wait_s: float) -> HoldsAnswer:
        """A follower's poll of ``engine_id`` (``registered``: the engine has
        a worker here), counted in :attr:`answers_sent` once answered (a
        refused or cancelled poll is not). Raises NotFound for an engine
        with none, ResourceExhausted as :meth:`HoldFeed.wait_answer`."""
        if not registered:
            raise NotFound(f"holds: engine {engine_id!r} is not registered here")
        ans = await self._feed(engine_id).wait_answer(epoch, after, wait_s)
        self.answers_sent += 1
        return ans
