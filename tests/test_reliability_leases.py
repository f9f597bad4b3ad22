"""Reliability: prefill blocks are always freed, and never too early.

A lease holds a prefill request's blocks for the decode side's READ. It ends
when the reader's notification arrives, when the decode side aborts (a bare
notification), when the prefill engine releases it, or when it expires. These
tests drive two real daemons from the test process (``kvd.testing.sessions.Engine``); both
daemons serve the whole module.

Deadlines are in docs/RELIABILITY.md.
"""

from __future__ import annotations

import random
import time

import pytest

from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import Engine, KvShape, event_kind
from kvd.testing.util import wait_until

SHAPE = KvShape(num_layers=2, num_blocks=256, block_len=1024)
SLACK_S = 3.0  # scheduling slack on a busy 2-core machine (leases are polled every 5 ms; typically 10-50 ms late)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("leases"))
    p = start_daemon(tmp, "prefill")
    d = start_daemon(tmp, "decode")
    src = Engine(p, "lease-p", SHAPE, seed=3)
    dst = Engine(d, "lease-d", SHAPE)
    yield src, dst
    dst.close()
    src.close()
    assert p.stop() == 0 and d.stop() == 0


def _assert_no_leases(src: Engine) -> None:
    st = src.daemon.stats()
    assert st.active_leases == 0, st
    assert st.early_notifications == 0, st


# ------------------------------------------------------------------ scenario 3
def test_decode_abort_before_reading_frees_prefill_blocks_at_once(pair):
    """The decode request is aborted before its load: the decode daemon sends
    the prefill worker a bare NIXL notification; the prefill lease (600 s)
    ends within a second, as a read would end it (SendDone, not expired)."""
    src, dst = pair
    for rid, peer in (("abort-first-contact", "handshake first"), ("abort-known-peer", "peer known")):
        src.hold(rid, [1, 2, 3], lease_s=600)
        wait_until(lambda: src.daemon.stats().active_leases == 1, 5, "lease held")
        t0 = time.monotonic()
        dst.abort_load(rid, src, rid)
        ev = src.wait(rid, 10)
        took = src.arrived - t0
        print(f"\n{rid} ({peer}): prefill SendDone {took * 1e3:.0f} ms after AbortLoad (lease 600 s)")
        assert event_kind(ev) == "send_done", ev
        assert not ev.send_done.expired and not ev.send_done.released
        assert took < 30.0  # the lease is 600 s: freed by the abort, not by expiry (slack for a loaded CI box)
        assert dst.quiet(rid, 0.2), "AbortLoad has no event on the decode side"
    _assert_no_leases(src)


def test_abort_that_beats_the_hold_still_frees_the_blocks_at_once(pair):
    """The decode side aborts before the prefill engine's hold reaches its
    daemon: the notification is kept, and the hold, when it comes, ends at
    once instead of waiting out its lease."""
    src, dst = pair
    dst.abort_load("early", src, "early")
    wait_until(lambda: src.daemon.stats().early_notifications == 1, 10, "notification kept for a later hold")
    t0 = time.monotonic()
    src.hold("early", [4, 5], lease_s=600)
    ev = src.wait("early", 5)
    assert event_kind(ev) == "send_done" and not ev.send_done.expired, ev
    assert time.monotonic() - t0 < 1.0
    _assert_no_leases(src)


def test_read_ends_the_lease_and_release_ends_it_too(pair):
    src, dst = pair
    src.hold("read", [6, 7], lease_s=600)
    dst.load("read", [6, 7], src, [6, 7], "read", timeout_s=10)
    assert event_kind(dst.wait("read")) == "recv_done"
    ev = src.wait("read")
    assert event_kind(ev) == "send_done" and not ev.send_done.expired
    src.hold("rel", [8], lease_s=600)
    src.release("rel")
    ev = src.wait("rel")
    assert event_kind(ev) == "send_done" and ev.send_done.released
    _assert_no_leases(src)


# ------------------------------------------------------------------ scenario 4
def test_unread_lease_expires_and_frees_the_blocks(pair):
    src, _ = pair
    before = src.daemon.stats().leases_expired
    t0 = time.monotonic()
    src.hold("nobody-reads", [10, 11], lease_s=1.0)
    assert src.quiet("nobody-reads", 0.7), "lease ended before it expired"
    ev = src.wait("nobody-reads", 1.0 + SLACK_S)
    took = src.arrived - t0
    print(f"\nlease of 1.0 s: SendDone(expired) after {took:.3f} s")
    assert event_kind(ev) == "send_done" and ev.send_done.expired, ev
    assert 1.0 <= took <= 1.0 + SLACK_S
    st = src.daemon.stats()
    assert st.active_leases == 0 and st.leases_expired == before + 1


def test_renewed_lease_stays_held_until_its_new_end(pair):
    """A second HoldBlocks of the same request and blocks renews the lease; a
    hold of the same request with other blocks is refused and changes nothing."""
    src, _ = pair
    t0 = time.monotonic()
    src.hold("renewed", [12, 13], lease_s=1.0)
    time.sleep(0.5)
    src.hold("renewed", [12, 13], lease_s=2.5)  # now ends at about 3.0 s
    src.hold("renewed", [14], lease_s=0.1)
    ev = src.wait("renewed", 2)
    assert event_kind(ev) == "rejected" and "other blocks" in ev.rejected.reason, ev
    assert src.quiet("renewed", 2.0 - (time.monotonic() - t0)), "renewed lease ended at its first deadline"
    assert src.daemon.stats().active_leases == 1
    ev = src.wait("renewed", 1.0 + SLACK_S + 1)
    took = src.arrived - t0
    print(f"\nrenewed lease (1.0 s, renewed at 0.5 s for 2.5 s): expired after {took:.3f} s")
    assert event_kind(ev) == "send_done" and ev.send_done.expired
    assert 3.0 <= took <= 3.0 + SLACK_S
    _assert_no_leases(src)


@pytest.mark.parametrize("order", ["longest-first", "shortest-first", "shuffled"])
def test_every_expired_lease_is_reclaimed_whatever_the_creation_order(pair, order):
    """40 leases of 0.3 to 2.0 s made in a given order, a quarter of them
    renewed once: each ends exactly once, expired, not before its (renewed)
    end and at most SLACK_S after it; none is left."""
    src, _ = pair
    rng = random.Random(order)
    leases = [0.3 + 1.7 * i / 39 for i in range(40)]
    if order == "longest-first":
        leases.reverse()
    elif order == "shuffled":
        rng.shuffle(leases)
    ends = {}
    t0 = time.monotonic()
    for i, lease in enumerate(leases):
        rid = f"{order}-{i}"
        src.hold(rid, [100 + 3 * i, 101 + 3 * i], lease_s=lease)
        ends[rid] = time.monotonic() - t0 + lease
    for i in rng.sample(range(40), 10):  # renew a quarter, before any expires
        rid = f"{order}-{i}"
        src.hold(rid, [100 + 3 * i, 101 + 3 * i], lease_s=leases[i] + 0.5)
        ends[rid] = time.monotonic() - t0 + leases[i] + 0.5
    late = []
    for rid, end in sorted(ends.items(), key=lambda kv: kv[1]):
        ev = src.wait(rid, end + SLACK_S + 2 - (time.monotonic() - t0))
        at = src.arrived - t0
        assert event_kind(ev) == "send_done" and ev.send_done.expired, ev
        assert at >= end - 0.05, f"{rid} ended at {at:.3f} s, before its end {end:.3f} s"
        late.append(at - end)
    print(f"\n{order}: 40 leases expired, at most {max(late) * 1e3:.0f} ms after their end")
    assert max(late) <= SLACK_S
    assert not src.drain(0.3), "a lease ended twice"
    _assert_no_leases(src)
