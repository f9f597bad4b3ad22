"""kvd.core.load_ids: the block ids of loads in flight, counted per worker and
per owner uid, made exact from what is still in flight when a load would pass
a cap (the real daemon's caps: tests/test_security_authority.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvd.core.limits import Limits
from kvd.core.load_ids import LoadIds, ids_of
from kvd.requests import LoadRequest


def _worker(uid: int):
    return SimpleNamespace(load_ids={}, load_ids_total=0, inflight={}, owner=SimpleNamespace(uid=uid))


def _req(rid: str, n: int) -> LoadRequest:
    return LoadRequest(rid, [[1] * n], "p", "h:1", [list(range(n))], rid)


def _start(ids: LoadIds, w, req: LoadRequest, gate: asyncio.Event) -> str | None:
    """take, then a task that waits on ``gate`` as the load's; the refusal or None."""
    refused, entry = ids.take(w, req)
    if refused:
        return refused
    ids.started(w, entry, asyncio.get_running_loop().create_task(gate.wait()))
    return None


async def _settled():
    for _ in range(3):
        await asyncio.sleep(0)


def test_ids_are_released_when_the_task_ends_or_later_when_the_read_ends():
    async def main():
        ids = LoadIds(Limits(max_load_block_ids_per_worker=500, max_load_block_ids_per_uid=10_000))
        w, gate = _worker(7), asyncio.Event()
        assert ids_of(_req("x", 100)) == 200
        assert _start(ids, w, _req("r0", 100), gate) is None and _start(ids, w, _req("r1", 100), gate) is None
        assert w.load_ids_total == 400 and ids.uid_total(7) == 400
        assert "max_load_block_ids_per_worker 500" in _start(ids, w, _req("r2", 100), gate)
        w.inflight["r1"] = object()  # r1 is reading when its task ends: still counted
        gate.set()
        await _settled()
        assert w.load_ids_total == 200
        assert "max_load_block_ids_per_worker" in _start(ids, w, _req("r2", 200), asyncio.Event())
        del w.inflight["r1"]  # its READ ended: released at the next count that needs it
        assert _start(ids, w, _req("r2", 200), asyncio.Event()) is None
        assert w.load_ids_total == 400 and ids.uid_total(7) == 400

    asyncio.run(main())


def test_a_second_load_of_the_same_request_id_does_not_replace_the_first_ones_count():
    """A duplicate is refused later (Pull), and its task ends at once: the
    load it duplicated, still waiting, stays counted (a replacement by
    request id let 12 loads of 2M ids each wait uncounted: attacker review)."""
    async def main():
        ids = LoadIds(Limits(max_load_block_ids_per_worker=500, max_load_block_ids_per_uid=10_000))
        w, waiting, ended = _worker(1), asyncio.Event(), asyncio.Event()
        ended.set()
        assert _start(ids, w, _req("r", 200), waiting) is None      # waits on a handshake
        assert _start(ids, w, _req("r", 1), ended) is None          # the duplicate, over at once
        await _settled()
        assert w.load_ids_total == 400 and ids.uid_total(1) == 400
        assert "max_load_block_ids_per_worker" in _start(ids, w, _req("s", 100), waiting)
        waiting.set()
        await _settled()
        assert w.load_ids_total == 0 and ids.uid_total(1) == 0 and not w.load_ids

    asyncio.run(main())


def test_a_worker_that_unregistered_counts_for_its_uid_until_its_loads_end():
    """Its load tasks hold their ids until their deadline: the uid's count
    keeps them (registered or not) until they end, and falls by exactly
    them then (attacker review: a recount from registered workers only,
    then their end subtracted again, let the uid pass its cap)."""
    async def main():
        ids = LoadIds(Limits(max_load_block_ids_per_worker=10_000, max_load_block_ids_per_uid=700))
        gone, b, other = _worker(7), _worker(7), _worker(8)
        waiting = asyncio.Event()
        assert _start(ids, gone, _req("g", 200), waiting) is None   # then `gone` unregisters
        gone.inflight.clear()
        assert _start(ids, b, _req("b", 100), asyncio.Event()) is None
        assert _start(ids, other, _req("o", 300), asyncio.Event()) is None  # another uid: its own count
        assert "max_load_block_ids_per_uid 700" in _start(ids, b, _req("b1", 100), asyncio.Event())
        waiting.set()
        await _settled()
        assert ids.uid_total(7) == 200 and ids.uid_total(8) == 600
        assert _start(ids, b, _req("b1", 100), asyncio.Event()) is None

    asyncio.run(main())
