"""First contact with a peer: what a handshake costs does not grow with the
cache, every rank of a remote engine is handshaken at once (and ahead of
need), and a pair too large to prepare moves the right bytes with each
transfer's own descriptor rows. Real daemons, NIXL/UCX and shared memory."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from kvd.core import plan
from kvd.core.layout import Layout, Region
from kvd.core.limits import BOUNDS
from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import Session, one_group
from kvd.testing.shm import ShmSegment
from kvd.testing.util import wait_until
from kvd.v1 import kvd_pb2 as pb

HEAD_DIM = 16
BLOCK_SIZE = 16
NUM_BLOCKS = 8192  # x 16 per-token chunks x 2 regions: past BOUNDS.max_prepped_rows on each side


def _geometry(rank: int, tp: int, num_regions: int, kv_layout: str = "NHD", num_blocks: int = 16) -> plan.Geometry:
    heads = 2 // tp
    blen = BLOCK_SIZE * heads * HEAD_DIM * 2
    layout = Layout(num_blocks, BLOCK_SIZE, kv_layout, "float16", heads, HEAD_DIM, num_regions // 2,
                    (blen,) * num_regions, total_kv_heads=2)
    return plan.Geometry(rank, tp, layout, tuple(Region(i, 0, blen, blen) for i in range(num_regions)), 2)


def test_a_pair_of_many_regions_is_checked_once_not_once_per_region(monkeypatch):
    """1,000 regions: one compatibility check for the pair (it was one per
    region, each over every region: 1.4 s of the event loop at handshake),
    and the same chunks as region by region."""
    reader, source = _geometry(0, 1, 1000), _geometry(1, 2, 1000)
    calls = []
    real = plan.compatible
    monkeypatch.setattr(plan, "compatible", lambda a, b: calls.append(1) or real(a, b))
    sets = plan.pair_chunks(reader, source)
    assert len(calls) == 1
    monkeypatch.setattr(plan, "compatible", real)
    assert all(np.array_equal(s, plan.chunks(reader, source, i)) for i, s in enumerate(sets[:3]))
    assert len(sets) == 1000 and len(sets[0]) == BLOCK_SIZE  # one head of 2, token by token: 16 chunks


@pytest.mark.parametrize("reader_layout", ["NHD", "HND"])
def test_rows_made_per_transfer_are_the_rows_a_prepared_list_has(reader_layout):
    reader, source = _geometry(0, 1, 4, reader_layout), _geometry(1, 2, 4)
    sets = plan.pair_chunks(reader, source)
    k = 1
    rng = np.random.default_rng(5)
    for m in (plan.local_map([(1 << 20) * i for i in range(1, 5)], reader.regions, 16, sets, k),
              plan.remote_map([(1 << 30) * i for i in range(1, 5)], source.regions, 16, sets, k, device=3)):
        every = m.all()
        assert len(every) == 4 * 16 * len(sets[0])
        idx = rng.choice(len(every), 50, replace=False)
        assert np.array_equal(m.rows(idx), every[idx])
        assert (every[:, 2] == m.device).all()


def _register(daemon, engine_id: str, rank: int, tp: int, seed: int | None):
    """One worker of ``engine_id``: NHD float16, 2 KV heads in the model, 2 regions of NUM_BLOCKS blocks."""
    heads = 2 // tp
    blen = BLOCK_SIZE * heads * HEAD_DIM * 2
    seg = ShmSegment(2 * NUM_BLOCKS * blen)
    if seed is not None:
        seg.array[:] = np.random.default_rng(seed).integers(0, 256, seg.size, dtype=np.uint8)
    layout = pb.Layout(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, kv_layout=pb.KV_LAYOUT_NHD, dtype="float16",
                       num_kv_heads=heads, head_dim=HEAD_DIM, num_layers=1, block_lens=[blen, blen],
                       total_kv_heads=2)
    daemon.stub().RegisterEngine(pb.RegisterEngineRequest(
        worker=pb.EngineWorker(engine_id=engine_id, tp_rank=rank, tp_size=tp), layout=layout,
        segments=[pb.Segment(kind=pb.MEMORY_KIND_SHM, name=seg.name, size=seg.size)],
        regions=[pb.Region(segment_index=0, offset=i * NUM_BLOCKS * blen, block_len=blen, block_stride=blen)
                 for i in range(2)], model="m"), timeout=60)
    return seg, Session(daemon, engine_id, rank)


def _next(session: Session, timeout: float = 30.0):
    ev = session.next(timeout)
    assert not isinstance(ev, Exception), ev
    return ev


@pytest.fixture
def prefill_tp2(tmp_path):
    """A daemon with both ranks of a TP 2 prefill engine "P", filled with seeds 10 and 11."""
    p = start_daemon(str(tmp_path), "P")
    workers = []
    try:
        for rank in range(2):
            workers.append(_register(p, "P", rank, 2, seed=10 + rank))
        yield p, workers
    finally:
        for seg, s in workers:
            s.close()
            seg.close()
        p.stop()


def test_tp2_to_tp1_load_too_large_to_prepare_moves_every_byte(tmp_path, prefill_tp2):
    """D (TP 1, both heads) reads head h of each token from P rank h: per
    token chunks, 2 x 8,192 x 16 rows per side, more than a pair prepares in all
    (BOUNDS.max_prepped_rows): each READ makes its own rows. The bytes land
    where they belong, both P ranks free their blocks on D's notification,
    and D prepared no list for the pairs."""
    assert 2 * (2 * NUM_BLOCKS * BLOCK_SIZE) > BOUNDS.max_prepped_rows  # both sides, 2 regions each
    p, sources = prefill_tp2
    d = start_daemon(str(tmp_path), "D")
    seg, s = _register(d, "D", 0, 1, seed=None)
    try:
        remote, local = [8000, 3, 4097, 9], [1, 8191, 40, 2]
        for _, src in sources:
            src.send(hold=pb.HoldBlocks(request_id="r1", groups=one_group(remote), lease_s=600))
        time.sleep(0.2)
        s.send(load=pb.LoadBlocks(request_id="r1", local_groups=one_group(local), remote_engine_id="P",
                                  remote_address=p.peer_address, remote_groups=one_group(remote),
                                  remote_request_id="r1", remote_tp_size=2, timeout_s=60))
        ev = _next(s, 60)
        assert ev.WhichOneof("event") == "recv_done", ev
        for _, src in sources:
            done = _next(src)
            assert done.WhichOneof("event") == "send_done" and not done.send_done.expired, done
        dblk = BLOCK_SIZE * 2 * HEAD_DIM * 2
        pblk = BLOCK_SIZE * HEAD_DIM * 2
        dkv = seg.array.reshape(2, NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_DIM * 2)
        for rank, (pseg, _) in enumerate(sources):
            pkv = pseg.array.reshape(2, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM * 2)
            for lb, rb in zip(local, remote):
                assert np.array_equal(dkv[:, lb, :, rank], pkv[:, rb]), (rank, lb, rb)
        assert not dkv[:, 0].any() and ev.recv_done.bytes == 2 * len(local) * dblk == 2 * 2 * len(remote) * pblk
        st = d.stats()
        assert st.remote_agents == 2 and st.prepped_dlists == 1, st  # D's own block list only
        assert "rows per transfer" in d.log()
    finally:
        s.close()
        seg.close()
        d.stop()


def test_every_rank_pair_of_two_engines_is_handshaken_when_one_is_needed(tmp_path, prefill_tp2):
    """D (TP 2, both ranks on this daemon) loads on rank 0 only, which reads
    from P rank 0; that first contact also starts the handshake of D rank 1
    with P rank 1 (vLLM's rank 1 loads the same request a moment later), so
    both pairs are ready after one load."""
    p, sources = prefill_tp2
    d = start_daemon(str(tmp_path), "D")
    workers = [_register(d, "D", rank, 2, seed=None) for rank in range(2)]
    try:
        sources[0][1].send(hold=pb.HoldBlocks(request_id="r1", groups=one_group([5]), lease_s=600))
        time.sleep(0.2)
        workers[0][1].send(load=pb.LoadBlocks(
            request_id="r1", local_groups=one_group([6]), remote_engine_id="P", remote_address=p.peer_address,
            remote_groups=one_group([5]), remote_request_id="r1", remote_tp_size=2, timeout_s=60))
        assert _next(workers[0][1], 60).WhichOneof("event") == "recv_done"
        assert wait_until(lambda: d.stats().remote_agents == 2, 30, interval=0.1) is not None, d.log_tail()
        pairs = sorted((r.local_tp_rank, r.tp_rank) for r in d.stats().remote_workers)
        assert pairs == [(0, 0), (1, 1)], pairs
        assert d.stats().transfers_done == 1
    finally:
        for seg, s in workers:
            s.close()
            seg.close()
        d.stop()


def test_warm_peers_handshakes_before_any_load(tmp_path, prefill_tp2):
    """``--warm-peers host:port/P``: D's worker handshakes with both P ranks
    right after it registers, before any load names P; a peer that is not
    there (a closed port) is only retried, never an error."""
    p, _ = prefill_tp2
    d = start_daemon(str(tmp_path), "D", "--warm-peers", f"{p.peer_address}/P,127.0.0.1:1/nobody")
    # Before any engine registers, status names the configured peers and says when they pair.
    before = subprocess.run([sys.executable, "-m", "kvd.cli", "status", "--socket", d.socket],
                            capture_output=True, text=True, timeout=60).stdout
    assert (f"warm peers      {p.peer_address}/P, 127.0.0.1:1/nobody (paired once an engine registers)"
            in before), before
    assert list(d.stats().warm_peers_configured) == [f"{p.peer_address}/P", "127.0.0.1:1/nobody"]
    seg, s = _register(d, "D", 0, 1, seed=None)
    try:
        assert wait_until(lambda: d.stats().remote_agents == 2, 30, interval=0.1) is not None, d.log_tail()
        st = d.stats()
        assert st.transfers_done == 0 and st.peers == 1
        assert sorted(r.tp_rank for r in st.remote_workers) == [0, 1], st.remote_workers
        assert "warm_peers 127.0.0.1:1/nobody not reached" in d.log()
        # kvd status: where each warm peer stands, for that worker.
        r = subprocess.run([sys.executable, "-m", "kvd.cli", "status", "--socket", d.socket, "--json"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        warm = {p["engine_id"]: p for p in json.loads(r.stdout)["warm_peers"]}
        assert set(warm) == {"P", "nobody"} and {p["local_engine_id"] for p in warm.values()} == {"D"}
        assert (warm["P"]["state"], warm["P"]["paired_ranks"], warm["P"]["last_error"]) == ("answered", 2, "")
        assert warm["nobody"]["state"] == "trying" and warm["nobody"]["tries"] >= 1
        assert warm["nobody"]["last_error"] and warm["nobody"]["paired_ranks"] == 0
        table = subprocess.run([sys.executable, "-m", "kvd.cli", "status", "--socket", d.socket],
                               capture_output=True, text=True, timeout=60).stdout
        assert any(line.startswith("127.0.0.1:1") and "nobody" in line and "trying" in line
                   for line in table.splitlines()), table
    finally:
        s.close()
        seg.close()
        d.stop()


def test_warm_peers_pairs_a_rank_that_registers_after_its_rank_0(tmp_path):
    """A TP engine's ranks register one after the other: D's warm-up finds
    P's rank 0 and not yet rank 1 (NOT_FOUND), and keeps trying until rank
    1 registers, then pairs it too, before any load (before, the pair
    with rank 1 was tried once and left to the first load)."""
    p = start_daemon(str(tmp_path), "P")
    d = start_daemon(str(tmp_path), "D", "--warm-peers", f"{p.peer_address}/P")
    made = []
    try:
        made.append(_register(p, "P", 0, 2, seed=10))
        made.append(_register(d, "D", 0, 1, seed=None))
        wait_until(lambda: d.stats().remote_agents == 1, 30, "D paired with P's rank 0")
        wait_until(lambda: "rank(s) 1 not paired" in d.log(), 30, "D tried P's rank 1")
        made.append(_register(p, "P", 1, 2, seed=11))
        wait_until(lambda: d.stats().remote_agents == 2, 30, "D paired with P's rank 1 once it registered")
        (row,) = d.stats().warm_peers
        assert (row.state, row.paired_ranks) == ("answered", 2), row
        assert d.stats().transfers_done == 0
    finally:
        for seg, s in made:
            s.close()
            seg.close()
        d.stop()
        p.stop()


def test_warm_peers_pairs_again_after_the_peer_engine_restarts(tmp_path):
    """A warm peer's pairs are kept: not released as idle (``--peer-idle-s``
    2 here), and when its engine goes away (the pair dropped at a liveness
    check: NOT_FOUND) and registers again, D pairs with it again in the
    background, before any load, as at start-up (before, only the first
    pairing was made ahead of need, and the first load after the restart
    paid for first contact)."""
    p = start_daemon(str(tmp_path), "P", "--detach-grace-s", "1")
    # A liveness check every second; the pair is dropped once P's engine is
    # unregistered (its detach grace, 1 s) and no claim can be in flight on
    # it (BOUNDS.max_claim_wait_s + handshake_timeout_s, 7 s).
    d = start_daemon(str(tmp_path), "D", "--warm-peers", f"{p.peer_address}/P", "--peer-check-s", "1",
                     "--handshake-timeout-s", "2", "--peer-idle-s", "2")
    made = []
    try:
        made.append(_register(p, "P", 0, 1, seed=10))
        made.append(_register(d, "D", 0, 1, seed=None))
        wait_until(lambda: d.stats().remote_agents == 1, 60, "D paired with P")
        first = d.stats().remote_workers[0].agent_name
        time.sleep(4.0)  # past peer_idle_s, at least two liveness checks
        assert [r.agent_name for r in d.stats().remote_workers] == [first]
        assert "peer_idle_s" not in d.log()
        seg, s = made.pop(0)
        s.close()
        seg.close()
        wait_until(lambda: "a pair was dropped; pairing again" in d.log(), 60, "D saw the pair dropped")
        assert d.stats().warm_peers[0].state == "trying"
        made.append(_register(p, "P", 0, 1, seed=11))
        wait_until(lambda: [r.agent_name for r in d.stats().remote_workers] not in ([], [first]), 60,
                   "D paired with P's engine again")
        st = d.stats()
        assert len(st.remote_workers) == 1
        (row,) = st.warm_peers
        assert (row.state, row.paired_ranks) == ("answered", 1), row
        assert st.transfers_done == 0
    finally:
        for seg, s in made:
            s.close()
            seg.close()
        d.stop()
        p.stop()


def test_a_warm_peer_whose_rank_0_claims_a_huge_tp_size_is_given_up(tmp_path):
    """A hostile or broken peer's rank 0 answers TP size 1,000,000 (the
    field is a uint32): the daemon gives the peer up at once (a size past
    BOUNDS.max_tp_size), logs it once, and never plans a million ranks on
    its event loop (before: one 7.9 MB log line a second, 6 s of CPU in 12 s,
    and at 8M the loop blocked 18 s)."""
    import asyncio
    import threading

    import grpc

    from kvd.testing.util import free_port
    from kvd.v1 import kvd_pb2_grpc as pb_grpc

    asked = []

    class Hostile(pb_grpc.PeerServiceServicer):
        async def Handshake(self, req, ctx):
            asked.append(req.tp_rank)
            return pb.HandshakeResponse(agent_metadata=b"x", agent_name="a", compat_hash=req.compat_hash,
                                        protocol_version=req.protocol_version, daemon_version="evil",
                                        tp_size=1_000_000, regions=[pb.Region(block_len=1)], region_base_addrs=[1],
                                        memory="DRAM", layout=pb.Layout(kv_layout=pb.KV_LAYOUT_NHD, num_blocks=1))

    port, ready, stop = free_port(), threading.Event(), threading.Event()

    async def serve():
        srv = grpc.aio.server()
        pb_grpc.add_PeerServiceServicer_to_server(Hostile(), srv)
        srv.add_insecure_port(f"127.0.0.1:{port}")
        await srv.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await srv.stop(None)

    t = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    t.start()
    assert ready.wait(30)
    d = start_daemon(str(tmp_path), "D", "--warm-peers", f"127.0.0.1:{port}/P")
    seg, s = _register(d, "D", 0, 1, seed=None)
    try:
        wait_until(lambda: [r.state for r in d.stats().warm_peers] == ["given up"], 30, "the peer given up")
        time.sleep(2.0)  # it is not asked again
        (row,) = d.stats().warm_peers
        assert row.tries == 1 and "tp_size must be in 1.." in row.last_error, row
        assert asked == [0], asked
        log = d.log()
        assert log.count("not tried again") == 1 and len(log) < 200_000, len(log)
    finally:
        s.close()
        seg.close()
        d.stop()
        stop.set()
        t.join(10)


def test_a_handshake_is_answered_while_the_nixl_thread_is_busy():
    """The answer is the agent's kept metadata: it does not wait for the
    NIXL thread (here held by a 3 s job, as a long post or an agent being
    made would hold it), and it is what NIXL itself makes for the agent."""
    import asyncio

    from kvd.core.node import Node
    from kvd.core.state import Segment

    seg = ShmSegment(2 * 16 * 1024)
    layout = Layout(16, BLOCK_SIZE, "NHD", "float16", 2, HEAD_DIM, 1, (1024, 1024))
    regions = [Region(0, 0, 1024, 1024), Region(0, 16 * 1024, 1024, 1024)]

    async def main():
        node = Node()
        node.start()
        try:
            w = await node.register("P", 0, 1, layout, [Segment(seg.name, seg.size)], regions, model="m")
            blocker = asyncio.ensure_future(node.rt.nixl(time.sleep, 3.0))
            await asyncio.sleep(0.1)  # the blocker holds the NIXL thread
            hs = await asyncio.wait_for(node.handshake_info("P", 0, w.compat_hash), 60)
            answered_first = not blocker.done()
            await blocker
            return hs, answered_first, await node.rt.nixl(w.agent._agent.get_agent_metadata)
        finally:
            await node.close()

    try:
        hs, answered_first, fresh = asyncio.run(main())
    finally:
        seg.close()
    assert answered_first
    assert hs.agent_metadata == fresh and hs.agent_name.startswith("kvd-P-r0-")


def test_a_new_pair_reads_the_peers_scratch_page_into_its_own_not_any_engine_memory():
    """A handshake's pair makes its first READ at once (UCX wire-up, off any
    request's path): the peer daemon's scratch page (``warm_up_addr``, here
    filled with a pattern) lands in the reader agent's scratch page; neither
    engine's memory is read or written, and the handle is released."""
    import asyncio

    from kvd.core.nixl_agent import SCRATCH_BYTES
    from kvd.core.node import Node
    from kvd.core.state import Segment

    blen = 1024
    layout = Layout(16, BLOCK_SIZE, "NHD", "float16", 2, HEAD_DIM, 1, (blen, blen))
    regions = [Region(0, 0, blen, blen), Region(0, 16 * blen, blen, blen)]
    src, dst = ShmSegment(2 * 16 * blen), ShmSegment(2 * 16 * blen)
    src.array[:] = 7
    pattern = np.random.default_rng(3).integers(1, 256, SCRATCH_BYTES, dtype=np.uint8)

    async def main():
        p, d = Node(), Node()
        p.start()
        d.start()
        try:
            wp = await p.register("P", 0, 1, layout, [Segment(src.name, src.size)], regions, model="m")
            wd = await d.register("D", 0, 1, layout, [Segment(dst.name, dst.size)], regions, model="m")
            wp.agent._scratch[:] = pattern
            before = bytes(wd.agent._scratch)
            hs = await p.handshake_info("P", 0, wd.compat_hash)
            assert hs.warm_up_addr == wp.agent.scratch_addr != 0
            await d.peers.pair(wd, hs, 0, we_read=True, address="127.0.0.1:1", engine_id="P")
            for _ in range(200):  # a READ still in progress is released by the progress loop
                if not d.rt.warm_ups:
                    break
                await asyncio.sleep(0.01)
            return before, bytes(wd.agent._scratch), len(d.rt.warm_ups), len(d.rt.zombies)
        finally:
            await d.close()
            await p.close()

    try:
        before, after, warm_ups, zombies = asyncio.run(main())
        assert not any(before)
        assert after == pattern.tobytes(), "the peer's scratch page did not land in the reader's"
        assert not dst.array.any() and (src.array == 7).all(), "the warm-up touched an engine's memory"
        assert warm_ups == zombies == 0
    finally:
        src.close()
        dst.close()


def test_a_pair_is_wired_up_only_once_the_warm_up_before_it_ended(monkeypatch):
    """``Peers._wire_ups_ended``: the next agent load waits while a warm-up
    READ of this daemon is in flight (one UCX wire-up at a time), and goes
    on at ``WIRE_UP_WAIT_S`` when one never ends."""
    import asyncio

    from kvd.core import peers as peers_mod
    from kvd.core.limits import Limits
    from kvd.core.runtime import Runtime

    async def main():
        rt = Runtime(Limits())
        p = peers_mod.Peers(rt, None)
        w = type("W", (), {"label": "engine=e rank=0"})()
        rt.warm_ups.append(("agent", "handle", 0.0))
        asyncio.get_running_loop().call_later(0.2, rt.warm_ups.clear)  # the warm-up ends
        phases = {}
        await p._wire_ups_ended(w, phases)
        waited = phases["wire_up_wait"]
        monkeypatch.setattr(peers_mod, "WIRE_UP_WAIT_S", 0.3)
        rt.warm_ups.append(("agent", "handle", 0.0))  # one that never ends
        await p._wire_ups_ended(w, phases)
        return waited, phases["wire_up_wait"]

    waited, bounded = asyncio.run(main())
    assert 0.15 <= waited < 1.5, waited
    assert 0.25 <= bounded < 1.5, bounded


def _keep_warm_harness(monkeypatch, answer):
    """A ``Peers`` whose pairing is faked (``warm`` makes the pair at once)
    and whose sleeps are recorded, not slept: runs ``_keep_warm`` for one
    warm peer, dropping every pair as soon as it is made (a hostile peer),
    until ``rounds`` pairings; returns (the pauses slept, the WarmPeer).
    ``answer(try_number)``: rank 0's answer, or an exception to raise."""
    import asyncio
    import types

    from kvd.core import peers as peers_mod
    from kvd.core.limits import Limits
    from kvd.core.runtime import Runtime
    from kvd.core.state import WorkerPairs

    slept = []
    real_sleep = asyncio.sleep

    async def fake_sleep(s, *a, **k):
        slept.append(s)
        await real_sleep(0)

    monkeypatch.setattr(peers_mod.asyncio, "sleep", fake_sleep)
    monkeypatch.setattr(peers_mod, "check_peer", lambda w, hs, what: None)
    monkeypatch.setattr(peers_mod, "_paired_ranks", lambda w, tp: [0])

    async def main(rounds: int):
        rt = Runtime(Limits(peer_check_s=3600.0))
        w = types.SimpleNamespace(key=("D", 0), label="engine=D rank=0", compat_hash="h", pairs=WorkerPairs())
        rt.workers[w.key] = w
        tries = []

        class Link:
            async def handshake(self, address, engine_id, rank, compat_hash, timeout_s):
                tries.append(rank)
                got = answer(len(tries))
                if isinstance(got, BaseException):
                    raise got
                return types.SimpleNamespace(tp_size=1)

        p = peers_mod.Peers(rt, Link())
        pairings = []

        def warm(w_, address, engine_id, tp_size):
            key = (address, engine_id, 0)
            w_.pairs.remotes[key] = object()
            pairings.append(key)

            def drop():  # the pair is retired at once (Peers.retire's signal)
                w_.pairs.remotes.pop(key, None)
                w_.pairs.warm_peer(address, engine_id).dropped.set()
                if len(pairings) >= rounds:
                    del rt.workers[w.key]  # unregistered: the warm-up ends

            asyncio.get_running_loop().call_soon(drop)
            return []

        p.warm = warm
        await asyncio.wait_for(p._keep_warm(w, "10.0.0.1:7000", "P"), 30)
        return w.pairs.warm[0]

    return slept, main


def test_a_warm_peer_dropped_as_soon_as_paired_is_paired_again_at_a_growing_pause(monkeypatch):
    """A peer whose pairs are dropped at once (two engines of a hostile
    daemon describing one agent name retire each other's pairs) must not
    make the decode daemon handshake and load agents in a loop: the pause
    before each new pairing doubles from 1 s up to 30 s."""
    import asyncio

    slept, main = _keep_warm_harness(monkeypatch, lambda n: None)
    state = asyncio.run(main(8))
    assert slept == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0], slept
    assert state.tries == 8


def test_a_warm_peer_answering_incompatible_after_a_pairing_is_tried_again_not_given_up(monkeypatch):
    """Given up at its first pairing, an incompatible warm peer is tried
    again every 30 s once it has been paired (a rolling upgrade of the
    prefill side briefly answers another hash), and paired again after."""
    import asyncio

    from kvd.core.events import Incompatible

    answers = {2: Incompatible("compat hash x != y"), 3: Incompatible("compat hash x != y")}
    slept, main = _keep_warm_harness(monkeypatch, lambda n: answers.get(n))
    state = asyncio.run(main(2))
    # pause after the drop, two refusals 30 s apart, then the second pairing.
    assert slept == [1.0, 30.0, 30.0], slept
    assert state.state != "given up" and state.tries == 4, state


def test_a_warm_peer_incompatible_at_its_first_pairing_is_given_up(monkeypatch):
    import asyncio

    from kvd.core.events import Incompatible

    slept, main = _keep_warm_harness(monkeypatch, lambda n: Incompatible("compat hash x != y"))
    state = asyncio.run(main(1))
    assert (state.state, state.tries, slept) == ("given up", 1, [])


def test_a_warm_peer_that_refuses_this_daemon_is_logged_as_refused_at_a_growing_pause(monkeypatch, caplog):
    """A warm peer whose daemon answered UNAUTHENTICATED (another peer
    token) was reached: its retry line says "refused", pointing at the
    token, at WARNING the first time; it lasts until an operator acts, so
    it is tried again after 1, 2, 4 .. s, not every second. Only an
    unreachable one says "not reached"."""
    import asyncio
    import logging

    from kvd.core.events import PeerUnavailable

    bad = PeerUnavailable("10.0.0.1:7000: UNAUTHENTICATED: bad peer token proof")
    answers = {1: bad, 2: bad, 3: bad, 4: PeerUnavailable("10.0.0.1:7000: UNAVAILABLE: failed to connect",
                                                          transient=True)}
    slept, main = _keep_warm_harness(monkeypatch, lambda n: answers.get(n))
    with caplog.at_level(logging.INFO, logger="kvd.core"):
        state = asyncio.run(main(1))
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "warm_peers 10.0.0.1:7000/P" in r.getMessage()]
    assert len(lines) == 4, lines
    assert [level for level, _ in lines] == ["WARNING", "INFO", "INFO", "INFO"], lines
    assert all("/P refused (10.0.0.1:7000: UNAUTHENTICATED: bad peer token proof)" in m for _, m in lines[:3]), lines
    assert "/P not reached (10.0.0.1:7000: UNAVAILABLE" in lines[3][1], lines
    assert slept[:4] == [1.0, 2.0, 4.0, 8.0], slept
    assert state.tries == 5, state
