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
