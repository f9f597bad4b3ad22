"""Row copies between device pointers: one kernel launch for a whole load.

The same-node copy of two engines' VRAM (``kvd.core.local_copy``) is a list
of rows ``(dst, src, bytes)``, one per block and region: thousands per load.
``cudaMemcpyBatchAsync`` queues them in one call, but the copy engines still
take them one by one: on an H200 each row cost ~3.4 us whatever its size
(64 KiB rows: 14-20 GB/s; 4 MiB rows: 716-837 GB/s against a ~2,100 GB/s
device-to-device copy; docs/GPU.md). A kernel copies them all in one
launch: the rows are cut into *segments* (:func:`segment_bytes`: a few per
thread block of a grid sized to the GPU), each block copies its segments in
turn, in 16-byte words when the row allows (else bytes).

How: the kernel's source (:data:`KERNEL_SOURCE`) is compiled once per
process and compute capability with NVRTC (``libnvrtc``, which every CUDA
build of torch brings) to machine code for the GPU (``sm_XY``: it loads on
an older driver of the same CUDA major version too) and to PTX
(``compute_XY``, the driver compiles it: a GPU NVRTC does not know), loaded
per device with the driver API (``cuModuleLoadData``) and launched with
``cuLaunchKernel`` on the runtime's stream (``kvd.cudart.Cudart.stream``).
The segment table (``uint64 [3, n]``: destinations, sources, lengths) goes
to a scratch buffer on the device first. Where NVRTC or the driver API is
missing, or every build fails to compile or load, copies take
``Cudart.copy_rows`` (``cudaMemcpyBatchAsync``, or one ``cudaMemcpyAsync``
per row) and the log says why (WARNING). No torch: the daemon uses it.
The caller's current device is left as it was (the engine's thread shares
it with torch).

Units: bytes; pointers are this process's device pointers as ints.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import logging
import os
import sys
import threading

import numpy as np

from kvd import cudart

log = logging.getLogger("kvd.cuda")

#: Threads per block and 16-byte words each thread has in flight per step
#: (the kernel's compile-time constants, ``-DKVD_THREADS`` / ``-DKVD_UNROLL``),
#: and blocks per SM the grid is sized for (2,048 threads per SM on Hopper).
#: Chosen on an H200 among 10 shapes (docs/GPU.md, "Row copies"): 1,024 x 4
#: x 2 moved 2 GiB of 1 MiB rows at 1,616-1,851 GB/s in two runs (256 x 4 x
#: 8: 1,363-1,607), 0.87-0.97 of a contiguous device-to-device copy; every
#: shape ran 64 KiB rows at 1,250-1,390 GB/s. (ptxas gives the kernel 40
#: registers, so one 1,024-thread block fits an SM at a time: the grid of
#: 2 per SM runs as two waves; measured as it is.)
THREADS = 1024
UNROLL = 4
BLOCKS_PER_SM = 2
#: Segment sizes: a load's rows are cut into segments of total / (blocks x
#: :data:`WAVES`), rounded down to a power of two within these bounds, so
#: every block of the grid gets several and the table stays small (16 GiB
#: on an H200's grid of 264 blocks: 4 MiB segments, 4,096 table rows, 96 KiB).
MIN_SEGMENT = 32 << 10
MAX_SEGMENT = 4 << 20
WAVES = 4

KERNEL_NAME = "kvd_copy_segments"
KERNEL_SOURCE = r"""
#ifndef KVD_THREADS
#define KVD_THREADS 1024
#endif
#ifndef KVD_UNROLL
#define KVD_UNROLL 4
#endif
extern "C" __global__ void __launch_bounds__(KVD_THREADS)
kvd_copy_segments(const unsigned long long* __restrict__ seg, unsigned long long n)
{
    // seg: [3][n] destinations, sources, lengths (bytes). Each block takes
    // segments blockIdx.x, + gridDim.x, ... (a grid sized to the GPU).
    const unsigned long long t = threadIdx.x, b = KVD_THREADS;
    for (unsigned long long i = blockIdx.x; i < n; i += gridDim.x) {
        const unsigned long long d = seg[i], s = seg[n + i], len = seg[2 * n + i];
        unsigned char* db = (unsigned char*)d;
        const unsigned char* sb = (const unsigned char*)s;
        // Bytes up to the next 16-byte boundary of both, when they share one;
        // 16-byte words; the bytes after the last word.
        const unsigned long long head = (16 - (d & 15)) & 15;
        unsigned long long done = 0;
        if (((d ^ s) & 15) == 0 && len >= head + 16) {
            for (unsigned long long j = t; j < head; j += b) db[j] = sb[j];
            uint4* __restrict__ d4 = (uint4*)(d + head);
            const uint4* __restrict__ s4 = (const uint4*)(s + head);
            const unsigned long long n4 = (len - head) >> 4;
            unsigned long long j = t;
            for (; j + (KVD_UNROLL - 1) * b < n4; j += KVD_UNROLL * b) {
                uint4 w[KVD_UNROLL];
#pragma unroll
                for (int k = 0; k < KVD_UNROLL; ++k) w[k] = __ldg(s4 + j + k * b);
#pragma unroll
                for (int k = 0; k < KVD_UNROLL; ++k) d4[j + k * b] = w[k];
            }
            for (; j < n4; j += b) d4[j] = __ldg(s4 + j);
            done = head + (n4 << 4);
        }
        for (unsigned long long j = done + t; j < len; j += b) db[j] = sb[j];
    }
}
"""


def segment_bytes(total: int, blocks: int, waves: int = WAVES, lo: int = MIN_SEGMENT, hi: int = MAX_SEGMENT) -> int:
    """The segment size for ``total`` bytes on a grid of ``blocks``: a power
    of two in ``[lo, hi]``, about ``total / (blocks * waves)``."""
    want = max(1, total // max(1, blocks * waves))
    size = 1 << (want.bit_length() - 1)
    return max(lo, min(hi, size))


def segments(dsts, srcs, sizes, segment: int = MIN_SEGMENT) -> np.ndarray:
    """The segment table of rows: ``uint64 [3, n]`` (destinations, sources,
    lengths), each row cut into pieces of at most ``segment`` bytes, in
    order; rows of 0 bytes dropped.

    Raises:
        ValueError: the three sequences differ in length, or a size is negative.
    """
    d, s, n = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (dsts, srcs, sizes))
    if not (len(d) == len(s) == len(n)):
        raise ValueError(f"{len(d)} destinations, {len(s)} sources, {len(n)} sizes")
    if len(n) and int(n.min()) < 0:
        raise ValueError("a row of negative size")
    keep = n > 0
    return np.stack(cut_rows(d[keep], s[keep], n[keep], segment)).astype(np.uint64)


def cut_rows(d: np.ndarray, s: np.ndarray, n: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``(destinations, sources, lengths)`` (int64 arrays) with each row
    longer than ``size`` bytes cut into rows of ``size`` (the last shorter),
    in order; the same arrays when none is longer."""
    if not len(n) or int(n.max()) <= size:
        return d, s, n
    cuts = -(-n // size)
    row = np.repeat(np.arange(len(n)), cuts)
    off = (np.arange(len(row)) - np.repeat(np.cumsum(cuts) - cuts, cuts)) * size
    return d[row] + off, s[row] + off, np.minimum(n[row] - off, size)


def _nvrtc_candidates() -> list[str]:
    """Where libnvrtc may be: ``$KVD_NVRTC``, one already loaded (torch's),
    pip's ``nvidia`` packages on ``sys.path`` (absolute entries only: ``''``
    is the working directory), the system's."""
    out: list[str] = []
    env = os.environ.get("KVD_NVRTC", "").strip()
    if env:
        out.append(env)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if os.path.basename(path).startswith("libnvrtc.so") and path not in out:
                    out.append(path)
    except OSError:
        pass
    for base in sys.path:
        if not os.path.isabs(base):
            continue
        for pattern in ("nvidia/cu*/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*"):
            out += [p for p in sorted(glob.glob(os.path.join(base, pattern)), reverse=True)
                    if "builtins" not in os.path.basename(p) and "alt" not in os.path.basename(p)]
    name = ctypes.util.find_library("nvrtc")
    if name:
        out.append(name)
    out += ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    out += sorted(glob.glob("/usr/local/cuda*/lib*/libnvrtc.so*"), reverse=True)
    return list(dict.fromkeys(out))


def _load_nvrtc(c: str):
    """``c`` as a bound NVRTC library (raises OSError/AttributeError if it is not one)."""
    if os.path.isabs(c):
        # NVRTC dlopens libnvrtc-builtins by name at compile time; pip's
        # wheels put it beside libnvrtc with no rpath to it, so it is
        # loaded first from there (then the name resolves to it).
        for b in sorted(glob.glob(os.path.join(os.path.dirname(c), "libnvrtc-builtins.so*"))):
            try:
                ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass
    lib = ctypes.CDLL(c)
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
    for fn, args in (("nvrtcCreateProgram", [ctypes.POINTER(vp), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                             vp, vp]),
                     ("nvrtcCompileProgram", [vp, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]),
                     ("nvrtcGetProgramLogSize", [vp, ctypes.POINTER(sz)]),
                     ("nvrtcGetProgramLog", [vp, ctypes.c_char_p]),
                     ("nvrtcGetPTXSize", [vp, ctypes.POINTER(sz)]),
                     ("nvrtcGetPTX", [vp, ctypes.c_char_p]),
                     ("nvrtcGetCUBINSize", [vp, ctypes.POINTER(sz)]),
                     ("nvrtcGetCUBIN", [vp, ctypes.c_char_p]),
                     ("nvrtcDestroyProgram", [ctypes.POINTER(vp)])):
        getattr(lib, fn).argtypes = args
        getattr(lib, fn).restype = ctypes.c_int
    return lib


def _compile(lib, c: str, arch: str, options) -> bytes:
    """One NVRTC compile of :data:`KERNEL_SOURCE` for ``arch``: machine code
    for ``sm_XY``, PTX for ``compute_XY``. Raises RuntimeError with NVRTC's log."""
    vp, sz = ctypes.c_void_p, ctypes.c_size_t

    def check(call, code):
        if code != 0:
            raise RuntimeError(f"{c}: {call}({arch}): {lib.nvrtcGetErrorString(code).decode()}")

    prog = vp()
    check("nvrtcCreateProgram", lib.nvrtcCreateProgram(ctypes.byref(prog), KERNEL_SOURCE.encode(), b"kvd_copy.cu",
                                                       0, None, None))
    try:
        args = [f"--gpu-architecture={arch}", "-default-device", *options]
        opts = (ctypes.c_char_p * len(args))(*[a.encode() for a in args])
        code = lib.nvrtcCompileProgram(prog, len(args), opts)
        if code != 0:
            n = sz(0)
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            buf = ctypes.create_string_buffer(n.value + 1)
            lib.nvrtcGetProgramLog(prog, buf)
            raise RuntimeError(f"{c}: nvrtcCompileProgram({arch}): {lib.nvrtcGetErrorString(code).decode()}: "
                               f"{buf.value.decode(errors='replace').strip()[:2000]}")
        what = "CUBIN" if arch.startswith("sm_") else "PTX"
        n = sz(0)
        check(f"nvrtcGet{what}Size", getattr(lib, f"nvrtcGet{what}Size")(prog, ctypes.byref(n)))
        buf = ctypes.create_string_buffer(n.value)
        check(f"nvrtcGet{what}", getattr(lib, f"nvrtcGet{what}")(prog, buf))
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_kernel(major: int, minor: int, options: list[str] | tuple[str, ...] = ()) -> list[tuple[str, bytes]]:
    """:data:`KERNEL_SOURCE` built for compute capability ``major.minor``
    with NVRTC ``options`` (e.g. ``-DKVD_THREADS=512``): ``[("sm_XY",
    machine code), ("compute_XY", PTX)]``, each that the first NVRTC able to
    build it made, in the order to try loading them. A NVRTC that fails
    (one too new for an old GPU) leaves the build to the next candidate.

    Raises:
        RuntimeError: no libnvrtc loads, or none built either (every error).
    """
    errors: list[str] = []
    built: dict[str, bytes] = {}
    found = False
    for c in _nvrtc_candidates():
        try:
            lib = _load_nvrtc(c)
        except (OSError, AttributeError) as e:
            errors.append(f"{c}: {e}".split("\n")[0])
            continue
        found = True
        for arch in (f"sm_{major}{minor}", f"compute_{major}{minor}"):
            if arch in built:
                continue
            try:
                built[arch] = _compile(lib, c, arch, options)
            except RuntimeError as e:
                errors.append(str(e))
        if len(built) == 2:
            break
    if not built:
        if not found:
            raise RuntimeError("no libnvrtc found (tried " + "; ".join(errors[:4]) + "); set KVD_NVRTC to its path")
        raise RuntimeError("; ".join(errors[:4]))
    return [(a, built[a]) for a in (f"sm_{major}{minor}", f"compute_{major}{minor}") if a in built]


class RowCopier:
    """Row copies on one process's GPUs: the kernel where it loads, else
    ``Cudart.copy_rows`` (``cudaMemcpyBatchAsync`` or a ``cudaMemcpyAsync``
    per row). Get the process's one with :func:`engine`; the arguments
    (the kernel's shape and segment sizes, see the constants) are for
    measuring others (benchmarks/gpu_check.py).

    Attributes:
        kernel: False once the kernel could not be loaded somewhere (or
            there is no driver API): those devices copy without it.
        why: why not ("" while it loads everywhere).
    """

    def __init__(self, rt: cudart.Cudart, threads: int = THREADS, unroll: int = UNROLL,
                 blocks_per_sm: int = BLOCKS_PER_SM, waves: int = WAVES, min_segment: int = MIN_SEGMENT,
                 max_segment: int = MAX_SEGMENT):
        self.rt = rt
        self.kernel = True
        self.why = ""
        self.threads, self.unroll, self.blocks_per_sm, self.waves = threads, unroll, blocks_per_sm, waves
        self.min_segment, self.max_segment = min_segment, max_segment
        self._sms: dict[int, int] = {}
        self._builds: dict[tuple[int, int], list[tuple[str, bytes]] | str] = {}  # per compute capability
        self._functions: dict[int, int] = {}      # device -> CUfunction
        self._failed: dict[int, str] = {}         # device -> why the kernel is not used there
        self._scratch: dict[int, tuple[int, int]] = {}  # device -> (pointer, bytes)
        self._lock = threading.Lock()
        self._drv = None
        drv = rt._libcuda()
        if drv is None:
            self._give_up(None, "no libcuda.so.1 (driver API) here")
            return
        vp, ui = ctypes.c_void_p, ctypes.c_uint
        try:
            for fn, args in (("cuModuleLoadData", [ctypes.POINTER(vp), ctypes.c_char_p]),
                             ("cuModuleGetFunction", [ctypes.POINTER(vp), vp, ctypes.c_char_p]),
                             ("cuLaunchKernel", [vp, ui, ui, ui, ui, ui, ui, ui, vp, ctypes.POINTER(vp), vp]),
                             ("cuGetErrorName", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])):
                getattr(drv, fn).argtypes = args
                getattr(drv, fn).restype = ctypes.c_int
        except AttributeError as e:
            self._give_up(None, f"libcuda lacks {e}")
            return
        self._drv = drv

    def _give_up(self, device: int | None, why: str) -> None:
        self.kernel, self.why = False, why
        if device is not None:
            self._failed[device] = why
        log.warning("kvd's copy kernel is not used%s; copies take a slower way (the daemon: cudaMemcpyBatchAsync or "
                    "one copy per row; the engine: torch's), which matters for same-node loads and staged copies: %s",
                    "" if device is None else f" on device {device}", why)

    def _driver_check(self, call: str, code: int) -> None:
        if code != 0:
            name = ctypes.c_char_p()
            self._drv.cuGetErrorName(code, ctypes.byref(name))
            raise cudart.CudaError(call, code, (name.value or b"CUDA_ERROR").decode(), "driver API")

    def _function(self, device: int) -> int | None:
        """The kernel on ``device`` (built and loaded on first use), or None
        where it cannot be (logged once; copies without it there)."""
        f = self._functions.get(device)
        if f is not None or self._drv is None or device in self._failed:
            return f
        try:
            cc = self.rt.compute_capability(device)
            builds = self._builds.get(cc)
            if builds is None:
                try:
                    builds = compile_kernel(*cc, [f"-DKVD_THREADS={self.threads}", f"-DKVD_UNROLL={self.unroll}"])
                except RuntimeError as e:
                    builds = str(e)
                self._builds[cc] = builds
            if isinstance(builds, str):
                raise RuntimeError(builds)
            self.rt.stream(device)  # the device's primary context is current on this thread from here on
            self.rt.set_device(device)
            errors = []
            for arch, image in builds:  # machine code first; PTX where the driver cannot load it
                mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
                try:
                    self._driver_check("cuModuleLoadData", self._drv.cuModuleLoadData(ctypes.byref(mod), image))
                    self._driver_check("cuModuleGetFunction",
                                       self._drv.cuModuleGetFunction(ctypes.byref(fn), mod, KERNEL_NAME.encode()))
                except cudart.CudaError as e:
                    errors.append(f"{arch}: {e}")
                    continue
                break
            else:
                raise RuntimeError("; ".join(errors))
            self._sms[device] = self.rt.multiprocessors(device)
        except (RuntimeError, cudart.CudaError) as e:
            self._give_up(device, str(e))
            return None
        self._functions[device] = fn.value
        log.info("kvd's copy kernel (%s) loaded on device %d", arch, device)
        return fn.value

    def _table_on_device(self, device: int, table: np.ndarray) -> int:
        need = table.nbytes
        ptr, size = self._scratch.get(device, (0, 0))
        if size < need:
            if ptr:
                self.rt.free(device, ptr)
                self._scratch.pop(device, None)
            size = max(need, 1 << 20, 2 * size)
            ptr = self.rt.malloc(device, size)
            self._scratch[device] = (ptr, size)
        # From pageable memory: returns once the table is staged, so it may go.
        self.rt.memcpy_async(device, ptr, table.ctypes.data, need, cudart.HOST_TO_DEVICE)
        return ptr

    def _restore(self, device: int) -> None:
        try:
            self.rt.set_device(device)
        except cudart.CudaError as e:  # a lost context: the copy's own error says more
            log.debug("restoring current device %d: %s", device, e)

    def ready(self, device: int) -> bool:
        """The kernel is loaded on ``device`` (built and loaded now if it
        was not); False where it cannot be (:attr:`why`)."""
        with self._lock:
            prev = self.rt.current_device()
            try:
                return self._function(device) is not None
            finally:
                self._restore(prev)

    def copy_rows(self, device: int, dsts, srcs, sizes) -> None:
        """Copies each row (``sizes[i]`` bytes ``srcs[i]`` -> ``dsts[i]``;
        rows must not overlap) on the runtime's stream of ``device`` and
        waits for them, even after a failure (no byte lands after this
        returns or raises).

        Raises:
            ValueError: the sequences differ in length, or a size is negative.
            CudaError: a launch or a copy failed (``cudart.STICKY_ERRORS``:
                this process's CUDA context is lost).
        """
        with self._lock:
            prev = self.rt.current_device()
            try:
                fn = self._function(device)
                if fn is None:
                    self.rt.copy_rows(device, dsts, srcs, sizes)
                    return
                n_rows = np.asarray(sizes, dtype=np.int64)
                grid = self._sms[device] * self.blocks_per_sm
                seg = segment_bytes(int(n_rows.sum()), grid, self.waves, self.min_segment, self.max_segment)
                table = np.ascontiguousarray(segments(dsts, srcs, n_rows, seg))
                n = table.shape[1]
                if n == 0:
                    return
                stream = self.rt.stream(device)
                try:
                    ptr = self._table_on_device(device, table)
                    arg_table, arg_n = ctypes.c_uint64(ptr), ctypes.c_uint64(n)
                    params = (ctypes.c_void_p * 2)(ctypes.addressof(arg_table), ctypes.addressof(arg_n))
                    self.rt.set_device(device)
                    self._driver_check("cuLaunchKernel", self._drv.cuLaunchKernel(
                        fn, min(n, grid), 1, 1, self.threads, 1, 1, 0, stream, params, None))
                finally:
                    self.rt.stream_synchronize(device)
            finally:
                self._restore(prev)


_engine: RowCopier | None = None
_engine_lock = threading.Lock()


def kernel_devices() -> int:
    """Devices this process has loaded the kernel on (0 before any GPU copy,
    or where it could not load: the log says why). Never makes the copier."""
    e = _engine
    return len(e._functions) if e is not None else 0


def engine() -> RowCopier:
    """This process's :class:`RowCopier` (made on first use).

    Raises:
        CudaUnavailable: no CUDA runtime (``kvd.cudart.load``).
    """
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = RowCopier(cudart.load())
        return _engine
