"""vLLM 0.32 pieces the in-process engine-loop tests share
(tests/test_shim_vllm.py, tests/test_shim_realdaemon.py): the tiny model's
KV shape, a ``VllmConfig`` with KvdConnector, KV cache configs (one group,
or the hybrid two-group layout as vLLM groups it) and requests.

Not in :mod:`kvd.testing`: this module imports vllm, and inside kvd only the
vLLM shim package may (docs/DESIGN.md, dependency rules). Import it after a
test module's vllm skip guard.
"""

from __future__ import annotations

import json

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                        SlidingWindowSpec)
from vllm.v1.request import Request

BS, NB, LAYERS, KV_HEADS, HEAD = 32, 64, ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"), 2, 32
EOS = 2047


def vllm_config(model_dir: str, sock: str, *, role: str = "kv_both", policy: str = "fail",
                max_num_batched_tokens: int = 2048, **extra) -> VllmConfig:
    mc = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=2048)
    cc = CacheConfig(block_size=BS, enable_prefix_caching=True)
    cc.kv_cache_layout = "LBHNC"  # what the engine core resolves for the CPU backend
    kv = KVTransferConfig(
        kv_connector="KvdConnector", kv_connector_module_path="kvd.shim.vllm", kv_role=role,
        kv_load_failure_policy=policy, kv_connector_extra_config={"kvd_socket": sock, **extra},
    )
    return VllmConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=2048, is_encoder_decoder=False),
        model_config=mc, cache_config=cc, kv_transfer_config=kv, device_config=DeviceConfig("cpu"),
    )


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32)
    page = spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[KVCacheTensor(size=NB * page * len(LAYERS), layers=list(LAYERS),
                                        layer_stride=NB * page, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )


HMA_LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
WINDOW = 64                      # tokens of the sliding-window layers
WINDOW_BLOCKS = WINDOW // BS + 1  # what NixlConnector keeps of them: cdiv(window, block) + 1


def hma_kv_cache_config(config: VllmConfig) -> KVCacheConfig:
    """A hybrid model as vLLM itself groups it: layers 0 and 2 full attention
    (group 0), layers 1 and 3 a 64-token sliding window (group 1), the two
    groups overlaid on the same bytes (vLLM's own get_kv_cache_groups and
    get_kv_cache_config_from_groups)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

    full = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32)
    sw = SlidingWindowSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32,
                           sliding_window=WINDOW)
    specs = {name: (full if i % 2 == 0 else sw) for i, name in enumerate(HMA_LAYERS)}
    groups = get_kv_cache_groups(config, specs)
    assert [type(g.kv_cache_spec) for g in groups] == [FullAttentionSpec, SlidingWindowSpec]
    kcc = get_kv_cache_config_from_groups(config, groups, NB * full.page_size_bytes * 2)
    assert kcc.num_blocks == NB
    return kcc


_ids = iter(range(1, 1 << 30))


def make_request(prompt: list[int], params: dict | None, max_tokens: int = 4, rid: str | None = None) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, EOS)
    req = Request(request_id=rid or f"req-{next(_ids)}", prompt_token_ids=list(prompt), sampling_params=sp,
                  pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256))
    req.kv_transfer_params = params
    return req


def remote_params(prefill_output_params: dict) -> dict:
    """What vLLM's toy proxy forwards to the decode engine: the params as JSON."""
    return json.loads(json.dumps(prefill_output_params))
