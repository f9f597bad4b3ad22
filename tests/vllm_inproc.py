"""vLLM pieces the in-process engine-loop tests share (tests/test_shim_vllm*.py,
tests/test_shim_realdaemon.py): the tiny model's KV shape, a ``VllmConfig``
with KvdConnector, KV cache configs (one group, or the hybrid two-group
layout as vLLM groups it), requests, and :class:`Engine` (vLLM's scheduler
and a worker-side KvdConnector; one ``step`` = one engine step).

Not in :mod:`kvd.testing`: this module imports vllm, and inside kvd only the
vLLM shim package may (docs/DESIGN.md, dependency rules). Import it after a
test module's vllm skip guard.
"""

from __future__ import annotations

import json
import time

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                        SlidingWindowSpec)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvd.shim.vllm import KvdConnector

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


def prefill_request(prompt: list[int]) -> Request:
    """A request a prefill engine finishes with ``kv_transfer_params`` for a decode engine (the toy proxy's first leg)."""
    return make_request(prompt, {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_request_id": None, "remote_host": None,
                                 "remote_port": None}, max_tokens=1)


class Engine:
    """vLLM's scheduler + a worker-side KvdConnector; one ``step`` = one engine step."""

    def __init__(self, model_dir: str, sock: str, hma: bool = False, write_kv: bool = False, **kw):
        self.config = vllm_config(model_dir, sock, **kw)
        kcc = hma_kv_cache_config(self.config) if hma else kv_cache_config()
        self.kcc = kcc
        self.config.cache_config.num_gpu_blocks = NB
        self.sched = Scheduler(vllm_config=self.config, kv_cache_config=kcc, log_stats=True,
                               structured_output_manager=StructuredOutputManager(self.config), block_size=BS)
        self.connector = self.sched.connector
        assert isinstance(self.connector, KvdConnector)
        self.worker = KvdConnector(self.config, KVConnectorRole.WORKER, kcc)
        self.caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC,
                                        [BS] * len(kcc.kv_cache_groups))
        self.worker.register_kv_caches(self.caches)
        # What vLLM's EngineCore does next (vllm/v1/engine/core.py): every
        # worker's handshake metadata, keyed (pp_rank, tp_rank), to the
        # scheduler's connector.
        meta = self.worker.get_handshake_metadata()
        if meta is not None:
            self.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): meta})
        self.stats: list = []
        self.write_kv = write_kv
        self.outputs: dict[str, list] = {}
        self.step_times: list[float] = []

    def forward(self, out) -> None:
        """What the forward pass writes: block b of layer i of every scheduled
        request holds 100 * i + b (only with write_kv)."""
        for rid in out.num_scheduled_tokens:
            for group, ids in zip(self.kcc.kv_cache_groups, self.sched.kv_cache_manager.get_block_ids(rid)):
                for name in group.layer_names:
                    i = list(self.caches).index(name)
                    for b in ids:
                        if b:
                            self.caches[name][b].fill_(float(100 * i + b))

    def step(self) -> None:
        out = self.sched.schedule()
        t0 = time.perf_counter()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        if self.write_kv:
            self.forward(out)
        self.worker.wait_for_save()
        res = self.worker.get_transfer_results(out.finished_req_ids)
        kvo = KVConnectorOutput(
            finished_sending=res.finished_sending, finished_recving=res.finished_recving,
            failed_recving=res.failed_recving, invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
            kv_connector_stats=self.worker.get_kv_connector_stats(),
        )
        if kvo.kv_connector_stats is not None:
            self.stats.append(kvo.kv_connector_stats)
        self.worker.clear_connector_metadata()
        self.step_times.append(time.perf_counter() - t0)
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.sched.requests[rid]
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled, kv_connector_output=kvo)
        for outs in self.sched.update_from_output(out, mro).values():
            for o in outs.outputs:
                self.outputs.setdefault(o.request_id, []).append(o)
        self.last_meta = out.kv_connector_metadata

    def run_until(self, cond, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, "engine loop timed out"
            self.step()
            time.sleep(0.005)

    def finished(self, rid: str):
        return next((o for o in self.outputs.get(rid, []) if o.finish_reason is not None), None)

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()
