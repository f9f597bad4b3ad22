"""Parity with the seed connector, through two real daemons (NIXL/UCX, shm):
heterogeneous TP, KV heads < TP, HND<->NHD, MLA, block size remap, and the
handshake refusing combinations that cannot work. Every decode rank's KV cache
is compared element by element with what it must hold."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.v1 import kvd_pb2 as pb
from kvd.testing.sessions import Session, one_group
from kvd.testing.shm import ShmSegment

HEAD_DIM = 8
NUM_BLOCKS = 24
NUM_REGIONS = 4  # 2 layers x (K, V)
LAYOUTS = {"HND": pb.KV_LAYOUT_HND, "NHD": pb.KV_LAYOUT_NHD, "MLA": pb.KV_LAYOUT_MLA}


class Rank:
    """One TP rank's KV cache in shm: NUM_REGIONS regions of [blocks, ...] float32.

    ``layout="CPU"``: vLLM-CPU's block, K and V of each head in it
    (``cpu_attn.py:411-415``), K as its vec kernels write it, dim-major
    ``[HEAD_DIM // 2, tokens]``, then V ``[tokens, HEAD_DIM // 2]``
    (``kvd.shim.vllm.cpu_kv_probe``); registered as HND with
    ``Layout.kv_in_block`` and ``k_dim_major``. A token's HEAD_DIM values
    are its K (first half) and its V (second half).
    """

    def __init__(self, engine, rank, tp, heads, block_size, layout, model="m"):
        self.engine, self.rank, self.tp, self.heads = engine, rank, tp, heads
        self.block_size, self.layout, self.model = block_size, layout, model
        self.nh = 1 if layout == "MLA" else max(1, heads // tp)
        self.h0 = 0 if layout == "MLA" else rank * heads // tp
        self.block_len = self.nh * block_size * HEAD_DIM * 4
        self.seg = ShmSegment(NUM_REGIONS * NUM_BLOCKS * self.block_len)

    def shape(self):
        if self.layout == "CPU":
            return NUM_BLOCKS, self.nh, self.block_size * HEAD_DIM
        return ((NUM_BLOCKS, self.nh, self.block_size, HEAD_DIM) if self.layout == "HND"
                else (NUM_BLOCKS, self.block_size, self.nh, HEAD_DIM))

    def arrays(self):
        shape = self.shape()
        f = np.frombuffer(self.seg.mm, dtype=np.float32)
        n = int(np.prod(shape))
        return [f[i * n:(i + 1) * n].reshape(shape) for i in range(NUM_REGIONS)]

    def fill(self, block_ids, n_tokens):
        """Writes value(region, head, token, dim) for the prompt's tokens."""
        for reg, arr in enumerate(self.arrays()):
            for tok in range(n_tokens):
                blk, t = block_ids[tok // self.block_size], tok % self.block_size
                for h in range(self.nh):
                    val = 1e5 * reg + 1000 * (self.h0 + h) + tok + np.arange(HEAD_DIM) / 16
                    if self.layout == "CPU":
                        hs, d = HEAD_DIM // 2, np.arange(HEAD_DIM // 2)
                        arr[blk, h, d * self.block_size + t] = val[:hs]                    # K: [hs, tokens]
                        arr[blk, h, self.block_size * hs + t * hs + d] = val[hs:]        # V: [tokens, hs]
                    elif self.layout == "HND":
                        arr[blk, h, t] = val
                    else:
                        arr[blk, t, h] = val

    def expected(self, block_ids, n_tokens):
        want = Rank.__new__(Rank)
        want.__dict__.update(self.__dict__)
        bufs = [np.zeros(self.shape(), np.float32) for _ in range(NUM_REGIONS)]
        want.arrays = lambda: bufs
        want.fill(block_ids, n_tokens)
        return bufs

    def register(self, daemon):
        regions = [pb.Region(segment_index=0, offset=i * NUM_BLOCKS * self.block_len, block_len=self.block_len,
                             block_stride=self.block_len, name=f"r{i}") for i in range(NUM_REGIONS)]
        daemon.stub().RegisterEngine(pb.RegisterEngineRequest(
            worker=pb.EngineWorker(engine_id=self.engine, tp_rank=self.rank, tp_size=self.tp),
            layout=pb.Layout(num_blocks=NUM_BLOCKS, block_size=self.block_size,
                             kv_layout=LAYOUTS["HND" if self.layout == "CPU" else self.layout],
                             kv_in_block=self.layout == "CPU", k_dim_major=self.layout == "CPU",
                             dtype="float32", num_kv_heads=self.nh, head_dim=HEAD_DIM, num_layers=2,
                             block_lens=[self.block_len] * NUM_REGIONS,
                             total_kv_heads=1 if self.layout == "MLA" else self.heads),
            segments=[pb.Segment(kind=pb.MEMORY_KIND_SHM, name=self.seg.name, size=self.seg.size)],
            regions=regions, model=self.model), timeout=30)
        return Session(daemon, self.engine, self.rank)


def _unregister(daemon, ranks):
    for r in ranks:
        daemon.stub().UnregisterEngine(pb.UnregisterEngineRequest(
            worker=pb.EngineWorker(engine_id=r.engine, tp_rank=r.rank)), timeout=30)
        r.seg.close()


def run_pd(prefill_daemon, decode_daemon, p_tp, d_tp, heads, p_layout, d_layout, p_bs, d_bs, tag,
           n_tokens=None):
    """Prefill ranks hold, decode ranks load; returns (events per decode rank, P events)."""
    n_tokens = n_tokens or 3 * d_bs + 1  # n*block+1
    rng = np.random.default_rng(7)
    p_ids = [int(x) for x in rng.permutation(NUM_BLOCKS)[:-(-n_tokens // p_bs)]]
    d_ids = [int(x) for x in rng.permutation(NUM_BLOCKS)[:-(-n_tokens // d_bs)]]
    P = [Rank(f"P{tag}", p, p_tp, heads, p_bs, p_layout) for p in range(p_tp)]
    D = [Rank(f"D{tag}", r, d_tp, heads, d_bs, d_layout) for r in range(d_tp)]
    sessions = []
    try:
        for r in P:
            r.fill(p_ids, n_tokens)
            s = r.register(prefill_daemon)
            s.send(hold=pb.HoldBlocks(request_id="req", groups=one_group(p_ids), lease_s=600))
            sessions.append(s)
        d_events = []
        for r in D:
            s = r.register(decode_daemon)
            sessions.append(s)
            s.send(load=pb.LoadBlocks(request_id="dreq", local_groups=one_group(d_ids), remote_engine_id=f"P{tag}",
                                      remote_address=prefill_daemon.peer_address, remote_groups=one_group(p_ids),
                                      remote_request_id="req", remote_tp_size=p_tp, timeout_s=20))
        for i, r in enumerate(D):
            ev = sessions[p_tp + i].next(30)
            d_events.append(ev)
            if ev.WhichOneof("event") == "recv_done":
                want = r.expected(d_ids, n_tokens)
                for reg, (got, exp) in enumerate(zip(r.arrays(), want)):
                    np.testing.assert_array_equal(got, exp, err_msg=f"decode rank {r.rank} region {reg}")
        # Every P rank ends its 600 s lease: read and notified, or (a pair
        # refused at handshake) freed by D's daemon over PeerService.Notify.
        p_events = [sessions[i].next(10) for i in range(p_tp)]
        return d_events, p_events
    finally:
        for s in sessions:
            s.close()
        _unregister(prefill_daemon, P)
        _unregister(decode_daemon, D)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from kvd.testing.daemons import start_daemon

    d = str(tmp_path_factory.mktemp("parity"))
    a, b = start_daemon(d, "prefill"), start_daemon(d, "decode")
    yield a, b
    assert a.stop() == 0 and b.stop() == 0


@pytest.mark.parametrize("p_tp,d_tp,heads", [(1, 1, 4), (1, 2, 4), (2, 1, 4), (2, 4, 4), (4, 2, 4),
                                             (2, 4, 2), (4, 2, 2)])
def test_tp_pairs_each_decode_rank_gets_its_head_slice(pair, p_tp, d_tp, heads):
    d_events, p_events = run_pd(*pair, p_tp, d_tp, heads, "HND", "HND", 16, 16, f"tp{p_tp}{d_tp}{heads}")
    assert [e.WhichOneof("event") for e in d_events] == ["recv_done"] * d_tp, d_events
    # Every prefill rank frees only after all of its readers notified, well before the 600 s lease.
    assert [(e.WhichOneof("event"), e.send_done.expired) for e in p_events] == [("send_done", False)] * p_tp
    assert pair[0].stats().active_leases == 0


@pytest.mark.parametrize("p_layout,d_layout", [("NHD", "HND"), ("HND", "NHD"), ("NHD", "NHD")])
def test_hnd_nhd_permute_by_descriptors(pair, p_layout, d_layout):
    d_events, _ = run_pd(*pair, 1, 2, 4, p_layout, d_layout, 16, 16, f"lay{p_layout}{d_layout}")
    assert [e.WhichOneof("event") for e in d_events] == ["recv_done"] * 2, d_events


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1)])
def test_mla_one_reader_reads_the_others_notify(pair, p_tp, d_tp):
    d_events, p_events = run_pd(*pair, p_tp, d_tp, 1, "MLA", "MLA", 16, 16, f"mla{p_tp}{d_tp}")
    assert [e.WhichOneof("event") for e in d_events] == ["recv_done"] * d_tp
    assert [e.WhichOneof("event") for e in p_events] == ["send_done"] * p_tp


def test_prefill_block_16_into_decode_block_32(pair):
    d_events, _ = run_pd(*pair, 1, 1, 4, "HND", "HND", 16, 32, "bs1632")
    assert d_events[0].WhichOneof("event") == "recv_done", d_events


@pytest.mark.parametrize("p_tp,d_tp,heads,p_bs,d_bs", [(1, 1, 4, 16, 32), (2, 1, 4, 16, 32), (1, 2, 4, 16, 32),
                                                        (4, 2, 2, 16, 64), (2, 1, 4, 16, 16)])
def test_kv_in_block_prefill_block_16_into_decode_block_32(pair, p_tp, d_tp, heads, p_bs, d_bs):
    """vLLM-CPU blocks (K and V of a head in one block): each (head, K|V,
    source block) lands in its rows of the decode block; run_pd compares
    every element of every block of every decode rank (untouched blocks: 0)."""
    d_events, p_events = run_pd(*pair, p_tp, d_tp, heads, "CPU", "CPU", p_bs, d_bs,
                                f"cpu{p_tp}{d_tp}{heads}{p_bs}{d_bs}")
    assert [e.WhichOneof("event") for e in d_events] == ["recv_done"] * d_tp, d_events
    n_tokens = 3 * d_bs + 1
    per_rank = NUM_REGIONS * -(-n_tokens // p_bs) * max(1, heads // d_tp) * p_bs * HEAD_DIM * 4
    assert [e.recv_done.bytes for e in d_events] == [per_rank] * d_tp
    assert [(e.WhichOneof("event"), e.send_done.expired) for e in p_events] == [("send_done", False)] * p_tp
    assert pair[0].stats().active_leases == 0


def test_kv_in_block_decode_block_smaller_than_prefill_block_is_refused_at_handshake(pair):
    d_events, p_events = run_pd(*pair, 1, 1, 4, "CPU", "CPU", 32, 16, "cpu3216")
    ev = d_events[0]
    assert ev.WhichOneof("event") == "load_failed"
    assert "handshake" in ev.load_failed.reason and "not a multiple" in ev.load_failed.reason, ev
    assert list(ev.load_failed.failed_block_ids)
    # Nobody can read P's blocks: D's daemon frees them now, not at lease end.
    assert [(e.WhichOneof("event"), e.send_done.expired) for e in p_events] == [("send_done", False)]


def test_decode_block_smaller_than_prefill_block_is_refused_at_handshake(pair):
    d_events, p_events = run_pd(*pair, 1, 1, 4, "HND", "HND", 32, 16, "bs3216")
    ev = d_events[0]
    assert ev.WhichOneof("event") == "load_failed"
    assert "handshake" in ev.load_failed.reason and "not a multiple" in ev.load_failed.reason
    assert list(ev.load_failed.failed_block_ids)  # the engine learns which blocks to recompute
    assert [(e.WhichOneof("event"), e.send_done.expired) for e in p_events] == [("send_done", False)]


@pytest.fixture(scope="module")
def push_pair(tmp_path_factory):
    """A prefill daemon and a decode daemon in push mode (prefill WRITEs)."""
    from kvd.testing.daemons import start_daemon

    d = str(tmp_path_factory.mktemp("push"))
    a, b = start_daemon(d, "prefill"), start_daemon(d, "decode", "--transfer-mode", "push")
    yield a, b
    assert a.stop() == 0 and b.stop() == 0


@pytest.mark.parametrize("p_tp,d_tp,heads,p_bs,d_bs", [(1, 1, 4, 16, 16), (1, 2, 4, 16, 16), (2, 1, 4, 16, 16),
                                                        (1, 1, 4, 16, 32)])
def test_push_mode_writes_the_same_bytes_as_pull(push_pair, p_tp, d_tp, heads, p_bs, d_bs):
    # run_pd checks every decode element against the same expected values as
    # the pull tests above: push bytes == pull bytes.
    d_events, p_events = run_pd(*push_pair, p_tp, d_tp, heads, "HND", "HND", p_bs, d_bs,
                                f"push{p_tp}{d_tp}{p_bs}{d_bs}")
    assert [e.WhichOneof("event") for e in d_events] == ["recv_done"] * d_tp, d_events
    assert all(e.recv_done.bytes > 0 for e in d_events)
    assert [(e.WhichOneof("event"), e.send_done.expired) for e in p_events] == [("send_done", False)] * p_tp
    assert push_pair[0].stats().active_leases == 0


def test_push_without_a_lease_fails_the_request(push_pair):
    prefill, decode = push_pair
    r = Rank("Pnolease", 0, 1, 4, 16, "HND")
    d = Rank("Dnolease", 0, 1, 4, 16, "HND")
    sp, sd = r.register(prefill), d.register(decode)
    try:
        sd.send(load=pb.LoadBlocks(request_id="x", local_groups=one_group([1]), remote_engine_id="Pnolease",
                                   remote_address=prefill.peer_address, remote_groups=one_group([2]),
                                   remote_request_id="never-held", remote_tp_size=1, timeout_s=10))
        ev = sd.next(20)
        assert ev.WhichOneof("event") == "load_failed" and "holds no blocks" in ev.load_failed.reason
    finally:
        sp.close(), sd.close()
        _unregister(prefill, [r])
        _unregister(decode, [d])


def test_hma_two_groups_one_sliding_window(pair):
    """vLLM HMA: layer 0 is full attention (group 0), layer 1 sliding window
    (group 1, clipped to its last 2 blocks); each region moves its group's blocks."""
    prefill, decode = pair
    block_len, nb = 4096, NUM_BLOCKS
    groups_of_region = [0, 0, 1, 1]
    p_full, p_win = [5, 9, 2, 17, 11], [17, 11]
    d_full, d_win = [3, 20, 8, 1, 14], [1, 14]

    def register(daemon, engine, seg):
        regions = [pb.Region(segment_index=0, offset=i * nb * block_len, block_len=block_len, block_stride=block_len,
                             name=f"r{i}", group=g) for i, g in enumerate(groups_of_region)]
        daemon.stub().RegisterEngine(pb.RegisterEngineRequest(
            worker=pb.EngineWorker(engine_id=engine, tp_rank=0, tp_size=1),
            layout=pb.Layout(num_blocks=nb, block_size=16, kv_layout=pb.KV_LAYOUT_HND, dtype="float32",
                             num_kv_heads=4, head_dim=16, num_layers=2, block_lens=[block_len] * 4),
            segments=[pb.Segment(kind=pb.MEMORY_KIND_SHM, name=seg.name, size=seg.size)], regions=regions,
            model="hma"), timeout=30)
        return Session(daemon, engine)

    ps, ds = ShmSegment(4 * nb * block_len), ShmSegment(4 * nb * block_len)
    try:
        ps.array[:] = np.random.default_rng(5).integers(1, 256, ps.size, dtype=np.uint8)
        sp, sd = register(prefill, "Phma", ps), register(decode, "Dhma", ds)
        sp.send(hold=pb.HoldBlocks(request_id="h", groups=[pb.BlockIds(ids=p_full), pb.BlockIds(ids=p_win)]))
        sd.send(load=pb.LoadBlocks(request_id="d", remote_engine_id="Phma", remote_address=prefill.peer_address,
                                   remote_request_id="h", remote_tp_size=1,
                                   local_groups=[pb.BlockIds(ids=d_full), pb.BlockIds(ids=d_win)],
                                   remote_groups=[pb.BlockIds(ids=p_full), pb.BlockIds(ids=p_win)]))
        ev = sd.next(30)
        assert ev.WhichOneof("event") == "recv_done", ev
        assert ev.recv_done.bytes == (2 * len(p_full) + 2 * len(p_win)) * block_len
        assert sp.next(10).WhichOneof("event") == "send_done"

        def blk(seg, region, b):
            off = (region * nb + b) * block_len
            return bytes(seg.mm[off:off + block_len])

        for region, g in enumerate(groups_of_region):
            local, remote = (d_full, p_full) if g == 0 else (d_win, p_win)
            for lb, rb in zip(local, remote):
                assert blk(ds, region, lb) == blk(ps, region, rb), (region, lb)
            for lb in set(range(nb)) - set(local):
                assert blk(ds, region, lb) == bytes(block_len), (region, lb)  # outside the window: untouched
        sp.close(), sd.close()
    finally:
        _unregister(prefill, [type("R", (), {"engine": "Phma", "rank": 0, "seg": ps})])
        _unregister(decode, [type("R", (), {"engine": "Dhma", "rank": 0, "seg": ds})])
