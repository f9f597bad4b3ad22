"""Mapping engine GPU memory into the daemon: CUDA IPC handles (docs/GPU.md).

The shim exports each KV cache allocation as a ``cudaIpcMemHandle_t``
(``kvd.shim.memory.cuda_ipc``); the daemon opens it here
(``cudaIpcOpenMemHandle``) on the segment's device and the core registers the
mapping with NIXL as VRAM. It closes the mapping when the worker goes away,
after NIXL has deregistered it.

The known hazard (docs/DESIGN.md "Memory sharing", NIXL issues 154 and 1754): UCX's
``cuda_ipc`` transport exports registered memory to a peer with
``cuIpcGetMemHandle``. Memory this daemon *imported* through CUDA IPC cannot
be exported again that way, so the transfer silently takes a slow path
(GPUDirect RDMA through a NIC at best, UCX's software emulation over TCP at
worst) with correct bytes. :func:`open_segments` therefore checks each opened
mapping (:func:`reexport_check`) and, under ``data_path = auto``, switches the
worker to the staged path: daemon-owned ``cudaMalloc`` mirrors
(:class:`VramMirror`), which the daemon's UCX *can* export, and which the shim
opens to copy blocks in and out. ``kvd.core.path_select`` makes the choice.

Nothing here imports NIXL or torch; all CUDA calls go through
``kvd.cudart``. On a machine without a GPU every entry point raises
:class:`CudaIpcError` with :data:`NO_GPU` (the gRPC adapter makes it
``INVALID_ARGUMENT``); nothing crashes.

Units: bytes; device ordinals as the daemon's CUDA runtime numbers them
(run the daemon with the same ``CUDA_VISIBLE_DEVICES`` as the engines, or
none: see docs/GPU.md).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kvd import cudart
from kvd.core import path_select
from kvd.core.memory import SegmentError

log = logging.getLogger("kvd.core.cuda_ipc")

#: ``kvd.core.state.Segment.kind`` of a CUDA IPC segment.
KIND = "cuda_ipc"

#: The message a GPU-less daemon answers a CUDA IPC segment with.
NO_GPU = "CUDA IPC segments need a GPU and libcudart; this daemon has none"


class CudaIpcError(SegmentError):
    """A CUDA IPC segment cannot be opened or used; the message says why."""


def runtime() -> cudart.Cudart:
    """The CUDA runtime, or :class:`CudaIpcError` (``NO_GPU`` and the reason)."""
    try:
        return cudart.load()
    except cudart.CudaUnavailable as e:
        raise CudaIpcError(f"{NO_GPU} ({e})") from None


def wants_vram(staged: bool | None) -> bool:
    """Whether CUDA IPC segments with this ``staged`` request are handled here.

    False only for an explicitly staged worker on a daemon without a GPU:
    the core then gives it shm mirrors (the shim copies through host memory).
    Direct and auto need the GPU (:func:`open_segments` says so).
    """
    return staged is not True or cudart.available()[0]


def check_handle(handle: bytes, what: str = "segment") -> bytes:
    """Validates the wire form of a handle: exactly 64 bytes (``cudaIpcMemHandle_t``)."""
    if len(handle) != cudart.IPC_HANDLE_SIZE:
        raise CudaIpcError(f"{what}: a CUDA IPC handle is {cudart.IPC_HANDLE_SIZE} bytes (cudaIpcMemHandle_t), "
                           f"got {len(handle)}")
    return bytes(handle)


def resolve_device(device: int, uuid: bytes, what: str = "CUDA IPC segment") -> int:
    """This daemon's ordinal of a segment's GPU: the one whose UUID is
    ``uuid`` (``Segment.device_uuid``), else ``device`` as sent.

    An engine names its GPU by UUID because ordinals follow each process's
    ``CUDA_VISIBLE_DEVICES`` (a pod given GPU 3 calls it 0; a node daemon
    that sees every GPU calls it 3).

    Raises:
        CudaIpcError: a UUID that is not 16 bytes, or a GPU this daemon does
            not see (the message lists the ones it does).
    """
    if not uuid:
        return device
    if len(uuid) != cudart.UUID_SIZE:
        raise CudaIpcError(f"{what}: device_uuid must be {cudart.UUID_SIZE} bytes (cudaUUID_t), got {len(uuid)}")
    rt = runtime()
    try:
        found = rt.device_of_uuid(bytes(uuid))
        if found is not None:
            return found
    except cudart.CudaError as e:
        raise CudaIpcError(f"{what}: cannot read this daemon's GPU UUIDs: {e}") from None
    # The daemon's GPUs are not listed to the caller: `nvidia-smi -L` on the node does that for an operator.
    raise CudaIpcError(f"{what}: the engine's GPU {cudart.format_uuid(uuid)} is not visible to this daemon "
                       f"(it sees {rt.devices} GPU(s)); give the daemon the engines' GPUs (CUDA_VISIBLE_DEVICES, "
                       "or the container's device list)")


def uuid_of(device: int) -> bytes:
    """The UUID of this daemon's GPU ``device`` for a staging segment the
    shim opens (it finds its own ordinal of that GPU by it); empty when the
    runtime cannot tell (the shim then uses ``device``)."""
    try:
        return runtime().device_uuid(device)
    except (cudart.CudaError, CudaIpcError, AttributeError):
        return b""


# ------------------------------------------------------------------ mappings
class _Opened:
    """One handle opened in this process, shared by every mapping of it."""

    def __init__(self, addr: int, refs: int = 1):
        self.addr = addr
        self.refs = refs


# CUDA lets a process open one handle once per device context: a second open of
# the same allocation (two workers naming one engine allocation, or a worker
# re-registered before the first is closed) shares the first mapping.
_opened: dict[tuple[bytes, int], _Opened] = {}
_opened_lock = threading.Lock()


class CudaIpcMapping:
    """Another process's GPU allocation, opened in the daemon.

    Args:
        handle: the 64-byte ``cudaIpcMemHandle_t`` of the allocation.
        device: the device ordinal it lives on.
        size: bytes the daemon may touch from the allocation's first byte
            (the shim sends ``storage offset + storage bytes``); checked
            against what the handle really maps (the driver's
            ``cuMemGetAddressRange``) where libcuda answers: an engine that
            claims more would have the daemon register, and peers read or
            write, device memory past its allocation.

    Attributes:
        addr: device pointer of the allocation's byte 0 in this process.
        size, device, handle: as given.
        memory: ``"VRAM"`` (the NIXL memory type to register it as).
        reexport: :class:`path_select.Evidence` of whether this daemon's UCX
            could export it to a peer through ``cuda_ipc``.

    Raises:
        CudaIpcError: no GPU, a bad handle or device, the open failed, or
            ``size`` is larger than the allocation the handle maps.
    """

    memory = "VRAM"

    def __init__(self, handle: bytes, device: int, size: int):
        rt = runtime()
        handle = check_handle(handle)
        if size <= 0:
            raise CudaIpcError(f"CUDA IPC segment: size must be > 0 (got {size})")
        if not 0 <= device < rt.devices:
            raise CudaIpcError(f"CUDA IPC segment: device {device} out of range: this daemon sees {rt.devices} "
                               "device(s) (run it with the engines' CUDA_VISIBLE_DEVICES)")
        key = (handle, device)
        with _opened_lock:
            o = _opened.get(key)
            if o is None:
                try:
                    addr = rt.ipc_open(device, handle)
                except cudart.CudaError as e:
                    raise CudaIpcError(f"CUDA IPC segment on device {device}: {e} (is the engine alive, and on "
                                       "this node, in this IPC namespace?)") from None
                o = _opened[key] = _Opened(addr, 0)
            o.refs += 1
        self._rt = rt
        self.handle = handle
        self.device = device
        self.size = size
        self.addr = o.addr
        got = rt.allocation_range(device, self.addr)
        if got is not None and self.addr + size > got[0] + got[1]:
            mapped = got[0] + got[1] - self.addr
            self.close()
            raise CudaIpcError(f"CUDA IPC segment on device {device}: {size} bytes claimed, but the handle maps an "
                               f"allocation of {mapped} bytes from its start")
        # The open maps another device's memory too (peer access): an engine
        # must not have the daemon work on a GPU its memory is not on.
        owner = rt.pointer_device(device, self.addr)
        if owner is not None and owner != device:
            self.close()
            raise CudaIpcError(f"CUDA IPC segment: the handle maps memory of device {owner}, not of the device "
                               f"the segment names ({device} here)")
        self.reexport = reexport_check(rt, device, self.addr)

    def read(self, offset: int, length: int) -> bytes:
        """Copies ``length`` bytes at ``offset`` to the host (checks and tests)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise CudaIpcError(f"read [{offset}, {offset + length}) outside segment of {self.size} bytes")
        return self._rt.read(self.device, self.addr + offset, length)

    def close(self) -> None:
        """Closes the mapping (the last user of a handle closes it); idempotent."""
        if not self.addr:
            return
        key = (self.handle, self.device)
        with _opened_lock:
            o = _opened.get(key)
            if o is not None:
                o.refs -= 1
                if o.refs <= 0:
                    del _opened[key]
                    try:
                        self._rt.ipc_close(self.device, o.addr)
                    except cudart.CudaError as e:
                        log.warning("closing CUDA IPC mapping on device %d: %s", self.device, e)
        self.addr = 0


class VramMirror:
    """A daemon-owned staging mirror in VRAM (``data_path = staged``).

    ``cudaMalloc`` memory of this process: UCX can export it to a peer daemon
    through ``cuda_ipc`` (zero-copy), unlike memory the daemon imported. The
    shim opens :attr:`handle` and copies blocks between its KV cache and the
    mirror with the same region/block maths.

    Attributes:
        addr, size, device, memory (``"VRAM"``), handle (64 bytes, for the shim).
    """

    memory = "VRAM"

    def __init__(self, size: int, device: int):
        rt = runtime()
        if not 0 <= device < rt.devices:
            raise CudaIpcError(f"staging mirror: device {device} out of range: this daemon sees {rt.devices}")
        try:
            addr = rt.malloc(device, size)
        except cudart.CudaError as e:
            hint = ("; staged mirrors are a second copy of the engine's KV cache on its GPU: leave that much free "
                    "(e.g. a lower vLLM --gpu-memory-utilization)" if e.name == "cudaErrorMemoryAllocation" else "")
            raise CudaIpcError(f"staging mirror of {size} bytes on device {device}: {e}{hint}") from None
        try:
            rt.memset(device, addr, 0, size)
            self.handle = rt.ipc_get_handle(device, addr)
        except cudart.CudaError as e:
            rt.free(device, addr)
            raise CudaIpcError(f"staging mirror on device {device}: {e}") from None
        self._rt = rt
        self.addr, self.size, self.device = addr, size, device

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise CudaIpcError(f"read [{offset}, {offset + length}) outside mirror of {self.size} bytes")
        return self._rt.read(self.device, self.addr + offset, length)

    def close(self) -> None:
        """Frees the mirror; idempotent. The shim must have closed its mapping first."""
        if self.addr:
            try:
                self._rt.free(self.device, self.addr)
            except cudart.CudaError as e:
                log.warning("freeing staging mirror on device %d: %s", self.device, e)
            self.addr = 0


def reexport_check(rt: cudart.Cudart, device: int, addr: int) -> path_select.Evidence:
    """Can this daemon's UCX export ``addr`` to a peer through ``cuda_ipc``?

    UCX's ``cuda_ipc`` memory domain exports a registered region with
    ``cuIpcGetMemHandle`` on its allocation (legacy IPC). The driver's
    ``IS_LEGACY_CUDA_IPC_CAPABLE`` attribute answers when libcuda is there;
    either way a ``cudaIpcGetMemHandle`` on the address is tried, which is
    what UCX will do. Returns ``Evidence(source="reexport")``: path
    ``cuda_ipc`` when it works, ``host_staged`` (the hazard) when it fails.
    """
    capable = rt.legacy_ipc_capable(device, addr)
    try:
        rt.ipc_get_handle(device, addr)
        ok, detail = True, "cudaIpcGetMemHandle on the opened mapping works"
    except cudart.CudaError as e:
        ok, detail = False, f"cudaIpcGetMemHandle on the opened mapping fails ({e.name})"
    if capable is not None:
        detail += f"; IS_LEGACY_CUDA_IPC_CAPABLE={int(capable)}"
        ok = ok and capable
    return path_select.reexport_evidence(ok, detail)


@dataclass
class OpenedSegments:
    """What :func:`open_segments` made for one worker.

    Attributes:
        mappings: one per segment, in order (:class:`CudaIpcMapping` on the
            direct path, :class:`VramMirror` on the staged path).
        staged: the staged path is in use.
        device: the worker's device (all its segments must share one).
        choice: the data path decision and why (for logs and status).
    """

    mappings: list
    staged: bool
    device: int
    choice: path_select.Choice


def open_segments(segments, requested: str) -> OpenedSegments:
    """Opens (or mirrors) a worker's CUDA IPC segments.

    Args:
        segments: ``kvd.core.state.Segment`` values, all of kind :data:`KIND`.
        requested: ``"direct"``, ``"staged"`` or ``"auto"``.

    Every path opens each handle first (:class:`CudaIpcMapping`): the engine
    shows it holds an allocation of at least the segment's size on the GPU it
    names, so a mirror is never larger than memory the caller has there, nor
    on a GPU it has no memory on. Direct: keep the mappings. Staged: close
    them and make a :class:`VramMirror` of each size on that device. Auto:
    check each (:func:`reexport_check`); if any cannot be re-exported, close
    them and make mirrors (``path_select.choose_data_path``).

    Raises:
        CudaIpcError: no GPU here, bad handle/device, mixed devices, or a
            CUDA call failed; nothing stays open or allocated.
    """
    if requested not in ("direct", "staged", "auto"):
        raise ValueError(f"requested data path must be direct, staged or auto (got {requested!r})")
    runtime()  # NO_GPU before anything else
    on = [resolve_device(s.device, s.device_uuid, f"segment {i}") for i, s in enumerate(segments)]
    devices = sorted(set(on))
    if len(devices) != 1:
        raise CudaIpcError(f"a worker's CUDA IPC segments must all be on one device (got devices {devices})")
    device = devices[0]
    mappings: list = []
    try:
        evidence: list[path_select.Evidence] = []
        for i, s in enumerate(segments):
            check_handle(s.handle, f"segment {i}")
            mappings.append(CudaIpcMapping(s.handle, device, s.size))
            if requested != "staged":
                evidence.append(mappings[-1].reexport)
        choice = path_select.choose_data_path(requested, evidence)
        if choice.path == "staged":
            opened, mappings = mappings, []
            for m in opened:
                m.close()
            for s in segments:
                mappings.append(VramMirror(s.size, device))
    except BaseException as e:
        for m in mappings:
            m.close()
        if isinstance(e, cudart.CudaError):
            raise CudaIpcError(f"CUDA IPC segments on device {device}: {e}") from None
        raise
    return OpenedSegments(mappings, choice.path == "staged", device, choice)
