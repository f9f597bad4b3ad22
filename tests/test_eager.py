"""``kvd.core.eager.start``: a coroutine runs at once up to its first wait,
and only what waits becomes a task that behaves as one made for the whole
coroutine (results, errors thrown in by futures, cancellation, order)."""

import asyncio
import logging

import pytest

from kvd.core import eager


def _run(coro_fn):
    return asyncio.run(coro_fn())


def test_no_wait_runs_now_and_makes_no_task():
    seen = []

    async def body():
        seen.append("ran")

    async def main():
        before = len(asyncio.all_tasks())
        assert eager.start(body()) is None
        assert seen == ["ran"]  # in the caller's frame, before its next line
        assert len(asyncio.all_tasks()) == before

    _run(main)


def test_rest_after_a_wait_runs_as_a_task_in_order():
    seen = []

    async def body(fut):
        seen.append("first")
        got = await fut
        seen.append(("woken", got))
        await asyncio.sleep(0)  # a bare yield
        seen.append("end")
        return 7

    async def main():
        fut = asyncio.get_running_loop().create_future()
        task = eager.start(body(fut))
        assert seen == ["first"] and isinstance(task, asyncio.Task) and not task.done()
        await asyncio.sleep(0)
        assert seen == ["first"]  # still waiting on fut
        fut.set_result(3)
        assert await task == 7
        assert seen == ["first", ("woken", 3), "end"]

    _run(main)


def test_future_error_is_thrown_into_the_coroutine():
    caught = []

    async def body(fut):
        try:
            await fut
        except KeyError as e:
            caught.append(e.args[0])
            await asyncio.sleep(0)
            return "handled"

    async def main():
        fut = asyncio.get_running_loop().create_future()
        task = eager.start(body(fut))
        fut.set_exception(KeyError("k"))
        assert await task == "handled"
        assert caught == ["k"]

    _run(main)


def test_cancel_reaches_the_coroutine_and_its_finally():
    steps = []

    async def body():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            steps.append("cancelled")
            raise
        finally:
            steps.append("finally")

    async def main():
        task = eager.start(body())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert steps == ["cancelled", "finally"]

    _run(main)


def test_first_step_error_is_logged_not_raised(caplog):
    async def body():
        raise RuntimeError("boom")

    async def main():
        with caplog.at_level(logging.ERROR, logger="kvd.core"):
            assert eager.start(body()) is None
        assert "boom" in caplog.text

    _run(main)


def test_later_error_is_the_tasks():
    async def body(fut):
        await fut
        raise ValueError("late")

    async def main():
        fut = asyncio.get_running_loop().create_future()
        task = eager.start(body(fut))
        fut.set_result(None)
        with pytest.raises(ValueError, match="late"):
            await task

    _run(main)
