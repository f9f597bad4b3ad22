"""Coalesced READs (kvd.core.coalesce): the small READs of several loads of
one worker from one source rank go out as one NIXL transfer with one
notification holding a piece per load; each load keeps its own answer,
lease end, deadline and failure."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from types import SimpleNamespace

import numpy as np
import pytest

from kvd.core import coalesce
from kvd.core import progress as progress_mod
from kvd.core.leases import notif_message, parse_notif
from kvd.core.limits import BOUNDS
from kvd.core.pull import Pull
from kvd.core.state import InflightLoad
from kvd.requests import LoadRequest
from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import KvShape, Session, one_group, register_request
from kvd.testing.shm import ShmSegment
from kvd.testing.util import wait_until
from kvd.v1 import kvd_pb2 as pb

# ----------------------------------------------------- the notification's pieces


def test_pieces_join_and_parse_back_whatever_the_request_ids_hold():
    ids = ["a", "r:1", "x\n\x00\xff:2", "é" * 300, "k" * BOUNDS.max_id_bytes]
    msg = b"".join(notif_message(rid, n + 1) for n, rid in enumerate(ids))
    assert parse_notif(msg) == [(rid, n + 1) for n, rid in enumerate(ids)]
    # A request id cannot forge a second piece: the length, not a separator, ends one.
    forged = "a:1" + notif_message("victim", 1).decode()
    assert parse_notif(notif_message(forged, 1)) == [(forged, 1)]


@pytest.mark.parametrize("msg", [
    b"",                                        # nothing
    b"r:1",                                     # no length (the old format)
    notif_message("r", 1)[:-1],                 # cut short
    notif_message("r", 1) + b"\x00",            # a trailing byte
    b"\x00\x00" + notif_message("r", 1),        # an empty piece
    (3).to_bytes(2, "big") + b"r:\xb2",         # not UTF-8
    notif_message("r", 0),                      # count out of range
    notif_message("r", BOUNDS.max_notifications + 1),
    (5).to_bytes(2, "big") + "r:²".encode(),     # "²".isdigit(): int() raised out of the handler before
    (2).to_bytes(2, "big") + b":1",             # no request id
    notif_message("r", 1) * (BOUNDS.max_loads_per_read + 1),  # more pieces than a READ carries
])
def test_a_malformed_notification_is_refused_whole(msg):
    assert parse_notif(msg) is None


def test_the_progress_loop_budget_counts_pieces_not_notifications():
    """A notification may hold BOUNDS.max_loads_per_read pieces: a pass
    handles NOTIFS_PER_PASS pieces, not that many notifications (64x as
    many lease lookups a pass otherwise)."""
    msg = notif_message("r", 1) * BOUNDS.max_loads_per_read
    handled = []
    holds = SimpleNamespace(on_notif=lambda w, a, m: handled.append(m) or len(parse_notif(m)))
    rt = SimpleNamespace(registered=lambda w: True)
    prog = progress_mod.Progress(rt, None, None, holds, None, None)
    for _ in range(100):
        prog._keep(SimpleNamespace(label="w"), "reader", msg)
    taken = prog.handle_notifs(progress_mod.NOTIFS_PER_PASS)
    assert taken == progress_mod.NOTIFS_PER_PASS // BOUNDS.max_loads_per_read == len(handled)
    assert len(prog._notifs) == 100 - taken


def test_a_malformed_notification_costs_the_budget_the_pieces_its_parse_walked():
    """63 good pieces of 1,000-byte ids and a bad last one were charged 1:
    a pass then parsed 16,317 pieces of a 1,024 budget (38 ms against ~5)."""
    from kvd.core.holds import Holds

    bad = notif_message("x" * 1000, 1) * 63 + notif_message("y", 0)
    holds = Holds.__new__(Holds)
    holds._malformed = SimpleNamespace(warning=lambda *a: None)
    assert holds.on_notif(SimpleNamespace(label="w"), "peer", bad) == 64
    assert holds.on_notif(SimpleNamespace(label="w"), "peer", b"\xff") == 1


# ----------------------------------------------------- batching, offline


class _Rt:
    """What CoalescedReads uses of the Runtime; posts run here (the NIXL thread idle)."""

    def __init__(self):
        self.counters = SimpleNamespace(coalesced_reads=0)
        self.zombies = []
        self.kick = asyncio.Event()

    def nixl_now(self, nbytes, fn, *args):
        return True, fn(*args)


def _worker():
    return SimpleNamespace(agent=object(), session=SimpleNamespace(epoch=1), inflight={})


def _req(rid):
    return LoadRequest(rid, [[1]], "p", "127.0.0.1:1", [[1]], "p-" + rid, 1)


def test_reads_of_one_pass_go_out_as_one_transfer_and_the_next_pass_starts_another():
    posts = []

    def post(rid, agent, r, op, local, lidx, remote, ridx, msg, spin):
        posts.append((rid, list(lidx), list(ridx), msg))
        return 7, "PROC", 0.004

    async def main():
        rt, w, r = _Rt(), _worker(), SimpleNamespace()
        reads = coalesce.CoalescedReads(rt, post)

        def read(i):
            return reads.read(w, 1, r, "L", "R", _req(f"d{i}"), np.array([i]), np.array([10 + i]),
                              notif_message(f"p-d{i}", 1), 4096, 0.0, 9.0, True)

        first = [read(i) for i in range(3)]
        got = await asyncio.gather(*first)
        second = await read(3)
        return rt, w, got, second

    rt, w, got, second = asyncio.run(main())
    assert [p[:3] for p in posts] == [("d0", [0, 1, 2], [10, 11, 12]), ("d3", [3], [13])]
    assert parse_notif(posts[0][3]) == [("p-d0", 1), ("p-d1", 1), ("p-d2", 1)]
    assert got == [(coalesce.INFLIGHT, pytest.approx(0.004 / 3))] * 3 and second == (coalesce.INFLIGHT, 0.004)
    assert rt.counters.coalesced_reads == 2
    # Each load in flight with the shared handle as its part; its own bytes and rows.
    assert sorted(w.inflight) == ["d0", "d1", "d2", "d3"]
    assert all(l.parts[0][0] == 7 and l.nbytes == 4096 and l.ndescs == 1 for l in w.inflight.values())


def test_a_batch_is_bounded_by_loads_and_bytes():
    sizes = []

    def post(rid, agent, r, op, local, lidx, remote, ridx, msg, spin):
        sizes.append(len(lidx))
        return None, "DONE", 0.0

    async def main():
        rt, w, r = _Rt(), _worker(), SimpleNamespace()
        reads = coalesce.CoalescedReads(rt, post)
        futs = [reads.read(w, 1, r, "L", "R", _req(f"d{i}"), np.array([i]), np.array([i]), notif_message("x", 1),
                           1024, 0.0, 9.0, True) for i in range(BOUNDS.max_loads_per_read + 5)]
        big = BOUNDS.inline_post_max_bytes // 2 + 1
        futs += [reads.read(w, 1, r, "L", "R", _req(f"b{i}"), np.array([i]), np.array([i]), notif_message("x", 1),
                            big, 0.0, 9.0, True) for i in range(2)]
        return await asyncio.gather(*futs)

    got = asyncio.run(main())
    assert sizes == [BOUNDS.max_loads_per_read, 6, 1]  # 5 small ones and a big one fit 1 MiB
    assert all(g == (coalesce.DONE, 0.0) for g in got)


@pytest.mark.parametrize("outcome", ["err", "raises", "session ended"])
def test_a_failed_or_dropped_post_answers_every_load_it_carries(outcome):
    from kvd.core.nixl_agent import NixlError

    def post(rid, agent, r, op, local, lidx, remote, ridx, msg, spin):
        if outcome == "raises":
            raise NixlError("post failed")
        return 9, "ERR", 0.0

    async def main():
        rt, w, r = _Rt(), _worker(), SimpleNamespace()
        reads = coalesce.CoalescedReads(rt, post)
        futs = [reads.read(w, 1, r, "L", "R", _req(f"d{i}"), np.array([i]), np.array([i]), notif_message("x", 1),
                           64, 0.0, 9.0, True) for i in range(3)]
        if outcome == "session ended":
            w.session.epoch = 2
        got = await asyncio.gather(*futs, return_exceptions=True)
        return rt, w, got

    rt, w, got = asyncio.run(main())
    assert w.inflight == {}
    if outcome == "err":
        assert got == [(coalesce.FAILED, (coalesce.FailureKind.NIXL, "nixl: transfer post returned ERR"))] * 3
        assert len(rt.zombies) == 1  # released once, by the next poll
    elif outcome == "raises":
        assert all(isinstance(g, NixlError) for g in got)
    else:
        assert got == [(coalesce.DROPPED, None)] * 3 and rt.zombies == []


# ----------------------------------------------------- one handle, many loads


class _Agent:
    def __init__(self, states):
        self.states, self.polled, self.released = states, [], []

    def state(self, h):
        self.polled.append(h)
        return self.states[h]

    def notifs(self):
        return {}


def _shared_worker(agent, deadlines):
    w = SimpleNamespace(agent=agent, inflight={}, pushes={}, pairs=SimpleNamespace(retired=[]), label="w",
                        key=("e", 0))
    r = SimpleNamespace(agent_name="src")
    for i, d in enumerate(deadlines):
        w.inflight[f"d{i}"] = InflightLoad(_req(f"d{i}"), [(5, r)], 0.0, d, 64, 1)
    return w


def test_the_progress_loop_polls_a_shared_read_once_and_the_loop_gives_it_up_once():
    """The poll (NIXL thread) only reads states; the loop ends each load the
    READ carried and hands its handle to the zombies once (released by the
    next poll): the loop owns the parts, so a session's end cannot take a
    handle the poll released."""
    agent = _Agent({5: "DONE"})
    w = _shared_worker(agent, [9.0] * 4)
    released, finished = [], []
    rt = SimpleNamespace(workers={"w": w}, zombies=[], warm_ups=None, release_zombies=lambda: None,
                         release_handle=lambda a, h, settled=False: released.append(h))
    pull = SimpleNamespace(finish=lambda w, rid, now: finished.append(rid), read_failed=None)
    prog = progress_mod.Progress(rt, None, None, None, pull, SimpleNamespace(poll_writes=lambda now: []))
    _, done = prog.poll()
    assert agent.polled == [5] and released == [] and done == [(w, None, "STATES", {5: "DONE"})]
    prog.reads_ended(w, {5: "DONE"}, 1.0)
    assert sorted(finished) == ["d0", "d1", "d2", "d3"] and rt.zombies == [(agent, 5)]
    assert all(l.parts == [] for l in w.inflight.values())


def test_a_load_past_its_deadline_gives_up_its_shared_read_once_and_the_others_fail_with_it():
    w = _shared_worker(_Agent({5: "PROC"}), [1.0, 50.0, 60.0])
    w.inflight["other"] = InflightLoad(_req("other"), [(6, SimpleNamespace(agent_name="src"))], 0.0, 70.0, 64, 1)
    rt = SimpleNamespace(workers={"w": w}, zombies=[])
    retired, failed = [], []
    pull = Pull.__new__(Pull)
    pull.rt, pull.peers = rt, SimpleNamespace(retire=lambda w, r, why: retired.append(why))

    retried = []

    async def fail_when_ended(w, req):
        failed.append(req.request_id)

    async def retry_when_ended(w, load, epoch):
        retried.append(load.req.request_id)

    pull._fail_when_ended, pull._retry_when_ended = fail_when_ended, retry_when_ended
    w.session = SimpleNamespace(epoch=1)

    async def main():
        pull.expire(10.0)
        await asyncio.sleep(0)

    asyncio.run(main())
    # d0 past its deadline fails once the READ has ended; d1 and d2 with it, though inside
    # theirs: not tried again, a second READ's notification would count twice at the source.
    assert sorted(failed) == ["d0", "d1", "d2"] and retried == [] and list(w.inflight) == ["other"]
    assert rt.zombies == [(w.agent, 5)]


def test_a_session_end_gives_up_a_shared_read_once(monkeypatch):
    w = _shared_worker(_Agent({5: "PROC"}), [9.0] * 3)
    w.session = SimpleNamespace(settling=None)

    async def nixl(fn, *args):
        return fn(*args)

    rt = SimpleNamespace(counters=SimpleNamespace(transfers_failed=0), nixl=nixl,
                         lines=SimpleNamespace(warning=lambda *a, **k: None))
    given = []

    async def cancel_reads(rt, registry, w, handles):
        given.append(handles)

    monkeypatch.setattr("kvd.core.settle.cancel_reads", cancel_reads)
    pull = Pull.__new__(Pull)
    pull.rt, pull.registry = rt, None
    asyncio.run(pull.cancel(w))
    assert given == [[5]] and w.inflight == {} and rt.counters.transfers_failed == 3


# ----------------------------------------------------- two real daemons

SHAPE = KvShape(num_layers=2, num_blocks=64, block_len=4096)
LOADS = 16


def _prefill(socket, q_out, q_in):
    """A prefill engine: fills its cache, holds a warm-up request and LOADS
    requests of 2 blocks each, reports their ends."""
    from kvd.testing.daemons import Daemon

    d = Daemon(proc=None, socket=socket, log_path="")
    seg = ShmSegment(SHAPE.size)
    try:
        seg.array[:] = np.random.default_rng(5).integers(0, 256, SHAPE.size, dtype=np.uint8)
        d.stub().RegisterEngine(register_request("prefill-c", SHAPE, seg), timeout=30)
        s = Session(d, "prefill-c")
        s.send(hold=pb.HoldBlocks(request_id="p-warm", groups=one_group([40]), lease_s=600))
        for i in range(LOADS):
            s.send(hold=pb.HoldBlocks(request_id=f"p-{i}", groups=one_group([2 * i, 2 * i + 1]), lease_s=600))
        q_out.put("ready")
        ends = []
        while len(ends) < LOADS + 1:
            ev = s.next(60)
            if ev.WhichOneof("event") == "send_done":
                ends.append((ev.send_done.request_id, ev.send_done.expired))
        q_out.put(sorted(ends))
        q_in.get(timeout=60)
        s.close()
    finally:
        seg.close()


def _load(i, local, remote, rid, peer):
    return pb.SessionCommand(load=pb.LoadBlocks(
        request_id=f"d-{rid}", local_groups=one_group(local), remote_engine_id="prefill-c", remote_address=peer,
        remote_groups=one_group(remote), remote_request_id=f"p-{rid}", remote_tp_size=1))


def test_loads_sent_together_go_out_as_one_read_byte_exact_each_ending_its_own_lease(tmp_path):
    """Real daemons, NIXL and shared memory. A warm-up load pairs the two
    daemons and starts the decode daemon following the prefill engine's
    holds; once a poll's answer has been applied after it (so the copy holds
    every request, all held before), LOADS loads in one write of the command
    socket need no claim, reach their post in the same pass and go out as
    one READ whose notification holds LOADS pieces: each lease ends by its
    own piece (not expired), each load gets its own RecvDone, and every
    block lands where its load put it."""
    prefill = start_daemon(str(tmp_path), "prefill")
    decode = start_daemon(str(tmp_path), "decode")
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_prefill, args=(prefill.socket, q_out, q_in))
    child.start()
    seg = ShmSegment(SHAPE.size)
    try:
        assert q_out.get(timeout=60) == "ready"
        decode.stub().RegisterEngine(register_request("decode-c", SHAPE, seg), timeout=30)
        s = Session(decode, "decode-c")
        assert s.transport == "socket"  # the daemons tests start offer it
        s._conn.send([_load(0, [0], [40], "warm", prefill.peer_address)])
        ev = s.next(30)
        assert ev.WhichOneof("event") == "recv_done", ev
        applied = decode.stats().holds_answers_applied
        wait_until(lambda: decode.stats().holds_answers_applied > applied, 30, "an answer of the followed holds")
        before = decode.stats()
        s._conn.send([_load(i, [63 - 2 * i, 62 - 2 * i], [2 * i, 2 * i + 1], i, prefill.peer_address)
                      for i in range(LOADS)])  # one write: the daemon reads them in one pass
        done = {}
        while len(done) < LOADS:
            ev = s.next(30)
            assert ev.WhichOneof("event") == "recv_done", ev
            done[ev.recv_done.request_id] = ev.recv_done
        assert sorted(done) == sorted(f"d-{i}" for i in range(LOADS))
        assert all(e.bytes == 2 * SHAPE.num_regions * SHAPE.block_len for e in done.values())
        ends = q_out.get(timeout=60)
        assert ends == sorted([("p-warm", False)] + [(f"p-{i}", False) for i in range(LOADS)])
        after = decode.stats()
        assert after.claims_sent == before.claims_sent  # every hold shown by the followed copy
        assert after.coalesced_reads - before.coalesced_reads == 1
        expected = np.random.default_rng(5).integers(0, 256, SHAPE.size, dtype=np.uint8)
        src = expected.reshape(SHAPE.num_regions, SHAPE.num_blocks, SHAPE.block_len)
        dst = seg.array.reshape(SHAPE.num_regions, SHAPE.num_blocks, SHAPE.block_len)
        for i in range(LOADS):
            assert np.array_equal(dst[:, [63 - 2 * i, 62 - 2 * i]], src[:, [2 * i, 2 * i + 1]]), i
        assert np.array_equal(dst[:, 0], src[:, 40])
        assert not dst[:, 1:64 - 2 * LOADS].any()
        q_in.put("done")
        s.close()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
        seg.close()
        for d in (prefill, decode):
            d.stop()


def test_a_session_end_never_takes_a_handle_the_poll_released(monkeypatch):
    """``Progress.poll`` (NIXL thread) released a READ that ended, then
    dropped it from its load's parts; ``Pull.cancel`` read the parts on the
    event loop, so in between it handed an already released handle to the
    zombies (released again later: a freed NIXL handle). A reviewer's run of
    the two side by side hit it in 10-43 of 300 tries, and a coalesced READ
    (a part of several loads, some taken before the poll saw them) made it
    likelier. The poll now releases no load's handle: the loop does, once."""
    import sys
    import threading

    from kvd.core.runtime import NixlThread

    monkeypatch.setattr(sys, "getswitchinterval", sys.getswitchinterval)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    hits = 0
    try:
        for _ in range(100):
            w = _shared_worker(_Agent({5: "DONE"}), [99.0] * 64)
            w.session = SimpleNamespace(settling=None)
            released, zombies = [], []
            thread = NixlThread("test-nixl")
            rt = SimpleNamespace(workers={"w": w}, zombies=[], warm_ups=None, release_zombies=lambda: None,
                                 release_handle=lambda a, h, settled=False: released.append(h), nixl=thread.call,
                                 counters=SimpleNamespace(transfers_failed=0),
                                 lines=SimpleNamespace(warning=lambda *a, **k: None))
            prog = progress_mod.Progress(rt, None, None, None, None, SimpleNamespace(poll_writes=lambda now: []))
            pull = Pull.__new__(Pull)
            pull.rt, pull.registry = rt, None

            async def cancel_reads(rt_, registry, w_, handles):
                zombies.extend(handles)

            monkeypatch.setattr("kvd.core.settle.cancel_reads", cancel_reads)

            async def main():
                polled = rt.nixl(prog.poll)  # on the NIXL thread, as the progress loop runs it
                await pull.cancel(w)
                await polled

            asyncio.run(main())
            thread.shutdown()
            assert threading.active_count() < 50
            hits += bool(released) or zombies != [5]
    finally:
        sys.setswitchinterval(interval)
    assert hits == 0, f"{hits} of 100: a handle released by the poll, or not handed to the zombies once"


def test_a_bug_answering_a_post_still_answers_every_load_and_gives_the_read_up_once():
    def post(rid, agent, r, op, local, lidx, remote, ridx, msg, spin):
        return 11, "PROC", 0.0

    async def main():
        rt, w, r = _Rt(), _worker(), SimpleNamespace()
        reads = coalesce.CoalescedReads(rt, post)
        def broken(b, members, res):
            raise ValueError("a bug")  # before any load is put in flight

        reads._posted = broken
        got = await asyncio.gather(*(reads.read(w, 1, r, "L", "R", _req(f"d{i}"), np.array([i]), np.array([i]),
                                                notif_message("x", 1), 64, 0.0, 9.0, True) for i in range(3)),
                                   return_exceptions=True)
        return rt, w, got

    rt, w, got = asyncio.run(main())
    assert all(isinstance(g, ValueError) for g in got)  # each load's catch-all answers LoadFailed
    assert w.inflight == {} and rt.zombies == [(w.agent, 11)]
