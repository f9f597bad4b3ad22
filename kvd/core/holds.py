"""Holds: the prefill side's leases on blocks its readers will READ.

A hold starts (or renews) a lease (``kvd.core.leases``); it ends when every
expected reader has notified (a READ's notification, a bare one, or a push
WRITE), when the engine releases it, or when it expires; each end is one
``SendDone`` for the engine. Bad input is a ``CommandRejected``.

A hold is also the source engine's consent to be read (docs/SECURITY.md): a
reader READs another engine's blocks only after that engine's daemon
confirmed a lease on exactly those blocks for that request (a *claim*:
:meth:`Holds.claim` on the source, :meth:`Holds.claim_sources` on the
reader; PeerService.Claim between two daemons, a direct call when the
source is this daemon). Without it, any admitted local user could name
another user's engine id in a LoadBlocks and READ its KV cache.

A reader whose request still waits renews the leases it will read
(:meth:`Holds.renew` on the source, :meth:`Holds.renew_at` on the reader;
PeerService.Renew between two daemons), under the same rule as a
claim: a renewal names the engine, the request and the blocks, and renews
only a lease of that engine's workers that holds those blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from kvd.core.events import (
    CommandRejected,
    CoreError,
    FailureKind,
    InvalidArgument,
    LeaseRenewed,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SendDone,
)
from kvd.core.hold_mirror import HoldMirror
from kvd.core.layout import LayoutError
from kvd.core.leases import notif_pieces, parse_notif
from kvd.core.limits import BOUNDS
from kvd.core.plan import check_block_ids
from kvd.core.runtime import Runtime
from kvd.core.state import PeerLink, Worker
from kvd.core.throttle import Throttled
from kvd.requests import MAX_RENEWAL_GROUPS, BlockGroups, LeaseRenewal, LoadRequest, RenewResult, flat

log = logging.getLogger("kvd.core")

#: A renewed lease's engine learns its new end once the end has moved this
#: many seconds since it last learned one (seconds; its client's own end of
#: a hold is the lease plus a 5 s grace, ``kvd.client.pending``).
TELL_STEP_S = 1.0


def _repeated(groups: BlockGroups) -> str:
    """Why ``groups`` is no hold: a block id twice in one KV-cache group
    (vLLM allocates a request's blocks once each), or "" when none is."""
    for g, ids in enumerate(groups):
        if len(ids) > 1:
            # Sorted, not counted per block: a count array would take 8 bytes
            # per block of the cache (up to 2^24 blocks) for each hold.
            a = np.sort(np.asarray(ids, dtype=np.int64))
            same = np.flatnonzero(a[1:] == a[:-1])
            if same.size:
                bid = a[same[0]]
                return f"block id {int(bid)} repeated in group {g} ({int((a == bid).sum())} times)"
    return ""


def check_renewal_counts(renewals: int, blocks: int, max_blocks_per_request: int, groups: int = 0) -> None:
    """Raises InvalidArgument for a call of ``renewals`` renewals naming
    ``blocks`` block ids in all, the largest in ``groups`` KV-cache groups,
    past the bounds (``BOUNDS.max_renewals_per_call``,
    ``max_blocks_per_request``, :data:`MAX_RENEWAL_GROUPS`). The gRPC
    handlers call it on the counts of the parsed message, before its ids
    become Python lists."""
    if renewals > BOUNDS.max_renewals_per_call:
        raise InvalidArgument(f"renew: {renewals} leases in one call, more than {BOUNDS.max_renewals_per_call}")
    if groups > MAX_RENEWAL_GROUPS:
        raise InvalidArgument(f"renew: a lease renewed in {groups} groups, more than {MAX_RENEWAL_GROUPS}")
    if blocks > max_blocks_per_request:
        raise InvalidArgument(f"renew: {blocks} block ids in one call, more than "
                              f"{max_blocks_per_request} (max_blocks_per_request)")


class Holds:
    """Leases of every prefill worker (``Worker.leases``), and the claims on them.

    Args:
        rt: the core's shared state.
        link: reaches remote daemons (claims on their holds; None: none).
        own_address: this daemon's peer address (a claim on a worker of this
            daemon is answered without a call).
        mirror: the followed holds of remote engines (``kvd.core.hold_mirror``):
            a source rank they show holding the blocks is not asked.
    """

    def __init__(self, rt: Runtime, link: PeerLink | None = None, own_address: str = "",
                 mirror: HoldMirror | None = None):
        self.rt = rt
        self.link = link
        self.own_address = own_address
        self.mirror = mirror
        # Any peer that loaded a source's agent can send malformed
        # notifications as fast as it likes: a line each would flood the log.
        self._malformed = Throttled(log)
        self.waiting_claims = 0  # claims waiting for a hold now (BOUNDS.max_waiting_claims)
        self.waiting_claim_ids = 0  # the block ids they carry (BOUNDS.max_waiting_claim_ids)

    def hold(self, w: Worker, request_id: str, groups: BlockGroups, lease_s: float = 0.0) -> None:
        """Holds ``groups`` (block ids per KV-cache group) of ``request_id``
        for its readers: a lease (``kvd.core.leases``).

        ``lease_s`` 0 means the daemon default; capped at ``max_lease_s``. A
        second hold of the same request and blocks renews the lease. Emits
        ``CommandRejected`` on bad input (more groups than the worker's
        regions use, an id out of range or repeated within a group, more
        than ``max_blocks_per_request`` ids, past
        ``max_leases_per_worker`` leases or ``max_held_blocks_per_worker``
        ids held), ``SendDone`` when the lease ends.
        """
        emit, limits = self.rt.emit, self.rt.limits
        if not request_id:
            emit(w, CommandRejected("", "hold: request_id is empty"))
            return
        if len(groups) > w.num_groups:
            # The caps below count block ids; a lease keeps an array per
            # group, so empty groups (2 bytes each on the wire) cost the
            # daemon ~180 bytes each for the lease's life.
            emit(w, CommandRejected(request_id, f"hold: block ids for {len(groups)} KV-cache groups, the "
                                                f"worker's regions use {w.num_groups}"))
            return
        ids = flat(groups)
        if len(ids) > limits.max_blocks_per_request:
            emit(w, CommandRejected(request_id, "hold: too many blocks"))
            return
        try:
            # Python's min/max on the list: numpy's conversion cost ~5 % of a
            # prefill daemon's loop with 64 one-block holds a batch (py-spy).
            check_block_ids(ids, w.layout.num_blocks)
        except LayoutError as e:
            emit(w, CommandRejected(request_id, f"hold: {e}"))
            return
        repeated = _repeated(groups)
        if repeated:
            emit(w, CommandRejected(request_id, f"hold: {repeated}"))
            return
        if request_id not in w.leases.leases:
            if len(w.leases) >= limits.max_leases_per_worker:
                emit(w, CommandRejected(request_id, f"hold: {limits.max_leases_per_worker} leases held already "
                                                    f"(max_leases_per_worker)"))
                return
            if w.leases.held_blocks + len(ids) > limits.max_held_blocks_per_worker:
                emit(w, CommandRejected(request_id, f"hold: {len(ids)} more block ids would pass the "
                                                    f"{limits.max_held_blocks_per_worker} this worker may hold "
                                                    f"({w.leases.held_blocks} held; max_held_blocks_per_worker)"))
                return
        now = time.monotonic()
        lease_s = min(lease_s if lease_s > 0 else limits.lease_s, limits.max_lease_s)
        result = w.leases.hold(request_id, groups, now + lease_s, now)
        w.hold_added.set()  # a waiting claim wakes; one that waits next takes a fresh event (claim)
        if result == "conflict":
            emit(w, CommandRejected(request_id, "hold: request already holds other blocks"))
        elif result == "done":
            self.rt.counters.leases_notified += 1
            emit(w, SendDone(request_id))
            self.rt.lines.info(("notified before the hold", w.key),
                               "%s request=%s: readers notified before the hold; blocks freed", w.label, request_id)

    def release(self, w: Worker, request_id: str) -> None:
        """Ends a lease now (the request was aborted); emits ``SendDone(released)``."""
        if not w.leases.release(request_id):
            self.rt.emit(w, CommandRejected(request_id, "release: no lease for this request"))
            return
        self.rt.counters.leases_released += 1
        self.rt.emit(w, SendDone(request_id, released=True))

    def on_notif(self, w: Worker, remote_agent: str, msg: bytes) -> int:
        """A NIXL notification from ``remote_agent`` (a reader's READ, or a
        bare one): one piece per load it notifies (``kvd.core.leases``).
        Returns how many pieces it held (for a malformed one, ignored whole,
        those its parse walked): the progress loop's budget per pass counts
        pieces."""
        parsed = parse_notif(msg)
        if parsed is None:
            self._malformed.warning("%s: malformed notification from %s ignored (%d bytes)", w.label, remote_agent,
                                    len(msg))
            return notif_pieces(msg)
        now = time.monotonic()
        for request_id, expected in parsed:
            if w.leases.notify(request_id, expected, now):
                self.rt.counters.leases_notified += 1
                log.debug("%s request=%s: every reader notified; lease ended", w.label, request_id)
                self.rt.emit(w, SendDone(request_id))
        return len(parsed)

    def notify(self, engine_id: str, tp_rank: int, request_id: str, expected: int) -> None:
        """One reader is done with ``request_id`` on this worker (push mode's
        bare notification, also used after a push WRITE). Raises NotFound."""
        w = self.rt.worker(engine_id, tp_rank)
        if not 0 < expected <= BOUNDS.max_notifications:
            raise InvalidArgument(f"notify: expected_notifications must be in 1..{BOUNDS.max_notifications}")
        if w.leases.notify(request_id, expected, time.monotonic()):
            self.rt.counters.leases_notified += 1
            self.rt.emit(w, SendDone(request_id))

    async def claim(self, engine_id: str, tp_rank: int, request_id: str, groups: BlockGroups,
                    wait_s: float = 0.0) -> None:
        """Source side: returns once worker ``(engine_id, tp_rank)`` holds a
        lease of ``request_id`` covering ``groups`` (block ids per KV-cache
        group; a subset of the held ones), waiting up to ``wait_s`` seconds
        (capped at ``BOUNDS.max_claim_wait_s``) for a hold still on its way.

        Raises:
            NotFound: no such worker here.
            InvalidArgument: more blocks than ``max_blocks_per_request``.
            PermissionDenied: no such lease by the end of the wait.
            ResourceExhausted: the claim would wait while
                ``BOUNDS.max_waiting_claims`` claims, or claims with
                ``BOUNDS.max_waiting_claim_ids`` block ids in all, wait here.
        """
        w = self.rt.worker(engine_id, tp_rank)
        n = len(flat(groups))
        if n > self.rt.limits.max_blocks_per_request:
            raise InvalidArgument(f"claim: more than {self.rt.limits.max_blocks_per_request} blocks")
        # NaN, negative or infinite from a peer: no wait, or the cap.
        t0 = time.monotonic()
        deadline = t0 + (min(wait_s, BOUNDS.max_claim_wait_s) if wait_s > 0 else 0.0)
        waited = False
        try:
            while not w.leases.covers(request_id, groups):
                left = deadline - time.monotonic()
                # A lease of the request that lacks these blocks will not grow
                # (a second hold of other blocks is refused): no use waiting.
                if left <= 0 or self.rt.workers.get(w.key) is not w or request_id in w.leases.leases:
                    raise PermissionDenied(f"claim: engine {engine_id!r} rank {tp_rank} holds no lease on those "
                                           f"blocks for request {request_id!r}")
                if not waited:
                    if (self.waiting_claims >= BOUNDS.max_waiting_claims
                            or self.waiting_claim_ids + n > BOUNDS.max_waiting_claim_ids):
                        raise ResourceExhausted(
                            f"claim: {self.waiting_claims} claims with {self.waiting_claim_ids} block ids wait for "
                            f"holds here already (at most {BOUNDS.max_waiting_claims} claims and "
                            f"{BOUNDS.max_waiting_claim_ids} ids); request {request_id!r} is not held yet")
                    waited = True
                    self.waiting_claims += 1
                    self.waiting_claim_ids += n
                if w.hold_added.is_set():
                    # Set by a hold before this check, which saw it: stale. A
                    # fresh event per wait, not per hold (a hold made one each,
                    # ~1 % of a prefill daemon's samples with 64 holds a batch).
                    w.hold_added = asyncio.Event()
                try:
                    async with asyncio.timeout(left):
                        await w.hold_added.wait()
                except TimeoutError:
                    pass
        finally:
            if waited:
                self.waiting_claims -= 1
                self.waiting_claim_ids -= n
        if waited:
            # A reader asked before the engine's hold came (vLLM sends it a
            # step after answering P's request): part of that load's time; a
            # long wait (an engine slow to step) is worth an INFO line.
            spent = time.monotonic() - t0
            log.log(logging.INFO if spent > 0.1 else logging.DEBUG,
                    "%s request=%s: claimed after waiting %.1f ms for the engine's hold", w.label, request_id,
                    1e3 * spent)

    def unshown(self, req: LoadRequest, ranks) -> list[int]:
        """Those of source ``ranks`` of ``req`` whose hold is not known to
        cover the request's blocks: the ones to claim. A remote source's
        holds are known from the followed holds (``kvd.core.hold_mirror``); a
        source on this daemon's from its own leases, read here (the same
        check its claim makes first: a claim is a task, ~0.2 ms of loop
        passes a load here, docs/PERFORMANCE.md "twelfth round")."""
        if req.remote_address == self.own_address:
            workers = self.rt.workers
            return [p for p in ranks if (s := workers.get((req.remote_engine_id, p))) is None
                    or not s.leases.covers(req.remote_request_id, req.remote_groups)]
        if self.mirror is None:
            return list(ranks)
        left = [p for p in ranks if not self.mirror.covers(req.remote_address, req.remote_engine_id, p,
                                                           req.remote_request_id, req.remote_groups)]
        self.rt.counters.claims_followed += len(ranks) - len(left)
        return left

    def notified(self, address: str, engine_id: str, tp_rank: int, request_id: str, expected: int) -> None:
        """This daemon sent source rank ``tp_rank`` one of the ``expected``
        notifications of ``request_id`` (a READ's, or a bare one): the
        followed holds drop a lease once this daemon sent them all
        (``HoldMirror.notified``)."""
        if self.mirror is not None:
            self.mirror.notified(address, engine_id, tp_rank, request_id, expected)

    def _foreign_denied(self, w: Worker, req: LoadRequest) -> None:
        """A same-node load of another uid's engine was denied: said apart from
        the load's own failure line (keyed by the source engine), so that the
        engine's flood of its own not_held loads cannot hide it (attacker
        review: 469 such probes among 23k loads, none logged)."""
        src = next((s for k, s in self.rt.workers.items() if k[0] == req.remote_engine_id), None)
        mine = w.owner.uid if w.owner is not None else None
        theirs = src.owner.uid if src is not None and src.owner is not None else None
        if src is not None and theirs != mine:
            self.rt.lines.warning(("foreign not_held", w.key, req.remote_engine_id),
                                  "%s (uid %s) request=%s: asked to read blocks of engine %s (uid %s) it holds none "
                                  "of for request %s; no READ", w.label, mine, req.request_id,
                                  req.remote_engine_id, theirs, req.remote_request_id)

    async def claim_sources(self, w: Worker, req: LoadRequest, ranks, deadline: float
                            ) -> tuple[FailureKind, str] | None:
        """Reader side, before any READ of ``req``: every source rank in
        ``ranks`` holds ``req.remote_groups`` for ``req.remote_request_id``.

        A rank whose hold the followed holds show (``kvd.core.hold_mirror``),
        now or within the next answers (``HoldMirror.wait_shown``, at most
        ``SHOWN_WAIT_S``), is not asked; every other rank gets one claim, all at once (a direct
        call when the source is this daemon, PeerService.Claim otherwise),
        each within ``deadline`` (monotonic seconds). Returns None, or
        ``(kind, reason)`` for ``LoadFailed``: ``not_held`` when a source
        denies, ``handshake`` when it cannot be asked.
        """
        local = req.remote_address == self.own_address
        ranks = self.unshown(req, ranks)
        if ranks and not local and self.mirror is not None:
            shown = len(ranks)
            ranks = await self.mirror.wait_shown(req.remote_address, req.remote_engine_id, ranks,
                                                 req.remote_request_id, req.remote_groups, deadline - 0.1)
            self.rt.counters.claims_followed += shown - len(ranks)
        if not ranks:
            return None
        wait_s = min(BOUNDS.max_claim_wait_s, max(0.0, deadline - time.monotonic() - 0.1))

        async def one(p: int) -> None:
            if local:
                await self.claim(req.remote_engine_id, p, req.remote_request_id, req.remote_groups, wait_s)
            elif self.link is None:
                raise NotFound("this daemon has no peer client")
            else:
                self.rt.counters.claims_sent += 1
                await self.link.claim(req.remote_address, req.remote_engine_id, p, req.remote_request_id,
                                      req.remote_groups, wait_s, max(0.1, deadline - time.monotonic()))

        sent = time.monotonic()
        results = await asyncio.gather(*(one(p) for p in ranks), return_exceptions=True)
        # kvd_claim_duration_seconds: a claim's own time, sent to answered
        # (granted or denied; not the wait for the copy before it, a load
        # that sent none, or a claim that could not be asked).
        if not any(isinstance(e, BaseException) and not isinstance(e, PermissionDenied) for e in results):
            self.rt.on_event("claim", {"seconds": time.monotonic() - sent})
        for e in results:
            if isinstance(e, PermissionDenied):  # logged as the load fails (Runtime.fail_load)
                if local:
                    self._foreign_denied(w, req)
                return FailureKind.NOT_HELD, f"not_held: {e}"
            if isinstance(e, CoreError):
                return FailureKind.HANDSHAKE, f"handshake: claim: {e}"
            if isinstance(e, BaseException):
                raise e
        return None

    def _check_renewals(self, renewals: list[LeaseRenewal]) -> None:
        """Raises InvalidArgument for a batch past the bounds (both sides
        check: a local caller's batch is refused before any peer call)."""
        check_renewal_counts(len(renewals), sum(len(flat(r.groups)) for r in renewals),
                             self.rt.limits.max_blocks_per_request, max((len(r.groups) for r in renewals), default=0))
        for r in renewals:
            if not r.request_id or len(r.request_id.encode()) > BOUNDS.max_id_bytes:
                raise InvalidArgument(f"renew: request_id empty or longer than {BOUNDS.max_id_bytes} bytes")

    def renew(self, engine_id: str, renewals: list[LeaseRenewal]) -> list[RenewResult]:
        """Source side: renews, on every TP rank of ``engine_id`` registered
        here, the lease of each renewal's request that holds its blocks
        (``LeaseTable.renew``: a full lease from now, capped at the lease's
        start plus ``min(max_lease_life_s, max_lease_s)``), and tells each
        renewed worker's engine (``LeaseRenewed``). One result per
        renewal, same order; a request no rank holds those blocks for is
        ``reason="not_held"`` (not an error for the batch).

        Raises:
            NotFound: no worker of ``engine_id`` here.
            InvalidArgument: more than ``BOUNDS.max_renewals_per_call``
                renewals, more than ``max_blocks_per_request`` block ids in
                all, or an empty or over-long request id.
        """
        self._check_renewals(renewals)
        workers = [w for (eid, _), w in list(self.rt.workers.items()) if eid == engine_id]
        if not workers:
            raise NotFound(f"renew: engine {engine_id!r} is not registered here")
        now = time.monotonic()
        life_s = min(self.rt.limits.max_lease_life_s, self.rt.limits.max_lease_s)
        out = []
        done: dict[tuple, RenewResult] = {}  # a request named again in one call is answered, not renewed again
        for r in renewals:
            key = (r.request_id, tuple(map(tuple, r.groups)))
            if key in done:
                out.append(done[key])
                continue
            left = []
            for w in workers:
                x = w.leases.renew(r.request_id, r.groups, now, life_s)
                if x is not None:
                    left.append(x)
                    # The engine ends a hold itself at its lease plus a grace
                    # (kvd.client.pending): it must learn the new end, but
                    # not of every renewal: one event per TELL_STEP_S moved
                    # at most (its grace is 5 s), so renewals cannot push the
                    # engine's other events out of its queue.
                    if w.leases.tell(r.request_id, TELL_STEP_S):
                        self.rt.emit(w, LeaseRenewed(r.request_id, x))
            self.rt.counters.leases_renewed += len(left)
            out.append(RenewResult(r.request_id, min(left)) if left else RenewResult(r.request_id, 0.0, "not_held"))
            done[key] = out[-1]
        log.debug("engine %s: %d of %d leases renewed", engine_id, sum(r.renewed for r in out), len(out))
        return out

    async def renew_at(self, address: str, engine_id: str, renewals: list[LeaseRenewal],
                       timeout_s: float) -> list[RenewResult]:
        """Reader side: renews ``renewals`` of engine ``engine_id`` at the
        daemon at ``address`` (this daemon's own holds without a call when
        it is this one; the caller resolved aliases first), within
        ``timeout_s`` seconds. Raises what :meth:`renew` raises, and
        ``PeerUnavailable`` when the peer cannot be asked."""
        self._check_renewals(renewals)
        if address == self.own_address:
            return self.renew(engine_id, renewals)
        if self.link is None:
            raise NotFound("this daemon has no peer client")
        return await self.link.renew(address, engine_id, renewals, timeout_s)

    def expire(self, now: float) -> None:
        """Ends every lease past its deadline (``SendDone(expired=True)``)."""
        for w in list(self.rt.workers.values()):
            for rid in w.leases.expire(now):
                self.rt.counters.leases_expired += 1
                # One line a second per worker, with the count: an engine may
                # send holds of any short lease at will (attacker review: 18,200
                # lines of 4 KiB in 10 s); kvd_leases_expired_total counts each.
                self.rt.lines.warning(("lease expired", w.key), "%s request=%s: lease expired, nobody read the blocks",
                                      w.label, rid)
                self.rt.emit(w, SendDone(rid, expired=True))
