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

Each load the session reads is counted as an entry of its own (not by
request id: a second load of the same id, refused later as a duplicate,
must not replace the count of the one still waiting), released when its
task ends, unless the load is then reading (``Worker.inflight``): those are
released lazily, when a load would pass a cap and the counts are made
exact again from what is still in flight. A worker that unregistered keeps
counting for its uid until its loads' tasks end (they hold their ids until
their deadline). So the hot path is a dict insert and two additions a load,
and the exact count never depends on every exit path of a load.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from kvd.core.limits import Limits
from kvd.core.state import Worker, owner_uid
from kvd.requests import LoadRequest


def ids_of(req: LoadRequest) -> int:
    """Block ids ``req`` names, local and remote, all groups."""
    return sum(map(len, req.local_groups)) + sum(map(len, req.remote_groups))


class _Entry:
    """One load's count: its request id, its ids, and its task once started."""

    __slots__ = ("request_id", "ids", "task")

    def __init__(self, request_id: str, ids: int):
        self.request_id = request_id
        self.ids = ids
        self.task: asyncio.Task | None = None


class LoadIds:
    """Per-daemon accounting of the block ids of loads in flight.

    Each worker keeps ``load_ids`` (its entries, by identity) and
    ``load_ids_total``; this object keeps, per owner uid, the total and the
    workers that have entries (registered or not).

    Args:
        limits: the two caps, ``max_load_block_ids_per_worker`` and
            ``max_load_block_ids_per_uid`` (block ids, local and remote).
    """

    def __init__(self, limits: Limits):
        self.limits = limits
        self._by_uid: dict[int, int] = {}
        self._workers: dict[int, dict[int, Worker]] = {}  # uid -> id(worker) -> worker with entries

    def uid_total(self, uid: int) -> int:
        """Block ids counted for the workers of ``uid``: an upper bound (loads
        that ended reading) until :meth:`take` makes it exact."""
        return self._by_uid.get(uid, 0)

    def take(self, w: Worker, req: LoadRequest) -> tuple[str | None, _Entry | None]:
        """Counts ``req``'s ids for ``w`` when both caps allow them. Returns
        ``(None, entry)`` (pass ``entry`` to :meth:`started` with the load's
        task), or ``(reason, None)`` when refused (for a ``busy`` LoadFailed)."""
        n = ids_of(req)
        uid = owner_uid(w)
        lim = self.limits
        if w.load_ids_total + n > lim.max_load_block_ids_per_worker:
            self._settle(w)
        if w.load_ids_total + n > lim.max_load_block_ids_per_worker:
            return (f"busy: {w.load_ids_total} block ids in this worker's loads in flight, this load names {n} "
                    f"(max_load_block_ids_per_worker {lim.max_load_block_ids_per_worker})"), None
        if self.uid_total(uid) + n > lim.max_load_block_ids_per_uid:
            for x in list(self._workers.get(uid, {}).values()):
                self._settle(x)
        if self.uid_total(uid) + n > lim.max_load_block_ids_per_uid:
            return (f"busy: {self.uid_total(uid)} block ids in loads in flight of uid {uid}'s workers, this "
                    f"load names {n} (max_load_block_ids_per_uid {lim.max_load_block_ids_per_uid})"), None
        entry = _Entry(req.request_id, n)
        w.load_ids[id(entry)] = entry
        self._workers.setdefault(uid, {})[id(w)] = w
        self._add(w, n)
        return None, entry

    def started(self, w: Worker, entry: _Entry, task: asyncio.Task, on_end: Callable[[], None] | None = None) -> None:
        """The load ``entry`` counts runs as ``task``: its ids are released
        when the task ends, unless the load is reading then (released once
        it is not, at the next settle). ``on_end``: called then too, from
        the same done callback (one callback a load, not two: each is a
        round through the event loop)."""
        entry.task = task

        def ended(_t) -> None:
            if on_end is not None:
                on_end()
            if entry.request_id not in w.inflight:  # reading (its own READ, or the load this one duplicated): later
                self._drop(w, entry)

        task.add_done_callback(ended)

    def _settle(self, w: Worker) -> None:
        """Drops ``w``'s entries of loads that ended (their task done, not reading)."""
        for entry in [e for e in w.load_ids.values()
                      if e.task is not None and e.task.done() and e.request_id not in w.inflight]:
            self._drop(w, entry)

    def _drop(self, w: Worker, entry: _Entry) -> None:
        if w.load_ids.pop(id(entry), None) is None:
            return
        self._add(w, -entry.ids)
        if not w.load_ids:
            workers = self._workers.get(owner_uid(w), {})
            workers.pop(id(w), None)
            if not workers:
                self._workers.pop(owner_uid(w), None)

    def _add(self, w: Worker, n: int) -> None:
        w.load_ids_total += n
        uid = owner_uid(w)
        total = self._by_uid.get(uid, 0) + n
        if total:
            self._by_uid[uid] = total
        else:
            self._by_uid.pop(uid, None)
