"""KvdConnector inside vLLM 0.32's real scheduler, against a fake daemon:
the transfers. Prefill hands its blocks off (holds, ``kv_transfer_params``),
decode loads them (or only notifies P, or fails by vLLM's policy), both with
vLLM's hybrid allocator (two KV-cache groups), no step call waits on the
daemon, and the transfer stats reach vLLM's logger and Prometheus.

(``test_shim_vllm_memory.py``: configuration, registration and the KV
cache's memory; ``test_shim_realdaemon.py`` runs the same engine loop against
two real daemons and checks the bytes.)

Each test runs an in-process "engine loop" with no model
(``tests/vllm_inproc.py``): vLLM's own ``Scheduler`` (which constructs the
scheduler-side ``KvdConnector`` from the ``--kv-transfer-config`` it would get
on the command line), and a worker-side ``KvdConnector`` that registers a KV
cache allocated by vLLM's own ``allocate_kv_cache``. Each step does what
``vllm/v1/worker/kv_connector_model_runner_mixin.py:_get_kv_connector_output``
does around a forward pass: bind metadata, ``start_load_kv``,
``get_transfer_results``, ``get_block_ids_with_load_errors``, and hands the
result back to ``Scheduler.update_from_output``.
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

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvd.addresses import join_host_port  # noqa: E402
from kvd.shim.vllm.metadata import LoadRules  # noqa: E402
from kvd.shim.vllm import (  # noqa: E402
    HoldSpec,
    KvdConnector,
    KvdConnectorMetadata,
    KvdKVConnectorStats,
    LoadSpec,
    TransferGroups,
)
from kvd.testing.fakes import PEER_ADDRESS, FakeDaemon  # noqa: E402
from kvd.testing.util import wait_until  # noqa: E402
from vllm_inproc import (  # noqa: E402
    BS, HMA_LAYERS, WINDOW_BLOCKS, Engine, kv_cache_config, make_request, prefill_request, remote_params,
    vllm_config,
)


def prefill_stats(eng: Engine, rid: str):
    return next(o.prefill_stats for o in eng.outputs[rid] if o.prefill_stats is not None)



def load_spec(rid: str, local: list, remote: list, remote_rid: str, *, engine: str = "engine-p",
              awaiting: bool = True, error: str | None = None) -> LoadSpec:
    """A scheduler -> worker load (block ids per group) from a prefill engine at 127.0.0.1:9."""
    return LoadSpec(rid, local, (engine, "127.0.0.1", 9, remote_rid, remote), awaiting, LoadRules(), error,
                    max_ids=1 << 20)



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
        wait_until(lambda: fake.service.count("hold") == 1, 5, "hold command #1 at the daemon")
        (hold,) = fake.service.received("hold")
        assert (hold.request_id, [list(g.ids) for g in hold.groups], hold.lease_s) == (req.request_id, [blocks], 45)
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
        assert req.request_id not in eng.sched.requests and fake.service.received("hold") == []
    finally:
        eng.close()


def test_prefill_peer_address_comes_from_the_daemon_when_not_configured(model_dir, fake):
    eng = Engine(model_dir, fake.socket)
    try:
        assert join_host_port(eng.connector.scheduler.peer_host, eng.connector.scheduler.peer_port) == PEER_ADDRESS
        assert eng.connector.scheduler.renewals.max_groups == 1  # the engine's transfer groups bound renewals'
    finally:
        eng.close()


# ----------------------------------------------------------------- decode side
def decode_params(num_blocks: int, first: int = 40) -> dict:
    return remote_params({
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_block_ids": (list(range(first, first + num_blocks)),), "remote_engine_id": "engine-p",
        "remote_request_id": "p-req-1", "remote_host": "10.9.9.9", "remote_port": 7500, "tp_size": 1,
    })


def test_decode_loads_all_prompt_blocks_then_runs(model_dir, fake, monkeypatch):
    """... and P's fields are checked and converted off the engine's step:
    by the engine client's sender thread, once (``LoadSpec.resolve``)."""
    import kvd.shim.vllm.metadata as metadata

    resolved_on = []
    real = metadata.resolve_load

    def resolve_load(spec):
        resolved_on.append(threading.current_thread().name)
        return real(spec)

    monkeypatch.setattr(metadata, "resolve_load", resolve_load)
    eng = Engine(model_dir, fake.socket, role="kv_consumer", kvd_load_timeout_s=12)
    try:
        req = make_request(list(range(500, 600)), decode_params(4))
        eng.sched.add_request(req)
        eng.step()
        wait_until(lambda: resolved_on, 5, "the load resolved")
        assert len(resolved_on) == 1 and resolved_on[0] != threading.current_thread().name, resolved_on
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        (ld,) = eng.last_meta.loads
        (local,) = ld.request.local_groups
        assert ld.awaiting and len(local) == 4 and ld.request.remote_groups == [[40, 41, 42, 43]]
        wait_until(lambda: fake.service.count("load") == 1, 5, "load command #1 at the daemon")
        (cmd,) = fake.service.received("load")
        assert (cmd.remote_address, cmd.remote_engine_id, cmd.remote_request_id) == ("10.9.9.9:7500", "engine-p", "p-req-1")
        assert [list(g.ids) for g in cmd.local_groups] == [local] and cmd.timeout_s == 12 and cmd.remote_tp_size == 1
        assert [list(g.ids) for g in cmd.remote_groups] == [[40, 41, 42, 43]]  # one group: [[...]], groups only
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
        assert len(ld.request.local_groups[0]) == 2, "only the blocks D does not hold are loaded"
        assert ld.request.remote_groups == [[42, 43]], "P's blocks trimmed from the front, aligned by position"
        eng.run_until(lambda: eng.finished(req.request_id) is not None)
        ps = prefill_stats(eng, req.request_id)
        assert (ps.num_local_cached_tokens, ps.num_external_cached_tokens, ps.num_computed_tokens) == (64, 36, 0)
    finally:
        eng.close()


def test_nothing_to_load_only_notifies_and_never_reports_a_receive(model_dir, fake):
    """A request that skips the prefix cache (e.g. prompt logprobs) computes its
    prompt locally: P is told to free its blocks (AbortLoad, no answer), no
    load is sent and vLLM never sees a receive for it."""
    eng = Engine(model_dir, fake.socket, role="kv_consumer")
    try:
        req = make_request(list(range(900, 964)), decode_params(2))
        req.skip_reading_prefix_cache = True
        eng.sched.add_request(req)
        eng.run_until(lambda: eng.finished(req.request_id) is not None)
        wait_until(lambda: fake.service.count("abort_load") == 1, 5, "abort_load command #1 at the daemon")
        (ab,) = fake.service.received("abort_load")
        assert (ab.request_id, ab.remote_engine_id, ab.remote_address, ab.remote_request_id, ab.remote_tp_size) == (
            req.request_id, "engine-p", "10.9.9.9:7500", "p-req-1", 1)
        for _ in range(5):
            eng.step()
            time.sleep(0.01)
        assert fake.service.received("load") == []
    finally:
        eng.close()


def test_decode_request_aborted_before_scheduling_tells_the_prefill_side(model_dir, fake):
    """vLLM finishes a decode request before it was scheduled (aborted):
    request_finished sends AbortLoad, so P frees the blocks at once (as
    NixlConnector's empty read does, pull_scheduler.py:219-230)."""
    eng = Engine(model_dir, fake.socket, role="kv_consumer")
    try:
        req = make_request(list(range(1000, 1064)), decode_params(2))
        eng.sched.add_request(req)
        eng.sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
        eng.step()
        (ld,) = eng.last_meta.loads
        assert (ld.request_id, ld.local_groups, ld.awaiting, ld.source().remote_request_id) == (
            req.request_id, [], False, "p-req-1")
        wait_until(lambda: fake.service.count("abort_load") == 1, 5, "abort_load command #1 at the daemon")
        assert fake.service.received("abort_load")[0].remote_request_id == "p-req-1"
        for _ in range(5):
            eng.step()
            time.sleep(0.01)
        assert fake.service.received("load") == []
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
        fake.close()


def test_mismatched_remote_blocks_fail_the_load_without_asking_the_daemon(model_dir, fake):
    eng = Engine(model_dir, fake.socket, role="kv_consumer", policy="fail")
    try:
        req = make_request(list(range(1300, 1400)), decode_params(2))  # 4 blocks needed, 2 offered
        eng.sched.add_request(req)
        eng.run_until(lambda: eng.finished(req.request_id) is not None)
        assert eng.finished(req.request_id).finish_reason == FinishReason.ERROR
        assert fake.service.received("load") == []
        # P frees its blocks at once
        wait_until(lambda: fake.service.count("abort_load") == 1, 5, "abort_load command #1 at the daemon")
    finally:
        eng.close()


def add_decode_request(eng: Engine, field: str, value):
    """Adds a 100-token decode request whose P params have ``field`` set to
    ``value`` (4 blocks from 40); returns it."""
    params = decode_params(4)
    params[field] = value
    req = make_request(list(range(500, 600)), params)
    eng.sched.add_request(req)
    return req


@pytest.mark.parametrize("field,value,told_p", [
    ("remote_port", "abc", False), ("remote_port", [7500], False), ("remote_port", 99999999, False),
    ("remote_port", 1e400, False), ("tp_size", "x", False), ("tp_size", -3, False), ("tp_size", 1 << 40, False),
    ("remote_block_ids", [["a"]], True), ("remote_block_ids", [[None]], True), ("remote_block_ids", 5, True),
    ("remote_block_ids", {"0": [40]}, True), ("block_size", "z", True),
    ("remote_block_ids", [list(range(200_000))], True), ("remote_block_ids", [[40]] * 5000, True),
    ("remote_block_ids", ["40" * 100_000], True), ("remote_block_ids", [["4_0", 41]], True),
    ("remote_block_ids", [[40.9, 41]], True),
    ("remote_block_ids", [[40, 41, 42, -1]], True), ("remote_block_ids", [[40, 41, 42, 1 << 32]], True),
    ("remote_engine_id", "E" * 5000, False), ("remote_host", "h" * 5000, False),
    ("remote_request_id", "\ud800", False), ("remote_engine_id", ["e"], False),
    ("tp_size", list(range(100_000)), False), ("block_size", list(range(100_000)), True),
], ids=lambda v: repr(v)[:20])
def test_hostile_kv_transfer_params_fail_that_load_and_the_engine_serves_on(model_dir, fake, field, value, told_p):
    """``kv_transfer_params`` come in the decode engine's API request: a
    field no load can use fails that request's load (vLLM's policy: fail)
    and never raises out of the scheduler. An exception there stops vLLM's
    engine core, every user's requests with it; before, each of these did.
    P is told to free its blocks when the params still say where P is."""
    eng = Engine(model_dir, fake.socket, role="kv_consumer", policy="fail")
    try:
        bad = add_decode_request(eng, field, value)
        eng.run_until(lambda: eng.finished(bad.request_id) is not None)
        assert eng.finished(bad.request_id).finish_reason == FinishReason.ERROR
        good = make_request(list(range(600, 700)), decode_params(4, first=50))
        eng.sched.add_request(good)
        eng.run_until(lambda: eng.finished(good.request_id) is not None)
        assert eng.finished(good.request_id).finish_reason != FinishReason.ERROR
        assert [c.request_id for c in fake.service.received("load")] == [good.request_id]
        if told_p:
            wait_until(lambda: fake.service.count("abort_load") == 1, 5, "abort_load for the failed load")
        else:
            time.sleep(0.2)
            assert fake.service.count("abort_load") == 0, "an AbortLoad to no address"
    finally:
        eng.close()


def test_a_load_whose_source_cannot_even_be_told_fails_alone_and_the_session_serves_on(model_dir, fake):
    """P's fields no command can carry (a lone surrogate in its engine id,
    which protobuf refuses to encode) with block ids that fail the load: the
    load fails, nobody is told, and a good load queued in the same step goes
    out on the same session and is served. (The first version of the
    off-step checks built the AbortLoad of such a load and its encoding
    error ended the client's session: every load in flight failed.)"""
    eng = Engine(model_dir, fake.socket, role="kv_consumer", policy="fail")
    try:
        params = decode_params(4)
        params.update(remote_engine_id="\ud800", remote_block_ids=[["x"]])
        bad = make_request(list(range(500, 600)), params)
        good = make_request(list(range(600, 700)), decode_params(4, first=50))
        eng.sched.add_request(bad)
        eng.sched.add_request(good)
        eng.run_until(lambda: eng.finished(bad.request_id) is not None and eng.finished(good.request_id) is not None)
        assert eng.finished(bad.request_id).finish_reason == FinishReason.ERROR
        assert eng.finished(good.request_id).finish_reason != FinishReason.ERROR
        assert [c.request_id for c in fake.service.received("load")] == [good.request_id]
        assert fake.service.count("abort_load") == 0
        assert fake.service.sessions == 1, "one session throughout"
    finally:
        eng.close()


@pytest.mark.parametrize("field,value,error", [
    ("tp_size", list(range(100_000)), "tp_size"), ("remote_port", [7500] * 100_000, "port"),
    ("block_size", {"a": list(range(100_000))}, "block size"), ("remote_engine_id", "E" * 100_000, "engine_id"),
    ("remote_port", dict.fromkeys(map(str, range(100_000)), 1), "port"),
    ("remote_block_ids", [list(range(2_000_000))], "remote_block_ids"),
    ("remote_block_ids", "4" * 2_000_000, "remote_block_ids"),
    ("block_size", " " * 1_000_000 + str(BS), None),  # int() takes it: a block size equal to this engine's
], ids=lambda v: repr(v)[:20])
def test_fields_of_odd_types_are_checked_on_the_step_and_never_reach_the_workers_as_given(model_dir, fake, field,
                                                                                          value, error):
    """P's fields go to the workers unchecked only as ints and short text
    (what JSON gives an honest P); anything else is checked on the step, and
    a load that fails there carries no block ids, so no value of an API
    client's choosing and size is pickled to each TP rank's process with the
    step's metadata. The error names the field, in a bounded message."""
    import pickle

    eng = Engine(model_dir, fake.socket, role="kv_consumer", policy="fail")
    try:
        add_decode_request(eng, field, value)
        eng.step()
        (ld,) = eng.last_meta.loads
        if error is None:
            assert ld.error is None and ld.remote_block_size is None
        else:
            assert ld.error and error in ld.error and len(ld.error) < 200, ld.error
        assert len(pickle.dumps(eng.last_meta)) < 4096
    finally:
        eng.close()


def test_a_request_aborted_before_its_load_hands_the_workers_no_block_ids_of_p(model_dir, fake):
    """A notify-only load (the request finished before it was scheduled)
    reads nothing: P's block ids, whatever their count, stay on the
    scheduler; P is still told to free."""
    import pickle

    eng = Engine(model_dir, fake.socket, role="kv_consumer")
    try:
        params = decode_params(2)
        params["remote_block_ids"] = [list(range(2_000_000))]
        req = make_request(list(range(1000, 1064)), params)
        eng.sched.add_request(req)
        eng.sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
        eng.step()
        (ld,) = eng.last_meta.loads
        assert not ld.awaiting and ld.remote[4] == [] and len(pickle.dumps(eng.last_meta)) < 4096
        wait_until(lambda: fake.service.count("abort_load") == 1, 5, "abort_load command #1 at the daemon")
    finally:
        eng.close()


# -------------------------------------------------------- never blocks the step
def test_worker_step_calls_stay_fast_while_the_daemon_is_slow(model_dir, tmp_path):
    """A daemon taking 1 s per command: no step's connector calls wait for it.
    The bound is half the daemon's delay (behaviour, not a quiet machine): a
    step that waited for one command would take at least the whole delay."""
    fake_delay_s = 1.0
    fake = FakeDaemon(str(tmp_path / "slow.sock"), delay_s=fake_delay_s).start()
    cfg = vllm_config(model_dir, fake.socket, role="kv_both", kvd_peer_address="127.0.0.1:1")
    kcc = kv_cache_config()
    worker = KvdConnector(cfg, KVConnectorRole.WORKER, kcc)
    worker.register_kv_caches(allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC, [BS]))
    try:
        worst = 0.0
        for step in range(10):
            meta = KvdConnectorMetadata(
                loads=[load_spec(f"d{step}", [[step]], [[step + 10]], f"p{step}"),
                       load_spec(f"a{step}", [], [], f"pa{step}", awaiting=False)],
                holds=[HoldSpec(f"p{step}", [[step + 20]], 30.0)],
            )
            t0 = time.perf_counter()
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            worker.wait_for_save()
            worker.get_finished(set())
            worker.get_kv_connector_stats()
            worker.get_transfer_results(set())
            worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
            worst = max(worst, time.perf_counter() - t0)
        assert worst < fake_delay_s / 2, f"a step's connector calls took {worst * 1e3:.2f} ms"
        done: set[str] = set()
        deadline = time.monotonic() + 5
        while "d0" not in done:
            assert time.monotonic() < deadline
            done |= worker.get_transfer_results(set()).finished_recving
            time.sleep(0.01)
    finally:
        worker.shutdown()
        fake.close()


# ------------------------------------------------------------- HMA (2 groups)
def test_hma_regions_carry_their_group_and_overlaid_bytes_are_one_region_per_group(model_dir, fake):
    eng = Engine(model_dir, fake.socket, hma=True, kvd_peer_address="127.0.0.1:7000")
    try:
        (reg,) = fake.service.registers
        assert len(reg.segments) == 1 and len(reg.regions) == 4
        by_layer = {r.name: r for r in reg.regions}
        assert [by_layer[n].group for n in HMA_LAYERS] == [0, 1, 0, 1]
        # vLLM overlays the groups: layer 0 (group 0) and layer 1 (group 1) share bytes
        assert by_layer[HMA_LAYERS[0]].offset == by_layer[HMA_LAYERS[1]].offset
        assert eng.connector.get_loaded_kv_cache_group_ids(None) == (0, 1)
    finally:
        eng.close()


def test_hma_prefill_hands_off_block_ids_per_group_with_the_window_clipped(model_dir, fake):
    """request_finished_all_groups gets every group's blocks; the params and
    the hold carry them per group, the sliding-window group clipped to the
    window's blocks as NixlConnector clips it (no null padding blocks)."""
    eng = Engine(model_dir, fake.socket, hma=True, kvd_peer_address="10.1.2.3:7400", kvd_lease_s=45)
    try:
        req = prefill_request(list(range(100, 300)))  # 200 tokens: 7 blocks of 32
        eng.sched.add_request(req)
        eng.run_until(lambda: eng.finished(req.request_id) is not None)
        params = remote_params(eng.finished(req.request_id).kv_transfer_params)
        full, window = params["remote_block_ids"]
        assert len(full) == 7 and len(window) == WINDOW_BLOCKS
        full_now, window_now = eng.sched.kv_cache_manager.get_block_ids(req.request_id)
        assert full == list(full_now) and window == list(window_now)[-WINDOW_BLOCKS:]
        assert 0 not in window, "null (padding) blocks are never handed off"
        eng.step()
        wait_until(lambda: fake.service.count("hold") == 1, 5, "hold command #1 at the daemon")
        (hold,) = fake.service.received("hold")
        assert [list(g.ids) for g in hold.groups] == [full, window] and hold.lease_s == 45
        eng.worker.worker.client.release(req.request_id)
        eng.run_until(lambda: req.request_id not in eng.sched.requests)
    finally:
        eng.close()


def test_hma_decode_loads_each_group_into_its_own_blocks(model_dir, fake):
    eng = Engine(model_dir, fake.socket, hma=True, role="kv_consumer")
    try:
        params = remote_params({
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": (list(range(40, 47)), [50, 51, 52]), "remote_engine_id": "engine-p",
            "remote_request_id": "p-req-1", "remote_host": "10.9.9.9", "remote_port": 7500, "tp_size": 1,
        })
        req = make_request(list(range(500, 700)), params)
        eng.sched.add_request(req)
        eng.step()
        (ld,) = eng.last_meta.loads
        full, window = ld.request.local_groups
        assert len(full) == 7 and 0 < len(window) <= WINDOW_BLOCKS and 0 not in window
        assert ld.request.remote_groups == [list(range(40, 47)), [50, 51, 52][-len(window):]]
        wait_until(lambda: fake.service.count("load") == 1, 5, "load command #1 at the daemon")
        (cmd,) = fake.service.received("load")
        assert [list(g.ids) for g in cmd.local_groups] == [full, window]
        assert [list(g.ids) for g in cmd.remote_groups] == ld.request.remote_groups
        eng.run_until(lambda: eng.finished(req.request_id) is not None)
        ps = prefill_stats(eng, req.request_id)
        assert (ps.num_external_cached_tokens, ps.num_computed_tokens) == (200, 0)
    finally:
        eng.close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_hma_failed_load_is_reported_per_request_never_as_block_ids(model_dir, tmp_path, policy):
    """With two groups vLLM's scheduler raises on invalid_block_ids
    (scheduler.py:3365): the failure goes out as failed_recving only, and the
    load-failure policy applies to the whole request; the engine goes on."""
    fake = FakeDaemon(str(tmp_path / "e.sock"), load_mode="fail").start()
    eng = Engine(model_dir, fake.socket, hma=True, role="kv_consumer", policy=policy)
    try:
        params = remote_params({
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": (list(range(40, 44)), [42, 43]), "remote_engine_id": "engine-p",
            "remote_request_id": "p-req-1", "remote_host": "10.9.9.9", "remote_port": 7500, "tp_size": 1,
        })
        req = make_request(list(range(1100, 1200)), params)
        eng.sched.add_request(req)
        eng.run_until(lambda: eng.finished(req.request_id) is not None)
        out = eng.finished(req.request_id)
        if policy == "fail":
            assert out.finish_reason == FinishReason.ERROR
        else:
            assert out.finish_reason == FinishReason.LENGTH
            assert prefill_stats(eng, req.request_id).num_computed_tokens == 100
        assert sum(len(s.data["num_failed_transfers"]) for s in eng.stats) == 1
    finally:
        eng.close()
        fake.close()


def test_transfer_groups_select_and_clip_like_nixl(model_dir, fake):
    eng = Engine(model_dir, fake.socket, hma=True, kvd_peer_address="127.0.0.1:7000")
    try:
        groups = TransferGroups.from_config(eng.kcc)
        assert groups.group_ids == (0, 1) and groups.window_blocks == (0, WINDOW_BLOCKS)
        assert groups.clip([[1, 2, 3, 4, 5], [0, 0, 6, 7, 8, 9]]) == [[1, 2, 3, 4, 5], [7, 8, 9]]
        assert groups.clip([[1], [2]]) == [[1], [2]]
        with pytest.raises(ValueError, match="3 KV-cache groups"):
            groups.select([[1], [2], [3]])
    finally:
        eng.close()


# ----------------------------------------------------------------------- stats
def test_stats_reach_vllms_aggregation_logger_and_prometheus(model_dir, tmp_path, caplog):
    """Two workers' stats (RecvDone: duration, bytes, descriptors; a failed
    load; an expired lease) go through what vLLM does with them: the
    executor's KVOutputAggregator, to_dict() to the frontend,
    build_kv_connector_stats, KVConnectorLogging (reduce, logged) and
    KVConnectorProm (observe)."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

    fakes, workers = [], []
    try:
        for i, (load_mode, hold_mode) in enumerate([("answer", "expire"), ("answer", "never")]):
            fake = FakeDaemon(str(tmp_path / f"w{i}.sock"), load_mode=load_mode, hold_mode=hold_mode).start()
            cfg = vllm_config(model_dir, fake.socket, kvd_peer_address="127.0.0.1:1")
            kcc = kv_cache_config()
            w = KvdConnector(cfg, KVConnectorRole.WORKER, kcc)
            w.register_kv_caches(allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC, [BS]))
            fakes.append(fake)
            workers.append(w)
        assert all(w.get_kv_connector_stats() is None for w in workers), "no events: no stats"
        meta0 = KvdConnectorMetadata(
            loads=[load_spec("d1", [[1, 2, 3]], [[4, 5, 6]], "p1", engine="e"),
                   load_spec("d2", [[7]], [[8]], "p2", engine="e"),
                   load_spec("d3", [[9]], [[]], "p3", engine="e", error="invalid: test")],
            holds=[HoldSpec("h1", [[10]], 30.0)])
        meta1 = KvdConnectorMetadata(loads=[load_spec("d1", [[11, 12]], [[4, 5]], "p1", engine="e")])
        outputs = []
        for w, meta in zip(workers, (meta0, meta1)):
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            w.clear_connector_metadata()
        want_recv = [{"d1", "d2", "d3"}, {"d1"}]
        got_recv = [set(), set()]
        stats = [None, None]
        deadline = time.monotonic() + 5
        while got_recv != want_recv or stats[0] is None or stats[0].data["num_kv_expired_reqs"] == []:
            assert time.monotonic() < deadline, (got_recv, stats)
            for i, w in enumerate(workers):
                got_recv[i] |= w.get_transfer_results(set()).finished_recving
                s = w.get_kv_connector_stats()
                if s is not None:
                    stats[i] = s if stats[i] is None else stats[i].aggregate(s)
            time.sleep(0.01)
        assert isinstance(stats[0], KvdKVConnectorStats)
        assert stats[0].data["bytes_transferred"] == [3072, 1024] and stats[0].data["num_descriptors"] == [6, 2]
        assert stats[0].data["num_failed_transfers"] == [1] and stats[0].data["num_kv_expired_reqs"] == [1]
        for w, s in zip(workers, stats):
            outputs.append(ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(
                finished_recving=set(), kv_connector_stats=s)))

        merged = KVOutputAggregator(expected_finished_count=2).aggregate(outputs).kv_connector_output.kv_connector_stats
        data = merged.to_dict()
        assert sorted(data["bytes_transferred"]) == [1024, 2048, 3072]

        logging_ = KVConnectorLogging(vllm_config(model_dir, "/unused").kv_transfer_config)
        logging_.observe(data)
        lines: list[str] = []
        logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
        (line,) = lines
        assert "Num successful transfers=3" in line and "Num failed transfers=1" in line
        assert "Num KV expired reqs=1" in line and "Avg number of descriptors=4.0" in line
        reduced = KvdConnector.build_kv_connector_stats(data).reduce()
        assert reduced["Avg MB per transfer"] == round(6144 / 3 / 2**20, 3)
        assert reduced["Avg xfer time (ms)"] == 2.0 and reduced["Throughput (MB/s)"] > 0
        assert reduced["Avg post time (ms)"] == 1.0  # NixlConnector's post duration, from RecvDone

        registry = CollectorRegistry()
        types = {Gauge: functools.partial(Gauge, registry=registry),
                 Counter: functools.partial(Counter, registry=registry),
                 Histogram: functools.partial(Histogram, registry=registry)}

        class Prom(KVConnectorProm):
            _gauge_cls, _counter_cls, _histogram_cls = types[Gauge], types[Counter], types[Histogram]

        prom = Prom(vllm_config(model_dir, "/unused"), ["engine"], {0: ["0"]})
        prom.observe(data, 0)
        assert registry.get_sample_value("vllm:kvd_xfer_time_seconds_count", {"engine": "0"}) == 3
        assert registry.get_sample_value("vllm:kvd_post_time_seconds_sum", {"engine": "0"}) == pytest.approx(0.003)
        assert registry.get_sample_value("vllm:kvd_bytes_transferred_sum", {"engine": "0"}) == 6144
        assert registry.get_sample_value("vllm:kvd_num_failed_transfers_total", {"engine": "0"}) == 1
        assert registry.get_sample_value("vllm:kvd_num_kv_expired_reqs_total", {"engine": "0"}) == 1
    finally:
        for w in workers:
            w.shutdown()
        for f in fakes:
            f.close()


def test_empty_stats_reduce_and_aggregate():
    empty = KvdConnector.build_kv_connector_stats()
    assert empty.is_empty() and empty.reduce()["Num successful transfers"] == 0
    one = KvdKVConnectorStats()
    one.record_kv_expired_req()
    assert not one.is_empty() and empty.aggregate(one).reduce()["Num KV expired reqs"] == 1
    clone = one.clone_and_reset()
    assert one.is_empty() and clone.data["num_kv_expired_reqs"] == [1]
