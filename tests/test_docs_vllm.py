"""What README.md and docs/OPERATIONS.md say of vLLM's own behaviour around
kvd's connector, checked against the vLLM installed here: a vLLM whose
default changes fails this, not a deployment that read the old text."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", ROOT / "docs" / "OPERATIONS.md")


def test_the_docs_give_vllms_default_load_failure_policy_and_how_to_recompute():
    """A failed load fails the request unless ``--kv-transfer-config`` sets
    ``kv_load_failure_policy`` to ``recompute``: the docs name vLLM's
    default as its startup line prints it, and a key vLLM takes."""
    pytest.importorskip("vllm")
    from vllm.config.kv_transfer import KVTransferConfig

    default = {f.name: f.default for f in dataclasses.fields(KVTransferConfig)}["kv_load_failure_policy"]
    assert default == "fail"
    key = '"kv_load_failure_policy":"recompute"'
    assert KVTransferConfig(**json.loads("{" + key + "}")).kv_load_failure_policy == "recompute"
    for doc in DOCS:
        text = re.sub(r"\s+", " ", doc.read_text())
        assert f"`kv_load_failure_policy='{default}'`" in text, doc.name
        assert f"`{key}`" in text and "HTTP 500" in text, doc.name
