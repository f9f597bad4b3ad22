"""A push's deadline and its session's end stop a source's WRITE by
replacing the decode worker's NIXL agent (``kvd.core.settle``); that
replacement fails the worker's other transfers and drops its pairs, so it
happens only where a WRITE can come: once a push order has gone out.

Found by an attacker review: a load naming an address where nothing
answers (any API user sets it in ``kv_transfer_params``) timed out in the
callee's proof handshake, no order sent, and still replaced the agent: at
will, for every transfer of that worker.
"""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

from kvd.core import settle
from kvd.core.limits import Limits
from kvd.core.node import Node
from kvd.core.state import Segment
from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import Engine, KvShape, event_kind
from kvd.testing.shm import ShmSegment
from kvd.testing.util import peer_token_file
from kvd.requests import LoadRequest
from kvd.testing.nixl_peer import LAYOUT, REGIONS, SIZE

SHAPE = KvShape(num_layers=1, num_blocks=16, block_len=4096)


def _pushes_to_a_silent_callee_replace_no_agent(tmp_path, *credential: str) -> None:
    """Two push loads of a decode daemon with ``credential`` (its flags)
    name a listener that takes the connection and never answers (it does
    not accept: gRPC's preface and the TLS handshake go unanswered); both
    fail at their 1 s deadline and the worker keeps its agent."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    d = start_daemon(str(tmp_path), "decode", "--transfer-mode", "push", *credential)
    try:
        dec = Engine(d, "dec", SHAPE)
        for n in range(2):
            dec.load(f"r{n}", [1], None, [1], f"p{n}", remote_engine_id="p",
                     remote_address=f"127.0.0.1:{hole.getsockname()[1]}", timeout_s=1)
            ev = dec.wait(f"r{n}", 20)
            assert event_kind(ev) == "load_failed", ev
        assert "replaced by" not in d.log(), "an agent was replaced though no push order had gone out"
        dec.close()
    finally:
        hole.close()
        assert d.stop() == 0


def test_a_push_that_times_out_before_its_order_went_out_replaces_no_agent(tmp_path):
    """With a token: the callee's proof handshake runs into the load's
    deadline, no PushRequest is sent."""
    _pushes_to_a_silent_callee_replace_no_agent(tmp_path, "--peer-token-file", peer_token_file(tmp_path))


def test_with_mutual_tls_a_push_to_a_callee_that_never_answers_replaces_no_agent(tmp_path):
    """With mutual TLS, where the TLS handshake proves the callee: the push
    counts as sent only once the channel is ready."""
    from kvd.testing.security import Pki

    _pushes_to_a_silent_callee_replace_no_agent(tmp_path, *Pki(str(tmp_path / "pki")).flags("dec"))


def test_with_mutual_tls_an_honest_push_moves_the_blocks(tmp_path):
    from kvd.testing.security import Pki

    pki = Pki(str(tmp_path / "pki"))
    p = start_daemon(str(tmp_path), "prefill", *pki.flags("pre"))
    d = start_daemon(str(tmp_path), "decode", "--transfer-mode", "push", *pki.flags("dec"))
    try:
        src, dec = Engine(p, "src", SHAPE, seed=3), Engine(d, "dec", SHAPE)
        src.hold("r1", [3, 4])
        dec.load("r1", [6, 7], src, [3, 4], "r1", timeout_s=20)
        assert event_kind(dec.wait("r1", 30)) == "recv_done"
        assert dec.same_blocks([6, 7], src, [3, 4])
        dec.close()
        src.close()
    finally:
        assert d.stop() == 0 and p.stop() == 0


def test_a_load_whose_session_ends_while_its_mode_is_decided_sends_no_push_order():
    """``auto`` may look a name up before it knows a load is a push; the
    session ending meanwhile (its engine has counted the load failed and
    may reuse the blocks) must leave the load with no order sent and
    nothing emitted."""
    seg = ShmSegment(SIZE)

    async def main():
        d = Node(Limits(transfer_mode="auto"))
        d.start()
        try:
            w = await d.register("D", 0, 1, LAYOUT, [Segment(seg.name, seg.size)], REGIONS, model="m")
            deciding, decide = asyncio.Event(), asyncio.Event()
            pushed, emitted = [], []

            async def slow_pushes(address):
                deciding.set()
                await decide.wait()
                return True

            async def record_push(*a, **k):
                pushed.append(a)

            d.pull.modes.pushes, d.pull.modes.fixed = slow_pushes, None  # decided by address, whatever this host has
            d.push_mode.load = record_push
            d.rt.emit = lambda w_, ev: emitted.append(ev)
            req = LoadRequest("r1", [[1]], "p", "192.0.2.7:7600", [[2]], "p1", timeout_s=10)
            task = asyncio.ensure_future(d.load(w, req))
            await asyncio.wait_for(deciding.wait(), 10)
            w.session.epoch += 1  # the session ends (as the engine service does at a stream's end)
            await d.pull.cancel(w)
            decide.set()
            await asyncio.wait_for(task, 10)
            return pushed, emitted, dict(w.pushes), dict(w.pending_loads)
        finally:
            await d.close()

    try:
        pushed, emitted, pushes, pending = asyncio.run(main())
    finally:
        seg.close()
    assert pushed == [] and emitted == [] and pushes == {} and pending == {}


def test_a_load_by_a_daemon_set_to_pull_asks_for_no_decision():
    """Where every load is a pull (``pull`` set, or ``auto`` with an RDMA
    device here) a load neither asks ``TransferModes.pushes`` nor makes a
    ``w.pushes`` entry: the per-load path stays as before ``auto``."""
    seg = ShmSegment(SIZE)

    async def main():
        d = Node(Limits(transfer_mode="pull"))
        d.start()
        try:
            w = await d.register("D", 0, 1, LAYOUT, [Segment(seg.name, seg.size)], REGIONS, model="m")
            asked, entries = [], []

            async def recording(address):
                asked.append(address)
                return False

            d.pull.modes.pushes = recording
            w.pushes = type("Watched", (dict,), {"__setitem__": lambda s, k, v: entries.append(k)})()
            failed = []
            d.rt.emit = lambda w_, ev: failed.append(ev)
            closed = socket.socket()
            closed.bind(("127.0.0.1", 0))  # bound, never listening: the pull's handshake is refused
            try:
                await d.load(w, LoadRequest("r1", [[1]], "p", f"127.0.0.1:{closed.getsockname()[1]}", [[2]], "p1",
                                            timeout_s=1))
            finally:
                closed.close()
            return asked, entries, failed
        finally:
            await d.close()

    try:
        asked, entries, failed = asyncio.run(main())
    finally:
        seg.close()
    assert asked == [] and entries == []
    assert [type(ev).__name__ for ev in failed] == ["LoadFailed"], failed


def test_a_replacement_under_way_serves_a_push_only_if_it_removes_the_agent_the_push_described():
    """``settle.stop_writes_into`` with a replacement of the worker's agent
    already under way (a READ's deadline, say): a push order described
    against the agent that replacement *made* (the order went out while the
    old agent was being destroyed) is stopped only by replacing that one in
    turn; an order against the old agent is stopped by the one under way.
    (A fake registry: the real replacement is what
    tests/test_reliability_tcp.py measures.)"""
    async def main(described: str) -> list[str]:
        w = SimpleNamespace(agent=SimpleNamespace(name="a1"))
        rt = SimpleNamespace(registered=lambda w_: True)
        replaced, switched = [], asyncio.Event()

        class Registry:
            async def replace_agent(self, w_, why):
                old = w_.agent.name
                w_.agent = SimpleNamespace(name=f"a{int(old[1:]) + 1}")  # as Registry._replace switches
                switched.set()
                await asyncio.sleep(0.05)  # the old agent's destruction
                replaced.append(old)
                return True

        registry = Registry()
        first = settle._start_replacing(registry, w, "a READ past its deadline")
        await switched.wait()
        assert await settle.stop_writes_into(rt, registry, w, "push past its deadline", {described}) is True
        await first
        return replaced

    assert asyncio.run(main("a2")) == ["a1", "a2"]
    assert asyncio.run(main("a1")) == ["a1"]
