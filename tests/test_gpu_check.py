"""benchmarks/gpu_check.py, the GPU device check, proven on the CPU
(``--cpu``): the same flow as on the H200 (two engine processes, two real
daemons, direct / staged / auto, local (both engines on one daemon, which
copies itself), and the in-process baseline: each engine's own NIXL agent;
bytes compared, reference copy, UCX protocol tables classified from the
reader's log), on DRAM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cpu_dry_run_moves_verified_bytes_on_every_path(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--out", str(tmp_path),
                        "--sizes", "1M,64K", "--bytes-per-load", "1M", "--reps", "1"],
                       capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["errors"] == []
    cases = {(c["block_bytes"], c["path"]): c for c in res["cases"]}
    assert set(cases) == {(s, p) for s in (64 << 10, 1 << 20) for p in ("nixl", "direct", "staged", "auto", "local")}
    for (size, path), c in cases.items():
        assert c["ok"] and c["verify"]["ok"], (size, path, c)
        assert c["verify"]["bytes_checked"] == c["bytes_per_load"]  # repetition 0: one load, every byte
        # named shm: auto is direct; nixl: each engine's own agent, the in-process baseline
        want = {"nixl": "nixl", "direct": "direct", "staged": "staged", "auto": "direct", "local": "direct"}[path]
        assert c["registered"]["prefill"]["data_path"] == c["registered"]["decode"]["data_path"] == want
        assert c["transfer_gbps"] > 0 and c["e2e_gbps"] > 0
        assert all(rep["send_done"]["send_done"] == rep["loads"] for rep in c["reps"])  # every lease ended by a read
        if path == "local":  # one daemon for both: its own copy (its log says so), no UCX between them
            assert c["same_node_copy"] and c["ucx_path"] == "none: same-node copy" and not c["ucx_proto_info"]
            continue
        # the decode daemon's own UCX protocol table, parsed from its log: a DRAM READ
        assert c["ucx_path"] == "host", c["ucx_proto_info"]
        if path == "staged":
            assert c["reps"][-1]["copy_in_s"] > 0 and c["reps"][-1]["copy_out_s"] > 0
        assert c["of_nixl"] > 0  # against the in-process baseline of its block size
    assert set(res["d2d"]) == {str(64 << 10), str(1 << 20)}
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| 1 MiB | staged | staged/staged | 2 MiB ok |" in md and "CPU dry run" in md
    assert (tmp_path / "decode_daemon.log").exists() and (tmp_path / "prefill_daemon.log").exists()
    assert "| 1 MiB | nixl | nixl/nixl | 2 MiB ok |" in md
    # the in-process baseline's UCX table comes from the decode engine's own output
    assert "remote memory read" in (tmp_path / "decode_engine.log").read_text()


def test_the_gpu_mode_on_a_cpu_torch_stops_at_once_saying_what_to_install(tmp_path):
    """scripts/setup.sh's environment has CPU torch: the GPU check says so
    before starting any daemon or engine (it failed deep in an engine
    with torch's AttributeError before)."""
    import torch

    if torch.version.cuda is not None and torch.cuda.is_available():
        import pytest

        pytest.skip("this machine has a GPU")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "gpu_check: torch" in r.stderr and "--cpu runs the same flow" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not list(tmp_path.iterdir())


def test_the_kernel_check_on_a_cpu_torch_stops_at_once():
    """benchmarks/gpu_kernel_check.py (kvd's row copies on a GPU, docs/GPU.md)
    imports and says what it needs where there is no GPU."""
    import torch

    if torch.version.cuda is not None and torch.cuda.is_available():
        import pytest

        pytest.skip("this machine has a GPU")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_kernel_check.py")],
                       capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert r.returncode == 2 and "needs a CUDA build of torch and a GPU" in r.stderr, r.stdout + r.stderr
