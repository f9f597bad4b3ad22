"""The engine side of the staged data path: copy blocks to and from the daemon's mirrors.

With ``data_path = staged`` (docs/DESIGN.md "Memory sharing") the daemon does not
map the engine's KV cache: it makes one staging *mirror* per engine segment
(``RegisterEngineResponse.staging_segments``, same order and sizes) and NIXL
moves bytes between mirrors. A mirror is POSIX shm (a CPU engine, or a CUDA
engine whose daemon has no GPU: ``kvd.core.cuda_ipc.wants_vram``) or
daemon-owned VRAM exported by CUDA IPC (``kvd.core.cuda_ipc.VramMirror``,
opened here through ``kvd.cudart``). The engine copies, with the same
region/block maths as the daemon (``kvd.v1.Region``: block ``b`` of a region
at ``offset + b * block_stride`` of its segment, ``block_len`` bytes):

- prefill: the blocks a step's forward pass wrote for a request that will be
  handed off, cache -> mirror, in that same step (``wait_for_save``), so they
  are in the mirror before the request's ``kv_transfer_params`` leave the
  engine and a reader can READ them (:meth:`StagingMirror.copy_in`; copying at
  ``HoldBlocks`` time, one step later, would race with a fast reader);
- decode: the blocks of a finished load, mirror -> cache, *after*
  ``RecvDone`` and before vLLM is told the request finished receiving
  (:meth:`StagingMirror.copy_out`).

On a GPU each copy is one launch of kvd's copy kernel over every block of
every region (``kvd.cuda_copy``: one pass over the bytes); elsewhere, or
where the kernel cannot load, one ``index_select`` / ``index_copy_`` per
region (no Python loop over blocks). Block ids come per KV-cache group; a region
takes the list of its ``group``. A copy that touches CUDA memory waits for
the device before it returns: the daemon reads the mirror as soon as the
hold goes out, and NIXL does not order itself after the engine's stream.
Units: bytes.

Thread model: the engine thread copies; the client's session thread calls
:meth:`StagingMirror.remap` then :meth:`StagingMirror.copy_all` when a
re-registration brought new mirrors (the daemon restarted or had dropped the
worker), before held blocks are offered again. One lock orders them; it is
taken for the copies only, never across I/O.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence

import torch

from kvd.shim.memory.regions import block_view
from kvd.v1 import kvd_pb2 as pb

log = logging.getLogger("kvd.shim.memory.staged")

SHM_DIR = "/dev/shm"


#: Bytes of blocks gathered at once by torch's staged copy (its temporary;
#: on a GPU the copies are kvd's kernel's, with no temporary, where it loads).
#: On an H200 a block-wise copy of 2 GiB of uint8 rows ran at 315-323 GB/s
#: (int64 rows: 836-976) for blocks of 64 KiB to
#: 4 MiB (docs/GPU.md): a 256 MiB piece is ~0.8 ms, against ~10 us to launch it.
COPY_PIECE_BYTES = 256 << 20


def _wide(blocks: torch.Tensor) -> torch.Tensor:
    """``blocks`` (``[num_blocks, block_len]`` ``uint8``) viewed with the widest
    integer type its rows and strides allow: torch's ``index_select`` /
    ``index_copy_`` move one element per thread step, so 8-byte elements move
    the same rows several times faster than bytes (here, one CPU thread:
    1.0 -> 1.7 GB/s on 1 MiB rows); the bytes are the same."""
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if blocks.shape[-1] % size == 0:
            try:
                return blocks.view(dt)
            except RuntimeError:  # a stride or the storage offset not a multiple of size
                continue
    return blocks


class StagingError(RuntimeError):
    """The daemon's mirrors cannot be used (missing, wrong size or kind); the message says which."""


class _CudaArray:
    """``__cuda_array_interface__`` over a raw device pointer (for ``torch.as_tensor``)."""

    def __init__(self, ptr: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}


def open_mirrors(staging_segments: Sequence[pb.Segment], sizes: Sequence[int]
                 ) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """Maps the daemon's mirrors: one 1-D ``uint8`` tensor per segment, and the
    function that unmaps them all (call it once the tensors are dropped).

    ``sizes``: the engine's segment sizes, in order (a mirror must be at least
    as large). Shm mirrors are ``mmap``-ed from ``/dev/shm``; CUDA IPC mirrors
    are opened with ``cudaIpcOpenMemHandle`` on their device (``kvd.cudart``).

    Raises:
        StagingError: counts differ, a mirror is smaller than its segment, of
            an unknown kind, or cannot be opened (nothing stays mapped).
        kvd.cudart.CudaUnavailable: a CUDA IPC mirror on a host without CUDA.
    """
    if len(staging_segments) != len(sizes):
        raise StagingError(f"the daemon returned {len(staging_segments)} staging segments "
                           f"for {len(sizes)} engine segments")
    maps: list[mmap.mmap] = []
    opened: list[tuple[object, int, int]] = []  # (cudart, device, ptr)

    def unmap() -> None:
        for m in maps:
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere; the GC unmaps it
                pass
        maps.clear()
        for rt, device, ptr in opened:
            try:
                rt.ipc_close(device, ptr)
            except Exception as e:  # noqa: BLE001 - best effort at close
                log.warning("closing CUDA IPC mirror mapping on device %d: %s", device, e)
        opened.clear()

    tensors: list[torch.Tensor] = []
    try:
        for seg, size in zip(staging_segments, sizes):
            if seg.size < size:
                raise StagingError(f"staging segment {seg.name!r} has {seg.size} bytes, the engine segment {size}")
            if seg.kind == pb.MEMORY_KIND_CUDA_IPC:
                from kvd import cudart

                rt = cudart.load()
                device = local_device(seg, rt)  # the daemon may number GPUs otherwise
                ptr = rt.ipc_open(device, bytes(seg.handle))
                opened.append((rt, device, ptr))
                tensors.append(torch.as_tensor(_CudaArray(ptr, seg.size), device=f"cuda:{device}"))
                continue
            if seg.kind != pb.MEMORY_KIND_SHM:
                raise StagingError(f"staging segment of kind {seg.kind}: expected SHM or CUDA_IPC")
            path = os.path.join(SHM_DIR, seg.name.lstrip("/"))
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as e:
                raise StagingError(f"cannot open staging segment {path}: {e}") from e
            try:
                maps.append(mmap.mmap(fd, seg.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
            except (OSError, ValueError) as e:
                raise StagingError(f"cannot map staging segment {path} ({seg.size} bytes): {e}") from e
            finally:
                os.close(fd)
            tensors.append(torch.frombuffer(maps[-1], dtype=torch.uint8))
    except BaseException:
        tensors.clear()
        unmap()
        raise
    return tensors, unmap


def local_device(seg: pb.Segment, rt) -> int:
    """This process's ordinal of a daemon mirror's GPU: by
    ``seg.device_uuid`` when set (``rt``: a ``kvd.cudart.Cudart``; the
    daemon may number GPUs otherwise), else ``seg.device``.

    Raises:
        StagingError: a GPU this process does not see.
    """
    if not seg.device_uuid:
        return seg.device
    from kvd import cudart

    found = rt.device_of_uuid(bytes(seg.device_uuid))
    if found is None:
        raise StagingError(f"the daemon's staging mirror is on GPU {cudart.format_uuid(bytes(seg.device_uuid))}, "
                           f"which this engine does not see (it sees {rt.devices} device(s))")
    return found

class StagingMirror:
    """The engine's KV cache blocks and the daemon's mirrors of them.

    Args:
        cache_blocks: per region, the ``[num_blocks, block_len]`` ``uint8`` view
            of the KV cache (``SharedKvCaches.cache_blocks()`` on CPU,
            ``SharedCudaKvCaches.cache_blocks()`` on GPU).
        regions: the registered regions (offsets from each segment's byte 0).
        segment_sizes: bytes of each registered segment.
        num_blocks: blocks per region.
        staging_segments: ``RegisterEngineResponse.staging_segments``.

    Raises:
        StagingError: see :func:`open_mirrors`.
    """

    def __init__(self, cache_blocks: Sequence[torch.Tensor], regions: Sequence[pb.Region],
                 segment_sizes: Sequence[int], num_blocks: int, staging_segments: Sequence[pb.Segment]):
        if len(cache_blocks) != len(regions):
            raise StagingError(f"{len(cache_blocks)} cache views for {len(regions)} regions")
        self.num_blocks = int(num_blocks)
        self.regions = list(regions)
        self.sizes = list(segment_sizes)
        self._cache_blocks = list(cache_blocks)
        self._cuda = [d for d in {c.device for c in self._cache_blocks} if d.type == "cuda"]
        # The device kvd's copy kernel copies on (set by remap), or None: torch's copies.
        self._kernel_dev: int | None = None
        self._lock = threading.Lock()
        self._unmap: Callable[[], None] | None = None
        self._mirror_blocks: list[torch.Tensor] = []
        self.names: list[str] = []
        self.remap(staging_segments)

    # ------------------------------------------------------------- mapping
    def remap(self, staging_segments: Sequence[pb.Segment]) -> None:
        """Maps (new) mirrors; the old ones are unmapped (the daemon frees them).

        Raises:
            StagingError: see :func:`open_mirrors`.
        """
        flats, unmap = open_mirrors(staging_segments, self.sizes)
        try:
            blocks = [block_view(flats[r.segment_index], r.offset, r.block_len, r.block_stride, self.num_blocks,
                                 StagingError) for r in self.regions]
        except BaseException:
            flats.clear()
            unmap()
            raise
        devices = {f.device for f in flats} | {c.device for c in self._cache_blocks}
        with self._lock:
            old = self._unmap
            self._unmap, self._mirror_blocks = unmap, blocks
            self._cuda = [d for d in devices if d.type == "cuda"]
            self.names = [s.name or f"cuda-ipc:{s.device}" for s in staging_segments]
        if old is not None:
            old()
        dev = self._kernel_device()  # NVRTC compiles now, not in the first request's step
        with self._lock:
            self._kernel_dev = dev

    def _sync(self) -> None:
        for d in self._cuda:  # the daemon reads the mirror (or vLLM the cache) right after this
            torch.cuda.synchronize(d)

    # --------------------------------------------------------------- copies
    def copy_in(self, groups: Sequence[Sequence[int]]) -> int:
        """Cache -> mirror for block ids per group (prefill, before the hold).
        Returns the bytes copied."""
        return self._copy(groups, to_mirror=True)

    def copy_all(self) -> int:
        """Cache -> mirror for every block of every region (after a remap:
        whatever a reader may read, held or still being computed, is in the
        new mirror too; later saves go to the new mirror anyway). Returns the
        bytes copied."""
        moved = 0
        with self._lock:
            for r, cache, mirror in zip(self.regions, self._cache_blocks, self._mirror_blocks):
                mirror.copy_(cache)
                moved += self.num_blocks * r.block_len
            self._sync()
        return moved

    def copy_out(self, groups: Sequence[Sequence[int]]) -> int:
        """Mirror -> cache for block ids per group (decode, after the load).
        Returns the bytes copied."""
        return self._copy(groups, to_mirror=False)

    def _copy(self, groups: Sequence[Sequence[int]], to_mirror: bool) -> int:
        ids = [torch.as_tensor(list(g), dtype=torch.long) for g in groups]
        for g, t in enumerate(ids):
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.num_blocks):
                raise StagingError(f"group {g}: block id out of range 0..{self.num_blocks - 1}")
        moved = 0
        with self._lock:
            if not self._mirror_blocks:
                raise StagingError("staging mirrors are closed")
            if self._kernel_dev is not None:
                from kvd import cudart

                try:
                    return self._copy_rows(self._kernel_dev, ids, to_mirror)
                except cudart.CudaError as e:
                    # The connector handles StagingError only (the load or save fails, the engine goes on).
                    if e.code in cudart.STICKY_ERRORS:
                        raise StagingError(f"row-copy kernel: {e} (this process's CUDA context is lost)") from None
                    log.warning("kvd's row-copy kernel failed (%s); staged copies by torch from now on", e)
                    self._kernel_dev = None
            for r, cache, mirror in zip(self.regions, self._cache_blocks, self._mirror_blocks):
                if r.group >= len(ids) or not ids[r.group].numel():
                    continue
                sel = ids[r.group]
                src, dst = (_wide(cache), _wide(mirror)) if to_mirror else (_wide(mirror), _wide(cache))
                # In pieces of at most COPY_PIECE_BYTES: the gathered rows are a temporary in the
                # engine's memory, and a vLLM engine leaves little free VRAM beside its cache.
                step = max(1, COPY_PIECE_BYTES // max(1, r.block_len))
                for i in range(0, sel.numel(), step):
                    part = sel[i:i + step]
                    rows = src.index_select(0, part.to(src.device))
                    dst.index_copy_(0, part.to(dst.device), rows.to(dst.device))
                    del rows
                moved += sel.numel() * r.block_len
            if moved:
                self._sync()
        return moved

    def _kernel_device(self) -> int | None:
        """The one CUDA device of every cache and mirror view when kvd's copy
        kernel (``kvd.cuda_copy``) runs there, else None (the torch copies)."""
        devices = {t.device for t in (*self._cache_blocks, *self._mirror_blocks)}
        if len(devices) != 1:
            return None
        (dev,) = devices
        if dev.type != "cuda":
            return None
        from kvd import cuda_copy, cudart

        index = dev.index if dev.index is not None else torch.cuda.current_device()
        try:
            return index if cuda_copy.engine().ready(index) else None
        except (cudart.CudaUnavailable, cudart.CudaError) as e:  # torch's copies then; never the caller's error
            log.warning("kvd's row-copy kernel is not used for staged copies: %s", e)
            return None

    def _copy_rows(self, device: int, ids: list[torch.Tensor], to_mirror: bool) -> int:
        """:meth:`_copy` as one launch of kvd's copy kernel over every block
        of every region (one pass over the bytes; ``index_select`` then
        ``index_copy_`` is two, and a temporary). The kernel runs on kvd's
        own stream, so torch's stream on the device is waited for first
        (the forward pass wrote the cache there, or will read it); the
        kernel is waited for before this returns."""
        import numpy as np

        from kvd import cuda_copy

        dsts, srcs, lens = [], [], []
        moved = 0
        for r, cache, mirror in zip(self.regions, self._cache_blocks, self._mirror_blocks):
            if r.group >= len(ids) or not ids[r.group].numel():
                continue
            sel = ids[r.group].numpy().astype(np.int64)
            src, dst = (cache, mirror) if to_mirror else (mirror, cache)
            dsts.append(dst.data_ptr() + sel * (dst.stride(0) * dst.element_size()))
            srcs.append(src.data_ptr() + sel * (src.stride(0) * src.element_size()))
            lens.append(np.full(len(sel), r.block_len, dtype=np.int64))
            moved += len(sel) * r.block_len
        if moved:
            torch.cuda.current_stream(device).synchronize()
            cuda_copy.engine().copy_rows(device, np.concatenate(dsts), np.concatenate(srcs), np.concatenate(lens))
        return moved

    def close(self) -> None:
        """Waits for pending copies, drops the views, unmaps the mirrors
        (idempotent). Before ``UnregisterEngine``: the daemon then frees them."""
        with self._lock:
            if self._mirror_blocks:
                self._sync()
            unmap, self._unmap, self._mirror_blocks = self._unmap, None, []
        if unmap is not None:
            unmap()
