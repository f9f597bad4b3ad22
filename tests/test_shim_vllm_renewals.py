"""The decode scheduler renews P's leases while a request waits to load
(``kvd.shim.vllm.renewals``; vLLM's NixlConnector heartbeats,
``nixl/base_scheduler.py`` ``on_new_request`` / ``_stop_heartbeat``).

First :class:`LeaseRenewals` alone, with a fake clock and a recorded
``send`` (and once with two real daemons, P's refusing a call past its
``max_blocks_per_request``); then inside vLLM 0.32's real scheduler against the fake daemon
(``tests/vllm_inproc.py``): renewals go out while the request waits for its
blocks and stop when it loads or is aborted. ``tests/test_lease_renewal.py``
runs the daemon side for real.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

if os.environ.get("KVD_SKIP_VLLM") == "1":
    pytest.skip("KVD_SKIP_VLLM=1", allow_module_level=True)
pytest.importorskip("vllm")

import grpc  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvd.client import EngineClientError  # noqa: E402
from kvd.requests import MAX_RENEWALS_PER_CALL, RenewResult  # noqa: E402
from kvd.shim.vllm.renewals import FIRST_UNKNOWN_S, MIN_INTERVAL_S, RETRY_S, LeaseRenewals  # noqa: E402
from vllm_inproc import Engine, make_request, remote_params  # noqa: E402


def params(remote_rid: str, engine: str = "engine-p", port: int = 7500, blocks=(40, 41), expiry=None) -> dict:
    return remote_params({
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(blocks)],
        "remote_engine_id": engine, "remote_request_id": remote_rid, "remote_host": "10.9.9.9",
        "remote_port": port, "tp_size": 1, "remote_blocks_expiry_time": expiry,
    })


class Recorder:
    """A ``send`` that records each call and leaves its future to the test."""

    def __init__(self):
        self.calls: list[tuple[str, str, list, Future]] = []

    def __call__(self, engine_id, address, renewals):
        f: Future = Future()
        self.calls.append((engine_id, address, renewals, f))
        return f

    def answer(self, i: int, left_s: float = 3.0, not_held=()):
        _, _, renewals, f = self.calls[i]
        f.set_result([RenewResult(r.request_id, 0.0, "not_held") if r.request_id in not_held
                      else RenewResult(r.request_id, left_s) for r in renewals])


@pytest.fixture
def clock():
    return SimpleNamespace(now=100.0)


def renewer(clock, rec, wall=1000.0) -> LeaseRenewals:
    return LeaseRenewals(rec, clock=lambda: clock.now, wall=lambda: wall)


def req(rid: str, tokens: int = 4096) -> SimpleNamespace:
    """A stand-in of vLLM's ``Request``: what ``LeaseRenewals.track`` reads."""
    return SimpleNamespace(request_id=rid, num_prompt_tokens=tokens)


def test_one_call_per_prefill_engine_when_due_then_a_third_of_the_lease_left(clock):
    rec = Recorder()
    r = renewer(clock, rec)
    r.track(req("d1"), params("p1"))
    r.track(req("d2"), params("p2"))
    r.track(req("d3"), params("p3", engine="engine-q", port=7600))
    assert r.poll() == 0 and not rec.calls  # nothing due before FIRST_UNKNOWN_S
    clock.now += FIRST_UNKNOWN_S
    assert r.poll() == 2
    by_engine = {(e, a): [x.request_id for x in rs] for e, a, rs, _ in rec.calls}
    assert by_engine == {("engine-p", "10.9.9.9:7500"): ["p1", "p2"], ("engine-q", "10.9.9.9:7600"): ["p3"]}
    assert rec.calls[0][2][0].groups == [[40, 41]]
    assert r.poll() == 0  # answers not in yet: no second call
    rec.answer(0, left_s=3.0)
    rec.answer(1, left_s=6.0)
    assert r.poll() == 0
    clock.now += 1.0 - 0.01
    assert r.poll() == 0
    clock.now += 0.01  # a third of 3 s since the answers
    assert r.poll() == 1 and rec.calls[2][0] == "engine-p"
    clock.now += 1.0
    assert r.poll() == 1 and rec.calls[3][0] == "engine-q"  # a third of 6 s


def test_the_first_renewal_follows_p_s_expiry_time_when_p_sent_one(clock):
    rec = Recorder()
    r = renewer(clock, rec, wall=1000.0)
    r.track(req("d1"), params("p1", expiry=1000.0 + 0.9))  # a 0.9 s lease left: first renewal at 0.3 s
    clock.now += 0.3
    assert r.poll() == 1


def test_stops_on_request_and_after_the_lease_is_gone_but_not_before_p_held_it(clock):
    rec = Recorder()
    r = renewer(clock, rec)
    for i in range(3):
        r.track(req(f"d{i}"), params(f"p{i}"))
    r.stop("d2")
    r.stop("unknown")  # a no-op
    clock.now += FIRST_UNKNOWN_S
    r.poll()
    assert [x.request_id for x in rec.calls[0][2]] == ["p0", "p1"]
    rec.answer(0, left_s=0.9, not_held={"p1"})  # p1's hold not at P yet: kept
    assert r.poll() == 0  # takes the answer: next in a third of 0.9 s
    clock.now += 0.3
    assert r.poll() == 1
    assert [x.request_id for x in rec.calls[1][2]] == ["p0", "p1"]
    rec.answer(1, left_s=0.9, not_held={"p0"})  # p0 was renewed before: its lease is gone
    assert r.poll() == 0
    clock.now += 0.3
    assert r.poll() == 1
    assert [x.request_id for x in rec.calls[2][2]] == ["p1"] and len(r) == 1
    r.stop("d1")
    rec.answer(2)
    clock.now += 10
    assert r.poll() == 0 and len(r) == 0 and not r._remotes


def test_large_batches_are_split_and_a_failed_call_is_retried(clock, caplog):
    rec = Recorder()
    r = renewer(clock, rec)
    n = 2 * MAX_RENEWALS_PER_CALL + 1
    for i in range(n):
        r.track(req(f"d{i}"), params(f"p{i}"))
    clock.now += FIRST_UNKNOWN_S
    assert r.poll() == 3
    assert [len(c[2]) for c in rec.calls] == [MAX_RENEWALS_PER_CALL, MAX_RENEWALS_PER_CALL, 1]
    for i in range(3):
        rec.calls[i][3].set_exception(RuntimeError("daemon away"))
    caplog.set_level("WARNING", logger="kvd.shim.vllm")
    assert r.poll() == 0
    assert sum("daemon away" in m for m in caplog.messages) == 1  # once per failing engine
    clock.now += RETRY_S
    assert r.poll() == 3


def test_a_request_that_loads_soon_is_never_read_and_a_late_poll_keeps_the_arrival_time(clock, caplog):
    """``track`` only notes the request: one stopped within MIN_INTERVAL_S
    (it loaded) never has its params read; one read later counts its first
    renewal from when it arrived, and bad block ids are logged then."""
    rec = Recorder()
    r = renewer(clock, rec)
    bad = params("p-bad")
    bad["remote_block_ids"] = [["x"]]
    r.track(req("d-quick"), bad)
    assert len(r) == 1
    clock.now += MIN_INTERVAL_S / 2
    assert r.poll() == 0 and len(r) == 1
    r.stop("d-quick")
    caplog.set_level("WARNING", logger="kvd.shim.vllm")
    clock.now += 10
    assert r.poll() == 0 and len(r) == 0 and not caplog.messages  # never read
    r.track(req("d-bad"), bad)
    r.track(req("d1"), params("p1"))
    clock.now += FIRST_UNKNOWN_S  # the first poll after it arrived is already past its first renewal
    assert r.poll() == 1 and [x.request_id for x in rec.calls[0][2]] == ["p1"]
    assert len(r) == 1 and any("request=d-bad" in m and "remote_block_ids" in m for m in caplog.messages)
    r.track(req("d1"), params("p1-again"))  # tracked again: its old renewals stop
    rec.answer(0)
    clock.now += FIRST_UNKNOWN_S
    assert r.poll() == 1 and [x.request_id for x in rec.calls[1][2]] == ["p1-again"]


@pytest.mark.parametrize("field,value", [
    ("remote_port", "abc"), ("remote_port", 0), ("tp_size", "x"), ("remote_block_ids", 5),
    ("remote_block_ids", [[-1]]), ("remote_block_ids", [[1 << 40]]), ("remote_block_ids", [[1]] * 257),
    ("remote_request_id", "x" * 1025), ("remote_request_id", ""), ("remote_request_id", "\ud800"),
    ("remote_block_ids", [list(range(5000))]),
], ids=["port-text", "port-0", "tp-text", "ids-int", "negative-id", "id-past-uint32", "257-groups", "long-id",
        "empty-id", "lone-surrogate", "ids-past-the-prompt"])
def test_a_request_whose_renewal_cannot_go_is_logged_and_holds_back_no_other(clock, caplog, field, value):
    """A request waiting past MIN_INTERVAL_S whose params name no P a
    renewal could reach, or a renewal the daemon would refuse whole (or
    protobuf would not encode): they come in the API request
    (``kvd.shim.vllm.params``). It is logged and not renewed, the poll (on
    vLLM's engine step) does not raise, and the other requests of the same
    prefill engine are renewed: their renewals go in one call. Before, such
    a request raised out of the poll, or kept every request of its prefill
    engine unrenewed, the call failing again each second, until their
    leases ran out."""
    rec = Recorder()
    r = renewer(clock, rec)
    bad = params("p-bad")
    bad[field] = value
    caplog.set_level("WARNING", logger="kvd.shim.vllm")
    r.track(req("d-bad"), bad)
    r.track(req("d1"), params("p1"))
    clock.now += FIRST_UNKNOWN_S
    assert r.poll() == 1 and [x.request_id for x in rec.calls[0][2]] == ["p1"]
    assert any("request=d-bad" in m and field in m and "not renewed" in m for m in caplog.messages), caplog.messages


def test_block_ids_for_more_groups_than_the_engine_has_are_not_converted_for_renewals(clock, caplog):
    """Renewals take no more KV-cache groups than the engine transfers (the
    scheduler gives its count): an API request naming 256 groups of the
    prompt's size fails its load (checked by length), and its renewals
    converted every id on the step and sent them to P each second
    (attacker review: 260k ids for a 1,000-token prompt, ~90 ms a poll)."""
    rec = Recorder()
    r = LeaseRenewals(rec, max_groups=1, clock=lambda: clock.now, wall=lambda: 1000.0)
    caplog.set_level("WARNING", logger="kvd.shim.vllm")
    bad = params("p-bad")
    bad["remote_block_ids"] = [[40, 41]] * 256
    r.track(req("d-bad"), bad)
    r.track(req("d1"), params("p1"))
    clock.now += FIRST_UNKNOWN_S
    assert r.poll() == 1 and [x.request_id for x in rec.calls[0][2]] == ["p1"]
    assert any("d-bad" in m and "256 KV-cache groups, more than 1" in m for m in caplog.messages), caplog.messages


def test_a_batch_the_client_cannot_encode_leaves_the_other_batches_to_go(clock, caplog):
    """A send that raises ValueError (protobuf refusing an argument) drops
    that batch's requests, and the other prefill engines' batches still go;
    before, the poll stopped there and retried every second."""
    sent = []

    def send(engine_id, address, renewals):
        if engine_id == "engine-bad":
            raise ValueError("Value out of range")
        sent.append(engine_id)
        return Future()

    r = renewer(clock, send)
    caplog.set_level("WARNING", logger="kvd.shim.vllm")
    r.track(req("d-bad"), params("p-bad", engine="engine-bad"))
    r.track(req("d1"), params("p1", engine="engine-q"))
    clock.now += FIRST_UNKNOWN_S
    assert r.poll() == 1 and sent == ["engine-q"]
    assert len(r) == 1 and any("not renewed" in m and "d-bad" in m for m in caplog.messages)


class BoundedP:
    """A ``send`` answering as a prefill daemon of ``max_blocks`` block ids a
    call (its ``max_blocks_per_request``) would, through the local daemon:
    a call past it is refused whole with INVALID_ARGUMENT (as
    ``EngineClient.renew_leases`` gives it), any other renews every request
    in it. Futures are answered at once; ``calls`` records the remote
    request ids of each call and whether it was refused."""

    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        self.calls: list[tuple[list[str], bool]] = []

    def __call__(self, engine_id, address, renewals):
        f: Future = Future()
        n = sum(len(g) for r in renewals for g in r.groups)
        refused = n > self.max_blocks
        self.calls.append(([r.request_id for r in renewals], refused))
        if refused:
            f.set_exception(EngineClientError(
                f"RenewLeases to kvd at unix:x failed: INVALID_ARGUMENT: {address}: INVALID_ARGUMENT: renew: {n} "
                f"block ids in one call, more than {self.max_blocks}", grpc.StatusCode.INVALID_ARGUMENT))
        else:
            f.set_result([RenewResult(r.request_id, 30.0) for r in renewals])
        return f

    def renewed(self) -> set[str]:
        return {rid for ids, refused in self.calls if not refused for rid in ids}


def test_a_call_refused_as_invalid_is_split_until_the_request_past_p_s_bound_is_alone(clock, caplog):
    """P's daemon refuses a call past its ``max_blocks_per_request`` whole
    (INVALID_ARGUMENT); one API request's ``remote_block_ids`` can be what
    is past it. The calls to that engine get smaller (half the refused
    call's ids) until that request is alone: its renewals stop (a warning
    with the reason), every other request of that prefill engine is
    renewed, the poll never raises, and the next round of renewals goes in
    a few calls, none refused. Before, the same call was retried each
    second and no request was renewed."""
    p = BoundedP(max_blocks=50)
    r = renewer(clock, p)
    caplog.set_level("WARNING", logger="kvd.shim.vllm")
    small = [f"d{i}" for i in range(9)]
    for i, rid in enumerate(small):
        r.track(req(rid), params(f"p{i}"))
        if i == 4:
            r.track(req("d-big"), params("p-big", blocks=range(100, 200)))
    clock.now += FIRST_UNKNOWN_S
    for _ in range(10):  # each poll takes the refusals and sends the smaller calls at once
        r.poll()
    assert p.calls[0] == ([f"p{i}" for i in range(5)] + ["p-big"] + [f"p{i}" for i in range(5, 9)], True)
    assert p.renewed() == {f"p{i}" for i in range(9)}
    assert len(r) == 9 and "d-big" not in r._of
    warned = [m for m in caplog.messages if "d-big" in m]
    assert len(warned) == 1 and "refused" in warned[0] and "more than 50" in warned[0], caplog.messages
    assert (["p-big"], True) in p.calls  # stopped only once refused alone
    n = len(p.calls)
    clock.now += 10.0  # a third of the 30 s left
    r.poll()
    later = p.calls[n:]
    assert later and not any(refused for _, refused in later)
    assert sorted(rid for ids, _ in later for rid in ids) == sorted(f"p{i}" for i in range(9))
    assert len(later) <= 4, later  # not one call a request


def test_many_requests_past_p_s_bound_cost_a_few_calls_each_once_and_none_later(clock):
    """An API client's requests past P's bound among innocent ones (each
    names P's real engine): each costs a few refused calls once, then the
    innocent ones go in as few calls as P's bound allows, none refused.
    Before, each refused call's halves stayed calls of their own: 256
    innocent requests with 128 such ones went in 192 calls every renewal
    (attacker review), against 1 without them."""
    p = BoundedP(max_blocks=1000)
    r = renewer(clock, p)
    hostile = 0
    for i in range(256):
        r.track(req(f"g{i}"), params(f"pg{i}"))
        if i % 2 == 0:
            r.track(req(f"b{hostile}"), params(f"pb{hostile}", blocks=range(1001)))
            hostile += 1
    clock.now += FIRST_UNKNOWN_S
    for _ in range(20):
        r.poll()
    assert len(r) == 256 and p.renewed() == {f"pg{i}" for i in range(256)}
    assert len(p.calls) <= 4 * hostile, len(p.calls)
    n = len(p.calls)
    clock.now += 10.0
    r.poll()
    later = p.calls[n:]
    assert not any(refused for _, refused in later) and len(later) <= 2, later  # 512 ids: 1 or 2 calls


def test_requests_past_p_s_bound_only_together_are_split_and_stay_so(clock):
    """Two requests each within P's bound, past it together: split once,
    both renewed, and their next renewals go in calls that P takes (the
    split is kept), not refused again each time."""
    p = BoundedP(max_blocks=3)
    r = renewer(clock, p)
    r.track(req("d1"), params("p1", blocks=(1, 2)))
    r.track(req("d2"), params("p2", blocks=(3, 4)))
    clock.now += FIRST_UNKNOWN_S
    r.poll()
    r.poll()
    assert p.calls == [(["p1", "p2"], True), (["p1"], False), (["p2"], False)]
    assert len(r) == 2
    for _ in range(3):
        r.poll()  # takes the answers: the next renewal is due in a third of the 30 s left
        clock.now += 10.0
        r.poll()
    assert p.calls[3:] == [(["p1"], False), (["p2"], False)] * 3


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.NOT_FOUND])
def test_a_call_that_failed_otherwise_is_retried_whole(clock, code):
    """Only INVALID_ARGUMENT splits a call: P unreachable, a deadline, or an
    engine not (yet) at P are retried as they were, every RETRY_S, with no
    request stopped."""
    rec = Recorder()
    r = renewer(clock, rec)
    r.track(req("d1"), params("p1"))
    r.track(req("d2"), params("p2"))
    clock.now += FIRST_UNKNOWN_S
    assert r.poll() == 1
    rec.calls[0][3].set_exception(EngineClientError(f"RenewLeases failed: {code.name}", code))
    assert r.poll() == 0
    clock.now += RETRY_S
    assert r.poll() == 1 and [x.request_id for x in rec.calls[1][2]] == ["p1", "p2"] and len(r) == 2


def test_a_request_past_a_real_prefill_daemon_s_bound_does_not_hold_back_the_other(tmp_path, caplog):
    """Two real daemons, P's with ``--max-blocks-per-request 16``: the shim's
    renewals (the real ``EngineClient.renew_leases`` to the decode daemon,
    ``PeerService.Renew`` to P's) of a held request of 2 blocks and an API
    client's request naming 20 go in one call, which P refuses whole; the
    decode daemon passes INVALID_ARGUMENT on, the call is split, and the
    held request's lease is renewed (P counts the renewal), while the other
    is stopped."""
    from kvd.addresses import split_host_port
    from kvd.client import EngineClient
    from kvd.testing.daemons import start_daemons, stop_daemons
    from kvd.testing.sessions import Engine as PEngine
    from kvd.testing.sessions import KvShape
    from kvd.testing.util import wait_until

    p, d = start_daemons((str(tmp_path), "prefill", "--max-blocks-per-request", "16"), (str(tmp_path), "decode"))
    src = client = None
    try:
        src = PEngine(p, "renew-bound-p", KvShape(num_layers=2, num_blocks=64, block_len=1024))
        client = EngineClient(d.socket)
        src.hold("p-small", [1, 2], lease_s=60.0)
        wait_until(lambda: p.stats().active_leases == 1, 10, "the hold at P")
        host, port = split_host_port(src.peer_address)
        r = LeaseRenewals(client.renew_leases)
        caplog.set_level("WARNING", logger="kvd.shim.vllm")

        def at_p(remote_rid, blocks):
            return {**params(remote_rid, engine=src.engine_id, port=port, blocks=blocks), "remote_host": host}

        r.track(req("d-small"), at_p("p-small", (1, 2)))
        r.track(req("d-big"), at_p("p-big", range(20)))
        before = p.stats().leases_renewed

        def renewed() -> bool:
            r.poll()
            return p.stats().leases_renewed > before

        wait_until(renewed, 60, "the small request's lease renewed")
        wait_until(lambda: r.poll() is not None and "d-big" not in r._of, 60, "the big request stopped")
        assert "d-small" in r._of and len(r) == 1
        (line,) = [m for m in caplog.messages if "d-big" in m]
        assert "INVALID_ARGUMENT" in line and "16" in line, line
    finally:
        if client is not None:
            client.close()
        if src is not None:
            src.close()
        stop_daemons([p, d])


# ------------------------------------------------------- inside vLLM's scheduler
def test_a_waiting_request_renews_until_it_is_aborted(model_dir, tmp_path):
    """The fake daemon never answers the load: the request waits for its
    remote KV, renewals go out at a third of the lease left (0.9 s -> every
    0.3 s); aborting it stops them."""
    from kvd.testing.fakes import FakeDaemon

    fake = FakeDaemon(str(tmp_path / "e.sock"), load_mode="never").start()
    eng = Engine(model_dir, fake.socket, role="kv_consumer")
    try:
        r = make_request(list(range(500, 564)), params("p-wait", expiry=time.time() + 0.9))
        eng.sched.add_request(r)
        eng.step()
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        t0 = time.monotonic()
        while len(fake.service.renewals) < 3:
            assert time.monotonic() - t0 < 30, "no renewals while the request waits"
            eng.step()
            time.sleep(0.02)
        (call,) = {tuple(x) for x in fake.service.renewed_ids()}
        assert call == ("p-wait",)
        req0 = fake.service.renewals[0]
        assert (req0.remote_engine_id, req0.remote_address) == ("engine-p", "10.9.9.9:7500")
        assert [list(g.ids) for g in req0.renewals[0].groups] == [[40, 41]]
        eng.sched.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
        eng.step()
        seen = len(fake.service.renewals)
        for _ in range(40):  # > 1 s of steps: several intervals
            eng.step()
            time.sleep(0.03)
        assert len(fake.service.renewals) <= seen + 1  # one still in flight at the abort, no more
        assert len(eng.connector.scheduler.renewals) == 0
    finally:
        eng.close()
        fake.close()


def test_renewals_stop_once_the_blocks_are_received(model_dir, tmp_path):
    """The fake daemon answers the load after 1.5 s: renewals meanwhile,
    none after vLLM sees the receive (``update_connector_output``)."""
    from kvd.testing.fakes import FakeDaemon

    fake = FakeDaemon(str(tmp_path / "e.sock"), delay_s=1.5).start()
    eng = Engine(model_dir, fake.socket, role="kv_consumer")
    try:
        r = make_request(list(range(600, 664)), params("p-load", expiry=time.time() + 0.9))
        eng.sched.add_request(r)
        eng.run_until(lambda: eng.finished(r.request_id) is not None, timeout_s=30)
        seen = len(fake.service.renewals)
        assert seen >= 1, "no renewal while the load took 1.5 s"
        assert len(eng.connector.scheduler.renewals) == 0
        for _ in range(30):
            eng.step()
            time.sleep(0.03)
        assert len(fake.service.renewals) == seen
    finally:
        eng.close()
        fake.close()
