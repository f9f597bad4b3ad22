"""Calls to a peer address that did not answer go one at a time
(``kvd.daemon.unreachable``), and ``PeerClient`` gates its calls by it.

The gate alone with fake calls, then ``PeerClient`` against a real gRPC
server that answers UNAVAILABLE (as a stopping daemon does) or is gone.
The daemon-level flood from a dead prefill node is in
``tests/test_reliability_peers.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvd.core.events import PeerUnavailable
from kvd.daemon.peer_auth import PeerAuth
from kvd.daemon.peer_client import PeerClient
from kvd.daemon.unreachable import Unreachable
from kvd.testing.fakes import closed_address
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc


class _Fake:
    """Calls through a gate to a pretend peer: ``up`` says how it answers;
    counts the calls made and the most in flight at once."""

    def __init__(self, gate: Unreachable, delay_s: float = 0.01):
        self.gate, self.delay_s = gate, delay_s
        self.up, self.calls, self.now, self.most = False, 0, 0, 0

    async def call(self, address: str = "p:1", timeout_s: float = 5.0) -> str:
        async with self.gate.turn(address, timeout_s) as out:
            self.calls += 1
            self.now += 1
            self.most = max(self.most, self.now)
            try:
                await asyncio.sleep(self.delay_s)
            finally:
                self.now -= 1
            if not self.up:
                out.unavailable(f"{address}: UNAVAILABLE: refused")
                raise PeerUnavailable(f"{address}: UNAVAILABLE: refused", transient=True)
            out.answered()
            return "ok"


def test_after_an_unavailable_call_the_next_go_one_at_a_time_and_share_its_failure():
    async def main():
        gate = Unreachable()
        fake = _Fake(gate)
        # Not marked: calls go at once, all of them.
        got = await asyncio.gather(*(fake.call() for _ in range(10)), return_exceptions=True)
        assert all(isinstance(g, PeerUnavailable) for g in got) and fake.calls == 10 and fake.most == 10
        assert "p:1" in gate
        # Marked: one goes; the others wait for it and fail with its error, sending nothing.
        fake.calls = fake.most = 0
        got = await asyncio.gather(*(fake.call() for _ in range(200)), return_exceptions=True)
        assert all(isinstance(g, PeerUnavailable) and g.transient for g in got), got[:3]
        assert fake.calls == 1 and fake.most == 1, (fake.calls, fake.most)
        shared = [g for g in got if "not sent again" in str(g)]
        assert len(shared) == 199 and gate.shared_failures == 199
        assert str(shared[0]).startswith("p:1: UNAVAILABLE: refused (not sent again")
        # Another address is not held up by this one.
        fake.up = True
        assert await fake.call("q:2") == "ok" and "q:2" not in gate

    asyncio.run(main())


def test_a_peer_that_answers_again_is_unmarked_and_its_callers_all_go():
    async def main():
        gate = Unreachable()
        fake = _Fake(gate)
        with pytest.raises(PeerUnavailable):
            await fake.call()
        fake.up = True  # it came back: the one call in flight finds it, no timer waited for
        fake.calls = fake.most = 0
        t0 = time.monotonic()
        got = await asyncio.gather(*(fake.call() for _ in range(50)))
        assert got == ["ok"] * 50 and "p:1" not in gate
        assert fake.calls == 50 and fake.most == 49  # the first alone, then the 49 that waited at once
        assert time.monotonic() - t0 < 2.0

    asyncio.run(main())


def test_a_call_that_ends_without_an_outcome_passes_the_turn_to_the_next():
    """Cancelled with its load, or a local error: its waiters do not fail
    with it; the next one makes its own call."""
    async def main():
        gate = Unreachable()
        fake = _Fake(gate, delay_s=0.2)
        with pytest.raises(PeerUnavailable):
            await fake.call()
        first = asyncio.ensure_future(fake.call())
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(fake.call())
        await asyncio.sleep(0.05)
        first.cancel()
        fake.up = True
        assert await waiting == "ok"
        assert fake.calls == 3 and "p:1" not in gate

        # A local error with no outcome said: still marked, the next goes.
        fake.up = False
        with pytest.raises(PeerUnavailable):
            await fake.call()
        with pytest.raises(RuntimeError):
            async with gate.turn("p:1", 1.0):
                raise RuntimeError("a local failure")
        assert "p:1" in gate
        calls = fake.calls
        with pytest.raises(PeerUnavailable, match="UNAVAILABLE: refused$"):  # its own call, not a shared failure
            await fake.call()
        assert fake.calls == calls + 1

    asyncio.run(main())


def test_a_waiter_gives_up_at_its_own_timeout_while_the_call_in_flight_hangs():
    async def main():
        gate = Unreachable()
        fake = _Fake(gate)
        with pytest.raises(PeerUnavailable):
            await fake.call()
        fake.delay_s = 5.0
        hung = asyncio.ensure_future(fake.call())
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable, match="did not end within 0.2 s") as e:
            await fake.call(timeout_s=0.2)
        assert e.value.transient and 0.15 < time.monotonic() - t0 < 2.0
        hung.cancel()
        await asyncio.gather(hung, return_exceptions=True)

    asyncio.run(main())


def test_marked_addresses_are_bounded_oldest_first():
    """An engine names addresses at will: at most ``max_addresses`` kept."""
    async def main():
        gate = Unreachable(max_addresses=8)
        fake = _Fake(gate, delay_s=0)
        for i in range(100):
            with pytest.raises(PeerUnavailable):
                await fake.call(f"10.0.0.{i}:1")
        assert len(gate) == 8 and "10.0.0.99:1" in gate and "10.0.0.91:1" not in gate

    asyncio.run(main())


class _Stopping(pb_grpc.PeerServiceServicer):
    """A peer daemon that answers every Claim UNAVAILABLE after ``delay_s``
    (as a draining daemon does), or answers it when ``up``; counts calls
    and the most in flight."""

    def __init__(self, delay_s: float = 0.02):
        self.delay_s, self.up = delay_s, False
        self.calls = self.now = self.most = 0
        self.lock = threading.Lock()

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


def test_peer_client_sends_one_claim_at_a_time_to_a_peer_that_answered_unavailable():
    servicer = _Stopping()
    server = grpc.server(ThreadPoolExecutor(max_workers=16))
    pb_grpc.add_PeerServiceServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()

    async def main():
        client = PeerClient(PeerAuth())

        def claim(i: int):
            return client.claim(address, "p", 0, f"r{i}", [[1]], 0.0, 5.0)

        try:
            with pytest.raises(PeerUnavailable, match="draining"):
                await claim(0)
            servicer.calls = servicer.most = 0
            got = await asyncio.gather(*(claim(i) for i in range(100)), return_exceptions=True)
            assert all(isinstance(g, PeerUnavailable) and "draining" in str(g) for g in got), got[:3]
            assert servicer.calls == 1 and servicer.most == 1, (servicer.calls, servicer.most)
            servicer.up = True  # back: every caller goes again, at once
            servicer.calls = servicer.most = 0
            got = await asyncio.gather(*(claim(i) for i in range(20)), return_exceptions=True)
            assert got == [None] * 20 and address not in client.unreachable
            assert servicer.calls == 20 and servicer.most > 1
            # A refused connection marks the address too; the long polls and pushes are not gated.
            dead = closed_address()
            with pytest.raises(PeerUnavailable, match="UNAVAILABLE"):
                await client.claim(dead, "p", 0, "x", [[1]], 0.0, 5.0)
            assert dead in client.unreachable
        finally:
            await client.close()

    try:
        asyncio.run(main())
    finally:
        server.stop(0.5).wait()
