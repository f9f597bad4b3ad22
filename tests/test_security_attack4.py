"""Attack 4: the warm-up READ of a new pair (``Peers._warm_read``) against
a peer that stops progressing right after it answered the handshake (a
hostile peer daemon, or one frozen with SIGSTOP).

The warm-up READ had no deadline: over UCX's ``tcp`` transport a READ needs
the source's progress, so against a frozen peer it stays ``PROC`` for ever
and its handle sits in ``Runtime.zombies`` for as long as the reader worker
lived. Every zombie of a worker's agent counts, to the rest of the daemon, as
a READ into engine memory that must be settled, although this one can only
land in the daemon's scratch page:

* ``leaked_handles`` never returned to 0 (the warm-up was never given up);
* the progress loop frees a worker's retired remotes only while none of its
  agent's handles is a zombie, so every remote the worker retired later
  (a healthy peer that restarted, an idle one) stayed loaded for ever;
* ``settle.end_reads`` replaces the agent whenever a zombie of it is still in
  progress, so the next end of the engine's session (no load in flight at
  all) destroyed the worker's agent and dropped every healthy pair.

Real NIXL agents over ``UCX_TLS=tcp``: the frozen peer is a NIXL agent in a
process of its own (``kvd.testing.nixl_peer``) stopped before the pair is
made; the reader is an in-process ``Node`` whose handshake answer from a
healthy in-process ``Node`` is replayed with the frozen agent's metadata and
addresses (what a hostile peer daemon answers), given to ``Peers.pair`` as
``Peers.handshake`` does.

Found by an attacker review, now fixed: warm-up READs are kept apart from
``Runtime.zombies`` (``Runtime.warm_ups``), given up by force at
``handshake_timeout_s``, and the warm-up reads the peer daemon's own scratch
page (``warm_up_addr`` in the handshake), never an engine's memory. A
precondition that does not hold raises ``RuntimeError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from kvd.core.limits import Limits
from kvd.core.nixl_agent import metadata_agent_name
from kvd.core.node import Node
from kvd.core.state import Segment
from kvd.testing.nixl_peer import LAYOUT, PEER_AGENT, REGIONS, SIZE
from kvd.testing.processes import child_env
from kvd.testing.shm import ShmSegment

HANDSHAKE_TIMEOUT_S = 1.0


def need(cond: bool, what: str) -> None:
    """A precondition of the scenario (not the weakness under test)."""
    if not cond:
        raise RuntimeError(f"precondition failed: {what}")


@pytest.fixture
def frozen_peer(monkeypatch):
    """``(metadata, base address)`` of a NIXL agent in another process that
    registered ``SIZE`` bytes and is stopped (SIGSTOP), over ``UCX_TLS=tcp``."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by UCX when each agent is made
    peer = subprocess.Popen([sys.executable, "-c", PEER_AGENT, "attack4-frozen-peer", str(SIZE)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=child_env({"UCX_TLS": "tcp"}))
    try:
        line = next(x for x in peer.stdout if x.startswith("MD "))
        _, md, base = line.split()
        os.kill(peer.pid, signal.SIGSTOP)
        yield bytes.fromhex(md), int(base)
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        peer.kill()
        peer.wait()


def run_pair(body, limits: Limits | None = None, fill: int = 0):
    """Runs ``body(d, wd, hs)``: an in-process source Node (engine "P",
    memory filled with ``fill``) and a reader Node ``d`` (worker ``wd``),
    ``hs`` the source's honest handshake answer; returns what ``body`` does
    and both segments' bytes at the end."""
    src, dst = ShmSegment(SIZE), ShmSegment(SIZE)
    src.array[:] = fill

    async def main():
        # The reader set to pull: under auto it would skip the warm-up READ
        # of a source whose handshake says its READs are TCP's (UCX_TLS=tcp here).
        p, d = Node(), Node(limits or Limits(transfer_mode="pull"))
        p.start()
        d.start()
        try:
            await p.register("P", 0, 1, LAYOUT, [Segment(src.name, src.size)], REGIONS, model="m")
            wd = await d.register("D", 0, 1, LAYOUT, [Segment(dst.name, dst.size)], REGIONS, model="m")
            return await body(d, wd, await p.handshake_info("P", 0, wd.compat_hash))
        finally:
            await d.close()
            await p.close()

    try:
        return asyncio.run(main()), bytes(src.array), bytes(dst.array)
    finally:
        src.close()
        dst.close()


def run_scenario(frozen, body):
    """Runs ``body(d, wd, healthy_remote, frozen_remote)``: a reader Node ``d``
    (worker ``wd``, ``handshake_timeout_s`` of 1 s) paired with a healthy
    in-process peer and then with the frozen one (its warm-up READ posted and
    stuck)."""
    md, base = frozen

    async def scenario(d, wd, hs):
        healthy = await d.peers.pair(wd, hs, 0, we_read=True, address="127.0.0.1:2", engine_id="P")
        wd.pairs.remotes[healthy.key] = healthy
        for _ in range(300):  # the healthy pair's warm-up READ ends at once
            if not d.rt.warm_ups:
                break
            await asyncio.sleep(0.01)
        need(not d.rt.warm_ups, "the healthy peer's warm-up READ ended")
        # The hostile peer's answer: a valid layout, its own agent and
        # addresses, its warm-up page somewhere in its registered memory.
        forged = dataclasses.replace(hs, agent_metadata=md, agent_name=metadata_agent_name(md),
                                     region_bases=[base + r.offset for r in REGIONS], warm_up_addr=base)
        bad = await d.peers.pair(wd, forged, 0, we_read=True, address="127.0.0.1:1", engine_id="X")
        wd.pairs.remotes[bad.key] = bad
        return await body(d, wd, healthy, bad)

    return run_pair(scenario, Limits(handshake_timeout_s=HANDSHAKE_TIMEOUT_S, transfer_mode="pull"))[0]


def test_a_warm_up_read_stuck_on_a_frozen_peer_is_given_up_within_the_handshake_timeout(frozen_peer, caplog):
    """Attack: a peer answers the handshake, then stops (SIGSTOP, or a
    hostile peer whose agent never progresses). The reader's warm-up READ
    never ends; its handle stays in ``Runtime.zombies`` and
    ``leaked_handles`` in stats stays 1 until the reader worker goes
    (an alarm for operators that never clears; ``kvd.testing.daemons``
    counts it as a leak).

    Safe behaviour: the warm-up READ lands only in the daemon's scratch page
    (it lives as long as the agent object), so a warm-up still in progress
    after ``handshake_timeout_s`` can be released by force and forgotten:
    ``leaked_handles`` back to 0 within the handshake timeout (plus a poll)."""

    async def body(d, wd, healthy, bad):
        await asyncio.sleep(0.2)
        need(len(d.rt.warm_ups) == 1, "the frozen peer's warm-up READ is still in progress")
        leaked_meanwhile = d.stats()["leaked_handles"]
        t_end = time.monotonic() + HANDSHAKE_TIMEOUT_S + 2.0
        while time.monotonic() < t_end and d.rt.warm_ups:
            await asyncio.sleep(0.05)
        return len(d.rt.warm_ups), leaked_meanwhile, d.stats()["leaked_handles"]

    with caplog.at_level(logging.WARNING, logger="kvd.core"):
        kept, leaked_meanwhile, leaked = run_scenario(frozen_peer, body)
    assert kept == 0, f"{kept} warm-up READ handle(s) still kept {HANDSHAKE_TIMEOUT_S + 2:.0f} s later"
    assert leaked_meanwhile == leaked == 0, "a warm-up READ (scratch page only) counted as a leaked handle"
    # Operators are told: a pair UCX never wired up stalls its loads' READs too.
    assert [r for r in caplog.records if "warm-up READ not done after" in r.getMessage()], caplog.text


def test_a_warm_up_read_stuck_on_a_frozen_peer_does_not_keep_retired_remotes_loaded(frozen_peer):
    """Attack: one frozen peer (its warm-up READ stuck) makes the reader
    worker keep every remote it retires afterwards: ``Progress.poll`` frees
    ``w.pairs.retired`` only when no handle of ``w.agent`` is in
    ``Runtime.zombies``. A healthy peer that restarts (liveness retires its
    old agent), or one idle past ``peer_dead_s``, then stays loaded in NIXL
    with its prepared lists for as long as the worker lives:
    ``remote_agents`` and ``prepped_dlists`` grow with each such event.

    Safe behaviour: a retired remote no posted READ uses is freed within a
    few polls, whatever warm-up READ to another peer is still in progress."""

    async def body(d, wd, healthy, bad):
        d.peers.retire(wd, healthy, "attack4: the healthy peer restarted", again=False)
        need(healthy in wd.pairs.retired, "the healthy remote is retired")
        t_end = time.monotonic() + 3.0
        while time.monotonic() < t_end and (wd.pairs.retired or healthy.agent_name in wd.pairs.agents):
            await asyncio.sleep(0.05)
        return len(wd.pairs.retired), healthy.agent_name in wd.pairs.agents, d.stats()["remote_agents"]

    retired, loaded, remote_agents = run_scenario(frozen_peer, body)
    assert retired == 0 and not loaded, (f"3 s after retiring it: {retired} retired remote(s) kept, the healthy "
                                         f"peer's agent loaded={loaded}, remote_agents={remote_agents}")


def test_a_warm_up_read_stuck_on_a_frozen_peer_does_not_make_a_session_end_replace_the_agent(frozen_peer):
    """Attack: after one frozen peer's warm-up READ, the reader engine's
    session ends (a reconnect of its stream) with no load in flight. The
    daemon takes the stuck warm-up for a READ into engine memory
    (``settle.end_reads``: a zombie of the agent still in progress) and
    replaces the worker's NIXL agent (``Registry.replace_agent``): the
    agent's set-up again on the NIXL thread, every pair with every peer
    freed (each must handshake again, its first load paying first contact
    once more). A hostile peer that answers and freezes can trigger this on
    each reconnect of each engine it is paired with.

    Safe behaviour: a warm-up READ (scratch page only) is not a READ to
    settle: a session end with no load in flight keeps the agent and the
    healthy peer's pair."""

    async def body(d, wd, healthy, bad):
        agent = wd.agent
        w = await d.attach("D", 0)
        await d.detach(w)  # the last stream ends: no load in flight
        return wd.agent is agent, healthy.key in wd.pairs.remotes

    same_agent, kept = run_scenario(frozen_peer, body)
    assert same_agent and kept, (f"a session end with no load in flight: agent kept={same_agent}, healthy "
                                 f"pair kept={kept}")


def test_a_warm_up_address_outside_the_peers_registered_memory_is_refused_and_the_pair_kept():
    """A peer's ``warm_up_addr`` pointing at memory it never registered
    (here: the reader's own engine memory, or a wild address) makes no READ
    (NIXL checks the row against the peer's registrations): the pair is
    made, nothing lands anywhere; one past the 64-bit range is refused as
    invalid before any NIXL call."""
    from kvd.core.events import InvalidArgument
    from kvd.core.peers import check_peer

    async def body(d, wd, hs):
        with pytest.raises(InvalidArgument, match="warm_up_addr"):
            check_peer(wd, dataclasses.replace(hs, warm_up_addr=(1 << 64) - 1), "handshake")
        kept = []
        for i, addr in enumerate((wd.mem.bases[0], 0x1000)):
            forged = dataclasses.replace(hs, warm_up_addr=addr)
            r = await d.peers.pair(wd, forged, 0, we_read=True, address=f"127.0.0.1:{i + 1}", engine_id="P")
            kept.append(r.agent_name)
            await d.rt.nixl(d.peers.free_remote, wd, r)
        return kept, list(d.rt.warm_ups), bytes(wd.agent._scratch)

    (kept, warm_ups, scratch), src, dst = run_pair(body, fill=9)
    assert len(kept) == 2 and not warm_ups
    assert not any(scratch) and not any(dst) and set(src) == {9}
