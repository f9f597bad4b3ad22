"""kvd.core.cuda_ipc and kvd.cudart on a machine without a GPU (docs/GPU.md).

- The real library: no device here, so every entry point raises the clear
  ``NO_GPU`` error (this machine may even have a libcudart, with no driver).
- The daemon-side logic (open / re-export check / auto -> staged mirrors /
  close / shared mappings / cleanup on failure) against a fake CUDA runtime
  that behaves as CUDA documents: memory a process imported through IPC
  cannot be exported again (NIXL issue 154).
"""

from __future__ import annotations

import itertools

import pytest

from kvd import cudart
from kvd.core import cuda_ipc
from kvd.core.cuda_ipc import NO_GPU, CudaIpcError, CudaIpcMapping, VramMirror, open_segments
from kvd.core.state import Segment

H1, H2 = bytes([1]) * 64, bytes([2]) * 64


def seg(handle=H1, device=0, size=1 << 20, uuid=b""):
    return Segment(name="", size=size, kind=cuda_ipc.KIND, handle=handle, device=device, device_uuid=uuid)


# ------------------------------------------------------------- no GPU here
def test_no_gpu_is_a_clear_error_everywhere():
    ok, why = cudart.available()
    if ok:
        pytest.skip("this machine has a GPU")
    assert why  # names the library tried, or that none was found
    for call in (lambda: open_segments([seg()], "auto"), lambda: CudaIpcMapping(H1, 0, 1024),
                 lambda: VramMirror(1024, 0), cuda_ipc.runtime):
        with pytest.raises(CudaIpcError) as e:
            call()
        assert str(e.value).startswith(NO_GPU)
    assert isinstance(CudaIpcError("x"), ValueError)  # the core maps SegmentError (a ValueError) to INVALID_ARGUMENT


def test_candidates_honour_kvd_cudart(monkeypatch):
    monkeypatch.setenv("KVD_CUDART", "/opt/x/libcudart.so.99")
    assert cudart.candidates()[0] == "/opt/x/libcudart.so.99"


def test_handle_wire_form_is_64_bytes():
    assert cuda_ipc.check_handle(H1) == H1
    with pytest.raises(CudaIpcError, match="segment 3: a CUDA IPC handle is 64 bytes .* got 66"):
        cuda_ipc.check_handle(b"\x03c" + H1, "segment 3")


# ------------------------------------------------------------ fake runtime
class FakeCudart:
    """What the daemon needs of libcudart, with CUDA's IPC rules."""

    devices = 2

    def __init__(self, reexport=False, fail_malloc_after=None):
        self.reexport = reexport
        self.addrs = itertools.count(0x7F0000000000, 1 << 30)
        self.opened = {}      # addr -> (device, handle)
        self.allocated = {}   # addr -> (device, size)
        self.closed = []
        self.freed = []
        self.fail_malloc_after = fail_malloc_after
        self.sizes = {}       # handle -> the size of the allocation it maps (the driver's answer)
        self.foreign = {}     # handle -> the device whose memory it really is (peer access opens it anywhere)

    def _fail(self, call, code, name):
        raise cudart.CudaError(call, code, name, "fake")

    def pointer_device(self, device, ptr):
        handle = self.opened[ptr][1]
        return self.foreign.get(handle, device)

    def device_uuid(self, device):
        return bytes([0xA0 + device]) * cudart.UUID_SIZE

    def device_of_uuid(self, uuid):
        return next((d for d in range(self.devices) if self.device_uuid(d) == uuid), None)

    def ipc_open(self, device, handle):
        if any(v == (device, handle) for v in self.opened.values()):
            self._fail("cudaIpcOpenMemHandle", 208, "cudaErrorAlreadyMapped")
        a = next(self.addrs)
        self.opened[a] = (device, handle)
        return a

    def ipc_close(self, device, ptr):
        self.closed.append(ptr)
        del self.opened[ptr]

    def ipc_get_handle(self, device, ptr):
        if ptr in self.opened and not self.reexport:
            self._fail("cudaIpcGetMemHandle", 1, "cudaErrorInvalidValue")
        return bytes([7]) * 64

    def legacy_ipc_capable(self, device, ptr):
        return None  # no libcuda: the runtime probe decides

    def allocation_range(self, device, ptr):
        size = self.sizes.get(self.opened.get(ptr, (None, None))[1])
        return None if size is None else (ptr, size)  # None: no libcuda, nothing to check against

    def malloc(self, device, size):
        if self.fail_malloc_after is not None and len(self.allocated) >= self.fail_malloc_after:
            self._fail("cudaMalloc", 2, "cudaErrorMemoryAllocation")
        a = next(self.addrs)
        self.allocated[a] = (device, size)
        return a

    def memset(self, device, ptr, value, size):
        pass

    def free(self, device, ptr):
        self.freed.append(ptr)
        del self.allocated[ptr]


@pytest.fixture
def fake(monkeypatch):
    rt = FakeCudart()
    monkeypatch.setattr(cudart, "load", lambda refresh=False: rt)
    cuda_ipc._opened.clear()
    yield rt
    cuda_ipc._opened.clear()


def test_direct_opens_each_handle_and_close_closes_it(fake):
    got = open_segments([seg(H1, 1), seg(H2, 1, 2048)], "direct")
    assert not got.staged and got.device == 1 and got.choice.path == "direct"
    assert [m.memory for m in got.mappings] == ["VRAM", "VRAM"] and len(fake.opened) == 2
    assert got.choice.warning.startswith("direct path requested, but cudaIpcGetMemHandle")  # the hazard, flagged
    for m in got.mappings:
        m.close()
        m.close()
    assert fake.opened == {} and len(fake.closed) == 2


def test_auto_switches_to_daemon_owned_mirrors_when_the_mapping_cannot_be_reexported(fake):
    got = open_segments([seg(H1, 0, 4096), seg(H2, 0, 8192)], "auto")
    assert got.staged and "zero-copy unavailable" in got.choice.reason
    assert "cudaErrorInvalidValue" in got.choice.reason
    assert all(isinstance(m, VramMirror) for m in got.mappings)
    assert [m.size for m in got.mappings] == [4096, 8192] and [len(m.handle) for m in got.mappings] == [64, 64]
    assert fake.opened == {}, "the probed handles are closed again"
    for m in got.mappings:
        m.close()
    assert fake.allocated == {}


def test_auto_stays_direct_when_the_mapping_can_be_reexported(fake):
    fake.reexport = True
    got = open_segments([seg()], "auto")
    assert not got.staged and got.choice.reason.startswith("auto: zero-copy")
    got.mappings[0].close()


def test_staged_checks_each_engine_handle_then_mirrors_it_on_that_device(fake):
    """Staged opens each handle only to check it (the caller holds at least
    that much memory, on that GPU) and closes it before the mirrors are
    made; without a handle, a caller could have the daemon allocate VRAM of
    any size on any GPU it sees."""
    got = open_segments([seg(H1)], "staged")
    assert got.staged and fake.opened == {} and len(fake.closed) == 1 and len(fake.allocated) == 1
    got.mappings[0].close()
    with pytest.raises(CudaIpcError, match="a CUDA IPC handle is 64 bytes"):
        open_segments([seg(b"")], "staged")
    fake.sizes[H1] = 4096
    with pytest.raises(CudaIpcError, match="70368744177664 bytes claimed, but the handle maps an allocation of 4096"):
        open_segments([seg(H1, 0, 64 << 40)], "staged")
    fake.foreign[H2] = 0  # the engine's memory is on GPU 0; it names GPU 1
    with pytest.raises(CudaIpcError, match="the handle maps memory of device 0, not of the device the segment names"):
        open_segments([seg(H2, 1)], "staged")
    assert fake.opened == {} and fake.allocated == {}


def test_one_allocation_named_twice_is_opened_once_and_closed_by_its_last_user(fake):
    a, b = CudaIpcMapping(H1, 0, 100), CudaIpcMapping(H1, 0, 200)
    assert a.addr == b.addr and len(fake.opened) == 1
    a.close()
    assert len(fake.opened) == 1
    b.close()
    assert fake.opened == {}


def test_bad_input_is_refused_and_nothing_stays_open(fake):
    with pytest.raises(CudaIpcError, match="one device"):
        open_segments([seg(H1, 0), seg(H2, 1)], "auto")
    with pytest.raises(CudaIpcError, match="device 5 out of range: this daemon sees 2"):
        open_segments([seg(H1, 5)], "direct")
    with pytest.raises(CudaIpcError, match="segment 1: a CUDA IPC handle is 64 bytes"):
        open_segments([seg(H1), seg(b"short")], "direct")
    assert fake.opened == {}
    with pytest.raises(ValueError):
        open_segments([seg()], "sometimes")


def test_a_segment_larger_than_the_allocation_its_handle_maps_is_refused(fake):
    # An engine that claims more than it shares would have peers READ or WRITE
    # device memory past its allocation: the driver's answer is the bound.
    fake.sizes[H1] = 4096
    with pytest.raises(CudaIpcError, match="8192 bytes claimed, but the handle maps an allocation of 4096 bytes"):
        CudaIpcMapping(H1, 0, 8192)
    assert fake.opened == {} and cuda_ipc._opened == {}, "the refused handle is closed again"
    ok = CudaIpcMapping(H1, 0, 4096)  # exactly the allocation: fine
    ok.close()
    unknown = CudaIpcMapping(H2, 0, 1 << 40)  # no driver answer (no libcuda): the size cannot be checked here
    unknown.close()
    assert fake.opened == {}


def test_a_failed_mirror_frees_the_mirrors_made_before_it(fake):
    fake.fail_malloc_after = 1
    with pytest.raises(CudaIpcError, match="cudaErrorMemoryAllocation") as e:
        open_segments([seg(H1), seg(H2)], "auto")
    assert fake.allocated == {} and fake.opened == {}
    # the H200 check ran out of VRAM this way: the message says what mirrors cost
    assert "second copy of the engine's KV cache" in str(e.value) and "gpu-memory-utilization" in str(e.value)


def test_a_direct_registration_ucx_cannot_export_names_the_cause_and_closes_the_mappings(fake):
    """On an H200, NIXL 1.5.1 refused to register the daemon's mapping of an
    engine's IPC handle (NIXL_ERR_BACKEND: UCX's cuda_ipc packs a key with
    cuIpcGetMemHandle, which fails on an imported mapping). A real daemon
    core and a real NIXL agent here (a CPU-only UCX refuses VRAM the same
    way): the error says why and what to use instead; nothing stays open."""
    import asyncio

    from kvd.core.events import InvalidArgument
    from kvd.core.layout import Layout, Region
    from kvd.core.node import Node

    layout = Layout(16, 16, "NHD", "bfloat16", 8, 128, 1, (1 << 16, 1 << 16))
    regions = [Region(0, 0, 1 << 16, 1 << 16), Region(0, 16 << 16, 1 << 16, 1 << 16)]

    async def main():
        node = Node()
        node.start()
        try:
            with pytest.raises(InvalidArgument) as e:
                await node.register("G", 0, 1, layout, [seg(size=32 << 16)], regions, model="m", staged=False)
            return str(e.value)
        finally:
            await node.close()

    msg = asyncio.run(main())
    assert "NIXL_ERR_BACKEND" in msg and "cannot export again" in msg and "auto or staged" in msg, msg
    assert '"kvd_data_path": "auto" in kv_connector_extra_config' in msg, msg
    assert fake.opened == {} and len(fake.closed) == 1


# ------------------------------------------------------------ GPUs by UUID
def test_a_segment_named_by_uuid_is_opened_on_the_daemons_ordinal_of_that_gpu(fake):
    """An engine in a pod sees its GPU as device 0; a node daemon that sees
    every GPU may call the same one 1: ``device_uuid`` decides, ``device``
    is ignored when it is set (also for the mirrors of the staged path)."""
    gpu1 = fake.device_uuid(1)
    got = open_segments([seg(H1, 0, uuid=gpu1), seg(H2, 0, 2048, uuid=gpu1)], "direct")
    assert got.device == 1 and {d for d, _ in fake.opened.values()} == {1}
    for m in got.mappings:
        m.close()
    got = open_segments([seg(H1, 0, 4096, uuid=gpu1)], "staged")
    assert got.device == 1 and [d for d, _ in fake.allocated.values()] == [1]
    assert cuda_ipc.uuid_of(got.mappings[0].device) == gpu1  # what the shim is told of the mirror
    got.mappings[0].close()
    assert open_segments([seg(H1, 1)], "direct").device == 1  # no UUID (an older shim): the ordinal


def test_a_gpu_the_daemon_does_not_see_or_a_malformed_uuid_is_refused_naming_what_it_sees(fake):
    with pytest.raises(CudaIpcError) as e:
        open_segments([seg(H1, 0, uuid=bytes([0x11]) * 16)], "auto")
    msg = str(e.value)
    assert msg.startswith("segment 0: the engine's GPU GPU-11111111-1111-1111-1111-111111111111 is not visible"), msg
    assert "it sees 2 GPU(s)" in msg and "GPU-a0" not in msg and "CUDA_VISIBLE_DEVICES" in msg  # not listed to callers
    with pytest.raises(CudaIpcError, match="segment 1: device_uuid must be 16 bytes .* got 3"):
        open_segments([seg(H1, 0, uuid=fake.device_uuid(0)), seg(H2, 0, uuid=b"abc")], "direct")
    with pytest.raises(CudaIpcError, match="one device"):
        open_segments([seg(H1, 0, uuid=fake.device_uuid(0)), seg(H2, 0, uuid=fake.device_uuid(1))], "direct")
    assert fake.opened == {} and fake.allocated == {}


def test_cudart_reads_the_uuid_after_the_256_byte_name_of_cudadeviceprop():
    """``Cudart.device_uuid`` against a stand-in library that fills
    cudaDeviceProp as CUDA does (name[256], then the 16-byte uuid)."""
    import ctypes

    class Lib:
        def __init__(self):
            self.props_calls = 0

        def __getattr__(self, name):
            def call(*args):
                return 0
            call.__name__ = name
            self.__dict__[name] = call
            return call

    lib = Lib()

    def count(n):
        ctypes.cast(n, ctypes.POINTER(ctypes.c_int))[0] = 3
        return 0

    def props(buf, device):
        lib.props_calls += 1
        ctypes.memmove(buf, b"NVIDIA H200".ljust(256, b"\0") + bytes([0x40 + device]) * 16, 272)
        return 0

    lib.__dict__["cudaGetDeviceCount"] = count
    lib.__dict__["cudaGetDeviceProperties_v2"] = props
    rt = cudart.Cudart(lib, "fake")
    assert rt.devices == 3 and rt.device_uuid(2) == bytes([0x42]) * 16
    assert rt.device_of_uuid(bytes([0x41]) * 16) == 1 and rt.device_of_uuid(b"x" * 16) is None
    calls = lib.props_calls
    rt.device_uuid(2)
    assert lib.props_calls == calls, "cached per device"
    with pytest.raises(cudart.CudaError, match="out of range"):
        rt.device_uuid(3)
    assert cudart.format_uuid(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_the_shim_names_its_gpu_by_uuid_and_opens_a_mirror_on_its_own_ordinal(monkeypatch):
    """Engine side: the segments carry the GPU's UUID; a daemon's mirror named
    by UUID opens on this process's ordinal of that GPU, and one on a GPU
    this engine does not see is a StagingError naming it."""
    from kvd.shim.memory import cuda_ipc as shim_cuda
    from kvd.shim.memory.staged import StagingError, local_device
    from kvd.v1 import kvd_pb2 as pb

    rt = FakeCudart()
    assert local_device(pb.Segment(device=1), rt) == 1
    assert local_device(pb.Segment(device=1, device_uuid=rt.device_uuid(0)), rt) == 0
    with pytest.raises(StagingError, match="GPU-07070707-.*which this engine does not see"):
        local_device(pb.Segment(device=0, device_uuid=bytes([7]) * 16), rt)
    monkeypatch.setattr(cudart, "load", lambda refresh=False: rt)
    assert shim_cuda.gpu_uuid(1) == rt.device_uuid(1)

    def none(refresh=False):
        raise cudart.CudaUnavailable("no driver")

    monkeypatch.setattr(cudart, "load", none)
    assert shim_cuda.gpu_uuid(0) == b""  # the daemon goes by the ordinal then
