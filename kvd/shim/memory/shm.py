"""CPU KV cache tensors -> POSIX shared memory + ``kvd.v1`` segments and regions
(:class:`ShmSharing`, what ``kvd.shim.memory.auto`` picks for CPU tensors).

The engine hands the daemon its KV cache *by name*, never by copying bytes: each
torch storage that backs a KV cache tensor is moved into a POSIX shared memory
object, the daemon maps that object (``mmap(MAP_SHARED)``, see
``kvd/core/memory.py``) and registers the mapping with NIXL as DRAM. A NIXL READ
into the daemon's mapping then lands directly in the engine's tensor.

This is the one module that touches torch's private sharing APIs:

- ``UntypedStorage._share_filename_cpu_()`` moves a CPU storage into a named
  shm object ``/torch_<pid>_<n>_<k>`` (torch's ``THManagedMapAllocator``; the
  object lives as long as the storage, and ``torch_shm_manager`` unlinks it
  when the engine process dies). It copies the bytes once and swaps the data
  pointer *inside the same StorageImpl*, so every view made before the call
  (vLLM's per-layer KV cache views, already bound to the attention layers)
  follows the move. Checked in ``tests/test_shim_cpu_share.py``.
- The object starts with a small header (torch's refcount, 64 bytes in torch
  2.13); the storage's byte 0 is *not* at the object's byte 0. We read the
  true file offset of the storage from ``/proc/self/maps`` (the mapping that
  holds ``storage.data_ptr()`` and its file offset), and fall back to
  ``object size - storage size`` where ``/proc`` is unavailable.

Why not ``tensor.share_memory_()`` first (as the first trial in
``notes/vllm-cpu.md`` did)? Under torch's default ``file_descriptor``
strategy it copies the storage into an fd-backed segment that has no usable
name, and ``_share_filename_cpu_()`` then copies it a second time. Going
straight to the named segment costs one copy of the KV cache (1 GiB on the
CPU demo) instead of two, with the same result.

The maths (``plan_regions``) is separate from the sharing so it can be tested on
any tensor:

- Find the *block dimension*: the first dim of size ``num_blocks`` (or a dim of
  size ``k * num_blocks`` when vLLM split each manager block into ``k`` kernel
  blocks; those ``k`` must be dense and are merged back into one block).
- Every index combination of the dims before it is one region (e.g. the K/V
  dim of size 2 of the legacy ``[2, num_blocks, ...]`` layouts gives ``/k`` and
  ``/v``). vLLM-CPU 0.32.0 has no such dim: its per-layer view is
  ``[num_blocks, num_kv_heads, block_size, head_size + head_size_v]``
  (``vllm/v1/kv_cache_interface.py:create_kv_cache_views`` with the
  ``LBHNC`` layout that ``CPUAttentionBackend.supported_kv_cache_layouts``
  requires), K and V of one head side by side inside a block: the kernel
  views it as ``[num_kv_heads, 2 * block_size, head_size]``, K rows then V
  rows (``vllm/v1/attention/backends/cpu_attn.py:411-415``), so one region per
  layer whose block holds both K and V. Such a block is head-major but not
  token-major inside a head: ``Layout.head_dim`` then says ``2 * head_size``
  (the bytes of one token of one head, as far as slicing by heads goes), which
  lets the daemon give each decode rank its heads under heterogeneous TP.
  With ``kv_layout`` HND, ``Layout.kv_in_block`` then tells the daemon that a
  head's bytes are its K then its V (the vLLM shim adds how the kernel lays
  out K inside, ``Layout.k_dim_major``, probed by ``kvd.shim.vllm.cpu_kv_probe``),
  so it moves K and V of each head separately and a prefill block can fill part of a larger
  decode block (``kvd.core.plan.chunks``). Any other layout with K and V in
  the block cannot be re-sliced by tokens: the vLLM shim then puts the block
  size into ``compat_extra`` (``SharedKvCaches.kv_in_block``).
- ``block_len`` = bytes of everything after the block dim (must be contiguous,
  else :class:`CpuShareError`), ``block_stride`` = stride of the block dim x
  element size, ``offset`` = byte offset of that sub-tensor's block 0 from the
  storage's byte 0 (then shifted by the shm header for the proto).
- vLLM 0.32 puts *all* layers in one backing allocation
  (``vllm/v1/worker/utils.py:allocate_kv_cache``), so segments are deduped by
  storage; layers that reuse another layer's cache (cross-layer KV sharing,
  ``gpu_model_runner.py:initialize_kv_cache_tensors``) give byte-identical
  regions, which are deduped too (the bytes move once). Hybrid models (vLLM
  HMA) overlay their KV-cache groups on the same bytes (``KVCacheTensor``): a
  region is kept once *per group* (``Region.group``), since each group's block
  ids address those bytes independently.
- Shutdown: :func:`release_names` unlinks the segment names (vLLM kills
  ``torch_shm_manager`` before the storages are freed, so torch would leak
  them), after raising torch's header refcount so that torch's own unlink at
  free time does not abort the process.
- The staged data path shares nothing: :func:`describe_kv_caches` gives the
  same regions over unnamed segments, and ``kvd.shim.memory.staged`` copies blocks.

Units: bytes for sizes, strides and offsets; tokens for ``block_size``.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvd.shim.memory import regions
from kvd.shim.memory.base import KvSharing
from kvd.shim.memory.regions import KvCachePlan, KvDescription, KvShareError
from kvd.v1 import kvd_pb2 as pb

log = logging.getLogger("kvd.shim.memory.shm")

SHM_DIR = "/dev/shm"

# torch's MapInfo header (aten/src/ATen/MapAllocator.cpp): a std::atomic<int>
# reference count at byte 0 of a shared segment, data at byte 64.
_REFCOUNT = ctypes.c_int

class CpuShareError(KvShareError):
    """A KV cache tensor cannot be shared or described; the message says why."""


# ------------------------------------------------------------------ sharing
@dataclass(frozen=True)
class SharedStorage:
    """One torch storage moved into a named POSIX shm object.

    Attributes:
        name: shm object name, e.g. ``"/torch_123_456_1"`` (``/dev/shm/torch_...``).
        data_offset: bytes from the object's byte 0 to the storage's byte 0.
        nbytes: bytes of the storage.
        size: bytes the daemon must map from the object's start
            (``data_offset + nbytes``); never larger than the object.
        header_addr: address, in this process, of torch's header at the
            object's byte 0 (its reference count, see :func:`release_names`);
            0 when unknown (then the name is never unlinked here).
        fd: a sealed memfd holding the storage (``kvd.shim.memory.memfd``;
            ``name`` is then ""), handed over by fd; -1 for a named object.
    """

    name: str
    data_offset: int
    nbytes: int
    header_addr: int = 0
    fd: int = -1

    @property
    def size(self) -> int:
        return self.data_offset + self.nbytes


def _mapping_file_offset(ptr: int) -> tuple[int, str] | None:
    """(file offset of ``ptr``, mapped path) from ``/proc/self/maps``, or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= ptr < hi:
                    path = parts[5].strip() if len(parts) > 5 else ""
                    return ptr - lo + int(parts[2], 16), path
    except OSError:
        return None
    return None


def share_storage(tensor: torch.Tensor) -> SharedStorage:
    """Moves ``tensor``'s storage into a named shm object; returns its handle.

    Idempotent: a storage that is already in a named segment is not copied
    again and yields the same name. Every view of the storage stays valid
    (same StorageImpl, new data pointer).

    Raises:
        CpuShareError: not a CPU tensor, empty storage, or torch's private API
            behaved differently than this module expects (the message says how).
    """
    if tensor.device.type != "cpu":
        raise CpuShareError(f"only CPU tensors can be shared as POSIX shm (got device {tensor.device})")
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0:
        raise CpuShareError("cannot share an empty storage")
    try:
        _manager, raw_name, size = storage._share_filename_cpu_()
    except (AttributeError, RuntimeError) as e:
        raise CpuShareError(
            f"torch {torch.__version__}: UntypedStorage._share_filename_cpu_() failed ({e}); "
            "is /dev/shm mounted and large enough for the KV cache?"
        ) from e
    name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
    if int(size) != nbytes:
        raise CpuShareError(f"shared segment {name} reports {size} bytes, the storage has {nbytes}")
    path = os.path.join(SHM_DIR, name.lstrip("/"))
    found = _mapping_file_offset(storage.data_ptr())
    if found is not None and found[1] == path:
        data_offset = found[0]
    else:
        try:
            data_offset = os.stat(path).st_size - nbytes
        except OSError as e:
            raise CpuShareError(f"shared segment {name} is not visible at {path}: {e}") from e
    if data_offset < 0:
        raise CpuShareError(f"shared segment {name}: negative data offset {data_offset}")
    try:
        object_size = os.stat(path).st_size
    except OSError as e:
        raise CpuShareError(f"shared segment {name} is not visible at {path}: {e}") from e
    if data_offset + nbytes > object_size:
        raise CpuShareError(
            f"shared segment {name}: storage ends at byte {data_offset + nbytes}, the object has {object_size}"
        )
    header_addr = 0
    if found is not None and found[1] == path and data_offset >= ctypes.sizeof(_REFCOUNT):
        header_addr = storage.data_ptr() - data_offset
        if _REFCOUNT.from_address(header_addr).value < 1:  # not torch's MapInfo as we know it
            header_addr = 0
    return SharedStorage(name=name, data_offset=data_offset, nbytes=nbytes, header_addr=header_addr)


def release_names(storages: list[SharedStorage], tensors: list[torch.Tensor]) -> list[str]:
    """Unlinks the shm names of shared storages (engine shutdown); returns them.

    ``tensors[i]`` must hold the storage of ``storages[i]`` (the caller keeps
    them alive until here: the header is written through this process's
    mapping, which a freed storage no longer has).

    The memory stays mapped and every tensor view stays valid; the kernel
    frees the pages when the last mapping (this process's, the daemon's) goes.
    Without this the names leak: torch unlinks a segment when its storage is
    freed or, for a process that dies, through ``torch_shm_manager``, which
    vLLM kills at shutdown before the storages are freed.

    torch's own unlink at free time (``RefcountedMapAllocator::close``,
    ``MapAllocator.cpp``) aborts the process when the name is already gone,
    so the header's reference count (``MapInfo.refcount``, an int at the
    object's byte 0: 1 after sharing) is raised by one first: torch's close
    then only drops its mapping. A storage whose header was not found
    (``header_addr`` 0) keeps its name. Idempotent per name.
    """
    released = []
    for st, t in zip(storages, tensors):
        if not st.name or not st.header_addr or st.name in _RELEASED:
            continue
        if t.untyped_storage().data_ptr() != st.header_addr + st.data_offset:
            continue  # not the mapping we described (moved?): leave the name to torch
        path = os.path.join(SHM_DIR, st.name.lstrip("/"))
        _RELEASED.add(st.name)
        _REFCOUNT.from_address(st.header_addr).value += 1
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        released.append(st.name)
    return released


# Names this process has unlinked (their headers were raised once).
_RELEASED: set[str] = set()


# --------------------------------------------------------------------- maths
def plan_regions(
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    *,
    block_dim: int | None = None,
    groups: Mapping[str, int] | None = None,
) -> KvCachePlan:
    """Regions of vLLM CPU KV cache tensors (``layer name -> tensor``):
    ``kvd.shim.memory.regions.plan_regions`` on CPU tensors, blocks in row-major
    order (vLLM-CPU's LBHNC/LBNHC).

    Args:
        kv_caches: the dict vLLM passes to ``register_kv_caches``.
        num_blocks: blocks of the KV cache manager (``KVCacheConfig.num_blocks``).
        block_dim: force the block dimension (default: the first dim of size
            ``num_blocks``, else the first multiple of it: kernel blocks).
        groups: layer name -> KV-cache group (vLLM HMA; default: all group 0).
            vLLM overlays the groups on the same bytes
            (``KVCacheTensor``: a block id belongs to one group at a time), so
            the same bytes may be one region per group: regions are deduped
            within a group only.

    Raises:
        CpuShareError: no block dim, a non-contiguous block, overlapping blocks,
            mixed dtypes, or a non-CPU tensor; the message names the layer.
    """
    return regions.plan_regions(kv_caches, num_blocks, block_dim=block_dim, groups=groups, device_type="cpu",
                                permuted_blocks=False, error=CpuShareError)


# ------------------------------------------------------------------- proto
@dataclass
class SharedKvCaches:
    """What ``RegisterEngineRequest`` needs: segments, regions and layout.

    Attributes:
        segments, regions, layout: for the proto (see :func:`share_kv_caches`).
        storages: one per segment; named for the direct path, unnamed (``""``,
            ``data_offset`` 0) for the staged one.
        tensors: one tensor per segment (its storage is the segment's bytes),
            for the staged path's copies.
        kv_in_block: True when one head's bytes in a block hold both its K
            and its V (vLLM-CPU): ``layout.head_dim`` is then the per-head
            vector (K and V together) and the block is not token-major inside
            a head. With HND, ``layout.kv_in_block`` is set too: the daemon
            then re-slices by heads (heterogeneous TP) and by tokens (a
            smaller prefill block into a larger decode block) moving K and V
            runs separately; never permuted (HND/NHD). Without HND the layout
            flag stays unset and only equal block sizes may pair.
    """

    segments: list[pb.Segment]
    regions: list[pb.Region]
    layout: pb.Layout
    storages: list[SharedStorage]
    tensors: list[torch.Tensor] = field(default_factory=list)
    kv_in_block: bool = False

    def cache_blocks(self) -> list[torch.Tensor]:
        """Per region, the ``[num_blocks, block_len]`` ``uint8`` view of the KV
        cache (the staged path's copy source and target)."""
        # Region offsets count from the segment's byte 0: back to the storage's.
        spans = ((r.segment_index, r.offset - self.storages[r.segment_index].data_offset, r.block_len,
                  r.block_stride) for r in self.regions)
        return regions.block_views(self.tensors, spans, self.layout.num_blocks, CpuShareError)


def head_vector(block_len: int, block_size: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Elements per (token, head) in one region's block, as ``Layout.head_dim``.

    ``head_dim`` when a block is ``tokens x heads x head_dim`` (per-layer K
    and V regions, or MLA); ``2 * head_dim`` when K and V of a head share the
    block (vLLM-CPU's ``[heads, 2 * block_size, head_dim]`` per block,
    ``cpu_attn.py``); else ``head_dim`` unchanged (the daemon then moves only
    whole blocks between equal layouts and refuses re-slicing, by message).
    """
    per_token_head = block_size * num_kv_heads * elem_bytes
    if per_token_head <= 0 or block_len % per_token_head:
        return head_dim
    vec = block_len // per_token_head
    return vec if vec in (head_dim, 2 * head_dim) else head_dim


def share_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    share: Callable[[torch.Tensor], SharedStorage] = share_storage,
    **describe: Any,
) -> SharedKvCaches:
    """Shares every storage behind ``kv_caches`` and describes it for the daemon
    (the direct data path: the daemon maps the engine's own pages).

    Args:
        kv_caches: ``layer name -> tensor`` as given to ``register_kv_caches``.
        share: moves one storage where the daemon can map it:
            :func:`share_storage` (a name in /dev/shm) or
            ``kvd.shim.memory.memfd.share_storage`` (a sealed memfd).
        describe: the fields of ``kvd.shim.memory.regions.KvDescription``
            (``num_blocks``, ``block_size``, ``kv_layout``, ``num_kv_heads``,
            ``head_dim``; optional ``total_kv_heads``, ``block_dim``,
            ``groups``); ``layout.head_dim`` may be twice ``head_dim``, see
            :func:`head_vector`.

    Returns:
        Segments (one per storage, ``MEMORY_KIND_SHM``, or ``MEMORY_KIND_MEMFD``
        without its ``fd_id`` yet), regions with offsets from each segment's
        byte 0 (the shm header included), and the layout.

    Raises:
        CpuShareError: see :func:`plan_regions` and :func:`share_storage`.
        TypeError: a missing or unknown ``describe`` key.
    """
    return _describe(kv_caches, KvDescription(**describe), share)


def describe_kv_caches(kv_caches: Mapping[str, torch.Tensor], **describe: Any) -> SharedKvCaches:
    """Describes ``kv_caches`` without sharing anything (the staged data path).

    Same ``describe`` arguments and maths as :func:`share_kv_caches`, but
    the segments are unnamed (``RegisterEngineRequest`` with
    ``DATA_PATH_STAGED``: only their sizes count, the daemon makes a mirror of
    each) and the region offsets count from each storage's byte 0.
    ``tensors`` are what the shim copies from and to (``kvd.shim.memory.staged``).

    Raises:
        CpuShareError, TypeError: as :func:`share_kv_caches`.
    """
    return _describe(kv_caches, KvDescription(**describe), None)


def _describe(kv_caches: Mapping[str, torch.Tensor], d: KvDescription,
              share: Callable[[torch.Tensor], SharedStorage] | None) -> SharedKvCaches:
    """:func:`share_kv_caches` (``share`` given) or :func:`describe_kv_caches` (None)."""
    d.check(CpuShareError)
    plan = plan_regions(kv_caches, d.num_blocks, block_dim=d.block_dim, groups=d.groups)
    if share is not None:
        shared = [share(t) for t in plan.storages]
        segments = [pb.Segment(kind=pb.MEMORY_KIND_MEMFD, size=s.size) if s.fd >= 0 else
                    pb.Segment(kind=pb.MEMORY_KIND_SHM, name=s.name, size=s.size) for s in shared]
    else:
        shared = [SharedStorage(name="", data_offset=0, nbytes=t.untyped_storage().nbytes()) for t in plan.storages]
        segments = [pb.Segment(kind=pb.MEMORY_KIND_SHM, name="", size=s.size) for s in shared]
    wire = regions.wire_regions(plan, d.num_blocks, bases=[s.data_offset for s in shared],
                                nbytes=[s.nbytes for s in shared], error=CpuShareError)
    esize = plan.storages[0].element_size() if plan.storages else 1
    vecs = {head_vector(r.block_len, d.block_size, d.num_kv_heads, d.head_dim, esize) for r in plan.regions}
    vec = vecs.pop() if len(vecs) == 1 and plan.kernel_blocks == 1 else d.head_dim
    kv_in_block = vec != d.head_dim
    # HND with K and V in the block is vLLM-CPU's [heads, 2, tokens, head_size]:
    # the daemon moves K and V runs separately (block-size remap works).
    layout = regions.wire_layout(plan, d, head_dim=vec, kv_in_block=kv_in_block and d.kv_layout == "HND")
    return SharedKvCaches(segments=segments, regions=wire, layout=layout, storages=shared,
                          tensors=list(plan.storages), kv_in_block=kv_in_block)


# ---------------------------------------------------------------- sharing
class ShmSharing(KvSharing):
    """CPU KV caches: POSIX shm segments (direct), or unnamed ones the daemon
    mirrors (staged). ``auto`` is decided here: direct, or staged when the
    storages cannot be moved into shm (the warning says why); the daemon is
    then asked for exactly that path."""

    kind = "shm"
    #: Moves one storage where the daemon can map it (see ``share_kv_caches``).
    share_storage = staticmethod(share_storage)

    def __init__(self, data_path: str = "direct"):
        super().__init__(data_path)
        self._names: list[SharedStorage] = []
        self._tensors: list[torch.Tensor] = []  # keep the storages alive until close

    def share(self, kv_caches: Mapping[str, torch.Tensor], **describe) -> SharedKvCaches:
        """See :meth:`KvSharing.share`. Raises :class:`CpuShareError`."""
        if self.data_path == "staged":
            self.shared = describe_kv_caches(kv_caches, **describe)
            return self.shared
        try:
            shared = share_kv_caches(kv_caches, share=self.share_storage, **describe)
        except CpuShareError as e:
            if self.data_path != "auto":
                raise
            log.warning("kvd: the KV cache cannot be shared (%s); using the staged data path", e)
            self.data_path = "staged"
            self.shared = describe_kv_caches(kv_caches, **describe)
            return self.shared
        self.data_path = "direct"
        self._names, self._tensors = list(shared.storages), list(shared.tensors)
        self.shared = shared
        return shared

    def close(self) -> list[str]:
        """Unlinks the shm names first (see :func:`release_names`: vLLM
        force-kills workers right after asking them to stop), then unmaps
        any mirrors."""
        released = release_names(self._names, self._tensors)
        self._names, self._tensors = [], []
        super().close()
        return released

