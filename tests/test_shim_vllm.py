"""KvdConnector inside vLLM 0.32's real scheduler, against a fake daemon.

Each test runs an in-process "engine loop" with no model: vLLM's own
``Scheduler`` (which constructs the scheduler-side ``KvdConnector`` from the
``--kv-transfer-config`` it would get on the command line), and a worker-side
``KvdConnector`` that registers a KV cache allocated by vLLM's own
``allocate_kv_cache``. Each step does what
``vllm/v1/worker/kv_connector_model_runner_mixin.py:_get_kv_connector_output``
does around a forward pass: bind metadata, ``start_load_kv``,
``get_transfer_results``, ``get_block_ids_with_load_errors``, and hands the
result back to ``Scheduler.update_from_output``.
"""

from __future__ import annotations

import mmap
import os
import time

import pytest
import torch

if os.environ.get("KVD_SKIP_VLLM") == "1":
    pytest.skip("KVD_SKIP_VLLM=1", allow_module_level=True)
pytest.importorskip("vllm")

from transformers import LlamaConfig  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvd.shim.vllm import (  # noqa: E402
    HoldSpec,
    KvdConnector,
    KvdConnectorMetadata,
    KvdShimConfig,
    LoadSpec,
    first_group,
    join_host_port,
    split_host_port,
)
from kvd.v1 import kvd_pb2 as pb  # noqa: E402
from test_client_fakedaemon import PEER_ADDRESS, FakeDaemon  # noqa: E402

BS, NB, LAYERS, KV_HEADS, HEAD = 32, 64, ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"), 2, 32
EOS = 2047
FAST_S = 0.010


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD,
                max_position_embeddings=2048, torch_dtype="float32").save_pretrained(d)
    init_none_hash(sha256)
    return str(d)


def vllm_config(model_dir: str, sock: str, *, role: str = "kv_both", policy: str = "fail", **extra) -> VllmConfig:
    mc = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=2048)
    cc = CacheConfig(block_size=BS, enable_prefix_caching=True)
    cc.kv_cache_layout = "LBHNC"  # what the engine core resolves for the CPU backend
    kv = KVTransferConfig(
        kv_connector="KvdConnector", kv_connector_module_path="kvd.shim.vllm", kv_role=role,
        kv_load_failure_policy=policy, kv_connector_extra_config={"kvd_socket": sock, **extra},
    )
    return VllmConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=2048,
                                         is_encoder_decoder=False),
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


_ids = iter(range(1, 1 << 30))


def make_request(prompt: list[int], params: dict | None, max_tokens: int = 4, rid: str | None = None) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, EOS)
    req = Request(request_id=rid or f"req-{next(_ids)}", prompt_token_ids=list(prompt), sampling_params=sp,
                  pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256))
    req.kv_transfer_params = params
    return req


class Engine:
    """vLLM's scheduler + a worker-side KvdConnector; one ``step`` = one engine step."""

    def __init__(self, model_dir: str, sock: str, **kw):
        self.config = vllm_config(model_dir, sock, **kw)
        kcc = kv_cache_config()
        self.config.cache_config.num_gpu_blocks = NB
        self.sched = Scheduler(vllm_config=self.config, kv_cache_config=kcc, log_stats=True,
                               structured_output_manager=StructuredOutputManager(self.config), block_size=BS)
        self.connector = self.sched.connector
        assert isinstance(self.connector, KvdConnector)
        self.worker = KvdConnector(self.config, KVConnectorRole.WORKER, kcc)
        self.caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC, [BS])
        self.worker.register_kv_caches(self.caches)
        self.outputs: dict[str, list] = {}
        self.step_times: list[float] = []

    def step(self) -> None:
        out = self.sched.schedule()
        t0 = time.perf_counter()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        res = self.worker.get_transfer_results(out.finished_req_ids)
        kvo = KVConnectorOutput(
            finished_sending=res.finished_sending, finished_recving=res.finished_recving,
            failed_recving=res.failed_recving, invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
        )
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


@pytest.fixture
def fake(tmp_path):
    d = FakeDaemon(str(tmp_path / "engine.sock")).start()
    yield d
    d.stop()


def hold_cmds(fake) -> list:
    return [c.hold for c in fake.service.commands if c.WhichOneof("command") == "hold"]


def load_cmds(fake) -> list:
    return [c.load for c in fake.service.commands if c.WhichOneof("command") == "load"]


def prefill_stats(eng: Engine, rid: str):
    return next(o.prefill_stats for o in eng.outputs[rid] if o.prefill_stats is not None)


def wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def remote_params(prefill_output_params: dict) -> dict:
    """What vLLM's toy proxy forwards to the decode engine: the params as JSON."""
    import json

    return json.loads(json.dumps(prefill_output_params))


# ------------------------------------------------------------------ helpers
def test_config_keys_and_addresses():
    cfg = KvdShimConfig.from_extra({"kvd_socket": "/s.sock", "kvd_lease_s": "12", "kvd_peer_address": "[::1]:5"})
    assert (cfg.socket, cfg.lease_s, cfg.load_timeout_s, cfg.peer_address) == ("/s.sock", 12.0, 0.0, "[::1]:5")
    with pytest.raises(ValueError, match="kvd_socket"):
        KvdShimConfig.from_extra({})
    with pytest.raises(ValueError, match="kvd_load_timeout_s"):
        KvdShimConfig.from_extra({"kvd_socket": "/s", "kvd_load_timeout_s": -1})
    with pytest.raises(ValueError, match="host:port"):
        KvdShimConfig.from_extra({"kvd_socket": "/s", "kvd_peer_address": "nope"})
    assert split_host_port("[::1]:5") == ("::1", 5) and join_host_port("::1", 5) == "[::1]:5"
    assert join_host_port("10.0.0.1", "80") == "10.0.0.1:80"
    assert first_group([[1, 2], [3]]) == [1, 2] and first_group([4, 5]) == [4, 5] and first_group([]) == []


# ------------------------------------------------------------- registration
def test_register_kv_caches_shares_vllm_allocation_and_describes_it(model_dir, fake):
    eng = Engine(model_dir, fake.socket, kvd_peer_address="127.0.0.1:7000")
    try:
        (reg,) = fake.service.registers
        spec = kv_cache_config().kv_cache_groups[0].kv_cache_spec
        assert reg.worker == pb.EngineWorker(engine_id=eng.config.kv_transfer_config.engine_id, tp_rank=0, tp_size=1)
        assert (reg.layout.num_blocks, reg.layout.block_size, reg.layout.kv_layout) == (NB, BS, pb.KV_LAYOUT_HND)
        assert (reg.layout.dtype, reg.layout.num_kv_heads, reg.layout.head_dim, reg.layout.num_layers) == (
            "float32", KV_HEADS, HEAD, 2)
        assert reg.layout.total_kv_heads == KV_HEADS
        assert len(reg.segments) == 1 and len(reg.regions) == 2  # one backing buffer, one region per layer
        assert all(r.block_len == spec.page_size_bytes == r.block_stride for r in reg.regions)
        assert reg.model == model_dir and "vllm=0.32" in reg.compat_extra
        assert fake.service.sessions == 1
        # The regions address vLLM's own per-layer views, block by block.
        seg = reg.segments[0]
        with open("/dev/shm" + seg.name, "rb") as f:
            m = mmap.mmap(f.fileno(), seg.size, prot=mmap.PROT_READ)
            for i, (layer, r) in enumerate(zip(LAYERS, reg.regions)):
                view = eng.caches[layer]
                assert tuple(view.shape) == (NB, KV_HEADS, BS, 2 * HEAD)  # [B, H, N, K+V]
                view[5].fill_(float(i + 1))
                start = r.offset + 5 * r.block_stride
                assert m[start:start + r.block_len] == view[5].numpy().tobytes()
            m.close()
    finally:
        eng.close()
    assert len(fake.service.unregisters) == 1


# ---------------------------------------------------------------- prefill side
def test_prefill_finish_returns_nixl_shaped_params_and_holds_until_send_done(model_dir, fake):
    eng = Engine(model_dir, fake.socket, kvd_peer_address="10.1.2.3:7400", kvd_lease_s=45)
    try:
        req = make_request(list(range(100, 200)), {"do_remote_decode": True, "do_remote_prefill": False,
                                                    "remote_engine_id": None, "remote_block_ids": None,
                                                    "remote_request_id": None, "remote_host": None,
                                                    "remote_port": None}, max_tokens=1)
        eng.sched.add_request(req)
        eng.run_until(lambda: eng.finished(req.request_id) is not None)
        params = eng.finished(req.request_id).kv_transfer_params
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert (params["remote_host"], params["remote_port"]) == ("10.1.2.3", 7400)
        assert params["remote_engine_id"] == eng.config.kv_transfer_config.engine_id
        assert params["remote_request_id"] == req.request_id and params["tp_size"] == 1
        (blocks,) = params["remote_block_ids"]
        assert len(blocks) == 4  # 100 tokens / 32 per block
        assert req.request_id in eng.sched.requests, "blocks must stay allocated until finished_sending"

        eng.step()  # the next step carries the hold to the worker
        wait_for(lambda: len(hold_cmds(fake)) == 1)
        (hold,) = hold_cmds(fake)
        assert (hold.request_id, list(hold.block_ids), hold.lease_s) == (req.request_id, blocks, 45)
        assert req.request_id in eng.sched.requests

        eng.worker.worker.client.release(req.request_id)  # the fake ends leases on release
        eng.run_until(lambda: req.request_id not in eng.sched.requests)
    finally:
        eng.close()


def test_aborted_prefill_is_not_held(model_dir, fake):
    eng = Engine(model_dir, fake.socket, kvd_peer_address="10.1.2.3:7400")
    try:
        req = make_request(list(range(300, 340)), {"do_remote_decode": True, "do_remote_prefill": False},
                           max_tokens=1)
        eng.sched.add_request(req)
        eng.sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
        eng.step()
        assert req.request_id not in eng.sched.requests and hold_cmds(fake) == []
    finally:
        eng.close()


def test_prefill_peer_address_comes_from_the_daemon_when_not_configured(model_dir, fake):
    eng = Engine(model_dir, fake.socket)
    try:
        assert join_host_port(eng.connector.scheduler.peer_host, eng.connector.scheduler.peer_port) == PEER_ADDRESS
    finally:
        eng.close()


# ----------------------------------------------------------------- decode side
def decode_params(num_blocks: int, first: int = 40) -> dict:
    return remote_params({
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_block_ids": (list(range(first, first + num_blocks)),), "remote_engine_id": "engine-p",
        "remote_request_id": "p-req-1", "remote_host": "10.9.9.9", "remote_port": 7500, "tp_size": 1,
    })


def test_decode_loads_all_prompt_blocks_then_runs(model_dir, fake):
    eng = Engine(model_dir, fake.socket, role="kv_consumer", kvd_load_timeout_s=12)
    try:
        req = make_request(list(range(500, 600)), decode_params(4))
        eng.sched.add_request(req)
        eng.step()
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        (ld,) = eng.last_meta.loads
        assert ld.awaiting and len(ld.local_block_ids) == 4 and ld.remote_block_ids == [40, 41, 42, 43]
        wait_for(lambda: len(load_cmds(fake)) == 1)
        (cmd,) = load_cmds(fake)
        assert (cmd.remote_address, cmd.remote_engine_id, cmd.remote_request_id) == ("10.9.9.9:7500", "engine-p", "p-req-1")
        assert list(cmd.local_block_ids) == ld.local_block_ids and cmd.timeout_s == 12
        eng.run_until(lambda: eng.finished(req.request_id) is not None)
        ps = prefill_stats(eng, req.request_id)
        # vLLM counts all 100 prompt tokens as external KV transfer, none computed
        assert (ps.num_prompt_tokens, ps.num_external_cached_tokens, ps.num_computed_tokens) == (100, 100, 0)
    finally:
        eng.close()


def test_partial_local_prefix_hit_loads_only_the_missing_tail(model_dir, fake):
    eng = Engine(model_dir, fake.socket, role="kv_consumer")
    try:
        prompt = list(range(700, 800))  # 100 tokens: blocks 0..2 full, block 3 partial
        warm = make_request(prompt[:64] + [1, 2, 3], None, max_tokens=1)  # caches the first 2 blocks locally
        eng.sched.add_request(warm)
        eng.run_until(lambda: eng.finished(warm.request_id) is not None)
        req = make_request(prompt, decode_params(4))
        eng.sched.add_request(req)
        eng.step()
        (ld,) = eng.last_meta.loads
        assert len(ld.local_block_ids) == 2, "only the blocks D does not hold are loaded"
        assert ld.remote_block_ids == [42, 43], "P's blocks trimmed from the front, aligned by position"
        eng.run_until(lambda: eng.finished(req.request_id) is not None)
        ps = prefill_stats(eng, req.request_id)
        assert (ps.num_local_cached_tokens, ps.num_external_cached_tokens, ps.num_computed_tokens) == (64, 36, 0)
    finally:
        eng.close()


def test_nothing_to_load_only_notifies_and_never_reports_a_receive(model_dir, fake):
    """A request that skips the prefix cache (e.g. prompt logprobs) computes its
    prompt locally: P is told (empty load), vLLM never sees a receive for it."""
    eng = Engine(model_dir, fake.socket, role="kv_consumer")
    try:
        req = make_request(list(range(900, 964)), decode_params(2))
        req.skip_reading_prefix_cache = True
        eng.sched.add_request(req)
        eng.run_until(lambda: eng.finished(req.request_id) is not None)
        wait_for(lambda: len(load_cmds(fake)) == 1)
        (ld,) = load_cmds(fake)
        assert (ld.request_id, list(ld.local_block_ids), list(ld.remote_block_ids)) == (req.request_id, [], [])
        for _ in range(5):  # the daemon's recv_done for it must not reach vLLM (it would assert)
            eng.step()
            time.sleep(0.01)
    finally:
        eng.close()


def test_decode_request_aborted_before_scheduling_tells_the_prefill_side(model_dir, fake):
    eng = Engine(model_dir, fake.socket, role="kv_consumer")
    try:
        req = make_request(list(range(1000, 1064)), decode_params(2))
        eng.sched.add_request(req)
        eng.sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
        eng.step()
        (ld,) = eng.last_meta.loads
        assert (ld.request_id, ld.local_block_ids, ld.awaiting, ld.remote_request_id) == (
            req.request_id, [], False, "p-req-1")
        for _ in range(5):
            eng.step()
            time.sleep(0.01)
    finally:
        eng.close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_load_follows_vllm_kv_load_failure_policy(model_dir, tmp_path, policy):
    fake = FakeDaemon(str(tmp_path / "e.sock"), load_mode="fail").start()
    eng = Engine(model_dir, fake.socket, role="kv_consumer", policy=policy)
    try:
        req = make_request(list(range(1100, 1200)), decode_params(4))
        eng.sched.add_request(req)
        eng.run_until(lambda: eng.finished(req.request_id) is not None)
        out = eng.finished(req.request_id)
        if policy == "fail":  # the request fails, the engine goes on
            assert out.finish_reason == FinishReason.ERROR
        else:  # recomputed locally, then decoded normally
            assert out.finish_reason == FinishReason.LENGTH
            ps = prefill_stats(eng, req.request_id)
            assert (ps.num_computed_tokens, ps.num_external_cached_tokens) == (100, 0)
        assert req.request_id not in eng.sched.requests
    finally:
        eng.close()
        fake.stop()


def test_mismatched_remote_blocks_fail_the_load_without_asking_the_daemon(model_dir, fake):
    eng = Engine(model_dir, fake.socket, role="kv_consumer", policy="fail")
    try:
        req = make_request(list(range(1300, 1400)), decode_params(2))  # 4 blocks needed, 2 offered
        eng.sched.add_request(req)
        eng.run_until(lambda: eng.finished(req.request_id) is not None)
        assert eng.finished(req.request_id).finish_reason == FinishReason.ERROR
        assert load_cmds(fake) == []
    finally:
        eng.close()


# -------------------------------------------------------- never blocks the step
def test_worker_step_calls_stay_fast_while_the_daemon_is_slow(model_dir, tmp_path):
    """A daemon taking 1 s per command: start_load_kv and get_finished stay < 10 ms."""
    fake = FakeDaemon(str(tmp_path / "slow.sock"), delay_s=1.0).start()
    cfg = vllm_config(model_dir, fake.socket, role="kv_both", kvd_peer_address="127.0.0.1:1")
    kcc = kv_cache_config()
    worker = KvdConnector(cfg, KVConnectorRole.WORKER, kcc)
    worker.register_kv_caches(allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC, [BS]))
    try:
        worst = 0.0
        for step in range(10):
            meta = KvdConnectorMetadata(
                loads=[LoadSpec(f"d{step}", [step], "engine-p", "127.0.0.1:9", [step + 10], f"p{step}", 1, True)],
                holds=[HoldSpec(f"p{step}", [step + 20], 30.0)],
            )
            t0 = time.perf_counter()
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            worker.get_finished(set())
            worker.get_transfer_results(set())
            worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
            worst = max(worst, time.perf_counter() - t0)
        assert worst < FAST_S, f"a step's connector calls took {worst * 1e3:.2f} ms"
        done: set[str] = set()
        deadline = time.monotonic() + 5
        while "d0" not in done:
            assert time.monotonic() < deadline
            done |= worker.get_transfer_results(set()).finished_recving
            time.sleep(0.01)
    finally:
        worker.shutdown()
        fake.stop()
