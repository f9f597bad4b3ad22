"""The engine side of the staged data path: copy blocks to and from the daemon's mirrors.

With ``data_path = staged`` (docs/DESIGN.md "Memory sharing") the daemon does not
map the engine's KV cache: it makes one shared staging *mirror* per engine
segment (``RegisterEngineResponse.staging_segments``, same order and sizes)
and NIXL moves bytes between mirrors. The engine copies, with the same
region/block maths as the daemon (``kvd.v1.Region``: block ``b`` of a region
at ``offset + b * block_stride``, ``block_len`` bytes):

- prefill: the blocks a step's forward pass wrote for a request that will be
  handed off, cache -> mirror, in that same step (``wait_for_save``), so they
  are in the mirror before the request's ``kv_transfer_params`` leave the
  engine and a reader can READ them (:meth:`StagingMirror.copy_in`; copying at
  ``HoldBlocks`` time, one step later, would race with a fast reader);
- decode: the blocks of a finished load, mirror -> cache, *after*
  ``RecvDone`` and before vLLM is told the request finished receiving
  (:meth:`StagingMirror.copy_out`).

Each copy is one ``index_select`` / ``index_copy_`` per region (memcpy speed,
no Python loop over blocks). Block ids come per KV-cache group; a region
takes the list of its ``group``. Units: bytes.

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
from collections.abc import Sequence

import torch

from kvd.v1 import kvd_pb2 as pb

log = logging.getLogger("kvd.shim.staging")

SHM_DIR = "/dev/shm"


class StagingError(RuntimeError):
    """The daemon's mirrors cannot be used (missing, wrong size); the message says which."""


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole storage of ``tensor``."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


def _blocks(flat: torch.Tensor, region: pb.Region, num_blocks: int) -> torch.Tensor:
    """``[num_blocks, block_len]`` uint8 view of one region's blocks."""
    return flat.as_strided((num_blocks, region.block_len), (region.block_stride, 1), region.offset)


class StagingMirror:
    """The engine's KV cache tensors and the daemon's mirrors of them.

    Args:
        tensors: one tensor per registered segment, whose storage holds that
            segment's bytes (``SharedKvCaches.tensors``).
        regions: the registered regions (offsets from each storage's byte 0).
        num_blocks: blocks per region.
        staging_segments: ``RegisterEngineResponse.staging_segments``.

    Raises:
        StagingError: a mirror is missing, smaller than its segment, or the
            counts differ.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], regions: Sequence[pb.Region], num_blocks: int,
                 staging_segments: Sequence[pb.Segment]):
        self.num_blocks = int(num_blocks)
        self.regions = list(regions)
        self._cache = [_byte_view(t) for t in tensors]
        self._cache_blocks = [_blocks(self._cache[r.segment_index], r, self.num_blocks) for r in self.regions]
        self._lock = threading.Lock()
        self._maps: list[mmap.mmap] = []
        self._mirror_blocks: list[torch.Tensor] = []
        self.names: list[str] = []
        self.remap(staging_segments)

    # ------------------------------------------------------------- mapping
    def remap(self, staging_segments: Sequence[pb.Segment]) -> None:
        """Maps (new) mirrors; the old ones are unmapped (the daemon unlinks them).

        Raises:
            StagingError: see the class.
        """
        if len(staging_segments) != len(self._cache):
            raise StagingError(f"the daemon returned {len(staging_segments)} staging segments "
                               f"for {len(self._cache)} engine segments")
        maps: list[mmap.mmap] = []
        try:
            for seg, cache in zip(staging_segments, self._cache):
                if seg.size < cache.numel():
                    raise StagingError(f"staging segment {seg.name!r} has {seg.size} bytes, "
                                       f"the engine segment {cache.numel()}")
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
        except BaseException:
            for m in maps:
                m.close()
            raise
        flats = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        blocks = [_blocks(flats[r.segment_index], r, self.num_blocks) for r in self.regions]
        with self._lock:
            old = self._maps
            self._maps, self._mirror_blocks = maps, blocks
            self.names = [s.name for s in staging_segments]
        self._close_maps(old)

    @staticmethod
    def _close_maps(maps: list[mmap.mmap]) -> None:
        for m in maps:
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere; the GC unmaps it
                pass

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
            for r, cache, mirror in zip(self.regions, self._cache_blocks, self._mirror_blocks):
                if r.group >= len(ids) or not ids[r.group].numel():
                    continue
                sel = ids[r.group]
                src, dst = (cache, mirror) if to_mirror else (mirror, cache)
                dst.index_copy_(0, sel, src.index_select(0, sel))
                moved += sel.numel() * r.block_len
        return moved

    def close(self) -> None:
        """Unmaps the mirrors (idempotent)."""
        with self._lock:
            old, self._maps, self._mirror_blocks = self._maps, [], []
        self._close_maps(old)
