"""``Node.attach``: a session stream that goes while it waits for the
previous session's READs to settle is not left counted as open.

A worker's open-stream count decides when its loads are cancelled (the last
stream's end) and when an idle registration may be taken over; a count left
at 1 by a stream that never opened would keep both from happening.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvd.core.node import Node
from kvd.core.state import WorkerSession


class _Registry:
    """What ``Node.attach`` asks of the registry, counting as the real one does."""

    def attach(self, engine_id, tp_rank):
        self.w.session.streams += 1
        return self.w

    def detach(self, w):
        w.session.streams -= 1
        return w.session.streams == 0


def test_a_stream_cancelled_while_its_worker_settles_is_not_counted():
    cancelled = []

    async def cancel(w):
        cancelled.append(w)

    async def main():
        w = SimpleNamespace(session=WorkerSession(), label="engine=e rank=0")
        never = asyncio.get_running_loop().create_future()
        w.session.settling = asyncio.ensure_future(never)  # the last session's READs, not settled
        node = SimpleNamespace(registry=_Registry(), pull=SimpleNamespace(cancel=cancel))
        node.registry.w = w
        opening = asyncio.ensure_future(Node.attach(node, "e", 0))
        await asyncio.sleep(0.01)
        assert w.session.streams == 1  # waiting to open
        opening.cancel()  # the engine went (gRPC cancels the stream's handler)
        with pytest.raises(asyncio.CancelledError):
            await opening
        await asyncio.sleep(0)
        assert w.session.streams == 0
        assert cancelled == [w]  # as at any last stream's end: its loads are cancelled
        w.session.settling.cancel()

    asyncio.run(main())


def test_a_load_whose_session_ended_before_it_started_is_dropped():
    """``Pull.load(..., epoch=)``: the session's epoch is taken when the
    load's command is read; a load task that first runs after that session
    ended (its engine already failed the load and may reuse the blocks)
    posts nothing and emits nothing; it is counted as failed."""
    from kvd.core.pull import Pull
    from kvd.core.transfer_mode import TransferModes
    from kvd.core.runtime import Runtime
    from kvd.core.limits import Limits
    from kvd.requests import LoadRequest

    async def main():
        rt = Runtime(Limits())
        emitted = []
        rt.emit = lambda w, ev: emitted.append(ev)
        pull = Pull(rt, None, None, None, None, None, TransferModes("pull", {}, lambda: []))  # none may be reached
        w = SimpleNamespace(session=WorkerSession(epoch=3), key=("e", 0), label="engine=e rank=0", inflight={},
                            pending_loads={})
        req = LoadRequest("r1", [[1]], "p", "127.0.0.1:1", [[2]], "p1")
        await pull.load(w, req, epoch=2)  # read in epoch 2; the session ended (now 3)
        assert emitted == [] and not w.pending_loads and rt.counters.transfers_failed == 1
        rt.shutdown()

    asyncio.run(main())
