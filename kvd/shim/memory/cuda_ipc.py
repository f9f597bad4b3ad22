"""GPU KV cache tensors -> CUDA IPC handles + ``kvd.v1`` segments and regions
(:class:`CudaIpcSharing`, what ``kvd.shim.memory.auto`` picks for CUDA tensors).

The engine hands the daemon its KV cache by handle, never by copying bytes:
every CUDA allocation that backs a KV cache tensor is exported as a
``cudaIpcMemHandle_t``; the daemon opens it (``kvd.core.cuda_ipc``) and
registers it with NIXL as VRAM. A NIXL READ then lands in the engine's tensor.

Export, and the one place that touches torch's private CUDA sharing API
(:func:`export_storage`):

- ``UntypedStorage._share_cuda_()`` (what ``torch.multiprocessing`` uses)
  returns ``(device, handle, storage bytes, storage offset in the allocation,
  ref-counter handle and offset, event handle, event sync flag)``. The handle
  names the whole ``cudaMalloc`` *allocation* the caching allocator carved the
  storage from; the storage starts ``offset`` bytes into it. The daemon maps
  the allocation, so segments are per allocation and region offsets are
  relative to the allocation base (``storage offset + offset in the storage``).
- The handle's bytes: torch < 2.2 sent the bare 64-byte handle; since then a
  version byte (2; 3 from torch 2.13), a type byte (``'c'``: ``cudaMalloc``
  block, ``'e'``: expandable segment) and, for ``'c'``, the 64-byte handle.
  :func:`parse_torch_handle` accepts the bare and the ``'c'`` forms and sends
  the daemon the bare 64 bytes (the wire contract); ``'e'`` is refused:
  ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` memory is CUDA VMM
  memory, which legacy IPC cannot open (and which is NIXL issue 1754's trap
  for UCX as well).
- Calling ``_share_cuda_`` also makes torch keep a small shared ref-counter
  and record an event on the current stream; both are harmless for a KV cache
  that lives as long as the engine. The daemon reads the memory only after a
  hold / load command, through its own mapping, unordered with the engine's
  streams: the worker waits for the device before it sends a hold
  (:meth:`CudaIpcSharing.sync`).

The alternative when the engine lets the connector choose the allocator
(vLLM 0.33's ``get_mem_pool_context``): allocate the KV cache from a
``torch.cuda.MemPool`` whose allocator makes exportable VMM memory
(``cuMemCreate`` with ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``, or FABRIC
across nodes), export with ``cuMemExportToShareableHandle``, pass the fd over
the Unix socket (``SCM_RIGHTS``; a new ``MEMORY_KIND`` and an fd-passing
side channel, since gRPC carries no fds), import in the daemon with
``cuMemImportFromShareableHandle`` + ``cuMemMap``. What it buys: the daemon's
mapping would be exportable again (UCX >= 1.21 exports POSIX-fd VMM memory
through ``cuda_ipc``: openucx/ucx#11183), so the direct path would be
zero-copy with no staging; it needs that UCX, pidfd_getfd (Linux 5.6+), and
the connector to own allocation. Not built here; see docs/GPU.md.

Region maths (:func:`plan_regions`) follow ``kvd.shim.memory.shm.plan_regions``
(block dim = first dim of size ``num_blocks``, every index of the dims before
it is a region, dedup by storage), with two differences for GPU caches: any
device is accepted (tests use CPU and meta tensors shaped like vLLM's GPU
caches), and a block only needs to be *dense as a set* of bytes, so the
permuted views vLLM makes for HND (``kv_cache_stride_order``) are accepted:
the block then holds ``[heads, tokens, head_dim]``, which the caller declares
as ``kv_layout="HND"`` (checked by :func:`infer_kv_layout` where the shape
tells).

vLLM GPU caches this covers (per layer):

- FlashAttention ``[2, num_blocks, block_size, heads, head_dim]``, NHD
  (identity stride order) or HND (stride order ``(0, 1, 3, 2, 4)``): K and V
  regions per layer;
- FlashInfer ``[num_blocks, 2, block_size, heads, head_dim]`` (+ HND order):
  one region per layer, K and V inside the block;
- MLA ``[num_blocks, block_size, kv_lora_rank + rope_dim]``: one region.

Units: bytes for sizes, strides and offsets; tokens for ``block_size``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvd.shim.memory import regions
from kvd.shim.memory.base import KvSharing
from kvd.shim.memory.regions import KvCachePlan, KvDescription, KvShareError
from kvd.v1 import kvd_pb2 as pb

log = logging.getLogger("kvd.shim.memory")

IPC_HANDLE_SIZE = 64  # sizeof(cudaIpcMemHandle_t)


class CudaShareError(KvShareError):
    """A GPU KV cache cannot be exported or described; the message says why."""


# ------------------------------------------------------------------- export
def parse_torch_handle(raw: bytes) -> bytes:
    """The 64-byte ``cudaIpcMemHandle_t`` inside torch's storage handle.

    Raises:
        CudaShareError: an expandable-segment (VMM) handle, or a format this
            module does not know (the message shows its length and type byte).
    """
    raw = bytes(raw)
    if len(raw) == IPC_HANDLE_SIZE:
        return raw  # torch < 2.2: the bare handle
    if len(raw) >= 2 and raw[1:2] == b"e":
        raise CudaShareError(
            "the KV cache was allocated with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (CUDA VMM memory): "
            "legacy CUDA IPC cannot export it; start the engine with expandable_segments:False")
    if len(raw) == 2 + IPC_HANDLE_SIZE and raw[1:2] == b"c":
        return raw[2:]
    kind = raw[1:2].decode("latin-1") if len(raw) > 1 else ""
    raise CudaShareError(f"unknown torch CUDA IPC handle format: {len(raw)} bytes, version byte "
                         f"{raw[0] if raw else None}, type {kind!r}")


@dataclass(frozen=True)
class ExportedStorage:
    """One CUDA storage, as the daemon must open it.

    Attributes:
        device: CUDA device ordinal of the storage (the engine's numbering).
        handle: 64-byte ``cudaIpcMemHandle_t`` of the allocation holding it.
        offset: bytes from the allocation's first byte to the storage's.
        nbytes: bytes of the storage.
    """

    device: int
    handle: bytes
    offset: int
    nbytes: int

    @property
    def size(self) -> int:
        """Bytes the daemon may touch from the allocation base."""
        return self.offset + self.nbytes


def export_storage(tensor: torch.Tensor) -> ExportedStorage:
    """Exports ``tensor``'s storage through CUDA IPC (torch's ``_share_cuda_``).

    Raises:
        CudaShareError: not a CUDA tensor, an empty storage, or torch's private
            API answered in a way this module does not know.
    """
    if tensor.device.type != "cuda":
        raise CudaShareError(f"only CUDA tensors can be shared by CUDA IPC (got device {tensor.device})")
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        raise CudaShareError("cannot share an empty storage")
    try:
        shared = storage._share_cuda_()
    except (AttributeError, RuntimeError) as e:
        raise CudaShareError(f"torch {torch.__version__}: UntypedStorage._share_cuda_() failed: {e}") from e
    if not isinstance(shared, tuple) or len(shared) < 4:
        raise CudaShareError(f"torch {torch.__version__}: _share_cuda_() returned {type(shared).__name__} "
                             f"of {len(shared) if isinstance(shared, tuple) else '?'} items, expected 8")
    device, raw, size_bytes, offset_bytes = shared[:4]
    if raw is None:
        raise CudaShareError("torch returned no CUDA IPC handle (a storage without memory)")
    if int(size_bytes) != storage.nbytes():
        raise CudaShareError(f"_share_cuda_() reports {size_bytes} bytes, the storage has {storage.nbytes()}")
    return ExportedStorage(int(device), parse_torch_handle(raw), int(offset_bytes), int(size_bytes))


# --------------------------------------------------------------------- maths
def gpu_uuid(device: int) -> bytes:
    """The 16-byte UUID of this process's GPU ``device``
    (``kvd.cudart.Cudart.device_uuid``), sent as ``Segment.device_uuid`` so
    that a daemon numbering GPUs differently finds the same one; empty when
    the runtime cannot tell (the daemon then goes by the ordinal)."""
    from kvd import cudart

    try:
        return cudart.load().device_uuid(device)
    except (cudart.CudaUnavailable, cudart.CudaError) as e:
        log.warning("kvd: no UUID for GPU %d (%s); the daemon must number GPUs as this engine does", device, e)
        return b""


def plan_regions(
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    *,
    block_dim: int | None = None,
    groups: Mapping[str, int] | None = None,
) -> KvCachePlan:
    """Regions of vLLM GPU KV cache tensors (``layer name -> tensor``):
    ``kvd.shim.memory.regions.plan_regions`` on any device, a block's bytes one
    dense run in any order (vLLM's HND ``kv_cache_stride_order`` views).

    Args: as ``kvd.shim.memory.shm.plan_regions`` (``groups``: layer -> vLLM
    HMA KV-cache group; regions are deduped within a group).

    Raises:
        CudaShareError: no block dim, a block that is not one dense run, kernel
            blocks that are not dense, overlapping blocks or mixed dtypes; the
            message names the layer.
    """
    return regions.plan_regions(kv_caches, num_blocks, block_dim=block_dim, groups=groups, device_type=None,
                                permuted_blocks=True, error=CudaShareError)


def infer_kv_layout(t: torch.Tensor, block_dim: int, block_size: int, num_kv_heads: int) -> str | None:
    """``"NHD"`` or ``"HND"``: the physical order of tokens and heads inside a
    block of ``t`` (tokens outer: NHD), or None when the shape cannot tell
    (no such dims, or ``block_size == num_kv_heads``)."""
    if block_size == num_kv_heads:
        return None
    shape, strides = tuple(t.shape), tuple(t.stride())
    inner = list(range(block_dim + 1, len(shape)))
    tok = [d for d in inner if shape[d] == block_size]
    head = [d for d in inner if shape[d] == num_kv_heads]
    if len(tok) != 1 or len(head) != 1 or num_kv_heads == 1:
        return None
    return "NHD" if strides[tok[0]] > strides[head[0]] else "HND"


# ------------------------------------------------------------------- proto
@dataclass
class SharedCudaKvCaches:
    """What ``RegisterEngineRequest`` needs, and what the staged path's copies need.

    Attributes:
        segments: one ``MEMORY_KIND_CUDA_IPC`` segment per allocation.
        regions: offsets from each allocation's base.
        layout: the layout message.
        exported: one per storage of :attr:`plan` (same order).
        plan: the storage-relative regions (for copies in the engine).
        segment_of_storage: segment index of each storage.
    """

    segments: list[pb.Segment]
    regions: list[pb.Region]
    layout: pb.Layout
    exported: list[ExportedStorage]
    plan: KvCachePlan
    segment_of_storage: list[int]
    kv_in_block: bool = False

    def cache_blocks(self) -> list[torch.Tensor]:
        """Per region, the ``[num_blocks, block_len]`` ``uint8`` view of the KV
        cache, on its device (the staged path's copy source and target)."""
        spans = ((r.storage, r.offset, r.block_len, r.block_stride) for r in self.plan.regions)
        return regions.block_views(self.plan.storages, spans, self.layout.num_blocks, CudaShareError)


def share_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    exporter: Callable[[torch.Tensor], ExportedStorage] = export_storage,
    **describe: Any,
) -> SharedCudaKvCaches:
    """Exports every allocation behind ``kv_caches`` and describes it for the daemon.

    Args: as ``kvd.shim.memory.shm.share_kv_caches`` (``describe``: the fields
    of ``kvd.shim.memory.regions.KvDescription``); ``exporter`` turns a
    storage's tensor into an :class:`ExportedStorage` (tests pass a fake).

    Raises:
        CudaShareError: see :func:`plan_regions` and :func:`export_storage`; a
            declared ``kv_layout`` that contradicts the tensors' strides; regions
            past their storage; tensors on more than one device.
        TypeError: a missing or unknown ``describe`` key.
    """
    d = KvDescription(**describe)
    d.check(CudaShareError)
    plan = plan_regions(kv_caches, d.num_blocks, block_dim=d.block_dim, groups=d.groups)
    if d.kv_layout != "MLA":
        for layer in plan.layers:
            found = infer_kv_layout(kv_caches[layer], plan.block_dims[layer], d.block_size, d.num_kv_heads)
            if found is not None and found != d.kv_layout:
                raise CudaShareError(f"layer {layer}: declared kv_layout {d.kv_layout}, but its strides put the "
                                     f"blocks in {found} order (vLLM kv_cache_stride_order)")
    exported = [exporter(t) for t in plan.storages]
    devices = sorted({e.device for e in exported})
    if len(devices) != 1:
        raise CudaShareError(f"a worker's KV cache must be on one device (got devices {devices})")
    seg_index: dict[bytes, int] = {}
    sizes: list[int] = []
    seg_of: list[int] = []
    for e in exported:
        if e.handle not in seg_index:
            seg_index[e.handle] = len(sizes)
            sizes.append(0)
        i = seg_index[e.handle]
        sizes[i] = max(sizes[i], e.size)
        seg_of.append(i)
    handles = sorted(seg_index, key=seg_index.get)
    uuid = gpu_uuid(devices[0])
    segments = [pb.Segment(kind=pb.MEMORY_KIND_CUDA_IPC, handle=h, device=devices[0], size=sz, device_uuid=uuid)
                for h, sz in zip(handles, sizes)]
    wire = regions.wire_regions(plan, d.num_blocks, bases=[e.offset for e in exported],
                                nbytes=[e.nbytes for e in exported], segment_of=seg_of, error=CudaShareError)
    layout = regions.wire_layout(plan, d, head_dim=d.head_dim)
    # A block that is more than tokens x heads x head_dim of one K or V
    # (FlashInfer's [2, block_size, heads, head_dim] per block) holds K and V
    # together: the daemon can move it whole only, between equal block sizes.
    esize = plan.storages[0].element_size() if plan.storages else 1
    token_bytes = d.block_size * d.num_kv_heads * d.head_dim * esize
    kv_in_block = d.kv_layout != "MLA" and any(r.block_len != token_bytes for r in plan.regions)
    return SharedCudaKvCaches(segments, wire, layout, exported, plan, seg_of, kv_in_block)


# ---------------------------------------------------------------- sharing
def synchronize(device: torch.device) -> None:
    """Waits for every stream of ``device`` (``torch.cuda.synchronize``)."""
    torch.cuda.synchronize(device)


class CudaIpcSharing(KvSharing):
    """CUDA KV caches on one device: one CUDA IPC segment per allocation.

    Every ``data_path`` registers the same segments; the daemon opens them
    (direct), gives them VRAM mirrors (staged; shm mirrors on a daemon
    without a GPU) or chooses by whether UCX can re-export the imported
    memory (auto, ``kvd.core.path_select``); the response says which, and
    :meth:`attach` maps the mirrors then.

    Args:
        data_path: ``"direct"``, ``"staged"`` or ``"auto"``.
        device: the KV cache's device (``kvd.shim.memory.auto.kv_device``).
    """

    kind = "cuda_ipc"

    def __init__(self, data_path: str = "direct", device: torch.device | None = None):
        super().__init__(data_path)
        self.device = torch.device("cuda", 0) if device is None else device

    def share(self, kv_caches: Mapping[str, torch.Tensor], **describe) -> SharedCudaKvCaches:
        """Exports each allocation (:func:`export_storage`). Raises
        :class:`CudaShareError` (expandable segments, more than one device,
        a layout the strides contradict)."""
        # export_storage looked up per call: the module's one export function
        # (tests stand in for torch's _share_cuda_ by replacing it).
        self.shared = share_kv_caches(kv_caches, exporter=lambda t: export_storage(t), **describe)
        return self.shared

    def sync(self) -> None:
        """Waits for the device before a hold: the forward pass that wrote the
        held blocks ran on the engine's streams, and the daemon's NIXL READ
        (direct) or the peer's read of the mirror (staged) is ordered after
        none of them. Called in ``start_load_kv`` only on steps that send a
        hold, when that step's own kernels are not launched yet."""
        synchronize(self.device)

