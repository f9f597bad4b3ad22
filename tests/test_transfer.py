"""Two real daemons, two engine processes, real NIXL/UCX and shared memory:
blocks move byte-exact, with block ids neither contiguous nor ordered."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np

from kvd.v1 import kvd_pb2 as pb
from kvd.testing.sessions import KvShape, Session, one_group, register_request
from kvd.testing.shm import ShmSegment

SHAPE = KvShape(num_layers=4, num_blocks=64, block_len=4096)
REMOTE_IDS = [60, 3, 11, 7, 0, 41, 42, 19]
LOCAL_IDS = [5, 2, 40, 17, 33, 63, 1, 20]


def _prefill_engine(socket_dir_daemon, q_out, q_in):
    """A prefill engine process: fills its KV cache, registers, holds blocks."""
    import grpc  # noqa: F401

    from kvd.testing.daemons import Daemon

    d = Daemon(proc=None, socket=socket_dir_daemon, log_path="")
    seg = ShmSegment(SHAPE.size)
    try:
        seg.array[:] = np.random.default_rng(1).integers(0, 256, SHAPE.size, dtype=np.uint8)
        d.stub().RegisterEngine(register_request("prefill-e", SHAPE, seg), timeout=30)
        s = Session(d, "prefill-e")
        s.send(hold=pb.HoldBlocks(request_id="req-p", groups=one_group(REMOTE_IDS), lease_s=600))
        q_out.put("ready")
        ev = s.next(60)
        q_out.put((ev.WhichOneof("event"), ev.send_done.request_id, ev.send_done.expired))
        q_in.get(timeout=60)
        s.close()
    finally:
        seg.close()


def test_blocks_move_byte_exact_between_two_daemons(daemon_pair):
    prefill, decode = daemon_pair
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_prefill_engine, args=(prefill.socket, q_out, q_in))
    child.start()
    try:
        assert q_out.get(timeout=60) == "ready"
        assert prefill.stats().active_leases == 1
        expected = np.random.default_rng(1).integers(0, 256, SHAPE.size, dtype=np.uint8)
        seg = ShmSegment(SHAPE.size)
        try:
            decode.stub().RegisterEngine(register_request("decode-e", SHAPE, seg), timeout=30)
            s = Session(decode, "decode-e")
            s.send(load=pb.LoadBlocks(
                request_id="req-d", local_groups=one_group(LOCAL_IDS), remote_engine_id="prefill-e",
                remote_address=prefill.peer_address, remote_groups=one_group(REMOTE_IDS), remote_request_id="req-p",
                remote_tp_size=1))
            ev = s.next(30)
            assert ev.WhichOneof("event") == "recv_done", ev
            assert ev.recv_done.request_id == "req-d"
            assert ev.recv_done.bytes == len(LOCAL_IDS) * SHAPE.num_regions * SHAPE.block_len
            for region in range(SHAPE.num_regions):
                for lb, rb in zip(LOCAL_IDS, REMOTE_IDS):
                    off = (region * SHAPE.num_blocks + rb) * SHAPE.block_len
                    assert SHAPE.block_bytes(seg, region, lb) == expected[off:off + SHAPE.block_len].tobytes(), \
                        f"region {region} local block {lb} != remote block {rb}"
                untouched = set(range(SHAPE.num_blocks)) - set(LOCAL_IDS)
                for lb in untouched:
                    assert SHAPE.block_bytes(seg, region, lb) == bytes(SHAPE.block_len)
            # The reader's notification ends the prefill lease long before its 600 s.
            kind, rid, expired = q_out.get(timeout=10)
            assert (kind, rid, expired) == ("send_done", "req-p", False)
            assert prefill.stats().active_leases == 0
            st = decode.stats()
            assert st.transfers_done == 1 and st.bytes_read == ev.recv_done.bytes and st.peers == 1
            s.close()
        finally:
            seg.close()
    finally:
        q_in.put("bye")
        child.join(30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


# One write a line: print() writes the text and its newline apart, so a hit
# on the NIXL thread could land inside another thread's line and be lost.
SINK = """\
import sys
from kvd import tracepoints
tracepoints.install(lambda point, rid, detail, t: sys.stderr.write(f"TP {point} {rid} {detail} {t:.6f}\\n"))
"""


def test_trace_points_mark_each_hop_of_a_load(tmp_path):
    """A sink installed in the decode daemon's process (sitecustomize) sees a
    load at every named point, in path order, with no monkeypatching: the
    gate, the session adapter, the core's pull path and its NIXL post."""
    import os

    from kvd import tracepoints as tp
    from kvd.testing.daemons import start_daemon
    from kvd.testing.sessions import Engine, event_kind

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SINK)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    prefill = start_daemon(str(tmp_path), "prefill")
    decode = start_daemon(str(tmp_path), "decode", env={"PYTHONPATH": path})
    src = dst = None
    try:
        src, dst = Engine(prefill, "tp-prefill", SHAPE), Engine(decode, "tp-decode", SHAPE)
        src.hold("tp-req", REMOTE_IDS)
        dst.load("tp-req", LOCAL_IDS, src, REMOTE_IDS, "tp-req", timeout_s=20)
        assert event_kind(dst.wait("tp-req", 30)) == "recv_done"
    finally:
        for e in (src, dst):
            if e is not None:
                e.close()
        prefill.stop()
        decode.stop()
    hits = [line.split()[1:] for line in decode.log().splitlines() if line.startswith("TP ")]
    mine = [h[0] for h in hits if len(h) > 2 and h[1] == "tp-req"]
    path_order = [tp.SESSION_READ, tp.LOAD, tp.POST, tp.POSTED, tp.EVENT]
    assert [p for p in mine if p in path_order][:len(path_order)] == path_order, mine
    points = {h[0] for h in hits}
    assert {tp.GATE_IN, tp.GATE_OUT} <= points, points
    assert not any(line.startswith("TP ") for line in prefill.log().splitlines())  # no sink there: no hits
