"""Hold mirror: the reader side of following remote engines' holds.

A reader daemon READs another engine's blocks only with that engine's hold
on them (docs/SECURITY.md). Per load it can ask the source's daemon
(``PeerService.Claim``, a round trip, ``kvd.core.holds``); or it can know
already: once paired with a remote engine (a handshake), this daemon
*follows* that engine's holds at its daemon (``PeerService.Holds``, a long
poll answered as soon as a lease starts or ends there, or after
``WAIT_S``; ``kvd.core.hold_feed`` is the other side) and keeps a copy of
its live leases. A load whose blocks the copy shows held on every source
rank READs at once; any other load asks Claim as before (the hold may
still be on its way, or was made before this daemon followed; the copy
only ever grants, never denies).

How fresh the copy is: a source answers a poll the moment a lease ends, so
the copy lags the source by one answer's way across (the same window a
claim has between its answer and the READ it allows), and it is trusted
only while answers keep coming: more than ``FRESH_S`` after the last one
(a frozen or unreachable source, a cut link), every load asks Claim again.

Bounds against a hostile or broken source: ``MAX_LEASES`` leases and
``MAX_IDS`` block ids per followed engine, ``MAX_FOLLOWS`` engines
followed, every answer checked (ranks, id lengths, the order of changes);
past any of them the copy is dropped and the follow starts over after a
backoff (loads ask Claim meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from kvd.core.events import CoreError
from kvd.core.hold_feed import HoldsAnswer
from kvd.core.limits import BOUNDS
from kvd.core.runtime import Runtime
from kvd.core.state import PeerLink
from kvd.core.throttle import Throttled
from kvd.requests import BlockGroups

log = logging.getLogger("kvd.core")

#: Longest wait of one poll at the source (seconds; it caps it at
#: ``hold_feed.MAX_WAIT_S``).
WAIT_S = 1.0
#: The copy is trusted this long after the last answer (seconds): one poll's
#: wait plus room for a loaded machine's scheduling.
FRESH_S = WAIT_S + 0.5
#: Backoff after a failed poll or a dropped copy (seconds, doubling).
BACKOFF_S, MAX_BACKOFF_S = 0.5, 10.0
#: A follow no local worker is paired with, and no load used, ends after this (seconds).
IDLE_S = 60.0
#: Engines followed at once (each a pending poll and a copy of its leases).
MAX_FOLLOWS = 256
#: Per followed engine, all its ranks: leases and block ids in the copy
#: (the source's own caps are per worker, ``Limits.max_leases_per_worker``
#: and ``max_held_blocks_per_worker``; a copy past these is dropped).
MAX_LEASES = 1 << 17
MAX_IDS = 1 << 22
#: KV-cache groups per lease accepted from a source.
MAX_GROUPS = 64


class BadAnswer(Exception):
    """A source's poll answer that breaks the protocol or the bounds."""


@dataclass
class Follow:
    """The copy of one remote engine's live leases: ``held[(tp_rank,
    request_id)]`` = block ids per KV-cache group (int64 arrays), as of
    change ``seq`` of the source's feed ``epoch``; ``answered``: when the
    last answer came (monotonic seconds)."""

    address: str
    engine_id: str
    epoch: str = ""
    seq: int = 0
    held: dict[tuple[int, str], tuple[np.ndarray, ...]] = field(default_factory=dict)
    sent: dict[tuple[int, str], int] = field(default_factory=dict)  # notifications this daemon sent per lease
    ids: int = 0
    answered: float = -math.inf
    last_used: float = field(default_factory=time.monotonic)
    task: asyncio.Task | None = None

    def _clear(self) -> None:
        self.held.clear()
        self.sent.clear()
        self.ids = 0

    def forget(self) -> None:
        """Drops the copy; the next poll starts over (a reset from the source)."""
        self._clear()
        self.epoch, self.seq = "", 0
        self.answered = -math.inf

    def apply(self, ans: HoldsAnswer, now: float) -> None:
        """Applies one poll answer. Raises BadAnswer (the caller forgets the copy)."""
        if ans.reset or ans.epoch != self.epoch:
            if not ans.reset:
                raise BadAnswer(f"epoch {ans.epoch!r} without a reset (following {self.epoch!r})")
            self._clear()
            self.epoch, self.seq = ans.epoch, ans.seq
            self.answered = now
            return
        if ans.seq != self.seq + len(ans.changes):
            raise BadAnswer(f"answer ends at change {ans.seq} with {len(ans.changes)} changes after {self.seq}")
        for ch in ans.changes:
            if not 0 <= ch.tp_rank < BOUNDS.max_tp_size:
                raise BadAnswer(f"TP rank {ch.tp_rank}")
            if not ch.request_id or len(ch.request_id.encode()) > BOUNDS.max_id_bytes:
                raise BadAnswer("request id empty or too long")
            key = (ch.tp_rank, ch.request_id)
            self.sent.pop(key, None)
            old = self.held.pop(key, None)
            if old is not None:
                self.ids -= sum(len(g) for g in old)
            if ch.groups is None:
                continue
            if len(ch.groups) > MAX_GROUPS:
                raise BadAnswer(f"{len(ch.groups)} KV-cache groups")
            self.held[key] = ch.groups
            self.ids += sum(len(g) for g in ch.groups)
            if self.ids > MAX_IDS or len(self.held) > MAX_LEASES:
                raise BadAnswer(f"more than {MAX_LEASES} leases or {MAX_IDS} block ids held")
        self.seq = ans.seq
        self.answered = now

    def notified(self, tp_rank: int, request_id: str, expected: int) -> None:
        """This daemon sent the lease of ``request_id`` on ``tp_rank`` one of
        the ``expected`` notifications that end it (a READ's or a bare one):
        once it sent them all, the lease is gone from the copy at once, not
        an answer later (a second load naming the same blocks asks Claim)."""
        key = (tp_rank, request_id)
        if key not in self.held:
            return
        n = self.sent.get(key, 0) + 1
        if n >= expected:
            self.sent.pop(key, None)
            self.ids -= sum(len(g) for g in self.held.pop(key))
        else:
            self.sent[key] = n

    def covers(self, tp_rank: int, request_id: str, groups: BlockGroups, now: float) -> bool:
        """True when the copy is fresh and shows a lease of ``request_id`` on
        ``tp_rank`` holding every block of ``groups`` (a subset per group:
        ``LeaseTable.covers``, the source's own rule for a claim)."""
        if now - self.answered > FRESH_S:
            return False
        held = self.held.get((tp_rank, request_id))
        if held is None or len(groups) > len(held):
            return False
        for g, h in zip(groups, held):
            if len(g) == len(h) and np.array_equal(g, h):
                continue  # the whole group: a reader that takes every block (the common case)
            if not np.isin(np.asarray(g, dtype=np.int64), h).all():
                return False
        return True


class HoldMirror:
    """The followed holds of remote engines, by ``(address, engine_id)``.

    Args:
        rt: the core's shared state (``limits.follow_holds``: off, nothing is followed).
        link: reaches remote daemons (``PeerLink.holds``; None: nothing is followed).
    """

    def __init__(self, rt: Runtime, link: PeerLink | None):
        self.rt = rt
        self.link = link
        self.follows: dict[tuple[str, str], Follow] = {}
        self._warned = Throttled(log)

    def follow(self, address: str, engine_id: str) -> None:
        """Follows remote engine ``engine_id`` at ``address`` (once; a handshake
        with one of its ranks calls this). Does nothing when following is off,
        or ``MAX_FOLLOWS`` engines are followed already."""
        if self.link is None or not self.rt.limits.follow_holds or self.rt.closing:
            return
        key = (address, engine_id)
        f = self.follows.get(key)
        if f is not None:
            f.last_used = time.monotonic()
            return
        if len(self.follows) >= MAX_FOLLOWS:
            self._warned.warning("not following the holds of %s engine=%s: %d engines followed already; its "
                                 "loads claim each hold", address, engine_id, MAX_FOLLOWS)
            return
        f = self.follows[key] = Follow(address, engine_id)
        f.task = asyncio.get_running_loop().create_task(self._run(f))

    def covers(self, address: str, engine_id: str, tp_rank: int, request_id: str, groups: BlockGroups) -> bool:
        """True when the followed holds of ``engine_id`` at ``address`` show
        ``groups`` held for ``request_id`` on ``tp_rank`` (:meth:`Follow.covers`)."""
        f = self.follows.get((address, engine_id))
        if f is None:
            return False
        now = time.monotonic()
        if not f.covers(tp_rank, request_id, groups, now):
            return False
        f.last_used = now
        return True

    def notified(self, address: str, engine_id: str, tp_rank: int, request_id: str, expected: int) -> None:
        """See :meth:`Follow.notified` (nothing when ``engine_id`` at ``address`` is not followed)."""
        f = self.follows.get((address, engine_id))
        if f is not None:
            f.notified(tp_rank, request_id, expected)

    def fresh(self) -> int:
        """Followed engines whose copy is trusted now (``holds_followed`` in stats)."""
        now = time.monotonic()
        return sum(now - f.answered <= FRESH_S for f in self.follows.values())

    def _paired(self, address: str, engine_id: str) -> bool:
        return any(r.address == address and r.engine_id == engine_id
                   for w in self.rt.workers.values() for r in w.pairs.remotes.values())

    async def _run(self, f: Follow) -> None:
        """Polls ``f``'s source until the follow ends (idle, closing), keeping
        its copy; a failed poll or a bad answer drops the copy and waits a
        doubling backoff."""
        key = (f.address, f.engine_id)
        backoff = BACKOFF_S
        checked = time.monotonic()
        try:
            while not self.rt.closing and self.follows.get(key) is f:
                now = time.monotonic()
                if now - checked > 5.0:  # at most every few seconds: a walk over every pair
                    checked = now
                    if now - f.last_used > IDLE_S and not self._paired(*key):
                        log.info("stopped following the holds of %s engine=%s (no pair with it for %.0f s)",
                                 f.address, f.engine_id, IDLE_S)
                        return
                    if self._paired(*key):
                        f.last_used = now
                try:
                    ans = await self.link.holds(f.address, f.engine_id, f.epoch, f.seq, WAIT_S, WAIT_S + 5.0)
                    f.apply(ans, time.monotonic())
                except (CoreError, BadAnswer) as e:
                    f.forget()
                    msg = "holds of %s engine=%s: %s; loads claim each hold, following again in %.1f s"
                    if isinstance(e, BadAnswer):  # a broken or hostile source: said, at most once a second
                        self._warned.warning(msg, f.address, f.engine_id, e, backoff)
                    else:  # unreachable, restarted, the engine gone: the handshakes say so
                        log.debug(msg, f.address, f.engine_id, e, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(MAX_BACKOFF_S, 2 * backoff)
                    continue
                backoff = BACKOFF_S
        except asyncio.CancelledError:
            raise
        except Exception:  # never let a follow die silently: its loads claim each hold
            log.exception("following the holds of %s engine=%s failed", f.address, f.engine_id)
        finally:
            f.forget()
            if self.follows.get(key) is f:
                del self.follows[key]

    async def close(self) -> None:
        """Stops every follow (at shutdown)."""
        tasks = [f.task for f in self.follows.values() if f.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.follows.clear()
