"""Retired remotes (peer agents a worker stopped using) are freed only when
no READ can still go through them (``kvd.core.peers.Peers.retired_in_use``).

Removing a peer's agent under a READ leaves UCX's requests going (NIXL 1.5
reports the READ ``ERR`` at once), and over UCX's TCP transport the source
daemon then died with SIGSEGV when the connection later failed
(tests/test_reliability_twohosts.py runs that case with real daemons). These
unit tests cover the orderings a real run hits only by chance, with a
recording stand-in for the NIXL agent: the real ``Peers`` and ``Pull`` code
decide.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from kvd.core.peers import Peers
from kvd.core.pull import Pull
from kvd.core.state import RemoteWorker, WorkerPairs


class RecordingAgent:
    """Posts READs that stay in progress; records what reaches NIXL."""

    name = "local"

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.running: set = set()

    def post(self, op, local, lidx, remote, ridx, msg):
        h = object()
        self.running.add(h)
        self.calls.append(("post", op))
        return h, "PROC"

    def state(self, h) -> str:
        return "PROC" if h in self.running else "DONE"

    def release_dlist(self, d) -> None:
        self.calls.append(("release_dlist", d))

    def remove_remote(self, name: str) -> None:
        self.calls.append(("remove_remote", name, len(self.running)))


def _setup():
    agent = RecordingAgent()
    rt = SimpleNamespace(zombies=[], release_handle=lambda *a, **k: None)
    w = SimpleNamespace(agent=agent, inflight={}, posting={}, pairs=WorkerPairs(), label="w", key=("e", 0))
    peers = Peers(rt, None)
    peers.warm = lambda *a, **k: None  # no background handshake in a unit test
    r = RemoteWorker("10.0.0.2:7000", "P", 0, 1, "kvd-P-r0-abcd", None, 1, 1, 1, ("L", "R"), False, "x")
    w.pairs.remotes[r.key] = r
    w.pairs.agents[r.agent_name] = (b"metadata", 1, r.key)
    return agent, rt, w, peers, r


def test_a_remote_retired_while_a_load_posts_through_it_is_freed_only_after_the_read_ends():
    """A load took remote r and is between its claim and its post; r is
    retired (another load's READ from that peer failed); the load's READ is
    posted on the NIXL thread, and the next poll (queued behind it on that
    thread) runs before the loop records the load in ``inflight``. Before,
    that poll removed r's agent under the READ (``posting`` was a set of ids
    the check did not read)."""
    agent, rt, w, peers, r = _setup()
    w.posting["L"] = (r,)
    peers.retire(w, r, "READ failed", again=False)
    handle, state, _ = Pull._post(SimpleNamespace(rt=rt), "L", agent, r, "READ", "L", [0], "R", [0], b"m", 0.0)
    assert state == "PROC"
    assert peers.retired_in_use(w, r)
    peers.free_unused_retired(w)  # the progress poll
    assert not r.freed and not any(c[0] == "remove_remote" for c in agent.calls), agent.calls
    assert peers.free_retired(w, r) is False  # the handshake's free, on the NIXL thread, looks again
    # The loop records the load, then its READ ends and the load leaves.
    w.posting.pop("L")
    w.inflight["L"] = SimpleNamespace(parts=[(handle, r)])
    peers.free_unused_retired(w)
    assert not r.freed
    agent.running.discard(handle)
    w.inflight.pop("L")
    peers.free_unused_retired(w)
    assert r.freed and ("remove_remote", r.agent_name, 0) in agent.calls and not w.pairs.retired


def test_a_read_given_up_at_its_deadline_keeps_every_retired_remote_until_it_ends():
    """A READ handle in ``Runtime.zombies`` records no remote: while one of
    the worker's agent is there, no retired remote of that worker is freed,
    by the poll or by a handshake."""
    agent, rt, w, peers, r = _setup()
    rt.zombies.append((agent, object()))
    peers.retire(w, r, "transfer past its deadline", again=False)
    peers.free_unused_retired(w)
    assert peers.free_retired(w, r) is False and not r.freed
    rt.zombies.clear()
    assert peers.free_retired(w, r) is True and r.freed
    assert peers.free_retired(w, r) is True  # gone already: no second free
    assert [c for c in agent.calls if c[0] == "remove_remote"] == [("remove_remote", r.agent_name, 0)]


def test_a_retired_remote_is_removed_by_identity_not_by_equal_value():
    """Two remotes equal field by field (dataclasses compare by value):
    freeing one must leave the other in the retired list."""
    agent, rt, w, peers, r = _setup()
    twin = dataclasses.replace(r)
    assert twin == r and twin is not r
    w.pairs.retired.extend([twin, r])
    w.inflight["L"] = SimpleNamespace(parts=[(object(), twin)])
    peers.free_unused_retired(w)
    assert r.freed and not twin.freed and w.pairs.retired == [twin] and w.pairs.retired[0] is twin
