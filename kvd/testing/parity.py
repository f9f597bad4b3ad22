"""The parity scenarios with the seed connector: one prefill engine's TP
ranks hold, one decode engine's ranks load (heterogeneous TP, HND<->NHD,
MLA, block size remap, vLLM-CPU blocks), every decode element compared with
what it must hold. Played over raw sessions (:mod:`kvd.testing.sessions`);
used by tests/test_parity.py (two daemons, NIXL) and tests/test_same_node.py
(one daemon for both engines: the same-node copy)."""

from __future__ import annotations

import numpy as np

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

    def __init__(self, engine, rank, tp, heads, block_size, layout, model="m", memfd_socket: str = ""):
        self.engine, self.rank, self.tp, self.heads = engine, rank, tp, heads
        self.block_size, self.layout, self.model = block_size, layout, model
        self.nh = 1 if layout == "MLA" else max(1, heads // tp)
        self.h0 = 0 if layout == "MLA" else rank * heads // tp
        self.block_len = self.nh * block_size * HEAD_DIM * 4
        size = NUM_REGIONS * NUM_BLOCKS * self.block_len
        if memfd_socket:  # a sealed memfd handed over to the daemon on that engine socket
            from kvd.testing.memfd import MemfdSegment

            self.seg = MemfdSegment(size, memfd_socket)
        else:
            self.seg = ShmSegment(size)

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
            segments=[self.seg.segment() if hasattr(self.seg, "segment") else
                      pb.Segment(kind=pb.MEMORY_KIND_SHM, name=self.seg.name, size=self.seg.size)],
            regions=regions, model=self.model), timeout=30)
        return Session(daemon, self.engine, self.rank)


def unregister_ranks(daemon, ranks):
    """Unregisters every rank of ``ranks`` (``.engine``, ``.rank``) from ``daemon``."""
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
    # One daemon for both sides: memfds, as the shim hands over, so the
    # daemon copies itself (kvd.core.local_copy copies only sealed memory).
    fd_sock = prefill_daemon.socket if prefill_daemon is decode_daemon else ""
    P = [Rank(f"P{tag}", p, p_tp, heads, p_bs, p_layout, memfd_socket=fd_sock) for p in range(p_tp)]
    D = [Rank(f"D{tag}", r, d_tp, heads, d_bs, d_layout, memfd_socket=fd_sock) for r in range(d_tp)]
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
        unregister_ranks(prefill_daemon, P)
        unregister_ranks(decode_daemon, D)
