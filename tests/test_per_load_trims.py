"""The per-load trims of the nineteenth round (docs/PERFORMANCE.md): each
cheaper form gives what the form it replaced gave, and the wake-ups that
no longer make an event per change still wake every waiter and no other.

The paths themselves run for real in the suite (two daemons, the followed
holds, the command socket: tests/test_hold_follow.py,
tests/test_coalesced_reads.py, tests/test_ops.py); these pin the pieces."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest

from kvd.client.commands import Hold, Load
from kvd.core import events as ev
from kvd.core import plan
from kvd.core.events import PermissionDenied
from kvd.core.hold_feed import HoldChange, HoldFeed, HoldsAnswer
from kvd.core.holds import Holds
from kvd.core.leases import LeaseTable
from kvd.core.limits import Limits
from kvd.core.runtime import Runtime
from kvd.daemon import metrics as M
from kvd.daemon.convert import event_to_pb, groups_from_pb, holds_from_pb, holds_to_pb
from kvd.daemon.peer_client import _check_holds
from kvd.core.hold_mirror import BadAnswer
from kvd.requests import LoadRequest
from kvd.v1 import kvd_pb2 as pb


def test_the_transfer_metrics_expose_what_prometheus_clients_own_metrics_would():
    """Same names, buckets (a value on a bound counts in it), sums and
    counts as prometheus_client's Counter and Histogram fed the same."""
    disable_created_metrics()
    ref = CollectorRegistry()
    dur = Histogram("kvd_transfer_duration_seconds", "Transfer duration, load command to NIXL DONE", registry=ref,
                    buckets=M.DURATION_BUCKETS)
    descs = Histogram("kvd_transfer_descriptors", "NIXL descriptors per transfer", registry=ref,
                      buckets=M.DESCRIPTOR_BUCKETS)
    nbytes = Counter("kvd_transferred_bytes", "Bytes moved by completed transfers", registry=ref)
    count = Counter("kvd_transfers", "Completed transfers", registry=ref)
    ours = M._TransferCollector()
    reg = CollectorRegistry()
    reg.register(ours)
    for b, s, d in [(4096, 0.0005, 1), (10, 0.0031, 4), (7, 100.0, 70_000), (0, 0.0, 0), (1 << 40, 30, 65536)]:
        dur.observe(s)
        descs.observe(d)
        nbytes.inc(b)
        count.inc()
        ours.observe(b, s, d)
    assert sorted(generate_latest(reg).decode().splitlines()) == sorted(generate_latest(ref).decode().splitlines())
    assert ours.duration.counts[0] == 2 and ours.duration.counts[-1] == 1  # 0.0005 and 0 in le=0.0005; 100 in +Inf


@pytest.mark.parametrize("groups", [[[5]], [[1, 2, 3], [4]], [[]], []])
def test_groups_from_pb_gives_plain_lists_per_group(groups):
    got = groups_from_pb(pb.LoadBlocks(local_groups=[pb.BlockIds(ids=g) for g in groups]).local_groups)
    assert got == groups and all(type(g) is list for g in got)


def _changes():
    return (HoldChange(4, 0, "a", (np.array([7], np.int32),)),
            HoldChange(5, 1, "b", (np.array([1, 2], np.int32), np.array([], np.int32), np.array([9], np.int32))),
            HoldChange(6, 0, "c", ()),
            HoldChange(7, 0, "a", None))


def test_holds_answers_convert_both_ways_as_the_message_per_change_form_did():
    a = HoldsAnswer("ep", 7, False, _changes())
    m = holds_to_pb(a)
    old = pb.HoldsResponse(epoch="ep", seq=7, changes=[
        pb.HoldChange(tp_rank=c.tp_rank, request_id=c.request_id, ended=c.groups is None,
                      groups=[] if c.groups is None else [pb.BlockIds(ids=g.tolist()) for g in c.groups])
        for c in a.changes])
    assert m == old
    back = holds_from_pb(m)
    assert (back.epoch, back.seq, back.reset, back.snapshot) == ("ep", 7, False, False)
    assert [(c.seq, c.tp_rank, c.request_id) for c in back.changes] == [(4, 0, "a"), (5, 1, "b"), (6, 0, "c"),
                                                                        (7, 0, "a")]
    assert [None if c.groups is None else [g.tolist() for g in c.groups] for c in back.changes] == \
        [[[7]], [[1, 2], [], [9]], [], None]
    assert all(g.dtype == np.int64 for c in back.changes if c.groups for g in c.groups)
    snap = holds_from_pb(holds_to_pb(HoldsAnswer("ep", 9, True, _changes()[:3], snapshot=True)))
    assert snap.snapshot and [c.seq for c in snap.changes] == [9, 9, 9]


def test_a_hold_changes_sizes_are_counted_once_when_first_read():
    c = HoldChange(1, 0, "r\u00e9", (np.array([1, 2]), np.array([3])))
    assert c._sizes is None  # a reader that never reads them never counts them
    assert c.sizes() == (3, 2, 32 + 3 + 12 + 15)
    assert c.sizes() is c.sizes()
    assert HoldChange(2, 0, "r", None).sizes() == (0, 0, 33)


def test_a_holds_answer_is_refused_once_its_groups_pass_a_bound_before_any_is_converted(monkeypatch):
    from kvd.core import hold_feed

    monkeypatch.setattr(hold_feed, "MAX_GROUPS_PER_ANSWER", 5)
    ok = pb.HoldsResponse(changes=[pb.HoldChange(request_id="a", groups=[pb.BlockIds(ids=[1])] * 5)])
    assert _check_holds(ok) is ok
    spread = pb.HoldsResponse(changes=[pb.HoldChange(request_id=f"r{i}", groups=[pb.BlockIds()] * 2)
                                       for i in range(3)])
    with pytest.raises(BadAnswer, match="KV-cache groups in one answer"):
        _check_holds(spread)


@pytest.mark.parametrize("e", [ev.RecvDone("r", 1, 2, 3, 0.5, 0.25), ev.SendDone("s", True, False),
                               ev.LoadFailed("x", [1, 2], "why"), ev.LeaseRenewed("l", 3.0),
                               ev.CommandRejected("c", "bad")], ids=lambda e: type(e).__name__)
def test_each_event_converts_as_a_message_built_per_field_would(e):
    inner = {ev.RecvDone: ("recv_done", pb.RecvDone), ev.SendDone: ("send_done", pb.SendDone),
             ev.LoadFailed: ("load_failed", pb.LoadFailed), ev.LeaseRenewed: ("renewed", pb.LeaseRenewed),
             ev.CommandRejected: ("rejected", pb.CommandRejected)}[type(e)]
    fields = {f: getattr(e, f) for f in inner[1].DESCRIPTOR.fields_by_name if hasattr(e, f)}
    assert event_to_pb(e) == pb.SessionEvent(**{inner[0]: inner[1](**fields)})


def test_the_clients_commands_are_the_messages_they_were():
    req = LoadRequest("d1", [[3, 4], [5]], "p", "127.0.0.1:9", [[7, 8], [np.int64(9)]], "p1", 2, 1.5)
    assert Load(req, 1.5, 0.0).build() == pb.SessionCommand(load=pb.LoadBlocks(
        request_id="d1", local_groups=[pb.BlockIds(ids=[3, 4]), pb.BlockIds(ids=[5])], remote_engine_id="p",
        remote_address="127.0.0.1:9", remote_groups=[pb.BlockIds(ids=[7, 8]), pb.BlockIds(ids=[9])],
        remote_request_id="p1", remote_tp_size=2, timeout_s=1.5))
    h = Hold("p1", 2.0, [np.array([1, 2], np.int32)], 0.0, 1.0)
    assert h.build() == pb.SessionCommand(hold=h.hold_message(2.0))


def test_indices_of_checked_ids_equal_the_checking_form():
    for local, remote, regions, k, C, rg in [([[1, 2]], [[5, 6]], 1, 1, 1, None), ([[1, 2]], [[5, 6, 7]], 3, 2, 4, None),
                                             ([[0], [3]], [[1], [2]], 2, 1, 2, [0, 1])]:
        groups = tuple(rg) if rg else (0,) * regions
        want = plan.chunk_indices(local, remote, regions, 16, 16, k, C, rg)
        got = plan.checked_indices(*plan.check_request(local, remote, 16, 16, k, groups), regions, 16, 16, k, C,
                                   groups)
        assert all(np.array_equal(a, b) for a, b in zip(want, got))


def test_a_feeds_poll_waits_past_an_event_set_before_it_came_and_wakes_at_the_next_change():
    """The feed sets one event per change and a poll that waits makes a
    fresh one when it finds it set: a stale set must not end the wait at
    once, and a change must still wake every waiting poll."""
    async def main():
        f = HoldFeed("e")
        f.record(0, "r1", [np.array([1])])  # sets the event; nobody waits
        t0 = time.monotonic()
        empty = await f.wait_answer(f.epoch, 1, 0.2)
        waited = time.monotonic() - t0
        polls = [asyncio.ensure_future(f.wait_answer(f.epoch, 1, 30.0)) for _ in range(3)]
        await asyncio.sleep(0.05)
        f.record(0, "r2", [np.array([2])])
        got = await asyncio.wait_for(asyncio.gather(*polls), 10)
        return empty, waited, got

    empty, waited, got = asyncio.run(main())
    assert not empty.changes and waited >= 0.15
    assert [[c.request_id for c in a.changes] for a in got] == [["r2"]] * 3


def test_a_claim_waits_past_a_hold_event_set_before_it_and_wakes_at_the_hold_it_needs():
    async def main():
        rt = Runtime(Limits())
        w = SimpleNamespace(key=("p", 0), label="p rank 0", num_groups=1, layout=SimpleNamespace(num_blocks=64), leases=LeaseTable(),
                            hold_added=asyncio.Event())
        rt.workers[w.key] = w
        holds = Holds(rt)
        holds.hold(w, "other", [[1]])  # sets hold_added before the claim waits
        t0 = time.monotonic()
        with pytest.raises(PermissionDenied):
            await holds.claim("p", 0, "r", [[2]], wait_s=0.2)
        waited = time.monotonic() - t0
        claim = asyncio.ensure_future(holds.claim("p", 0, "r", [[2]], wait_s=30.0))
        await asyncio.sleep(0.05)
        assert not claim.done()
        holds.hold(w, "r", [[2]])
        await asyncio.wait_for(claim, 10)
        return waited

    assert asyncio.run(main()) >= 0.15


def test_a_large_group_is_converted_without_a_list_of_its_ids():
    """A hostile source's answer may hold one group of ~4M ids within the
    wire cap: slicing it to a Python list first cost the reader +192 MiB
    (attacker review); only small groups are sliced."""
    import tracemalloc

    n = 200_000
    m = pb.HoldsResponse(seq=1, changes=[pb.HoldChange(request_id="r", groups=[pb.BlockIds(
        ids=[257 + i % 16000 for i in range(n)])])])
    tracemalloc.start()
    try:
        got = holds_from_pb(m)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(got.changes[0].groups[0]) == n
    assert peak < 3 * 8 * n  # the int64 array (8 bytes an id) and little else; a list is ~36 bytes an id more
