"""Shared fixtures: real kvd daemons (subprocesses) and shm segments."""

from __future__ import annotations

import pytest

from kvd.testing.daemons import start_daemon
from kvd.testing.shm import cleanup_segments


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails while real-engine stacks run (kvd.testing.vllm_engines.
    PDStack) gets their daemons' and engines' log tails in its report: on a CI
    machine the run directory is gone by the time anyone reads the output."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    try:
        from kvd.testing.vllm_engines import open_stacks
    except ImportError:
        return
    for i, stack in enumerate(open_stacks()):
        report.sections.append((f"kvd stack {i} logs ({stack.run_dir})", stack.log_tails()))


@pytest.fixture(scope="session", autouse=True)
def no_leftover_test_segments():
    """Removes the test's shm segments (``/dev/shm/kvdtest_<pid>_*``) whose
    creating process is gone: engine processes that a scenario killed on
    purpose cannot clean up after themselves."""
    yield
    cleanup_segments("kvdtest")


@pytest.fixture(scope="module")
def real_md():
    """The NIXL agent metadata of a real agent (UCX, nothing registered),
    what a peer's handshake answer carries."""
    from kvd.core.nixl_agent import NixlAgent

    agent = NixlAgent("test-real-agent")
    try:
        yield agent.metadata()
    finally:
        agent.close()


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


@pytest.fixture(scope="session")
def hybrid_model_dir():
    """``kvd.demo.tiny_hybrid`` (built once, cached under ~/.cache/kvd)."""
    why = _vllm_missing()
    if why:
        pytest.skip(why)
    from kvd.demo import tiny_hybrid

    return tiny_hybrid.build(quiet=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A config-only tiny Llama (no weights: the in-process engine loops of
    tests/test_shim_*.py run vLLM's scheduler, not a model), with its KV shape
    (``tests/vllm_inproc.py``: 2 KV heads of 32)."""
    why = _vllm_missing()
    if why:
        pytest.skip(why)
    from transformers import LlamaConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=2048, torch_dtype="float32").save_pretrained(d)
    init_none_hash(sha256)
    return str(d)


@pytest.fixture
def fake(tmp_path):
    """A :class:`kvd.testing.fakes.FakeDaemon` on ``<tmp>/engine.sock``
    (answers every command at once), closed after the test."""
    from kvd.testing.fakes import FakeDaemon

    d = FakeDaemon(str(tmp_path / "engine.sock")).start()
    yield d
    d.close()
