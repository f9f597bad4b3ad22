"""Calls to a peer address that did not answer wait for a probe of it, one
at a time (``kvd.daemon.unreachable``), and ``PeerClient`` gates its calls
by it.

The gate alone with fake calls and probes, then ``PeerClient`` against a
real gRPC server that answers UNAVAILABLE with its health NOT_SERVING (as
a draining daemon does), then serves, and against an address that refuses.
Contacts with addresses that never answered take turns
(``FirstContacts``), alone and through ``PeerClient``. The daemon-level
floods from a dead prefill node (one address, and a new one each load) are
in ``tests/test_reliability_peers.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer

from kvd.core.events import PeerUnavailable
from kvd.daemon.peer_auth import PeerAuth
from kvd.daemon.peer_client import PeerClient
from kvd.daemon.unreachable import ANSWERED, NO_OUTCOME, PROBE_GAP_S, FirstContacts, Unreachable
from kvd.testing.fakes import closed_address
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc


class _Fake:
    """A pretend peer behind a gate: ``up`` says how it answers calls and
    probes; counts the calls and probes made and the most in flight."""

    def __init__(self, delay_s: float = 0.01):
        self.delay_s = delay_s
        self.gate = Unreachable(self.probe)
        self.up, self.calls, self.now, self.most = False, 0, 0, 0

    async def _reach(self) -> None:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.now -= 1

    async def probe(self, address: str, timeout_s: float) -> str:
        try:
            await asyncio.wait_for(self._reach(), timeout_s)
        except TimeoutError:
            return NO_OUTCOME
        return ANSWERED if self.up else f"{address}: UNAVAILABLE: refused"

    async def call(self, address: str = "p:1", timeout_s: float = 5.0) -> str:
        await self.gate.admit(address, timeout_s)
        self.calls += 1
        await self._reach()
        if not self.up:
            self.gate.failed(address)
            raise PeerUnavailable(f"{address}: UNAVAILABLE: refused", transient=True)
        self.gate.answered(address)
        return "ok"


def test_after_an_unavailable_call_one_probe_at_a_time_goes_and_its_failure_is_shared():
    async def main():
        fake = _Fake()
        gate = fake.gate
        # Not marked: calls go at once, all of them.
        got = await asyncio.gather(*(fake.call() for _ in range(10)), return_exceptions=True)
        assert all(isinstance(g, PeerUnavailable) for g in got) and fake.calls == 10 and fake.most == 10
        assert "p:1" in gate and gate.probes == 0
        # Marked: one probe goes; the callers wait for it and fail with its error, sending nothing.
        fake.calls = fake.most = 0
        got = await asyncio.gather(*(fake.call() for _ in range(200)), return_exceptions=True)
        assert all(isinstance(g, PeerUnavailable) and g.transient for g in got), got[:3]
        assert fake.calls == 0 and gate.probes == 1 and fake.most == 1, (fake.calls, gate.probes, fake.most)
        shared = [g for g in got if "not sent again" in str(g)]
        assert len(shared) == 199 and gate.not_sent == 200
        assert str(shared[0]).startswith("p:1: UNAVAILABLE: refused (not sent again")
        # Another address is not held up by this one.
        fake.up = True
        assert await fake.call("q:2") == "ok" and "q:2" not in gate

    asyncio.run(main())


def test_a_peer_that_answers_again_is_unmarked_and_its_callers_all_go_at_once():
    async def main():
        fake = _Fake()
        with pytest.raises(PeerUnavailable):
            await fake.call()
        fake.up = True  # it came back: the next probe finds it, no timer waited for
        fake.calls = fake.most = 0
        got = await asyncio.gather(*(fake.call() for _ in range(50)))
        assert got == ["ok"] * 50 and "p:1" not in fake.gate
        assert fake.gate.probes == 1 and fake.calls == 50 and fake.most == 50  # one probe, then all the calls

    asyncio.run(main())


def test_a_probe_that_ends_without_an_outcome_passes_the_turn_to_the_next():
    """A probe cancelled with its caller, or past its timeout: its waiters do
    not fail with it; the next one probes."""
    async def main():
        fake = _Fake(delay_s=0.2)
        with pytest.raises(PeerUnavailable):
            await fake.call()
        first = asyncio.ensure_future(fake.call())
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(fake.call())
        await asyncio.sleep(0.05)
        first.cancel()
        fake.up = True
        assert await waiting == "ok"
        assert fake.gate.probes == 2 and "p:1" not in fake.gate

    asyncio.run(main())


def test_a_caller_gives_up_at_its_own_timeout_while_the_probe_hangs():
    async def main():
        fake = _Fake()
        with pytest.raises(PeerUnavailable):
            await fake.call()
        fake.delay_s = 5.0
        hung = asyncio.ensure_future(fake.call())
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable, match="no probe of it ended within 0.2 s") as e:
            await fake.call(timeout_s=0.2)
        assert e.value.transient and 0.15 < time.monotonic() - t0 < 2.0
        hung.cancel()
        await asyncio.gather(hung, return_exceptions=True)
        assert "p:1" in fake.gate  # still marked: nothing said the peer is back

    asyncio.run(main())


def test_marked_addresses_are_bounded_oldest_first_even_beside_a_probe_in_flight():
    """An engine names addresses at will: at most ``max_addresses`` kept,
    whatever probe is in flight (one held open must not stop the bound)."""
    async def main():
        fake = _Fake(delay_s=0)
        gate = fake.gate = Unreachable(fake.probe, max_addresses=8)
        with pytest.raises(PeerUnavailable):
            await fake.call("hung:1")
        fake.delay_s = 5.0
        hung = asyncio.ensure_future(fake.call("hung:1"))  # its probe stays in flight
        await asyncio.sleep(0.05)
        fake.delay_s = 0
        for i in range(1000):
            with pytest.raises(PeerUnavailable):
                await fake.call(f"10.0.0.{i}:1")
        assert len(gate) == 8 and "hung:1" in gate and "10.0.0.999:1" in gate and "10.0.0.992:1" not in gate
        hung.cancel()
        await asyncio.gather(hung, return_exceptions=True)

    asyncio.run(main())


def test_probes_of_an_address_are_spaced_whatever_they_answer():
    """A peer whose health check answers at once with a code that says
    nothing was probed back to back, ~1,200-2,500 times a second (review):
    probes of an address are now at least PROBE_GAP_S apart, and a caller
    within the gap after a failed one fails with its error, sending nothing."""
    async def main():
        probes = []

        async def quiet(address: str, timeout_s: float) -> str:
            probes.append(time.monotonic())
            return NO_OUTCOME

        gate = Unreachable(quiet)
        gate.failed("p:1")
        with pytest.raises(PeerUnavailable, match="no probe of it ended within 0.5 s"):
            await gate.admit("p:1", 0.5)
        assert 2 <= len(probes) <= 0.5 / PROBE_GAP_S + 2, len(probes)
        assert min(b - a for a, b in zip(probes, probes[1:])) >= PROBE_GAP_S * 0.9

        async def refused(address: str, timeout_s: float) -> str:
            probes.append(time.monotonic())
            return f"{address}: UNAVAILABLE: refused"

        gate = Unreachable(refused)
        gate.failed("p:1")
        probes.clear()
        with pytest.raises(PeerUnavailable, match="refused$"):
            await gate.admit("p:1", 5.0)
        for _ in range(100):  # within the gap: its error, no probe
            with pytest.raises(PeerUnavailable, match="a probe of this address failed so"):
                await gate.admit("p:1", 5.0)
        assert len(probes) == 1 and gate.not_sent == 101
        await asyncio.sleep(PROBE_GAP_S)
        with pytest.raises(PeerUnavailable, match="refused$"):
            await gate.admit("p:1", 5.0)
        assert len(probes) == 2

    asyncio.run(main())


class _Stopping(pb_grpc.PeerServiceServicer):
    """A peer daemon that answers every Claim UNAVAILABLE after ``delay_s``
    with its health NOT_SERVING (as a draining daemon does), or answers it
    when ``up``; counts calls and the most in flight."""

    def __init__(self, health, delay_s: float = 0.02):
        self.health, self.delay_s = health, delay_s
        self.calls = self.now = self.most = 0
        self.lock = threading.Lock()
        self.set_up(False)

    def set_up(self, up: bool) -> None:
        self.up = up
        self.health.set("", health_pb2.HealthCheckResponse.SERVING if up else
                        health_pb2.HealthCheckResponse.NOT_SERVING)

    def Claim(self, request, context):
        with self.lock:
            self.calls += 1
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(self.delay_s)
        finally:
            with self.lock:
                self.now -= 1
        if not self.up:
            context.abort(grpc.StatusCode.UNAVAILABLE, "daemon is draining (shutting down)")
        return pb.ClaimResponse()


@contextlib.contextmanager
def _serving(*servicers):
    """A gRPC server on a free loopback port with ``servicers`` (each an
    ``add_...ToServer``-style ``(add, servicer)`` pair): yields its address."""
    server = grpc.server(ThreadPoolExecutor(max_workers=16))
    for add, servicer in servicers:
        add(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        yield address
    finally:
        server.stop(0.5).wait()


def test_peer_client_probes_a_peer_that_answered_unavailable_before_its_claims_go():
    health = HealthServicer()
    servicer = _Stopping(health)

    async def main(address: str):
        client = PeerClient(PeerAuth())

        def claim(i: int):
            return client.claim(address, "p", 0, f"r{i}", [[1]], 0.0, 5.0)

        try:
            with pytest.raises(PeerUnavailable, match="draining"):
                await claim(0)
            assert address in client.unreachable
            # Draining: its probe says NOT_SERVING; no claim is sent.
            servicer.calls = servicer.most = 0
            got = await asyncio.gather(*(claim(i) for i in range(100)), return_exceptions=True)
            assert all(isinstance(g, PeerUnavailable) and "NOT_SERVING" in str(g) for g in got), got[:3]
            assert servicer.calls == 0 and client.unreachable.probes == 1, (servicer.calls, client.unreachable.probes)
            # Back: once PROBE_GAP_S has passed since the last probe, one
            # probe finds it, and every caller goes, at once.
            servicer.set_up(True)
            await asyncio.sleep(PROBE_GAP_S)
            got = await asyncio.gather(*(claim(i) for i in range(20)), return_exceptions=True)
            assert got == [None] * 20 and address not in client.unreachable
            assert servicer.calls == 20 and servicer.most > 1 and client.unreachable.probes == 2
            # A refused connection marks its address too, and its probe is refused.
            dead = closed_address()
            for _ in range(2):
                with pytest.raises(PeerUnavailable, match="UNAVAILABLE"):
                    await client.claim(dead, "p", 0, "x", [[1]], 0.0, 5.0)
                assert dead in client.unreachable
                await asyncio.sleep(PROBE_GAP_S)
            assert client.unreachable.probes == 3
        finally:
            await client.close()

    with _serving((pb_grpc.add_PeerServiceServicer_to_server, servicer),
                  (health_pb2_grpc.add_HealthServicer_to_server, health)) as address:
        asyncio.run(main(address))


def test_the_gates_counts_are_served_as_metrics():
    """``kvd_peer_addresses_unanswered``, ``kvd_peer_probes_total`` and
    ``kvd_peer_calls_not_sent_total``, read by a registry as the daemon's
    metrics server reads them."""
    from prometheus_client import CollectorRegistry, generate_latest

    async def main():
        fake = _Fake(delay_s=0)
        await asyncio.gather(*(fake.call(f"a:{i}") for i in range(3)), return_exceptions=True)
        await asyncio.gather(*(fake.call("a:0") for _ in range(5)), return_exceptions=True)
        return fake.gate

    gate = asyncio.run(main())
    r = CollectorRegistry()
    r.register(gate)
    text = generate_latest(r).decode()
    assert "kvd_peer_addresses_unanswered 3.0" in text, text
    assert "kvd_peer_probes_total 1.0" in text and "kvd_peer_calls_not_sent_total 5.0" in text, text


def test_first_contacts_go_a_burst_at_once_then_in_turn_per_uid_and_too_far_off_fail_unsent():
    """The budget alone, on a clock of its own: a uid's ``burst`` contacts go
    at once, its next waits ``1 / per_s``; one whose turn is more than
    ``max_wait_s`` (or its timeout) off fails at once, counted, and reserves
    nothing (an hour-long deadline reserved turns minutes ahead before:
    review); another uid's turns are its own; a proven address never waits,
    and proven addresses are kept most recently answered last."""
    now = [100.0]
    fc = FirstContacts(per_s=10.0, burst=3, kept=2, max_wait_s=0.15, clock=lambda: now[0])

    async def main():
        tickets = []
        for i in range(3):
            left, t = await fc.admit(f"a:{i}", 5.0, uid=7)
            assert left == pytest.approx(5.0, abs=0.05) and t is not None
            tickets.append(t)
        t0 = time.monotonic()
        left, t = await fc.admit("a:3", 5.0, uid=7)  # its turn 0.1 s on
        assert 0.08 <= time.monotonic() - t0 < 1.0 and 4.0 < left < 4.95
        for _ in range(5):  # 0.2 s off, past max_wait_s however long the deadline: nothing reserved
            with pytest.raises(PeerUnavailable, match="not contacted: uid 7") as e:
                await fc.admit("a:4", 3600.0, uid=7)
            assert not e.value.transient
        assert (await fc.admit("b:0", 0.01, uid=8))[1] is not None  # another uid: its own burst
        fc.answered("live:1")
        assert await fc.admit("live:1", 0.01, uid=7) == (0.01, None)  # proven: no turn taken
        now[0] += 0.3  # three intervals: uid 7 has a turn at once again (the refusals reserved none)
        assert (await fc.admit("a:5", 0.01, uid=7))[1] is not None
        fc.answered("live:2")
        fc.answered("live:1")  # answered again: the most recent
        fc.answered("live:3")
        assert fc.proven("live:1") and not fc.proven("live:2") and fc.proven("live:3")
        for t in tickets:
            fc.ended(t)

    asyncio.run(main())
    assert (fc.waited, fc.refused) == (1, 5)


def test_contacts_with_one_new_address_go_one_at_a_time_and_take_one_turn():
    """Many contacts with one address not proven (a TP 8 decode engine's
    64 handshakes with a new prefill daemon): one goes; the others wait for
    it and go without a turn once it proved the address, or once the
    unreachable gate holds it (its probe then goes, one at a time); after
    an end that did neither, the next takes a turn of its own."""
    fc = FirstContacts(per_s=0.1, burst=2)
    held = set()

    async def main():
        left, first = await fc.admit("p:1", 5.0, uid=1)
        waiting = [asyncio.create_task(fc.admit("p:1", 5.0, uid=1)) for _ in range(63)]
        await asyncio.sleep(0.05)
        assert not any(w.done() for w in waiting)
        fc.answered("p:1")
        fc.ended(first)
        got = await asyncio.gather(*waiting)
        assert all(t is None for _, t in got)  # proven: no turn each
        # A dead one: held by the gate after the first contact's failure.
        _, first = await fc.admit("d:1", 5.0, uid=1)
        waiting = [asyncio.create_task(fc.admit("d:1", 5.0, uid=1, held=held.__contains__)) for _ in range(10)]
        await asyncio.sleep(0.01)
        held.add("d:1")
        fc.ended(first)
        got = await asyncio.gather(*waiting)
        assert all(t is None for _, t in got)
        # Neither: the next takes its turn, and uid 1's two are spent.
        with pytest.raises(PeerUnavailable, match="not contacted"):
            await fc.admit("n:1", 5.0, uid=1)

    asyncio.run(main())


def test_peer_client_refuses_a_new_address_past_its_turn_without_a_channel_and_serves_a_proven_one():
    """Through ``PeerClient``: with the caller's first-contact budget spent,
    a handshake and a claim to a new address fail at once, no channel made
    (each made one before, and a call); a call to an address a daemon
    answered at goes at once; another caller uid's contacts are not held
    up; a server that is no daemon (a gRPC server of another kind:
    UNIMPLEMENTED) proves nothing."""
    from kvd.core.state import PEER_CALLER

    up = _Stopping(HealthServicer(), delay_s=0.0)
    up.set_up(True)

    async def main(other: str, live: str):
        client = PeerClient(PeerAuth())
        client.first_contacts = FirstContacts(per_s=0.1, burst=2)
        try:
            PEER_CALLER.set(5)
            with pytest.raises(Exception):  # UNIMPLEMENTED there: a server, but no daemon
                await client.notify(other, "e", 0, "r", 1, 5.0)
            assert not client.first_contacts.proven(other)
            await client.claim(live, "p", 0, "r", [[1]], 0.0, 5.0)  # the second turn; a daemon's OK proves it
            assert client.first_contacts.proven(live)
            for call in (client.handshake(closed_address(), "e", 0, "h", 1.0),
                         client.claim(closed_address(), "e", 0, "r", [[1]], 0.0, 1.0)):
                with pytest.raises(PeerUnavailable, match="not contacted: uid 5"):
                    await call
            assert sorted(client._channels) == sorted([other, live])
            await client.claim(live, "p", 0, "r", [[1]], 0.0, 5.0)  # proven: sent at once
            PEER_CALLER.set(6)  # another uid: its own turns
            with pytest.raises(PeerUnavailable, match="UNAVAILABLE"):
                await client.claim(closed_address(), "e", 0, "r", [[1]], 0.0, 1.0)
            assert client.first_contacts.refused == 2
        finally:
            await client.close()

    with _serving((health_pb2_grpc.add_HealthServicer_to_server, HealthServicer())) as other, \
            _serving((pb_grpc.add_PeerServiceServicer_to_server, up)) as live:
        asyncio.run(main(other, live))


def test_a_long_contact_that_proves_nothing_holds_the_others_at_most_the_wait_and_an_answer_frees_them():
    """One contact with an address not proven that takes long and proves
    nothing (a claim waiting up to 5 s at its source for a hold, answered
    PERMISSION_DENIED) held every other contact with the address behind it,
    chained, past a handshake's deadline (review). The others now wait at
    most ``max_wait_s`` behind it, then take turns of their own; and a
    proof arriving meanwhile lets them go at once."""
    fc = FirstContacts(per_s=10.0, burst=8, max_wait_s=0.2)

    async def main():
        _, slow = await fc.admit("p:1", 10.0, uid=65534)
        t0 = time.monotonic()
        _, mine = await fc.admit("p:1", 10.0, uid=0)  # behind the slow one 0.2 s, then its own turn
        assert 0.15 <= time.monotonic() - t0 < 2.0 and mine is not None
        fc.ended(mine)
        fc.ended(slow)
        patient = FirstContacts(per_s=10.0, burst=8, max_wait_s=5.0)
        _, slow = await patient.admit("p:2", 10.0, uid=65534)
        waiting = asyncio.create_task(patient.admit("p:2", 10.0, uid=0))  # behind the slow one, up to 5 s
        await asyncio.sleep(0.05)
        t1 = time.monotonic()
        patient.answered("p:2")  # proven meanwhile (a followed-holds poll's OK): it goes at once
        assert (await waiting)[1] is None and time.monotonic() - t1 < 2.0
        patient.ended(slow)

    asyncio.run(main())
