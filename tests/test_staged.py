"""Staged data path: the daemon owns shared staging mirrors, the engine side
copies blocks in and out; the bytes that arrive equal the direct path's."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from kvd.v1 import kvd_pb2 as pb
from kvd.testing.sessions import KvShape, Session, one_group
from kvd.testing.shm import ShmSegment

SHAPE = KvShape(num_layers=2, num_blocks=32, block_len=2048)
REMOTE_IDS = [30, 4, 17, 9, 0]
LOCAL_IDS = [3, 21, 8, 31, 12]


def register(daemon, engine, seg_name, data_path):
    req = pb.RegisterEngineRequest(
        worker=pb.EngineWorker(engine_id=engine, tp_rank=0, tp_size=1), layout=SHAPE.layout(),
        segments=[pb.Segment(kind=pb.MEMORY_KIND_SHM, name=seg_name, size=SHAPE.size)],
        regions=SHAPE.regions(), model="m", data_path=data_path)
    return daemon.stub().RegisterEngine(req, timeout=30)


def map_staging(resp):
    (seg,) = resp.staging_segments
    fd = os.open("/dev/shm" + seg.name, os.O_RDWR)
    try:
        return mmap.mmap(fd, seg.size), seg.name
    finally:
        os.close(fd)


def copy_blocks(src: memoryview, dst: memoryview, ids):
    """What a staged shim does: the same block ids in every region."""
    for region in range(SHAPE.num_regions):
        for b in ids:
            off = (region * SHAPE.num_blocks + b) * SHAPE.block_len
            dst[off:off + SHAPE.block_len] = src[off:off + SHAPE.block_len]


def transfer(pair, p_path, d_path, tag):
    """P holds REMOTE_IDS, D loads them into LOCAL_IDS; returns D's private cache bytes."""
    prefill, decode = pair
    p_cache = np.random.default_rng(3).integers(0, 256, SHAPE.size, dtype=np.uint8)
    d_cache = np.zeros(SHAPE.size, np.uint8)
    segs, maps = [], []
    try:
        # Direct engines share their cache as shm; staged ones keep it private.
        p_seg = ShmSegment(SHAPE.size) if p_path == pb.DATA_PATH_DIRECT else None
        d_seg = ShmSegment(SHAPE.size) if d_path == pb.DATA_PATH_DIRECT else None
        segs += [s for s in (p_seg, d_seg) if s]
        rp = register(prefill, f"P{tag}", p_seg.name if p_seg else "", p_path)
        rd = register(decode, f"D{tag}", d_seg.name if d_seg else "", d_path)
        assert rp.data_path == (p_path or pb.DATA_PATH_STAGED) and rd.data_path == (d_path or pb.DATA_PATH_STAGED)
        if p_seg:
            p_seg.array[:] = p_cache
        else:
            pm, pname = map_staging(rp)
            maps.append(pm)
            copy_blocks(memoryview(p_cache), memoryview(pm), REMOTE_IDS)  # before the hold
        sp, sd = Session(prefill, f"P{tag}"), Session(decode, f"D{tag}")
        sp.send(hold=pb.HoldBlocks(request_id="r", groups=one_group(REMOTE_IDS), lease_s=60))
        sd.send(load=pb.LoadBlocks(request_id="d", local_groups=one_group(LOCAL_IDS), remote_engine_id=f"P{tag}",
                                   remote_address=prefill.peer_address, remote_groups=one_group(REMOTE_IDS),
                                   remote_request_id="r", remote_tp_size=1, timeout_s=20))
        ev = sd.next(30)
        assert ev.WhichOneof("event") == "recv_done", ev
        assert sp.next(10).WhichOneof("event") == "send_done"
        if d_seg:
            d_cache[:] = d_seg.array
        else:
            dm, dname = map_staging(rd)
            maps.append(dm)
            copy_blocks(memoryview(dm), memoryview(d_cache), LOCAL_IDS)  # after the load
        sp.close(), sd.close()
        for d, e in ((prefill, f"P{tag}"), (decode, f"D{tag}")):
            d.stub().UnregisterEngine(pb.UnregisterEngineRequest(worker=pb.EngineWorker(engine_id=e)), timeout=30)
        # The daemon unlinks the mirrors it made.
        for r in (rp, rd):
            for s in r.staging_segments:
                assert not os.path.exists("/dev/shm" + s.name)
        return p_cache, d_cache
    finally:
        for m in maps:
            m.close()
        for s in segs:
            s.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from kvd.testing.daemons import start_daemon

    d = str(tmp_path_factory.mktemp("staged"))
    a, b = start_daemon(d, "prefill"), start_daemon(d, "decode")
    yield a, b
    assert a.stop() == 0 and b.stop() == 0


def _expected(p_cache):
    want = np.zeros(SHAPE.size, np.uint8)
    for region in range(SHAPE.num_regions):
        for lb, rb in zip(LOCAL_IDS, REMOTE_IDS):
            lo, ro = (region * SHAPE.num_blocks + lb) * SHAPE.block_len, (region * SHAPE.num_blocks + rb) * SHAPE.block_len
            want[lo:lo + SHAPE.block_len] = p_cache[ro:ro + SHAPE.block_len]
    return want


def test_staged_bytes_equal_direct_bytes(pair):
    p_cache, direct = transfer(pair, pb.DATA_PATH_DIRECT, pb.DATA_PATH_DIRECT, "dd")
    _, staged = transfer(pair, pb.DATA_PATH_STAGED, pb.DATA_PATH_STAGED, "ss")
    _, mixed = transfer(pair, pb.DATA_PATH_DIRECT, pb.DATA_PATH_STAGED, "ds")
    _, auto = transfer(pair, pb.DATA_PATH_AUTO, pb.DATA_PATH_AUTO, "aa")  # unnamed segments -> staged
    want = _expected(p_cache)
    for name, got in (("direct", direct), ("staged", staged), ("direct->staged", mixed), ("auto", auto)):
        assert np.array_equal(got, want), name
