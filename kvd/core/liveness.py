"""Liveness of remote workers: a dead, gone or idle peer's state is released.

Every ``Limits.peer_check_s`` (:meth:`Liveness.check`), each remote worker a
local worker reads from is asked again (a handshake, one per remote worker
whatever the number of local workers pairing with it). Its state here (the
peer agent loaded into each local agent, the pair's descriptor lists) is
released, through ``Peers.retire`` (freed once no posted READ uses it), when:

- its daemon has not answered for ``peer_dead_s`` (killed, its host gone);
- its engine is no longer registered there, or no longer compatible;
- no load has used it for ``peer_idle_s``, unless it is a ``warm_peers``
  engine's (kept paired for the next load);

and the next load handshakes again (a daemon back on the address serves it;
a ``warm_peers`` engine's pairs are made again in the background,
``Peers._keep_warm``).
An answer naming another agent (the peer restarted) retires the old one and
handshakes anew in the background. A dead peer's state goes within about
``peer_dead_s + peer_check_s``. Before, a SIGKILLed peer's agent stayed
loaded for as long as the decode daemon ran (``remote_agents`` 1 after
> 120 s, found by an attacker review); docs/RELIABILITY.md has the numbers.

Push-mode readers (``WorkerPairs.readers``, the source side) no push has
used for ``peer_idle_s`` are released at the same check
(``kvd.core.push.retire_idle_readers``), never one a push is using. They
are not asked whether they are there: a push names the reader's agent, not
its daemon's address, so a dead reader goes as an idle one (a decode
engine that restarted comes back under a new agent name). Before, every
push reader stayed for the worker's life (``remote_agents`` 2,000 after a
hostile peer's 2,000 pushes, after the reader process had exited too).
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvd.core.events import Incompatible, InvalidArgument, NotFound, PeerUnavailable
from kvd.core.limits import BOUNDS
from kvd.core.peers import Peers
from kvd.core.push import retire_idle_readers
from kvd.core.runtime import Runtime
from kvd.core.state import PeerKey, RemoteWorker, Worker

log = logging.getLogger("kvd.core")


class Liveness:
    """The liveness check of one daemon's remote workers (:meth:`start` / :meth:`close`).

    Args:
        rt: the core's shared state.
        peers: the remote workers and the link to their daemons.
    """

    def __init__(self, rt: Runtime, peers: Peers):
        self.rt = rt
        self.peers = peers
        self._silent_since: dict[PeerKey, float] = {}  # remote worker -> first failed probe
        self._watcher: asyncio.Task | None = None

    def start(self) -> None:
        """Starts the liveness check of remote workers (:meth:`check` every
        ``Limits.peer_check_s``) on the running event loop."""
        self._watcher = asyncio.get_running_loop().create_task(self._watch(), name="kvd-peer-liveness")

    async def _watch(self) -> None:
        while not self.rt.closing:
            await asyncio.sleep(self.rt.limits.peer_check_s)
            try:
                await self.check(time.monotonic())
            except Exception:
                log.exception("peer liveness check failed")

    async def check(self, now: float) -> None:
        """One round (see the module docstring): releases idle remotes and
        push readers, then asks each remote worker still in use whether it
        is there, all at once, each within ``min(handshake_timeout_s,
        peer_check_s)``. ``now``: monotonic seconds."""
        limits = self.rt.limits
        users: dict[PeerKey, list[tuple[Worker, RemoteWorker]]] = {}
        for w in list(self.rt.workers.values()):
            retire_idle_readers(w, now, limits.peer_idle_s)
            for key, r in list(w.pairs.remotes.items()):
                if now - r.last_used > limits.peer_idle_s and w.pairs.warm_peer(r.address, r.engine_id) is None:
                    self.peers.retire(w, r, f"no load used it for {limits.peer_idle_s:.0f} s (peer_idle_s)",
                                      again=False)
                else:
                    users.setdefault(key, []).append((w, r))
        for key in [k for k in self._silent_since if k not in users]:
            del self._silent_since[key]
        if self.peers.link is None or not users:
            return
        timeout = min(limits.handshake_timeout_s, limits.peer_check_s)
        await asyncio.gather(*(self._probe(key, pairs, now, timeout) for key, pairs in users.items()))

    async def _probe(self, key: PeerKey, pairs: list[tuple[Worker, RemoteWorker]], now: float,
                     timeout: float) -> None:
        """Asks remote worker ``key`` for its handshake and retires the
        ``pairs`` using it when it is gone, another agent, or silent past
        ``peer_dead_s``."""
        address, engine_id, rank = key
        try:
            hs = await self.peers.link.handshake(address, engine_id, rank, pairs[0][0].compat_hash, timeout)
        except PeerUnavailable as e:
            since = self._silent_since.setdefault(key, now)
            if now - since >= self.rt.limits.peer_dead_s:
                del self._silent_since[key]
                for w, r in pairs:
                    self.peers.retire(w, r, f"its daemon has not answered for {now - since:.0f} s "
                                            f"(peer_dead_s): {e}", again=False)
            return
        except (NotFound, Incompatible, InvalidArgument) as e:
            self._silent_since.pop(key, None)
            for w, r in self._settled(pairs, now):
                self.peers.retire(w, r, f"liveness check: {e}", again=False)
            return
        self._silent_since.pop(key, None)
        for w, r in self._settled(pairs, now):
            if hs.agent_name != r.agent_name:
                self.peers.retire(w, r, f"the peer now has agent {hs.agent_name} (restarted)")

    def _settled(self, pairs: list[tuple[Worker, RemoteWorker]], now: float) -> list[tuple[Worker, RemoteWorker]]:
        """The pairs no load may be about to post on: a load takes its remote
        before its claim and posts after it, and a retired remote is freed
        once no *posted* READ uses it. A daemon that answers may grant that
        claim, so a remote taken within a claim's reach is left to the next
        round (or to the READ's own failure, ``kvd.core.pull``); a silent one
        cannot, and is released at once."""
        reach = BOUNDS.max_claim_wait_s + self.rt.limits.handshake_timeout_s
        return [(w, r) for w, r in pairs if now - r.last_used >= reach]

    async def close(self) -> None:
        """Stops the check (at shutdown)."""
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
