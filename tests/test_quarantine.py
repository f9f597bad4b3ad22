"""What the daemon keeps of a worker unregistered while a push WRITE out
of its memory runs (``Registry._free_worker``): unit tests with stand-in
workers; the path itself runs for real in
``tests/test_reliability_tcp.py::test_a_source_engine_unregistering_during_its_push_sends_no_other_engines_bytes_and_lives``."""

from __future__ import annotations

import time
from types import SimpleNamespace

from kvd.core.limits import Limits
from kvd.core.registry import Registry


def _registry(**rt):
    reg = Registry.__new__(Registry)  # no NIXL: only the bookkeeping is under test
    reg.rt = SimpleNamespace(zombies=[], writes={}, limits=Limits(transfer_timeout_s=30.0), **rt)
    return reg


def test_a_gone_workers_reads_go_to_the_zombies_and_its_writes_get_at_most_the_transfer_timeout():
    """Its loads' READ handles were dropped with its loads (unregister
    clears them): never released on the NIXL thread, they kept the agent,
    and the memory, alive, and the READs landed after the unregistration
    (an attacker review: 949-1,024 of 1,024 block-regions). They go to the
    zombies, which the next free releases before the agent is destroyed.
    A WRITE the reader gave an hour ends within ``transfer_timeout_s``; one
    due sooner keeps its deadline; another worker's is not touched."""
    agent = object()
    w = SimpleNamespace(agent=agent, inflight={
        "a": SimpleNamespace(parts=[("h1", 0), ("h2", 1)]),
        "b": SimpleNamespace(parts=[("h2", 0)]),  # a coalesced READ: a part of two loads, released once
    })
    other = SimpleNamespace(agent=object(), inflight={})
    reg = _registry()
    now = time.monotonic()
    reg.rt.writes.update({1: (w, "wh1", None, now + 3600), 2: (w, "wh2", None, now + 5), 3: (other, "wh3", None,
                                                                                           now + 3600)})
    assert reg._writing(w) and not reg._free_worker(w)
    assert sorted(h for a, h in reg.rt.zombies if a is agent) == ["h1", "h2"]
    assert all(not load.parts for load in w.inflight.values())
    assert now + 29 < reg.rt.writes[1][3] <= time.monotonic() + 30
    assert reg.rt.writes[2][3] == now + 5 and reg.rt.writes[3][3] == now + 3600
    # Called again each progress round until the WRITEs end: nothing twice.
    reg._free_worker(w)
    assert len(reg.rt.zombies) == 2


def test_quarantined_workers_count_against_the_caps_and_the_refusal_says_so():
    """A quarantined worker holds its memory, agent and threads: it counts
    (a uid unregistering under stalled WRITEs kept 1 GiB mapped against a
    256 MiB cap, an attacker review)."""
    import pytest

    from kvd.core.events import ResourceExhausted

    owner = SimpleNamespace(uid=1000)
    held = SimpleNamespace(owner=owner, regions=[0], layout=SimpleNamespace(num_blocks=4),
                           mem=SimpleNamespace(registered_bytes=1 << 20, memory="DRAM", staged=False))
    reg = _registry(workers={}, quarantine=[held])
    reg.rt.limits = Limits(max_workers_per_uid=1)
    reg._registering, reg._releasing = {}, {}
    with pytest.raises(ResourceExhausted) as e:
        reg._check_caps(4, owner)
    assert "max_workers_per_uid 1" in str(e.value) and "quarantined_workers" in str(e.value), e.value
    reg.rt.quarantine.clear()
    reg._check_caps(4, owner)


def test_an_agent_replaced_but_not_destroyed_keeps_the_memory_mapped_until_it_is():
    """A replacement (``Registry.replace_agent``, to stop a READ whose peer
    does not answer) that could not destroy the old agent (a handle of it
    still bound) leaves its transfers able to land. Only its name was kept,
    so the unregistration unmapped the memory while that agent lived. Now
    the agent is kept: the worker is quarantined until it is destroyed,
    and each later free tries again."""

    class Agent:
        def __init__(self, closes):
            self.closes, self.tries = closes, 0

        def close(self, defer=False):
            self.tries += 1
            return self.closes

    stuck = Agent(False)
    w = SimpleNamespace(agent=Agent(True), label="w", inflight={}, mem=SimpleNamespace(lingering={"old": stuck}))
    reg = _registry()
    reg._end_transfers = lambda w: 0  # no NIXL state to free: only the agents' bookkeeping is under test
    reg._free_nixl = lambda w: None
    assert not reg._free_worker(w)
    assert not reg._free_worker(w, False) and stuck.tries == 2
    stuck.closes = True
    assert reg._free_worker(w, False) and w.mem.lingering == {}
    assert reg._free_worker(w, False) and stuck.tries == 3  # destroyed once: not tried again
