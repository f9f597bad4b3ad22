"""EngineClient scenarios against a fake EngineService on a Unix socket.

Each test reads as one behaviour: the engine-facing calls never wait on the
daemon, every load ends in exactly one event, a daemon restart fails what was
in flight and the client carries on.
"""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from kvd.client.engine_client import EngineClient, EngineClientError, normalize_address
from kvd.requests import InvalidLoad, LoadRequest
from kvd.v1 import kvd_pb2 as pb
from kvd.testing.fakes import PEER_ADDRESS, FakeDaemon, kinds, wait_events
from kvd.testing.util import wait_until

WORKER = pb.EngineWorker(engine_id="engine-a", tp_rank=0, tp_size=1)
FAST_S = 0.010  # "never blocks": every engine-facing call returns faster than this


def register_request() -> pb.RegisterEngineRequest:
    return pb.RegisterEngineRequest(
        worker=WORKER,
        layout=pb.Layout(num_blocks=8, block_size=32, kv_layout=pb.KV_LAYOUT_HND, dtype="float32",
                         num_kv_heads=2, head_dim=32, num_layers=1, block_lens=[16384]),
        segments=[pb.Segment(kind=pb.MEMORY_KIND_SHM, name="/fake", size=8 * 16384)],
        regions=[pb.Region(segment_index=0, offset=0, block_len=16384, block_stride=16384, name="l0")],
        model="tiny",
    )


@pytest.fixture
def sock(tmp_path):
    return str(tmp_path / "engine.sock")


def connect(sock: str, **kwargs) -> EngineClient:
    client = EngineClient(sock, **kwargs)
    client.register(register_request(), timeout_s=5)
    client.start_session()
    assert client.wait_opened(5), "session did not open"
    return client


def load(client: EngineClient, rid: str, local=(1, 2), remote=(5, 6), **kw) -> None:
    client.load(LoadRequest(rid, [list(local)], "engine-p", PEER_ADDRESS, [list(remote)], f"p-{rid}", **kw))


def test_addresses_accept_bare_paths_and_grpc_targets(tmp_path):
    assert normalize_address("/run/kvd/engine.sock") == "unix:///run/kvd/engine.sock"
    assert normalize_address("unix:///x.sock") == "unix:///x.sock"
    assert normalize_address("127.0.0.1:50051") == "127.0.0.1:50051"
    rel = normalize_address("./e.sock")
    assert rel.startswith("unix:///") and rel.endswith("/e.sock")
    with pytest.raises(ValueError):
        normalize_address("  ")
    # gRPC reads a unix: target as a URI: "%41" is "A", "?" and "#" end the path. The look
    # at the socket would check one file and gRPC dial another.
    for bad in ("unix:///tmp/a%41.sock", "unix:///tmp/b?x", "/tmp/c#x.sock"):
        with pytest.raises(ValueError, match="characters gRPC targets cannot carry"):
            normalize_address(bad)
    with pytest.raises(ValueError, match="port '5O051' is not a number"):
        normalize_address("localhost:5O051")


def test_a_loads_local_deadline_follows_what_the_daemon_said_at_session_open(tmp_path):
    """The local wait for a load's answer: the daemon's default for a
    timeout of 0 and its cap on any (``SessionOpened``), as said; before any
    session, or from a daemon that says 0, the load's own timeout or
    ``unknown_timeout_wait_s``."""
    client = EngineClient(str(tmp_path / "none.sock"), unknown_timeout_wait_s=120.0)
    try:
        assert (client._daemon_timeout(0), client._daemon_timeout(20)) == (120.0, 20)
        client._session.session_info = pb.SessionOpened(transfer_timeout_s=3, max_transfer_timeout_s=10)
        assert (client._daemon_timeout(0), client._daemon_timeout(5), client._daemon_timeout(20)) == (3, 5, 10)
        client._session.session_info = pb.SessionOpened()  # an older daemon: says nothing
        assert (client._daemon_timeout(0), client._daemon_timeout(20)) == (120.0, 20)
    finally:
        client.close()


def test_register_stats_and_unregister_reach_the_daemon(sock):
    fake = FakeDaemon(sock).start()
    try:
        client = EngineClient(sock)
        resp = client.register(register_request(), timeout_s=5)
        assert resp.peer_address == PEER_ADDRESS
        stats = client.get_stats(timeout_s=5)
        assert stats.peer_address == PEER_ADDRESS and stats.daemon_version == "fake"
        client.unregister(timeout_s=5)
        assert fake.service.registers[0].worker.engine_id == "engine-a"
        assert len(fake.service.unregisters) == 1
        client.close()
    finally:
        fake.stop()


def test_register_without_a_daemon_fails_within_its_timeout(sock):
    client = EngineClient(sock)
    t0 = time.monotonic()
    with pytest.raises(EngineClientError) as err:
        client.register(register_request(), timeout_s=0.5)
    assert time.monotonic() - t0 < 3
    assert "RegisterEngine" in str(err.value) and err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    client.close()


def test_first_message_on_the_stream_is_open_session_then_loads_complete(sock):
    fake = FakeDaemon(sock).start()
    client = connect(sock)
    try:
        load(client, "r1")
        events = wait_events(client, lambda ev: len(ev) == 1)
        assert kinds(events) == ["recv_done"] and events[0].recv_done.request_id == "r1"
        assert fake.service.count("load") == 1 and fake.service.sessions == 1
        assert client.session_info.agent_name == "fake-agent"
    finally:
        client.close()
        fake.stop()


def test_slow_daemon_never_blocks_the_engine(sock):
    """A daemon taking 1 s per command: load/hold/drain still return in < 10 ms."""
    fake = FakeDaemon(sock, delay_s=1.0).start()
    client = connect(sock)
    try:
        worst = 0.0
        for i in range(20):
            t0 = time.perf_counter()
            load(client, f"r{i}")
            client.hold(f"h{i}", [[i]], lease_s=60)
            worst = max(worst, time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert client.drain_events() == []
            worst = max(worst, time.perf_counter() - t0)
        assert worst < FAST_S, f"an engine-facing call took {worst * 1e3:.2f} ms"
        # The daemon answers the first load about 1 s later; still no call blocks.
        events = wait_events(client, lambda ev: len(ev) >= 1, timeout_s=5)
        assert events[0].recv_done.request_id == "r0"
    finally:
        client.close()
        fake.stop()


def test_a_rejected_load_is_reported_as_failed_with_its_local_blocks(sock):
    fake = FakeDaemon(sock, load_mode="reject").start()
    client = connect(sock)
    try:
        load(client, "r1", local=(3, 4))
        (ev,) = wait_events(client, lambda ev: len(ev) == 1)
        assert ev.load_failed.request_id == "r1"
        assert list(ev.load_failed.failed_block_ids) == [3, 4]
        assert "fake rejection" in ev.load_failed.reason
    finally:
        client.close()
        fake.stop()


class Deferred:
    """A deferred load (``kvd.requests.DeferredLoad``): resolved by the
    client's sender thread, which it records, into ``result`` (or raises it)."""

    def __init__(self, rid: str, local, result):
        self.request_id, self.local_groups, self.timeout_s = rid, [list(local)], 0.0
        self.result = result
        self.resolved_on: list[str] = []

    @property
    def local_block_ids(self):
        return self.local_groups[0]

    def resolve(self) -> LoadRequest:
        import threading

        self.resolved_on.append(threading.current_thread().name)
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_a_deferred_load_is_resolved_off_the_engine_thread_and_its_refusal_fails_it_and_frees_the_source(sock):
    """``EngineClient.load`` of a deferred load returns without resolving it;
    the sender thread resolves it as it builds the command. Resolved: the
    daemon gets the load. ``InvalidLoad`` naming the source: the load fails
    here with that reason, naming its local blocks, and the daemon gets an
    ``AbortLoad`` of the source, never the load; a plain ValueError fails
    it the same way and tells nobody."""
    fake = FakeDaemon(sock, load_mode="answer").start()
    client = connect(sock)
    try:
        good = Deferred("ok", (1, 2), LoadRequest("ok", [[1, 2]], "engine-p", PEER_ADDRESS, [[5, 6]], "p-ok"))
        src = LoadRequest("bad", [], "engine-p", PEER_ADDRESS, [], "p-bad", 2)
        bad = Deferred("bad", (3, 4), InvalidLoad("invalid: remote_block_ids: 'x' is no id", src))
        worse = Deferred("worse", (7,), ValueError("nothing to say where"))
        for d in (good, bad, worse):
            client.load(d)
        events = wait_events(client, lambda ev: len(ev) == 3)
        by_id = {getattr(ev, ev.WhichOneof("event")).request_id: ev for ev in events}
        assert by_id["ok"].WhichOneof("event") == "recv_done"
        failed = by_id["bad"].load_failed
        assert (list(failed.failed_block_ids), failed.reason) == ([3, 4], "invalid: remote_block_ids: 'x' is no id")
        assert list(by_id["worse"].load_failed.failed_block_ids) == [7]
        assert "nothing to say where" in by_id["worse"].load_failed.reason
        assert [c.request_id for c in fake.service.received("load")] == ["ok"]
        wait_until(lambda: fake.service.count("abort_load") == 1, 5, "the AbortLoad of the refused load")
        (cmd,) = fake.service.received("abort_load")
        assert (cmd.request_id, cmd.remote_engine_id, cmd.remote_address, cmd.remote_request_id,
                cmd.remote_tp_size) == ("bad", "engine-p", PEER_ADDRESS, "p-bad", 2)
        for d in (good, bad, worse):  # once each, by the thread that sends commands
            assert len(d.resolved_on) == 1 and d.resolved_on[0] != threading.current_thread().name, d.resolved_on
        assert client.pending() == (0, 0)
    finally:
        client.close()
        fake.stop()


def test_duplicate_and_unknown_events_are_dropped(sock):
    fake = FakeDaemon(sock, load_mode="twice").start()
    client = connect(sock)
    try:
        load(client, "r1")
        wait_events(client, lambda ev: len(ev) == 1)
        time.sleep(0.2)
        assert client.drain_events() == []  # the second recv_done never surfaces
        assert client.pending() == (0, 0)
    finally:
        client.close()
        fake.stop()


def test_a_silent_daemon_fails_the_load_at_its_deadline(sock):
    fake = FakeDaemon(sock, load_mode="never").start()
    client = connect(sock, load_grace_s=0.1)
    try:
        t0 = time.monotonic()
        load(client, "r1", timeout_s=0.3)
        (ev,) = wait_events(client, lambda ev: len(ev) == 1, timeout_s=5)
        elapsed = time.monotonic() - t0
        assert ev.load_failed.request_id == "r1" and "timeout" in ev.load_failed.reason
        assert 0.35 <= elapsed < 2.0
    finally:
        client.close()
        fake.stop()


def test_a_hold_ends_with_send_done_on_release_or_at_its_lease(sock):
    fake = FakeDaemon(sock).start()
    client = connect(sock, hold_grace_s=0.1)
    try:
        client.hold("h1", [[1, 2]], lease_s=60)
        client.release("h1")
        (ev,) = wait_events(client, lambda ev: len(ev) == 1)
        assert ev.send_done.request_id == "h1" and ev.send_done.released
        client.hold("h2", [[3]], lease_s=0.2)  # the fake never ends it: the client does
        (ev,) = wait_events(client, lambda ev: len(ev) == 1, timeout_s=3)
        assert ev.send_done.request_id == "h2" and ev.send_done.expired
        sent = fake.service.received("hold")
        assert sent[0].lease_s == 60 and [list(g.ids) for g in sent[0].groups] == [[1, 2]]
    finally:
        client.close()
        fake.stop()


def test_daemon_restart_fails_inflight_loads_then_later_commands_work(sock):
    """Stream broken (daemon stopped) -> in-flight loads failed at once; the
    client re-registers, reopens the session, re-holds, and new loads work."""
    fake = FakeDaemon(sock, load_mode="never").start()
    client = connect(sock)
    try:
        load(client, "inflight", local=(7, 8))
        client.hold("held", [[9]], lease_s=60)
        deadline = time.monotonic() + 5
        while fake.service.count("load") < 1 or fake.service.count("hold") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)

        t0 = time.monotonic()
        fake.stop()
        (ev,) = wait_events(client, lambda ev: len(ev) == 1, timeout_s=5)
        assert ev.load_failed.request_id == "inflight"
        assert list(ev.load_failed.failed_block_ids) == [7, 8]
        assert "session lost" in ev.load_failed.reason
        assert time.monotonic() - t0 < 2.0
        assert not client.connected

        load(client, "queued")  # while the daemon is down: queued, not lost
        fake.service.load_mode = "answer"
        fake.start()
        assert client.wait_opened(10), "client did not reconnect"
        events = wait_events(client, lambda ev: "queued" in [e.recv_done.request_id for e in ev])
        assert kinds(events) == ["recv_done"]
        load(client, "after")
        events = wait_events(client, lambda ev: len(ev) == 1)
        assert events[0].recv_done.request_id == "after"

        assert len(fake.service.registers) >= 2, "regions were not registered again"
        assert fake.service.sessions == 2 and client.sessions_opened == 2
        holds = fake.service.received("hold")
        assert [h.request_id for h in holds] == ["held", "held"]
        assert 0 < holds[1].lease_s <= 60
        assert client.pending() == (0, 1)  # the hold is still held
    finally:
        client.close()
        fake.stop()


def test_close_fails_pending_loads_and_refuses_new_ones(sock):
    fake = FakeDaemon(sock, load_mode="never").start()
    client = connect(sock)
    try:
        load(client, "r1")
        client.close()
        load(client, "r2")
        events = client.drain_events()
        assert sorted(e.load_failed.request_id for e in events) == ["r1", "r2"]
    finally:
        fake.stop()


def test_channel_has_explicit_message_size_limits(sock):
    client = EngineClient(sock, max_message_bytes=1 << 20)
    assert client.max_message_bytes == 1 << 20
    fake = FakeDaemon(sock).start()
    try:
        big = register_request()
        big.compat_extra = "x" * (2 << 20)  # over the client's send limit
        with pytest.raises(EngineClientError) as err:
            client.register(big, timeout_s=5)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        client.close()
        fake.stop()


def test_socket_path_is_not_required_at_construction(tmp_path):
    client = EngineClient(str(tmp_path / "missing.sock"))
    assert not os.path.exists(tmp_path / "missing.sock")
    assert client.drain_events() == []
    client.close()


def test_abort_load_goes_out_on_the_stream_and_needs_no_answer(sock):
    fake = FakeDaemon(sock).start()
    client = connect(sock)
    try:
        t0 = time.perf_counter()
        client.abort_load("d1", remote_engine_id="engine-p", remote_address=PEER_ADDRESS,
                          remote_request_id="p-d1", remote_tp_size=2)
        assert time.perf_counter() - t0 < FAST_S
        deadline = time.monotonic() + 5
        while fake.service.count("abort_load") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (cmd,) = fake.service.received("abort_load")
        assert (cmd.request_id, cmd.remote_engine_id, cmd.remote_address, cmd.remote_request_id,
                cmd.remote_tp_size) == ("d1", "engine-p", PEER_ADDRESS, "p-d1", 2)
        assert client.pending() == (0, 0) and client.drain_events() == []
        client.close()
        client.abort_load("d2", remote_engine_id="e", remote_address=PEER_ADDRESS, remote_request_id="p")  # no error
    finally:
        client.close()
        fake.stop()


def test_block_ids_per_group_go_out_as_groups_and_survive_a_reconnect(sock):
    """HMA: loads and holds carry block ids per KV-cache group; a hold sent
    again after a daemon restart keeps its groups; a local failure of a
    grouped load names every local block."""
    fake = FakeDaemon(sock, load_mode="never").start()
    client = connect(sock)
    try:
        client.load(LoadRequest("d1", [[1, 2], [3]], "engine-p", PEER_ADDRESS, [[5, 6], [7]], "p-d1"))
        client.hold("h1", [[8, 9], [4]], lease_s=60)
        deadline = time.monotonic() + 5
        while fake.service.count("load") < 1 or fake.service.count("hold") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (ld,) = fake.service.received("load")
        assert [list(g.ids) for g in ld.local_groups] == [[1, 2], [3]]
        assert [list(g.ids) for g in ld.remote_groups] == [[5, 6], [7]]
        fake.stop()
        (ev,) = wait_events(client, lambda ev: len(ev) == 1)
        assert list(ev.load_failed.failed_block_ids) == [1, 2, 3]
        fake.start()
        assert client.wait_opened(10)
        deadline = time.monotonic() + 5
        while fake.service.count("hold") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        holds = fake.service.received("hold")
        assert [[list(g.ids) for g in h.groups] for h in holds] == [[[8, 9], [4]]] * 2
        assert 0 < holds[1].lease_s <= 60
    finally:
        client.close()
        fake.stop()


def test_on_register_sees_every_new_registration_before_holds_are_sent_again(sock):
    """A staged shim must map the daemon's new mirrors (and copy its held
    blocks in) before any hold goes out again: on_register runs first; when it
    fails, the registration is undone and retried."""
    fake = FakeDaemon(sock).start()
    client = connect(sock, backoff_initial_s=0.01, backoff_max_s=0.05)
    seen: list[tuple[int, int]] = []
    calls = {"n": 0}

    def on_register(resp):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("mirror not ready")
        seen.append((len(fake.service.registers), fake.service.count("hold")))

    client.on_register = on_register
    try:
        client.hold("h1", [[3]], lease_s=60)
        deadline = time.monotonic() + 5
        while fake.service.count("hold") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        fake.stop()
        fake.start()
        assert client.wait_opened(10)
        deadline = time.monotonic() + 5
        while fake.service.count("hold") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert calls["n"] == 2 and len(fake.service.unregisters) == 1, "the failed one was undone"
        assert seen == [(3, 1)], "on_register ran before the hold went out again"
    finally:
        client.close()
        fake.stop()


def test_a_load_request_crosses_the_wire_unchanged():
    """The one encoding of a load: what the client builds from a LoadRequest
    (groups only; the flat fields are reserved) is what the daemon's session
    adapter turns back into the same LoadRequest."""
    from kvd.client.commands import Load
    from kvd.daemon.convert import load_from_pb

    req = LoadRequest("d1", [[1, 2], [3]], "engine-p", PEER_ADDRESS, [[5, 6], [7]], "p-d1", remote_tp_size=2,
                      timeout_s=4.5)
    msg = Load(req, req.timeout_s, 0.0).build().load
    assert {f.name for f, _ in msg.ListFields()} == {
        "request_id", "local_groups", "remote_engine_id", "remote_address", "remote_groups", "remote_request_id",
        "remote_tp_size", "timeout_s"}
    assert "local_block_ids" not in pb.LoadBlocks.DESCRIPTOR.fields_by_name
    assert load_from_pb(pb.LoadBlocks.FromString(msg.SerializeToString())) == req


def test_renewal_failures_on_several_grpc_threads_start_one_look_at_a_time(tmp_path):
    """A renewal's failure callback runs on gRPC's threads, several at once;
    each asks for a look at the daemon off that thread, and one look at a
    time runs (two at once would retire each other's fresh channel)."""
    import threading

    client = EngineClient(str(tmp_path / "none.sock"))
    started, release = threading.Semaphore(0), threading.Event()
    looks = []

    def look() -> bool:
        looks.append(threading.current_thread().name)
        started.release()
        release.wait(10)
        return False

    client._look_after_failure = look
    barrier = threading.Barrier(8)

    def callback() -> None:
        barrier.wait()
        client._look_after_renewal()

    threads = [threading.Thread(target=callback) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert started.acquire(timeout=10)
    assert len(looks) == 1, looks
    release.set()
    deadline = time.monotonic() + 10
    while client._looking_after_renewal.locked() and time.monotonic() < deadline:
        time.sleep(0.01)
    client._look_after_renewal()  # the first look ended: the next failure looks again
    assert started.acquire(timeout=10) and len(looks) == 2
    client.close()


def test_a_lost_sessions_warning_names_a_few_loads_and_counts_the_rest(caplog):
    """Request ids are up to 1 KiB each: a session lost with 4,096 loads in
    flight made one 30 KB warning line naming every id (attacker review).
    Every load is still reported failed."""
    import logging

    from kvd.client.commands import Stream
    from kvd.client.pending import LOST_IDS_SHOWN, Pending

    p = Pending()
    for i in range(4096):
        p.add_load(LoadRequest(f"{'r' * 900}{i}", [[1]], "p", PEER_ADDRESS, [[2]], f"x{i}", 1, 5.0), 5.0, 5.0)
    for ld in p._loads.values():
        ld.stream = 1  # sent on the stream that ends (the sender thread sets it)
    with caplog.at_level(logging.WARNING, logger="kvd.client"):
        p.fail_stream(Stream(1), "the engine closed its client")
    [line] = [r.getMessage() for r in caplog.records if "session lost" in r.getMessage()]
    assert "(the engine closed its client): 4096 load(s) in flight reported failed" in line, line[:300]
    assert line.endswith(f" and {4096 - LOST_IDS_SHOWN} more") and len(line) < 2000, line[-300:]
    assert len(p.drain()) == 4096
