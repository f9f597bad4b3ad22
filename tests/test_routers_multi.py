"""kvd in the configuration Dynamo accepts, and kvd's push mode behind a
router, with real engines: one P/D stack whose engines run vLLM's
``MultiConnector`` with kvd as its only child, named ``NixlConnector``
(``kvd.shim.vllm.nixl_name``), and whose daemons run ``--transfer-mode push``
(the decode daemon asks the prefill daemon to WRITE). A second stack after
tests/test_routers.py's (pytest closes a module's fixtures at its end, so
the two never run at once).

Dynamo itself (``python -m dynamo.vllm``) needs its Rust runtime and etcd/NATS;
what is tested of it is its protocol resolution
(``dynamo.vllm.kv_connector_protocols.make_kv_connector_protocol``, package
``ai-dynamo``, installed without its dependencies by scripts/setup.sh: the
module is plain Python) on these engines' ``--kv-transfer-config``, and the
flow its NixlConnector protocol runs (the toy proxy's: six
``do_remote_decode`` keys to P, P's ``kv_transfer_params`` to D). Marked
``vllm`` (minutes), except the protocol checks.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from kvd.testing import proxy, routers
from kvd.testing.vllm_engines import PDStack, kvd_connector_config

vllm = pytest.mark.vllm

LENGTHS = [20, 100, 300]
NAMED_MODULE = "kvd.shim.vllm.nixl_name"


def _wrap(cfg: dict) -> dict:
    return routers.multi_connector_config(cfg, routers.NIXL_CONNECTOR, NAMED_MODULE)


@pytest.fixture(scope="module")
def pd(tiny_model_dir, tmp_path_factory):
    """P/D stack: MultiConnector[kvd as NixlConnector] engines, push-mode daemons."""
    st = PDStack(model_dir=tiny_model_dir, run_dir=tmp_path_factory.mktemp("routers-multi"),
                 log=lambda line: None, p_extra_config={"kvd_lease_s": 600.0},
                 d_extra_config={"kvd_load_timeout_s": 60},
                 daemon_args=["--transfer-mode", "push"], wrap_kv_config=_wrap)
    st.start()
    try:
        yield st
    finally:
        st.close()


def _bodies(model_dir, seed: int) -> list[dict]:
    from kvd.demo import run
    # Text prompts: smg takes a string or strings, not token ids.
    return [run.request_body(run.decode_text(model_dir, p))
            for p in run.make_prompts(model_dir, LENGTHS, seed=seed)]


def _check(send, st, bodies, tag: str) -> list[routers.RoutedResult]:
    out = []
    for i, body in enumerate(bodies):
        st.check_alive()
        res = routers.route_one(send, st, body)
        ref = routers.reference_token_ids(st, body, f"{tag}-{i}")
        assert len(res.token_ids) == 16, res
        assert res.token_ids == ref, (res, ref)
        assert res.external >= res.prompt_tokens - 1, res
        assert res.local_compute <= 1 and res.local_hit == 0, res
        out.append(res)
    assert routers.wait_leases_zero(st), st.p_daemon.stats()
    return out


@vllm
def test_multiconnector_with_kvd_child_pd_equals_non_disaggregated(pd, tiny_model_dir):
    """The flow Dynamo's NixlConnector protocol runs (the toy proxy's), on
    engines whose connector is MultiConnector[kvd]: P/D output equals the
    non-disaggregated output and D recomputes nothing."""
    assert pd.p.kv_transfer_config["kv_connector"] == "MultiConnector"
    _check(routers.toy_proxy(pd), pd, _bodies(tiny_model_dir, seed=401), "multi")


@vllm
def test_push_mode_through_vllm_router(pd, tiny_model_dir):
    """Push mode behind vllm-router: P's daemon WRITEs (it loads the decode
    daemon's agent: ``remote_agents``), outputs equal, no recompute. P's
    parameters still say ``transfer_mode: "pull"``: kvd's push starts only
    once P has finished and holds the blocks, so a router must run the legs
    one after the other (it may not dispatch both at once, which routers do
    only for ``"push"``)."""
    why = routers.router_missing(routers.VLLM_ROUTER)
    if why:
        pytest.skip(why)
    p_agents = pd.p_daemon.stats()["remote_agents"]
    with routers.start_vllm_router(pd) as router:
        _check(router.complete, pd, _bodies(tiny_model_dir, seed=402), "push")
    assert pd.p_daemon.stats()["remote_agents"] >= max(p_agents, 1)
    from kvd.demo import run
    body = run.request_body(run.decode_text(tiny_model_dir, run.make_prompts(tiny_model_dir, [40], seed=403)[0]))
    pre = proxy.complete(pd.p.url, proxy.prefill_request(body))
    assert pre.kv_transfer_params["transfer_mode"] == "pull", pre.kv_transfer_params
    # Let D take the blocks so that P's lease ends now, not in 600 s.
    proxy.complete(pd.d.url, dict(body, kv_transfer_params=pre.kv_transfer_params))
    assert routers.wait_leases_zero(pd)


# ---------------------------------------------------------------- Dynamo's protocol resolution

def _dynamo_protocols():
    return pytest.importorskip(
        "dynamo.vllm.kv_connector_protocols",
        reason="ai-dynamo is not installed (scripts/setup.sh installs it without dependencies)")


def _vllm_config(kv: dict) -> SimpleNamespace:
    """The two attributes Dynamo's resolution reads of a VllmConfig."""
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector=kv["kv_connector"], engine_id="e0",
        kv_connector_extra_config=copy.deepcopy(kv.get("kv_connector_extra_config", {}))))


def test_dynamo_refuses_kvd_by_its_own_name():
    protocols = _dynamo_protocols()
    cfg = kvd_connector_config("/run/kvd/engine.sock")
    with pytest.raises(ValueError, match="Unsupported kv_connector='KvdConnector'"):
        protocols.make_kv_connector_protocol(_vllm_config(cfg))
    with pytest.raises(ValueError, match="no PD-capable sub-connector"):
        protocols.make_kv_connector_protocol(_vllm_config(routers.multi_connector_config(cfg)))


def test_dynamo_takes_multiconnector_with_kvd_named_nixl_as_the_nixl_protocol():
    protocols = _dynamo_protocols()
    cfg = _wrap(kvd_connector_config("/run/kvd/engine.sock"))
    proto = protocols.make_kv_connector_protocol(_vllm_config(cfg))
    assert isinstance(proto, protocols.NixlConnectorProtocol)
    # What it sends P is the toy proxy's request, and D gets P's params as they are.
    assert proto.prefill_request_kv_transfer_params() == proxy.PREFILL_KV_PARAMS
    params = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 7700}
    assert proto.decode_request_kv_transfer_params(SimpleNamespace(kv_transfer_params=params)) is params
    # The child's config is the one the protocol is bound to (kvd's socket, its module).
    child = proto._vllm_config.kv_transfer_config
    assert child.kv_connector == routers.NIXL_CONNECTOR
    assert child.kv_connector_module_path == NAMED_MODULE


def test_multiconnector_rebuilds_kvd_stats_by_name():
    """vLLM's MultiConnector rebuilds a child's stats in the API server by
    class name from vLLM's registry; kvd registers itself on import
    (``kvd.shim.vllm.connector.register_with_vllm``), else the API server's
    output handler raises on the first load's stats."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvd.shim.vllm import KvdConnector, KvdKVConnectorStats

    assert KVConnectorFactory.get_connector_class_by_name("KvdConnector") is KvdConnector
    sent = KvdKVConnectorStats()
    sent.data["bytes_transferred"].append(32768)
    got = MultiConnector.build_kv_connector_stats({KvdConnector.__name__: dict(sent.data)})
    assert isinstance(got["KvdConnector"], KvdKVConnectorStats)
    assert got["KvdConnector"].data["bytes_transferred"] == [32768]


# ---------------------------------------------------------------- push: a hold that arrives after the push

@pytest.fixture(scope="module")
def push_daemons(tmp_path_factory):
    """A prefill daemon and a decode daemon in push mode (no engines)."""
    from kvd.testing.daemons import start_daemon

    d = str(tmp_path_factory.mktemp("push-late"))
    a, b = start_daemon(d, "prefill"), start_daemon(d, "decode", "--transfer-mode", "push")
    yield a, b
    assert a.stop() == 0 and b.stop() == 0


def test_push_waits_for_a_hold_that_arrives_after_the_load(push_daemons):
    """What vllm-router does to push mode: D's load reaches D's daemon
    before P's hold reaches P's daemon (vLLM answers P's HTTP request a
    step before its connector sends the hold). The push waits for the hold
    and moves the right bytes; P's lease ends by the WRITE."""
    import time

    import numpy as np

    from kvd.testing.parity import Rank, unregister_ranks
    from kvd.testing.sessions import one_group
    from kvd.v1 import kvd_pb2 as pb

    prefill, decode = push_daemons
    n_tokens, bs = 49, 16
    p_ids, d_ids = [3, 7, 1, 12], [5, 2, 9, 14]
    P, D = Rank("Plate", 0, 1, 4, bs, "HND"), Rank("Dlate", 0, 1, 4, bs, "HND")
    P.fill(p_ids, n_tokens)
    sp, sd = P.register(prefill), D.register(decode)
    try:
        sd.send(load=pb.LoadBlocks(request_id="dlate", local_groups=one_group(d_ids), remote_engine_id="Plate",
                                   remote_address=prefill.peer_address, remote_groups=one_group(p_ids),
                                   remote_request_id="plate", remote_tp_size=1, timeout_s=20))
        time.sleep(0.5)  # D's push reaches P's daemon before the hold does (on a machine not stalled)
        sp.send(hold=pb.HoldBlocks(request_id="plate", groups=one_group(p_ids), lease_s=600))
        ev = sd.next(30)
        assert ev.WhichOneof("event") == "recv_done", ev
        for got, want in zip(D.arrays(), D.expected(d_ids, n_tokens)):
            np.testing.assert_array_equal(got, want)
        pev = sp.next(10)
        assert pev.WhichOneof("event") == "send_done" and not pev.send_done.expired, pev
        assert prefill.stats().active_leases == 0
    finally:
        sp.close(), sd.close()
        unregister_ranks(prefill, [P])
        unregister_ranks(decode, [D])
