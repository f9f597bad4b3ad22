"""Holds: the prefill side's leases on blocks its readers will READ.

A hold starts (or renews) a lease (``kvd.core.leases``); it ends when every
expected reader has notified (a READ's notification, a bare one, or a push
WRITE), when the engine releases it, or when it expires; each end is one
``SendDone`` for the engine. Bad input is a ``CommandRejected``.
"""

from __future__ import annotations

import logging
import time

from kvd.core import layout as lay
from kvd.core.events import CommandRejected, InvalidArgument, SendDone
from kvd.core.layout import LayoutError
from kvd.core.leases import parse_notif
from kvd.core.limits import BOUNDS
from kvd.core.runtime import Runtime
from kvd.core.state import Worker
from kvd.requests import BlockGroups, flat

log = logging.getLogger("kvd.core")


class Holds:
    """Leases of every prefill worker (``Worker.leases``)."""

    def __init__(self, rt: Runtime):
        self.rt = rt

    def hold(self, w: Worker, request_id: str, groups: BlockGroups, lease_s: float = 0.0) -> None:
        """Holds ``groups`` (block ids per KV-cache group) of ``request_id``
        for its readers: a lease (``kvd.core.leases``).

        ``lease_s`` 0 means the daemon default; capped at ``max_lease_s``. A
        second hold of the same request and blocks renews the lease. Emits
        ``CommandRejected`` on bad input, ``SendDone`` when the lease ends.
        """
        emit, limits = self.rt.emit, self.rt.limits
        if not request_id:
            emit(w, CommandRejected("", "hold: request_id is empty"))
            return
        ids = flat(groups)
        if len(ids) > limits.max_blocks_per_request:
            emit(w, CommandRejected(request_id, "hold: too many blocks"))
            return
        try:
            lay.descriptor_indices(ids, 1, w.layout.num_blocks)
        except LayoutError as e:
            emit(w, CommandRejected(request_id, f"hold: {e}"))
            return
        if request_id not in w.leases.leases and len(w.leases) >= limits.max_leases_per_worker:
            emit(w, CommandRejected(request_id, f"hold: {limits.max_leases_per_worker} leases held already "
                                                f"(max_leases_per_worker)"))
            return
        now = time.monotonic()
        lease_s = min(lease_s if lease_s > 0 else limits.lease_s, limits.max_lease_s)
        result = w.leases.hold(request_id, groups, now + lease_s, now)
        if result == "conflict":
            emit(w, CommandRejected(request_id, "hold: request already holds other blocks"))
        elif result == "done":
            self.rt.counters.leases_notified += 1
            emit(w, SendDone(request_id))
            log.info("%s request=%s: readers notified before the hold; blocks freed", w.label, request_id)

    def release(self, w: Worker, request_id: str) -> None:
        """Ends a lease now (the request was aborted); emits ``SendDone(released)``."""
        if not w.leases.release(request_id):
            self.rt.emit(w, CommandRejected(request_id, "release: no lease for this request"))
            return
        self.rt.counters.leases_released += 1
        self.rt.emit(w, SendDone(request_id, released=True))

    def on_notif(self, w: Worker, remote_agent: str, msg: bytes) -> None:
        """A NIXL notification from ``remote_agent`` (a reader's READ, or a bare one)."""
        parsed = parse_notif(msg)
        if parsed is None:
            log.warning("%s: malformed notification from %s ignored (%d bytes)", w.label, remote_agent, len(msg))
            return
        request_id, expected = parsed
        if w.leases.notify(request_id, expected, time.monotonic()):
            self.rt.counters.leases_notified += 1
            log.debug("%s request=%s: every reader notified; lease ended", w.label, request_id)
            self.rt.emit(w, SendDone(request_id))

    def notify(self, engine_id: str, tp_rank: int, request_id: str, expected: int) -> None:
        """One reader is done with ``request_id`` on this worker (push mode's
        bare notification, also used after a push WRITE). Raises NotFound."""
        w = self.rt.worker(engine_id, tp_rank)
        if not 0 < expected <= BOUNDS.max_notifications:
            raise InvalidArgument(f"notify: expected_notifications must be in 1..{BOUNDS.max_notifications}")
        if w.leases.notify(request_id, expected, time.monotonic()):
            self.rt.counters.leases_notified += 1
            self.rt.emit(w, SendDone(request_id))

    def expire(self, now: float) -> None:
        """Ends every lease past its deadline (``SendDone(expired=True)``)."""
        for w in list(self.rt.workers.values()):
            for rid in w.leases.expire(now):
                self.rt.counters.leases_expired += 1
                log.warning("%s request=%s: lease expired, nobody read the blocks", w.label, rid)
                self.rt.emit(w, SendDone(rid, expired=True))
