"""Run a coroutine at once, up to its first wait; a task only for the rest.

A decode daemon made a task for every load its engine sent
(``EngineService._run_command``), yet with 64 one-block loads in flight
most of them never wait: the pairs are made, the followed holds show the
source's hold, and a small READ is posted on the loop
(``Runtime.nixl_now``), so the load's coroutine runs to its end in one step
(the others wait for the NIXL thread, a hold on its way, a claim).
The task only added its creation, a pass of the event loop before it ran,
its step and its done callback. :func:`start` runs that first step now, in
the caller's frame, and wraps the coroutine in a task only when it waits on
something (a handshake, a claim, the NIXL thread): what Python 3.12's
``asyncio.eager_task_factory`` does for every task of a loop (kvd runs on
3.11 too; this is for the callers that ask).

What differs from a task, and why that is fine for its callers:

- the first step runs in the caller's frame: before the caller's next line,
  not in a later pass of the loop (a load's checks, plan and post in the
  pass that read its command);
- ``asyncio.current_task()`` is the caller's (None in a protocol callback)
  during that step: nothing on the load path reads it (no
  ``asyncio.timeout``);
- an exception from the first step is logged as a task's unretrieved one
  would be, not raised to the caller.
"""

from __future__ import annotations

import asyncio
import logging
import types
from collections.abc import Coroutine

log = logging.getLogger("kvd.core")


def start(coro: Coroutine) -> asyncio.Task | None:
    """Runs ``coro`` up to its first wait (on the running loop). Returns None
    when it ended there (its result dropped: callers pass coroutines that
    answer through events), else the task that runs the rest."""
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    except Exception:  # as asyncio logs a task's exception nobody retrieved
        log.exception("%s failed", getattr(coro, "__qualname__", coro))
        return None
    return asyncio.get_running_loop().create_task(_rest(coro, waiting))


async def _rest(coro: Coroutine, waiting):
    return await _delegate(coro, waiting)


@types.coroutine
def _delegate(coro: Coroutine, waiting):
    """Drives ``coro`` for the task that runs it, ``coro`` having yielded
    ``waiting`` (a future it waits on, or None for a bare yield) to a
    caller that was no task: each yield goes to the task, each wake-up
    (``send``) and cancellation (``throw``) back to ``coro``."""
    while True:
        try:
            yield waiting
        except GeneratorExit:  # the task's coroutine closed unfinished: so is coro
            coro.close()
            raise
        except BaseException as e:  # the task's cancellation, or the future's error: coro handles it
            try:
                waiting = coro.throw(e)
            except StopIteration as done:
                return done.value
            continue
        try:
            waiting = coro.send(None)
        except StopIteration as done:
            return done.value
