"""Bounds: every block id is checked against the registered region
before any NIXL call, messages and per-worker state are capped, push writes
only what the source holds, and peer agent metadata is size-capped. Every
refusal is a status or an event with a message, and the daemons keep serving.

Daemons for the module: P (1 MiB messages, 3 leases and 12 held block ids
per worker), D (defaults),
E (push mode: asks P to WRITE).
"""

from __future__ import annotations

import grpc
import pytest

from kvd.core.state import PROTOCOL_VERSION
from kvd.core.limits import BOUNDS
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc
from kvd.testing.fakes import FakePeer
from kvd.testing.sessions import Engine, KvShape, event_kind, register_request
from kvd.testing.shm import ShmSegment
from kvd.testing.daemons import start_daemons, stop_daemons

SHAPE = KvShape(num_layers=2, num_blocks=16, block_len=2048)


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("bounds"))
    ds = start_daemons((tmp, "P", "--max-message-bytes", str(1 << 20), "--max-leases-per-worker", "3",
                        "--max-held-blocks-per-worker", "12"),
                       (tmp, "D"), (tmp, "E", "--transfer-mode", "push"))
    yield ds
    stop_daemons(ds)


@pytest.fixture(scope="module")
def engines(daemons):
    p, d, e = daemons
    es = Engine(p, "P", SHAPE, seed=1), Engine(d, "D", SHAPE, seed=2), Engine(e, "E", SHAPE, seed=3)
    yield es
    for x in es:
        x.close()


def _still_serving(*daemons) -> None:
    for d in daemons:
        assert d.proc.poll() is None and d.stats().daemon_version


def test_out_of_range_block_ids_are_refused_before_any_transfer(daemons, engines):
    src, dst, _ = engines
    src.hold("oob-hold", [1, SHAPE.num_blocks])
    ev = src.wait("oob-hold")
    assert event_kind(ev) == "rejected" and f"block id {SHAPE.num_blocks} out of range" in ev.rejected.reason
    src.hold("oob", [1, 2])
    dst.load("oob-local", [3, 99], src, [1, 2], "oob")
    ev = dst.wait("oob-local")
    assert event_kind(ev) == "load_failed" and "invalid: local block id 99 out of range" in ev.load_failed.reason
    dst.load("oob-remote", [3, 4], src, [1, 1 << 20], "oob")
    ev = dst.wait("oob-remote")
    assert event_kind(ev) == "load_failed" and f"remote block id {1 << 20} out of range" in ev.load_failed.reason
    assert list(ev.load_failed.failed_block_ids) == [3, 4]
    src.release("oob")
    assert src.wait("oob").send_done.released
    assert daemons[1].stats().leaked_handles == 0
    _still_serving(*daemons)


def test_an_oversized_message_is_refused_on_both_ports(daemons):
    p = daemons[0]
    seg = ShmSegment(SHAPE.size)
    try:
        req = register_request("big", SHAPE, seg)
        req.compat_extra = "x" * (2 << 20)
        with pytest.raises(grpc.RpcError) as e:
            p.stub().RegisterEngine(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.details()
    finally:
        seg.close()
    with grpc.insecure_channel(p.peer_address, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.PeerServiceStub(ch).Handshake(pb.HandshakeRequest(engine_id="x" * (2 << 20)), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.details()
    _still_serving(p)


def test_leases_per_worker_are_capped(daemons, engines):
    src = engines[0]
    for i in range(3):
        src.hold(f"cap{i}", [i])
    src.hold("cap0", [0])  # renewing a lease is not a new one
    src.hold("cap3", [3])
    ev = src.wait("cap3")
    assert event_kind(ev) == "rejected" and "max_leases_per_worker" in ev.rejected.reason
    assert src.quiet("cap0", 0.2)
    for i in range(3):
        src.release(f"cap{i}")
        assert src.wait(f"cap{i}").send_done.released
    _still_serving(daemons[0])


def test_a_hold_repeating_a_block_id_is_refused(daemons, engines):
    src = engines[0]
    src.hold("twice", [4, 5, 4])
    ev = src.wait("twice")
    assert event_kind(ev) == "rejected" and "block id 4 repeated in group 0 (2 times)" in ev.rejected.reason, ev
    assert daemons[0].stats().active_leases == 0
    _still_serving(daemons[0])


def test_block_ids_held_per_worker_are_capped(daemons, engines):
    """Every lease's ids count (``max_held_blocks_per_worker``): a block
    held by two requests counts twice; an ended lease gives its ids back."""
    src = engines[0]
    src.hold("many", list(range(10)))
    src.hold("shared", [0, 1])  # 12: at the cap, still held
    src.hold("one-more", [2])
    ev = src.wait("one-more")
    assert event_kind(ev) == "rejected" and "max_held_blocks_per_worker" in ev.rejected.reason, ev
    assert "12 held" in ev.rejected.reason
    src.hold("many", list(range(10)))  # a renewal adds nothing
    assert src.quiet("many", 0.2)
    src.release("many")
    assert src.wait("many").send_done.released
    src.hold("one-more", [2])
    assert src.quiet("one-more", 0.2)  # held now
    for rid in ("shared", "one-more"):
        src.release(rid)
        assert src.wait(rid).send_done.released
    _still_serving(daemons[0])


def test_overlong_ids_are_refused(daemons, engines):
    src, dst, _ = engines
    long_id = "r" * 2000
    src.hold(long_id, [1])
    ev = src.wait(long_id)
    assert event_kind(ev) == "rejected" and "longer than 1024 bytes" in ev.rejected.reason
    dst.load("ok-id", [1], src, [1], long_id)
    ev = dst.wait("ok-id")
    assert event_kind(ev) == "rejected" and "remote_request_id longer" in ev.rejected.reason
    with grpc.insecure_channel(daemons[0].peer_address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.PeerServiceStub(ch).Notify(pb.NotifyRequest(engine_id="P", request_id=long_id,
                                                               expected_notifications=1), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "longer than" in e.value.details()
    _still_serving(*daemons)


def test_push_writes_only_the_blocks_the_source_holds_for_that_request(daemons, engines):
    src, _, pusher = engines
    src.hold("held", [1, 2])
    pusher.load("steal", [5, 6], src, [1, 9], "held")  # block 9 is not held for "held"
    ev = pusher.wait("steal")
    assert event_kind(ev) == "load_failed" and "not held for request" in ev.load_failed.reason, ev
    assert not pusher.same_blocks([6], src, [9])
    pusher.load("fair", [5, 6], src, [1, 2], "held")
    ev = pusher.wait("fair")
    assert event_kind(ev) == "recv_done" and pusher.same_blocks([5, 6], src, [1, 2]), ev
    assert src.wait("held").WhichOneof("event") == "send_done"
    _still_serving(*daemons)


def test_agent_metadata_past_the_cap_is_refused(daemons, engines):
    d, dst = daemons[1], engines[1]

    def respond(request, context):
        return pb.HandshakeResponse(agent_metadata=b"m" * (BOUNDS.max_agent_metadata + 1), agent_name="huge",
                                    layout=SHAPE.layout(), regions=SHAPE.regions(),
                                    region_base_addrs=[4096] * SHAPE.num_regions, compat_hash=request.compat_hash,
                                    daemon_version="x", protocol_version=PROTOCOL_VERSION, tp_size=1)

    fake = FakePeer(respond)
    agents = d.stats().remote_agents
    try:
        dst.load("meta", [1], None, [1], "r", remote_engine_id="P", remote_address=fake.address, timeout_s=10)
        ev = dst.wait("meta")
        assert event_kind(ev) == "load_failed" and "agent metadata of" in ev.load_failed.reason, ev
        assert d.stats().remote_agents == agents  # never handed to NIXL
    finally:
        fake.stop()
    _still_serving(d)


def test_a_peers_long_strings_reach_no_reason_log_line_or_event_at_length(daemons, engines):
    """A hostile peer's handshake answer with a 16 MiB ``memory`` made each
    load from it fail with a 16 MiB reason, a 16 MiB log line and event; at
    48 MiB the decode daemon's loop stalled 2.2 s and the honest engine's
    session was dropped (attacker review). Each peer string a check quotes
    is bounded where it is checked (``memory``, the agent name, a region's
    name, ``dtype``), and a failure's reason is cut to ``MAX_REASON_CHARS``."""
    import os

    from kvd.core.layout import MAX_DTYPE_CHARS, MAX_NAME_CHARS
    from kvd.core.peers import MAX_AGENT_NAME_CHARS
    from kvd.core.runtime import MAX_REASON_CHARS

    d, dst = daemons[1], engines[1]
    long = "M" * (2 << 20)
    cases = {  # field -> what the reason says
        "memory": "memory 'MMMMMMMMMMMMMMMM...(2097152 characters)'",
        "agent_name": f"agent name of {len(long)} characters (at most {MAX_AGENT_NAME_CHARS})",
        "region name": f"region 0: name of {len(long)} characters (at most {MAX_NAME_CHARS})",
        "dtype": f"dtype of {len(long)} characters (at most {MAX_DTYPE_CHARS})",
    }

    def respond(request, context):
        field = current["field"]
        layout, regions = SHAPE.layout(), SHAPE.regions()
        if field == "dtype":
            layout.dtype = long
        if field == "region name":
            regions[0].name = long
        return pb.HandshakeResponse(
            agent_metadata=b"m" * 64, agent_name=long if field == "agent_name" else "a", layout=layout,
            regions=regions, region_base_addrs=[4096] * SHAPE.num_regions, compat_hash=request.compat_hash,
            daemon_version="x", protocol_version=PROTOCOL_VERSION, tp_size=1,
            memory=long if field == "memory" else "DRAM")

    current = {}
    fake = FakePeer(respond)
    try:
        for i, (field, said) in enumerate(cases.items()):
            current["field"] = field
            before = os.path.getsize(d.log_path)
            dst.load(f"long{i}", [1], None, [1], "r", remote_engine_id=f"P{i}", remote_address=fake.address,
                     timeout_s=10)
            ev = dst.wait(f"long{i}")
            reason = ev.load_failed.reason
            assert event_kind(ev) == "load_failed" and said in reason, (field, reason[:300])
            assert len(reason) < 1024, (field, len(reason))
            assert os.path.getsize(d.log_path) - before < 64 << 10, field
    finally:
        fake.stop()
    _still_serving(d)
    assert MAX_REASON_CHARS < 1 << 16


def test_a_load_failures_reason_is_cut_wherever_its_text_came_from():
    """``Runtime.fail_load`` cuts every reason to ``MAX_REASON_CHARS`` (the
    catch-all behind the checks above: a reason that quotes text kvd did not
    bound), saying how long it was; what it logs is the same cut text."""
    import types

    from kvd.core.events import FailureKind
    from kvd.core.runtime import MAX_REASON_CHARS, Runtime

    emitted, logged = [], []
    rt = types.SimpleNamespace(counters=types.SimpleNamespace(transfers_failed=0),
                               lines=types.SimpleNamespace(warning=lambda key, fmt, *a: logged.append(fmt % a)),
                               on_event=lambda *a: None, emit=lambda w, e: emitted.append(e))
    w = types.SimpleNamespace(label="w", key=("e", 0))
    Runtime.fail_load(rt, w, "r", [1], FailureKind.HANDSHAKE, "handshake: " + "x" * 10_000_000)
    reason = emitted[0].reason
    assert reason.startswith("handshake: x") and reason.endswith("...(10000011 characters)")
    assert len(reason) < MAX_REASON_CHARS + 64 and len(logged[0]) < MAX_REASON_CHARS + 200
    Runtime.fail_load(rt, w, "r", [1], FailureKind.HANDSHAKE, "handshake: short")
    assert emitted[1].reason == "handshake: short"


def test_host_memory_registered_per_uid_is_capped(tmp_path):
    """Sparse sealed memfds cost the daemon address space only: one uid
    mapped ~128 TiB of them in 31 workers (attacker review). A uid's
    registered host memory is capped (``max_host_bytes_per_uid``, by
    default this host's physical memory): past it RESOURCE_EXHAUSTED naming
    the key; what an unregistered worker had counts no more."""
    from kvd.core.registry import physical_memory
    from kvd.testing.daemons import start_daemon

    assert physical_memory() > 1 << 20
    d = start_daemon(str(tmp_path), "host", "--max-host-bytes-per-uid", str(SHAPE.size * 3 // 2))
    try:
        first = Engine(d, "host-1", SHAPE)
        with pytest.raises(grpc.RpcError) as e:
            Engine(d, "host-2", SHAPE)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
        assert "max_host_bytes_per_uid" in e.value.details() and f"would be {2 * SHAPE.size}" in e.value.details()
        first.close()
        Engine(d, "host-3", SHAPE).close()
        assert d.stats().engines == 0
        # CUDA segments staged on a daemon without a GPU get host shm mirrors
        # of their sizes: host memory too (an attacker review registered 4 TiB
        # of them with the cap at 1 MiB).
        from kvd import cudart

        if not cudart.available()[0]:
            huge = pb.RegisterEngineRequest(
                worker=pb.EngineWorker(engine_id="host-cuda", tp_rank=0, tp_size=1), layout=SHAPE.layout(),
                segments=[pb.Segment(kind=pb.MEMORY_KIND_CUDA_IPC, handle=bytes(64), device=0, size=SHAPE.size * 2)],
                regions=SHAPE.regions(), model="m", data_path=pb.DATA_PATH_STAGED)
            with pytest.raises(grpc.RpcError) as e:
                d.stub().RegisterEngine(huge, timeout=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
            assert "max_host_bytes_per_uid" in e.value.details()
            assert d.stats().engines == 0
    finally:
        assert d.stop() == 0


def test_registrations_at_once_are_held_to_the_caps(tmp_path):
    """A registration awaits its mappings and its NIXL agent before its
    worker counts: registrations sent at once all passed the caps (an
    attacker review registered 100 workers past ``max_workers_per_uid``
    32). Those under way count now: of 8 at once with a cap of 2, 2
    register, the rest get RESOURCE_EXHAUSTED naming the key; the same
    worker twice at once is registered once."""
    import threading

    from kvd.testing.daemons import start_daemon

    d = start_daemon(str(tmp_path), "race", "--max-workers-per-uid", "2")
    segs = [ShmSegment(SHAPE.size) for _ in range(10)]
    try:
        reqs = [register_request(f"race-{i}", SHAPE, segs[i]) for i in range(8)]
        reqs += [register_request("twin", SHAPE, segs[8]), register_request("twin", SHAPE, segs[9])]
        stub = d.stub()
        start = threading.Barrier(8)
        out: list = [None] * len(reqs)

        def call(i):
            start.wait()
            try:
                out[i] = stub.RegisterEngine(reqs[i], timeout=60)
            except grpc.RpcError as e:
                out[i] = e

        threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ok = [i for i in range(8) if not isinstance(out[i], grpc.RpcError)]
        refused = [r for r in out[:8] if isinstance(r, grpc.RpcError)]
        assert len(ok) == 2 and d.stats().engines == 2, out
        assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_workers_per_uid" in e.details()
                   for e in refused), refused
        for i in ok:
            stub.UnregisterEngine(pb.UnregisterEngineRequest(worker=reqs[i].worker,
                                                             session_token=out[i].session_token), timeout=30)
        assert d.stats().engines == 0
        start = threading.Barrier(2)
        threads = [threading.Thread(target=call, args=(i,)) for i in (8, 9)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        twins = [r for r in out[8:] if not isinstance(r, grpc.RpcError)]
        assert len(twins) == 1 and d.stats().engines == 1, out[8:]
        (e,) = [r for r in out[8:] if isinstance(r, grpc.RpcError)]
        assert e.code() == grpc.StatusCode.ALREADY_EXISTS, e
    finally:
        assert d.stop() == 0
        for s in segs:
            s.close()


def test_a_dropped_worker_s_memory_is_unmapped_and_unlinked_off_the_event_loop(monkeypatch):
    """The last unmap or unlink of memory an engine filled frees its pages
    inside the call: a 4 GiB memfd's unmap at unregister held the event
    loop 0.67 s (attacker review). ``Registry.unregister`` unmaps and
    unlinks on a thread; the loop only awaits it."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from kvd.core import registry as reg

    loop_thread = []
    seen = {}

    class Mapping:
        name, identity = "/kvdtest-gone", (1, 2)

        def close(self):
            seen["unmap"] = threading.get_ident()

    async def nixl(fn, *a):
        return True

    rt = SimpleNamespace(workers={}, counters=SimpleNamespace(transfers_failed=0), quarantine=[],
                         feeds=SimpleNamespace(drop=lambda engine: None), nixl=nixl)
    w = SimpleNamespace(label="e/0", inflight={}, leases={}, mem=SimpleNamespace(
        mappings=[Mapping()], staging=["/kvdtest-mirror"], segment_names=["/kvdtest-gone"], owner_pid=2 ** 22 + 7))
    rt.workers[("e", 0)] = w
    r = reg.Registry(rt, peers=None, backends=["UCX"])
    monkeypatch.setattr(reg, "unlink_shm", lambda name, identity=None: seen.setdefault(name, threading.get_ident())
                        and False)

    async def go():
        loop_thread.append(threading.get_ident())
        return await r.unregister(("e", 0), engine_gone=True)

    assert asyncio.run(go()) == 0
    assert set(seen) == {"unmap", "/kvdtest-mirror", "/kvdtest-gone"}
    assert loop_thread[0] not in set(seen.values())


def test_vram_mirrors_are_capped_per_uid_before_any_is_allocated(monkeypatch):
    """A staged (or auto) CUDA registration has the daemon allocate VRAM
    mirrors of the sizes the engine registers: with only its own handle's
    worth of memory a caller had the daemon allocate as much again per
    registration, up to max_workers_per_uid (attacker review). With
    ``max_device_bytes_per_uid`` set, a uid's mirrors (registered and under
    way) stay under it: past it RESOURCE_EXHAUSTED naming the key, before the
    handles are opened or any mirror is made; a direct registration (no
    mirrors) and another uid's are not counted. Checked with the CUDA side
    stubbed: this machine has no GPU (docs/GPU.md)."""
    import asyncio
    from types import SimpleNamespace

    from kvd.core import cuda_ipc, registry
    from kvd.core.events import ResourceExhausted
    from kvd.core.limits import Limits
    from kvd.core.runtime import Runtime
    from kvd.core.state import Owner, Segment

    mib = 1 << 20
    rt = Runtime(Limits(max_device_bytes_per_uid=3 * mib))
    reg = registry.Registry(rt, peers=None, backends=["UCX"])
    alice, bob = Owner(1000, 1000, frozenset(), 1, "a"), Owner(1001, 1001, frozenset(), 2, "b")
    mem = SimpleNamespace(memory="VRAM", staged=True, registered_bytes=2 * mib)
    rt.workers[("alice-1", 0)] = SimpleNamespace(owner=alice, mem=mem, regions=[], layout=SimpleNamespace(num_blocks=0))
    with pytest.raises(ResourceExhausted, match="bytes of GPU staging mirrors of uid 1000 would be 4194304, more "
                                                "than max_device_bytes_per_uid 3145728"):
        reg._check_caps(0, alice, 0, 2 * mib)
    reg._check_caps(0, alice, 0, 1 * mib)  # fits
    reg._check_caps(0, bob, 0, 3 * mib)  # bob's own budget
    reg._check_caps(0, alice, 0, 0)  # no mirrors asked (a direct registration): nothing counted
    with reg._reserved(("alice-2", 0), alice, 0, 0, 1 * mib):  # under way: counted
        with pytest.raises(ResourceExhausted, match="max_device_bytes_per_uid"):
            reg._check_caps(0, alice, 0, 1 * mib)
    mem.staged = False  # the registered worker's VRAM is the engine's own (direct): no mirrors
    reg._check_caps(0, alice, 0, 3 * mib)

    # Through register(): refused before any handle is opened or mirror made.
    opened = []
    monkeypatch.setattr(cuda_ipc, "wants_vram", lambda staged: True)
    monkeypatch.setattr(cuda_ipc, "open_segments", lambda *a: opened.append(a))
    mem.staged = True
    from kvd.daemon.convert import layout_from_pb, region_from_pb

    shape = KvShape(num_layers=1, num_blocks=8, block_len=128 << 10)  # 2 MiB in one segment
    assert shape.size == 2 * mib
    layout, regions = layout_from_pb(shape.layout()), [region_from_pb(r) for r in shape.regions()]
    big = [Segment("cuda-0", shape.size, cuda_ipc.KIND, handle=bytes(64))]
    try:
        asyncio.run(reg.register("alice-3", 0, 1, layout, big, regions, staged=None, owner=alice))
    except ResourceExhausted as e:
        assert "max_device_bytes_per_uid 3145728" in str(e)
    else:
        raise AssertionError("registered past max_device_bytes_per_uid")
    assert opened == [] and ("alice-3", 0) not in rt.workers and not reg._registering


@pytest.mark.parametrize("where", ["agent", "mirrors"])
def test_a_registration_cancelled_meanwhile_frees_what_the_nixl_thread_made(monkeypatch, where):
    """A registration whose caller gives up (its deadline) is cancelled while
    the NIXL thread makes its agent (or, for CUDA, its VRAM mirrors): that
    call still ends there. Before, what it made stayed: cancelled staged
    registrations left 2 GiB of mirrors mapped, counted by no cap, and in
    /dev/shm after the daemon exited (attacker review). Now it is freed
    when the call ends, counted against the caps until then, and the
    daemon's shutdown waits for that (``Registry.released``)."""
    import asyncio
    import os
    import threading
    from types import SimpleNamespace

    from kvd.core import cuda_ipc, registry
    from kvd.core.events import ResourceExhausted
    from kvd.core.limits import Limits
    from kvd.core.runtime import Runtime
    from kvd.core.state import Owner, Segment
    from kvd.daemon.convert import layout_from_pb, region_from_pb

    size = SHAPE.size
    rt = Runtime(Limits(max_host_bytes_per_uid=2 * size, max_device_bytes_per_uid=2 * size))
    reg = registry.Registry(rt, peers=None, backends=["UCX"])
    alice = Owner(os.getuid(), os.getgid(), frozenset(), os.getpid(), "a")
    layout, regions = layout_from_pb(SHAPE.layout()), [region_from_pb(r) for r in SHAPE.regions()]
    gate = threading.Event()  # holds the NIXL thread's call until the registration is cancelled
    closed = []
    if where == "agent":
        real = reg._make_agent
        monkeypatch.setattr(reg, "_make_agent", lambda *a: (gate.wait(10), real(*a))[1])
        segs, staged = [Segment("engine-seg", size)], True  # staged: the daemon's own shm mirror
    else:  # CUDA, stubbed (no GPU here): open_segments makes the mirrors
        mirror = SimpleNamespace(close=lambda: closed.append(1))
        monkeypatch.setattr(cuda_ipc, "wants_vram", lambda staged: True)
        monkeypatch.setattr(cuda_ipc, "open_segments",
                            lambda *a: (gate.wait(10), SimpleNamespace(mappings=[mirror], staged=True))[1])
        segs, staged = [Segment("cuda-0", size, cuda_ipc.KIND, handle=bytes(64))], None

    def mirrors() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if n.startswith("kvd-stage")}

    async def scenario():
        before = mirrors()
        task = asyncio.get_running_loop().create_task(
            reg.register("alice-1", 0, 1, layout, segs, regions, staged=staged, owner=alice))
        await asyncio.sleep(0.2)  # in the NIXL thread's call
        made = mirrors() - before
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Until the thread's call ends, what it makes still counts.
        with pytest.raises(ResourceExhausted):
            reg._check_caps(0, alice, 2 * size if where == "agent" else 0, 0 if where == "agent" else 2 * size)
        # The daemon's shutdown waits for the frees (Node.close: released(),
        # then the NIXL thread stops): the call ends meanwhile.
        waiting = asyncio.get_running_loop().create_task(reg.released())
        await asyncio.sleep(0.1)
        assert not waiting.done()
        gate.set()
        await asyncio.wait_for(waiting, 10)
        return before, made

    try:
        before, made = asyncio.run(scenario())
    finally:
        gate.set()
        rt.shutdown()
    assert reg._releasing == {} and reg._registering == {} and rt.workers == {}
    if where == "agent":
        assert len(made) == 1 and mirrors() == before, "the cancelled registration's mirror is gone"
    else:
        assert closed == [1], "the cancelled registration's VRAM mirror is closed"
    reg._check_caps(0, alice, 2 * size, 0)  # the whole budget is back
