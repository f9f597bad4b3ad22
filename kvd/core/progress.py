"""Progress: the loop that drives every transfer to its end.

Each round polls NIXL on the NIXL thread (:meth:`Progress.poll`: READs and
WRITEs that ended, notifications received, handles left to release, retired
remotes no load uses any more), then, on the event loop, hands each result
to its room (``pull``, ``push``, ``holds``), expires leases and loads past
their deadlines, and drops workers detached past ``Limits.detach_grace_s``.
It polls every ``Limits.poll_busy_s`` while transfers are in flight,
``Limits.poll_idle_s`` otherwise, or at once when a post kicks it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvd.core.events import NotFound
from kvd.core.holds import Holds
from kvd.core.peers import Peers
from kvd.core.pull import Pull
from kvd.core.push import Push
from kvd.core.registry import Registry
from kvd.core.runtime import Runtime
from kvd.core.state import WorkerKey

log = logging.getLogger("kvd.core")


class Progress:
    """The progress loop of one daemon (:meth:`start` / :meth:`stop`)."""

    def __init__(self, rt: Runtime, registry: Registry, peers: Peers, holds: Holds, pull: Pull, push: Push):
        self.rt = rt
        self.registry = registry
        self.peers = peers
        self.holds = holds
        self.pull = pull
        self.push = push
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Starts the loop on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvd-progress")

    async def stop(self) -> None:
        """Stops the loop (after its current round)."""
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    def poll(self):
        """NIXL thread: ``(writes ended, loads' results)``; each load result is
        ``(worker, request id | agent name, "ERR" | "END" | "NOTIF", source | message)``."""
        self.rt.release_zombies()
        if self.rt.warm_ups:
            self.rt.release_warm_ups(time.monotonic())
        writes = self.push.poll_writes(time.monotonic())
        done = []
        for w in list(self.rt.workers.values()):
            for rid, load in list(w.inflight.items()):
                running = []
                for h, r in load.parts:
                    st = w.agent.state(h)
                    if st == "PROC":
                        running.append((h, r))
                        continue
                    self.rt.release_handle(w.agent, h, settled=True)
                    if st != "DONE":
                        done.append((w, rid, "ERR", r))
                load.parts = running
                if not running:
                    done.append((w, rid, "END", None))
            if w.pairs.retired and not any(a is w.agent for a, _ in self.rt.zombies):
                used = {id(r) for l in list(w.inflight.values()) for _, r in l.parts}
                for r in [r for r in w.pairs.retired if id(r) not in used]:
                    w.pairs.retired.remove(r)
                    self.peers.free_remote(w, r)
            for agent_name, msgs in w.agent.notifs().items():
                for m in msgs:
                    done.append((w, agent_name, "NOTIF", m))
        return writes, done

    async def _loop(self) -> None:
        rt = self.rt
        while not rt.closing:
            try:
                writes, results = await rt.nixl(self.poll)
            except Exception:
                log.exception("progress poll failed")
                writes, results = [], []
            now = time.monotonic()
            self.push.complete(writes)
            for w, a, st, extra in results:
                if not rt.registered(w):
                    continue
                if st == "NOTIF":
                    self.holds.on_notif(w, a, extra)
                elif st == "ERR":
                    self.pull.read_failed(w, a, extra)
                elif st == "END":
                    self.pull.finish(w, a, now)
            self.expire(now)
            if rt.quarantine:
                await self.registry.free_quarantined()
            busy = bool(self.push.writes) or any(w.inflight for w in rt.workers.values())
            rt.kick.clear()
            try:
                await asyncio.wait_for(rt.kick.wait(), rt.limits.poll_busy_s if busy else rt.limits.poll_idle_s)
            except asyncio.TimeoutError:
                pass

    def expire(self, now: float) -> None:
        """Leases and loads past their deadlines; workers detached too long."""
        self.holds.expire(now)
        self.pull.expire(now)
        grace = self.rt.limits.detach_grace_s
        for w in list(self.rt.workers.values()):
            s = w.session
            if s.detached_since is not None and not s.streams and now - s.detached_since > grace:
                s.detached_since = None
                asyncio.get_running_loop().create_task(self._drop_detached(w.key))

    async def _drop_detached(self, key: WorkerKey) -> None:
        try:
            await self.registry.unregister(key, reason=f"no session for {self.rt.limits.detach_grace_s:.0f} s",
                                           engine_gone=True)
        except NotFound:
            pass  # unregistered meanwhile
