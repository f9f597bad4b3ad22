"""Authority: no engine reads another's KV cache, and engine ids belong to
the user that registered them (docs/SECURITY.md, "Who may read what").

Each scenario runs a real daemon as root that admits two unprivileged uids
through ``allowed_uids``; the hostile user's calls run in a child process
that has become that user. Every scenario ends with the daemon still serving.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from kvd.client.engine_client import EngineClient
from kvd.testing.daemons import start_daemon
from kvd.testing.processes import child_env
from kvd.testing.security import NOBODY, reachable_dir
from kvd.testing.sessions import MESSAGE_OPTIONS, Engine, KvShape, event_kind, one_group, register_request
from kvd.testing.shm import ShmSegment
from kvd.testing.util import wait_until
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

MALLORY = 65533   # admitted by allowed_uids; reaches the socket through group nogroup
ALICE = 65531     # admitted too: another user's engines
SHAPE = KvShape(num_layers=1, num_blocks=8, block_len=1024)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run callers as other users")

# Runs as root up to the imports and the channel, then becomes ``uid`` (gid
# nogroup) and plays one engine: makes its own 0600 segment, registers
# ``engine_id`` with the test's shape and model, opens its session with its
# token, then runs ``steps`` (a JSON list). Prints one JSON line.
_AS_ENGINE = r"""
import json, os, sys, time, uuid
import grpc
import numpy as np
from kvd.v1 import kvd_pb2 as pb, kvd_pb2_grpc as pb_grpc
from kvd.testing.sessions import KvShape, one_group, register_request, MESSAGE_OPTIONS
sock, uid, spec, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
engine_id, rank, size = (spec.split(":") + ["0", "1"])[:3]
rank, size = int(rank), int(size)
ch = grpc.insecure_channel(f"unix:{sock}", options=MESSAGE_OPTIONS)
stub = pb_grpc.EngineServiceStub(ch)
shape = KvShape(num_layers=1, num_blocks=8, block_len=1024)
os.setgroups([]); os.setgid(65534); os.setuid(uid)
out = {"steps": []}
name = f"/kvdtest_{os.getpid()}_{uuid.uuid4().hex[:8]}"
fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, shape.size)
import mmap
mm = mmap.mmap(fd, shape.size)
os.close(fd)
class Seg: pass
seg = Seg(); seg.name = name; seg.size = shape.size
token = ""
try:
    try:
        r = stub.RegisterEngine(register_request(engine_id, shape, seg, rank=rank, size=size), timeout=30)
        token = r.session_token
        out["register"] = "OK"
    except grpc.RpcError as e:
        out["register"] = e.code().name; out["register_details"] = e.details()
    for step in steps:
        kind = step["do"]
        if kind == "stats":
            s = stub.GetStats(pb.StatsRequest(), timeout=10)
            out["steps"].append({"engines": sorted(w.engine_id for w in s.workers),
                                 "hashes": sorted(w.compat_hash for w in s.workers)})
        elif kind == "load":
            cmds = [pb.SessionCommand(open=pb.OpenSession(worker=pb.EngineWorker(engine_id=engine_id),
                                                          session_token=token)),
                    pb.SessionCommand(load=pb.LoadBlocks(
                        request_id="steal", local_groups=one_group(step["local"]),
                        remote_engine_id=step["engine"], remote_address=step["address"],
                        remote_groups=one_group(step["remote"]), remote_request_id=step["rid"],
                        remote_tp_size=1, timeout_s=10))]
            import queue, threading
            q = queue.Queue()
            gen_done = threading.Event()
            def gen():
                yield from cmds
                gen_done.wait(60)
            call = stub.Session(gen(), timeout=60)
            res = {}
            for ev in call:
                k = ev.WhichOneof("event")
                if k == "opened":
                    continue
                res = {"event": k, "reason": getattr(ev, k).reason if k in ("load_failed", "rejected") else ""}
                break
            gen_done.set(); call.cancel()
            res["nonzero"] = int(np.count_nonzero(np.frombuffer(mm, dtype=np.uint8)))
            out["steps"].append(res)
        elif kind == "unregister":
            try:
                stub.UnregisterEngine(pb.UnregisterEngineRequest(worker=pb.EngineWorker(engine_id=step["engine"]),
                                                                 session_token=step.get("token", "")), timeout=10)
                out["steps"].append({"code": "OK"})
            except grpc.RpcError as e:
                out["steps"].append({"code": e.code().name, "details": e.details()})
    if out.get("register") == "OK":
        try:
            stub.UnregisterEngine(pb.UnregisterEngineRequest(
                worker=pb.EngineWorker(engine_id=engine_id, tp_rank=rank), session_token=token), timeout=10)
        except grpc.RpcError:
            pass
finally:
    mm.close()
    os.unlink("/dev/shm" + name)
print(json.dumps(out), flush=True)
"""


def as_engine(socket_path: str, uid: int, engine_id: str, steps: list[dict]) -> dict:
    """Plays engine ``engine_id`` (``"id"`` or ``"id:rank:tp_size"``) as
    ``uid`` in a fresh process (see ``_AS_ENGINE``)."""
    r = subprocess.run([sys.executable, "-c", _AS_ENGINE, socket_path, str(uid), engine_id, json.dumps(steps)],
                       capture_output=True, text=True, timeout=120, env=child_env())
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    assert lines, f"engine {engine_id} as uid {uid} printed nothing (rc {r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def daemon():
    d = start_daemon(reachable_dir(), "kvd", "--engine-socket-group", str(NOBODY),
                     "--allowed-uids", f"{MALLORY},{ALICE}")
    yield d
    assert d.stop() == 0


def _still_serving(d) -> None:
    assert d.proc.poll() is None and d.stats().daemon_version


def test_a_user_cannot_read_another_engines_blocks_through_its_own_daemon(daemon):
    """Cross-user KV read: Mallory names the victim's engine and this very
    daemon's peer address; without the victim's hold on those blocks for
    that request, no READ runs and Mallory's memory stays zero."""
    victim = Engine(daemon, "victim", SHAPE, seed=7)
    try:
        victim.hold("real-request", [1, 2])  # a live lease, but for another request
        assert victim.quiet("real-request", 0.2)
        out = as_engine(daemon.socket, MALLORY, "mallory", [
            {"do": "stats"},
            {"do": "load", "engine": "victim", "address": daemon.peer_address, "local": [0, 1, 2, 3],
             "remote": [0, 1, 2, 3], "rid": "guess"},
            {"do": "load", "engine": "victim", "address": daemon.peer_address, "local": [0, 1, 2],
             "remote": [1, 2, 3], "rid": "real-request"},  # the right request, one block too many
        ])
        assert out["register"] == "OK", out
        stats, guess, superset = out["steps"]
        # GetStats shows Mallory her own worker only: no engine id, no hash of the victim's.
        assert stats["engines"] == ["mallory"], stats
        for attempt in (guess, superset):
            assert attempt["event"] == "load_failed" and attempt["reason"].startswith("not_held:"), attempt
            assert attempt["nonzero"] == 0, attempt
        # The victim's lease is untouched and its owner still sees everything.
        assert {w.engine_id for w in daemon.stats().workers} == {"victim"}
        assert daemon.stats().workers[0].active_leases == 1
    finally:
        victim.close()
    _still_serving(daemon)


def test_a_held_request_is_read_as_before(daemon):
    """The rule does not stop a real P/D pair: a hold, then the load of a
    subset of its blocks (a decode-side prefix hit), moves the bytes."""
    p = Engine(daemon, "p", SHAPE, seed=3)
    d = Engine(daemon, "d", SHAPE)
    try:
        p.hold("r", [1, 2, 3])
        d.load("dr", [4, 5], p, [2, 3], "r")
        assert event_kind(d.wait("dr")) == "recv_done"
        assert d.same_blocks([4, 5], p, [2, 3])
        assert p.wait("r").send_done.request_id == "r"
    finally:
        d.close()
        p.close()


def test_across_daemons_the_reader_claims_the_hold_before_it_reads(daemon, tmp_path):
    """The reader's daemon asks the source's daemon (PeerService.Claim)
    before any READ: no hold there, no READ, and a hold that arrives while
    the claim waits is honoured."""
    other = start_daemon(str(tmp_path), "reader")
    src = Engine(daemon, "src", SHAPE, seed=11)
    dst = Engine(other, "dst", SHAPE)
    try:
        dst.load("x", [1, 2], src, [1, 2], "nobody-held-this", timeout_s=10)
        ev = dst.wait("x")
        assert event_kind(ev) == "load_failed" and ev.load_failed.reason.startswith("not_held:"), ev
        assert not dst.kv[:, [1, 2]].any()
        # The hold may reach the source's daemon after the reader's claim.
        dst.load("y", [3], src, [5], "late-hold", timeout_s=10)
        src.hold("late-hold", [5, 6])
        assert event_kind(dst.wait("y")) == "recv_done"
        assert dst.same_blocks([3], src, [5])
    finally:
        dst.close()
        src.close()
        assert other.stop() == 0
    _still_serving(daemon)


def test_an_engine_id_belongs_to_the_uid_that_registered_it(daemon):
    """Engine-id squatting: while root's engine "owned" has rank 0
    registered, another user can neither take that rank (ALREADY_EXISTS) nor
    add a rank of that id (PERMISSION_DENIED), nor drop it; the owner's
    engine goes on."""
    owner = Engine(daemon, "owned", SHAPE, tp_size=2)
    try:
        taken = as_engine(daemon.socket, MALLORY, "owned:0:2", [])
        assert taken["register"] == "ALREADY_EXISTS" and "by uid 0" in taken["register_details"], taken
        other_rank = as_engine(daemon.socket, MALLORY, "owned:1:2", [{"do": "unregister", "engine": "owned"}])
        assert other_rank["register"] == "PERMISSION_DENIED", other_rank
        assert "belongs to uid 0" in other_rank["register_details"], other_rank
        assert other_rank["steps"][0]["code"] == "PERMISSION_DENIED", other_rank
        # The owner's own second rank is welcome.
        rank1 = Engine(daemon, "owned", SHAPE, rank=1, tp_size=2, open_session=False)
        rank1.close()
        owner.hold("still-mine", [1])
        owner.release("still-mine")
        assert owner.wait("still-mine").send_done.released
    finally:
        owner.close()
    # Once every rank is gone, the id is free for whoever registers next.
    assert as_engine(daemon.socket, MALLORY, "owned:1:2", [])["register"] == "OK"
    _still_serving(daemon)


def test_the_engine_client_sends_its_session_token(tmp_path):
    """With require_session_token, the shipped EngineClient opens its session
    and unregisters: it sends the token RegisterEngine returned."""
    d = start_daemon(str(tmp_path), "strict", "--require-session-token", "true")
    seg = ShmSegment(SHAPE.size)
    client = EngineClient(d.socket)
    try:
        r = client.register(register_request("strict-engine", SHAPE, seg), timeout_s=10)
        assert len(r.session_token) == 32
        client.start_session()
        assert client.wait_opened(10), d.log_tail()
        assert client.unregister().released_leases == 0
        assert d.stats().engines == 0
    finally:
        client.close()
        seg.close()
        assert d.stop() == 0


def test_a_stale_session_never_drives_the_worker_registered_again_under_its_key(daemon):
    """Unregister and register the same key while the old session stays
    open: the old session's commands are refused (its worker's NIXL state is
    freed), the new registration serves, the daemon goes on."""
    src = Engine(daemon, "stale-src", SHAPE, seed=5)
    old = Engine(daemon, "stale", SHAPE)
    new = None
    try:
        daemon.stub().UnregisterEngine(pb.UnregisterEngineRequest(worker=pb.EngineWorker(engine_id="stale")),
                                       timeout=10)
        new = Engine(daemon, "stale", SHAPE, open_session=False)
        src.hold("h", [1, 2])
        old.load("via-old", [1, 2], src, [1, 2], "h", timeout_s=10)
        ev = old.wait("")  # refused before it names a request: the stream then ends
        assert event_kind(ev) == "rejected" and "unregistered" in ev.rejected.reason, ev
        assert not old.kv[:, [1, 2]].any()
        old.hold("via-old-hold", [3])
        assert old.quiet("via-old-hold", 0.5)
        stats = {w.engine_id: w for w in daemon.stats().workers}
        assert stats["stale"].active_leases == 0 and stats["stale-src"].active_leases == 1
    finally:
        old.close(unregister=False)
        if new is not None:
            new.close()
        src.close()
    _still_serving(daemon)


BIG = KvShape(num_layers=1, num_blocks=32, block_len=4 << 20)  # 2 regions x 32 blocks x 4 MiB: 256 MiB


def test_no_read_lands_after_its_session_ended(daemon):
    """A load's READ is running when its session ends (the shim half-closes
    the stream): the stream is closed only once that READ can no longer
    land, so the blocks the shim then reports failed never change after."""
    src = Engine(daemon, "big-src", BIG, seed=9)
    dst = Engine(daemon, "big-dst", BIG, open_session=False)
    ch = grpc.insecure_channel(f"unix:{daemon.socket}", options=MESSAGE_OPTIONS)
    try:
        ids = list(range(BIG.num_blocks))
        src.hold("big", ids)
        out: queue.Queue = queue.Queue()
        out.put(pb.SessionCommand(open=pb.OpenSession(worker=pb.EngineWorker(engine_id="big-dst"))))
        out.put(pb.SessionCommand(load=pb.LoadBlocks(
            request_id="big", local_groups=one_group(ids), remote_engine_id="big-src",
            remote_address=daemon.peer_address, remote_groups=one_group(ids), remote_request_id="big",
            remote_tp_size=1, timeout_s=30)))

        def gen():
            while (c := out.get()) is not None:
                yield c

        call = pb_grpc.EngineServiceStub(ch).Session(gen(), timeout=60)
        ended = threading.Event()
        snapshot = {}

        def read():
            try:
                for _ in call:
                    pass
            except grpc.RpcError:
                pass
            snapshot["at_end"] = np.array(dst.kv, copy=True)  # what the shim would report failed
            ended.set()

        threading.Thread(target=read, daemon=True).start()
        # Half-close once the READ is landing (its first bytes are there).
        deadline = time.monotonic() + 20
        while not dst.kv[0, 0].any():
            assert time.monotonic() < deadline, "the READ never started"
            time.sleep(0.0005)
        out.put(None)
        assert ended.wait(40)
        time.sleep(0.5)
        assert np.array_equal(snapshot["at_end"], dst.kv), "bytes landed after the session ended"
    finally:
        ch.close()
        dst.close()
        src.close()
    _still_serving(daemon)


def test_a_session_that_never_reads_is_dropped_past_its_queued_event_bytes(tmp_path):
    """Memory DoS through events: a session that never reads its stream sends
    LoadBlocks of 100,000 bad block ids, again and again; each LoadFailed
    names them all. Once gRPC's buffers are full, events queue in the
    daemon; past max_queued_event_bytes it ends the stream
    (RESOURCE_EXHAUSTED, logged) and drops them, instead of growing."""
    d = start_daemon(str(tmp_path), "events", "--max-queued-event-bytes", str(1 << 20))
    eng = Engine(d, "deaf", SHAPE, open_session=False)
    ch = grpc.insecure_channel(f"unix:{d.socket}", options=MESSAGE_OPTIONS)
    dropped = threading.Event()
    try:
        bad = list(range(1000, 101000))  # out of range: each load fails at once, naming all 100,000

        def commands():
            yield pb.SessionCommand(open=pb.OpenSession(worker=pb.EngineWorker(engine_id="deaf")))
            for i in range(2000):
                if dropped.is_set():
                    break
                yield pb.SessionCommand(load=pb.LoadBlocks(
                    request_id=f"r{i}", local_groups=one_group(bad), remote_engine_id="x",
                    remote_address="127.0.0.1:1", remote_groups=one_group([1]), remote_request_id="x"))
            dropped.wait(120)

        call = pb_grpc.EngineServiceStub(ch).Session(commands(), timeout=180)
        # Read nothing until the daemon has dropped the session.
        deadline = time.monotonic() + 150
        while "more than max_queued_event_bytes" not in d.log():
            assert time.monotonic() < deadline and d.proc.poll() is None, d.log_tail()
            time.sleep(0.2)
        dropped.set()
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:
                pass
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
        assert "max_queued_event_bytes" in e.value.details()
        # Dropped with the stream (a load still failing meanwhile may queue one more).
        assert d.stats().pending_events <= 2
        # The engine may open a new session; the daemon serves on.
        eng.session = None
        from kvd.testing.sessions import Session

        s2 = Session(d, "deaf")
        s2.close()
    finally:
        dropped.set()
        ch.close()
        eng.close()
        assert d.stop() == 0


# ------------------------------------------------------------ bounded tables
def test_hold_and_release_pairs_leave_no_lease_heap_behind(daemon):
    """15,000 hold + release pairs (and renewals) of hour-long leases on a real
    daemon: the lease table's heap stays near the live leases (before, each
    pair left an entry for the lease's full hour: +16 MiB RSS per 15,000)."""
    from kvd.testing.util import rss_kib

    p = Engine(daemon, "churn", SHAPE)
    try:
        rss0 = rss_kib(daemon.proc.pid)
        n = 15000
        for i in range(n):
            p.hold(f"c{i}", [i % SHAPE.num_blocks], lease_s=3600)
            p.hold(f"c{i}", [i % SHAPE.num_blocks], lease_s=3600)  # a renewal
            p.release(f"c{i}")
        assert p.wait(f"c{n - 1}", 120).send_done.released
        grown = rss_kib(daemon.proc.pid) - rss0
        # Measured here: +0.9 MiB with compaction, +6 MiB without.
        assert grown < 3 << 10, f"RSS grew {grown} KiB"
        assert daemon.stats().workers[0].active_leases == 0
        p.hold("after", [1])
        p.release("after")
        assert p.wait("after").send_done.released
    finally:
        p.close()
    _still_serving(daemon)


def test_the_lease_heap_is_compacted_when_dead_entries_dominate():
    from kvd.core.leases import LeaseTable

    t = LeaseTable()
    t.hold("live", [[1]], 100.0, 0.0)
    for i in range(10000):
        t.hold(f"r{i}", [[2]], 3600.0, 0.0)
        t.hold(f"r{i}", [[2]], 3601.0, 0.0)  # renewed: the first entry is stale
        t.release(f"r{i}")
    assert len(t._heap) <= 2 * len(t.leases) + 65
    assert t.expire(99.0) == [] and t.expire(100.0) == ["live"]


def test_expiring_early_notifications_looks_only_at_the_expired_ones():
    """65,536 early notifications (aimed at requests never held here): an
    expiry round with none due reads one entry, not all of them (before,
    every poll scanned the whole table: 10 % -> 55 % of a core idle)."""
    from collections import OrderedDict

    from kvd.core.leases import LeaseTable

    class Counting(OrderedDict):
        read = 0

        def __iter__(self):
            for k in super().__iter__():
                Counting.read += 1
                yield k

    t = LeaseTable(early_s=120.0)
    t.early = Counting()
    for i in range(65536):
        t.notify(f"e{i}", 1, now=float(i) / 1000)
    t.notify("e0", 2, now=70.0)  # a second notification moves e0 to the back (deadline 190)
    Counting.read = 0
    assert t.expire(now=100.0) == [] and len(t.early) == 65536
    assert Counting.read <= 1
    t.expire(now=120.0 + 65535 / 1000)  # every first notification's deadline has passed
    assert list(t.early) == ["e0"] and t.early["e0"][0] == 2
    assert len(t.early) <= t.max_early


def test_workers_descriptors_and_aborts_are_capped_per_uid_and_overall(tmp_path):
    """No caps on workers: 100 registrations once made 101 NIXL threads and
    1,500 fds. Past max_workers_per_uid / max_workers / max_descriptors a
    registration is refused RESOURCE_EXHAUSTED naming the key; AbortLoads
    past max_aborts are rejected; the daemon serves on."""
    from kvd.testing.fakes import blackhole

    d = start_daemon(reachable_dir(), "caps", "--engine-socket-group", str(NOBODY), "--allowed-uids",
                     str(MALLORY), "--max-workers", "3", "--max-workers-per-uid", "2",
                     "--max-descriptors", str(4 * SHAPE.num_regions * SHAPE.num_blocks), "--max-aborts", "2",
                     "--handshake-timeout-s", "3")
    engines = []
    try:
        engines += [Engine(d, "root-1", SHAPE), Engine(d, "root-2", SHAPE)]
        with pytest.raises(grpc.RpcError) as e:
            Engine(d, "root-3", SHAPE)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_workers_per_uid" in e.value.details()
        # Another uid still has room under the overall cap, once.
        assert as_engine(d.socket, MALLORY, "mallory-1", [])["register"] == "OK"
        big = KvShape(num_layers=3, num_blocks=8, block_len=1024)  # 48 descriptors: 32 + 48 > 64
        with pytest.raises(grpc.RpcError) as e:
            Engine(d, "root-big", big)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "more than max_descriptors 64" in e.value.details(), e.value.details()
        # Aborts against a peer that never answers: two run, the rest are rejected.
        with blackhole() as hung:
            a = engines[0]
            for i in range(5):
                a.session.send(abort_load=pb.AbortLoad(request_id=f"ab{i}", remote_engine_id="p",
                                                       remote_address=hung, remote_request_id=f"ab{i}",
                                                       remote_tp_size=1))
            rejected = [a.wait(f"ab{i}", 10) for i in range(2, 5)]
            assert all("max_aborts" in ev.rejected.reason for ev in rejected), rejected
            assert a.quiet("ab0", 0.2) and a.quiet("ab1", 0.0)
        assert d.stats().engines == 2
    finally:
        for e_ in engines:
            e_.close()
        _still_serving(d)
        assert d.stop() == 0


def test_empty_loads_take_the_same_abort_slots_as_abort_loads(tmp_path):
    """A LoadBlocks with no remote block ids but a remote request and
    address is done at once (RecvDone) and tells the source to free: that
    notification may wait a handshake timeout, as an AbortLoad's. It once
    ran outside the max_aborts caps (8 such loads opened 8 handshake
    connections where 8 AbortLoads opened 2). Now the loads take the same
    slots: with max_aborts_per_uid 2, five such loads to a peer that never
    answers are all answered RecvDone, two notifications are in flight, and
    an AbortLoad meanwhile is rejected naming the cap; once the handshakes
    time out the slots are free again."""
    from kvd.testing.fakes import blackhole

    d = start_daemon(str(tmp_path), "empty-loads", "--max-aborts-per-uid", "2", "--handshake-timeout-s", "5")
    a = None
    try:
        a = Engine(d, "d-empty", SHAPE)
        with blackhole() as hung:
            for i in range(5):
                a.session.send(load=pb.LoadBlocks(request_id=f"e{i}", local_groups=[pb.BlockIds(ids=[1])],
                                                  remote_engine_id="p", remote_address=hung,
                                                  remote_request_id=f"pe{i}", remote_tp_size=1))
            for i in range(5):
                assert event_kind(a.wait(f"e{i}", 10)) == "recv_done"
            a.session.send(abort_load=pb.AbortLoad(request_id="ab", remote_engine_id="p", remote_address=hung,
                                                   remote_request_id="pab", remote_tp_size=1))
            ev = a.wait("ab", 10)
            assert event_kind(ev) == "rejected" and "max_aborts_per_uid 2" in ev.rejected.reason, ev
            assert "2 aborts in flight" in ev.rejected.reason, ev
            # The two handshakes time out (5 s): the slots come back.
            deadline = time.monotonic() + 30
            while True:
                a.session.send(abort_load=pb.AbortLoad(request_id="again", remote_engine_id="p",
                                                       remote_address=hung, remote_request_id="pagain",
                                                       remote_tp_size=1))
                if a.quiet("again", 0.5):
                    break
                assert event_kind(a.wait("again", 1)) == "rejected"
                assert time.monotonic() < deadline, "the abort slots never came back"
    finally:
        if a is not None:
            a.close()
        _still_serving(d)
        assert d.stop() == 0


def test_the_daemon_never_unlinks_an_object_it_did_not_map(tmp_path):
    """A registration claims a dead owner_pid, then unlinks its own segment
    name; another user makes an object of that name. When the daemon drops
    the engine (its process gone), it leaves that object alone: it unlinks
    only the object it mapped."""
    d = start_daemon(str(tmp_path), "unlink", "--detach-grace-s", "1")
    seg = ShmSegment(SHAPE.size)
    planted = None
    try:
        dead = subprocess.Popen(["true"])
        dead.wait()
        req = register_request("liar", SHAPE, seg)
        req.owner_pid = dead.pid
        d.stub().RegisterEngine(req, timeout=30)
        os.unlink(seg.path)
        fd = os.open(seg.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.write(fd, b"alice's")
        os.fchown(fd, ALICE, ALICE)
        os.close(fd)
        planted = seg.path
        deadline = time.monotonic() + 30
        while d.stats().engines:
            assert time.monotonic() < deadline, d.log_tail()
            time.sleep(0.1)
        assert os.path.exists(planted), "the daemon unlinked an object it never mapped"
        with open(planted, "rb") as f:
            assert f.read(7) == b"alice's"
        assert "unlinked 0 of its 1 segment(s)" in d.log()
    finally:
        if planted and os.path.exists(planted):
            os.unlink(planted)
        seg.close()
        assert d.stop() == 0


def test_handshakes_in_flight_are_capped_per_uid(tmp_path):
    """A load handshakes with every remote rank it names (one per local
    worker and rank), and a handshake runs on to handshake_timeout_s after
    its load failed at its own deadline: an engine naming a remote TP size of
    256 and a new engine id per load had 5,120 in flight from 20 loads
    (attacker review). With max_handshakes_per_uid 2, two loads' handshakes
    to a peer that never answers are in flight; the next loads fail at once,
    HANDSHAKE naming the key; once those two end, handshakes start again."""
    from kvd.testing.fakes import blackhole

    d = start_daemon(str(tmp_path), "hs-cap", "--max-handshakes-per-uid", "2", "--handshake-timeout-s", "5")
    a = None
    try:
        a = Engine(d, "d-hs", SHAPE)
        with blackhole() as hung:
            def load(rid: str) -> None:
                a.session.send(load=pb.LoadBlocks(request_id=rid, local_groups=[pb.BlockIds(ids=[1])],
                                                  remote_engine_id=f"p-{rid}", remote_address=hung,
                                                  remote_groups=[pb.BlockIds(ids=[1])], remote_request_id=rid,
                                                  remote_tp_size=1, timeout_s=30))

            for i in range(5):
                load(f"h{i}")
            for i in (2, 3, 4):
                ev = a.wait(f"h{i}", 10)
                assert event_kind(ev) == "load_failed", ev
                assert "max_handshakes_per_uid 2" in ev.load_failed.reason, ev
                assert "2 handshakes in flight" in ev.load_failed.reason, ev
            assert a.quiet("h0", 0.5) and a.quiet("h1", 0.0)  # their handshakes wait on
            for i in (0, 1):  # the handshake timeout (5 s) ends them
                assert "max_handshakes" not in a.wait(f"h{i}", 30).load_failed.reason
            load("again")
            assert a.quiet("again", 1.0), "a handshake starts again once the others ended"
    finally:
        if a is not None:
            a.close()
        _still_serving(d)
        assert d.stop() == 0


def test_block_ids_of_loads_in_flight_are_capped_per_worker_and_per_uid(tmp_path):
    """A load keeps its block ids while it waits (a handshake with a peer
    that never answers: up to handshake_timeout_s, twice), and
    max_inflight_per_worker counts loads: loads of 1M local and 1M remote
    ids took a daemon to 4.6 GiB in ~20 s (attacker review). The ids of the
    loads in flight are capped per worker and per uid: past either, a load
    fails at once (busy) naming the cap; once the waiting loads end, their
    ids are free again."""
    from kvd.testing.fakes import blackhole

    d = start_daemon(str(tmp_path), "ids-cap", "--max-load-block-ids-per-worker", "500",
                     "--max-load-block-ids-per-uid", "700", "--handshake-timeout-s", "1")
    a = b = None
    try:
        a, b = Engine(d, "d-ids-a", SHAPE), Engine(d, "d-ids-b", SHAPE)
        with blackhole() as hung:
            def load(e: Engine, rid: str, n: int = 100) -> None:  # 2n ids: n local (repeated), n remote
                e.session.send(load=pb.LoadBlocks(request_id=rid, local_groups=[pb.BlockIds(ids=[1] * n)],
                                                  remote_engine_id="p-ids", remote_address=hung,
                                                  remote_groups=[pb.BlockIds(ids=list(range(n)))],
                                                  remote_request_id=rid, remote_tp_size=1, timeout_s=30))

            load(a, "a0")
            load(a, "a1")  # 400 ids waiting on worker a
            load(a, "a2")
            ev = a.wait("a2", 10)
            assert event_kind(ev) == "load_failed", ev
            assert "400 block ids in this worker's loads in flight, this load names 200" in ev.load_failed.reason
            assert "max_load_block_ids_per_worker 500" in ev.load_failed.reason, ev
            load(b, "b0", 100)  # 200 more of the same uid: 600
            load(b, "b1", 100)  # 800 > 700
            ev = b.wait("b1", 10)
            assert event_kind(ev) == "load_failed" and "max_load_block_ids_per_uid 700" in ev.load_failed.reason, ev
            assert a.quiet("a0", 0.3) and a.quiet("a1", 0.0) and b.quiet("b0", 0.0)  # still waiting
            for e, rid in ((a, "a0"), (a, "a1"), (b, "b0")):  # the handshake timeouts end them
                ev = e.wait(rid, 30)
                assert event_kind(ev) == "load_failed" and "max_load_block_ids" not in ev.load_failed.reason, ev
            load(a, "again", 200)  # 400 ids: room again on both caps
            assert a.quiet("again", 0.5), "a load is counted again once the others ended"
            ev = a.wait("again", 30)
            assert "max_load_block_ids" not in ev.load_failed.reason, ev
    finally:
        for e in (a, b):
            if e is not None:
                e.close()
        _still_serving(d)
        assert d.stop() == 0


def test_an_incompatible_sources_notifications_take_an_abort_slot_per_load(tmp_path):
    """A source that refuses the pair (here: another TP size than the load
    names) is told by gRPC to free each of its ranks' blocks. That was one
    task per rank per load, outside every cap: an engine naming a remote TP
    size of 256 had 4,272 Notify calls in flight from 20 loads (attacker
    review). Now one task per load walks the ranks, in an abort slot: with
    max_aborts_per_uid 1 and a source whose Notify hangs, one call is in
    flight whatever the loads; an AbortLoad meanwhile is rejected naming the
    cap; the loads fail HANDSHAKE at once either way."""
    import threading

    from kvd.testing.fakes import FakePeer

    release = threading.Event()

    def tp1(request, context):
        return pb.HandshakeResponse(agent_metadata=b"x" * 64, agent_name="kvd-tp1", tp_size=1, layout=SHAPE.layout(),
                                    regions=SHAPE.regions(), region_base_addrs=[4096] * SHAPE.num_regions,
                                    compat_hash=request.compat_hash, daemon_version="0.1.0",
                                    protocol_version=request.protocol_version)

    def hang(request, context):
        release.wait(30)
        return pb.NotifyResponse()

    fake = FakePeer(tp1, notify=hang)
    d = start_daemon(str(tmp_path), "inc-notify", "--max-aborts-per-uid", "1")
    a = None
    try:
        a = Engine(d, "d-inc", SHAPE)
        for i in range(3):
            a.session.send(load=pb.LoadBlocks(request_id=f"i{i}", local_groups=[pb.BlockIds(ids=[1])],
                                              remote_engine_id=f"p{i}", remote_address=fake.address,
                                              remote_groups=[pb.BlockIds(ids=[1])], remote_request_id=f"i{i}",
                                              remote_tp_size=2, timeout_s=20))
        for i in range(3):
            ev = a.wait(f"i{i}", 10)
            assert event_kind(ev) == "load_failed" and "TP size 1, the request says 2" in ev.load_failed.reason, ev
        a.session.send(abort_load=pb.AbortLoad(request_id="ab", remote_engine_id="p", remote_address=fake.address,
                                               remote_request_id="pab", remote_tp_size=1))
        ev = a.wait("ab", 10)
        assert event_kind(ev) == "rejected" and "max_aborts_per_uid 1" in ev.rejected.reason, ev
        # One load's first rank, once its call arrives (the slot is taken
        # before the call is made: asserted at once, it could still be 0);
        # the others were not sent.
        wait_until(lambda: fake.notifies >= 1, 10, "the first Notify at the source")
        time.sleep(0.3)
        assert fake.notifies == 1, fake.notifies
    finally:
        release.set()
        if a is not None:
            a.close()
        _still_serving(d)
        assert d.stop() == 0
        fake.stop()


def test_handshakes_ahead_of_need_take_at_most_half_of_the_caps():
    """Handshakes ahead of need (an engine's other ranks and workers, made
    when one load meets it) are optional: they stop at half of
    max_handshakes / max_handshakes_per_uid, so a decode engine meeting many
    prefill engines at once keeps room for its loads' own."""
    from types import SimpleNamespace

    from kvd.core.limits import Limits
    from kvd.core.peers import Peers
    from kvd.core.runtime import Runtime

    peers = Peers(Runtime(Limits(max_handshakes=100, max_handshakes_per_uid=4)), link=None)
    w = SimpleNamespace(owner=SimpleNamespace(uid=1000))
    assert peers._no_room(w, ahead=True) is None
    done = [peers._counts.add(1000) for _ in range(2)]  # two in flight for uid 1000's workers
    assert "max_handshakes_per_uid 4 (half of each for handshakes ahead of need)" in peers._no_room(w, ahead=True)
    assert peers._no_room(w, ahead=False) is None  # a load's own still starts
    done += [peers._counts.add(1000) for _ in range(2)]
    assert "max_handshakes_per_uid 4" in peers._no_room(w, ahead=False)
    assert peers._no_room(SimpleNamespace(owner=SimpleNamespace(uid=1001)), ahead=True) is None  # another uid
    done += [peers._counts.add(-1) for _ in range(46)]  # 50 of max_handshakes 100 in flight, all uids
    assert "max_handshakes 100" in peers._no_room(SimpleNamespace(owner=None), ahead=True)
    for uncount in done:
        uncount()
    assert peers._counts.total == 0 and peers._no_room(w, ahead=True) is None
