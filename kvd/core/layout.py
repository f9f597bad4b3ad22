"""KV cache layouts: validation, compatibility hash and descriptor maths.

A worker's KV cache is a list of regions; block ``b`` of region ``r`` occupies
``[base_r + b * stride_r, base_r + b * stride_r + block_len_r)`` in the daemon's
mapping of the region's segment. The descriptor list the daemon prepares for a
worker (local, or remote at handshake) holds one row per (region, block):
row ``r * num_blocks + b``. A transfer of blocks ``B`` then names rows
``r * num_blocks + B`` for every region ``r``, in the same order on both sides.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from kvd.core.limits import BOUNDS

KV_LAYOUTS = ("NHD", "HND", "MLA")
# A region's name is a vLLM layer name and a suffix ("model.layers.0.self_attn.attn.k": tens of
# characters); a dtype's, torch's ("bfloat16"). Both come from engines and peers and are quoted in
# errors, logs and load failures: a hostile peer's 48 MiB ``memory`` field stalled a daemon's loop
# 2.2 s through one such quote (attacker review), so every such field is bounded where it is checked.
MAX_NAME_CHARS = 1024
MAX_DTYPE_CHARS = 64


class LayoutError(ValueError):
    """A layout or region is invalid; the message names the field."""


@dataclass(frozen=True)
class Region:
    """One run of equal blocks inside one segment (units: bytes).

    Attributes:
        segment: index of the segment it lies in.
        offset: from the segment start to block 0.
        block_len: bytes moved per block.
        block_stride: from block b to b+1 (>= block_len).
        name: for logs, e.g. ``"model.layers.0.self_attn.attn/k"``.
    """

    segment: int
    offset: int
    block_len: int
    block_stride: int
    name: str = ""
    group: int = 0  # KV-cache group (vLLM HMA)


@dataclass(frozen=True)
class Layout:
    """The shape of one worker's KV cache, as exchanged at handshake.

    ``block_size`` is in tokens, ``block_lens`` in bytes (one per region).
    """

    num_blocks: int
    block_size: int
    kv_layout: str
    dtype: str
    num_kv_heads: int
    head_dim: int
    num_layers: int
    block_lens: tuple[int, ...] = field(default_factory=tuple)
    total_kv_heads: int = 0  # whole model; 0 = num_kv_heads x TP size (1 for MLA)
    # K and V of a head share the block (vLLM-CPU): HND only, a block is
    # [heads, 2, tokens, head_dim // 2] (``head_dim`` = K + V of one token).
    kv_in_block: bool = False
    # With kv_in_block: K of a head is [head_dim // 2, tokens] (dim-major,
    # vLLM-CPU's vec kernels); V stays [tokens, head_dim // 2].
    k_dim_major: bool = False

    def model_kv_heads(self, tp_size: int) -> int:
        """KV heads of the whole model (all TP ranks)."""
        if self.kv_layout == "MLA":
            return 1
        return self.total_kv_heads or self.num_kv_heads * tp_size


def validate(layout: Layout, regions: list[Region], segment_sizes: list[int]) -> None:
    """Checks that every block of every region lies inside its segment, and
    that the layout's fields are in range (``dtype`` at most
    :data:`MAX_DTYPE_CHARS` characters, region names :data:`MAX_NAME_CHARS`).

    Raises:
        LayoutError: the first violation, naming the region and the numbers.
    """
    if len(layout.dtype) > MAX_DTYPE_CHARS:
        raise LayoutError(f"dtype of {len(layout.dtype)} characters (at most {MAX_DTYPE_CHARS})")
    if not 0 < layout.num_blocks <= BOUNDS.max_blocks:
        raise LayoutError(f"num_blocks must be in 1..{BOUNDS.max_blocks} (got {layout.num_blocks})")
    if layout.block_size <= 0:
        raise LayoutError(f"block_size must be > 0 tokens (got {layout.block_size})")
    if layout.kv_layout not in KV_LAYOUTS:
        raise LayoutError(f"kv_layout must be one of {KV_LAYOUTS} (got {layout.kv_layout!r})")
    if layout.kv_in_block and (layout.kv_layout != "HND" or layout.head_dim % 2):
        raise LayoutError(f"kv_in_block needs kv_layout HND and an even head_dim (K and V of one token), "
                          f"got {layout.kv_layout} with head_dim {layout.head_dim}")
    if layout.k_dim_major and not layout.kv_in_block:
        raise LayoutError("k_dim_major describes a kv_in_block layout; kv_in_block is not set")
    if not 0 < len(regions) <= BOUNDS.max_regions:
        raise LayoutError(f"a worker registers 1..{BOUNDS.max_regions} regions (got {len(regions)})")
    if len(regions) * layout.num_blocks > BOUNDS.max_descriptors:
        raise LayoutError(f"{len(regions)} regions x {layout.num_blocks} blocks exceeds {BOUNDS.max_descriptors} "
                          f"descriptors")
    if layout.block_lens and tuple(r.block_len for r in regions) != tuple(layout.block_lens):
        raise LayoutError("layout.block_lens does not match the regions' block_len")
    groups = sorted({r.group for r in regions})
    if groups != list(range(len(groups))):
        raise LayoutError(f"region groups must be numbered 0..G-1 (got {groups[:8]})")
    for i, r in enumerate(regions):
        if len(r.name) > MAX_NAME_CHARS:
            raise LayoutError(f"region {i}: name of {len(r.name)} characters (at most {MAX_NAME_CHARS})")
        label = f"region {i} ({r.name or 'unnamed'})"
        if not 0 <= r.segment < len(segment_sizes):
            raise LayoutError(f"{label}: segment_index {r.segment} out of range (have {len(segment_sizes)})")
        if r.block_len <= 0:
            raise LayoutError(f"{label}: block_len must be > 0 bytes")
        if r.block_stride < r.block_len:
            raise LayoutError(f"{label}: block_stride {r.block_stride} < block_len {r.block_len}")
        end = r.offset + (layout.num_blocks - 1) * r.block_stride + r.block_len
        if end > segment_sizes[r.segment]:
            raise LayoutError(
                f"{label}: {layout.num_blocks} blocks end at byte {end}, "
                f"past its segment of {segment_sizes[r.segment]} bytes"
            )


def compat_hash(model: str, layout: Layout, tp_size: int, num_regions: int, extra: str = "") -> str:
    """Hex digest of what two workers must share to exchange blocks at all.

    Covers the model, dtype, head_dim, layer count, the model's KV heads, MLA
    or not, and the region count. Not TP size, block size, HND/NHD or
    ``num_blocks``: those may differ between prefill and decode, and the
    handshake checks each pair (``kvd.core.plan.compatible``) with a message
    naming the mismatch. 16 hex digits of SHA-256.
    """
    parts = [
        "kvd.v1",
        model,
        layout.dtype,
        str(layout.head_dim),
        str(layout.num_layers),
        str(layout.model_kv_heads(tp_size)),
        "mla" if layout.kv_layout == "MLA" else "kv",
        str(num_regions),
        extra,
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def block_descriptors(bases: list[int], regions: list[Region], num_blocks: int) -> np.ndarray:
    """All (region, block) descriptors: int64 array ``(len(regions) * num_blocks, 3)``.

    ``bases[i]`` is the virtual address of region i's block 0 in the process
    that registered it (the daemon that owns the memory).
    """
    rows = np.empty((len(regions) * num_blocks, 3), dtype=np.int64)
    blocks = np.arange(num_blocks, dtype=np.int64)
    for i, (base, r) in enumerate(zip(bases, regions)):
        sl = slice(i * num_blocks, (i + 1) * num_blocks)
        rows[sl, 0] = base + blocks * r.block_stride
        rows[sl, 1] = r.block_len
        rows[sl, 2] = 0
    return rows
