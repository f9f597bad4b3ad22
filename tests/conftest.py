"""Shared fixtures: real kvd daemons (subprocesses) and shm segments."""

from __future__ import annotations

import pytest

from kvdtest import start_daemon


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
