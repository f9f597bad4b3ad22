"""What kvd.core.settle counts on in NIXL 1.5 + UCX, checked with real agents
in two processes over UCX's ``tcp`` transport, the source frozen (SIGSTOP)
while a READ from it is posted: NIXL cannot cancel that READ (a released
handle's bytes still land when the source resumes), ``NixlAgent.release``
does not take it as settled, and destroying the reader's agent
(``NixlAgent.close``) stops it: nothing lands afterwards.

If a NIXL upgrade changes the first point (a real cancel), the agent
replacement in ``Registry.replace_agent`` may give way to it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvd.core.nixl_agent import NixlAgent, Unprepped
from kvd.testing.nixl_peer import PEER_AGENT
from kvd.testing.processes import child_env
from kvd.testing.util import wait_until

BLOCK = 4096
N_BLOCKS = 4


@pytest.fixture
def frozen_read(monkeypatch):
    """``(reader agent, handle, local buffer, source process)``: a READ of
    ``N_BLOCKS`` blocks posted to a source agent stopped before it, over
    ``UCX_TLS=tcp`` (both sides)."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by UCX when each agent is made
    size = BLOCK * N_BLOCKS
    src = subprocess.Popen([sys.executable, "-c", PEER_AGENT, "settle-source", str(size)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=child_env({"UCX_TLS": "tcp"}))
    agent = None
    try:
        line = next(x for x in src.stdout if x.startswith("MD "))
        _, md, base = line.split()
        agent = NixlAgent("settle-reader")
        buf = mmap.mmap(-1, size)
        local = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        agent.register_dram(local, size)
        os.kill(src.pid, signal.SIGSTOP)
        name = agent.add_remote(bytes.fromhex(md))

        def rows(at):
            return lambda idx: np.array([[at + int(i) * BLOCK, BLOCK, 0] for i in idx], dtype=np.int64)

        idx = np.arange(N_BLOCKS)
        h, state = agent.post("READ", Unprepped(rows(local)), idx, Unprepped(rows(int(base)), agent=name), idx, b"n")
        assert state == "PROC"
        yield agent, h, buf, src
    finally:
        os.kill(src.pid, signal.SIGCONT)
        src.kill()
        src.wait()


def _resume_and_wait(src, buf) -> bool:
    """Resumes the source; True when its bytes (0xAB) land in ``buf`` within
    10 s (when they land at all, they do within milliseconds)."""
    os.kill(src.pid, signal.SIGCONT)
    return wait_until(lambda: any(buf[:]), 10) is not None


def test_a_released_read_still_lands_and_release_does_not_take_it_as_settled(frozen_read):
    agent, h, buf, src = frozen_read
    time.sleep(0.5)
    assert agent.state(h) == "PROC"
    assert agent.release(h) is False  # not settled: the handle is kept
    assert agent.release(h, settled=True) is True  # what NIXL itself accepts
    assert _resume_and_wait(src, buf), "NIXL now stops a released READ: the agent replacement may be needless"


def test_closing_the_reader_agent_stops_its_read(frozen_read):
    agent, h, buf, src = frozen_read
    time.sleep(0.5)
    assert agent.close() is False  # the handle still binds the native agent
    assert agent.release(h, settled=True)
    del h
    assert agent.close() is True
    assert agent.state(object()) == "ERR" and agent.release(object()) is False  # a closed agent fails, never crashes
    assert not _resume_and_wait(src, buf), "a READ landed after its agent was destroyed"
    assert not any(buf[:])
