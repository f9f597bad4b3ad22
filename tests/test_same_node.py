"""Prefill and decode engines on one daemon: the daemon copies the blocks
itself (kvd.core.local_copy), with the same plan, lease and event semantics
as a NIXL READ, and never reads blocks their engine does not hold."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvd.core.limits import BOUNDS
from kvd.core.local_copy import COPY_PIECE_BYTES, split_pieces
from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import Engine, KvShape, event_kind

from kvd.testing.parity import run_pd  # one daemon for both sides

SHAPE = KvShape(num_layers=4, num_blocks=64, block_len=4096)
REMOTE_IDS = [60, 3, 11, 7, 0, 41, 42, 19]
LOCAL_IDS = [5, 2, 40, 17, 33, 63, 1, 20]


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """One daemon, same-node copy on (the default)."""
    d = start_daemon(str(tmp_path_factory.mktemp("samenode")), "kvd")
    yield d
    assert d.stop() == 0


@pytest.fixture
def engines(one, request):
    tag = request.node.name[-40:].replace("[", "-").replace("]", "")
    p = Engine(one, f"p-{tag}", SHAPE, seed=11, memfd=True)
    d = Engine(one, f"d-{tag}", SHAPE, memfd=True)
    yield p, d
    p.close()
    d.close()


def test_a_load_from_an_engine_of_the_same_daemon_is_copied_byte_exact_without_nixl(one, engines):
    p, d = engines
    before = one.stats()
    p.hold("req-p", REMOTE_IDS)
    d.load("req-d", LOCAL_IDS, p, REMOTE_IDS, "req-p")
    ev = d.wait("req-d")
    assert event_kind(ev) == "recv_done", ev
    assert ev.recv_done.bytes == len(LOCAL_IDS) * SHAPE.num_regions * SHAPE.block_len
    assert d.same_blocks(LOCAL_IDS, p, REMOTE_IDS)
    untouched = sorted(set(range(SHAPE.num_blocks)) - set(LOCAL_IDS))
    assert not d.kv[:, untouched].any()
    # The copy ends the prefill lease as a READ's notification would.
    sd = p.wait("req-p", 10)
    assert (event_kind(sd), sd.send_done.expired, sd.send_done.released) == ("send_done", False, False)
    st = one.stats()
    assert st.active_leases == 0 and st.transfers_done == before.transfers_done + 1
    # No NIXL pair: no handshake, no remote agent, no prepped list beyond each worker's own.
    assert st.peers == 0 and st.remote_agents == 0 and st.prepped_dlists == before.prepped_dlists
    assert "same-node copy plan" in one.log()


def test_a_load_past_the_inline_size_is_copied_on_the_nixl_thread_byte_exact(one):
    """Pieces up to BOUNDS.inline_post_max_bytes are copied on the loop when
    the NIXL thread is idle, larger ones on that thread: both byte exact."""
    shape = KvShape(num_layers=4, num_blocks=64, block_len=64 << 10)
    ids = LOCAL_IDS
    assert len(ids) * shape.num_regions * shape.block_len > BOUNDS.inline_post_max_bytes
    p = Engine(one, "p-big", shape, seed=5, memfd=True)
    d = Engine(one, "d-big", shape, memfd=True)
    try:
        p.hold("big-p", REMOTE_IDS)
        d.load("big-d", ids, p, REMOTE_IDS, "big-p")
        ev = d.wait("big-d")
        assert event_kind(ev) == "recv_done", ev
        assert ev.recv_done.bytes == len(ids) * shape.num_regions * shape.block_len
        assert d.same_blocks(ids, p, REMOTE_IDS)
        assert event_kind(p.wait("big-p", 10)) == "send_done"
    finally:
        p.close()
        d.close()


def test_every_load_is_answered_when_its_source_unregisters_during_the_copies(one):
    """40 one-block loads, the source unregistered a few ms after they are
    sent: each ends with recv_done (copied while both were registered, byte
    exact) or load_failed, none unanswered (an attacker review found 10-28
    of 40 with no event: a source gone after the last piece was taken for
    a reader gone)."""
    from kvd.v1 import kvd_pb2 as pb

    shape = KvShape(num_layers=4, num_blocks=64, block_len=64 << 10)
    p = Engine(one, "p-unreg", shape, seed=3, memfd=True)
    d = Engine(one, "d-unreg", shape, memfd=True)
    try:
        n = 40
        for i in range(n):
            p.hold(f"h{i}", [i])
        time.sleep(0.2)
        for i in range(n):
            d.load(f"l{i}", [i], p, [i], f"h{i}", timeout_s=5)
        time.sleep(0.005)
        one.stub().UnregisterEngine(pb.UnregisterEngineRequest(worker=pb.EngineWorker(engine_id="p-unreg",
                                                                                      tp_rank=0)), timeout=10)
        kinds = {}
        for i in range(n):
            ev = d.wait(f"l{i}", 15)  # AssertionError when a load is never answered
            kinds[event_kind(ev)] = kinds.get(event_kind(ev), 0) + 1
            if event_kind(ev) == "recv_done":
                assert d.same_blocks([i], p, [i])
            else:
                assert event_kind(ev) == "load_failed", ev
        assert sum(kinds.values()) == n
        assert one.stats().engines >= 1  # the daemon serves on
    finally:
        p.close(unregister=False)
        d.close()


def test_a_copy_past_its_deadline_stops_between_pieces_and_no_byte_lands_after_its_answer(one):
    """A 128 MiB load (16 pieces on the NIXL thread, the next one queued
    behind the one copying) with a 4 ms deadline fails with a timeout, and
    the reader's blocks do not change after the answer: a piece queued when
    the deadline passed is skipped, one copying ends before the answer."""
    shape = KvShape(num_layers=4, num_blocks=16, block_len=1 << 20)
    p = Engine(one, "p-late", shape, seed=9, memfd=True)
    d = Engine(one, "d-late", shape, memfd=True)
    try:
        ids = list(range(shape.num_blocks))
        p.hold("late-p", ids)
        p.held("late-p", ids)  # the hold is in: the load's time goes to its copy, not to a wait for it
        d.load("late-d", ids, p, ids, "late-p", timeout_s=0.004)
        ev = d.wait("late-d")
        assert event_kind(ev) == "load_failed" and "timeout" in ev.load_failed.reason, ev
        after = d.kv.copy()
        time.sleep(0.1)
        assert np.array_equal(d.kv, after), "bytes landed after the load was answered"
        # The daemon serves on: the same blocks load in full with time to do it.
        d.load("late-d2", ids, p, ids, "late-p", timeout_s=30)
        assert event_kind(d.wait("late-d2")) == "recv_done"
        assert d.same_blocks(ids, p, ids)
    finally:
        p.close()
        d.close()


def test_pieces_queued_behind_a_cancelled_copy_are_skipped_and_awaited():
    """LocalCopy._copy queues the next piece behind the one copying. When
    the load's task is cancelled (its session ended) while both wait on
    the NIXL thread, neither is copied (the first is skipped as a cancelled
    call, the second by the load's stop flag) and the task ends only after
    the thread has passed them: no byte lands after the load ended."""
    import asyncio
    import ctypes
    import threading
    from types import SimpleNamespace

    from kvd.core.limits import Limits
    from kvd.core.local_copy import LocalCopy
    from kvd.core.runtime import Runtime

    async def scenario():
        rt = Runtime(Limits())
        w = SimpleNamespace(key=("d", 0), session=SimpleNamespace(epoch=0), label="d")
        s = SimpleNamespace(key=("p", 0), label="p")
        rt.workers.update({w.key: w, s.key: s})
        n = 2 * BOUNDS.inline_post_max_bytes  # past the inline size: every piece goes to the thread
        src, dst = ctypes.create_string_buffer(b"x" * (3 * n)), ctypes.create_string_buffer(3 * n)
        pieces = [([ctypes.addressof(dst) + i * n], [ctypes.addressof(src) + i * n], [n]) for i in range(3)]
        gate = threading.Event()
        blocker = rt.nixl(gate.wait)  # the thread is busy: the pieces queue behind it
        task = asyncio.ensure_future(LocalCopy(rt, None)._copy(w, 0, {0: s}, time.monotonic() + 60, pieces))
        await asyncio.sleep(0.05)
        assert not task.done()
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done(), "the copy ended while a piece it queued could still run"
        gate.set()
        await blocker
        with pytest.raises(asyncio.CancelledError):
            await task
        assert dst.raw == bytes(3 * n), "a piece was copied after its load was cancelled"
        rt.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize("npieces, cancels", [(1, 1), (3, 1), (3, 2)])
def test_a_copy_cancelled_while_its_piece_runs_ends_after_the_piece(monkeypatch, npieces, cancels):
    """The task of a copy cancelled (once, or again while it waits) while
    its piece is copying on the NIXL thread ends only after that piece has
    (the piece's cancelled future is done at once, so _copy waits for a
    no-op queued behind it); its later pieces are skipped."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from kvd.core import local_copy
    from kvd.core.limits import Limits
    from kvd.core.local_copy import LocalCopy
    from kvd.core.runtime import Runtime

    started, gate, order = threading.Event(), threading.Event(), []

    def slow_copy(dst, src, ln, threads=1):
        order.append(f"start {dst[0]}")
        started.set()
        gate.wait(10)
        order.append(f"end {dst[0]}")

    monkeypatch.setattr(local_copy, "copy_rows", slow_copy)
    big = 2 * BOUNDS.inline_post_max_bytes  # past the inline size: every piece goes to the thread

    async def scenario():
        rt = Runtime(Limits())
        w = SimpleNamespace(key=("d", 0), session=SimpleNamespace(epoch=0), label="d")
        s = SimpleNamespace(key=("p", 0), label="p")
        rt.workers.update({w.key: w, s.key: s})
        pieces = [([i], [0], [big]) for i in range(npieces)]
        task = asyncio.ensure_future(LocalCopy(rt, None)._copy(w, 0, {0: s}, time.monotonic() + 60, pieces))
        for _ in range(2000):
            if started.is_set() or task.done():
                break
            await asyncio.sleep(0.005)
        assert started.is_set(), f"the piece never started: {task.exception() if task.done() else 'still waiting'}"
        for _ in range(cancels):
            task.cancel()
            await asyncio.sleep(0.05)
            assert not task.done(), "the copy ended while its piece was still copying"
        order.append("released")
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        order.append("task ended")
        rt.shutdown()

    asyncio.run(scenario())
    assert order == ["start 0", "released", "end 0", "task ended"], order


@pytest.mark.parametrize("spelling", ["localhost:{port}", "[::ffff:127.0.0.1]:{port}", "0.0.0.0:{port}"])
def test_a_load_naming_this_daemon_by_another_spelling_is_a_same_node_copy(one, engines, spelling):
    """kvd.core.own_addresses: another spelling of this daemon's peer address is
    resolved to its listener first, so the same-node rules apply (a copy, a
    claim answered by its own holds), with no NIXL pair to itself."""
    p, d = engines
    before = one.stats()
    address = spelling.format(port=one.peer_address.rsplit(":", 1)[1])
    p.hold("alias-p", REMOTE_IDS[:2])
    d.load("alias-d", LOCAL_IDS[:2], None, REMOTE_IDS[:2], "alias-p", remote_engine_id=p.engine_id,
           remote_address=address)
    ev = d.wait("alias-d")
    assert event_kind(ev) == "recv_done", ev
    assert d.same_blocks(LOCAL_IDS[:2], p, REMOTE_IDS[:2])
    assert event_kind(p.wait("alias-p", 10)) == "send_done"
    st = one.stats()
    assert st.peers == 0 and st.remote_agents == 0 and st.prepped_dlists == before.prepped_dlists


def test_a_load_that_comes_before_its_hold_waits_for_it(engines):
    p, d = engines
    d.load("early-d", LOCAL_IDS[:2], p, REMOTE_IDS[:2], "early-p", timeout_s=20)
    assert d.quiet("early-d", 0.3)  # no hold yet: nothing read, nothing failed
    p.hold("early-p", REMOTE_IDS)
    assert event_kind(d.wait("early-d")) == "recv_done"
    assert d.same_blocks(LOCAL_IDS[:2], p, REMOTE_IDS[:2])
    assert event_kind(p.wait("early-p", 10)) == "send_done"


def test_blocks_the_source_does_not_hold_for_that_request_are_not_read(one, engines):
    p, d = engines
    p.hold("mine", REMOTE_IDS[:4])
    d.load("thief", LOCAL_IDS[:2], p, [REMOTE_IDS[0], REMOTE_IDS[5]], "mine")  # block 41 is not held
    ev = d.wait("thief")
    assert event_kind(ev) == "load_failed" and ev.load_failed.reason.startswith("not_held:"), ev
    assert sorted(ev.load_failed.failed_block_ids) == sorted(LOCAL_IDS[:2])
    assert not d.kv[:, LOCAL_IDS[:2]].any()
    # A request id with no lease at all: refused once the claim's wait is over, nothing read.
    d.load("nolease", LOCAL_IDS[2:4], p, REMOTE_IDS[:2], "never-held", timeout_s=0.5)
    ev = d.wait("nolease", 10)
    assert event_kind(ev) == "load_failed" and ev.load_failed.reason.startswith("not_held:"), ev
    assert not d.kv[:, LOCAL_IDS[2:4]].any()
    assert p.quiet("mine", 0.1)  # the real lease is untouched
    p.release("mine")
    assert p.wait("mine").send_done.released
    assert one.stats().active_leases == 0


def test_block_ids_out_of_the_source_range_fail_the_load_not_the_daemon(one, engines):
    p, d = engines
    p.hold("r", [1, 2])
    d.load("bad", [1, 2], p, [1, SHAPE.num_blocks], "r")
    ev = d.wait("bad")
    assert event_kind(ev) == "load_failed" and "out of range" in ev.load_failed.reason, ev
    p.release("r")
    assert one.stats().engines >= 2  # still serving


def test_incompatible_engines_of_one_daemon_are_refused_and_the_source_freed(one):
    p = Engine(one, "p-other-model", SHAPE, seed=3, model="another-model", memfd=True)
    d = Engine(one, "d-other-model", SHAPE, memfd=True)
    try:
        p.hold("x", [1])
        d.load("xd", [1], p, [1], "x")
        ev = d.wait("xd")
        assert event_kind(ev) == "load_failed" and "compatibility hash" in ev.load_failed.reason, ev
        assert event_kind(p.wait("x", 10)) == "send_done"  # nobody will read them: freed now
    finally:
        p.close()
        d.close()


def test_same_node_copy_off_sends_the_load_through_nixl(tmp_path):
    nixl_only = start_daemon(str(tmp_path), "nixl-only", "--same-node-copy", "false")
    p = Engine(nixl_only, "p-nixl", SHAPE, seed=5)
    d = Engine(nixl_only, "d-nixl", SHAPE)
    try:
        p.hold("n", REMOTE_IDS)
        d.load("nd", LOCAL_IDS, p, REMOTE_IDS, "n")
        assert event_kind(d.wait("nd")) == "recv_done"
        assert d.same_blocks(LOCAL_IDS, p, REMOTE_IDS)
        assert event_kind(p.wait("n", 10)) == "send_done"
        assert nixl_only.stats().peers == 1  # a handshake with itself: the NIXL path
        assert "same-node copy" not in nixl_only.log()
    finally:
        p.close()
        d.close()
        nixl_only.stop()


# The parity scenarios (heterogeneous TP, HND<->NHD, MLA, block size remap,
# vLLM-CPU blocks), prefill and decode on one daemon: every decode element is
# compared with what it must hold, every prefill lease ends by notification.
@pytest.mark.parametrize("p_tp,d_tp,heads,p_layout,d_layout,p_bs,d_bs", [
    (1, 1, 4, "HND", "HND", 16, 16), (2, 1, 4, "HND", "HND", 16, 16), (1, 2, 4, "HND", "HND", 16, 16),
    (4, 2, 2, "HND", "HND", 16, 16), (1, 2, 4, "NHD", "HND", 16, 16), (2, 1, 1, "MLA", "MLA", 16, 16),
    (1, 1, 4, "HND", "HND", 16, 32), (2, 1, 4, "CPU", "CPU", 16, 32),
])
def test_parity_scenarios_on_one_daemon(one, p_tp, d_tp, heads, p_layout, d_layout, p_bs, d_bs):
    tag = f"one{p_tp}{d_tp}{heads}{p_layout}{d_layout}{p_bs}{d_bs}"
    d_events, p_events = run_pd(one, one, p_tp, d_tp, heads, p_layout, d_layout, p_bs, d_bs, tag)
    assert [e.WhichOneof("event") for e in d_events] == ["recv_done"] * d_tp, d_events
    assert [(e.WhichOneof("event"), e.send_done.expired) for e in p_events] == [("send_done", False)] * p_tp
    assert one.stats().peers == 0


def test_a_refused_block_size_on_one_daemon_fails_at_once_and_frees_the_source(one):
    d_events, p_events = run_pd(one, one, 1, 1, 4, "CPU", "CPU", 32, 16, "one3216")
    ev = d_events[0]
    assert ev.WhichOneof("event") == "load_failed" and "not a multiple" in ev.load_failed.reason, ev
    assert p_events[0].WhichOneof("event") == "send_done"


# -- the copy list, alone ---------------------------------------------------------------
def _fake_worker(kv: str, bs: int, nb: int, base: int):
    """A worker's fields a copy plan reads (two regions in two segments at
    ``base``, ``nb`` blocks of ``bs`` tokens, 2 heads x 8 x fp16), and its
    plan.Geometry; no memory behind the addresses."""
    from types import SimpleNamespace

    from kvd.core import plan
    from kvd.core.layout import Layout, Region

    bl = bs * 2 * 8 * 2  # tokens x heads x head_dim x fp16
    regions = [Region(0, 0, bl, bl), Region(1, 64, bl, bl + 64)]
    maps = [SimpleNamespace(addr=base, size=nb * (bl + 64) + 64),
            SimpleNamespace(addr=base + (1 << 30), size=nb * (bl + 64) + 64)]
    w = SimpleNamespace(label="w", regions=regions, layout=Layout(nb, bs, kv, "float16", 2, 8, 1, (bl, bl)),
                        mem=SimpleNamespace(bases=[m.addr + r.offset for m, r in zip(maps, regions)],
                                            mappings=maps))
    return w, plan.Geometry(0, 1, w.layout, tuple(regions), 2)


def test_contiguous_rows_merge_and_long_rows_are_cut_into_pieces():
    n = 1 << 20
    dst = np.array([0, n, 2 * n, 10 * n], dtype=np.int64)
    src = np.array([100 * n, 101 * n, 50 * n, 60 * n], dtype=np.int64)
    ln = np.array([n, n, n, 3 * n], dtype=np.int64)
    pieces = split_pieces(dst, src, ln, piece=2 * n)
    rows = [(int(d), int(s), int(x)) for p in pieces for d, s, x in zip(*p)]
    # rows 0 and 1 are contiguous on both sides; row 2 is not (its source jumps).
    assert rows[0] == (0, 100 * n, 2 * n)
    assert (2 * n, 50 * n, n) in rows
    cut = [r for r in rows if r[0] >= 10 * n]
    assert cut == [(10 * n, 60 * n, 2 * n), (12 * n, 62 * n, n)]
    assert sum(r[2] for r in rows) == int(ln.sum())
    assert all(int(p[2].sum()) <= 2 * (2 * n) for p in pieces)
    assert split_pieces(np.array([], np.int64), np.array([], np.int64), np.array([], np.int64)) == []
    assert COPY_PIECE_BYTES >= 1 << 20


def test_python_pieces_equal_numpy_pieces_for_random_rows():
    """split_runs (lists, a small load's) and split_pieces (numpy) cut the
    same merged rows into the same pieces: rows shorter and longer than a
    piece, totals just under, at and over multiples of it."""
    import random

    from kvd.core.local_copy import split_runs

    rng = random.Random(7)
    for _ in range(500):
        piece = rng.choice([1, 5, 64, 100])
        n = rng.randint(1, 30)
        ln = [rng.choice([1, piece - 1 or 1, piece, piece + 1, 3 * piece, rng.randint(1, 4 * piece)]) for _ in range(n)]
        dst = [i * 10_000 for i in range(n)]  # never contiguous: split_pieces merges nothing
        src = [5_000_000 + i * 20_000 for i in range(n)]
        want = [[(int(d), int(s), int(x)) for d, s, x in zip(*p)]
                for p in split_pieces(np.array(dst), np.array(src), np.array(ln), piece)]
        got = [list(zip(*p)) for p in split_runs(dst, src, ln, piece)]
        assert got == want, (piece, ln)
    assert split_runs([], [], []) == []


def test_a_plan_side_gives_the_addresses_of_the_full_descriptor_lists():
    """Side.rows (chunk offsets per region) equals plan.local_rows /
    plan.remote_rows (the lists a NIXL pair prepares) row for row: HND
    reader of block size 32, NHD source of block size 16 (per-vector chunks,
    k = 2), two regions in two segments."""
    from kvd.core import plan
    from kvd.core.local_copy import Side

    rw, rg = _fake_worker("HND", 32, 10, 1 << 40)
    sw, sg = _fake_worker("NHD", 16, 12, 1 << 41)
    sets = [plan.chunks(rg, sg, i) for i in range(2)]
    k, C = 2, len(sets[0]) // 2
    full_r = plan.local_rows(rw.mem.bases, rw.regions, 10, sets, k)
    full_s = plan.remote_rows(sw.mem.bases, sw.regions, 12, sets, k)
    addr, ln = Side.of(rw, sets, 1, k * C).rows(np.arange(len(full_r)))
    assert np.array_equal(addr, full_r[:, 0]) and np.array_equal(ln, full_r[:, 1])
    addr, ln = Side.of(sw, sets, 2, C).rows(np.arange(len(full_s)))
    assert np.array_equal(addr, full_s[:, 0]) and np.array_equal(ln, full_s[:, 1])
    # A region that would reach past its segment's mapping is refused.
    sw.mem.mappings[1].size -= 65
    with pytest.raises(Exception, match="outside the registered regions"):
        Side.of(sw, sets, 2, C)


@pytest.mark.parametrize("kinds", [("HND", "HND"), ("HND", "NHD")])
def test_a_small_loads_python_runs_equal_the_numpy_rows_merged(kinds):
    """CopyPlan.small_pieces (a small one-group load's pieces in Python) give
    what split_pieces makes of plan.chunk_indices' rows through Side.rows,
    row for row: whole blocks (HND to HND, one chunk) and per-vector chunks
    (HND reader, NHD source: C > 1), random block ids, consecutive runs."""
    import random

    from kvd.core import plan
    from kvd.core.local_copy import SMALL_COPY_ROWS, CopyPlan, Side

    rw, rg = _fake_worker(kinds[0], 16, 40, 1 << 40)
    sw, sg = _fake_worker(kinds[1], 16, 48, 1 << 41)
    sets = [plan.chunks(rg, sg, i) for i in range(2)]
    C = len(sets[0])
    cp = CopyPlan(rw, sw, 1, C, Side.of(rw, sets, 1, C), Side.of(sw, sets, 2, C),
                  tuple(int(c[:C, 3].sum()) for c in sets), (0, 0))
    rng = random.Random(len(kinds[1]) + C)
    checked = 0
    for _ in range(200):
        n = rng.randint(1, 12)
        if rng.random() < 0.5:
            start = rng.randint(0, 36 - n)
            local, remote = list(range(start, start + n)), list(range(start + 2, start + 2 + n))
        else:
            local, remote = rng.sample(range(40), n), rng.sample(range(48), n)
        piece = rng.choice([COPY_PIECE_BYTES, 256, 100, 37])  # pieces of one row, of several, rows cut
        got = cp.small_pieces([local], [remote], piece)
        if 2 * n * C > SMALL_COPY_ROWS:
            assert got is None
            continue
        lidx, ridx = plan.chunk_indices([local], [remote], 2, 40, 48, 1, C, [0, 0])
        dst, ln = cp.reader_side.rows(lidx)
        src, _ = cp.source_side.rows(ridx)
        want = [[(int(d), int(s), int(x)) for d, s, x in zip(*p)] for p in split_pieces(dst, src, ln, piece)]
        assert [list(zip(*p)) for p in got] == want
        checked += 1
    assert checked > 50


def test_same_node_copies_are_counted_in_the_metrics(tmp_path):
    """kvd_same_node_copies_total counts the loads the daemon copied itself;
    on the CPU none of them is a device copy, no copy kernel is loaded and
    the CUDA context is not lost (docs/OPERATIONS.md: what to watch)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from kvd.testing.util import free_port

    port = free_port()
    d = start_daemon(str(tmp_path), "kvd", "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    p = r = None
    try:
        p = Engine(d, "p-metrics", SHAPE, seed=11, memfd=True)
        r = Engine(d, "d-metrics", SHAPE, memfd=True)
        for i in range(2):
            p.hold(f"req-p{i}", REMOTE_IDS)
            r.load(f"req-d{i}", LOCAL_IDS, p, REMOTE_IDS, f"req-p{i}")
            assert event_kind(r.wait(f"req-d{i}")) == "recv_done"
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
        assert got["kvd_same_node_copies_total"] == 2
        assert got["kvd_same_node_vram_copies_total"] == 0
        assert got["kvd_copy_kernel_devices"] == 0 and got["kvd_cuda_context_lost"] == 0
    finally:
        for e in (p, r):
            if e is not None:
                e.close()
        assert d.stop() == 0
