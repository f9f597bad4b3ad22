"""Ending READs for good: no byte of a READ may land after kvd said its
load ended, and no memory is deregistered or unmapped under one.

A READ handle is settled only when NIXL reports it DONE or ERR
(``NixlAgent.release`` never takes one in ``PROC``). When a READ must end
and has not (its load's deadline, its worker's last session ending), the
worker's NIXL agent is replaced (``Registry.replace_agent``): NIXL 1.5 cannot
cancel a READ that needs the peer's progress (``UCX_TLS=tcp``, a peer that
stopped), destroying the agent does. Only then is the load reported failed
or the session's stream closed; a new session of the worker opens after
that (:func:`settled`). A worker unregistered meanwhile is handled by
``Registry.unregister`` (its agent destroyed before its memory is unmapped).

When the session ends, the shim reports every load of the broken stream as
failed, so the daemon waits first for loads whose post is still queued on
the NIXL thread (``Worker.posting``; they hand their handles to
``Runtime.zombies``), bounded by ``Limits.transfer_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from kvd.core.runtime import Runtime
from kvd.core.state import Worker

if TYPE_CHECKING:
    from kvd.core.registry import Registry

log = logging.getLogger("kvd.core")

POLL_S = 0.002  # between looks at the loads still posting (seconds)


async def cancel_reads(rt: Runtime, registry: Registry, w: Worker, handles: list) -> None:
    """Hands ``handles`` (NIXL transfer handles of ``w``'s agent) to
    ``Runtime.zombies`` and returns once no READ of ``w`` is posting or in
    progress (see the module)."""
    rt.zombies.extend((w.agent, h) for h in handles)
    task = asyncio.get_running_loop().create_task(_settle(rt, registry, w))
    w.session.settling = task
    await asyncio.shield(task)  # a second cancellation of the caller leaves the settling to run


async def settled(w: Worker) -> None:
    """Returns once the READs of ``w``'s previous session are settled."""
    task = w.session.settling
    if task is not None and not task.done():
        await asyncio.shield(task)


async def _settle(rt: Runtime, registry: Registry, w: Worker) -> None:
    bound = time.monotonic() + rt.limits.transfer_timeout_s
    while w.posting and rt.registered(w):
        if time.monotonic() > bound:
            log.warning("%s: %d load(s) of the ended session still posting after %.0f s", w.label, len(w.posting),
                        rt.limits.transfer_timeout_s)
            break
        await asyncio.sleep(POLL_S)
    await end_reads(rt, registry, w, "its session ended")


_replacing: dict[int, asyncio.Task] = {}  # id(worker) -> its agent replacement under way


def _start_replacing(registry: Registry, w: Worker, why: str) -> asyncio.Task:
    """Starts ``w``'s agent replacement and records it in ``_replacing``
    until it ends, so that callers meanwhile wait for it rather than start
    another. The task's result is ``Registry.replace_agent``'s."""
    task = _replacing[id(w)] = asyncio.get_running_loop().create_task(registry.replace_agent(w, why))
    task.add_done_callback(lambda t, k=id(w): _replacing.pop(k, None) if _replacing.get(k) is t else None)
    return task


def _under_way(w: Worker) -> asyncio.Task | None:
    """``w``'s agent replacement still running, if any. One that has ended
    stays in ``_replacing`` until its done-callback runs (the loop's next
    step); awaiting it then does not yield, and a caller that looked again
    would find it again, for ever (an attacker review: the loop frozen)."""
    task = _replacing.get(id(w))
    return task if task is not None and not task.done() else None


async def stop_writes_into(rt: Runtime, registry: Registry, w: Worker, why: str, agents: Collection[str]) -> bool:
    """Push mode, reader side: a source's WRITE into ``w``'s blocks may still
    be going on (its ``Push`` call did not answer by the load's deadline),
    and the source cannot be told to stop it (it may be stalled, or cut
    off). Destroying the NIXL agent the WRITE targets closes the UCX
    endpoints it comes through, so that agent is replaced before the load
    is reported failed, as for a READ (``end_reads``). Measured with
    ``UCX_TLS=tcp`` and the source daemon SIGSTOPped in the middle of a
    128 MiB WRITE: after the load had failed, 942-1,002 of its 1,024
    block-regions changed when the source resumed; with the agent replaced,
    none (tests/test_reliability_tcp.py).

    ``agents``: the names of ``w``'s agents its push orders described
    (``PushOrder.reader.agent_name``). A replacement under way is waited
    for; it serves only if it leaves none of them as ``w``'s agent (an order
    described against the agent it made is then replaced in turn). True
    once none of them is left; False (logged by ``Registry.replace_agent``)
    when one of them could not be replaced (no new agent could be made) or
    was replaced but not destroyed (``WorkerMemory.lingering``): a WRITE
    may still land."""
    tried: set[str] = set()
    while rt.registered(w):  # unregistered: its agent is destroyed at its unregistration
        task = _under_way(w)
        if task is None:
            name = w.agent.name
            if name not in agents:
                return w.mem.lingering.keys().isdisjoint(agents)
            if name in tried:
                return False  # no new agent could be made for it: trying again at once would fail the same way
            tried.add(name)
            task = _start_replacing(registry, w, why)
        await asyncio.shield(task)
    return True


async def end_reads(rt: Runtime, registry: Registry, w: Worker, why: str) -> None:
    """Returns once no handle of ``w``'s agent in ``Runtime.zombies`` is in
    progress: each one ended is released; if one has not, the agent is
    replaced (``why`` says what ended it, for logs and the failure reason
    of the worker's other loads). One replacement at a time per worker; a
    caller that finds one under way waits for it and looks again."""
    while rt.registered(w):
        task = _under_way(w)
        if task is None:
            if not await rt.nixl(rt.release_zombies, w.agent):
                return
            if _under_way(w) is not None:
                continue
            task = _start_replacing(registry, w, why)
        if not await asyncio.shield(task):
            return  # logged: nothing more this side can do
