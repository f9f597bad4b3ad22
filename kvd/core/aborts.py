"""Bounds on the notifications a daemon sends to free a source's blocks early.

A decode engine can ask its daemon to tell a prefill daemon that nobody
will read a request's blocks: an ``AbortLoad`` command, or a ``LoadBlocks``
with no remote block ids but a remote request and address (a full local
prefix hit); and a load whose source refuses the pair (incompatible) tells
each of the source's ranks by gRPC. Each starts a task that may first wait a handshake with that
peer (up to ``handshake_timeout_s`` on one that never answers), so
unbounded they pile up as tasks and handshake connections: measured, 8
such loads opened 8 handshake connections where ``max_aborts_per_uid 2``
let 8 ``AbortLoad`` commands open 2 (docs/SECURITY.md). All of them
take a slot here: ``Limits.max_aborts`` in flight for the daemon,
``Limits.max_aborts_per_uid`` for the engines of one caller uid.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from kvd.core.limits import Limits, UidCounts


class AbortSlots:
    """In-flight early-free notifications, counted per caller uid and in all.

    Args:
        limits: ``max_aborts`` and ``max_aborts_per_uid``.
    """

    def __init__(self, limits: Limits):
        self.limits = limits
        self.counts = UidCounts()  # by caller uid

    def start(self, uid: int, make: Callable[[], Coroutine[Any, Any, None]]) -> str | None:
        """Runs ``make()`` as a task in a slot of ``uid``; returns None, or,
        with no slot free, the reason (nothing is started: ``make`` is not
        called). The slot is freed when the task ends, however it ends."""
        lim, n = self.limits, self.counts
        if n.full(uid, lim.max_aborts, lim.max_aborts_per_uid):
            return (f"{n.total} aborts in flight ({n.of(uid)} of uid {uid}): max_aborts {lim.max_aborts}, "
                    f"max_aborts_per_uid {lim.max_aborts_per_uid}")
        task = asyncio.get_running_loop().create_task(make())
        task.add_done_callback(n.add(uid))
        return None
