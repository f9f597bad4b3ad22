"""The block ids that loads in flight hold, counted per engine worker and per
owner uid, and capped (``Limits.max_load_block_ids_per_worker``,
``max_load_block_ids_per_uid``).

A load keeps its request's block ids (Python lists of ints, ~36-40 bytes an
id past 256) while it waits: on a handshake (up to ``handshake_timeout_s``,
twice), a claim, the copy or the READ. ``max_inflight_per_worker`` counts
loads, not ids, and one load may name ``max_blocks_per_request`` ids on each
side: loads of 1M local and 1M remote ids against a peer that accepts TCP
and never answers took a daemon from 94 MiB to 4.6 GiB RSS in ~20 s (67
loads of ~67 MiB; attacker review).

Counted from the moment the session reads the load (before its task runs),
released when its task ends unless the load is then reading
(``Worker.inflight``); those are released lazily: a worker's total is made
exact again, from what is still in flight, only when a load would pass a
cap. So the hot path is a dict insert and two additions a load, and nothing
can leak: the exact count never depends on every exit path of a load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from kvd.core.limits import Limits
from kvd.core.state import Worker
from kvd.requests import LoadRequest


def ids_of(req: LoadRequest) -> int:
    """Block ids ``req`` names, local and remote, all groups."""
    return sum(map(len, req.local_groups)) + sum(map(len, req.remote_groups))


def _uid(w: Worker) -> int:
    return w.owner.uid if w.owner is not None else -1


class LoadIds:
    """Per-daemon accounting of the block ids of loads in flight.

    Each worker keeps ``load_ids`` (request id -> (ids, the load's task))
    and ``load_ids_total``; this object keeps the totals per owner uid.

    Args:
        limits: the two caps, ``max_load_block_ids_per_worker`` and
            ``max_load_block_ids_per_uid`` (block ids, local and remote).
    """

    def __init__(self, limits: Limits):
        self.limits = limits
        self._by_uid: dict[int, int] = {}

    def uid_total(self, uid: int) -> int:
        """Block ids counted for the workers of ``uid``: an upper bound
        (loads that ended reading, workers gone) until :meth:`take` makes it
        exact from the registered workers."""
        return self._by_uid.get(uid, 0)

    def take(self, w: Worker, req: LoadRequest, workers: Iterable[Worker]) -> str | None:
        """Counts ``req``'s ids for ``w`` when both caps allow them; returns
        None, or the reason it was refused (for a ``busy`` LoadFailed).
        ``workers``: every registered worker (to settle the uid's total
        when it looks full). Call :meth:`started` with the load's task next."""
        n = ids_of(req)
        uid = _uid(w)
        lim = self.limits
        if w.load_ids_total + n > lim.max_load_block_ids_per_worker:
            self._settle(w)
        if w.load_ids_total + n > lim.max_load_block_ids_per_worker:
            return (f"busy: {w.load_ids_total} block ids in this worker's loads in flight, this load names {n} "
                    f"(max_load_block_ids_per_worker {lim.max_load_block_ids_per_worker})")
        if self._by_uid.get(uid, 0) + n > lim.max_load_block_ids_per_uid:
            # Exact again from the registered workers (a worker unregistered
            # meanwhile no longer counts, whatever path it left by).
            total, counted = 0, False
            for x in list(workers):
                if _uid(x) == uid:
                    self._settle(x)
                    total += x.load_ids_total
                    counted = counted or x is w
            self._by_uid[uid] = total if counted else total + w.load_ids_total
        if self._by_uid.get(uid, 0) + n > lim.max_load_block_ids_per_uid:
            return (f"busy: {self._by_uid.get(uid, 0)} block ids in loads in flight of uid {uid}'s workers, this "
                    f"load names {n} (max_load_block_ids_per_uid {lim.max_load_block_ids_per_uid})")
        old = w.load_ids.get(req.request_id)
        if old is not None:  # the same id again (a duplicate, refused later, or one that ended): its count goes
            self._add(w, -old[0])
        w.load_ids[req.request_id] = (n, None)
        self._add(w, n)
        return None

    def started(self, w: Worker, request_id: str, task: asyncio.Task) -> None:
        """The load :meth:`take` counted runs as ``task``: its ids are released
        when the task ends, unless the load is reading then (released once
        it is not, at the next settle)."""
        entry = w.load_ids.get(request_id)
        if entry is not None:
            w.load_ids[request_id] = (entry[0], task)
        task.add_done_callback(lambda _t: self._ended(w, request_id, task))

    def _ended(self, w: Worker, request_id: str, task: asyncio.Task) -> None:
        entry = w.load_ids.get(request_id)
        if entry is None or entry[1] is not task or request_id in w.inflight:
            return  # counted again meanwhile, or reading: settled later
        del w.load_ids[request_id]
        self._add(w, -entry[0])

    def _settle(self, w: Worker) -> None:
        """Drops ``w``'s entries of loads that ended (their task done, not reading)."""
        gone = [rid for rid, (_n, task) in w.load_ids.items()
                if task is not None and task.done() and rid not in w.inflight]
        for rid in gone:
            self._add(w, -w.load_ids.pop(rid)[0])

    def _add(self, w: Worker, n: int) -> None:
        w.load_ids_total += n
        uid = _uid(w)
        total = self._by_uid.get(uid, 0) + n
        if total:
            self._by_uid[uid] = total
        else:
            self._by_uid.pop(uid, None)
