"""The progress poll waits on the NIXL thread for a transfer in flight to end,
and gives the thread up at once to any other NIXL call (unit test with a
fake agent; the real path runs in every transfer test)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from kvd.core import progress as pg
from kvd.core.limits import Limits


class Agent:
    """A NIXL agent stand-in: a transfer that is PROC until ``done`` is set."""

    def __init__(self):
        self.done = threading.Event()
        self.checks = 0

    def state(self, handle) -> str:
        self.checks += 1
        return "DONE" if self.done.is_set() else "PROC"


def _progress(agent, *, inflight=True):
    load = SimpleNamespace(parts=[("handle", None)])
    w = SimpleNamespace(agent=agent, inflight={"r": load} if inflight else {})
    rt = SimpleNamespace(workers={("e", 0): w}, nixl_jobs=1, nixl_called=threading.Event(), limits=Limits())
    p = pg.Progress.__new__(pg.Progress)
    p.rt, p.push = rt, SimpleNamespace(writes={})
    polls = []
    p.poll = lambda: polls.append(time.monotonic()) or ([], [])
    return p, rt, polls


@pytest.fixture
def long_wait(monkeypatch):
    """A wait bound far above anything the test waits for: returning at all proves the wake-up."""
    monkeypatch.setattr(pg, "BUSY_WAIT_S", 30.0)


def test_the_poll_returns_when_a_transfer_in_flight_ends(long_wait):
    agent = Agent()
    p, _, polls = _progress(agent)
    threading.Timer(0.05, agent.done.set).start()
    t0 = time.monotonic()
    p.poll_until_done()
    assert time.monotonic() - t0 < 10  # woken by the transfer's end, not the 30 s bound
    assert agent.done.is_set() and len(polls) == 2  # polled again once it ended
    assert agent.checks >= 2


def test_the_poll_gives_the_nixl_thread_up_to_another_call(long_wait):
    agent = Agent()
    p, rt, polls = _progress(agent)

    def another_call():
        rt.nixl_jobs += 1
        rt.nixl_called.set()

    threading.Timer(0.05, another_call).start()
    t0 = time.monotonic()
    p.poll_until_done()
    assert time.monotonic() - t0 < 10 and not agent.done.is_set()  # the transfer is still in flight
    assert len(polls) == 2


def test_nothing_in_flight_means_no_wait(long_wait):
    p, _, polls = _progress(Agent(), inflight=False)
    t0 = time.monotonic()
    p.poll_until_done()
    assert time.monotonic() - t0 < 10 and len(polls) == 1


def test_busy_wait_off_is_the_former_single_poll(monkeypatch):
    monkeypatch.setattr(pg, "BUSY_WAIT_S", 0.0)
    agent = Agent()
    p, _, polls = _progress(agent)
    p.poll_until_done()
    assert len(polls) == 1 and agent.checks == 0
