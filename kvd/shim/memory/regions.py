"""Region maths shared by the CPU (``kvd.shim.memory.shm``) and GPU
(``kvd.shim.memory.cuda_ipc``) sharing paths and the staged path's copies
(``kvd.shim.memory.staged``): which bytes of vLLM's KV cache tensors are
one block of one region, and the ``RegisterEngineRequest`` regions and
layout both sharing paths build from it.

vLLM hands ``register_kv_caches`` one tensor per layer (often views of one
backing allocation, ``vllm/v1/worker/utils.py:allocate_kv_cache``). A tensor
has a block dimension (size ``num_blocks``, or a multiple of it when the
attention kernel uses smaller "kernel blocks"); every index of the dims
before it (K/V, say) is one region; the dims after it must cover one dense
run of bytes, since kvd moves whole blocks. Regions are deduped by
(storage, offset, length, stride) within a KV-cache group (vLLM HMA
overlays groups on the same bytes, each group addressing them by its own
block ids).

Units: bytes for sizes, strides and offsets.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvd.v1 import kvd_pb2 as pb

#: ``Layout.kv_layout`` values by name.
KV_LAYOUTS = {"NHD": pb.KV_LAYOUT_NHD, "HND": pb.KV_LAYOUT_HND, "MLA": pb.KV_LAYOUT_MLA}


class KvShareError(ValueError):
    """A KV cache tensor cannot be described as regions; the message says why.
    (``CpuShareError`` and ``CudaShareError`` are its kinds.)"""


@dataclass(frozen=True)
class RegionPlan:
    """One region, relative to its storage's byte 0 (units: bytes).

    Block ``b`` occupies ``[offset + b * block_stride, ... + block_len)``.
    """

    storage: int        # index into KvCachePlan.storages
    offset: int
    block_len: int
    block_stride: int
    name: str
    layer: str
    group: int = 0      # KV-cache group of the layer (vLLM HMA), numbered 0..G-1


@dataclass
class KvCachePlan:
    """Regions of a set of KV cache tensors, before any sharing or export.

    Attributes:
        storages: one tensor per distinct storage (the first layer seen on it),
            in order of first appearance; ``RegionPlan.storage`` indexes it.
        regions: deduped regions in layer order (dict order of the input),
            then index order of the dims before the block dim.
        layers: layer names that own at least one region, in order.
        dtype: the common element type of all tensors.
        kernel_blocks: the most kernel blocks merged into one block (1: none).
        block_dims: the block dimension of each layer's tensor.
    """

    storages: list[torch.Tensor] = field(default_factory=list)
    regions: list[RegionPlan] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    dtype: torch.dtype | None = None
    kernel_blocks: int = 1
    block_dims: dict[str, int] = field(default_factory=dict)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the proto's ``Layout.dtype``)."""
    return str(dtype).removeprefix("torch.")


def is_dense(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when a tensor of this shape/strides covers one contiguous run in
    row-major order (element strides)."""
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def dense_as_set(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when the elements of a (possibly permuted) view cover one
    contiguous run (element strides)."""
    dims = sorted((st, n) for n, st in zip(shape, strides) if n != 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


def find_block_dim(shape: tuple[int, ...], num_blocks: int, block_dim: int | None,
                   error: type[KvShareError] = KvShareError) -> tuple[int, int]:
    """``(block dim, kernel blocks per block)`` of a KV cache tensor shape.

    The first dim of size ``num_blocks``, else the first multiple of it
    (the attention kernel's blocks are smaller than the manager's: vLLM's
    kernel block size). ``block_dim`` forces the dim. Raises ``error``.
    """
    if block_dim is not None:
        if not -len(shape) <= block_dim < len(shape):
            raise error(f"block_dim {block_dim} out of range for shape {tuple(shape)}")
        d = block_dim % len(shape)
        if shape[d] % num_blocks:
            raise error(f"dim {d} of shape {tuple(shape)} is not a multiple of num_blocks={num_blocks}")
        return d, shape[d] // num_blocks
    for d, n in enumerate(shape):
        if n == num_blocks:
            return d, 1
    for d, n in enumerate(shape):
        if n > num_blocks and n % num_blocks == 0:
            return d, n // num_blocks
    raise error(f"no dimension of size num_blocks={num_blocks} in KV cache shape {tuple(shape)}")


def storage_key(t: torch.Tensor) -> tuple:
    """Identity of ``t``'s storage: its device and address (meta tensors have
    none, so their StorageImpl's identity stands in)."""
    s = t.untyped_storage()
    ptr = s.data_ptr()
    return (t.device.type, t.device.index, ptr if ptr else ("impl", s._cdata))


def plan_regions(
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    *,
    block_dim: int | None = None,
    groups: Mapping[str, int] | None = None,
    device_type: str | None = None,
    permuted_blocks: bool = False,
    error: type[KvShareError] = KvShareError,
) -> KvCachePlan:
    """Regions of vLLM KV cache tensors (``layer name -> tensor``).

    Args:
        kv_caches: the dict vLLM passes to ``register_kv_caches``.
        num_blocks: blocks of the KV cache manager (``KVCacheConfig.num_blocks``).
        block_dim: force the block dimension (see :func:`find_block_dim`).
        groups: layer name -> KV-cache group (vLLM HMA; default: all group 0);
            regions are deduped within a group only.
        device_type: every tensor must be on this device type (None: any).
        permuted_blocks: accept a block whose bytes are one dense run in a
            permuted order (vLLM's HND stride order on GPUs; the caller then
            declares the layout); otherwise row-major order is required.
        error: the exception type raised (a :class:`KvShareError`).

    Raises:
        ``error``: no block dim, a block that is not one dense run, kernel
        blocks that are not dense, overlapping blocks, negative strides, mixed
        dtypes or a tensor on another device; the message names the layer.
    """
    if num_blocks <= 0:
        raise error(f"num_blocks must be > 0 (got {num_blocks})")
    plan = KvCachePlan()
    storage_index: dict[tuple, int] = {}
    seen: set[tuple[int, int, int, int, int]] = set()
    dense = dense_as_set if permuted_blocks else is_dense
    for layer, t in kv_caches.items():
        if not isinstance(t, torch.Tensor):
            raise error(f"layer {layer}: KV cache is a {type(t).__name__}, not a tensor")
        if device_type is not None and t.device.type != device_type:
            raise error(f"layer {layer}: KV cache is on {t.device}; this path shares {device_type} memory only")
        if plan.dtype is None:
            plan.dtype = t.dtype
        elif t.dtype != plan.dtype:
            raise error(f"layer {layer}: dtype {t.dtype} differs from {plan.dtype} of earlier layers")
        shape, strides = tuple(t.shape), tuple(t.stride())
        d, kernel_per_block = find_block_dim(shape, num_blocks, block_dim, error)
        plan.block_dims[layer] = d
        esize = t.element_size()
        inner_shape, inner_strides = shape[d + 1:], strides[d + 1:]
        if not dense(inner_shape, inner_strides):
            raise error(
                f"layer {layer}: the bytes of one block are not one contiguous run "
                f"(shape {shape}, strides {strides}, block dim {d}); kvd moves whole blocks, "
                "so it needs a layout whose dims after the block dim are dense (vLLM LBHNC/LBNHC)")
        # A block must not reach back before the region's start either (a
        # negative or permuted block dim): the maths assume blocks ascend.
        if any(st < 0 for st in strides):
            raise error(f"layer {layer}: negative strides {strides} are not supported")
        kernel_len = esize
        for n in inner_shape:
            kernel_len *= n
        kernel_stride = strides[d] * esize
        if kernel_per_block > 1 and kernel_stride != kernel_len:
            raise error(f"layer {layer}: {kernel_per_block} kernel blocks per block are not dense "
                        f"(stride {kernel_stride} B, length {kernel_len} B)")
        block_len = kernel_len * kernel_per_block
        block_stride = kernel_stride * kernel_per_block
        plan.kernel_blocks = max(plan.kernel_blocks, kernel_per_block)
        if block_stride < block_len:
            raise error(f"layer {layer}: blocks overlap (stride {block_stride} B < length {block_len} B)")
        key = storage_key(t)
        if key not in storage_index:
            storage_index[key] = len(plan.storages)
            plan.storages.append(t)
        s = storage_index[key]
        group = int(groups[layer]) if groups is not None else 0
        prefix = shape[:d]
        added = False
        for idx in itertools.product(*(range(n) for n in prefix)):
            offset = (t.storage_offset() + sum(i * st for i, st in zip(idx, strides[:d]))) * esize
            ident = (s, offset, block_len, block_stride, group)
            if ident in seen:
                continue
            seen.add(ident)
            if prefix == (2,):
                suffix = "/k" if idx[0] == 0 else "/v"
            elif prefix:
                suffix = "/" + ",".join(map(str, idx))
            else:
                suffix = ""
            plan.regions.append(RegionPlan(s, offset, block_len, block_stride, layer + suffix, layer, group))
            added = True
        if added:
            plan.layers.append(layer)
    if not plan.regions:
        raise error("no KV cache tensors to register")
    return plan


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D ``uint8`` view of ``t``'s whole storage (byte 0 = the storage's
    byte 0), on ``t``'s device."""
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(s, 0, (s.nbytes(),), (1,))


def block_view(buf: torch.Tensor, offset: int, block_len: int, block_stride: int, num_blocks: int,
               error: type[Exception] = KvShareError) -> torch.Tensor:
    """``[num_blocks, block_len]`` view of a region inside a 1-D ``uint8`` buffer
    (block ``b`` at ``offset + b * block_stride``, bytes).

    Raises:
        ``error``: the region reaches outside the buffer.
    """
    if offset < 0 or offset + (num_blocks - 1) * block_stride + block_len > buf.numel():
        raise error(f"region at {offset} ({num_blocks} x {block_stride} B) outside a buffer of "
                    f"{buf.numel()} bytes")
    return buf.as_strided((num_blocks, block_len), (block_stride, 1), buf.storage_offset() + offset)


# ------------------------------------------------------------------- proto
@dataclass(frozen=True)
class KvDescription:
    """What a worker says about its KV cache beside the tensors: the keyword
    arguments of ``KvSharing.share`` and of each path's ``share_kv_caches``.

    Attributes:
        num_blocks: blocks per region (``KVCacheConfig.num_blocks``).
        block_size: tokens per block (the KV cache manager's block size).
        kv_layout: ``"HND"``, ``"NHD"`` or ``"MLA"``: the order of tokens and
            heads inside one block.
        num_kv_heads: KV heads held by this TP rank.
        head_dim: head size in elements.
        total_kv_heads: KV heads of the whole model (0: ``num_kv_heads`` x TP size).
        block_dim: force the block dimension (see :func:`find_block_dim`).
        groups: layer name -> KV-cache group (vLLM HMA; default: all group 0).
    """

    num_blocks: int
    block_size: int
    kv_layout: str
    num_kv_heads: int
    head_dim: int
    total_kv_heads: int = 0
    block_dim: int | None = None
    groups: Mapping[str, int] | None = None

    def check(self, error: type[KvShareError] = KvShareError) -> None:
        """Refuses a ``kv_layout`` not in :data:`KV_LAYOUTS` or a ``block_size``
        below 1 token, raising ``error``."""
        if self.kv_layout not in KV_LAYOUTS:
            raise error(f"kv_layout must be one of {sorted(KV_LAYOUTS)} (got {self.kv_layout!r})")
        if self.block_size <= 0:
            raise error(f"block_size must be > 0 tokens (got {self.block_size})")


def wire_regions(plan: KvCachePlan, num_blocks: int, *, bases: Sequence[int], nbytes: Sequence[int],
                 segment_of: Sequence[int] | None = None,
                 error: type[KvShareError] = KvShareError) -> list[pb.Region]:
    """``RegisterEngineRequest.regions`` of ``plan`` (units: bytes).

    Args:
        plan: from :func:`plan_regions`.
        num_blocks: blocks per region.
        bases: per storage of ``plan``, the offset of its byte 0 in its
            segment (the shm header; the storage's place in its CUDA allocation).
        nbytes: per storage, its size: no region may reach past it.
        segment_of: per storage, its segment index (default: one segment per storage).

    Raises:
        ``error``: a region whose ``num_blocks`` blocks end past its storage.
    """
    out = []
    for r in plan.regions:
        end = r.offset + (num_blocks - 1) * r.block_stride + r.block_len
        if end > nbytes[r.storage]:
            raise error(f"region {r.name}: {num_blocks} blocks end at byte {end}, "
                        f"past its storage of {nbytes[r.storage]} bytes")
        out.append(pb.Region(segment_index=segment_of[r.storage] if segment_of is not None else r.storage,
                             offset=bases[r.storage] + r.offset, block_len=r.block_len,
                             block_stride=r.block_stride, name=r.name, group=r.group))
    return out


def wire_layout(plan: KvCachePlan, d: KvDescription, *, head_dim: int, kv_in_block: bool = False) -> pb.Layout:
    """``RegisterEngineRequest.layout`` of ``plan`` described by ``d``:
    ``head_dim`` is what the caller worked out (elements per token and head
    in a block), ``kv_in_block`` the layout flag (K and V runs the daemon may
    move apart)."""
    return pb.Layout(
        num_blocks=d.num_blocks, block_size=d.block_size, kv_layout=KV_LAYOUTS[d.kv_layout],
        dtype=dtype_name(plan.dtype) if plan.dtype is not None else "", num_kv_heads=d.num_kv_heads,
        head_dim=head_dim, num_layers=len(plan.layers), block_lens=[r.block_len for r in plan.regions],
        total_kv_heads=d.total_kv_heads, kv_in_block=kv_in_block,
    )


def block_views(storages: Sequence[torch.Tensor], spans: Iterable[tuple[int, int, int, int]], num_blocks: int,
                error: type[Exception] = KvShareError) -> list[torch.Tensor]:
    """Per span ``(storage index, offset from the storage's byte 0, block_len,
    block_stride)``, the ``[num_blocks, block_len]`` ``uint8`` view of those
    bytes of ``storages`` (what ``SharedKv.cache_blocks`` returns: the staged
    path's copy source and target). Raises ``error`` (:func:`block_view`)."""
    bufs = [storage_bytes(t) for t in storages]
    return [block_view(bufs[s], offset, block_len, block_stride, num_blocks, error)
            for s, offset, block_len, block_stride in spans]
