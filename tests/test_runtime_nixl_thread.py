"""kvd.core.runtime: the NIXL thread every NIXL call runs on (or, while it is
idle, a short call on the loop), and event delivery to a session.

The real NIXL calls through it are exercised by every transfer test; these
check the hand-off's own rules: order, errors, a cancelled call skipped,
shutdown, a call run at once only while the thread is idle; and that an
event goes straight to the session's writer only while nothing is queued."""

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


def test_a_short_call_runs_on_the_loop_only_while_the_thread_is_idle():
    """``try_now``: inline on the caller's thread when nothing is queued or
    running on the NIXL thread; refused (nothing run) otherwise, so two
    calls never overlap and submission order holds."""
    t = NixlThread(name="kvd-nixl-test")
    gate = threading.Event()
    seen: list[tuple[str, str]] = []

    def record(tag: str) -> str:
        seen.append((tag, threading.current_thread().name))
        return tag

    def fail() -> None:
        raise ValueError("post refused")

    async def main():
        assert t.try_now(record, "idle") == (True, "idle")
        blocker = t.call(gate.wait, 10)            # the thread runs a call
        queued = t.call(record, "queued")
        assert t.try_now(record, "busy") == (False, None)
        gate.set()
        await blocker
        await queued
        assert t.try_now(record, "idle again") == (True, "idle again")
        with pytest.raises(ValueError, match="post refused"):
            t.try_now(fail)
        assert t.try_now(record, "after an error") == (True, "after an error")  # the count was given back

    try:
        asyncio.run(main())
    finally:
        t.shutdown()
    here = threading.current_thread().name
    assert seen == [("idle", here), ("queued", "kvd-nixl-test"), ("idle again", here), ("after an error", here)]
    with pytest.raises(RuntimeError, match="shut down"):
        t.try_now(record, "late")


def test_a_cancelled_queued_call_does_not_keep_the_thread_busy():
    t = NixlThread()
    gate = threading.Event()

    async def main():
        blocker = t.call(gate.wait, 10)
        queued = asyncio.ensure_future(t.call(print, "never"))
        await asyncio.sleep(0)
        queued.cancel()
        gate.set()
        await blocker
        for _ in range(100):  # the skipped call is counted off on the thread
            ran, _ = t.try_now(lambda: None)
            if ran:
                return True
            await asyncio.sleep(0.01)
        return False

    try:
        assert asyncio.run(main())
    finally:
        t.shutdown()


def test_an_event_goes_straight_to_the_sessions_sink_only_while_nothing_is_queued():
    """``Runtime.emit``: written through the session's sink (the command
    socket's writer) when nothing waits in the queue; queued when the sink
    cannot write now, and then every later event queues behind it, so the
    engine sees them in order."""
    from types import SimpleNamespace

    from kvd.core.events import RecvDone
    from kvd.core.limits import Limits
    from kvd.core.runtime import Runtime
    from kvd.core.state import WorkerSession

    written: list[str] = []
    writable = [True]

    def sink(ev) -> bool:
        if writable[0]:
            written.append(ev.request_id)
        return writable[0]

    rt = Runtime(Limits())
    w = SimpleNamespace(session=WorkerSession(streams=1, sink=sink), label="engine=e rank=0")
    done = [RecvDone(f"r{i}", 1, 1, 1, 0.0) for i in range(4)]
    rt.emit(w, done[0])
    writable[0] = False                      # the engine's socket is full
    rt.emit(w, done[1])
    writable[0] = True
    rt.emit(w, done[2])                      # behind r1, not around it
    assert written == ["r0"]
    assert [e.request_id for e in (w.session.events.popleft(), w.session.events.popleft())] == ["r1", "r2"]
    assert w.session.wakeup.is_set()
    rt.emit(w, done[3])                      # the queue drained: straight out again
    assert written == ["r0", "r3"]
    rt.shutdown()


def test_posts_run_on_the_loop_are_capped_per_pass_of_the_loop():
    """``Runtime.nixl_now``: the posts run on the loop before it has gone
    round once move at most ``BOUNDS.inline_bytes_per_pass`` (each counted
    as at least ``inline_post_min_bytes``); then it runs them again."""
    from kvd.core.limits import BOUNDS, Limits
    from kvd.core.runtime import Runtime

    async def main():
        rt = Runtime(Limits())
        try:
            small = BOUNDS.inline_bytes_per_pass // BOUNDS.inline_post_min_bytes
            first = [rt.nixl_now(4096, lambda i=i: i)[0] for i in range(small + 2)]
            assert first == [True] * small + [False] * 2
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            big = [rt.nixl_now(BOUNDS.inline_bytes_per_pass // 2, lambda: 1)[0] for _ in range(3)]
            assert big == [True, True, False]
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert rt.nixl_now(BOUNDS.inline_bytes_per_pass * 2, lambda: 1) == (True, 1)  # one always may
        finally:
            rt.shutdown()

    asyncio.run(main())


def test_an_open_session_past_the_event_count_bound_is_ended_not_left_short(monkeypatch):
    """Past ``BOUNDS.max_pending_events`` queued, a session gone drops its
    oldest event (it may be reconnecting), but an open one is ended
    (``overflowed``: its engine hears of it) instead of silently losing
    events it would wait for."""
    import dataclasses
    from types import SimpleNamespace

    from kvd.core import runtime as runtime_mod
    from kvd.core.events import RecvDone
    from kvd.core.limits import BOUNDS, Limits
    from kvd.core.runtime import Runtime
    from kvd.core.state import WorkerSession

    monkeypatch.setattr(runtime_mod, "BOUNDS", dataclasses.replace(BOUNDS, max_pending_events=3))
    rt = Runtime(Limits())
    gone = SimpleNamespace(session=WorkerSession(streams=0), label="engine=g rank=0")
    open_ = SimpleNamespace(session=WorkerSession(streams=1), label="engine=o rank=0")
    for i in range(5):
        rt.emit(gone, RecvDone(f"r{i}", 1, 1, 1, 0.0))
        rt.emit(open_, RecvDone(f"r{i}", 1, 1, 1, 0.0))
    assert [gone.session.events.popleft().request_id for _ in range(3)] == ["r2", "r3", "r4"]
    assert not gone.session.overflowed
    assert open_.session.overflowed == "3 events (a bound of kvd)"
    rt.shutdown()


def test_failed_loads_are_logged_once_a_second_per_kind_and_worker(caplog):
    """A flood of failed loads (invalid ones, loads past the worker's cap,
    loads of a dead peer: an engine may send them at will) is one log line a
    second per kind and worker, with the count of the others; another
    worker's, or another kind's, are not folded into it. Every one is
    counted."""
    from types import SimpleNamespace

    from kvd.core.events import FailureKind
    from kvd.core.limits import Limits
    from kvd.core.runtime import Runtime
    from kvd.core.state import WorkerSession

    rt = Runtime(Limits())
    w = SimpleNamespace(session=WorkerSession(), label="engine=e rank=0", key=("e", 0))
    other = SimpleNamespace(session=WorkerSession(), label="engine=f rank=0", key=("f", 0))
    with caplog.at_level("WARNING", logger="kvd.core"):
        for i in range(50):
            rt.fail_load(w, f"bad{i}", [1], FailureKind.INVALID, "invalid: local block id 99 out of range")
        for i in range(3):
            rt.fail_load(w, f"late{i}", [1], FailureKind.TIMEOUT, "timeout: deadline passed")
        rt.fail_load(other, "theirs", [1], FailureKind.INVALID, "invalid: local block id 99 out of range")
    lines = [r.getMessage() for r in caplog.records if "load failed" in r.getMessage()]
    assert sum("invalid" in m and "engine=e " in m for m in lines) == 1
    assert sum("timeout" in m for m in lines) == 1
    assert sum("engine=f " in m for m in lines) == 1
    assert rt.counters.transfers_failed == 54  # counted all the same
    rt.shutdown()
