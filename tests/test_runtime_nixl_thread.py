"""kvd.core.runtime.NixlThread: the one thread every NIXL call runs on.

The real NIXL calls through it are exercised by every transfer test; these
check the hand-off's own rules: order, errors, a cancelled call skipped,
shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvd.core.runtime import NixlThread


def test_calls_run_in_order_on_one_thread_and_errors_reach_the_caller():
    t = NixlThread(name="kvd-nixl-test")
    seen: list[tuple[int, str]] = []

    def record(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * 2

    def fail() -> None:
        raise ValueError("nixl said no")

    async def main():
        results = await asyncio.gather(*(t.call(record, i) for i in range(50)))
        with pytest.raises(ValueError, match="nixl said no"):
            await t.call(fail)
        return results

    try:
        assert asyncio.run(main()) == [i * 2 for i in range(50)]
    finally:
        t.shutdown()
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"kvd-nixl-test"}
    assert threading.current_thread().name not in {name for _, name in seen}


def test_a_call_cancelled_before_it_starts_is_skipped():
    t = NixlThread()
    gate = threading.Event()
    ran: list[str] = []

    async def main():
        blocker = t.call(gate.wait, 10)            # holds the thread
        queued = asyncio.ensure_future(t.call(ran.append, "cancelled"))
        after = t.call(ran.append, "after")
        await asyncio.sleep(0)
        queued.cancel()                            # as a load task cancelled while its post waits
        await asyncio.sleep(0)
        gate.set()
        assert await blocker is True
        await after
        with pytest.raises(asyncio.CancelledError):
            await queued

    try:
        asyncio.run(main())
    finally:
        t.shutdown()
    assert ran == ["after"]


def test_shutdown_runs_what_is_queued_then_refuses():
    t = NixlThread()
    ran: list[int] = []

    async def queue_some():
        futs = [t.call(ran.append, i) for i in range(5)]
        await asyncio.gather(*futs)

    asyncio.run(queue_some())
    t.shutdown()
    assert ran == list(range(5))

    async def after():
        t.call(ran.append, 99)

    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(after())
    assert ran == list(range(5))
