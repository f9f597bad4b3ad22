"""End to end with real engines: two kvd daemons, two vLLM-CPU api_servers
(P and D, kv_both, KvdConnector each pointed at its own daemon) and the
toy-proxy P/D flow (kvd.testing.proxy).

Slow (the pair starts in about a minute on two cores); marked ``vllm``:
``pytest -m vllm tests/test_vllm_e2e.py``. ``KVD_E2E_CONNECTOR=nixl`` runs the
same checks against vLLM's built-in NixlConnector (no daemons; the kvd-only
checks are skipped), which validates the harness itself.

The tiny model's KV cache: 1024 bytes per token (2 layers x K,V x 2 KV heads
x 32 head_dim x 4 bytes), 32 KiB per 32-token block.
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
import time

import pytest

from kvd.testing import proxy
from kvd.testing.e2e import (STACK_PAIRED_S, check_named_kv_segments, kv_segments, run_prompts,
                             stop_engines_and_wait_segments_gone, swapped_prompt_outputs)
from kvd.testing.processes import ChildFailed, ProcessSet
from kvd.testing.shm import pids_in_groups
from kvd.testing.util import wait_until
from kvd.testing.vllm_engines import PDStack

vllm = pytest.mark.vllm

BLOCK_SIZE = 32
BLOCK_BYTES = 32 * 1024
P_LEASE_S = 600.0          # long: P must free blocks on D's notification, not on expiry
FREE_DEADLINE_S = 5.0      # P's lease must end this soon after D finished
CONNECTOR = os.environ.get("KVD_E2E_CONNECTOR", "kvd")


@pytest.fixture(scope="module")
def pd(tiny_model_dir, tmp_path_factory):
    """The running P/D stack (kvd.testing.vllm_engines.PDStack), module-scoped."""

    run_dir = tmp_path_factory.mktemp("pd")
    lines: list[str] = []
    st = PDStack(
        model_dir=tiny_model_dir, run_dir=run_dir, connector=CONNECTOR,
        log=lines.append,
        p_extra_config={"kvd_lease_s": P_LEASE_S},
        d_extra_config={"kvd_load_timeout_s": 60},
    )
    st.start()
    try:
        yield st
    finally:
        removed, left = st.close()


@pytest.fixture(scope="module")
def pd_results(pd, tiny_model_dir):
    """Prompts of 20 (< 1 block), 64 (2 full blocks), 100 and 600 tokens (many
    blocks) through the P/D flow one at a time, then the non-disaggregated
    reference of each (P alone, prefix cache bypassed by a cache_salt)."""
    from kvd.demo import run

    lengths = [20, 64, 100, 600]
    prompts = run.make_prompts(tiny_model_dir, lengths, seed=101)
    meter = run.Meter(pd)
    p_before = pd.p_daemon.stats() if pd.p_daemon else None
    d_before = pd.d_daemon.stats() if pd.d_daemon else None
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
    return run.format_report(rep, 4)


@vllm
def test_decode_output_equals_non_disaggregated(pd_results):
    reports = pd_results["reports"]
    assert len(reports) >= 3
    for rep in reports:
        assert len(rep.pd_token_ids) == 16, _describe(rep)
        assert rep.pd_token_ids == rep.ref_token_ids, (
            f"{_describe(rep)}\nP/D: {rep.pd_token_ids}\nref: {rep.ref_token_ids}")


@vllm
def test_decode_did_not_recompute_prompt(pd_results):
    for rep in pd_results["reports"]:
        # vLLM loads the whole prompt and recomputes only its last token.
        assert rep.external_tokens >= rep.prompt_tokens - 1, _describe(rep)
        assert rep.local_compute_tokens <= 1, _describe(rep)
        assert rep.local_hit_tokens == 0, _describe(rep)


@vllm
def test_bytes_moved_match_blocks(pd_results):
    for rep in pd_results["reports"]:
        n = rep.prompt_tokens
        lo = math.ceil((n - 1) / BLOCK_SIZE) * BLOCK_BYTES
        hi = math.ceil(n / BLOCK_SIZE) * BLOCK_BYTES
        assert lo <= rep.bytes <= hi, _describe(rep)
        assert rep.transfers >= 1, _describe(rep)


@vllm
def test_prefill_frees_blocks_on_notification(pd, pd_results):
    """P's lease (600 s) ends as soon as D has read the blocks, not on expiry."""
    if pd.p_daemon is None:
        pytest.skip("no kvd daemon with the nixl connector")
    for rep in pd_results["reports"]:
        assert rep.p_leases_after == 0, _describe(rep)
        assert rep.p_leases_zero_after_s is not None
        assert rep.p_leases_zero_after_s < FREE_DEADLINE_S, _describe(rep)
    p_after = pd.p_daemon.stats()
    assert p_after["leases_expired"] == pd_results["p_before"]["leases_expired"]
    assert p_after["active_leases"] == 0
    d_after = pd.d_daemon.stats()
    assert d_after["transfers_failed"] == pd_results["d_before"]["transfers_failed"]
    assert d_after["transfers_done"] - pd_results["d_before"]["transfers_done"] >= len(
        pd_results["reports"])
    for s in (p_after, d_after):
        assert s.get("leaked_handles", 0) == 0, s
        assert s.get("inflight_transfers", 0) == 0, s


@vllm
def test_prefill_engine_kv_cache_released(pd, pd_results):
    """P's vLLM frees the delayed blocks (finished sending reached the engine):
    its KV cache usage returns to 0 and no request stays running."""

    def idle() -> bool:
        m = pd.p.metrics()
        return (proxy.metric_sum(m, "vllm:kv_cache_usage_perc") == 0.0
                and proxy.metric_sum(m, "vllm:num_requests_running") == 0.0)

    assert wait_until(idle, FREE_DEADLINE_S, interval=0.1) is not None, pd.p.metrics()


@vllm
def test_decode_decodes_from_transferred_kv(pd, tiny_model_dir):
    """Prompt B sent to D with prompt A's kv_transfer_params continues A.

    B has A's length and A's last token (the one D recomputes), other tokens
    elsewhere: D's output is greedy(A), not greedy(B), so D really decoded from
    the transferred KV.
    """
    dec, ref_a, ref_b = swapped_prompt_outputs(pd, tiny_model_dir, 100, seed=202, tag="tiny")
    assert ref_a.token_ids != ref_b.token_ids, "prompts too alike for this check"
    assert dec.token_ids == ref_a.token_ids, (dec.token_ids, ref_a.token_ids, ref_b.token_ids)


@vllm
def test_engines_and_daemons_still_alive(pd, pd_results):
    pd.check_alive()


@vllm
def test_the_engines_ipc_sockets_are_in_the_stacks_own_directory(pd, pd_results):
    """vLLM makes its ZMQ IPC sockets in ``VLLM_RPC_BASE_PATH`` (the system's
    temporary directory by default) and leaves them when an engine is
    killed: the stack points it at a directory of its own, which its close
    removes (``test_a_stack_removes_its_ipc_directory``)."""
    socks = [e for e in pd.ipc_dir.iterdir() if stat.S_ISSOCK(e.lstat().st_mode)]
    assert len(socks) >= 2, list(pd.ipc_dir.iterdir())  # each engine's API server <-> engine core


def test_each_engines_log_names_its_file_store_which_the_stacks_close_removes(pd, pd_results):
    """vLLM's file-store rendezvous file (``/tmp/vllm_dist_<uuid>``) stays
    when an engine is killed; the stack's close removes the ones its
    engines' logs name (``kvd.testing.vllm_engines.remove_file_stores``,
    tested on a log of its own below): here, each engine names one that
    exists while it runs."""
    from kvd.testing.vllm_engines import _FILE_STORE

    for e in pd.engines.values():
        named = _FILE_STORE.findall(e.child.log_path.read_text(errors="replace"))
        assert named and all(os.path.exists(p) for p in named), (e.name, named)


def test_remove_file_stores_removes_only_the_store_vllms_own_line_names(tmp_path):
    """Only vLLM's own INFO line counts, from the engine's own offset in
    its log, for a regular file of this uid in the temporary directory:
    text an engine echoes from a request (a failed load's reason quotes an
    engine id the request chose; an attacker review) names nothing."""
    import tempfile
    import uuid

    from kvd.testing.vllm_engines import remove_file_stores

    def store() -> str:
        path = os.path.join(tempfile.gettempdir(), f"vllm_dist_{uuid.uuid4().hex}")
        open(path, "w").close()
        made.append(path)
        return path

    def vllm_line(path) -> str:
        return (f"(EngineCore pid=4242) INFO 12-07 08:44:01 [parallel_state.py:1907] world_size=1 rank=0 "
                f"local_rank=0 distributed_init_method=file://{path} backend=gloo\n")

    made: list[str] = []
    try:
        earlier, victim, ours = store(), store(), store()
        elsewhere = tmp_path / f"vllm_dist_{uuid.uuid4().hex}"
        elsewhere.touch()
        log = tmp_path / "engine.log"
        log.write_text(vllm_line(earlier))  # an earlier run's engine, same log (append mode)
        offset = log.stat().st_size
        with open(log, "a") as f:
            f.write(f"(EngineCore pid=4242) WARNING 12-07 08:44:02 [worker.py:355] kvd: load failed: handshake: "
                    f"NOT_FOUND: engine 'distributed_init_method=file://{victim}' rank 0 is not registered\n")
            f.write(vllm_line(ours))
        assert remove_file_stores(str(log), offset) == [ours]
        assert not os.path.exists(ours) and os.path.exists(victim) and os.path.exists(earlier)
        assert remove_file_stores(str(log), offset) == []  # gone already
        assert remove_file_stores(str(tmp_path / "absent.log")) == []
        # Named by vLLM's line, but outside the temporary directory, or another uid's: left.
        log.write_text(vllm_line(elsewhere))
        assert remove_file_stores(str(log)) == [] and elsewhere.exists()
        if os.getuid() == 0:
            os.chown(victim, 65534, 65534)
            log.write_text(vllm_line(victim))
            assert remove_file_stores(str(log)) == [] and os.path.exists(victim)
    finally:
        for path in made:
            with contextlib.suppress(OSError):
                os.unlink(path)


# ---------------------------------------------------------------------------
# The harness itself (fast, no vLLM): proxy request shaping, /metrics parsing,
# child process and /dev/shm cleanup.
# ---------------------------------------------------------------------------

def test_prefill_request_shape():

    req = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 16, "stream": True,
           "stream_options": {"include_usage": True}, "max_completion_tokens": 16}
    body = proxy.prefill_request(req)
    assert body["max_tokens"] == 1 and body["max_completion_tokens"] == 1
    assert body["stream"] is False and "stream_options" not in body
    assert body["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert req["max_tokens"] == 16 and "kv_transfer_params" not in req  # not mutated


def test_parse_prometheus_labels_and_sums():

    text = "\n".join([
        "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.",
        "# TYPE vllm:prompt_tokens_by_source_total counter",
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="a,b",source="external_kv_transfer"} 600.0',
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="a,b",source="local_compute"} 1.0',
        'vllm:prompt_tokens_by_source_total{engine="1",model_name="x\\"y",source="external_kv_transfer"} 20.0',
        "vllm:nixl_xfer_time_seconds_sum{engine=\"0\"} 0.25",
        "process_open_fds 12",
    ])
    m = proxy.parse_prometheus(text)
    assert proxy.metric_sum(m, "vllm:prompt_tokens_by_source_total",
                            source="external_kv_transfer") == 620.0
    assert proxy.metric_sum(m, "vllm:prompt_tokens_by_source_total", source="local_compute") == 1.0
    assert proxy.metric_sum(m, "vllm:nixl_xfer_time_seconds_sum") == 0.25
    assert proxy.metric_sum(m, "process_open_fds") == 12
    assert proxy.metric_sum(m, "missing") == 0.0


_LEAKER = r"""
import os, subprocess, sys, time
from multiprocessing import shared_memory, resource_tracker
def leak(name):
    s = shared_memory.SharedMemory(name=name, create=True, size=4096)
    resource_tracker.unregister(s._name, "shared_memory")  # really leave it behind
    return s
a = leak(sys.argv[1])
# a grandchild in the same process group, also leaking (mapped until killed)
subprocess.Popen([sys.executable, "-c", "import time, sys\n"
                  "from multiprocessing import shared_memory, resource_tracker\n"
                  "s = shared_memory.SharedMemory(name=sys.argv[1], create=True, size=4096)\n"
                  "resource_tracker.unregister(s._name, 'shared_memory')\n"
                  "print('grandchild', 'up', flush=True)\n"
                  "time.sleep(600)", sys.argv[2]])
print("child", "up", flush=True)
time.sleep(600)
"""


def test_process_set_stops_groups_and_cleans_shm(tmp_path):
    import os
    import sys
    from multiprocessing import shared_memory


    tag = f"kvdt{os.getpid()}x{time.time_ns() % 10**6}"
    mine_before = shared_memory.SharedMemory(name=f"{tag}_pre", create=True, size=4096)
    ps = ProcessSet(tmp_path)
    foreign = None
    try:
        child = ps.start("leaker", [sys.executable, "-c", _LEAKER, f"{tag}_c", f"{tag}_g"])
        ps.wait_ready(child, lambda: "grandchild up" in child.log_tail(), 30, 0.1)
        # an object someone else (this test process) makes during the run
        foreign = shared_memory.SharedMemory(name=f"{tag}_foreign", create=True, size=4096)
        ps.shm.sample()
        pids = pids_in_groups([child.pid])
        assert len(pids) >= 2, (pids, child.alive(), child.log_tail())
        removed, left = ps.close(grace_s=3)
        assert {f"{tag}_c", f"{tag}_g"} <= set(removed)
        assert f"{tag}_foreign" in left
        assert pids_in_groups([child.pid]) == []
        assert not os.path.exists(f"/dev/shm/{tag}_c")
        assert os.path.exists(f"/dev/shm/{tag}_pre")
        assert os.path.exists(f"/dev/shm/{tag}_foreign")
    finally:
        ps.close(grace_s=1)
        for s in (mine_before, foreign):
            if s is not None:
                s.close()
                s.unlink()


def test_a_stack_removes_its_ipc_directory(tmp_path):
    for run_dir in (tmp_path / "short", tmp_path / ("a-run-directory-name-past-sixty-characters-" * 2)):
        st = PDStack(model_dir=tmp_path, run_dir=run_dir)
        (st.ipc_dir / "left-by-a-killed-engine").touch()
        assert st._engine_env()["VLLM_RPC_BASE_PATH"] == str(st.ipc_dir) and len(str(st.ipc_dir)) <= 60
        st.close()
        assert not st.ipc_dir.exists()


def test_wait_ready_reports_exit_and_log_tail(tmp_path):
    import sys


    with ProcessSet(tmp_path) as ps:
        child = ps.start("crasher", [sys.executable, "-c",
                                     "print('loading...'); print('boom: bad config'); raise SystemExit(3)"])
        with pytest.raises(ChildFailed) as ei:
            ps.wait_ready(child, lambda: False, 30, 0.05)
        assert "exited with code 3" in str(ei.value)
        assert "boom: bad config" in str(ei.value)
        slow = ps.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
        with pytest.raises(ChildFailed) as ei:
            ps.wait_ready(slow, lambda: False, 0.5, 0.05)
        assert "not ready after" in str(ei.value)
    assert not slow.alive()


# ---------------------------------------------------------------------------
# Heterogeneous TP with real engines: P TP=1 -> D TP=2. vLLM-CPU
# runs TP=2 here (gloo/shm between two worker processes). Each D rank
# registers with D's daemon as its own rank and reads its KV head (the tiny
# model has 2) from P's single rank. P uses the staged data path (its blocks
# are copied into the daemon's mirror in the step that computes them), D the
# direct one: the first stack above covers direct -> direct. Marked ``vllm``.
# ---------------------------------------------------------------------------

TP_PROMPT_LENGTHS = [20, 100, 333]


@pytest.fixture(scope="module")
def pd_tp(tiny_model_dir, tmp_path_factory):
    """A P/D stack whose decode engine runs with --tensor-parallel-size 2."""

    lines: list[str] = []
    st = PDStack(model_dir=tiny_model_dir, run_dir=tmp_path_factory.mktemp("pd-tp"), connector="kvd",
                 log=lines.append, p_extra_config={"kvd_lease_s": P_LEASE_S, "kvd_data_path": "staged"},
                 d_extra_config={"kvd_load_timeout_s": 60}, side_args={"D": ["--tensor-parallel-size", "2"]},
                 warm_peers=True, wait_paired_s=STACK_PAIRED_S)
    st.start()
    try:
        yield st
    finally:
        st.close()


@pytest.fixture(scope="module")
def pd_tp_results(pd_tp, tiny_model_dir):
    """Each prompt through P (TP 1) -> D (TP 2), then the non-disaggregated
    output of each engine alone (prefix cache bypassed by a cache_salt)."""
    from kvd.demo import run

    prompts = run.make_prompts(tiny_model_dir, TP_PROMPT_LENGTHS, seed=303)
    p_before = pd_tp.p_daemon.stats()
    rows = run_prompts(pd_tp, prompts, "tp")
    return {"rows": rows, "p_before": p_before}


@vllm
def test_tp1_to_tp2_decode_output_equals_non_disaggregated(pd_tp_results):
    for row in pd_tp_results["rows"]:
        n = len(row["prompt"])
        assert len(row["pd"]) == 16, row
        assert row["params"]["tp_size"] == 1, row["params"]
        assert row["pd"] == row["ref_p"] == row["ref_d"], (n, row["pd"], row["ref_p"], row["ref_d"])
        assert row["external"] >= n - 1, (n, row["external"])  # loaded, not recomputed


@vllm
def test_tp1_to_tp2_each_decode_rank_registered_and_prefill_freed_on_notification(pd_tp, pd_tp_results):
    rows = pd_tp_results["rows"]
    assert all(r["freed"] for r in rows), "P's lease (600 s) must end on D's notifications"
    p_after = pd_tp.p_daemon.stats()
    assert p_after["leases_expired"] == pd_tp_results["p_before"]["leases_expired"]
    assert [w["data_path"] for w in p_after["workers"]] == ["staged"], p_after["workers"]
    d_after = pd_tp.d_daemon.stats()
    ranks = sorted((w["tp_rank"], w["tp_size"], w["data_path"]) for w in d_after["workers"])
    assert ranks == [(0, 2, "direct"), (1, 2, "direct")], d_after["workers"]
    assert d_after["transfers_failed"] == 0 and d_after["transfers_done"] >= 2 * len(rows)


@vllm
def test_tp_stats_reach_vllms_metrics(pd_tp, pd_tp_results):
    """KvdConnector's stats (both D ranks' RecvDone) reach D's /metrics."""

    m = pd_tp.d.metrics()
    assert proxy.metric_sum(m, "vllm:kvd_xfer_time_seconds_count") >= 2 * len(pd_tp_results["rows"])
    assert proxy.metric_sum(m, "vllm:kvd_bytes_transferred_sum") > 0
    assert proxy.metric_sum(m, "vllm:kvd_num_failed_transfers_total") == 0


@vllm
def test_tp_stopped_engines_leave_no_kv_segments(pd_tp, pd_tp_results):
    """Stopping the engines leaves none of their /dev/shm/torch_* KV segments:
    vLLM force-kills its workers (and torch's shm manager) at SIGTERM, so
    each worker's connector unlinks its names first thing in shutdown(), and
    the daemon unlinks those of a worker killed before that (owner_pid, once
    its session has been gone detach_grace_s = 10 s). The daemons keep
    running meanwhile, as they do in production."""

    pd_tp.check_alive()
    kv = kv_segments(pd_tp)
    check_named_kv_segments(kv, 2)  # named shm: one per D rank (P is staged: it shares nothing)
    stop_engines_and_wait_segments_gone(pd_tp, kv)
