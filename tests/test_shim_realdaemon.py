"""KvdConnector through two real kvd daemons: bytes, HMA groups, TP pairs,
the staged path, aborts and stats.

Each engine here is vLLM 0.32's real ``Scheduler`` (which builds the
scheduler half of ``KvdConnector``) and one worker-side ``KvdConnector`` per
TP rank, each with a KV cache from vLLM's own ``allocate_kv_cache``; a step
does what the model runner and the multiprocess executor do around a forward
pass (``kv_connector_model_runner_mixin.py`` then
``KVOutputAggregator.aggregate`` over the ranks). No model runs: the test
writes what a prefill forward pass would have written into P's blocks, and
checks, element by element, what lands in D's blocks through NIXL (UCX,
shared memory) between two ``kvd serve`` processes.

TP ranks: one process holds every rank's worker connector; each registers as
its own rank (``EngineWorker.tp_rank``) with a cache holding its own KV heads.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

if os.environ.get("KVD_SKIP_VLLM") == "1":
    pytest.skip("KVD_SKIP_VLLM=1", allow_module_level=True)
pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvd.client.engine_client import EngineClientError  # noqa: E402
from kvd.shim.memory import auto, cuda_ipc  # noqa: E402
from kvd.shim.memory.cuda_ipc import ExportedStorage  # noqa: E402
from kvd.shim.vllm import KvdConnector  # noqa: E402
from kvd.v1 import kvd_pb2 as pb  # noqa: E402
from kvd.requests import InvalidLoad  # noqa: E402
from kvd.testing.daemons import start_daemon  # noqa: E402
from vllm_inproc import (  # noqa: E402
    BS,
    EOS,
    HEAD,
    KV_HEADS,
    LAYERS,
    NB,
    WINDOW_BLOCKS,
    hma_kv_cache_config,
    make_request,
    remote_params,
    vllm_config,
)

P_LEASE_S = 600.0  # P must free on D's notification, never by expiry


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("shim-real"))
    p, dd = start_daemon(d, "prefill"), start_daemon(d, "decode")
    yield p, dd
    assert p.stop() == 0 and dd.stop() == 0


def kv_cache_config(heads: int, block_size: int = BS) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=HEAD, dtype=torch.float32)
    page = spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[KVCacheTensor(size=NB * page * len(LAYERS), layers=list(LAYERS),
                                        layer_stride=NB * page, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )


class Side:
    """One engine: vLLM's scheduler and ``tp`` worker connectors (its ranks)."""

    def __init__(self, model_dir: str, daemon, *, tp: int = 1, hma: bool = False, kv_seed: int | None = None,
                 block_size: int = BS, **extra):
        self.kv_seed = kv_seed  # P: what its "forward pass" writes (None: D, writes nothing)
        self.config = vllm_config(model_dir, daemon.socket, **extra)
        self.config.cache_config.num_gpu_blocks = NB
        self.config.cache_config.block_size = self.block_size = block_size
        self.tp = tp
        self.heads = max(1, KV_HEADS // tp)
        self.kcc = hma_kv_cache_config(self.config) if hma else kv_cache_config(self.heads, block_size)
        self.sched = Scheduler(vllm_config=self.config, kv_cache_config=self.kcc, log_stats=True,
                               structured_output_manager=StructuredOutputManager(self.config), block_size=block_size)
        assert isinstance(self.sched.connector, KvdConnector)
        self.sched.connector.scheduler.tp_size = tp  # what a TP engine puts in kv_transfer_params
        self.workers: list[KvdConnector] = []
        self.caches: list[dict[str, torch.Tensor]] = []
        for rank in range(tp):
            w = KvdConnector(self.config, KVConnectorRole.WORKER, self.kcc)
            w.worker.worker.tp_rank, w.worker.worker.tp_size = rank, tp
            caches = allocate_kv_cache(self.kcc, torch.device("cpu"), KVCacheLayout.LBHNC,
                                       [block_size] * len(self.kcc.kv_cache_groups))
            w.register_kv_caches(caches)
            self.workers.append(w)
            self.caches.append(caches)
        self.aggregator = KVOutputAggregator(expected_finished_count=tp)
        self.outputs: dict[str, list] = {}
        self.loads: dict[str, object] = {}
        self.stats: list = []
        self.finished_sending: set[str] = set()

    @property
    def engine_id(self) -> str:
        return self.config.kv_transfer_config.engine_id

    def step(self) -> None:
        out = self.sched.schedule()
        for ld in out.kv_connector_metadata.loads:
            self.loads[ld.request_id] = ld
        ids = list(out.num_scheduled_tokens)
        sampled = [[7] if self.sched.requests[r].num_computed_tokens >= self.sched.requests[r].num_tokens else []
                   for r in ids]
        outputs = []
        for rank, w in enumerate(self.workers):
            w.bind_connector_metadata(out.kv_connector_metadata)
            w.start_load_kv(None)
            if self.kv_seed is not None:
                self.forward(rank, out)
            w.wait_for_save()
            res = w.get_transfer_results(out.finished_req_ids)
            kvo = KVConnectorOutput(
                finished_sending=res.finished_sending, finished_recving=res.finished_recving,
                failed_recving=res.failed_recving, invalid_block_ids=w.get_block_ids_with_load_errors(),
                kv_connector_stats=w.get_kv_connector_stats(),
            )
            w.clear_connector_metadata()
            outputs.append(ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                             sampled_token_ids=sampled, kv_connector_output=kvo))
        mro = self.aggregator.aggregate(outputs)
        kvo = mro.kv_connector_output
        if kvo.kv_connector_stats is not None:
            self.stats.append(kvo.kv_connector_stats)
        self.finished_sending |= kvo.finished_sending or set()
        for outs in self.sched.update_from_output(out, mro).values():
            for o in outs.outputs:
                self.outputs.setdefault(o.request_id, []).append(o)

    def kv(self, rank: int, layer: int, block: int, shape) -> torch.Tensor:
        """The KV a prefill forward pass writes: random, fixed by (seed, rank, layer, block)."""
        gen = torch.Generator().manual_seed(((self.kv_seed * 8 + rank) * 64 + layer) * 4096 + block)
        return torch.rand(shape, generator=gen)

    def forward(self, rank: int, out) -> None:
        """Writes the KV of every scheduled request's blocks in rank ``rank``."""
        names = list(self.caches[rank])
        for rid in out.num_scheduled_tokens:
            table = self.sched.kv_cache_manager.get_block_ids(rid)
            for name, view in self.caches[rank].items():
                for b in table[self.kcc.transfer_group_index_by_layer.get(name, 0)]:
                    if b:  # 0: vLLM's null block
                        view[b].copy_(self.kv(rank, names.index(name), b, view[b].shape))

    def run_until(self, cond, timeout_s: float = 20.0) -> float:
        t0 = time.monotonic()
        while not cond():
            assert time.monotonic() - t0 < timeout_s, "engine loop timed out"
            self.step()
            time.sleep(0.002)
        return time.monotonic() - t0

    def finished(self, rid: str):
        return next((o for o in self.outputs.get(rid, []) if o.finish_reason is not None), None)

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()


def prefill(p: Side, prompt: list[int]) -> tuple[dict, object]:
    """P computes ``prompt`` (its forward pass writes random KV) and finishes
    it; returns the params for D and the request. The hold goes out with
    P's next step (vLLM steps once more to tell the workers which requests
    finished), so P steps once here, as its engine core would: D's daemon
    reads only blocks P's daemon holds for that request (docs/SECURITY.md)."""
    req = make_request(prompt, {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                "remote_block_ids": None, "remote_request_id": None, "remote_host": None,
                                "remote_port": None}, max_tokens=1)
    p.sched.add_request(req)
    p.run_until(lambda: p.finished(req.request_id) is not None)
    p.step()
    return remote_params(p.finished(req.request_id).kv_transfer_params), req


def decode(d: Side, prompt: list[int], params: dict):
    req = make_request(prompt, params, max_tokens=2)
    d.sched.add_request(req)
    d.run_until(lambda: d.finished(req.request_id) is not None)
    return req, d.loads[req.request_id]


def check_heads(p: Side, d: Side, load) -> int:
    """D rank r's blocks hold, head by head, P's blocks of the same global heads.
    Returns the elements compared."""
    compared = 0
    for g, (lg, rg) in enumerate(zip(load.request.local_groups, load.request.remote_groups)):
        assert len(lg) == len(rg) > 0
        for r, dcaches in enumerate(d.caches):
            for name, dview in dcaches.items():
                if d.kcc.transfer_group_index_by_layer.get(name, 0) != g:
                    continue
                for j in range(d.heads):
                    head = (r * KV_HEADS) // d.tp + j
                    src_rank = head // p.heads if p.tp <= KV_HEADS else head * p.tp // KV_HEADS
                    pview = p.caches[src_rank][name]
                    for lb, rb in zip(lg, rg):
                        got, want = dview[lb, j], pview[rb, head - (src_rank * KV_HEADS) // p.tp]
                        assert torch.equal(got, want), (name, r, j, lb, rb)
                        compared += got.numel()
    return compared


def wait_leases_zero(daemon, timeout_s: float = 5.0) -> float:
    t0 = time.monotonic()
    while daemon.stats().active_leases:
        assert time.monotonic() - t0 < timeout_s, daemon.stats()
        time.sleep(0.02)
    return time.monotonic() - t0


# ------------------------------------------------------------------ scenarios
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (1, 2), (2, 1)])
def test_tp_pairs_each_decode_rank_gets_its_heads(model_dir, daemons, p_tp, d_tp):
    """P TP -> D TP through the shim: each D rank registers its rank, the
    load names P's TP size (kv_transfer_params tp_size) and D rank r's cache
    holds P's bytes of exactly its KV heads (vLLM-CPU's K-and-V-per-head
    block, sliced by heads). 3 blocks + 4 tokens: the partial last block too."""
    pd, dd = daemons
    p = Side(model_dir, pd, tp=p_tp, kv_seed=p_tp * 10 + d_tp, kvd_lease_s=P_LEASE_S)
    d = Side(model_dir, dd, tp=d_tp, role="kv_consumer")
    try:
        prompt = list(range(3000 + 100 * p_tp + 10 * d_tp, 3000 + 100 * p_tp + 10 * d_tp + 3 * BS + 4))
        params, preq = prefill(p, prompt)
        assert params["tp_size"] == p_tp
        req, load = decode(d, prompt, params)
        assert d.finished(req.request_id).finish_reason is not None
        assert load.request.remote_tp_size == p_tp and len(load.request.local_groups[0]) == 4
        assert check_heads(p, d, load) == 4 * len(LAYERS) * KV_HEADS * BS * 2 * HEAD
        # Every P rank got every expected notification: blocks freed, not expired.
        p.run_until(lambda: preq.request_id in p.finished_sending, timeout_s=5)
        assert wait_leases_zero(pd) < 5
        assert pd.stats().leases_expired == 0
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("p_tp,d_tp,p_path", [(1, 1, "direct"), (2, 1, "staged"), (1, 2, "direct")])
def test_prefill_block_32_into_decode_block_64_cpu_layout(model_dir, daemons, p_tp, d_tp, p_path):
    """P block 32 -> D block 64 through the shim on vLLM-CPU caches (K and V
    of a head in one block, vLLM's own LBHNC allocation): P's params carry
    its block size, D loads 2 P blocks into each of its blocks, and every
    element lands where vLLM-CPU's kernel reads it (``cpu_attn.py:411-415``:
    per head K then V; inside K, the layout the kernel writes, probed by
    ``kvd.shim.vllm.cpu_kv_probe``: on x86 ``[head_size, tokens]``). Checked head
    by head, K and V apart: D block ``i`` tokens ``[32 j, 32 j + 32)`` of K
    and of V == P's block ``2 i + j``, for every element of every loaded
    block. 3 D blocks + 5 tokens: a partial last D block holding a single P
    block (7 P blocks into 4 D blocks)."""
    from kvd.shim.vllm.cpu_kv_probe import kv_block_layout

    k_layout = kv_block_layout(torch.float32, 2 * BS, HEAD)
    if k_layout is None:
        pytest.skip("this CPU kernel's block layout is unknown: the shim keeps blocks whole (no remap)")
    pd, dd = daemons
    p = Side(model_dir, pd, tp=p_tp, kv_seed=40 + p_tp * 10 + d_tp, kvd_lease_s=P_LEASE_S, kvd_data_path=p_path)
    d = Side(model_dir, dd, tp=d_tp, role="kv_consumer", block_size=2 * BS)
    try:
        prompt = list(range(11000 + 100 * p_tp + 10 * d_tp, 11000 + 100 * p_tp + 10 * d_tp + 6 * BS + 5))
        params, preq = prefill(p, prompt)
        assert params["block_size"] == BS and params["tp_size"] == p_tp
        req, load = decode(d, prompt, params)
        assert d.finished(req.request_id).finish_reason is not None
        (lg,), (rg,) = load.request.local_groups, load.request.remote_groups
        assert (len(lg), len(rg)) == (4, 7), (lg, rg)
        def k_and_v(view, bs):
            """[blocks, heads, tokens, head] views of K and V (tokens along dim 2)."""
            flat = view.view(NB, view.shape[1], 2, bs * HEAD)
            k = (flat[:, :, 0].view(NB, -1, HEAD, bs).transpose(2, 3) if k_layout == "dim_major"
                 else flat[:, :, 0].view(NB, -1, bs, HEAD))
            return k, flat[:, :, 1].view(NB, -1, bs, HEAD)

        elems = 0
        for r, dcaches in enumerate(d.caches):
            for name, dview in dcaches.items():
                dk, dv = k_and_v(dview, 2 * BS)
                for j in range(d.heads):
                    head = (r * KV_HEADS) // d_tp + j
                    src = head // p.heads
                    pk, pv = k_and_v(p.caches[src][name], BS)
                    for i, rb in enumerate(rg):
                        for dx, px in ((dk, pk), (dv, pv)):
                            got = dx[lg[i // 2], j, (i % 2) * BS:(i % 2 + 1) * BS]
                            assert torch.equal(got, px[rb, head - src * p.heads]), (name, r, j, i, rb)
                            elems += got.numel()
                    if len(rg) % 2:  # the last D block's second half: nothing was written there
                        assert not dk[lg[-1], j, BS:].any() and not dv[lg[-1], j, BS:].any()
        assert elems == len(LAYERS) * KV_HEADS * len(rg) * 2 * BS * HEAD
        p.run_until(lambda: preq.request_id in p.finished_sending, timeout_s=5)
        assert wait_leases_zero(pd) < 5
        assert pd.stats().leases_expired == 0
    finally:
        p.close()
        d.close()


def test_prefill_block_32_into_decode_block_64_partial_local_prefix_hit(model_dir, daemons):
    """Block-size remap and a partial prefix hit on D together: P block 32 ->
    D block 64 on vLLM-CPU caches, D already holding the prompt's first 2 D
    blocks in its own prefix cache, prompt 4 x 64 + 1 tokens (the
    off-by-one: 5 D blocks, 9 P blocks). Only D's 3 missing blocks are filled,
    from P's last 5 blocks (P's ids trimmed by k = 2 per D block hit, aligned
    by position: D block 2 + i // 2, half i % 2 == P block 4 + i), element by
    element, K and V apart; D's own prefix blocks keep their bytes; no other D
    block is written; the bytes moved are those 5 P blocks; P is freed on
    D's notification (600 s lease, not expired)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request
    from vllm import SamplingParams

    from kvd.shim.vllm.cpu_kv_probe import kv_block_layout

    k_layout = kv_block_layout(torch.float32, 2 * BS, HEAD)
    if k_layout is None:
        pytest.skip("this CPU kernel's block layout is unknown: the shim keeps blocks whole (no remap)")
    pd, dd = daemons
    dbs, hit = 2 * BS, 2  # D's block size; D blocks D already holds

    def d_request(prompt, params, max_tokens):  # hashed in D's 64-token blocks
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, EOS)
        req = Request(request_id=f"remap-hit-{time.time_ns()}", prompt_token_ids=list(prompt), sampling_params=sp,
                      pooling_params=None, block_hasher=get_request_block_hasher(dbs, sha256))
        req.kv_transfer_params = params
        return req

    def k_and_v(view, bs):
        """[blocks, heads, tokens, head] views of K and V (tokens along dim 2)."""
        flat = view.view(NB, view.shape[1], 2, bs * HEAD)
        k = (flat[:, :, 0].view(NB, -1, HEAD, bs).transpose(2, 3) if k_layout == "dim_major"
             else flat[:, :, 0].view(NB, -1, bs, HEAD))
        return k, flat[:, :, 1].view(NB, -1, bs, HEAD)

    p = Side(model_dir, pd, kv_seed=93, kvd_lease_s=P_LEASE_S)
    d = Side(model_dir, dd, role="kv_consumer", block_size=dbs)
    try:
        expired = pd.stats().leases_expired
        prompt = list(range(14000, 14000 + 4 * dbs + 1))
        # D computes the prompt's first 2 D blocks itself (then 3 other tokens):
        # they stay in its prefix cache. D's "forward" writes nothing, so give
        # them recognisable bytes.
        warm = d_request(prompt[:hit * dbs] + [1, 2, 3], None, max_tokens=2)
        d.sched.add_request(warm)
        d.step()
        own = d.sched.kv_cache_manager.get_block_ids(warm.request_id)[0][:hit]
        d.run_until(lambda: d.finished(warm.request_id) is not None)
        gen = torch.Generator().manual_seed(1234)
        for caches in d.caches:
            for view in caches.values():
                for b in own:
                    view[b].copy_(torch.rand(view[b].shape, generator=gen) + 1)
        before = [{n: v.clone() for n, v in caches.items()} for caches in d.caches]

        params, preq = prefill(p, prompt)
        (p_ids,) = params["remote_block_ids"]
        assert params["block_size"] == BS and len(p_ids) == 9, params
        req = d_request(prompt, params, max_tokens=2)
        d.sched.add_request(req)
        d.step()
        (table,) = d.sched.kv_cache_manager.get_block_ids(req.request_id)
        assert len(table) == 5 and table[:hit] == own, (table, own)  # D's own prefix blocks hit
        d.run_until(lambda: d.finished(req.request_id) is not None)
        load = d.loads[req.request_id]
        (lg,), (rg,) = load.request.local_groups, load.request.remote_groups
        assert lg == table[hit:], (lg, table)
        assert rg == p_ids[2 * hit:], (rg, p_ids)  # trimmed by k = 2 P blocks per D block hit

        elems = 0
        for r, dcaches in enumerate(d.caches):
            for name, dview in dcaches.items():
                dk, dv = k_and_v(dview, dbs)
                pk, pv = k_and_v(p.caches[0][name], BS)
                for i, rb in enumerate(rg):
                    for dx, px in ((dk, pk), (dv, pv)):
                        got = dx[lg[i // 2], :, (i % 2) * BS:(i % 2 + 1) * BS]
                        assert torch.equal(got, px[rb]), (name, i, rb)
                        elems += got.numel()
                assert not dk[lg[-1], :, BS:].any() and not dv[lg[-1], :, BS:].any()  # 1 P block in the last
                assert torch.equal(dview[own], before[r][name][own]), "D's own prefix blocks were overwritten"
                others = [b for b in range(NB) if b not in lg and b not in own]
                assert not dview[others].any(), "a D block outside the load was written"
        assert elems == len(LAYERS) * KV_HEADS * 5 * 2 * BS * HEAD
        (stats,) = [s for s in d.stats if s.num_successful_transfers]
        assert stats.data["bytes_transferred"] == [5 * len(LAYERS) * KV_HEADS * BS * 2 * HEAD * 4]
        p.run_until(lambda: preq.request_id in p.finished_sending, timeout_s=5)
        assert wait_leases_zero(pd) < 5
        assert pd.stats().leases_expired == expired
    finally:
        p.close()
        d.close()


def test_prefill_block_larger_than_decode_block_is_refused(model_dir, daemons):
    """P block 64 -> D block 32: no transfer, the load fails at once with a
    message naming the block sizes (vLLM's failure policy takes over), and P's
    blocks are freed at once, not at the end of their 600 s lease: D's shim
    aborts the load and D's daemon, which cannot pair with P (the handshake
    refuses it), tells P's over PeerService.Notify."""
    pd, dd = daemons
    p = Side(model_dir, pd, kv_seed=77, kvd_lease_s=600.0, block_size=2 * BS)
    d = Side(model_dir, dd, role="kv_consumer")
    try:
        prompt = list(range(13000, 13000 + 3 * BS + 1))
        params, preq = prefill(p, prompt)
        assert params["block_size"] == 2 * BS
        p.step()  # the hold goes out (before D's refusal tells P's daemon to let go)
        deadline = time.monotonic() + 5
        while pd.stats().active_leases != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        d.sched.add_request(make_request(prompt, params, max_tokens=2))
        d.step()
        (ld,) = d.loads.values()
        with pytest.raises(InvalidLoad, match="block size 64 does not divide this engine's 32"):
            ld.resolve()  # as the client's sender thread did
        assert d.stats == [] or not any(s.num_successful_transfers for s in d.stats)
        p.run_until(lambda: preq.request_id in p.finished_sending, timeout_s=10)
        assert wait_leases_zero(pd) < 5
        assert pd.stats().leases_expired == 0
    finally:
        p.close()
        d.close()


def test_staged_bytes_equal_direct_bytes(model_dir, daemons):
    """The same prompt (n x block + 1 tokens) through every pair of data
    paths: D's blocks hold P's bytes every time, equal to the direct path's
    (staged: copied into P's mirror in the step that computed them, out of
    D's mirror before vLLM is told the load finished)."""
    pd, dd = daemons
    got = {}
    for p_path, d_path in (("direct", "direct"), ("staged", "staged"), ("direct", "staged"), ("staged", "direct")):
        p = Side(model_dir, pd, kv_seed=7, kvd_lease_s=P_LEASE_S, kvd_data_path=p_path)
        d = Side(model_dir, dd, role="kv_consumer", kvd_data_path=d_path)
        try:
            for side, path in ((p, p_path), (d, d_path)):
                want = pb.DATA_PATH_STAGED if path == "staged" else pb.DATA_PATH_DIRECT
                assert side.workers[0].worker.registered.data_path == want
            prompt = list(range(5000, 5000 + 3 * BS + 1))  # n*block + 1: the classic off-by-one
            params, _ = prefill(p, prompt)
            _, load = decode(d, prompt, params)
            check_heads(p, d, load)
            got[(p_path, d_path)] = torch.stack([d.caches[0][n][torch.tensor(load.request.local_groups[0])]
                                                 for n in LAYERS]).clone()
            (stats,) = [s for s in d.stats if s.num_successful_transfers]
            block_len = KV_HEADS * BS * 2 * HEAD * 4
            assert stats.data["bytes_transferred"] == [4 * len(LAYERS) * block_len]
            assert stats.data["num_descriptors"][0] >= 4 and stats.data["transfer_duration"][0] > 0
        finally:
            p.close()
            d.close()
    first = got[("direct", "direct")]
    assert all(torch.equal(first, v) for v in got.values())
    assert pd.stats().active_leases == 0


@pytest.fixture
def cuda_kv_cache(monkeypatch):
    """The connector's CUDA branch on this GPU-less machine: the chooser sees
    the (CPU) KV cache on cuda:0, torch's ``_share_cuda_`` hands out one
    64-byte handle per storage, and the device syncs are recorded."""
    syncs: list[torch.device] = []
    monkeypatch.setattr(auto, "kv_device", lambda caches: torch.device("cuda", 0))
    monkeypatch.setattr(cuda_ipc, "export_storage", lambda t: ExportedStorage(
        0, t.untyped_storage().data_ptr().to_bytes(8, "little") * 8, 0, t.untyped_storage().nbytes()))
    monkeypatch.setattr(cuda_ipc, "synchronize", syncs.append)
    return syncs


def test_cuda_kv_cache_staged_through_a_daemon_without_gpu_moves_the_prefill_bytes(model_dir, daemons,
                                                                                    cuda_kv_cache):
    """A CUDA engine asking for the staged path registers CUDA IPC segments;
    a daemon without a GPU gives it shm mirrors (``kvd.core.cuda_ipc.wants_vram``),
    the worker copies through them, and D's blocks hold P's bytes. P waited
    for the device before its hold went out."""
    pd, dd = daemons
    p = Side(model_dir, pd, kv_seed=7, kvd_lease_s=P_LEASE_S, kvd_data_path="staged")
    d = Side(model_dir, dd, role="kv_consumer", kvd_data_path="staged")
    try:
        for side in (p, d):
            w = side.workers[0].worker
            assert w.sharing.kind == "cuda_ipc" and w.registered.data_path == pb.DATA_PATH_STAGED
            assert [s.kind for s in w.registered.staging_segments] == [pb.MEMORY_KIND_SHM]
        prompt = list(range(7000, 7000 + 3 * BS + 1))
        params, req = prefill(p, prompt)  # P's step after the request's end sends the hold
        assert cuda_kv_cache == [torch.device("cuda", 0)], "the hold's step waited for the device once"
        _, load = decode(d, prompt, params)
        p.run_until(lambda: req.request_id in p.finished_sending)
        assert cuda_kv_cache == [torch.device("cuda", 0)], "only a step that sends a hold waits for the device"
        assert check_heads(p, d, load) > 0
    finally:
        p.close()
        d.close()
    assert pd.stats().active_leases == 0


def test_cuda_kv_cache_direct_on_a_daemon_without_gpu_is_refused_with_a_message(model_dir, daemons, cuda_kv_cache):
    """Direct CUDA IPC needs the daemon to open the handles: a daemon without
    a GPU says so at registration; the engine fails to start with that message."""
    pd, _ = daemons
    with pytest.raises(EngineClientError) as e:
        Side(model_dir, pd, kvd_lease_s=P_LEASE_S, kvd_data_path="direct")
    assert "CUDA IPC segments need a GPU" in str(e.value), str(e.value)  # kvd.core.cuda_ipc.NO_GPU


@pytest.mark.parametrize("data_path", ["direct", "staged"])
def test_hma_two_groups_one_sliding_window(model_dir, daemons, data_path):
    """A hybrid model (full attention + a 64-token sliding window, vLLM's
    own grouping): every full-attention block and the window's blocks move,
    each group into its own blocks of the overlaid bytes."""
    pd, dd = daemons
    p = Side(model_dir, pd, hma=True, kv_seed=11, kvd_lease_s=P_LEASE_S, kvd_data_path=data_path)
    d = Side(model_dir, dd, hma=True, role="kv_consumer", kvd_data_path=data_path)
    try:
        prompt = list(range(7000, 7000 + 6 * BS + 9))  # 7 blocks
        params, preq = prefill(p, prompt)
        full, window = params["remote_block_ids"]
        assert len(full) == 7 and len(window) == WINDOW_BLOCKS
        _, load = decode(d, prompt, params)
        assert [len(g) for g in load.request.local_groups][0] == 7 and 0 < len(load.request.local_groups[1]) <= WINDOW_BLOCKS
        check_heads(p, d, load)
        p.run_until(lambda: preq.request_id in p.finished_sending, timeout_s=5)
        assert wait_leases_zero(pd) < 5
    finally:
        p.close()
        d.close()


def test_decode_aborted_before_its_load_frees_the_prefill_blocks_at_once(model_dir, daemons):
    """D aborts the request before scheduling it: AbortLoad -> D's daemon
    notifies P's daemon -> P's lease (600 s) ends now, P's vLLM frees the
    blocks (finished sending), well before any expiry."""
    pd, dd = daemons
    p = Side(model_dir, pd, kv_seed=3, kvd_lease_s=P_LEASE_S)
    d = Side(model_dir, dd, role="kv_consumer")
    try:
        expired = pd.stats().leases_expired
        prompt = list(range(9000, 9000 + 2 * BS + 3))
        params, preq = prefill(p, prompt)
        p.step()  # the hold goes out
        deadline = time.monotonic() + 5
        while pd.stats().active_leases != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        req = make_request(prompt, params)
        d.sched.add_request(req)
        d.sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
        t0 = time.monotonic()
        d.step()
        freed_s = p.run_until(lambda: preq.request_id in p.finished_sending, timeout_s=10)
        assert time.monotonic() - t0 < 5.0, "P's blocks waited for the lease, not the abort"
        assert preq.request_id not in p.sched.requests, "P's vLLM freed the blocks"
        assert wait_leases_zero(pd) < 1 and pd.stats().leases_expired == expired
        assert freed_s < 5.0
        assert d.loads[req.request_id].awaiting is False
    finally:
        p.close()
        d.close()


def test_an_engine_started_before_its_daemon_waits_up_to_kvd_connect_timeout_s(model_dir, tmp_path):
    """vLLM-CPU's worker connector (sealed memfds, the default CPU path)
    registering before ``kvd serve`` runs: with no daemon it fails once
    ``kvd_connect_timeout_s`` has passed, naming ``kvd_socket``'s path and
    what to do; with the daemon started 1 s after it, it registers."""
    sock = str(tmp_path / "engine.sock")

    def worker(timeout_s: float):
        config = vllm_config(model_dir, sock, kvd_connect_timeout_s=timeout_s)
        kcc = kv_cache_config(KV_HEADS)
        w = KvdConnector(config, KVConnectorRole.WORKER, kcc)
        return w, allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC, [BS])

    w, caches = worker(1.5)
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineClientError) as e:
            w.register_kv_caches(caches)
        took = time.monotonic() - t0  # the KV cache's move into memfds, then the wait
    finally:
        w.shutdown()
    assert 1.4 <= took < 10.0, took
    # Not "... engine.sock.fd: No such file or directory" at the first try.
    assert f"no kvd daemon at {sock} within 1.5 s (start `kvd serve` first, or check kvd_socket)" in str(e.value)

    w, caches = worker(30)
    out: dict = {}

    def register() -> None:
        try:
            w.register_kv_caches(caches)
        except Exception as err:  # the assertion below says what
            out["error"] = err

    thread = threading.Thread(target=register)
    thread.start()
    daemon = None
    try:
        time.sleep(1.0)
        # From this thread: a daemon gets SIGTERM when the thread that started it ends.
        daemon = start_daemon(str(tmp_path), "engine")
        thread.join(40)
        assert "error" not in out, out
        assert w.worker.sharing.kind == "memfd" and w.worker.registered.registered_bytes > 0
        (info,) = daemon.stats().workers
        assert info.handover == "memfd"
    finally:
        thread.join(40)
        w.shutdown()
        if daemon is not None:
            assert daemon.stop() == 0


def test_a_cuda_engine_with_no_daemon_fails_at_kvd_connect_timeout_s_naming_the_socket(model_dir, tmp_path,
                                                                                        cuda_kv_cache):
    """The CUDA IPC path hands nothing over before RegisterEngine, which waits
    for the daemon itself: with none it fails at ``kvd_connect_timeout_s``
    with the same words as the memfd path, not ``DEADLINE_EXCEEDED`` alone."""
    sock = str(tmp_path / "engine.sock")
    kcc = kv_cache_config(KV_HEADS)
    w = KvdConnector(vllm_config(model_dir, sock, kvd_connect_timeout_s=1.5), KVConnectorRole.WORKER, kcc)
    caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC, [BS])
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineClientError) as e:
            w.register_kv_caches(caches)
        took = time.monotonic() - t0
        assert w.worker.sharing.kind == "cuda_ipc"
    finally:
        w.shutdown()
    assert 1.4 <= took < 10.0, took
    assert f"no kvd daemon at {sock} within 1.5 s (start `kvd serve` first, or check kvd_socket)" in str(e.value)
