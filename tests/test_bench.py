"""``kvd bench --quick``: the short benchmarks run end to end (real daemons,
real NIXL, real vLLM scheduler) and report every figure; no goal is checked
here (the machine is shared: see docs/PERFORMANCE.md for the measured runs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_kvd_bench_quick_reports_ratios(tmp_path):
    out = tmp_path / "bench.json"
    args = [sys.executable, "-m", "kvd.cli", "bench", "--quick", "--no-progress", "--json", str(out)]
    try:
        import vllm  # noqa: F401
    except ImportError:
        args.append("--skip-step")
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "(1) data plane" in r.stdout and "a/b" in r.stdout
    res = json.loads(out.read_text())
    (cell,) = res["dataplane"]["cells"]
    assert "(1s) same node" in r.stdout and "s/m" in r.stdout
    for k in ("a_gbs", "b_gbs", "c_gbs", "a_over_b", "a_over_c", "s_gbs", "s_over_c", "m_gbs", "s_over_m"):
        assert cell[k] > 0, (k, cell)
    if "--skip-step" not in args:
        assert "(2) engine step" in r.stdout
        cases = {c["inflight"]: c for c in res["engine_step"]["cases"]}
        assert set(cases) == {0, 16}
        # How many loads finish in the quick run's few steps depends on the
        # machine's load; the figures must be there and measured.
        assert cases[16]["loads_done"] >= 0 and all(c["p50_us"] > 0 for c in cases.values())
        assert res["engine_step"]["unary_getstats"]["p50_us"] > 0


def test_daemon_entry_sets_module_defaults():
    from kvd.bench.daemon_entry import apply
    from kvd.core import node

    old = node.Limits().poll_busy_s
    try:
        apply("kvd.core.node.Limits.poll_busy_s=0.00025")
        assert node.Limits().poll_busy_s == 0.00025
    finally:
        apply(f"kvd.core.node.Limits.poll_busy_s={old}")
    with pytest.raises(ImportError):
        apply("nosuchmodule.X=1")
