"""Followed holds: a reader daemon READs without a per-load claim the blocks
the source's daemon has told it are held (``kvd.core.hold_feed`` on the
source, ``kvd.core.hold_mirror`` on the reader, ``PeerService.Holds``).

Unit tests of both halves (their rules and bounds), then two real daemons
(gRPC, NIXL/UCX and shared memory real, ``kvd.testing.sessions.Engine`` as
the engines) sharing a peer token: a load of a hold the reader follows is
served without ``PeerService.Claim``; what the copy no longer shows (a
lease its own READ ended, a released one, any lease while the source is
frozen) is claimed as before, and the claim decides.
"""

from __future__ import annotations

import asyncio
import math
import time

import grpc
import numpy as np
import pytest

from kvd.core import hold_feed as hf
from kvd.core import hold_mirror as hm
from kvd.core.events import NotFound, ResourceExhausted
from kvd.core.hold_feed import HoldChange, HoldFeed, HoldFeeds, HoldsAnswer
from kvd.core.hold_mirror import BadAnswer, Follow
from kvd.core.leases import LeaseTable
from kvd.testing.daemons import start_daemons, stop_daemons
from kvd.testing.sessions import Engine, KvShape, event_kind
from kvd.testing.util import peer_token_file, wait_until
from kvd.v1 import kvd_pb2 as pb

SHAPE = KvShape(num_layers=2, num_blocks=64, block_len=1024)
TOKEN = "kvd-follow-test-token-0123456789abcdef"


def arr(*ids) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


# ------------------------------------------------------------------ source side
def test_a_lease_table_reports_every_start_and_end_to_its_feed():
    """A lease's start names its blocks; its end (notified, released,
    expired, the worker unregistered) names none; a renewal or a conflict
    changes nothing."""
    seen = []
    t = LeaseTable(on_change=lambda rid, groups: seen.append((rid, None if groups is None else
                                                             [g.tolist() for g in groups])))
    assert t.hold("a", [[1, 2]], 10.0, 0.0) == "held"
    assert t.hold("a", [[1, 2]], 20.0, 0.0) == "renewed"
    assert t.hold("a", [[3]], 20.0, 0.0) == "conflict"
    t.hold("b", [[4]], 5.0, 0.0)
    t.hold("c", [[5]], 50.0, 0.0)
    t.hold("d", [[6]], 50.0, 0.0)
    assert t.notify("a", 1, 1.0)
    assert t.release("b")
    t.hold("e", [[7]], 1.0, 0.0)
    assert t.expire(2.0) == ["e"]
    t.clear()
    assert seen == [("a", [[1, 2]]), ("b", [[4]]), ("c", [[5]]), ("d", [[6]]), ("a", None), ("b", None),
                    ("e", [[7]]), ("e", None), ("c", None), ("d", None)]


def test_a_feed_answers_changes_in_order_and_a_reset_when_it_cannot_continue():
    async def main():
        f = HoldFeed("e")
        first = await f.wait_answer("", 0, 0.0)
        assert first.reset and first.epoch == f.epoch and first.seq == 0
        f.record(0, "r1", [arr(1, 2)])
        f.record(1, "r1", [arr(3)])
        f.record(0, "r1", None)
        a = await f.wait_answer(f.epoch, 0, 0.0)
        assert not a.reset and a.seq == 3 and [(c.seq, c.tp_rank, c.request_id, c.groups is None)
                                               for c in a.changes] == [(1, 0, "r1", False), (2, 1, "r1", False),
                                                                       (3, 0, "r1", True)]
        assert (await f.wait_answer(f.epoch, 2, 0.0)).changes[0].seq == 3
        # Nothing new: an empty answer at the end of the wait (no wait: at once).
        empty = await f.wait_answer(f.epoch, 3, 0.0)
        assert not empty.reset and empty.seq == 3 and not empty.changes
        for epoch, after in (("other", 3), (f.epoch, 4)):  # another feed, a change not made yet
            assert (await f.wait_answer(epoch, after, 0.0)).reset
        # A waiting poll is answered by the next change, not at the end of its wait.
        t0 = time.monotonic()
        waiter = asyncio.ensure_future(f.wait_answer(f.epoch, 3, 30.0))
        await asyncio.sleep(0.05)
        f.record(0, "r2", [arr(4)])
        got = await asyncio.wait_for(waiter, 10)
        assert [c.request_id for c in got.changes] == ["r2"] and time.monotonic() - t0 < 10
        # The feed ends (its engine's last worker went): a waiting poll is told to start over.
        waiter = asyncio.ensure_future(f.wait_answer(f.epoch, 4, 30.0))
        await asyncio.sleep(0.05)
        f.close()
        assert (await asyncio.wait_for(waiter, 10)).reset

    asyncio.run(main())


def test_a_feed_keeps_a_bounded_history_and_splits_large_answers(monkeypatch):
    monkeypatch.setattr(hf, "CHANGES_KEPT", 8)
    monkeypatch.setattr(hf, "MAX_IDS_PER_ANSWER", 10)

    async def main():
        f = HoldFeed("e")
        for i in range(20):
            f.record(0, f"r{i}", [np.arange(4, dtype=np.int32)])
        assert len(f.changes) == 8 and f.first_seq == 13
        assert (await f.wait_answer(f.epoch, 5, 0.0)).reset  # further behind than the history: start over
        a = await f.wait_answer(f.epoch, 12, 0.0)
        assert [c.seq for c in a.changes] == [13, 14] and a.seq == 14  # 8 ids of at most 10
        big = HoldFeed("e")
        big.record(0, "huge", [np.arange(50, dtype=np.int32)])
        assert [c.seq for c in (await big.wait_answer(big.epoch, 0, 0.0)).changes] == [1]  # one change always fits

    asyncio.run(main())


def test_a_feed_answers_the_same_from_either_end_of_its_history(monkeypatch):
    """Every follower position gets the changes after it, oldest first, up to
    one answer's count, whichever end of the kept history is nearer."""
    monkeypatch.setattr(hf, "CHANGES_KEPT", 12)
    monkeypatch.setattr(hf, "MAX_CHANGES_PER_ANSWER", 5)

    async def main():
        f = HoldFeed("e")
        for i in range(30):
            f.record(i % 2, f"r{i}", [np.arange(i % 3, dtype=np.int32)] if i % 4 else None)
            for after in range(f.first_seq - 1, f.seq):
                a = await f.wait_answer(f.epoch, after, 0.0)
                want = list(range(after + 1, min(f.seq, after + 5) + 1))
                assert not a.reset and [c.seq for c in a.changes] == want and a.seq == want[-1], (f.seq, after)

    asyncio.run(main())


def test_a_feeds_reset_lists_the_live_leases_when_they_fit_in_one_answer(monkeypatch):
    """A follower that starts over gets every lease live at the reset (not
    the ended ones), on the wire too; past one answer's bounds, or once the
    engine is gone, a reset without them (its loads claim those leases)."""
    from kvd.daemon.convert import holds_from_pb, holds_to_pb

    async def main():
        f = HoldFeed("e")
        f.record(0, "a", [arr(1, 2)])
        f.record(1, "a", [arr(3)])
        f.record(0, "b", [arr(4)])
        f.record(0, "a", None)
        r = await f.wait_answer("", 0, 0.0)
        assert r.reset and r.snapshot and r.seq == 4
        assert sorted((c.tp_rank, c.request_id, [g.tolist() for g in c.groups]) for c in r.changes) == [
            (0, "b", [[4]]), (1, "a", [[3]])]
        wire = holds_from_pb(pb.HoldsResponse.FromString(holds_to_pb(r).SerializeToString()))
        assert wire.snapshot and wire.seq == 4 and {(c.tp_rank, c.request_id) for c in wire.changes} == {
            (0, "b"), (1, "a")}
        # A later answer continues from the reset's change number.
        f.record(2, "c", [arr(5)])
        assert [c.request_id for c in (await f.wait_answer(f.epoch, r.seq, 0.0)).changes] == ["c"]
        monkeypatch.setattr(hf, "MAX_CHANGES_PER_ANSWER", 2)
        big = await f.wait_answer("old", 0, 0.0)
        assert big.reset and not big.snapshot and not big.changes
        monkeypatch.setattr(hf, "MAX_CHANGES_PER_ANSWER", 4096)
        f.close()
        assert not (await f.wait_answer("", 0, 0.0)).snapshot

    asyncio.run(main())


def test_a_feed_bounds_its_waiting_polls_and_answers_only_for_registered_engines(monkeypatch):
    monkeypatch.setattr(hf, "MAX_WAITING", 2)

    async def main():
        feeds = HoldFeeds()
        with pytest.raises(NotFound):
            await feeds.poll("nobody", False, "", 0, 1.0)
        a = await feeds.poll("e", True, "", 0, 0.0)
        waiters = [asyncio.ensure_future(feeds.poll("e", True, a.epoch, 0, 30.0)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(ResourceExhausted):
            await feeds.poll("e", True, a.epoch, 0, 30.0)
        # A wait past the cap, NaN or negative is capped or none.
        for w in (-1.0, math.nan):
            assert not (await feeds.poll("e", True, a.epoch, 0, w)).changes
        feeds.drop("e")
        assert all([(await asyncio.wait_for(w, 10)).reset for w in waiters])

    asyncio.run(main())


def test_a_feed_counts_the_answers_it_makes_not_the_polls_it_refuses(monkeypatch):
    """``HoldFeeds.answers_sent`` (``holds_answers_sent`` in stats): one per
    poll answered, a reset, changes or nothing new alike; none for a poll
    refused (no such engine, too many waiting) or given up before its answer."""
    monkeypatch.setattr(hf, "MAX_WAITING", 1)

    async def main():
        feeds = HoldFeeds()
        with pytest.raises(NotFound):
            await feeds.poll("nobody", False, "", 0, 1.0)
        assert feeds.answers_sent == 0
        a = await feeds.poll("e", True, "", 0, 0.0)  # a reset
        assert (await feeds.poll("e", True, a.epoch, a.seq, 0.0)).changes == ()  # nothing new
        assert feeds.answers_sent == 2
        waiting = asyncio.ensure_future(feeds.poll("e", True, a.epoch, a.seq, 30.0))
        await asyncio.sleep(0.05)
        with pytest.raises(ResourceExhausted):
            await feeds.poll("e", True, a.epoch, a.seq, 30.0)
        assert feeds.answers_sent == 2
        feeds.recorder("e", 0)("r", [arr(1)])  # a lease starts: the waiting poll is answered
        assert [c.request_id for c in (await asyncio.wait_for(waiting, 10)).changes] == ["r"]
        assert feeds.answers_sent == 3
        gone = asyncio.ensure_future(feeds.poll("e", True, a.epoch, a.seq + 1, 30.0))
        await asyncio.sleep(0.05)
        gone.cancel()  # the follower went away
        await asyncio.gather(gone, return_exceptions=True)
        assert feeds.answers_sent == 3

    asyncio.run(main())


# ------------------------------------------------------------------ reader side
def answer(epoch, seq, *changes, reset=False) -> HoldsAnswer:
    first = seq - len(changes) + 1
    return HoldsAnswer(epoch, seq, reset, tuple(HoldChange(first + i, *c) for i, c in enumerate(changes)))


def test_a_follow_copies_the_live_leases_and_trusts_them_only_while_fresh():
    f = Follow("p:1", "e")
    f.apply(answer("ep", 7, reset=True), 100.0)
    assert (f.epoch, f.seq, f.held) == ("ep", 7, {})
    f.apply(answer("ep", 9, (0, "r", (np.arange(8),)), (1, "r", (np.arange(4),))), 100.0)
    assert f.covers(0, "r", [list(range(8))], 100.0)      # every block
    assert f.covers(0, "r", [[7, 2]], 100.0)               # a subset (a local prefix hit)
    assert not f.covers(0, "r", [[8]], 100.0)              # a block not held
    assert not f.covers(0, "r", [[1], [1]], 100.0)         # a group the lease does not have
    assert not f.covers(2, "r", [[1]], 100.0) and not f.covers(0, "x", [[1]], 100.0)
    assert not f.covers(0, "r", [[1]], 100.0 + hm.FRESH_S + 0.01)  # no answer for too long: claim instead
    f.apply(answer("ep", 10, (0, "r", None)), 101.0)
    assert not f.covers(0, "r", [[1]], 101.0) and f.covers(1, "r", [[3]], 101.0)
    # This daemon's own notifications end the lease in the copy at once.
    f.notified(1, "r", 2)
    assert f.covers(1, "r", [[3]], 101.0)
    f.notified(1, "r", 2)
    assert not f.covers(1, "r", [[3]], 101.0) and f.ids == 0
    # A reset (another epoch) drops everything.
    f.apply(answer("ep", 11, (0, "s", (np.arange(2),))), 102.0)
    f.apply(answer("ep2", 1, reset=True), 103.0)
    assert not f.held and f.epoch == "ep2"


def snapshot(epoch, seq, *changes) -> HoldsAnswer:
    return HoldsAnswer(epoch, seq, True, tuple(HoldChange(seq, *c) for c in changes), snapshot=True)


def test_a_follow_that_starts_over_from_a_snapshot_shows_the_leases_made_before():
    """A reset's snapshot fills the copy; this daemon's own notifications
    outlive the reset, so a lease they ended, still live at the source,
    stays out of it; an end in a snapshot breaks the protocol."""
    f = Follow("p:1", "e")
    f.apply(answer("ep", 3, reset=True), 100.0)
    f.apply(answer("ep", 4, (0, "old", (np.arange(2),))), 100.0)
    f.notified(0, "done", 1)  # every notification of "done" sent, its end not yet at the source
    f.apply(snapshot("ep2", 9, (0, "r", (np.arange(4),)), (1, "r", (np.arange(2),)),
                     (0, "done", (np.arange(1),))), 101.0)
    assert (f.epoch, f.seq) == ("ep2", 9) and f.blind_at == -math.inf
    assert f.covers(0, "r", [[0, 3]], 101.0) and f.covers(1, "r", [[1]], 101.0)
    assert not f.covers(0, "old", [[0]], 101.0) and not f.covers(0, "done", [[0]], 101.0)
    assert f.ids == 6 and set(f.sent) == {(0, "done")}
    f.apply(answer("ep2", 10, (0, "done", None)), 102.0)  # its end comes: forgotten
    assert not f.sent
    # A reset without a snapshot leaves the copy blind to the leases before it.
    f.apply(answer("ep3", 1, reset=True), 103.0)
    assert not f.held and f.blind_at == 103.0
    with pytest.raises(BadAnswer):
        f.apply(snapshot("ep4", 2, (0, "x", None)), 104.0)
    # A follow that goes on after a failed poll keeps its notifications too.
    f.notified(0, "mine", 1)
    f.forget(keep_sent=True)
    f.apply(snapshot("ep5", 3, (0, "mine", (np.arange(1),)), (0, "t", (np.arange(1),))), 105.0)
    assert not f.covers(0, "mine", [[0]], 105.0) and f.covers(0, "t", [[0]], 105.0)
    # Its memory is counted while it lives, and given back in full when it ends,
    # a snapshot refused half-way included.
    with pytest.raises(BadAnswer):
        f.apply(snapshot("ep6", 4, (0, "u", (np.arange(3),)), (0, "", (np.arange(1),))), 106.0)
    assert f.budget.used == f.bytes > 0
    f.forget()
    assert f.budget.used == f.bytes == 0 and not f.sent


@pytest.mark.parametrize("bad", [
    answer("other", 5),                                              # another epoch without a reset
    answer("ep", 7, (0, "r", (np.arange(2),))),                      # a change number skipped
    answer("ep", 6, (9999, "r", (np.arange(2),))),                   # a TP rank past the bounds
    answer("ep", 6, (0, "", (np.arange(2),))),                       # no request id
    answer("ep", 6, (0, "x" * 2000, (np.arange(2),))),               # a request id past the bounds
    answer("ep", 6, (0, "r", tuple(np.arange(1) for _ in range(hm.MAX_GROUPS + 1)))),
])
def test_a_follow_refuses_an_answer_that_breaks_the_protocol(bad):
    f = Follow("p:1", "e")
    f.apply(answer("ep", 5, reset=True), 1.0)
    with pytest.raises(BadAnswer):
        f.apply(bad, 1.0)


def test_a_follow_refuses_a_copy_past_its_bounds(monkeypatch):
    monkeypatch.setattr(hm, "MAX_IDS", 100)
    f = Follow("p:1", "e")
    f.apply(answer("ep", 0, reset=True), 1.0)
    f.apply(answer("ep", 1, (0, "a", (np.arange(60),))), 1.0)
    with pytest.raises(BadAnswer):
        f.apply(answer("ep", 2, (0, "b", (np.arange(60),))), 1.0)
    with pytest.raises(BadAnswer):  # a snapshot too
        Follow("p:1", "e").apply(snapshot("ep", 2, (0, "a", (np.arange(60),)), (0, "b", (np.arange(60),))), 1.0)


# ------------------------------------------------------------------ waiting for the next answers
def mirror_with(f: Follow, monkeypatch) -> hm.HoldMirror:
    """A mirror following ``f`` whose pairs are with the copy's agents (the
    walk over real workers, ``_same_agent``, has its own real-daemon tests)."""
    from kvd.core.limits import Limits
    from kvd.core.runtime import Runtime

    m = hm.HoldMirror(Runtime(Limits()), link=None)
    m.follows[(f.address, f.engine_id)] = f
    monkeypatch.setattr(hm.HoldMirror, "_same_agent", lambda self, f, tp_rank: True)
    return m


def test_a_mirror_counts_the_answers_it_applies_not_the_ones_it_refuses(monkeypatch):
    """``HoldMirror.answers_applied`` (``holds_answers_applied`` in stats):
    one per poll answer applied to a copy; none for an answer refused
    (``BadAnswer``: the copy is dropped) or a poll that failed."""
    from types import SimpleNamespace

    from kvd.core.events import PeerUnavailable
    from kvd.core.limits import Limits

    monkeypatch.setattr(hm, "BACKOFF_S", 0.01)
    rt = SimpleNamespace(limits=Limits(), closing=False, workers={})

    class Link:
        answers = [answer("ep", 0, reset=True), answer("ep", 1, (0, "r", (arr(1),))),
                   answer("other", 2),  # another epoch without a reset: refused
                   PeerUnavailable("p:1: down"),
                   answer("ep", 1, reset=True)]
        polls = 0

        async def holds(self, address, engine_id, epoch, after, wait_s, timeout_s):
            self.polls += 1
            if not self.answers:
                await asyncio.sleep(3600)  # a long poll with nothing new
            got = self.answers.pop(0)
            if isinstance(got, Exception):
                raise got
            return got

    async def main():
        link = Link()
        m = hm.HoldMirror(rt, link)
        m.follow("p:1", "e")
        for _ in range(500):
            if link.polls == 6:
                break
            await asyncio.sleep(0.01)
        assert link.polls == 6 and m.answers_applied == 3  # two, then the reset after the refusal and failure
        await m.close()

    asyncio.run(main())


def test_a_load_the_copy_does_not_show_yet_waits_for_the_next_answers(monkeypatch):
    """The hold's answer comes while the load waits: shown, no claim. Two
    answers without it, or no answer for SHOWN_WAIT_S: claim. No wait for
    a copy that just started over (a hold may predate it), one not trusted,
    one dropped meanwhile, or a hold no answer can show."""
    monkeypatch.setattr(hm, "SHOWN_WAIT_S", 0.3)

    async def main():
        loop = asyncio.get_running_loop()
        t = time.monotonic()
        f = Follow("p:1", "e")
        f.apply(answer("ep", 1, reset=True), t - hm.SHOWN_WAIT_GRACE_S - 1)
        f.apply(answer("ep", 2, (0, "x", (arr(9),))), t)
        m = mirror_with(f, monkeypatch)

        def wait(rid, until=math.inf):
            return loop.create_task(m.wait_shown("p:1", "e", [0], rid, [[1, 2]], until))

        # Shown by the second answer after the load came.
        w = wait("r")
        await asyncio.sleep(0.01)
        f.apply(answer("ep", 3, (0, "other", (arr(1),))), time.monotonic())
        await asyncio.sleep(0.01)
        assert not w.done()
        f.apply(answer("ep", 4, (0, "r", (arr(1, 2),))), time.monotonic())
        assert await asyncio.wait_for(w, 1) == []
        # Two answers without it: claim, at once (no timeout waited).
        w = wait("s")
        for seq in (5, 6):
            await asyncio.sleep(0.01)
            f.apply(answer("ep", seq, (0, f"o{seq}", (arr(1),))), time.monotonic())
        assert await asyncio.wait_for(w, 0.2) == [0]
        # No answer: claim after SHOWN_WAIT_S, or the load's own bound if sooner.
        t0 = time.monotonic()
        assert await wait("s") == [0]
        assert hm.SHOWN_WAIT_S - 0.01 <= time.monotonic() - t0 < 5
        t0 = time.monotonic()
        assert await wait("s", until=t0 + 0.05) == [0]
        assert time.monotonic() - t0 < hm.SHOWN_WAIT_S
        # The copy dropped while a load waits: the load claims at once.
        w = wait("s")
        await asyncio.sleep(0.01)
        f.forget()
        assert await asyncio.wait_for(w, 0.2) == [0]
        # A copy not trusted, or just started over: no wait.
        assert await asyncio.wait_for(wait("s"), 0.1) == [0]
        f.apply(answer("ep2", 1, reset=True), time.monotonic())
        assert await asyncio.wait_for(wait("s"), 0.1) == [0]
        assert await m.wait_shown("q:1", "e", [0, 1], "s", [[1]], math.inf) == [0, 1]  # not followed
        # No wait where no answer can show it: the copy has the lease with
        # other blocks (the source refuses the claim at once), this daemon's
        # notifications ended it, or the pairs are not with the polled agent.
        f.blind_at = time.monotonic() - hm.SHOWN_WAIT_GRACE_S - 1
        f.apply(answer("ep2", 3, (0, "u", (arr(7),)), (0, "v", (arr(1, 2),))), time.monotonic())
        assert await asyncio.wait_for(wait("u"), 0.1) == [0]
        f.notified(0, "v", 1)
        assert await asyncio.wait_for(wait("v"), 0.1) == [0]
        monkeypatch.setattr(hm.HoldMirror, "_same_agent", lambda self, f, tp_rank: False)
        assert await asyncio.wait_for(wait("s"), 0.1) == [0]
        assert not f.waiters  # every waiter's future gone with it

    asyncio.run(main())


# ------------------------------------------------------------------ two real daemons
@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("follow")
    tok = ("--peer-token-file", peer_token_file(tmp, TOKEN))
    p, d = start_daemons((str(tmp), "prefill", *tok), (str(tmp), "decode", *tok))
    src = Engine(p, "follow-p", SHAPE, seed=11)
    dst = Engine(d, "follow-d", SHAPE)
    # A first load pairs D with the source and starts following its holds.
    src.hold("pair", [1])
    dst.load("pair-d", [1], src, [1], "pair")
    assert event_kind(dst.wait("pair-d")) == "recv_done"
    assert event_kind(src.wait("pair")) == "send_done"
    wait_until(lambda: d.stats().holds_followed == 1, 30, "D follows the source's holds")
    yield src, dst
    for e in (dst, src):
        e.close()
    stop_daemons([p, d])


def counts(dst: Engine) -> tuple[int, int]:
    s = dst.daemon.stats()
    return s.claims_sent, s.claims_followed


def waited(dst: Engine) -> int:
    return dst.daemon.stats().claims_waited


def wait_held(src: Engine, rid: str) -> None:
    """Holds ``rid`` and waits until the source counts its lease. Every
    earlier lease of this module ended first (its ``send_done`` taken), so
    no release can cross the count."""
    n = src.daemon.stats().active_leases
    src.hold(rid, [2, 3, 4])
    wait_until(lambda: src.daemon.stats().active_leases == n + 1, 10, f"{rid} held")


def followed_load(src: Engine, dst: Engine, tag: str, tries: int = 10) -> str:
    """Holds and loads new requests until one is served by the followed holds
    (no claim asked); returns its source request id. The copy learns a
    hold one poll answer after it is made: a load that beats it claims, as
    it should (a busy machine may delay an answer). Each read's lease has
    ended at the source (its ``send_done`` taken) when this returns: a
    notification still on its way would lower ``active_leases`` under a
    later :func:`wait_held`."""
    for i in range(tries):
        rid = f"{tag}-{i}"
        wait_held(src, rid)
        time.sleep(0.3)
        if load_held(src, dst, rid):
            return rid
    raise AssertionError(f"no load of {tries} was served by the followed holds")


def load_held(src: Engine, dst: Engine, rid: str) -> bool:
    """Loads ``rid``, held by ``src`` on blocks 2-4, into ``dst``'s blocks
    5-7 and checks the bytes and the lease's end; True when the followed
    holds served it (no claim asked)."""
    sent, followed = counts(dst)
    dst.load(f"{rid}-d", [5, 6, 7], src, [2, 3, 4], rid)
    ev = dst.wait(f"{rid}-d")
    assert event_kind(ev) == "recv_done", ev
    assert np.array_equal(dst.kv[:, 5:8], src.kv[:, 2:5])
    assert event_kind(src.wait(rid)) == "send_done"
    s2, f2 = counts(dst)
    if f2 == followed + 1:
        assert s2 == sent, "a load the followed holds served asked a claim too"
        return True
    return False


def test_a_followed_hold_is_read_without_a_claim(env):
    src, dst = env
    followed_load(src, dst, "plain")


def test_a_load_that_comes_before_its_hold_is_served_by_the_next_answer(env):
    """The load reaches the reader before the hold reaches the source (the
    decode engine's load ahead of the prefill engine's hold): it waits for
    the copy's next answers instead of claiming at once, and the answer
    that brings the hold serves it without a claim. A busy machine may
    delay an answer past the wait (that load claims, as it should): one
    of several tries served without a claim is enough."""
    src, dst = env
    followed_load(src, dst, "first")  # the copy has answered: a load it does not show waits
    for i in range(8):
        rid = f"early-{i}"
        sent, followed = counts(dst)
        w0 = waited(dst)
        dst.load(f"{rid}-d", [5, 6, 7], src, [2, 3, 4], rid, timeout_s=30)
        src.hold(rid, [2, 3, 4])
        ev = dst.wait(f"{rid}-d")
        assert event_kind(ev) == "recv_done", ev
        assert np.array_equal(dst.kv[:, 5:8], src.kv[:, 2:5])
        assert event_kind(src.wait(rid)) == "send_done"
        # Served by the answer it waited for (kvd_claims_waited_total counts
        # the wait; a slow loop may apply the answer first: no wait, retried).
        if counts(dst) == (sent, followed + 1) and waited(dst) == w0 + 1:
            return
        time.sleep(0.2)
    raise AssertionError("every load that came before its hold claimed, or did not count its wait")


def test_a_lease_the_readers_own_read_ended_is_claimed_again_and_refused(env):
    """A second load of the same source request (a replayed
    kv_transfer_params) after the first read ended the lease: the copy
    dropped it when the READ's notification went out, so the load asks
    Claim, and the source, whose lease has ended, refuses it."""
    src, dst = env
    rid = followed_load(src, dst, "replay")  # its lease ended at the source
    sent, followed = counts(dst)
    dst.load(f"{rid}-again", [5, 6, 7], src, [2, 3, 4], rid)
    ev = dst.wait(f"{rid}-again")
    assert event_kind(ev) == "load_failed" and "not_held" in ev.load_failed.reason, ev
    assert counts(dst) == (sent + 1, followed)


def test_a_released_lease_leaves_the_copy_with_the_next_answer(env):
    """A hold released by its engine: once a later hold has reached the
    copy (changes arrive in order), the released one is gone from it, and
    a load of it is claimed and refused."""
    src, dst = env
    wait_held(src, "gone")
    src.release("gone")
    assert src.wait("gone").send_done.released
    followed_load(src, dst, "after-release")  # a later change applied: the release's too
    sent, followed = counts(dst)
    dst.load("gone-d", [5, 6, 7], src, [2, 3, 4], "gone")
    ev = dst.wait("gone-d")
    assert event_kind(ev) == "load_failed" and "not_held" in ev.load_failed.reason, ev
    assert counts(dst) == (sent + 1, followed)


def test_a_frozen_source_is_not_trusted_and_its_loads_claim(env):
    """Past FRESH_S without an answer (the source frozen), a held request's
    load asks Claim: it waits for the source, and once the source runs
    again the claim grants the READ."""
    src, dst = env
    followed_load(src, dst, "before-freeze")
    wait_held(src, "frozen")
    time.sleep(0.3)
    sent, followed = counts(dst)
    src.daemon.pause(True)
    try:
        time.sleep(hm.FRESH_S + 1.0)
        dst.load("frozen-d", [5, 6, 7], src, [2, 3, 4], "frozen", timeout_s=60)
        time.sleep(0.5)
    finally:
        src.daemon.pause(False)
    ev = dst.wait("frozen-d", 60)
    assert event_kind(ev) == "recv_done", ev
    assert event_kind(src.wait("frozen")) == "send_done"
    s2, f2 = counts(dst)
    assert (s2, f2) == (sent + 1, followed), (sent, followed, s2, f2)
    # Answers come again: the copy is trusted again.
    followed_load(src, dst, "after-freeze")


def test_both_daemons_count_the_holds_answers_in_their_stats(env):
    """GetStats (``kvd status --json``, the ``kvd_holds_answers_*_total``
    metrics): the source counts the answers it makes for the reader's
    polls, the reader those it applies; neither counts the other side's
    (D follows P's holds, not the other way). The reader applies only
    answers P made; both go on about once a second with nothing changing
    (P answers a waiting poll at the end of its wait), and a hold is
    answered at once."""
    src, dst = env
    p, d = src.daemon, dst.daemon
    assert p.stats().holds_answers_applied == 0 and d.stats().holds_answers_sent == 0
    applied = d.stats().holds_answers_applied
    sent = p.stats().holds_answers_sent
    assert 1 <= applied <= sent  # the follow's reset at least; read in this order, never more applied than made
    wait_until(lambda: p.stats().holds_answers_sent > sent and d.stats().holds_answers_applied > applied, 30,
               "P answering D's polls with nothing new, and D applying the answers")
    followed_load(src, dst, "counted")  # a hold whose answer D applied before its load (no claim)
    assert d.stats().holds_answers_applied <= p.stats().holds_answers_sent


def test_a_hold_made_before_the_reader_follows_is_read_without_a_claim(tmp_path):
    """The source's reset brings the leases live when the reader starts to
    follow: a hold made before then is read without a claim (before the
    snapshot, its load claimed), and so is one made after.

    Several holds are made before: a busy machine may leave the copy
    untrusted for a moment (no answer within ``FRESH_S``) when one's load
    comes, which then claims, as it should (seen once in a full suite
    run); one of them served by the copy shows the snapshot brought them."""
    p, d = start_daemons((str(tmp_path), "snap-p"), (str(tmp_path), "snap-d"))
    src = dst = None
    early = [f"early-{i}" for i in range(5)]
    try:
        src = Engine(p, "snap-p", SHAPE, seed=5)
        dst = Engine(d, "snap-d", SHAPE)
        for rid in early:
            src.hold(rid, [2, 3, 4])
        wait_until(lambda: p.stats().active_leases == len(early), 10, "early held")
        src.hold("pair", [1])
        dst.load("pair-d", [1], src, [1], "pair")  # pairs D with the source: D starts following
        assert event_kind(dst.wait("pair-d")) == "recv_done"
        assert event_kind(src.wait("pair")) == "send_done"
        wait_until(lambda: d.stats().holds_followed == 1, 30, "D follows the source's holds")
        served = []
        for rid in early:
            if load_held(src, dst, rid):
                served.append(rid)
                break
            time.sleep(0.3)  # the copy's next answer
        assert served, "no hold made before the follow began was served by the followed holds"
        for rid in early[early.index(served[0]) + 1:]:
            src.release(rid)
            assert event_kind(src.wait(rid)) == "send_done"
        followed_load(src, dst, "later")
    finally:
        for e in (dst, src):
            if e is not None:
                e.close()
        stop_daemons([p, d])


def test_holds_polls_need_the_peer_token_and_refuse_bad_input(env):
    src, _ = env
    ch = grpc.insecure_channel(src.daemon.peer_address)
    call = ch.unary_unary("/kvd.v1.PeerService/Holds")
    req = pb.HoldsRequest(engine_id=src.engine_id, wait_s=0.1).SerializeToString()
    with pytest.raises(grpc.RpcError) as e:
        call(req, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ch.close()


def test_holds_are_followed_with_the_token_and_refused_for_bad_input(tmp_path):
    """The source's PeerService.Holds, through the daemon's own peer client
    (the token's proof both ways): NOT_FOUND for an engine not registered
    there, INVALID_ARGUMENT for an engine id past the bounds."""
    import asyncio as aio

    from kvd.core.events import InvalidArgument
    from kvd.daemon.peer_auth import PeerAuth
    from kvd.daemon.peer_client import PeerClient

    (p,) = start_daemons((str(tmp_path), "holds-src", "--peer-token-file", peer_token_file(tmp_path, TOKEN)))
    try:
        src = Engine(p, "holds-e", SHAPE)

        async def main():
            client = PeerClient(PeerAuth(token=TOKEN.encode()))
            try:
                first = await client.holds(p.peer_address, "holds-e", "", 0, 0.1, 10)
                assert first.reset and first.epoch
                src.hold("h1", [1, 2])
                got = await client.holds(p.peer_address, "holds-e", first.epoch, first.seq, 5.0, 10)
                assert [(c.request_id, [g.tolist() for g in c.groups]) for c in got.changes] == [("h1", [[1, 2]])]
                # The agent comes with the feed's epoch; a reset now lists h1.
                agent = await client.holds_agent(p.peer_address, "holds-e", 0, 10)
                assert agent == (src.registered.agent_name, first.epoch)
                again = await client.holds(p.peer_address, "holds-e", "", 0, 0.1, 10)
                assert again.snapshot and [c.request_id for c in again.changes] == ["h1"]
                with pytest.raises(NotFound):
                    await client.holds(p.peer_address, "nobody", "", 0, 0.1, 10)
                with pytest.raises(InvalidArgument):
                    await client.holds(p.peer_address, "x" * 5000, "", 0, 0.1, 10)
            finally:
                await client.close()

        aio.run(main())
        src.close()
    finally:
        stop_daemons([p])


def test_a_sources_long_epoch_is_refused_before_it_is_kept_or_quoted():
    """A hostile source answered its polls with 7 MiB epochs: the reader kept
    one, sent it back with every poll and quoted both in a warning, 117 MB of
    log in 40 s (attacker review). An answer's epoch, and the one a poll
    channel's handshake gives, are refused past ``MAX_EPOCH_CHARS``; a bad
    answer's message quotes epochs cut."""
    from kvd.core.events import InvalidArgument
    from kvd.daemon.peer_auth import PeerAuth
    from kvd.daemon.peer_client import PeerClient, _check_holds
    from kvd.core.state import PROTOCOL_VERSION
    from kvd.testing.fakes import FakePeer

    long = "A" * (7 << 20)
    with pytest.raises(BadAnswer, match=f"an epoch of {len(long)} characters"):
        _check_holds(pb.HoldsResponse(epoch=long, reset=True))
    ok = pb.HoldsResponse(epoch="e" * hm.MAX_EPOCH_CHARS, reset=True)
    assert _check_holds(ok) is ok

    f = Follow("p:1", "e")
    f.apply(answer("a" * hm.MAX_EPOCH_CHARS, 5, reset=True), 1.0)
    with pytest.raises(BadAnswer) as e:
        f.apply(answer("b" * hm.MAX_EPOCH_CHARS, 6), 2.0)
    assert "without a reset" in str(e.value) and len(str(e.value)) < 200, str(e.value)

    def respond(request, context):
        return pb.HandshakeResponse(agent_name="a", holds_epoch=long, protocol_version=PROTOCOL_VERSION)

    fake = FakePeer(respond)

    async def main():
        client = PeerClient(PeerAuth())
        try:
            with pytest.raises(InvalidArgument, match="an epoch of 7340032 and an agent name of 1 characters"):
                await client.holds_agent(fake.address, "e", 0, 10)
        finally:
            await client.close()

    try:
        asyncio.run(main())
    finally:
        fake.stop()
