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


def test_ids_are_released_when_the_task_ends_or_later_when_the_read_ends():
    async def main():
        ids = LoadIds(Limits(max_load_block_ids_per_worker=500, max_load_block_ids_per_uid=10_000))
        w = _worker(7)
        assert ids_of(_req("x", 100)) == 200
        gate = asyncio.Event()

        async def load():
            await gate.wait()

        tasks = {}
        for rid in ("r0", "r1"):
            assert ids.take(w, _req(rid, 100), [w]) is None
            tasks[rid] = asyncio.get_running_loop().create_task(load())
            ids.started(w, rid, tasks[rid])
        assert w.load_ids_total == 400 and ids.uid_total(7) == 400
        assert "max_load_block_ids_per_worker 500" in ids.take(w, _req("r2", 100), [w])
        w.inflight["r1"] = object()  # r1 is reading when its task ends: still counted
        gate.set()
        await asyncio.gather(*tasks.values())
        assert w.load_ids_total == 200 and set(w.load_ids) == {"r1"}
        assert "max_load_block_ids_per_worker" in ids.take(w, _req("r2", 200), [w])  # 200 + 400
        del w.inflight["r1"]  # its READ ended: released at the next take that needs it
        assert ids.take(w, _req("r2", 200), [w]) is None
        assert w.load_ids_total == 400 and set(w.load_ids) == {"r2"}

    asyncio.run(main())


def test_the_uid_total_is_made_exact_from_the_registered_workers():
    async def main():
        ids = LoadIds(Limits(max_load_block_ids_per_worker=10_000, max_load_block_ids_per_uid=500))
        a, b, other = _worker(7), _worker(7), _worker(8)
        assert ids.take(a, _req("a0", 100), [a, b, other]) is None
        assert ids.take(b, _req("b0", 100), [a, b, other]) is None
        assert ids.take(other, _req("o0", 200), [a, b, other]) is None  # another uid: its own count
        assert "max_load_block_ids_per_uid 500" in ids.take(b, _req("b1", 100), [a, b, other])
        # Worker a unregistered (whatever path): it no longer counts for its uid.
        assert ids.take(b, _req("b1", 100), [b, other]) is None
        assert ids.uid_total(7) == 400 and ids.uid_total(8) == 400

    asyncio.run(main())


def test_a_request_id_counted_again_replaces_its_count():
    ids = LoadIds(Limits(max_load_block_ids_per_worker=1000, max_load_block_ids_per_uid=1000))
    w = _worker(1)
    assert ids.take(w, _req("r", 100), [w]) is None
    assert ids.take(w, _req("r", 50), [w]) is None
    assert w.load_ids_total == 100 and ids.uid_total(1) == 100
