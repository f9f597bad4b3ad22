"""Settling a session's READs: when a worker's last session ends, none of
its loads' READs may land afterwards.

The shim reports every load of a broken stream as failed (its blocks go back
to vLLM, which may reuse them at once), so before the stream is closed the
daemon waits until each READ has ended (NIXL state DONE or ERR; a handle in
``PROC`` is never taken as settled: ``NixlAgent.release``) and until loads
whose post is still queued on the NIXL thread (``Worker.posting``) have
cancelled their own. A new session of the worker opens only after that
(:func:`settled`). The handles wait in ``Runtime.zombies`` from the start, so
an unregistration meanwhile sees them and keeps the worker's memory
(``Registry.unregister``, quarantine).

Bounded by ``Limits.transfer_timeout_s``: past it a warning is logged and the
stream closes; the handles stay in ``Runtime.zombies`` for the progress loop.
NIXL 1.5 offers no way to stop a READ that needs the peer's progress
(``UCX_TLS=tcp``) with a peer that stopped: its bytes may still land after
that bound (docs/SECURITY.md, "Open").
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
    """Hands ``handles`` (NIXL transfer handles of ``w``'s agent) to
    ``Runtime.zombies`` and waits until no READ of ``w`` is posting or in
    progress (see the module)."""
    rt.zombies.extend((w.agent, h) for h in handles)
    task = asyncio.get_running_loop().create_task(_settle(rt, w))
    w.session.settling = task
    await asyncio.shield(task)  # a second cancellation of the caller leaves the settling to run


async def settled(w: Worker) -> None:
    """Returns once the READs of ``w``'s previous session are settled."""
    task = w.session.settling
    if task is not None and not task.done():
        await asyncio.shield(task)


async def _settle(rt: Runtime, w: Worker) -> None:
    bound = time.monotonic() + rt.limits.transfer_timeout_s
    while rt.registered(w):
        left = await rt.nixl(rt.release_zombies, w.agent)
        if not left and not w.posting:
            return
        if time.monotonic() > bound:
            log.warning("%s: %d READ(s) of the ended session still in progress after %.0f s; the stream closes, "
                        "the handles are left to the progress loop", w.label, left + len(w.posting),
                        rt.limits.transfer_timeout_s)
            return
        await asyncio.sleep(POLL_S)
