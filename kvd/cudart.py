"""A small ctypes binding of the CUDA runtime (``libcudart``): no torch, no NIXL.

Both sides of the GPU path use it (docs/GPU.md):

- the daemon (``kvd.core.cuda_ipc``) opens the engine's CUDA IPC handles,
  checks whether the opened memory can be re-exported, and allocates its own
  VRAM staging mirrors;
- the engine side (``kvd.shim.memory.cuda_ipc``) opens a daemon's staging mirror
  to copy blocks in and out.

Only what those need is bound, each call with explicit ``argtypes`` /
``restype``. Every failing call raises :class:`CudaError` naming the call,
the CUDA error name and its text. :func:`load` finds the library once per
process and raises :class:`CudaUnavailable` (with the reason) when there is
no libcudart, no driver or no device: the caller decides what that means
(the daemon turns it into ``INVALID_ARGUMENT`` for a CUDA IPC segment).

Which libcudart: ``$KVD_CUDART`` if set; else one already loaded in this
process (torch's, so both share one runtime); else one from a pip
``nvidia-*`` package on ``sys.path``; else the system's (``ldconfig``,
``/usr/local/cuda*``).

Units: bytes and device pointers as Python ints. Calls are thread-safe as
the CUDA runtime is; the current device is per thread, so every call that
needs one takes the device and sets it first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import threading

IPC_HANDLE_SIZE = 64  # sizeof(cudaIpcMemHandle_t)
UUID_SIZE = 16  # sizeof(cudaUUID_t)
# cudaDeviceProp begins with char name[256] and then cudaUUID_t uuid in every
# CUDA release (cuda_runtime_api.h / driver_types.h); the struct itself grows
# between releases, so it is read into a buffer larger than any of them.
_PROP_UUID_OFFSET = 256
_PROP_BUFFER = 8192

# cudaMemcpyKind
HOST_TO_HOST, HOST_TO_DEVICE, DEVICE_TO_HOST, DEVICE_TO_DEVICE, DEFAULT = 0, 1, 2, 3, 4
# cudaIpcOpenMemHandle flags
IPC_LAZY_ENABLE_PEER_ACCESS = 1
# cudaStreamCreateWithFlags: no implicit sync with the legacy default stream
STREAM_NON_BLOCKING = 1
# cudaMemcpySrcAccessOrderStream (driver_types.h): sources read in stream order
_SRC_ACCESS_ORDER_STREAM = 1
# cudaErrorCallRequiresNewerDriver, cudaErrorNotSupported: the batch call is
# not there after all; copies go row by row.
_BATCH_UNSUPPORTED = (36, 801)
#: CUDA errors after which the process's context is lost (every later call
#: fails; only a new process recovers): ECC, illegal address, launch
#: timeout, context destroyed, device assert, the kernel exceptions 714-719,
#: unknown (driver_types.h / cuda.h).
STICKY_ERRORS = frozenset({214, 700, 702, 709, 710, 714, 715, 716, 717, 718, 719, 999})
# Copies per cudaMemcpyBatchAsync call: the API names no limit; one call per
# this many rows keeps each host array small (3 x 128 KiB).
BATCH_ROWS = 16384
# CUpointer_attribute (driver API, cuda.h)
_CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9


class CudaUnavailable(RuntimeError):
    """No usable CUDA runtime here; the message says why (library, driver, devices)."""


class CudaError(RuntimeError):
    """A CUDA runtime call failed.

    Attributes:
        call: the function, e.g. ``"cudaIpcOpenMemHandle"``.
        code: the ``cudaError_t`` value.
        name: e.g. ``"cudaErrorInvalidValue"``.
    """

    def __init__(self, call: str, code: int, name: str, text: str):
        super().__init__(f"{call}: {name} ({code}): {text}")
        self.call, self.code, self.name = call, code, name


class MemcpyAttributes(ctypes.Structure):
    """``cudaMemcpyAttributes`` (CUDA 12.8+, driver_types.h): the source
    access order, two ``cudaMemLocation`` hints (type, id; ignored for
    ``cudaMalloc`` memory) and flags: 24 bytes of 4-byte fields."""

    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_type", ctypes.c_int), ("src_loc_id", ctypes.c_int),
                ("dst_loc_type", ctypes.c_int), ("dst_loc_id", ctypes.c_int), ("flags", ctypes.c_uint)]


class IpcMemHandle(ctypes.Structure):
    """``cudaIpcMemHandle_t``: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_SIZE)]


def _loaded_cudart() -> list[str]:
    """Paths of a libcudart already mapped into this process (e.g. by torch)."""
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if "libcudart.so" in os.path.basename(path) and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def candidates() -> list[str]:
    """Library names/paths :func:`load` tries, in order."""
    out: list[str] = []
    env = os.environ.get("KVD_CUDART", "").strip()
    if env:
        out.append(env)
    out += _loaded_cudart()
    for base in sys.path:
        if not os.path.isabs(base):  # '' or a relative entry: the working directory, maybe anyone's
            continue
        for pattern in ("nvidia/cuda_runtime/lib/libcudart.so*", "nvidia/cu*/lib/libcudart.so*"):
            out += sorted(glob.glob(os.path.join(base, pattern)), reverse=True)
    name = ctypes.util.find_library("cudart")
    if name:
        out.append(name)
    out += ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    out += sorted(glob.glob("/usr/local/cuda*/lib*/libcudart.so*"), reverse=True)
    seen, unique = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return unique


class Cudart:
    """One loaded libcudart. Get it with :func:`load`, not directly.

    Attributes:
        path: the library that was loaded.
        devices: CUDA devices this process sees (>= 1).
    """

    def __init__(self, lib: ctypes.CDLL, path: str):
        self._lib = lib
        self.path = path
        c_int, c_uint, c_size, vp = ctypes.c_int, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p
        sig = {
            "cudaGetDeviceCount": [ctypes.POINTER(c_int)],
            "cudaSetDevice": [c_int],
            "cudaGetDevice": [ctypes.POINTER(c_int)],
            "cudaRuntimeGetVersion": [ctypes.POINTER(c_int)],
            "cudaDriverGetVersion": [ctypes.POINTER(c_int)],
            "cudaMalloc": [ctypes.POINTER(vp), c_size],
            "cudaFree": [vp],
            "cudaMemset": [vp, c_int, c_size],
            "cudaMemcpy": [vp, vp, c_size, c_int],
            "cudaDeviceSynchronize": [],
            "cudaGetLastError": [],
            "cudaIpcGetMemHandle": [ctypes.POINTER(IpcMemHandle), vp],
            "cudaIpcOpenMemHandle": [ctypes.POINTER(vp), IpcMemHandle, c_uint],
            "cudaIpcCloseMemHandle": [vp],
            "cudaDeviceGetPCIBusId": [ctypes.c_char_p, c_int, c_int],
            "cudaDeviceGetAttribute": [ctypes.POINTER(c_int), c_int, c_int],
        }
        for fn, args in sig.items():
            f = getattr(lib, fn)
            f.argtypes = args
            f.restype = c_int
        for fn in ("cudaGetErrorName", "cudaGetErrorString"):
            f = getattr(lib, fn)
            f.argtypes = [c_int]
            f.restype = ctypes.c_char_p
        # CUDA 12 headers map cudaGetDeviceProperties to the _v2 symbol; older
        # libraries export only the plain one. Both start name, uuid.
        self._get_props = getattr(lib, "cudaGetDeviceProperties_v2", None) or getattr(lib, "cudaGetDeviceProperties",
                                                                                    None)
        if self._get_props is not None:
            self._get_props.argtypes = [vp, c_int]
            self._get_props.restype = c_int
        # Optional: a batch of copies in one call (runtime 12.8+). Its
        # signature changed in 13.0 (cuda_runtime_api.h): 12.8/12.9 take a
        # ``size_t *failIdx`` before the stream, 13.x do not.
        for fn, args in (("cudaStreamCreateWithFlags", [ctypes.POINTER(vp), c_uint]),
                         ("cudaStreamSynchronize", [vp]), ("cudaStreamDestroy", [vp]),
                         ("cudaMemcpyAsync", [vp, vp, c_size, c_int, vp])):
            f = getattr(lib, fn)
            f.argtypes = args
            f.restype = c_int
        self._batch = getattr(lib, "cudaMemcpyBatchAsync", None)
        self._batch_fail_idx = False
        if self._batch is not None:
            runtime, driver = ctypes.c_int(0), ctypes.c_int(0)
            lib.cudaRuntimeGetVersion(ctypes.byref(runtime))
            lib.cudaDriverGetVersion(ctypes.byref(driver))
            # A 12.8+ runtime on an older driver (CUDA minor-version
            # compatibility) exports the call, which then fails with
            # cudaErrorCallRequiresNewerDriver: the driver must be 12.8+ too.
            if runtime.value < 12080 or driver.value < 12080:
                self._batch = None
            else:
                self._batch_fail_idx = runtime.value < 13000
                pp, ps = ctypes.POINTER(vp), ctypes.POINTER(c_size)
                self._batch.argtypes = [pp, pp, ps, c_size, ctypes.POINTER(MemcpyAttributes), ps, c_size] + \
                    ([ps] if self._batch_fail_idx else []) + [vp]
                self._batch.restype = c_int
        self._streams: dict[int, int] = {}
        self._streams_lock = threading.Lock()
        self.devices = self._device_count()
        self._uuids: dict[int, bytes] = {}
        self._driver = None  # libcuda, loaded on first use (optional)

    # ----------------------------------------------------------------- errors
    def error_name(self, code: int) -> str:
        name = self._lib.cudaGetErrorName(code)
        return name.decode() if name else f"cudaError {code}"

    def _check(self, call: str, code: int) -> None:
        if code != 0:
            self._lib.cudaGetLastError()  # clear a non-sticky error so the next call starts clean
            text = self._lib.cudaGetErrorString(code)
            raise CudaError(call, code, self.error_name(code), text.decode() if text else "")

    def _device_count(self) -> int:
        n = ctypes.c_int(0)
        code = self._lib.cudaGetDeviceCount(ctypes.byref(n))
        if code != 0:
            text = self._lib.cudaGetErrorString(code)
            raise CudaUnavailable(f"{self.path}: cudaGetDeviceCount: {self.error_name(code)}: "
                                  f"{text.decode() if text else ''}")
        if n.value < 1:
            raise CudaUnavailable(f"{self.path}: no CUDA device visible")
        return n.value

    # ---------------------------------------------------------------- devices
    def set_device(self, device: int) -> None:
        """Makes ``device`` current for this thread.

        Raises:
            CudaError: out of range (the message names the count).
        """
        if not 0 <= device < self.devices:
            raise CudaError("cudaSetDevice", 101, "cudaErrorInvalidDevice",
                            f"device {device} out of range: this process sees {self.devices}")
        self._check("cudaSetDevice", self._lib.cudaSetDevice(device))

    def current_device(self) -> int:
        """This thread's current device (``cudaGetDevice``)."""
        d = ctypes.c_int(0)
        self._check("cudaGetDevice", self._lib.cudaGetDevice(ctypes.byref(d)))
        return d.value

    def compute_capability(self, device: int) -> tuple[int, int]:
        """``(major, minor)`` of ``device`` (9, 0 on an H100 or H200)."""
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        self._check("cudaDeviceGetAttribute", self._lib.cudaDeviceGetAttribute(ctypes.byref(major), 75, device))
        self._check("cudaDeviceGetAttribute", self._lib.cudaDeviceGetAttribute(ctypes.byref(minor), 76, device))
        return major.value, minor.value

    def multiprocessors(self, device: int) -> int:
        """Streaming multiprocessors of ``device`` (132 on an H200)."""
        n = ctypes.c_int(0)
        self._check("cudaDeviceGetAttribute", self._lib.cudaDeviceGetAttribute(ctypes.byref(n), 16, device))
        return n.value

    def versions(self) -> tuple[int, int]:
        """``(runtime, driver)`` versions as CUDA encodes them (``12080`` = 12.8)."""
        rt, drv = ctypes.c_int(0), ctypes.c_int(0)
        self._check("cudaRuntimeGetVersion", self._lib.cudaRuntimeGetVersion(ctypes.byref(rt)))
        self._check("cudaDriverGetVersion", self._lib.cudaDriverGetVersion(ctypes.byref(drv)))
        return rt.value, drv.value

    def pci_bus_id(self, device: int) -> str:
        """``"0000:19:00.0"``: the same GPU has the same id in every process."""
        buf = ctypes.create_string_buffer(32)
        self._check("cudaDeviceGetPCIBusId", self._lib.cudaDeviceGetPCIBusId(buf, 32, device))
        return buf.value.decode()

    def device_uuid(self, device: int) -> bytes:
        """The 16-byte UUID of ``device`` (``cudaDeviceProp.uuid``, what
        ``nvidia-smi -L`` prints as ``GPU-...``): the same GPU, or MIG
        instance, has the same UUID in every process, whatever its
        ``CUDA_VISIBLE_DEVICES``. Cached per device.

        Raises:
            CudaError: ``device`` out of range, or the call failed.
        """
        if device not in self._uuids:
            if not 0 <= device < self.devices:
                raise CudaError("cudaGetDeviceProperties", 101, "cudaErrorInvalidDevice",
                                f"device {device} out of range: this process sees {self.devices}")
            if self._get_props is None:
                raise CudaError("cudaGetDeviceProperties", 0, "missing", f"{self.path} exports no cudaGetDeviceProperties")
            buf = ctypes.create_string_buffer(_PROP_BUFFER)
            self._check("cudaGetDeviceProperties", self._get_props(buf, device))
            self._uuids[device] = buf.raw[_PROP_UUID_OFFSET:_PROP_UUID_OFFSET + UUID_SIZE]
        return self._uuids[device]

    def device_of_uuid(self, uuid: bytes) -> int | None:
        """This process's ordinal of the GPU whose UUID is ``uuid`` (16
        bytes), or None when it does not see that GPU."""
        for device in range(self.devices):
            if self.device_uuid(device) == uuid:
                return device
        return None

    # ----------------------------------------------------------------- memory
    def malloc(self, device: int, size: int) -> int:
        """``cudaMalloc`` on ``device``; returns the device pointer."""
        self.set_device(device)
        p = ctypes.c_void_p()
        self._check("cudaMalloc", self._lib.cudaMalloc(ctypes.byref(p), size))
        return int(p.value or 0)

    def free(self, device: int, ptr: int) -> None:
        self.set_device(device)
        self._check("cudaFree", self._lib.cudaFree(ptr))

    def memset(self, device: int, ptr: int, value: int, size: int) -> None:
        """Synchronous with respect to the host (``cudaMemset`` on the legacy stream, then a sync)."""
        self.set_device(device)
        self._check("cudaMemset", self._lib.cudaMemset(ptr, value, size))
        self.synchronize(device)

    def memcpy(self, device: int, dst: int, src: int, size: int, kind: int = DEFAULT) -> None:
        """``cudaMemcpy`` (synchronous for device/host copies; ``DEFAULT`` infers the direction)."""
        self.set_device(device)
        self._check("cudaMemcpy", self._lib.cudaMemcpy(dst, src, size, kind))

    def synchronize(self, device: int) -> None:
        self.set_device(device)
        self._check("cudaDeviceSynchronize", self._lib.cudaDeviceSynchronize())

    def stream(self, device: int) -> int:
        """This process's own non-blocking stream on ``device`` (made once,
        kept for the process's life): copies on it never wait for, nor
        delay, work an engine queued on the legacy default stream."""
        with self._streams_lock:
            s = self._streams.get(device)
            if s is None:
                self.set_device(device)
                p = ctypes.c_void_p()
                self._check("cudaStreamCreateWithFlags",
                            self._lib.cudaStreamCreateWithFlags(ctypes.byref(p), STREAM_NON_BLOCKING))
                s = self._streams[device] = int(p.value or 0)
            return s

    def memcpy_async(self, device: int, dst: int, src: int, size: int, kind: int = DEFAULT) -> None:
        """``cudaMemcpyAsync`` on :meth:`stream` of ``device`` (from pageable
        host memory it returns once the bytes are staged)."""
        stream = self.stream(device)
        self.set_device(device)
        self._check("cudaMemcpyAsync", self._lib.cudaMemcpyAsync(dst, src, size, kind, stream))

    def stream_synchronize(self, device: int) -> None:
        """Waits for everything queued on :meth:`stream` of ``device``.

        Raises:
            CudaError: a queued copy or kernel failed."""
        self._check("cudaStreamSynchronize", self._lib.cudaStreamSynchronize(self.stream(device)))

    @property
    def batch_copies(self) -> bool:
        """``cudaMemcpyBatchAsync`` is there (runtime 12.8+): :meth:`copy_rows`
        queues its rows in one call per :data:`BATCH_ROWS`, else one
        ``cudaMemcpyAsync`` each."""
        return self._batch is not None

    def copy_rows(self, device: int, dsts, srcs, sizes) -> None:
        """Copies row ``i``: ``sizes[i]`` bytes from ``srcs[i]`` to
        ``dsts[i]`` (device pointers of this process, any device this one
        can reach), on :meth:`stream` of ``device``, and waits for them.

        Rows may run in any order (``cudaMemcpyBatchAsync``'s rule): they
        must not overlap. ``dsts``, ``srcs``, ``sizes``: sequences of ints
        or int64/uint64 numpy arrays of one length.

        Raises:
            CudaError: a copy could not be queued, or failed (the stream's
                error, at the synchronize).
        """
        import numpy as np  # only the copying daemon needs it here

        d, s_, n = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
        if not (len(d) == len(s_) == len(n)):
            raise ValueError(f"copy_rows: {len(d)} destinations, {len(s_)} sources, {len(n)} sizes")
        if not len(n):
            return
        stream = self.stream(device)
        self.set_device(device)
        try:
            i = 0
            if self._batch is not None:
                attrs = MemcpyAttributes(src_access_order=_SRC_ACCESS_ORDER_STREAM)
                zero = ctypes.c_size_t(0)
                fail = ctypes.c_size_t(0)
                pp, ps = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)
                while i < len(n):
                    j = min(len(n), i + BATCH_ROWS)
                    args = [d[i:j].ctypes.data_as(pp), s_[i:j].ctypes.data_as(pp), n[i:j].ctypes.data_as(ps),
                            j - i, ctypes.byref(attrs), ctypes.byref(zero), 1]
                    if self._batch_fail_idx:
                        args.append(ctypes.byref(fail))
                    code = self._batch(*args, stream)
                    if code in _BATCH_UNSUPPORTED:  # this driver lacks it after all: per row from here on
                        self._lib.cudaGetLastError()
                        self._batch = None
                        break
                    self._check("cudaMemcpyBatchAsync", code)
                    i = j
            if self._batch is None:
                for dst, src, size in zip(d[i:].tolist(), s_[i:].tolist(), n[i:].tolist()):
                    self._check("cudaMemcpyAsync", self._lib.cudaMemcpyAsync(dst, src, size, DEFAULT, stream))
        finally:
            # Even after a failure: nothing queued may still be copying when
            # the caller answers the load (its blocks may be reused next).
            code = self._lib.cudaStreamSynchronize(stream)
        self._check("cudaStreamSynchronize", code)

    def read(self, device: int, ptr: int, size: int) -> bytes:
        """Copies ``size`` bytes of device memory at ``ptr`` to the host."""
        buf = ctypes.create_string_buffer(size)
        self.memcpy(device, ctypes.addressof(buf), ptr, size, DEVICE_TO_HOST)
        return buf.raw

    def write(self, device: int, ptr: int, data: bytes) -> None:
        """Copies host ``data`` to device memory at ``ptr``."""
        buf = ctypes.create_string_buffer(bytes(data), len(data))
        self.memcpy(device, ptr, ctypes.addressof(buf), len(data), HOST_TO_DEVICE)

    # -------------------------------------------------------------------- IPC
    def ipc_get_handle(self, device: int, ptr: int) -> bytes:
        """The 64-byte ``cudaIpcMemHandle_t`` of the allocation holding ``ptr``.

        Raises:
            CudaError: the memory cannot be exported through legacy CUDA IPC
                (memory this process itself imported through IPC, VMM/expandable
                segments, managed memory ...).
        """
        self.set_device(device)
        h = IpcMemHandle()
        self._check("cudaIpcGetMemHandle", self._lib.cudaIpcGetMemHandle(ctypes.byref(h), ptr))
        return _raw(h)

    def ipc_open(self, device: int, handle: bytes, flags: int = IPC_LAZY_ENABLE_PEER_ACCESS) -> int:
        """``cudaIpcOpenMemHandle`` on ``device``: maps another process's allocation.

        Returns the device pointer of the allocation's first byte in this process.
        Close it with :meth:`ipc_close` (before the exporter frees it).
        """
        if len(handle) != IPC_HANDLE_SIZE:
            raise ValueError(f"a cudaIpcMemHandle_t is {IPC_HANDLE_SIZE} bytes (got {len(handle)})")
        self.set_device(device)
        h = IpcMemHandle()
        ctypes.memmove(ctypes.addressof(h), handle, IPC_HANDLE_SIZE)
        p = ctypes.c_void_p()
        self._check("cudaIpcOpenMemHandle", self._lib.cudaIpcOpenMemHandle(ctypes.byref(p), h, flags))
        return int(p.value or 0)

    def ipc_close(self, device: int, ptr: int) -> None:
        self.set_device(device)
        self._check("cudaIpcCloseMemHandle", self._lib.cudaIpcCloseMemHandle(ptr))

    # ------------------------------------------------------- driver (optional)
    def _libcuda(self):
        if self._driver is None:
            try:
                drv = ctypes.CDLL("libcuda.so.1")
                drv.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
                drv.cuPointerGetAttribute.restype = ctypes.c_int
                # CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr dptr)
                drv.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                        ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
                drv.cuMemGetAddressRange_v2.restype = ctypes.c_int
                self._driver = drv
            except (OSError, AttributeError):
                self._driver = False
        return self._driver or None

    def legacy_ipc_capable(self, device: int, ptr: int) -> bool | None:
        """The driver's ``CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE`` for ``ptr``.

        What UCX's ``cuda_ipc`` transport needs to export memory to a peer
        (NIXL issue 1754). ``None`` when libcuda or the attribute is not
        available (older drivers).
        """
        drv = self._libcuda()
        if drv is None:
            return None
        self.set_device(device)  # makes the primary context current for the driver call
        val = ctypes.c_int(0)  # the driver writes a bool (1 byte) or int; a zeroed int reads both
        code = drv.cuPointerGetAttribute(ctypes.byref(val), _CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr)
        if code != 0:
            return None
        return bool(val.value)


    def pointer_device(self, device: int, ptr: int) -> int | None:
        """The ordinal of the device whose memory ``ptr`` is
        (``CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL``): a handle opened on
        ``device`` may map another device's memory through peer access.
        ``None`` when libcuda does not answer."""
        drv = self._libcuda()
        if drv is None:
            return None
        self.set_device(device)
        val = ctypes.c_int(-1)
        if drv.cuPointerGetAttribute(ctypes.byref(val), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr) != 0:
            return None
        return val.value

    def allocation_range(self, device: int, ptr: int) -> tuple[int, int] | None:
        """``(base, size in bytes)`` of the allocation that contains device
        pointer ``ptr``, from the driver (``cuMemGetAddressRange``): what a
        handle the daemon opened really maps, whatever size the engine
        claims. ``None`` when libcuda is not available or the driver does
        not know the pointer."""
        drv = self._libcuda()
        if drv is None:
            return None
        self.set_device(device)  # the primary context current for the driver call
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        if drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr) != 0:
            return None
        return base.value, size.value


def format_uuid(uuid: bytes) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` as ``nvidia-smi -L`` writes
    a 16-byte UUID; anything else as its hex (for error messages)."""
    h = bytes(uuid).hex()
    if len(uuid) != UUID_SIZE:
        return f"(bad UUID of {len(uuid)} bytes: {h[:64]})"
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _raw(handle: IpcMemHandle) -> bytes:
    """All 64 bytes of a handle (a ``c_char`` array field read as ``.reserved`` stops at a NUL)."""
    return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_SIZE)


_lock = threading.Lock()
_loaded: Cudart | None = None
_failure: str | None = None


def load(refresh: bool = False) -> Cudart:
    """The process's :class:`Cudart` (found and checked once; ``refresh`` retries).

    Raises:
        CudaUnavailable: no libcudart loads, or it finds no driver or device;
            the message lists what was tried.
    """
    global _loaded, _failure
    with _lock:
        if _loaded is not None and not refresh:
            return _loaded
        if _failure is not None and not refresh:
            raise CudaUnavailable(_failure)
        tried, unusable, handles = [], [], set()
        for c in candidates():
            try:
                lib = ctypes.CDLL(c)
            except OSError as e:
                tried.append(f"{c}: {e}".split("\n")[0])
                continue
            if lib._handle in handles:  # the same library under another name
                continue
            handles.add(lib._handle)
            try:
                _loaded, _failure = Cudart(lib, c), None
                return _loaded
            except CudaUnavailable as e:  # no device or driver: another runtime (e.g. torch's) may match the driver
                unusable.append(str(e))
            except AttributeError as e:
                tried.append(f"{c}: not a CUDA runtime ({e})")
        if unusable:
            _failure = unusable[0] + (f" (and {len(unusable) - 1} other libcudart alike)" if len(unusable) > 1 else "")
        else:
            _failure = "no libcudart found (tried " + "; ".join(tried[:6]) + (" ..." if len(tried) > 6 else "") + \
                "); set KVD_CUDART to its path"
        raise CudaUnavailable(_failure)


def available() -> tuple[bool, str]:
    """``(True, "<path>: N device(s)")`` or ``(False, reason)``; never raises."""
    try:
        rt = load()
    except CudaUnavailable as e:
        return False, str(e)
    return True, f"{rt.path}: {rt.devices} device(s)"
