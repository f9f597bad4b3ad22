"""End to end with real engines on one kvd daemon: two vLLM-CPU api_servers
(P and D, KvdConnector) registered with the same daemon, so every load is a
same-node copy (kvd.core.local_copy: the daemon memmoves the blocks, no
NIXL), through the toy-proxy P/D flow (kvd.testing.proxy).

Slow (an engine pair starts in about a minute on two cores); marked ``vllm``:
``pytest -m vllm tests/test_vllm_e2e_same_node.py``. The two-daemon (NIXL)
flow is tests/test_vllm_e2e.py.
"""

from __future__ import annotations

import pytest

from kvd.testing.vllm_engines import PDStack

vllm = pytest.mark.vllm

P_LEASE_S = 600.0  # long: P must free blocks when D's copy is done, not on expiry


@vllm
def test_engines_on_one_daemon_decode_the_non_disaggregated_output_from_copied_blocks(tiny_model_dir, tmp_path):
    from kvd.demo import run

    lines: list[str] = []
    st = PDStack(model_dir=tiny_model_dir, run_dir=tmp_path / "pd", log=lines.append, shared_daemon=True,
                 p_extra_config={"kvd_lease_s": P_LEASE_S}, d_extra_config={"kvd_load_timeout_s": 60})
    with st:
        daemon = st.p_daemon
        assert daemon is st.d_daemon
        before = daemon.stats()
        prompts = run.make_prompts(tiny_model_dir, [20, 100, 600], seed=202)
        meter = run.Meter(st)
        reports = [run.run_one(st, meter, i, prompt) for i, prompt in enumerate(prompts)]
        for rep, prompt in zip(reports, prompts):
            run.reference(st, rep, prompt)
        for rep in reports:
            described = run.format_report(rep, 4)
            assert len(rep.pd_token_ids) == 16 and rep.match, described
            # The whole prompt was loaded, not recomputed (vLLM recomputes its last token).
            assert rep.external_tokens >= rep.prompt_tokens - 1 and rep.local_compute_tokens <= 1, described
            assert rep.p_leases_after == 0, described  # the copy ended P's 600 s lease
        after = daemon.stats()
        assert after["transfers_done"] - before["transfers_done"] >= len(reports)
        assert after["transfers_failed"] == before["transfers_failed"]
        assert after["leases_expired"] == before["leases_expired"] and after["active_leases"] == 0
        # No NIXL pair between the engines: no handshake, no remote agent.
        assert after["peers"] == 0 and after["remote_agents"] == 0, after
        st.check_alive()
