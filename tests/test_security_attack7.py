"""Attacker scenarios, eleventh review: a hostile peer.

What docs/SECURITY.md promises ("What the attacker review found"): a peer's
description is checked before anything is sized by it; early notifications
(for requests not held here) cost the same whatever a peer sent before; a
flood of notifications neither holds the event loop nor grows the daemon's
memory without bound. Real daemons where the finding needs one; the
progress loop and the lease table in-process where the promise is a
property of theirs. The measurements before the fixes are in the docstrings.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from kvd.core.state import PROTOCOL_VERSION
from kvd.core import progress as progress_mod
from kvd.core.leases import LeaseTable
from kvd.core.progress import Progress
from kvd.testing.daemons import start_daemon
from kvd.testing.fakes import FakePeer
from kvd.testing.processes import child_env
from kvd.testing.sessions import Engine, KvShape, event_kind
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

SHAPE = KvShape(num_layers=2, num_blocks=16, block_len=4096)


def vm_kib(pid: int, field: str) -> int:
    """``field`` (``VmHWM``, ``VmRSS``) of process ``pid`` (KiB)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field}")


def describe(d, eng: Engine) -> pb.HandshakeResponse:
    """``eng``'s description as its daemon answers a handshake (its agent metadata too)."""
    ch = grpc.insecure_channel(d.peer_address)
    try:
        return pb_grpc.PeerServiceStub(ch).Handshake(pb.HandshakeRequest(
            engine_id=eng.engine_id, tp_rank=0, compat_hash=eng.registered.compat_hash, protocol_version=PROTOCOL_VERSION),
            timeout=10)
    finally:
        ch.close()


class LoopProbe:
    """GetStats every 50 ms from a thread: the worst latency (seconds) is how
    long the daemon's event loop was held."""

    def __init__(self, d):
        self.d, self.worst, self._stop = d, 0.0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        stub = self.d.stub()
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                stub.GetStats(pb.StatsRequest(), timeout=120)
            except grpc.RpcError:
                pass
            self.worst = max(self.worst, time.monotonic() - t0)
            time.sleep(0.05)

    def done(self) -> float:
        self._stop.set()
        self._t.join()
        return self.worst


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    d = start_daemon(str(tmp_path_factory.mktemp("a7")), "a7", "--handshake-timeout-s", "20",
                     "--same-node-copy", "false")
    p = Engine(d, "a7-prefill", SHAPE, seed=2)
    dec = Engine(d, "a7-decode", SHAPE)
    yield d, p, dec
    dec.close()
    p.close()
    assert d.stop() == 0


# ----------------------------------------------------- segment_index
@pytest.mark.parametrize("seg", [1 << 26, (1 << 32) - 1], ids=["2**26", "2**32-1"])
def test_a_handshake_answer_with_a_huge_segment_index_is_refused_before_anything_is_sized_by_it(pd, seg):
    """A peer's answer naming segment_index 2**26 made the reader build a
    list of 2**26 entries on its event loop (+512 MiB peak RSS, and the load
    went on); 2**28: +2 GiB and 6 s; 2**32-1: the load failed "internal:
    MemoryError". Now the load fails naming the field, nothing allocated."""
    d, p, dec = pd
    forged = pb.HandshakeResponse()
    forged.CopyFrom(describe(d, p))
    forged.regions[0].segment_index = seg
    fake = FakePeer(lambda request, context: forged)
    hwm0 = vm_kib(d.proc.pid, "VmRSS")
    try:
        rid = f"seg-{seg}"
        dec.load(rid, [1], None, [1], rid, remote_engine_id="forged-e", remote_address=fake.address,
                 timeout_s=60)
        ev = dec.wait(rid, 90)
    finally:
        fake.stop()
    assert event_kind(ev) == "load_failed", ev
    reason = ev.load_failed.reason
    assert reason.startswith("handshake:") and f"segment_index {seg} out of range" in reason, reason
    assert vm_kib(d.proc.pid, "VmHWM") - hwm0 < 64 << 10  # KiB
    assert d.proc.poll() is None and d.stats().daemon_version


def test_a_push_whose_reader_has_a_huge_segment_index_is_refused_naming_it(pd):
    """The same check on the source side (PushRequest.reader): segment_index
    2**32-1 answered UNKNOWN "Unexpected <class 'MemoryError'>", 2**26 held
    the loop 0.6 s and peaked +520 MiB. Now INVALID_ARGUMENT naming the field."""
    d, p, _ = pd
    p.hold("push-seg", [1])
    p.held("push-seg", [1])  # a Push waits for no hold
    reader = describe(d, p)
    ch = grpc.insecure_channel(d.peer_address)
    try:
        for seg in (1 << 26, (1 << 32) - 1):
            reader.regions[0].segment_index = seg
            hwm0 = vm_kib(d.proc.pid, "VmRSS")
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.PeerServiceStub(ch).Push(pb.PushRequest(
                    engine_id=p.engine_id, tp_rank=0, request_id="push-seg", source_groups=[pb.BlockIds(ids=[1])],
                    reader=reader, reader_tp_rank=0, reader_groups=[pb.BlockIds(ids=[5])],
                    expected_notifications=1, timeout_s=5), timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
            assert f"segment_index {seg} out of range" in e.value.details(), e.value.details()
            assert vm_kib(d.proc.pid, "VmHWM") - hwm0 < 64 << 10  # KiB
    finally:
        ch.close()
        p.release("push-seg")
    assert d.proc.poll() is None and d.stats().daemon_version


# ----------------------------------------------------- early notifications
def test_early_notifications_are_evicted_and_expired_at_a_constant_cost_each():
    """Once the table was full (65,536), each further notification evicted
    the oldest with ``next(iter(dict))``, which scans the slots freed at the
    dict's front: ~38 us each instead of ~1.7 (400k: 15.6 s of the event
    loop); expiring 65,536 at once took 2.7-3.2 s (quadratic). Timed in CPU
    seconds of this process, against filling the table: before, evicting
    was ~30x and expiring ~40x the fill; now about 1x and well under it.
    The order is unchanged: oldest deadline first, a second notification
    moves its request to the back."""
    n = 65536
    t = LeaseTable(early_s=120.0, max_early=n)
    t0 = time.process_time()
    for i in range(n):
        t.notify(f"fill-{i}", 1, now=0.0)
    fill = time.process_time() - t0
    t0 = time.process_time()
    for i in range(n):
        t.notify(f"more-{i}", 1, now=1.0)  # each evicts the oldest
    evict = time.process_time() - t0
    assert len(t.early) == n and next(iter(t.early)) == "more-0"
    t.notify("more-0", 2, now=2.0)  # moved to the back, counted twice
    assert next(iter(t.early)) == "more-1" and next(reversed(t.early)) == "more-0"
    t0 = time.process_time()
    t.expire(now=121.5)  # every first notification's deadline (121.0) has passed
    expire = time.process_time() - t0
    assert list(t.early) == ["more-0"] and t.early["more-0"][:2] == (2, 2)
    fill = max(fill, 0.02)  # a clock tick's worth at least
    assert evict < 4 * fill, (evict, fill)
    assert expire < 2 * fill, (expire, fill)


# ----------------------------------------------------- the progress loop's passes
def _offline_progress(batches):
    """A :class:`Progress` with its room stubbed: each poll returns the next
    of ``batches`` (lists of messages, all from one worker), then nothing;
    ``handled`` gets every message its holds are given."""
    handled = []
    w = SimpleNamespace(label="w0", inflight={})
    rt = SimpleNamespace(closing=False, registered=lambda w: True, quarantine=[], workers={},
                         kick=asyncio.Event(),
                         limits=SimpleNamespace(poll_busy_s=0.0005, poll_idle_s=0.005, detach_grace_s=10.0))

    def nixl(fn, *args):
        fut = asyncio.get_running_loop().create_future()  # answered a loop pass later, like the NIXL thread
        asyncio.get_running_loop().call_soon(lambda: fut.set_result(fn(*args)))
        return fut

    rt.nixl = nixl
    holds = SimpleNamespace(on_notif=lambda w, a, m: handled.append(m) or 1, expire=lambda now: None)  # 1 piece
    pull = SimpleNamespace(expire=lambda now: None)
    push = SimpleNamespace(complete=lambda writes: None, writes=[])
    prog = Progress(rt, None, None, holds, pull, push)
    pending = list(batches)

    def poll():
        return [], [(w, "hostile", "NOTIF", m) for m in (pending.pop(0) if pending else [])]

    prog.poll = poll
    return prog, handled


async def _run_passes(prog, handled, until):
    """Runs the loop until ``until()``; returns the most messages handled
    between two turns of another task (what one pass held the loop for)."""
    marks = []
    prog.start()
    try:
        deadline = time.monotonic() + 60
        while not until() and time.monotonic() < deadline:
            marks.append(len(handled))
            await asyncio.sleep(0)
        marks.append(len(handled))
    finally:
        await prog.stop()
    return max(b - a for a, b in zip(marks, marks[1:]))


def test_a_pass_of_the_progress_loop_handles_a_bounded_number_of_notifications():
    """Each poll took everything NIXL had queued and handled it in one pass:
    a hostile peer's 414k bare notifications in 10 s held a daemon's loop
    9.7 s. A burst of 60,000 at once is now handled whole, in passes of at
    most NOTIFS_PER_PASS (1,024) with the loop serving others in between."""
    msgs = [f"r-{i}:1".encode() for i in range(60000)]
    prog, handled = _offline_progress([msgs])
    most = asyncio.run(_run_passes(prog, handled, lambda: len(handled) == len(msgs)))
    assert handled == msgs  # in order, none dropped
    assert most <= 1024, most


def test_notifications_past_the_backlog_are_dropped_counted_and_logged_once(caplog):
    """Notifications NIXL returned wait for a pass in a backlog of at most
    MAX_BACKLOG (65,536) and MAX_BACKLOG_BYTES (16 MiB): 200,000 of 1,000
    bytes at once (a hostile flood; before, a 30 s one kept 1.6 GB of the
    daemon's memory and held its loop 22 s) keep at most 16 MiB, the rest
    dropped and counted, with one log line (throttled)."""
    msgs = [b"x" * 998 + b":1"] * 200000
    prog, handled = _offline_progress([msgs])
    peak = [0]
    real_handle = prog.handle_notifs

    def handle(limit):
        peak[0] = max(peak[0], prog._notif_bytes)
        return real_handle(limit)

    prog.handle_notifs = handle
    with caplog.at_level(logging.WARNING, logger="kvd.core"):
        most = asyncio.run(_run_passes(prog, handled,
                                       lambda: len(handled) + prog.notifs_dropped == len(msgs) and not prog._notifs))
    assert len(handled) + prog.notifs_dropped == len(msgs)
    assert len(handled) == progress_mod.MAX_BACKLOG_BYTES // 1000 and peak[0] <= progress_mod.MAX_BACKLOG_BYTES
    assert most <= progress_mod.NOTIFS_PER_PASS
    lines = [r.getMessage() for r in caplog.records if "notification from hostile dropped" in r.getMessage()]
    assert len(lines) == 1 and "at most 65536, 16777216 bytes" in lines[0], lines


def test_dropped_notifications_are_shown_by_getstats_status_and_metrics():
    """The drops past the backlog were counted in ``Progress.notifs_dropped``
    only, which no operator could read: a daemon's own Node now reports them
    in GetStats (``notifications_dropped``), ``kvd status`` (a line when
    nonzero, every field in --json) and Prometheus
    (``kvd_notifications_dropped_total``)."""
    from kvd.core.node import Node
    from kvd.daemon.metrics import Metrics
    from kvd.daemon.status import build_stats, render, to_dict

    async def main():
        node = Node()
        try:
            quiet = render(to_dict(build_stats(node)))
            w = SimpleNamespace(label="w0")
            for i in range(progress_mod.MAX_BACKLOG + 3):  # the backlog full, then 3 more
                node.progress._keep(w, "hostile", f"r-{i}:1".encode())
            return node.stats(), build_stats(node), Metrics(node.stats), quiet
        finally:
            await node.close()

    stats, resp, metrics, quiet = asyncio.run(main())
    assert stats["notifications_dropped"] == 3
    assert resp.notifications_dropped == 3 and to_dict(resp)["notifications_dropped"] == 3
    assert "dropped notifications" not in quiet  # none dropped: no line
    assert re.search(r"^dropped notifications +3 past the backlog", render(to_dict(resp)), re.M)
    assert metrics.registry.get_sample_value("kvd_notifications_dropped_total") == 3


def test_a_poll_drops_the_excess_as_a_count_before_the_event_loop_sees_it():
    """NIXL hands over every notification queued since the last poll; the
    event loop dropped the excess one by one (~1-2 us each), so a poll of a
    flood took as long as the flood was big and NIXL queued ever more
    meanwhile. Now :meth:`Progress.poll` (the NIXL thread) passes on only
    what fits the backlog and one ``"DROPPED"`` count per remote agent."""
    msgs = [b"x" * 998 + b":1"] * 200000
    w = SimpleNamespace(label="w0", inflight={}, pairs=SimpleNamespace(retired=[]),
                        agent=SimpleNamespace(notifs=lambda: {"hostile": msgs, "honest": [b"r-1:1"]}))
    rt = SimpleNamespace(workers={"w0": w}, zombies=[], warm_ups=None, release_zombies=lambda: None)
    prog = Progress(rt, None, None, None, None, SimpleNamespace(poll_writes=lambda now: []))
    prog._notifs.extend([(w, "early", b"y" * 1000)] * 100)  # waiting from the last poll
    prog._notif_bytes = 100 * 1000
    _, done = prog.poll()
    kept = [r[1] for r in done if r[2] == "NOTIF"]
    fit = (progress_mod.MAX_BACKLOG_BYTES - 100 * 1000) // 1000
    assert kept == ["hostile"] * fit + ["honest"]  # a short one still fits the bytes left
    assert [r[1:] for r in done if r[2] == "DROPPED"] == [("hostile", "DROPPED", len(msgs) - fit)]
    for r in done:  # as the loop does with them
        prog._keep(*r[:2], r[3]) if r[2] == "NOTIF" else prog._drop(*r[:2], r[3])
    assert prog.notifs_dropped == len(msgs) - fit
    assert prog._notif_bytes <= progress_mod.MAX_BACKLOG_BYTES


# ----------------------------------------------------- a real flood
# As fast as one Python process sends: NIXL's native genNotif, each id unique.
FLOOD = r"""
import os, sys, time
from kvd.core.leases import notif_message
from kvd.core.nixl_agent import NixlAgent
md = open(sys.argv[1], "rb").read(); secs = float(sys.argv[2])
at_least = int(sys.argv[3]) if len(sys.argv) > 3 else 0  # and this many, within 60 s: a busy machine sends slower
a = NixlAgent("a7-hostile")
name = a.add_remote(md); a.connect(name)
time.sleep(0.5)
native = a._agent.agent; gen = native.genNotif
n = 0; t0 = time.monotonic(); pre = os.urandom(500).hex()[:988]
while (time.monotonic() - t0 < secs or n < at_least) and time.monotonic() - t0 < 60:
    for i in range(n, n + 4096):
        gen(name, notif_message(f"{pre}{i:012d}", 1))
    n += 4096
    native.getNotifs({}, [])  # its own progress
print("SENT", n, flush=True)
time.sleep(2)
"""


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Sets the CPU affinity of each thread of ``pid`` (a process's own
    affinity call reaches only its main thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, OSError):
            pass  # ended meanwhile


def test_a_flood_of_bare_notifications_neither_holds_the_loop_nor_grows_memory_unbounded(pd, tmp_path):
    """A hostile peer that loaded a source worker's agent metadata (any
    handshake gives it) sends bare NIXL notifications with 1,000-byte ids of
    requests never held: before, 414k in 10 s held GetStats 9.7 s (14.5 s on
    this machine, busy) and grew RSS 100 -> 900 MB; 1.25M in 30 s: 22 s and
    1.6 GB, a honest load after it took 56 s. Now GetStats answers within
    ~0.1 s throughout (a 3 s bound here), the early table stays capped and
    honest loads run.

    Memory: what NIXL queues between two polls is the flood's rate times the
    time between polls (``kvd.core.progress``), so the bound holds only while
    a poll drains faster than the flood arrives. The daemon is held to one
    CPU for the flood and the sender left the others: the sender's rate
    against the daemon's, the ratio that matters, is then about the same on
    a slower or a faster machine. With the excess dropped on the event loop
    (before), this flood (2.2-2.3M sent in 10 s) grew RSS by 1.3-1.5 GiB here
    and held GetStats up to 6 s (unpinned, the older, slower sender: +2.3 GiB
    in CI with 2.5M sent); dropped by the poll, 1.2-3.4M sent: +129-192 MiB
    at peak, GetStats at most 0.14 s. What stays: the early table's 65,536
    ids (~90 MiB), the backlog (16 MiB) and what NIXL queued between polls."""
    d, p, dec = pd
    md = tmp_path / "md"
    md.write_bytes(describe(d, p).agent_metadata)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:
        pin_threads(d.proc.pid, {cpus[-1]})
    rss0 = vm_kib(d.proc.pid, "VmRSS")
    probe = LoopProbe(d)
    fl = subprocess.Popen([sys.executable, "-c", FLOOD, str(md), "10"], stdout=subprocess.PIPE, text=True,
                          env=child_env())
    peak, honest = rss0, []
    try:
        t0 = time.monotonic()
        while fl.poll() is None and time.monotonic() - t0 < 60:
            peak = max(peak, vm_kib(d.proc.pid, "VmRSS"))
            if time.monotonic() - t0 > 3 and len(honest) < 2:
                rid = f"honest-{len(honest)}"
                p.hold(rid, [3])
                dec.load(rid, [3], p, [3], rid, timeout_s=30)
                honest.append(event_kind(dec.wait(rid, 60)))
            time.sleep(0.2)
        out = fl.communicate(timeout=30)[0]
    finally:
        if fl.poll() is None:
            fl.kill()
            fl.wait()
        worst = probe.done()
        pin_threads(d.proc.pid, set(cpus))
    sent = int(re.search(r"SENT (\d+)", out).group(1))
    print(f"{sent} notifications: GetStats worst {worst:.3f} s, RSS +{(peak - rss0) >> 10} MiB at peak, "
          f"{d.stats().notifications_dropped} dropped")
    assert sent > 65536, out  # past the early table's cap: each further one evicts
    assert honest == ["recv_done", "recv_done"], honest
    # ~0.1 s measured; the bound leaves room for a machine loaded by others
    # (load 18 on 2 cores once made it 1.5 s), before: 12 s
    assert worst < 3.0, f"GetStats held {worst:.2f} s by {sent} notifications"
    assert d.stats().early_notifications <= 65536
    # KiB: the early table's 65,536 ids, the backlog, NIXL's queue between two polls. Measured
    # +129-192 MiB, once +378 MiB (a fresh clone's full run, 1.8M sent); the excess dropped on the
    # event loop instead: +1.3-1.5 GiB pinned, +2.3 GiB unpinned in CI. The bound tells the two apart.
    assert peak - rss0 < 768 << 10, (rss0, peak)


def test_early_notifications_are_bounded_per_daemon_and_a_flood_evicts_its_own_past_a_fair_share():
    """Early notifications were capped per worker only (65,536 each): an
    admitted peer's flood grew with the workers registered (attacker review:
    4 workers, +327 MiB held 120 s). Now :class:`EarlyBudget` counts every
    table of a daemon against one limit; a table taking one more while it is
    spent evicts its own oldest past its fair share, else the fullest
    table's, so a flood at one worker leaves another a fair share; holds,
    expiry and unregistration give back."""
    from kvd.core.leases import EarlyBudget

    budget = EarlyBudget(limit=100)
    a, b, c = (LeaseTable(early_s=10.0, budget=budget) for _ in range(3))
    for i in range(30):
        b.notify(f"b{i}", 1, now=0.0)
    for i in range(1000):
        a.notify(f"a{i}", 1, now=1.0)  # the flood
    assert budget.used == len(a.early) + len(b.early) == 100
    assert len(b.early) == 30 and len(a.early) == 70 and next(iter(a.early)) == "a930"
    c.notify("c0", 1, now=2.0)  # evicts the flood's oldest, not b's
    assert len(b.early) == 30 and len(a.early) == 69 and "c0" in c.early and budget.used == 100
    assert c.hold("c0", [[1]], 100.0, now=2.5) == "done"  # taken by its hold: given back
    assert budget.used == 99 and not c.early
    b.expire(now=10.5)  # b's deadlines (10.0) passed; a's (11.0) not
    assert not b.early and budget.used == 69
    a.clear()  # its worker unregistered
    assert budget.used == 0 and id(a) not in budget.tables and id(b) in budget.tables
    # A worker that held more than its share before a flood at another keeps its share (limit / tables).
    budget = EarlyBudget(limit=100)
    a, b = (LeaseTable(early_s=10.0, budget=budget) for _ in range(2))
    for i in range(80):
        b.notify(f"b{i}", 1, now=0.0)
    for i in range(1000):
        a.notify(f"a{i}", 1, now=1.0)
    assert len(a.early) == len(b.early) == 50 and budget.used == 100 and next(iter(b.early)) == "b30"


def test_a_flood_at_two_workers_keeps_the_daemons_early_notifications_within_one_bound(pd, tmp_path):
    """The real daemon: two workers' agents flooded at once with bare
    notifications of requests never held, past the bound each. Before, each
    kept 65,536 (131,072 in all); now the daemon keeps at most
    ``BOUNDS.max_early_notifications`` together, and serves a load after."""
    from kvd.core.limits import BOUNDS

    d, p, dec = pd
    floods = []
    for eng in (p, dec):
        md = tmp_path / f"md-{eng.engine_id}"
        md.write_bytes(describe(d, eng).agent_metadata)
        # 4 s, and past the bound each, however slow a busy machine makes the sender (53,248 in 4 s once)
        floods.append(subprocess.Popen([sys.executable, "-c", FLOOD, str(md), "4",
                                        str(BOUNDS.max_early_notifications + 8192)], stdout=subprocess.PIPE,
                                       text=True, env=child_env()))
    try:
        sent = [int(re.search(r"SENT (\d+)", f.communicate(timeout=90)[0]).group(1)) for f in floods]
    finally:
        for f in floods:
            if f.poll() is None:
                f.kill()
                f.wait()
    kept = d.stats().early_notifications
    print(f"sent {sent}, kept {kept}")
    assert min(sent) > BOUNDS.max_early_notifications, sent  # each alone would fill a per-worker table
    assert 0 < kept <= BOUNDS.max_early_notifications, kept
    p.hold("after-two-floods", [4])
    dec.load("after-two-floods", [4], p, [4], "after-two-floods", timeout_s=30)
    assert event_kind(dec.wait("after-two-floods", 60)) == "recv_done"


ODD = r"""
import sys, time
from kvd.core.leases import notif_message
from kvd.core.nixl_agent import NixlAgent
md = open(sys.argv[1], "rb").read()
a = NixlAgent("a7-odd")
name = a.add_remote(md); a.connect(name)
time.sleep(0.5)
native = a._agent.agent
piece = "odd-none:\u00b2".encode()  # "\u00b2".isdigit() is true; int() of it raises
native.genNotif(name, len(piece).to_bytes(2, "big") + piece)
native.genNotif(name, notif_message("odd-held", 1) + notif_message("odd-never-held", 1))
for _ in range(40):
    native.getNotifs({}, [])  # its own progress
    time.sleep(0.05)
print("SENT", flush=True)
"""


def test_a_notification_whose_count_is_not_ascii_digits_is_ignored_and_the_daemon_keeps_going(pd, tmp_path):
    """A notification's count was checked with ``str.isdigit``, true for
    "\u00b2" ("2" superscript), and then read with ``int()``, which raises
    on it: one such notification from a peer that loaded a worker's agent
    metadata (any handshake gives it) raised out of the progress loop,
    which then stopped for good (no READ polled, no lease or load past its
    deadline ended). Now it is malformed, ignored with a throttled line,
    and a notification of two pieces after it ends the held lease it names."""
    d, p, dec = pd
    md = tmp_path / "md"
    md.write_bytes(describe(d, p).agent_metadata)
    p.hold("odd-held", [6])
    out = subprocess.run([sys.executable, "-c", ODD, str(md)], capture_output=True, text=True, timeout=120,
                         env=child_env())
    assert "SENT" in out.stdout, out.stderr[-2000:]
    ev = p.wait("odd-held", 30)
    assert ev.WhichOneof("event") == "send_done" and not ev.send_done.expired, ev
    p.hold("odd-after", [7])
    dec.load("odd-after", [7], p, [7], "odd-after", timeout_s=30)
    assert event_kind(dec.wait("odd-after", 60)) == "recv_done"
    assert "malformed notification from" in d.log()
