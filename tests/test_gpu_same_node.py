"""The VRAM form of the same-node copy (kvd.core.local_copy, docs/GPU.md) on
a machine without a GPU.

- ``Cudart.copy_rows`` against a stand-in libcudart made of ctypes callbacks
  with CUDA's signatures (host memory standing in for device memory): the
  rows reach ``cudaMemcpyBatchAsync`` as CUDA 13 declares it (no
  ``failIdx``), as 12.8/12.9 declare it (with one), or, on an older
  runtime, one ``cudaMemcpyAsync`` each; all on the runtime's own
  non-blocking stream, then synchronized; every byte lands.
- ``kvd.cuda_copy``: rows cut into segments for the copy kernel (their
  size grows with the load, within bounds); where the kernel cannot load (no driver API, no
  NVRTC) copies take ``cudaMemcpyBatchAsync`` and say why.
- ``LocalCopy.sources``: two VRAM workers of one daemon are a same-node
  copy; DRAM with VRAM goes through NIXL.
- ``LocalCopy._copy`` sends VRAM pieces to the NIXL thread (never the loop)
  as device copies, and a failed device copy ends the copy with the CUDA
  error.

The device copy itself ran on an H200 (benchmarks/gpu_check.py, path
``local``; docs/GPU.md).
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvd import cuda_copy, cudart
from kvd.core import cuda_ipc, local_copy
from kvd.core.limits import Limits
from kvd.core.local_copy import LocalCopy
from kvd.core.runtime import Runtime

c_int, c_uint, c_size, vp = ctypes.c_int, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p
PP, PS = ctypes.POINTER(vp), ctypes.POINTER(c_size)


_ERROR_NAME = ctypes.create_string_buffer(b"cudaErrorInvalidValue")
_ERROR_TEXT = ctypes.create_string_buffer(b"invalid argument")


class StandInLib:
    """A libcudart of ctypes callbacks: ``runtime`` is what
    ``cudaRuntimeGetVersion`` says (13000: batch without ``failIdx``; 12080:
    with; 12000: no batch symbol). Copies are memmoves of host memory;
    ``calls`` records what was called."""

    def __init__(self, runtime: int, driver: int = 13000):
        self.calls: list[tuple] = []
        self.streams = 0
        rt = self

        def fn(restype, argtypes, body):
            return ctypes.CFUNCTYPE(restype, *argtypes)(body)

        def out_int(value):
            def body(p):
                ctypes.cast(p, ctypes.POINTER(c_int))[0] = value
                return 0
            return body

        self.cudaGetDeviceCount = fn(c_int, [vp], out_int(1))
        self.cudaRuntimeGetVersion = fn(c_int, [vp], out_int(runtime))
        self.cudaDriverGetVersion = fn(c_int, [vp], out_int(driver))
        self.batch_fails: dict[int, int] = {}  # call number -> error code
        self.cudaSetDevice = fn(c_int, [c_int], lambda d: rt.calls.append(("set", d)) or 0)
        for name, args in (("cudaGetDevice", [vp]), ("cudaMalloc", [vp, c_size]), ("cudaFree", [vp]),
                           ("cudaMemset", [vp, c_int, c_size]), ("cudaMemcpy", [vp, vp, c_size, c_int]),
                           ("cudaDeviceSynchronize", []), ("cudaGetLastError", []),
                           ("cudaIpcGetMemHandle", [vp, vp]), ("cudaIpcOpenMemHandle", [vp, vp, c_uint]),
                           ("cudaIpcCloseMemHandle", [vp]), ("cudaDeviceGetPCIBusId", [vp, c_int, c_int]),
                           ("cudaStreamDestroy", [vp]), ("cudaDeviceGetAttribute", [vp, c_int, c_int])):
            setattr(self, name, fn(c_int, args, lambda *a: 0))
        # c_char_p results of a callback leak; static strings by address do not.
        self.cudaGetErrorName = fn(vp, [c_int], lambda c: ctypes.addressof(_ERROR_NAME))
        self.cudaGetErrorString = fn(vp, [c_int], lambda c: ctypes.addressof(_ERROR_TEXT))

        def create(p, flags):
            rt.streams += 1
            ctypes.cast(p, ctypes.POINTER(vp))[0] = 0x5000 + rt.streams
            rt.calls.append(("stream", flags))
            return 0

        self.cudaStreamCreateWithFlags = fn(c_int, [vp, c_uint], create)
        self.cudaStreamSynchronize = fn(c_int, [vp], lambda s: rt.calls.append(("sync", s)) or 0)

        def one(dst, src, n, kind, stream):
            ctypes.memmove(dst, src, n)
            rt.calls.append(("async", n, kind, stream))
            return 0

        self.cudaMemcpyAsync = fn(c_int, [vp, vp, c_size, c_int, vp], one)

        def batch(dsts, srcs, sizes, count, attrs, idxs, nattrs, *rest):
            stream = rest[-1]
            nth = sum(1 for c in rt.calls if c[0] in ("batch", "batch-failed"))
            if nth in rt.batch_fails:
                rt.calls.append(("batch-failed", rt.batch_fails[nth]))
                return rt.batch_fails[nth]
            a = ctypes.cast(attrs, ctypes.POINTER(cudart.MemcpyAttributes))[0]
            d, s, n = (ctypes.cast(x, ctypes.POINTER(ctypes.c_uint64)) for x in (dsts, srcs, sizes))
            for i in range(count):
                ctypes.memmove(d[i], s[i], n[i])
            rt.calls.append(("batch", count, a.src_access_order, nattrs, ctypes.cast(idxs, PS)[0], len(rest),
                             stream))
            return 0

        if runtime >= 13000:
            self.cudaMemcpyBatchAsync = fn(c_int, [vp, vp, vp, c_size, vp, vp, c_size, vp], batch)
        elif runtime >= 12080:
            self.cudaMemcpyBatchAsync = fn(c_int, [vp, vp, vp, c_size, vp, vp, c_size, vp, vp], batch)


def rows(n_rows: int, row: int = 4096):
    """Host buffers and shuffled non-overlapping rows between them."""
    rng = np.random.default_rng(n_rows)
    src = np.frombuffer(rng.bytes(n_rows * row), dtype=np.uint8).copy()
    dst = np.zeros(n_rows * row, dtype=np.uint8)
    order = rng.permutation(n_rows)
    d = dst.ctypes.data + np.arange(n_rows, dtype=np.int64) * row
    s = src.ctypes.data + order.astype(np.int64) * row
    expect = src.reshape(n_rows, row)[order].reshape(-1)
    return dst, src, d, s, np.full(n_rows, row, dtype=np.int64), expect


@pytest.mark.parametrize("runtime, mode, fail_idx", [(13000, "batch", 0), (12080, "batch", 1), (12000, "async", None)])
def test_copy_rows_marshals_every_row_to_the_runtime_and_waits(runtime, mode, fail_idx):
    lib = StandInLib(runtime)
    rt = cudart.Cudart(lib, "stand-in")
    assert rt.batch_copies == (mode == "batch")
    dst, src, d, s, n, expect = rows(300)
    rt.copy_rows(0, d, s, n)
    assert np.array_equal(dst, expect), "a row did not land where its descriptor says"
    stream = 0x5001
    assert lib.calls[0] == ("set", 0), "the device is made current first"
    lib.calls[:] = [c for c in lib.calls if c[0] != "set"]
    assert lib.calls[0] == ("stream", cudart.STREAM_NON_BLOCKING), "copies run on a stream of kvd's own"
    assert lib.calls[-1] == ("sync", stream), "copy_rows returns only after the stream is synchronized"
    copies = [c for c in lib.calls if c[0] == mode]
    if mode == "batch":
        # One attribute for every row, sources in stream order; failIdx only where the runtime declares it.
        assert copies == [("batch", 300, 1, 1, 0, fail_idx + 1, stream)]
    else:
        assert len(copies) == 300 and all(c == ("async", 4096, cudart.DEFAULT, stream) for c in copies)
    # Lists work as well as arrays, the stream is made once, and an empty copy queues nothing.
    dst[:] = 0
    lib.calls.clear()
    rt.copy_rows(0, d.tolist(), s.tolist(), n.tolist())
    rt.copy_rows(0, [], [], [])
    assert np.array_equal(dst, expect) and not [c for c in lib.calls if c[0] == "stream"]
    with pytest.raises(ValueError, match="2 destinations, 1 sources"):
        rt.copy_rows(0, [1, 2], [1], [1, 1])


def test_a_large_copy_is_split_into_batches_of_batch_rows(monkeypatch):
    monkeypatch.setattr(cudart, "BATCH_ROWS", 64)
    lib = StandInLib(13000)
    rt = cudart.Cudart(lib, "stand-in")
    dst, src, d, s, n, expect = rows(150, 512)
    rt.copy_rows(0, d, s, n)
    assert np.array_equal(dst, expect)
    assert [c[1] for c in lib.calls if c[0] == "batch"] == [64, 64, 22]
    assert [c[0] for c in lib.calls].count("sync") == 1


def test_an_older_driver_or_a_batch_it_refuses_copies_row_by_row(monkeypatch):
    # A 12.8+ runtime on an older driver (minor-version compatibility): no batch call at all.
    rt = cudart.Cudart(StandInLib(13000, driver=12040), "stand-in")
    assert not rt.batch_copies
    # The driver refuses the call after all (cudaErrorCallRequiresNewerDriver): the rows not yet
    # queued go one by one, every byte lands, and later copies skip the batch.
    monkeypatch.setattr(cudart, "BATCH_ROWS", 64)
    lib = StandInLib(13000)
    lib.batch_fails = {1: 36}
    rt = cudart.Cudart(lib, "stand-in")
    dst, src, d, s, n, expect = rows(150, 512)
    rt.copy_rows(0, d, s, n)
    assert np.array_equal(dst, expect) and not rt.batch_copies
    names = [c[0] for c in lib.calls]
    assert names.count("batch") == 1 and names.count("async") == 150 - 64 and names[-1] == "sync"


def test_a_failed_batch_still_waits_for_what_it_queued(monkeypatch):
    monkeypatch.setattr(cudart, "BATCH_ROWS", 64)
    lib = StandInLib(13000)
    lib.batch_fails = {1: 1}  # cudaErrorInvalidValue on the second call: the first is in flight
    rt = cudart.Cudart(lib, "stand-in")
    dst, src, d, s, n, expect = rows(150, 512)
    with pytest.raises(cudart.CudaError, match="cudaMemcpyBatchAsync"):
        rt.copy_rows(0, d, s, n)
    assert [c[0] for c in lib.calls if c[0] != "set"][-2:] == ["batch-failed", "sync"], \
        "the stream was not synchronized before the error reached the caller"


def test_a_failed_batch_raises_the_cuda_error_and_clears_it():
    lib = StandInLib(13000)
    lib.cudaMemcpyBatchAsync = ctypes.CFUNCTYPE(c_int, vp, vp, vp, c_size, vp, vp, c_size, vp)(lambda *a: 1)
    rt = cudart.Cudart(lib, "stand-in")
    with pytest.raises(cudart.CudaError, match=r"cudaMemcpyBatchAsync: cudaErrorInvalidValue \(1\)"):
        rt.copy_rows(0, [0x1000], [0x2000], [16])


def test_attributes_have_cudas_layout():
    # cudaMemcpyAttributes: enum, two cudaMemLocation {enum, int}, unsigned (driver_types.h, CUDA 12.8+)
    assert ctypes.sizeof(cudart.MemcpyAttributes) == 24
    assert cudart.MemcpyAttributes.flags.offset == 20


# ------------------------------------------------------------- the kernel's table
def test_rows_are_cut_into_segments_in_order_and_empty_rows_dropped():
    seg = cuda_copy.MIN_SEGMENT
    t = cuda_copy.segments([1 << 40, 0x1000, 1 << 41], [1 << 42, 0x9000, 1 << 43], [2 * seg + 16, 0, 10], seg)
    assert t.dtype == np.uint64 and t.shape == (3, 4)
    assert t.T.tolist() == [[1 << 40, 1 << 42, seg], [(1 << 40) + seg, (1 << 42) + seg, seg],
                            [(1 << 40) + 2 * seg, (1 << 42) + 2 * seg, 16], [1 << 41, 1 << 43, 10]]
    # Every byte of every row once: the segments' lengths add up, none is longer than a segment.
    rng = np.random.default_rng(3)
    n = rng.integers(0, 5 * seg, 200)
    d = np.cumsum(np.r_[0, n[:-1]]) + (1 << 30)
    t = cuda_copy.segments(d, d + (1 << 35), n, seg)
    assert int(t[2].sum()) == int(n.sum()) and int(t[2].max()) <= seg and (t[1] - t[0] == 1 << 35).all()
    # Segment sizes: powers of two, a few per block of the grid, within bounds.
    grid = 132 * 8
    assert cuda_copy.segment_bytes(16 << 30, grid) == 2 << 20  # 16 GiB / (1056 x 4): 3.9 MiB, floored
    assert cuda_copy.segment_bytes(1 << 30, grid) == 128 << 10  # 248 KiB, floored
    assert cuda_copy.segment_bytes(1 << 20, grid) == cuda_copy.MIN_SEGMENT
    assert cuda_copy.segment_bytes(1 << 40, grid) == cuda_copy.MAX_SEGMENT
    with pytest.raises(ValueError, match="2 destinations, 1 sources"):
        cuda_copy.segments([1, 2], [1], [1, 1])
    with pytest.raises(ValueError, match="negative"):
        cuda_copy.segments([1], [1], [-1])


def test_without_the_driver_api_row_copies_take_the_batch_and_say_why(monkeypatch):
    lib = StandInLib(13000)
    rt = cudart.Cudart(lib, "stand-in")
    monkeypatch.setattr(rt, "_libcuda", lambda: None)
    copier = cuda_copy.RowCopier(rt)
    assert not copier.kernel and "libcuda" in copier.why and not copier.ready(0)
    dst, src, d, s, n, expect = rows(40)
    copier.copy_rows(0, d, s, n)
    assert np.array_equal(dst, expect) and [c[0] for c in lib.calls].count("batch") == 1


def test_no_nvrtc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_copy, "_nvrtc_candidates", lambda: [str(tmp_path / "libnvrtc.so.13")])
    with pytest.raises(RuntimeError, match="no libnvrtc found .*libnvrtc.so.13.*set KVD_NVRTC"):
        cuda_copy.compile_kernel(9, 0)


def test_a_piece_of_many_rows_is_cut_by_rows_in_order():
    rows_ = (np.arange(10), np.arange(10) + 100, np.ones(10, dtype=np.int64))
    got = local_copy.cap_rows([rows_, ([1], [2], [3])], 4)
    assert [list(p[0]) for p in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [1]]
    assert [list(p[1]) for p in got][:3] == [[100, 101, 102, 103], [104, 105, 106, 107], [108, 109]]
    assert local_copy.VRAM_PIECE_ROWS * 24 <= 8 << 20  # the device table of a piece stays small


# ------------------------------------------------------------- the choice
def worker(key, memory, kind="memfd", device=0, staged=None):
    staged = memory == "VRAM" if staged is None else staged
    return SimpleNamespace(key=key, label=f"{key[0]}", session=SimpleNamespace(epoch=0),
                           mem=SimpleNamespace(memory=memory, staged=staged,
                                               mappings=[SimpleNamespace(kind=kind, device=device)]))


def test_two_vram_workers_of_one_gpu_are_a_same_node_copy_and_mixed_memory_or_gpus_are_not():
    rt = Runtime(Limits())
    try:
        lc = LocalCopy(rt, None)
        lc.addresses = {"127.0.0.1:5000"}
        req = SimpleNamespace(remote_address="127.0.0.1:5000", remote_engine_id="p")
        d = worker(("d", 0), "VRAM")
        for memory, expect in (("VRAM", True), ("DRAM", False)):
            p = worker(("p", 0), memory, kind=cuda_ipc.KIND if memory == "VRAM" else "memfd")
            rt.workers.update({d.key: d, p.key: p})
            got = lc.sources(d, req, [0])
            assert (got == {0: p}) if expect else got is None, (memory, got)
        # Two GPUs: the kernel would need peer access between them; NIXL's UCX moves those.
        p = worker(("p", 0), "VRAM", kind=cuda_ipc.KIND, device=1)
        rt.workers[p.key] = p
        assert lc.sources(d, req, [0]) is None
        # An engine allocation the daemon opened (direct): sized by the engine's word where the
        # driver does not answer, so the kernel copies only the daemon's own mirrors.
        p = worker(("p", 0), "VRAM", kind=cuda_ipc.KIND, staged=False)
        rt.workers[p.key] = p
        assert lc.sources(d, req, [0]) is None
        p = worker(("p", 0), "VRAM", kind=cuda_ipc.KIND)
        rt.workers[p.key] = p
        assert lc.sources(d, req, [0]) == {0: p}
        lc.vram_off = "cudaErrorIllegalAddress"  # a copy lost the context: NIXL (and its errors) from now on
        assert lc.sources(d, req, [0]) is None
        lc.vram_off = ""
        rt.limits.same_node_copy = False
        assert lc.sources(d, req, [0]) is None
    finally:
        rt.shutdown()


def test_vram_pieces_are_device_copies_on_the_nixl_thread_and_a_cuda_error_ends_the_copy(monkeypatch):
    """Even a tiny VRAM piece goes to the NIXL thread (the loop never waits
    on a GPU), through kvd.cuda_copy's copy_rows with the reader's device; a
    CudaError there comes out of _copy (LocalCopy.load turns it into a
    TRANSFER failure) after the thread has passed the load's pieces."""
    import threading

    seen = []

    class Runtime_:
        def copy_rows(self, device, dst, src, ln):
            seen.append((device, list(dst), list(src), list(ln), threading.current_thread().name))
            if dst[0] == 99:
                raise cudart.CudaError("cudaMemcpyBatchAsync", 700, "cudaErrorIllegalAddress", "stand-in")

    monkeypatch.setattr(cuda_ipc, "runtime", lambda: Runtime_())
    monkeypatch.setattr(cuda_copy, "engine", lambda: Runtime_())

    async def scenario():
        rt = Runtime(Limits())
        w, s = worker(("d", 0), "VRAM"), worker(("p", 0), "VRAM")
        rt.workers.update({w.key: w, s.key: s})
        lc = LocalCopy(rt, None)
        loop_thread = threading.current_thread().name
        assert await lc._copy(w, 0, {0: s}, time.monotonic() + 60, [([1], [2], [64]), ([3], [4], [64])], 1) is None
        assert [x[:4] for x in seen] == [(1, [1], [2], [64]), (1, [3], [4], [64])]
        assert all(x[4] != loop_thread for x in seen), "a device copy ran on the event loop"
        with pytest.raises(cudart.CudaError, match="cudaErrorIllegalAddress"):
            await lc._copy(w, 0, {0: s}, time.monotonic() + 60, [([99], [2], [64]), ([5], [6], [64])], 1)
        assert [x[1] for x in seen][2:] in ([[99]], [[99], [5]])  # the second may have been queued behind
        rt.shutdown()

    asyncio.run(scenario())
    assert local_copy.VRAM_PIECE_BYTES >= local_copy.COPY_PIECE_BYTES


def test_a_copy_that_loses_the_cuda_context_fails_its_load_and_is_reported_once():
    """An ordinary CUDA error fails the load (TRANSFER) and nothing else; one
    that loses the context (an illegal address) also turns VRAM same-node
    copies off and calls on_cuda_lost once (the daemon then goes NOT_SERVING,
    kvd.daemon.server), however many loads fail after it."""
    from kvd.core.events import FailureKind

    rt = Runtime(Limits())
    try:
        lc = LocalCopy(rt, None)
        lost = []
        lc.on_cuda_lost = lost.append
        w, req = worker(("d", 0), "VRAM"), SimpleNamespace(request_id="r1")
        kind, why = lc._device_failure(w, req, cudart.CudaError("cuLaunchKernel", 2, "cudaErrorMemoryAllocation", "x"))
        assert kind == FailureKind.TRANSFER and "cudaErrorMemoryAllocation" in why
        assert not lc.vram_off and not lost
        for _ in range(3):
            kind, why = lc._device_failure(w, req, cudart.CudaError("cudaStreamSynchronize", 700,
                                                                    "cudaErrorIllegalAddress", "x"))
            assert kind == FailureKind.TRANSFER and why.startswith("transfer: same-node device copy failed")
        assert "cudaErrorIllegalAddress" in lc.vram_off and len(lost) == 1
        kind, _ = lc._device_failure(w, req, MemoryError("numpy"))  # not a CUDA error: still an answer
        assert kind == FailureKind.TRANSFER
    finally:
        rt.shutdown()


def test_a_lost_cuda_context_turns_the_daemons_health_not_serving(tmp_path):
    """kvd.daemon.server wires LocalCopy.on_cuda_lost to its health
    servicers: every service on both ports answers NOT_SERVING, so that a
    liveness probe restarts the daemon; under systemd with a watchdog its
    keep-alives stop and the watchdog fires at once (``WATCHDOG=trigger``),
    so that systemd restarts it (deploy/systemd/kvd.service)."""
    import socket

    from grpc_health.v1 import health_pb2
    from grpc_health.v1._async import HealthServicer

    from kvd.daemon.sdnotify import Notifier
    from kvd.daemon.server import ENGINE_SERVICE, PEER_SERVICE, Server

    path = str(tmp_path / "notify.sock")

    async def scenario(systemd):
        srv = Server.__new__(Server)  # only the health servicers and the watchdog are used
        srv.peer_health, srv.engine_health = HealthServicer(), HealthServicer()
        srv.notifier, srv._unhealthy = Notifier(path), ""
        for h in (srv.peer_health, srv.engine_health):
            for svc in ("", ENGINE_SERVICE, PEER_SERVICE):
                await h.set(svc, health_pb2.HealthCheckResponse.SERVING)
        srv._watchdog = asyncio.get_running_loop().create_task(srv._keep_alive(0.03))
        await asyncio.sleep(0.05)
        srv._cuda_lost("cudaErrorIllegalAddress")
        await asyncio.sleep(0.1)
        assert srv._watchdog.done()  # no keep-alive after the context is lost
        got = []
        while True:
            try:
                got.append(systemd.recv(4096).decode())
            except BlockingIOError:
                break
        return got, [(await h.Check(health_pb2.HealthCheckRequest(service=svc), None)).status
                     for h in (srv.peer_health, srv.engine_health) for svc in ("", ENGINE_SERVICE, PEER_SERVICE)]

    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(path)
        systemd.setblocking(False)
        sent, health = asyncio.run(scenario(systemd))
    assert set(health) == {health_pb2.HealthCheckResponse.NOT_SERVING}
    assert sent[0] == "WATCHDOG=1" and "WATCHDOG=trigger" in sent[-1], sent
    assert "cudaErrorIllegalAddress" in sent[-1] and sent.count("WATCHDOG=1") == len(sent) - 1
