"""A real daemon on a machine without a GPU, asked for the GPU path (docs/GPU.md).

- A CUDA IPC segment, data_path DIRECT or AUTO: INVALID_ARGUMENT with the
  message "CUDA IPC segments need a GPU and libcudart; this daemon has none",
  nothing registered, and the daemon keeps serving (an SHM engine registers
  and moves blocks right after).
- data_path STAGED with CUDA IPC segments: host-staged fallback, shm mirrors
  the shim can copy into (the one GPU-less way to serve a GPU engine).
- Handshakes say where a worker's regions live: DRAM here.
"""

from __future__ import annotations

import grpc
import pytest

from kvd.core.state import PROTOCOL_VERSION
from kvd import cudart
from kvd.core.cuda_ipc import NO_GPU
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc
from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import KvShape, register_request
from kvd.testing.shm import ShmSegment

SHAPE = KvShape(num_layers=1, num_blocks=8, block_len=4096)

pytestmark = pytest.mark.skipif(cudart.available()[0], reason="this machine has a GPU: the no-GPU answers differ")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(str(tmp_path_factory.mktemp("gpu")), "kvd")
    yield d
    assert d.stop() == 0


def cuda_request(engine_id: str, data_path) -> pb.RegisterEngineRequest:
    return pb.RegisterEngineRequest(
        worker=pb.EngineWorker(engine_id=engine_id, tp_rank=0, tp_size=1), layout=SHAPE.layout(),
        segments=[pb.Segment(kind=pb.MEMORY_KIND_CUDA_IPC, handle=bytes(range(64)), device=0, size=SHAPE.size)],
        regions=SHAPE.regions(), model="m", data_path=data_path)


@pytest.mark.parametrize("data_path", [pb.DATA_PATH_DIRECT, pb.DATA_PATH_AUTO])
def test_cuda_ipc_segment_is_invalid_argument_and_the_daemon_keeps_serving(daemon, data_path):
    with pytest.raises(grpc.RpcError) as e:
        daemon.stub().RegisterEngine(cuda_request("gpu-engine", data_path), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(NO_GPU), e.value.details()
    assert NO_GPU == "CUDA IPC segments need a GPU and libcudart; this daemon has none"
    assert daemon.proc.poll() is None
    st = daemon.stats()
    assert st.engines == 0 and st.registered_bytes == 0
    assert "Traceback" not in daemon.log()


def test_an_shm_engine_registers_and_handshakes_as_dram_after_a_refused_gpu_one(daemon):
    with pytest.raises(grpc.RpcError):
        daemon.stub().RegisterEngine(cuda_request("gpu-engine", pb.DATA_PATH_AUTO), timeout=30)
    seg = ShmSegment(SHAPE.size)
    try:
        seg.fill(5)
        resp = daemon.stub().RegisterEngine(register_request("cpu-engine", SHAPE, seg), timeout=30)
        assert resp.data_path == pb.DATA_PATH_DIRECT
        st = daemon.stats()
        (w,) = st.workers
        assert (w.memory, w.data_path) == ("DRAM", "direct")
        peer = pb_grpc.PeerServiceStub(grpc.insecure_channel(daemon.peer_address))
        hs = peer.Handshake(pb.HandshakeRequest(engine_id="cpu-engine", tp_rank=0, compat_hash=resp.compat_hash,
                                                protocol_version=PROTOCOL_VERSION), timeout=10)
        assert (hs.memory, hs.device) == ("DRAM", 0)
        daemon.stub().UnregisterEngine(pb.UnregisterEngineRequest(worker=pb.EngineWorker(engine_id="cpu-engine"),
                                                                  session_token=resp.session_token), timeout=30)
    finally:
        seg.close()
    assert daemon.stats().engines == 0


def test_staged_cuda_segments_fall_back_to_host_mirrors(daemon):
    resp = daemon.stub().RegisterEngine(cuda_request("staged-gpu", pb.DATA_PATH_STAGED), timeout=30)
    try:
        assert resp.data_path == pb.DATA_PATH_STAGED
        (m,) = resp.staging_segments
        assert m.kind == pb.MEMORY_KIND_SHM and m.size == SHAPE.size and m.name
        (w,) = [x for x in daemon.stats().workers if x.engine_id == "staged-gpu"]
        assert (w.memory, w.data_path) == ("DRAM", "staged")
    finally:
        daemon.stub().UnregisterEngine(pb.UnregisterEngineRequest(worker=pb.EngineWorker(engine_id="staged-gpu"),
                                                                  session_token=resp.session_token), timeout=30)
