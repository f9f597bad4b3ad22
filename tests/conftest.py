"""Shared fixtures: real kvd daemons (subprocesses) and shm segments."""

from __future__ import annotations

import pytest

from kvd.testing.daemons import start_daemon
from kvd.testing.shm import cleanup_segments


@pytest.fixture(scope="session", autouse=True)
def no_leftover_test_segments():
    """Removes the test's shm segments (``/dev/shm/kvdtest_<pid>_*``) whose
    creating process is gone: engine processes that a scenario killed on
    purpose cannot clean up after themselves."""
    yield
    cleanup_segments("kvdtest")


@pytest.fixture
def daemon_pair(tmp_path):
    """Two running daemons, ``(prefill, decode)``, stopped after the test."""
    a = start_daemon(str(tmp_path), "prefill")
    b = start_daemon(str(tmp_path), "decode")
    yield a, b
    for d in (a, b):
        d.stop()


@pytest.fixture
def daemon(tmp_path):
    """One running daemon."""
    d = start_daemon(str(tmp_path), "kvd")
    yield d
    d.stop()


# vLLM end-to-end fixtures (tests marked @pytest.mark.vllm; see
# tests/test_vllm_e2e.py and kvd/demo/). Nothing above depends on these.

import importlib.util as _importlib_util
import os as _os


def _vllm_missing() -> str | None:
    """Why the real-engine tests cannot run here (None when they can)."""
    if _os.environ.get("KVD_SKIP_VLLM") == "1":
        return "KVD_SKIP_VLLM=1"
    for mod in ("vllm", "transformers", "tokenizers"):
        if _importlib_util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install -e '.[vllm]')"
    return None


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The demo's tiny random Llama (built once, cached under ~/.cache/kvd or
    $KVD_TINY_MODEL_DIR; about 8 s the first time)."""
    why = _vllm_missing()
    if why:
        pytest.skip(why)
    from kvd.demo import tiny_model

    return tiny_model.build(quiet=True)
