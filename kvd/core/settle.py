"""Settling a session's READs: when a worker's last session ends, none of
its loads' READs may land afterwards.

The shim reports every load of a broken stream as failed (its blocks go back
to vLLM, which may reuse them at once), so before the stream is closed the
daemon cancels each READ (NIXL releases a transfer handle only once it is no
longer in progress: cancelled or done) and waits for loads whose post is
still queued on the NIXL thread (``Worker.posting``; they cancel their own).
A new session of the worker opens only after that (:func:`settled`).

Bounded by ``Limits.transfer_timeout_s``: past it, the handles left are kept
for the progress loop (``Runtime.zombies``) and a warning is logged.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvd.core.runtime import Runtime
from kvd.core.state import Worker

log = logging.getLogger("kvd.core")

POLL_S = 0.002  # between tries to release a handle still in progress (seconds)


async def cancel_reads(rt: Runtime, w: Worker, handles: list) -> None:
    """Releases ``handles`` (NIXL transfer handles of ``w``'s agent) and waits
    until no READ of ``w`` is posting or in progress (see the module)."""
    task = asyncio.get_running_loop().create_task(_settle(rt, w, handles))
    w.session.settling = task
    await asyncio.shield(task)  # a second cancellation of the caller leaves the settling to run


async def settled(w: Worker) -> None:
    """Returns once the READs of ``w``'s previous session are settled."""
    task = w.session.settling
    if task is not None and not task.done():
        await asyncio.shield(task)


def _release(agent, handles: list) -> list:
    """NIXL thread: releases what it can; returns the handles still in progress."""
    return [h for h in handles if not agent.release(h)]


async def _settle(rt: Runtime, w: Worker, handles: list) -> None:
    bound = time.monotonic() + rt.limits.transfer_timeout_s
    while True:
        if handles:
            handles = await rt.nixl(_release, w.agent, handles)
        busy = handles or w.posting or any(a is w.agent for a, _ in rt.zombies)
        if not busy or not rt.registered(w):
            break
        if time.monotonic() > bound:
            log.warning("%s: %d READ(s) of the ended session still in progress after %.0f s; left to the "
                        "progress loop", w.label, len(handles) + len(w.posting), rt.limits.transfer_timeout_s)
            break
        await asyncio.sleep(POLL_S)
    rt.zombies.extend((w.agent, h) for h in handles)
