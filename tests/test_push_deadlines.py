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
import time
from types import SimpleNamespace

from kvd.core import settle
from kvd.core.limits import Limits
from kvd.core.node import Node
from kvd.core.events import InvalidArgument, NotFound, PeerBusy, PeerUnavailable, WriteEnded
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


def _on_a_decode_worker(mode: str, body):
    """Runs ``await body(d, w)``: an in-process ``Node`` ``d`` with
    ``transfer_mode`` ``mode`` and one registered decode worker ``w`` (the
    tiny layout of ``kvd.testing.nixl_peer``); returns what ``body`` does."""
    seg = ShmSegment(SIZE)

    async def main():
        d = Node(Limits(transfer_mode=mode))
        d.start()
        try:
            w = await d.register("D", 0, 1, LAYOUT, [Segment(seg.name, seg.size)], REGIONS, model="m")
            return await body(d, w)
        finally:
            await d.close()

    try:
        return asyncio.run(main())
    finally:
        seg.close()


def test_a_load_whose_session_ends_while_its_mode_is_decided_sends_no_push_order():
    """``auto`` may look a name up before it knows a load is a push; the
    session ending meanwhile (its engine has counted the load failed and
    may reuse the blocks) must leave the load with no order sent and
    nothing emitted."""
    async def main(d, w):
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

    pushed, emitted, pushes, pending = _on_a_decode_worker("auto", main)
    assert pushed == [] and emitted == [] and pushes == {} and pending == {}


def test_a_load_by_a_daemon_set_to_pull_asks_for_no_decision():
    """With ``pull`` set a load neither asks ``TransferModes.pushes`` nor
    makes a ``w.pushes`` entry: the per-load path stays as before ``auto``.
    (Under ``auto`` even a host with RDMA asks: a source's handshake may
    say its READs are TCP's.)"""
    async def main(d, w):
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

    asked, entries, failed = _on_a_decode_worker("pull", main)
    assert asked == [] and entries == []
    assert [type(ev).__name__ for ev in failed] == ["LoadFailed"], failed


class _Replacements:
    """A fake ``Registry.replace_agent``: switches the worker's agent (as
    ``Registry._replace`` does), then takes 50 ms to destroy the old one,
    which fails (``result`` False) where ``fails`` names it."""

    def __init__(self, fails=()):
        self.replaced, self.switched, self.fails = [], asyncio.Event(), set(fails)

    async def replace_agent(self, w, why):
        old = w.agent.name
        w.agent = SimpleNamespace(name=f"a{int(old[1:]) + 1}")
        self.switched.set()
        await asyncio.sleep(0.05)
        self.replaced.append(old)
        if old in self.fails:
            w.mem.lingering[old] = SimpleNamespace(name=old)
            return False
        return True


def _worker(name="a1"):
    return SimpleNamespace(agent=SimpleNamespace(name=name), mem=SimpleNamespace(lingering={}))


RT = SimpleNamespace(registered=lambda w: True)


def test_a_replacement_under_way_serves_a_push_only_if_it_removes_the_agent_the_push_described():
    """``settle.stop_writes_into`` with a replacement of the worker's agent
    already under way (a READ's deadline, say): a push order described
    against the agent that replacement *made* (the order went out while the
    old agent was being destroyed) is stopped only by replacing that one in
    turn; an order against the old agent is stopped by the one under way.
    (A fake registry: the real replacement is what
    tests/test_reliability_tcp.py measures.)"""
    async def main(described: str) -> list[str]:
        w, registry = _worker(), _Replacements()
        first = settle._start_replacing(registry, w, "a READ past its deadline")
        await registry.switched.wait()
        assert await settle.stop_writes_into(RT, registry, w, "push past its deadline", {described}) is True
        await first
        return registry.replaced

    assert asyncio.run(main("a2")) == ["a1", "a2"]
    assert asyncio.run(main("a1")) == ["a1"]


def test_an_ended_replacement_not_yet_forgotten_does_not_freeze_the_loop():
    """A replacement task stays in ``settle._replacing`` until its
    done-callback runs, a loop step after it ended. Found by an attacker
    review: a caller in that step awaited the ended task (which does not
    yield), found it again, and so on for ever, the event loop frozen."""
    import threading

    got = []

    async def main():
        w, registry = _worker(), _Replacements()
        ended = asyncio.get_running_loop().create_future()
        ended.set_result(True)
        settle._replacing[id(w)] = ended  # ended, its callback not run yet
        try:
            got.append(await settle.stop_writes_into(RT, registry, w, "push past its deadline", {"a1"}))
            got.append(registry.replaced)
        finally:
            settle._replacing.pop(id(w), None)

    t = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "stop_writes_into spun on an ended replacement"
    assert got == [True, ["a1"]]


def test_a_replacement_that_could_not_destroy_an_agent_a_push_described_is_no_stop():
    """``Registry.replace_agent`` returns False when the old agent could not
    be destroyed (a handle still bound): a WRITE through it may still land,
    and ``stop_writes_into`` says so only when the push described that
    agent; one that failed for another agent is not this push's."""
    async def main(described: str, fails: set[str], finished_first: bool):
        w, registry = _worker(), _Replacements(fails)
        first = settle._start_replacing(registry, w, "a READ past its deadline")
        await (first if finished_first else registry.switched.wait())
        stopped = await settle.stop_writes_into(RT, registry, w, "push past its deadline", {described})
        await first
        return stopped, registry.replaced

    assert asyncio.run(main("a1", {"a1"}, True)) == (False, ["a1"])   # the one it described lingers
    assert asyncio.run(main("a1", {"a1"}, False)) == (False, ["a1"])
    assert asyncio.run(main("a2", {"a1"}, False)) == (True, ["a1", "a2"])  # the old one's failure is not its
    assert asyncio.run(main("a2", {"a2"}, True)) == (False, ["a1", "a2"])


class _Link:
    """A fake ``PeerClient`` for ``Push.load``: each rank's Push answers
    after ``delay_s[rank]`` with a result, or raises ``error[rank]``."""

    def __init__(self, delay_s, error):
        self.delay_s, self.error, self.sent_at = delay_s, error, {}

    async def push(self, address, order, timeout_s):
        order.sent = True
        self.sent_at[order.tp_rank] = time.monotonic()
        await asyncio.sleep(self.delay_s.get(order.tp_rank, 0))
        if order.tp_rank in self.error:
            raise self.error[order.tp_rank]
        return SimpleNamespace(bytes=4096, num_descriptors=1)

    claim_s = 0.2  # until the hold shows up

    async def claim(self, *a, **k):
        await asyncio.sleep(self.claim_s)


def _push_load(link, remote_tp=2, linger_s=0.0):
    """Runs ``Push.load`` of one block from a source of ``remote_tp`` ranks
    through ``link``, and lets the loop run ``linger_s`` more; returns
    ``(failure, seconds it took, the orders, when it returned)``."""
    async def main(d, w):
        d.peers.link = link
        d.rt.emit = lambda w_, ev: None
        req = LoadRequest("r1", [[1]], "p", "192.0.2.7:7600", [[2]], "p1", timeout_s=10, remote_tp_size=remote_tp)
        w.pushes["r1"] = []
        t0 = time.monotonic()
        failure = await d.push_mode.load(w, req, remote_tp, list(range(remote_tp)), list(range(remote_tp)), t0,
                                         t0 + 10, w.session.epoch)
        took, returned = time.monotonic() - t0, time.monotonic()
        await asyncio.sleep(linger_s)  # what a sibling left running would do meanwhile
        return failure, took, w.pushes["r1"], returned

    return _on_a_decode_worker("push", main)


def test_a_rank_refused_waits_for_the_other_ranks_writes_before_the_load_fails():
    """Source TP 2, rank 1 refuses at once (InvalidArgument) while rank 0's
    WRITE takes 300 ms. Found by an attacker review: the load failed at
    once and rank 0's WRITE went on landing for 300 ms in blocks vLLM was
    told failed. Now the load fails once rank 0 has answered, and no order
    is unanswered (so no agent replacement is needed)."""
    failure, took, orders, _ = _push_load(_Link({0: 0.3}, {1: InvalidArgument("block ids out of range")}))
    assert failure is not None and "block ids out of range" in failure[1]
    assert took >= 0.3, took
    assert [(o.tp_rank, o.sent, o.settled) for o in orders] == [(0, True, True), (1, True, True)]


def test_no_order_goes_out_after_another_rank_failed():
    """Rank 0's hold is not there yet (NotFound: it claims, then asks again
    200 ms later); rank 1 refuses meanwhile. Found by an attacker review:
    rank 0's second order went out 200 ms after the load had failed."""
    link = _Link({}, {1: InvalidArgument("no")})
    calls = []
    first = link.push

    async def push(address, order, timeout_s):
        calls.append(order.tp_rank)
        if order.tp_rank == 0 and calls.count(0) == 1:
            order.sent = True
            raise NotFound("no hold yet")
        return await first(address, order, timeout_s)

    link.push = push
    failure, took, orders, _ = _push_load(link, linger_s=0.5)
    assert failure is not None and calls.count(0) == 1, calls


def test_an_order_whose_answer_leaves_its_write_unknown_is_stopped():
    """A rank whose Push ended UNAVAILABLE (a cut, the source's WRITE
    failed or past its deadline) after its order went out leaves the WRITE
    unknown: its agent is one ``Pull._pushed`` stops
    (``PushOrder.settled`` False); a refusal is not."""
    failure, _, orders, _ = _push_load(_Link({}, {0: PeerUnavailable("cut"), 1: InvalidArgument("no")}))
    assert failure is not None
    assert {o.tp_rank: (o.sent, o.settled) for o in orders} == {0: (True, False), 1: (True, True)}


def test_a_rank_waiting_for_its_hold_is_dropped_when_another_rank_failed():
    """Rank 0's hold is not there (its claim would wait 20 s); rank 1
    refuses. Rank 0 has no order out, so nothing of it can land: the load
    fails at once rather than at its deadline, and rank 0 sends nothing."""
    link = _Link({}, {1: InvalidArgument("no")})
    link.claim_s = 20
    calls = []
    first = link.push

    async def push(address, order, timeout_s):
        calls.append(order.tp_rank)
        if order.tp_rank == 0:
            raise NotFound("no hold yet")  # refused before anything was sent
        return await first(address, order, timeout_s)

    link.push = push
    failure, took, orders, _ = _push_load(link, linger_s=0.3)
    assert failure is not None and took < 5, took
    assert calls.count(0) == 1 and not orders[0].sent


def test_a_source_that_says_its_write_ended_or_that_it_had_no_room_needs_no_stop():
    """ABORTED (``WriteEnded``: the WRITE failed and has ended, or none was
    posted) and RESOURCE_EXHAUSTED (``PeerBusy``) answers settle their
    order: a replacement of the reader's agent would only cost its other
    transfers. (An attacker review found RESOURCE_EXHAUSTED read as
    UNAVAILABLE, and every busy source replacing readers' agents.)"""
    failure, _, orders, _ = _push_load(_Link({}, {0: WriteEnded("WRITE ERR"), 1: PeerBusy("no room")}))
    assert failure is not None and [(o.sent, o.settled) for o in orders] == [(True, True), (True, True)]


def test_a_rank_failing_with_an_unforeseen_error_still_leaves_the_unanswered_write_to_stop():
    """Rank 1 fails with an error no branch foresaw (a bug); rank 0's order
    went out and its call ended UNAVAILABLE. The load fails as ``internal``
    (returned, not raised, so that ``Pull._pushed`` stops rank 0's WRITE;
    an attacker review found the raise skipped that)."""
    failure, _, orders, _ = _push_load(_Link({0: 0.1}, {0: PeerUnavailable("cut"), 1: RuntimeError("a bug")}))
    assert failure is not None and failure[1].startswith("internal: RuntimeError"), failure
    assert {o.tp_rank: (o.sent, o.settled) for o in orders} == {0: (True, False), 1: (True, False)}


def test_the_peer_client_tells_an_ended_write_and_a_busy_peer_from_an_unknown_outcome():
    import grpc

    from kvd.daemon.convert import status_of
    from kvd.daemon.peer_client import _error

    class Answer(grpc.aio.AioRpcError):
        def __init__(self, code):
            super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")

    assert type(_error("a:1", Answer(grpc.StatusCode.ABORTED))) is WriteEnded
    assert type(_error("a:1", Answer(grpc.StatusCode.RESOURCE_EXHAUSTED))) is PeerBusy
    assert type(_error("a:1", Answer(grpc.StatusCode.UNAVAILABLE))) is PeerUnavailable
    assert isinstance(_error("a:1", Answer(grpc.StatusCode.ABORTED)), PeerUnavailable)  # callers of before
    assert status_of(WriteEnded("x")) == grpc.StatusCode.ABORTED
