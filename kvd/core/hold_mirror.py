"""Hold mirror: the reader side of following remote engines' holds.

A reader daemon READs another engine's blocks only with that engine's hold
on them (docs/SECURITY.md). Per load it can ask the source's daemon
(``PeerService.Claim``, a round trip, ``kvd.core.holds``); or it can know
already: once paired with a remote engine (a handshake), this daemon
*follows* that engine's holds at its daemon (``PeerService.Holds``, a long
poll answered as soon as a lease starts or ends there, or after
``WAIT_S``; ``kvd.core.hold_feed`` is the other side) and keeps a copy of
its live leases. A load whose blocks the copy shows held on every source
rank READs at once; any other load first waits briefly for the next
answers (the hold may still be on its way: ``HoldMirror.wait_shown``),
then asks Claim as before (the hold is not there, or not yet; the copy
only ever grants, never denies). The copy starts from the source's
snapshot of its live leases (``kvd.core.hold_feed``), so it lacks none
made before this daemon followed, unless they are more than one answer
holds.

How fresh the copy is: a source answers a poll the moment a lease ends, so
the copy lags the source by one answer's way across (the same window a
claim has between its answer and the READ it allows), and it is trusted
only while answers keep coming: more than ``FRESH_S`` after the last one
(a frozen or unreachable source, a cut link), every load asks Claim again.

Whose holds: the polls have a connection of their own, and an address may
reach several daemons (a load balancer, a DNS name of several records),
each perhaps with an engine of the same id. So after each reset the follow
asks, on the polls' channel, the NIXL agent of every rank it is paired
with (``PeerClient.holds_agent``, with the epoch of the engine's feed at
the daemon that answers), and the copy grants a rank only when this
daemon's pairs with it are with that very agent and the agent came with
the copy's own epoch: the daemon whose holds the copy shows is the one
its READs go to.

Bounds against a hostile or broken source: ``MAX_LEASES`` leases and
``MAX_IDS`` block ids per followed engine, ``MAX_BYTES`` of memory per
followed engine and ``MAX_TOTAL_BYTES`` for all of them, ``MAX_FOLLOWS``
engines followed, every answer checked (its size and groups before it is
converted, ``kvd.daemon.peer_client``; ranks, id lengths, the order of
changes here); past any of them the copy is dropped and the follow starts
over after a backoff (loads ask Claim meanwhile). A source is polled at
most every ``MIN_POLL_S``; one that answers at once with nothing new (an
honest one waits ``WAIT_S`` for a change), resets again within ``WAIT_S``,
or whose answers bring more than ``UNITS_PER_S`` a second, is polled again
only later, its copy not trusted meanwhile (no poll waits at the source for
a lease's end).
"""

from __future__ import annotations

import asyncio
import logging
import math
import operator
import time
from dataclasses import dataclass, field

import numpy as np

from kvd.core.events import CoreError
from kvd.core.hold_feed import HoldChange, HoldsAnswer
from kvd.core.leases import groups_cover
from kvd.core.limits import BOUNDS
from kvd.core.runtime import Runtime
from kvd.core.state import PEER_CALLER, PeerLink
from kvd.core.throttle import Throttled
from kvd.logtext import clip
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
#: How often a follow checks that it is still paired with, and asks the
#: agents of ranks paired with since or with another agent (seconds: each
#: check walks every pair, each agent asked is a Handshake).
CHECK_S = 5.0
#: A load whose hold the copy does not show yet waits for at most this many
#: answers, and this long (seconds), before it claims (``HoldMirror.wait_shown``).
#: Measured with 64 one-block loads in flight, holds placed 5 ms ahead, on a
#: 2-core machine: the holds' answer reached the reader's loop 3-15 ms after
#: the source sent it, behind the batch's loads (the loop read those first),
#: so 68-72 % of the loads claimed (docs/PERFORMANCE.md, "Per-load cost,
#: seventh round"). Two answers: the first may have left the source before
#: the hold came there; the second was asked after it. Loads within
#: ``SHOWN_WAIT_GRACE_S`` of a (re)start of the copy that brought no
#: snapshot of the source's live leases (an older source, or more leases
#: than one answer holds) do not wait: their hold may predate the copy,
#: which then never shows it.
SHOWN_WAIT_ANSWERS = 2
SHOWN_WAIT_S = 0.05
SHOWN_WAIT_GRACE_S = 1.0
#: Engines followed at once (each a pending poll and a copy of its leases).
MAX_FOLLOWS = 256
#: Per followed engine, all its ranks: leases and block ids in the copy
#: (the source's own caps are per worker, ``Limits.max_leases_per_worker``
#: and ``max_held_blocks_per_worker``; a copy past these is dropped).
MAX_LEASES = 1 << 17
MAX_IDS = 1 << 22
#: KV-cache groups per lease accepted from a source.
MAX_GROUPS = 64
#: Characters of a source's feed epoch (``kvd.core.hold_feed`` makes 16 hex
#: digits): a hostile source's 7 MiB epochs were kept, sent back with every
#: poll and quoted whole in a warning, 117 MB of log in 40 s (attacker review).
MAX_EPOCH_CHARS = 64
#: Memory of the copies (bytes, estimated per lease: ``LEASE_BYTES`` plus its
#: request id, plus ``GROUP_BYTES`` and the ids' own bytes per group;
#: measured with tracemalloc, 331 bytes for a lease of one empty group and a
#: 36-byte id, +121 per group, +8 per id). Counts alone did not bound it: a
#: hostile source's 131,072 leases of 64 empty groups each (ids: 0) kept
#: 1.7 GB per followed engine, 256 engines followed.
LEASE_BYTES, GROUP_BYTES = 192, 128
MAX_BYTES = 64 << 20       # one followed engine
MAX_TOTAL_BYTES = 256 << 20  # every followed engine together
#: Leases of one followed engine this daemon remembers having sent every
#: notification of until the source's end of them comes (see
#: :meth:`Follow.notified`).
MAX_SENT = 4096
#: Polls of one source at most every ``MIN_POLL_S`` seconds; what the
#: answers bring (a unit per change and per KV-cache group, one per
#: ``IDS_PER_UNIT`` block ids) at most ``UNITS_PER_S`` a second after a burst
#: of ``BURST_UNITS``; past that the next poll waits. Measured: a hostile
#: source answering at once kept a reader polling 1,200 times a second
#: (42 % of a core); converting a full answer (4,096 changes) takes
#: ~40-50 ms, ~10 us a change. An honest source at the throughput goal
#: (10,000 one-block loads/s: a start and an end each, 2 units a change)
#: brings ~40,000 units a second; at 16,384 the pace had capped what a copy
#: could serve near the ~4,000 loads/s measured (docs/PERFORMANCE.md,
#: "Per-load cost, fifth round"). A hostile source can keep a reader busy
#: converting for up to ~0.3 of a core.
MIN_POLL_S = 0.002
UNITS_PER_S = 1 << 16
BURST_UNITS = 1 << 15
IDS_PER_UNIT = 256


class BadAnswer(Exception):
    """A source's poll answer that breaks the protocol or the bounds."""


@dataclass
class Budget:
    """Bytes the copies of every followed engine use (``HoldMirror``'s one,
    shared by its follows), at most ``limit``."""

    used: int = 0
    limit: int = MAX_TOTAL_BYTES


_NBYTES = operator.attrgetter("nbytes")


def lease_bytes(request_id: str, groups=()) -> int:
    """The estimated memory of one lease in a copy (see ``LEASE_BYTES``;
    ``groups``: its block id arrays); with no ``groups``, of one record in
    ``Follow.sent``."""
    return LEASE_BYTES + len(request_id) + GROUP_BYTES * len(groups) + sum(map(_NBYTES, groups))


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
    # Notifications this daemon sent per lease: (sent, expected), oldest
    # first, kept until the source's end of the lease comes (at most
    # MAX_SENT, counted in bytes and budget).
    sent: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)
    ids: int = 0
    answered: float = -math.inf
    last_used: float = field(default_factory=time.monotonic)
    task: asyncio.Task | None = None
    bytes: int = 0  # the copy's memory (lease_bytes), counted in budget too
    budget: Budget = field(default_factory=Budget)
    # The agent of each TP rank at the daemon that answers the polls (since
    # the last reset): the copy grants a rank only through pairs with it.
    agents: dict[int, str] = field(default_factory=dict)
    # When the copy last started over without the source's live leases (a
    # reset with no snapshot; monotonic seconds): those never show in it.
    blind_at: float = -math.inf
    # wait_shown's waiters: each resolved at the next answer applied, or when
    # the copy is dropped or stops being trusted (one future per waiter:
    # removing a callback from a shared one costs a scan of all of them).
    waiters: set[asyncio.Future] = field(default_factory=set)

    def woken(self) -> None:
        """Wakes every :meth:`HoldMirror.wait_shown` waiter of this copy."""
        for fut in self.waiters:
            if not fut.done():
                try:
                    fut.set_result(None)
                except RuntimeError:  # its loop is closed: nobody waits on it any more
                    pass
        self.waiters.clear()

    def _clear(self, keep_sent: bool = False) -> None:
        self.held.clear()
        self.agents.clear()
        self.ids = 0
        if keep_sent:  # its bytes stay counted
            sent = sum(lease_bytes(k[1]) for k in self.sent)
            self.budget.used -= self.bytes - sent
            self.bytes = sent
            return
        self.sent.clear()
        self.budget.used -= self.bytes
        self.bytes = 0

    def take_agents(self, learnt: dict[int, tuple[str, str]]) -> None:
        """Keeps the agents of ``learnt`` (rank -> (agent name, feed epoch),
        ``HoldMirror._learn_agents``) answered with the copy's own epoch:
        the daemon that named them is the one whose holds the copy shows
        (epochs are random). Behind an address that reaches two daemons, a
        reset and its snapshot from one and the agents from the other (a
        connection broken between the two calls) would otherwise have
        granted the first one's holds through pairs with the second."""
        self.agents.update({p: name for p, (name, epoch) in learnt.items() if epoch and epoch == self.epoch})

    def _charge(self, n: int) -> None:
        self.bytes += n
        self.budget.used += n

    def _drop(self, key: tuple[int, str]) -> None:
        old = self.held.pop(key, None)
        if old is not None:
            self.ids -= sum(map(len, old))
            self._charge(-lease_bytes(key[1], old))

    def _unsend(self, key: tuple[int, str]) -> None:
        if self.sent.pop(key, None) is not None:
            self._charge(-lease_bytes(key[1]))

    def forget(self, keep_sent: bool = False) -> None:
        """Drops the copy; the next poll starts over (a reset from the source).
        ``keep_sent``: this daemon's own notifications stay (a follow that
        goes on: a snapshot may still list a lease they ended)."""
        self._clear(keep_sent)
        self.epoch, self.seq = "", 0
        self.answered = -math.inf
        self.woken()

    def apply(self, ans: HoldsAnswer, now: float) -> None:
        """Applies one poll answer. Raises BadAnswer (the caller forgets the copy).

        A reset empties the copy; its snapshot (``HoldsAnswer.snapshot``),
        if any, fills it again. This daemon's own notifications are kept
        across a reset: a lease they ended may still be live in the
        snapshot (their end not yet at the source), and must not show."""
        if ans.reset or ans.epoch != self.epoch:
            if not ans.reset:
                raise BadAnswer(f"epoch {clip(ans.epoch, 32)!r} without a reset (following "
                                f"{clip(self.epoch, 32)!r})")
            self._clear(keep_sent=True)
            self.epoch, self.seq = ans.epoch, ans.seq
            if ans.snapshot:
                for ch in ans.changes:
                    if ch.groups is None:
                        raise BadAnswer("a lease's end in a snapshot")
                    self._take(ch)
            self.blind_at = -math.inf if ans.snapshot else now
            self.answered = now
            self.woken()
            return
        if ans.seq != self.seq + len(ans.changes):
            raise BadAnswer(f"answer ends at change {ans.seq} with {len(ans.changes)} changes after {self.seq}")
        for ch in ans.changes:
            self._take(ch)
        self.seq = ans.seq
        self.answered = now
        self.woken()

    def _take(self, ch: HoldChange) -> None:
        """One lease started (into the copy, unless this daemon's own
        notifications ended it) or ended. Raises BadAnswer past a bound."""
        if not 0 <= ch.tp_rank < BOUNDS.max_tp_size:
            raise BadAnswer(f"TP rank {ch.tp_rank}")
        if not ch.request_id or len(ch.request_id.encode()) > BOUNDS.max_id_bytes:
            raise BadAnswer("request id empty or too long")
        key = (ch.tp_rank, ch.request_id)
        self._drop(key)
        if ch.groups is None:
            self._unsend(key)
            return
        if len(ch.groups) > MAX_GROUPS:
            raise BadAnswer(f"{len(ch.groups)} KV-cache groups")
        done = self.sent.get(key)
        if done is not None and done[0] >= done[1]:
            return  # this daemon has sent every notification that ends it: not held for its loads
        self.held[key] = ch.groups
        self.ids += sum(map(len, ch.groups))
        self._charge(lease_bytes(ch.request_id, ch.groups))
        if self.ids > MAX_IDS or len(self.held) > MAX_LEASES or self.bytes > MAX_BYTES:
            raise BadAnswer(f"more than {MAX_LEASES} leases, {MAX_IDS} block ids or {MAX_BYTES >> 20} MiB "
                            f"held")
        if self.budget.used > self.budget.limit:
            raise BadAnswer(f"the copies of every followed engine would pass {self.budget.limit >> 20} MiB")

    def notified(self, tp_rank: int, request_id: str, expected: int) -> None:
        """This daemon sent the lease of ``request_id`` on ``tp_rank`` one of
        the ``expected`` notifications that end it (a READ's or a bare one):
        once it sent them all, the lease is gone from the copy at once, not
        an answer later (a second load naming the same blocks asks Claim),
        and stays gone if its start reaches the copy only after that (its
        load claimed: the claim's answer came before the poll's), until the
        source's end of it comes. Before, the count began only once the
        lease was in the copy: a start that came late put back a lease
        this daemon had ended, until its end came one answer later."""
        key = (tp_rank, request_id)
        old = self.sent.pop(key, None)
        if old is None:
            self._charge(lease_bytes(request_id))
        n = (0 if old is None else old[0]) + 1
        self.sent[key] = (n, expected)  # (re)inserted last: the oldest go first
        while len(self.sent) > MAX_SENT:
            self._unsend(next(iter(self.sent)))
        if n >= expected:
            self._drop(key)

    def covers(self, tp_rank: int, request_id: str, groups: BlockGroups, now: float) -> bool:
        """True when the copy is fresh and shows a lease of ``request_id`` on
        ``tp_rank`` holding every block of ``groups`` (a subset per group:
        ``LeaseTable.covers``, the source's own rule for a claim)."""
        if now - self.answered > FRESH_S:
            return False
        held = self.held.get((tp_rank, request_id))
        # Short groups compare in Python: numpy's conversions were ~5 % of
        # a reader's loop at 64 one-block loads in flight (py-spy).
        return held is not None and groups_cover(groups, held)


@dataclass
class Pace:
    """When a follow polls its source again (:meth:`after`)."""

    units: float = BURST_UNITS  # what the next answers may bring at once
    at: float = 0.0             # when ``units`` was counted (monotonic seconds)
    reset_at: float = -math.inf  # when the last reset came

    def after(self, ans: HoldsAnswer, took_s: float, now: float) -> float:
        """Seconds to wait before the next poll, the answer ``ans`` having
        come at ``now``, ``took_s`` seconds after its poll went out.

        An honest source answers at once only with something new (changes,
        or a reset to start over from, at a follow's start or when the
        source restarted); with nothing, it waits ``WAIT_S``
        (``kvd.core.hold_feed``). One that answers at once with nothing, or
        resets again within ``WAIT_S`` (each reset costs a handshake per
        rank paired, ``HoldMirror._learn_agents``), is polled again only
        after ``WAIT_S``. Otherwise at least ``MIN_POLL_S`` after the last
        poll went out, and later when the answers bring more than
        ``UNITS_PER_S`` (after a burst of ``BURST_UNITS``).
        """
        if ans.reset:
            again, self.reset_at = now - self.reset_at < WAIT_S, now
            if again:
                return WAIT_S
        elif took_s < WAIT_S / 2 and not ans.changes:
            return WAIT_S
        self.units = min(BURST_UNITS, self.units + (now - self.at) * UNITS_PER_S)
        self.at = now
        self.units -= sum(1 + (0 if c.groups is None else len(c.groups) + sum(len(g) for g in c.groups)
                                // IDS_PER_UNIT) for c in ans.changes)
        return max(MIN_POLL_S - took_s, -self.units / UNITS_PER_S)


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
        self.budget = Budget()  # the memory of every follow's copy
        # Poll answers applied to the copies since start, every followed
        # engine together (``holds_answers_applied`` in stats): one
        # increment per answer, nothing per load.
        self.answers_applied = 0
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
        f = self.follows[key] = Follow(address, engine_id, budget=self.budget)
        f.task = asyncio.get_running_loop().create_task(self._run(f))

    def covers(self, address: str, engine_id: str, tp_rank: int, request_id: str, groups: BlockGroups) -> bool:
        """True when the followed holds of ``engine_id`` at ``address`` show
        ``groups`` held for ``request_id`` on ``tp_rank`` (:meth:`Follow.covers`)
        and this daemon's pairs with that rank are with the agent of the
        daemon that answers the polls (:meth:`_same_agent`)."""
        f = self.follows.get((address, engine_id))
        if f is None:
            return False
        now = time.monotonic()
        if not f.covers(tp_rank, request_id, groups, now) or not self._same_agent(f, tp_rank):
            return False
        f.last_used = now
        return True

    async def wait_shown(self, address: str, engine_id: str, ranks: list[int], request_id: str,
                         groups: BlockGroups, until: float) -> list[int]:
        """Of source ``ranks`` whose hold of ``groups`` for ``request_id`` the
        copy does not show, those it still does not show after up to
        ``SHOWN_WAIT_ANSWERS`` more answers, ``SHOWN_WAIT_S`` seconds, or
        ``until`` (monotonic seconds), whichever comes first: the ones to
        claim. No wait when the copy is not trusted now, or started over
        without a snapshot within ``SHOWN_WAIT_GRACE_S`` (a hold made
        before it never shows).

        Why: under load a hold's answer can reach this daemon's event loop
        after the load that needs it (both arrive together; the loop reads
        the engine's commands first), and a claim then costs a round trip
        and CPU on both daemons for what the next answer brings anyway. A
        wait only delays a claim; the copy still only grants."""
        f = self.follows.get((address, engine_id))
        if f is None:
            return ranks
        until = min(until, time.monotonic() + SHOWN_WAIT_S)
        loop = asyncio.get_running_loop()
        for i in range(SHOWN_WAIT_ANSWERS):
            now = time.monotonic()
            if (not ranks or now >= until or self.follows.get((address, engine_id)) is not f
                    or now - f.answered > FRESH_S or now - f.blind_at < SHOWN_WAIT_GRACE_S
                    or not all(self._may_show(f, p, request_id) for p in ranks)):
                break
            if not i:
                self.rt.counters.claims_waited += len(ranks)  # kvd_claims_waited_total: holds on their way
            fut = loop.create_future()
            f.waiters.add(fut)
            try:
                await asyncio.wait((fut,), timeout=until - now)
            finally:
                f.waiters.discard(fut)
            ranks = [p for p in ranks if not self.covers(address, engine_id, p, request_id, groups)]
        return ranks

    def _may_show(self, f: Follow, tp_rank: int, request_id: str) -> bool:
        """Whether a later answer could make the copy show a hold of
        ``request_id`` on ``tp_rank`` that it does not show now: not when
        the copy has that lease already (other blocks: the source refuses
        the claim at once), when this daemon's own notifications ended it,
        or when this daemon's pairs with the rank are not with the agent
        that answers the polls (learnt every few seconds at most)."""
        key = (tp_rank, request_id)
        if key in f.held:
            return False
        done = f.sent.get(key)
        if done is not None and done[0] >= done[1]:
            return False
        return self._same_agent(f, tp_rank)

    def _same_agent(self, f: Follow, tp_rank: int) -> bool:
        """True when some local worker is paired with ``f``'s engine's rank
        ``tp_rank`` and every such pair is with ``f.agents[tp_rank]``: the
        daemon whose holds the copy shows is the one a READ goes to. The
        polls have a connection of their own (``PeerClient.holds``), and an
        address may reach several daemons (a load balancer, a DNS name of
        several records, one per connection)."""
        name = f.agents.get(tp_rank)
        if name is None:
            return False
        key = (f.address, f.engine_id, tp_rank)
        found = False
        for w in self.rt.workers.values():
            r = w.pairs.remotes.get(key)
            if r is not None:
                if r.agent_name != name:
                    return False
                found = True
        return found

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

    def _ranks_to_learn(self, f: Follow) -> set[int]:
        """The ranks of ``f``'s engine this daemon is paired with whose agent
        the follow does not know, or knows another one of than a pair's (a
        rank registered again there, with a new agent: its loads would
        claim until the copy's next reset)."""
        return {r.tp_rank for w in self.rt.workers.values() for r in w.pairs.remotes.values()
                if r.address == f.address and r.engine_id == f.engine_id and f.agents.get(r.tp_rank) != r.agent_name}

    async def _learn_agents(self, f: Follow) -> dict[int, tuple[str, str]]:
        """Asks, on the polls' own channel, the agent of every rank of ``f``'s
        engine this daemon is paired with and does not know it of yet, with
        the epoch of the engine's hold feed at the daemon that answers
        (``PeerClient.holds_agent``; a link without it: none, and the copy
        grants nothing). Raises CoreError."""
        ask = getattr(self.link, "holds_agent", None)
        if ask is None:
            return {}
        return {p: await ask(f.address, f.engine_id, p, WAIT_S + 5.0) for p in sorted(self._ranks_to_learn(f))}


    async def _run(self, f: Follow) -> None:
        """Polls ``f``'s source until the follow ends (idle, closing), keeping
        its copy; a failed poll or a bad answer drops the copy and waits a
        doubling backoff (back to the shortest only once the source has
        not failed for ``MAX_BACKOFF_S``: a source that breaks every other
        answer is not polled at the shortest backoff each time); between
        polls, :meth:`Pace.after`."""
        # The daemon's own work, for every engine that reads from the source:
        # not the uid whose handshake started it (its task copied that context).
        PEER_CALLER.set(-1)
        key = (f.address, f.engine_id)
        backoff = BACKOFF_S
        failed = -math.inf
        learn = False
        pace = Pace(at=time.monotonic())
        checked = time.monotonic()
        try:
            while not self.rt.closing and self.follows.get(key) is f:
                now = time.monotonic()
                if now - checked > CHECK_S:  # at most every few seconds: a walk over every pair
                    checked = now
                    if now - f.last_used > IDLE_S and not self._paired(*key):
                        log.info("stopped following the holds of %s engine=%s (no pair with it for %.0f s)",
                                 f.address, f.engine_id, IDLE_S)
                        return
                    if self._paired(*key):
                        f.last_used = now
                    learn = True  # pairs made since: their ranks' agents
                try:
                    # The agents of ranks paired with since, asked before the
                    # poll and used only if they came with the copy's epoch.
                    learnt = await self._learn_agents(f) if learn and f.epoch else {}
                    learn = False
                    started = time.monotonic()
                    ans = await self.link.holds(f.address, f.engine_id, f.epoch, f.seq, WAIT_S, WAIT_S + 5.0)
                    got = time.monotonic()
                    f.apply(ans, got)
                    self.answers_applied += 1
                    if ans.reset:  # the copy starts over: who answers now
                        learnt = await self._learn_agents(f)
                    f.take_agents(learnt)
                except (CoreError, BadAnswer) as e:
                    f.forget(keep_sent=True)
                    msg = "holds of %s engine=%s: %s; loads claim each hold, following again in %.1f s"
                    if isinstance(e, BadAnswer):  # a broken or hostile source: said, at most once a second
                        self._warned.warning(msg, f.address, f.engine_id, e, backoff)
                    else:  # unreachable, restarted, the engine gone: the handshakes say so
                        log.debug(msg, f.address, f.engine_id, e, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(MAX_BACKOFF_S, 2 * backoff)
                    failed = time.monotonic()
                    continue
                if got - failed > MAX_BACKOFF_S:
                    backoff = BACKOFF_S
                wait = pace.after(ans, got - started, got)
                if wait > MIN_POLL_S:
                    # No poll of this daemon waits at the source meanwhile: a
                    # lease that ends there would not reach the copy.
                    f.answered = -math.inf
                    f.woken()  # loads waiting for an answer claim now
                if wait > 0:
                    await asyncio.sleep(wait)
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
