"""Pull: the decode side's load path (docs/DESIGN.md "Transfer protocol").

A :class:`~kvd.requests.LoadRequest` arrives from the engine's session; the
load handshakes once per (local worker, source rank) pair (``kvd.core.peers``),
then posts one NIXL READ per source rank the plan reads from, each with a
notification naming the remote request; source ranks it does not read from
get a bare notification. The progress loop (``kvd.core.progress``) polls the
READs and calls :meth:`Pull.finish`: ``RecvDone``, or ``LoadFailed`` naming
the local block ids. In push mode the same checks run, then
``kvd.core.push`` asks the source ranks to WRITE. A same-node load (the
request names this daemon's own peer address and its source ranks are
registered here) is copied by ``kvd.core.local_copy`` instead, in either
mode, after the same checks (``Limits.same_node_copy``).
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvd import tracepoints as tp
from kvd.core import coalesce, plan, settle
from kvd.core.events import (
    CommandRejected,
    FailureKind,
    Incompatible,
    InvalidArgument,
    NotFound,
    PeerUnavailable,
    RecvDone,
)
from kvd.core.holds import Holds
from kvd.core.layout import LayoutError
from kvd.core.leases import notif_message
from kvd.core.limits import BOUNDS
from kvd.core.local_copy import LocalCopy
from kvd.core.nixl_agent import NixlAgent, NixlError
from kvd.core.peers import Peers
from kvd.core.push import Push
from kvd.core.registry import Registry
from kvd.core.runtime import Runtime
from kvd.core.state import PEER_CALLER, InflightLoad, RemoteWorker, Worker, owner_uid
from kvd.core.throttle import Throttled
from kvd.core.transfer_mode import TransferModes
from kvd.logtext import clip
from kvd.requests import LoadRequest

log = logging.getLogger("kvd.core")

K = FailureKind


def _caller_uid(w: Worker, uid: int | None) -> int:
    """``uid`` (a session's caller), else the uid of ``w``'s owner (-1: none)."""
    return uid if uid is not None else owner_uid(w)


class _PushInstead(Exception):
    """Raised inside a pull's handshake-to-post span: its source said a READ
    from it is TCP's (``Pull._source_says_push``); the load goes on as a
    push (``Pull._pushed``)."""


class Pull:
    """Loads of every decode worker (``Worker.inflight``, ``Worker.pending_loads``).

    Args:
        rt: the core's shared state.
        peers: handshakes and remote workers.
        push: the push-mode reader side, for the loads
            ``kvd.core.transfer_mode`` makes pushes.
        local: same-node loads (the source registered with this daemon),
            which it copies itself (``kvd.core.local_copy``) in either mode.
        holds: claims on the sources' holds before any READ.
        registry: replaces a worker's NIXL agent to stop a READ that does
            not end when its load must (``kvd.core.settle``).
        modes: decides whether a load is a pull or a push (the node's, which
            its ``peers`` read too).
    """

    def __init__(self, rt: Runtime, peers: Peers, push: Push, local: LocalCopy, holds: Holds, registry: Registry,
                 modes: TransferModes):
        self.rt = rt
        self.registry = registry
        self.peers = peers
        self.push = push
        self.local = local
        self.holds = holds
        self.reads = coalesce.CoalescedReads(rt, self._post)
        self.modes = modes
        self._tcp_reads_warning = Throttled(log, interval_s=60.0)  # a request names the source: one line for all

    async def load(self, w: Worker, req: LoadRequest, *, retry_deadline: float | None = None,
                   epoch: int | None = None, uid: int | None = None) -> None:
        """Pulls ``req.remote_groups`` into ``req.local_groups``; emits
        ``RecvDone`` or ``LoadFailed`` (naming every local block id). The
        caller has refused ``req`` if :meth:`refusal` names a reason.

        ``epoch``: the worker's session epoch when the load's command was
        read (None: the current one). A load whose session ended before it
        started is dropped: its engine has already counted it failed (the
        shim fails every load of a broken session) and may reuse its blocks.

        ``uid``: the caller uid of the session that sent it (None: the
        worker's owner's). A load with no remote block ids tells the source
        to free in one of that uid's abort slots (``kvd.core.aborts``), or,
        with none free, not at all (its lease ends it; logged).

        ``retry_deadline``: this is the one second try of a load whose READ
        failed on a cached remote agent (the peer may have restarted with a
        new agent); it keeps the first try's deadline and is not tried again.

        Never raises: an unexpected error (a bug, or peer input no check
        foresaw) still ends the request with ``LoadFailed``, so no request
        is left without an answer.
        """
        tp.hit(tp.LOAD, req.request_id)
        # Its own task: the peer calls it makes (and the handshakes it starts)
        # spend its caller's first contacts (kvd.core.state.PEER_CALLER).
        PEER_CALLER.set(_caller_uid(w, uid))
        try:
            await self._load(w, req, retry_deadline, epoch, uid)
        except Exception as e:
            log.exception("%s request=%s: load failed unexpectedly", w.label, req.request_id)
            w.pending_loads.pop(req.request_id, None)
            w.posting.pop(req.request_id, None)
            if req.request_id not in w.inflight:
                self.rt.fail_load(w, req.request_id, req.local_block_ids, K.INTERNAL,
                                  f"internal: {type(e).__name__}: {e}", req.remote_address)

    def _paired(self, w: Worker, req: LoadRequest, ranks: list[int]) -> bool:
        """Whether ``req``'s source is this daemon or every rank of ``ranks``
        is paired with ``w`` already (:meth:`kvd.core.peers.Peers.remotes`'s
        cache): a claim may then go out before the pairs are looked up."""
        if req.remote_address == self.holds.own_address:
            return True
        made = w.pairs.remotes
        return all((req.remote_address, req.remote_engine_id, p) in made for p in ranks)

    def _free_early(self, w: Worker, req: LoadRequest, uid: int | None, make) -> None:
        """Runs ``make()``, which tells ``req``'s source to free its blocks
        now, in an abort slot of ``uid`` (``kvd.core.aborts``: the slots of
        AbortLoad commands; each may wait a handshake timeout, so unbounded
        they pile up); with none free the source is not told (its lease
        ends the hold), said at most once a second."""
        refused = self.rt.aborts.start(_caller_uid(w, uid), make)
        if refused:
            self.rt.dropped_warning.warning("%s request=%s: %s not told to free %s now (its lease ends it): %s",
                                            w.label, req.request_id, req.remote_address, req.remote_request_id,
                                            refused)

    def refusal(self, w: Worker, req: LoadRequest) -> str | None:
        """Why ``req`` can never load into ``w`` (an ``"invalid: ..."``
        reason, its kind ``FailureKind.INVALID``), or None: more block ids a
        side than ``max_blocks_per_request``, block ids for more KV-cache
        groups than ``w``'s regions use, a local block id out of range, a
        remote TP size past ``BOUNDS.max_tp_size``. A load with no remote
        block ids is never refused (it is answered ``RecvDone`` and its
        source told to free, :meth:`load`).

        None of it depends on what happens while a load waits, so the
        session runs it as it reads the command, before the load's task
        exists: its cost, linear in the block ids, is the command's, which
        the command socket bounds per pass and shares out by caller uid
        (``kvd.daemon.command_socket``); in the task it was not (loads of
        1M ids, the bad one last, took ``kvd health`` to 0.7 s past those
        bounds, docs/SECURITY.md). Local input is checked before any
        network or NIXL call.
        """
        if not any(req.remote_groups):
            return None
        limit = self.rt.limits.max_blocks_per_request
        if max(sum(map(len, req.local_groups)), sum(map(len, req.remote_groups))) > limit:
            return f"invalid: more than {limit} blocks"
        if max(len(req.local_groups), len(req.remote_groups)) > w.num_groups:  # kept while the load waits
            return (f"invalid: block ids for {len(req.local_groups)} local / {len(req.remote_groups)} remote "
                    f"KV-cache groups, the worker's regions use {w.num_groups}")
        try:
            for g in req.local_groups:
                plan.check_block_ids(g, w.layout.num_blocks)
        except LayoutError as e:
            return f"invalid: local {e}"
        if req.remote_tp_size > BOUNDS.max_tp_size:
            return f"invalid: remote TP size {req.remote_tp_size} exceeds {BOUNDS.max_tp_size}"
        return None

    def _fail(self, w: Worker, req: LoadRequest, kind: FailureKind, reason: str) -> None:
        self.rt.fail_load(w, req.request_id, req.local_block_ids, kind, reason, req.remote_address)

    async def _pushed(self, w: Worker, req: LoadRequest, remote_tp: int, read_from, notify, started: float,
                      deadline: float, epoch: int, decided: bool = False) -> bool:
        """Decides whether the load is a push (``TransferModes.pushes``,
        which may resolve a name; ``decided``: it is one) and, if so, makes
        it. True: the load is done with (pushed, failed, or its session
        ended meanwhile); False: :meth:`_load` goes on with a pull."""
        rid = req.request_id
        w.pushes[rid] = []  # from here on, Pull.cancel looks at the orders a push sends
        push = failure = None
        try:
            push = decided or await self.modes.pushes(req.remote_address)
            if push and w.session.epoch == epoch and self.rt.registered(w):
                failure = await self.push.load(w, req, remote_tp, read_from, notify, started, deadline, epoch)
        finally:
            # Agents a WRITE may still target: its order sent, not answered.
            unsettled = {o.reader.agent_name for o in w.pushes.pop(rid, ()) if o.sent and not o.settled}
        if w.session.epoch != epoch or not self.rt.registered(w):
            # Ended meanwhile: its engine counted the load failed with its
            # session (the shim fails every load of a broken stream).
            w.pending_loads.pop(rid, None)
            return True
        if not push:
            return False
        w.pending_loads.pop(rid, None)
        if failure is not None:
            # A source's WRITE may still be going on into these blocks,
            # which vLLM reuses once told they failed. (None unanswered:
            # nothing can come; a replacement would only cost the worker's
            # other transfers.)
            if unsettled and not await settle.stop_writes_into(
                    self.rt, self.registry, w, f"request {rid}: push failed ({failure[1]})", unsettled):
                log.error("%s request=%s: a WRITE of the failed push may still land in its blocks (the agent it "
                          "targets could not be destroyed)", w.label, rid)
            self._fail(w, req, *failure)
        return True

    async def _source_says_push(self, req: LoadRequest, remotes: dict[int, RemoteWorker],
                                read_from: list[int]) -> bool:
        """``auto``, a pull: True when a source rank's handshake said a READ
        from it is TCP's (``RemoteWorker.read_transport``) and that makes
        loads from its address pushes (``TransferModes.pushes``). News only
        (``TransferModes.learn``): a load from a source already known costs
        a dict lookup a rank."""
        news = said = False
        for p in read_from:
            if self.modes.learn(req.remote_address, remotes[p].read_transport):
                news, said = True, remotes[p].read_transport
        if not news or not await self.modes.pushes(req.remote_address):
            return False
        # One key of its own: a request names the address, so fresh ones could come at will.
        self.rt.lines.info(("transfer mode source",), "transfer mode auto: loads from %s are pushes (its handshake "
                           "says a READ from it is TCP's software GET: read_transport %s)",
                           clip(req.remote_address, 100), said)
        return True

    def _warn_if_reads_are_tcp(self, req: LoadRequest, remotes: dict[int, RemoteWorker], read_from: list[int]) -> None:
        """``pull`` set, a new pair: a WARNING (at most one a minute) when
        its source's handshake says a READ from it is TCP's software GET,
        which this daemon's startup check cannot see (the source's
        ``UCX_TLS``; a source without RDMA where this host has some)."""
        said = {remotes[p].read_transport for p in read_from} & self.modes.tcp_reads_said
        if said:
            self._tcp_reads_warning.warning(
                "transfer mode pull: loads from %s READ over TCP (its handshake says a READ from it is UCX's software "
                "GET: read_transport %s), and UCX 1.23 crashes that source when a reader dies in the middle of one; "
                "set transfer_mode = auto or push (docs/OPERATIONS.md, \"Transfer mode\")",
                clip(req.remote_address, 100), "tcp" if "tcp" in said else "tcp-between-hosts")

    async def _load(self, w: Worker, req: LoadRequest, retry_deadline: float | None,
                    epoch: int | None = None, uid: int | None = None) -> None:
        """See :meth:`load`. Block ids come per KV-cache group:
        ``remote_groups[g][i]`` fills slot ``i % k`` of local block
        ``local_groups[g][i // k]`` (``k`` = local / remote block size).
        Reads from every source rank the plan needs (``remote_tp_size`` 0
        means the local TP size) and notifies all overlapping ones."""
        rid = req.request_id
        started = time.monotonic()
        if epoch is None:
            epoch = w.session.epoch
        elif epoch != w.session.epoch:
            self.rt.counters.transfers_failed += 1  # as a load whose session ended while posting
            self.rt.lines.info(("dropped", w.key), "%s request=%s: session ended before the load started; load "
                               "dropped", w.label, rid)
            return
        deadline = retry_deadline or started + self.rt.timeout(req.timeout_s)
        if not rid or rid in w.inflight or (rid in w.pending_loads and retry_deadline is None):
            self.rt.emit(w, CommandRejected(rid, "load: empty or duplicate request_id"))
            return
        if self.rt.draining and retry_deadline is None:
            return self._fail(w, req, K.DRAINING, "draining: daemon is shutting down")
        if not any(req.remote_groups):
            # Nothing to move (a full local prefix hit, or the request ended
            # before its load): done at once, and the source is told nobody
            # will read, so it frees its blocks now rather than at lease end.
            self.rt.emit(w, RecvDone(rid, 0, 0, 0, 0.0))
            if req.remote_request_id and req.remote_address:
                self._free_early(w, req, uid, lambda: self.abort_load(
                    w, rid, req.remote_engine_id, req.remote_address, req.remote_request_id, req.remote_tp_size))
            return
        if len(w.inflight) + len(w.pending_loads) >= self.rt.limits.max_inflight_per_worker:
            return self._fail(w, req, K.BUSY, "busy: too many loads in flight for this worker")
        remote_tp = req.remote_tp_size or w.tp_size
        heads = w.layout.model_kv_heads(w.tp_size)  # the model's: Geometry.total_kv_heads
        mla = w.layout.kv_layout == "MLA"
        try:
            read_from, notify = plan.source_ranks(w.key[1], w.tp_size, remote_tp, heads, mla)
        except plan.PlanError as e:
            return self._fail(w, req, K.INCOMPATIBLE, f"incompatible: {e}")
        w.pending_loads[rid] = req.remote_address
        sources = self.local.sources(w, req, notify)
        if sources is not None:
            try:
                result = await self.local.load(w, req, sources, remote_tp, read_from, notify, deadline)
            finally:
                w.pending_loads.pop(rid, None)
            if result is not None and isinstance(result[0], FailureKind):
                self._fail(w, req, *result)
            elif result is not None:
                self._recv_done(w, req, *result, time.monotonic() - started)
            return
        if self.modes.fixed is not False:  # (pull set: no decision to make)
            if await self._pushed(w, req, remote_tp, read_from, notify, started, deadline, epoch):
                return
        elif not self.rt.registered(w):  # as _pushed does: unregistered while Node.load resolved its address
            w.pending_loads.pop(rid, None)
            return

        def expected(p: int) -> int:
            return plan.expected_notifications(p, remote_tp, w.tp_size, heads, mla)

        posted: list[tuple[object, RemoteWorker]] = []
        nbytes = ndescs = 0
        posts_s = 0.0
        fresh_any = False
        err: tuple[FailureKind, str] | None = None
        remotes: dict[int, RemoteWorker] = {}
        in_flight = False  # a coalesced READ put this load in w.inflight (kvd.core.coalesce)
        push_instead = False
        # A claim only asks (no lease changes on the source), so it is sent
        # now and its round trip overlaps the remote workers and the plan:
        # it is the largest daemon-side piece of a small load
        # (docs/PERFORMANCE.md, "Per-load cost, third round"). Only to a
        # source this worker is paired with (or this daemon): a new
        # address is claimed after its handshake, which vets it (with no
        # credential, a daemon of this host only) and finds a dead one
        # without a gRPC call; sent ahead, every load from a dead prefill
        # node made a Claim call there, and 512 such loads in flight kept
        # the daemon's gRPC from answering health for as long as they came
        # (review; tests/test_reliability_peers.py).
        tp.hit(tp.CLAIM, rid)
        # Ranks whose hold the followed holds show need no claim (kvd.core.hold_mirror).
        unshown = self.holds.unshown(req, read_from)
        claim = asyncio.ensure_future(self.holds.claim_sources(w, req, unshown, deadline)) \
            if unshown and self._paired(w, req, unshown) else None
        try:
            try:
                remotes, fresh_any = await self.peers.remotes(w, req.remote_address, req.remote_engine_id, notify,
                                                              remote_tp, deadline)
            except Incompatible as e:
                # Nobody will ever read these blocks: free them on the source
                # now (by gRPC: there is no NIXL pair), not at its lease's end;
                # one task walking the ranks (an engine names how many ranks:
                # one task per rank made 4,272 calls in flight from 20 loads,
                # attacker review).
                async def notify_all() -> None:
                    for p in notify:
                        await self.peers.notify_by_rpc(req.remote_address, req.remote_engine_id, p,
                                                       req.remote_request_id, expected(p), deadline, w.label)

                self._free_early(w, req, uid, notify_all)
                return self._fail(w, req, K.HANDSHAKE, f"handshake: {e}")
            except (NotFound, PeerUnavailable, InvalidArgument) as e:
                return self._fail(w, req, K.HANDSHAKE, f"handshake: {e}")
            if not self.rt.registered(w):
                return self._fail(w, req, K.UNREGISTERED, "worker unregistered")
            if w.session.epoch != epoch:
                self.rt.lines.info(("dropped", w.key), "%s request=%s: session ended during the handshake; load "
                                   "dropped", w.label, rid)
                return
            if self.modes.fixed is None and await self._source_says_push(req, remotes, read_from):
                raise _PushInstead  # before any READ: a READ from it would be TCP's software GET
            if fresh_any and self.modes.setting == "pull":
                self._warn_if_reads_are_tcp(req, remotes, read_from)
            checked = {}
            for p in read_from:  # the request's block ids are checked against both layouts before any READ
                r = remotes[p]
                try:
                    checked[p] = plan.check_request(req.local_groups, req.remote_groups, w.layout.num_blocks,
                                                    r.layout.num_blocks, r.k, r.region_groups)
                except LayoutError as e:
                    return self._fail(w, req, K.INVALID, f"invalid: {e}")
            # No READ of another engine's blocks without its hold on them (docs/SECURITY.md).
            if claim is not None:
                denied = await claim
            else:  # sent now, to a source this handshake just paired (or none needed)
                denied = await self.holds.claim_sources(w, req, unshown, deadline) if unshown else None
            tp.hit(tp.CLAIMED, rid)
            if denied or not self.rt.registered(w):
                return self._fail(w, req, *(denied or (K.UNREGISTERED, "worker unregistered")))
            if w.session.epoch != epoch:
                return
            # Rows after the claim: a load waiting for its hold (up to
            # max_claim_wait_s) keeps only its block ids, not regions x
            # blocks x chunks of rows (docs/SECURITY.md, "Limits").
            chunks = {p: plan.checked_indices(*checked[p], remotes[p].num_regions, w.layout.num_blocks,
                                              remotes[p].layout.num_blocks, remotes[p].k, remotes[p].C,
                                              remotes[p].region_groups) for p in read_from}
            # Pull.cancel waits for it: a post may be queued on the NIXL
            # thread; its remotes are not freed meanwhile (Peers._read_users).
            w.posting[rid] = tuple(remotes[p] for p in read_from)
            retry = not fresh_any and retry_deadline is None
            joined = False  # one transfer with the other small loads of this pass (kvd.core.coalesce)
            if len(read_from) == 1 and w.session.epoch == epoch:
                p = read_from[0]
                r, (lidx, ridx) = remotes[p], chunks[p]
                size = r.transfer_bytes(req.remote_groups)
                # Alone: a second try (its deadline is older than the others'),
                # and a load no other load of its worker could join now (no
                # other load task of the worker running: Worker.loads_started),
                # which then waits for no pass of the loop.
                joined = retry_deadline is None and w.loads_started > 1 \
                    and coalesce.CoalescedReads.fits(read_from, notify, size)
            if joined:
                local, remote = r.lists
                outcome, value = await self.reads.read(
                    w, epoch, r, local, remote, req, lidx, ridx,
                    notif_message(req.remote_request_id, expected(p)), size, started, deadline, retry)
                if outcome == coalesce.FAILED:
                    err = value
                elif outcome != coalesce.DROPPED:
                    self.holds.notified(req.remote_address, req.remote_engine_id, p, req.remote_request_id,
                                        expected(p))
                    ndescs, nbytes, posts_s = len(lidx), size, value
                    in_flight = outcome == coalesce.INFLIGHT
            for p in () if joined else read_from:
                if w.session.epoch != epoch:
                    break
                r = remotes[p]
                lidx, ridx = chunks[p]
                msg = notif_message(req.remote_request_id, expected(p))
                local, remote = r.lists  # one read: the NIXL thread may swap in prepared lists
                size = r.transfer_bytes(req.remote_groups)
                args = (rid, w.agent, r, "READ", local, lidx, remote, ridx, msg)
                try:
                    # A small READ is posted here, on the loop, when the NIXL
                    # thread is idle (BOUNDS.inline_post_max_bytes); the loop
                    # never spins on it (BOUNDS.post_spin_s).
                    ran, posted_now = (self.rt.nixl_now(size, self._post, *args, 0.0)
                                       if size <= BOUNDS.inline_post_max_bytes else (False, None))
                    handle, state, post_s = posted_now if ran else \
                        await self.rt.nixl(self._post, *args, BOUNDS.post_spin_s)
                    posts_s += post_s
                except NixlError as e:
                    err = (K.NIXL, f"nixl: {e}")
                    break
                if handle is not None:
                    posted.append((handle, r))
                if state == "ERR":
                    err = (K.NIXL, "nixl: transfer post returned ERR")
                    break
                self.holds.notified(req.remote_address, req.remote_engine_id, p, req.remote_request_id, expected(p))
                ndescs += len(lidx)
                nbytes += size
            else:
                for p in notify:
                    if p not in read_from:
                        await self.rt.nixl(w.agent.send_notif, remotes[p].agent_name,
                                           notif_message(req.remote_request_id, expected(p)))
                        self.holds.notified(req.remote_address, req.remote_engine_id, p, req.remote_request_id,
                                            expected(p))
        except NixlError as e:
            err = (K.NIXL, f"nixl: {e}")
        except _PushInstead:
            push_instead = True
        finally:
            w.pending_loads.pop(rid, None)
            if claim is None:
                pass
            elif not claim.done():  # the load ended before its claim was answered
                claim.cancel()
            elif not claim.cancelled():
                claim.exception()  # retrieved: an early return never awaited it
        if push_instead:  # a push now, decided: whatever the memory of sources says by now
            w.pending_loads[rid] = req.remote_address
            await self._pushed(w, req, remote_tp, read_from, notify, started, deadline, epoch, decided=True)
            return
        if in_flight:  # Pull.cancel finds it there if its session ended since
            w.posting.pop(rid, None)
            return
        if w.session.epoch != epoch:
            # The session ended while posting: its shim reports these blocks
            # failed once the stream is closed, which waits for this release.
            for h, r in posted:
                await self.rt.nixl(self.rt.release_handle, w.agent, h)
            w.posting.pop(rid, None)
            self.rt.counters.transfers_failed += 1
            self.rt.lines.warning(("cancelled while posting", w.key), "%s request=%s: session ended while posting; "
                                  "READs cancelled", w.label, rid)
            return
        w.posting.pop(rid, None)
        retry = not fresh_any and retry_deadline is None  # also where an error came before the posts
        if err:
            for h, r in posted:
                await self.rt.nixl(self.rt.release_handle, w.agent, h)
            if posted:  # a READ of another source rank still in progress must end before the load does
                await settle.end_reads(self.rt, self.registry, w, f"request {rid}: a post failed")
            if retry and err[0] is K.NIXL and self.rt.registered(w):
                for _, r in posted:
                    self.peers.retire(w, r, err[1])
                for p in read_from:
                    self.peers.retire(w, remotes[p], err[1])
                return await self.load(w, req, retry_deadline=deadline, epoch=epoch)
            return self._fail(w, req, *err)
        if not posted:
            # Every READ was done when posted (UCX moves a small one inside
            # the post): done now, no poll round to wait for and no
            # InflightLoad made only for finish() to take it back.
            self._recv_done(w, req, nbytes, ndescs, time.monotonic() - started, posts_s)
            return
        w.inflight[rid] = InflightLoad(req, posted, started, deadline, nbytes, ndescs, retry, post_s=posts_s)
        self.rt.kick.set()

    def _post(self, request_id: str, agent: NixlAgent, source: RemoteWorker, op: str, local, lidx, remote, ridx,
              msg: bytes, spin: float):
        """NIXL thread, or the loop for a small READ (``Runtime.nixl_now``):
        posts a transfer; ``(handle, state, seconds inside the post call)``.
        One already DONE (UCX moves shared-memory bytes inside the post) is
        released here and its handle is None: nothing is left to poll. One
        still in progress is checked again for up to ``spin`` seconds first
        (its notification is usually a moment from done): cheaper than a
        round through the progress loop on the NIXL thread; 0 on the loop,
        where it held up every other load (measured: ~15 % of the decode
        daemon's CPU with 64 one-block loads in flight, and no gain for a
        small load alone; docs/PERFORMANCE.md, "sixth round")."""
        if source.freed:
            # Its lists were released meanwhile (the worker's agent replaced,
            # the pair freed): NIXL must not see their handles again.
            raise NixlError(f"the pair with {source.agent_name} was freed before the post")
        tp.hit(tp.POST, request_id)
        t0 = time.monotonic()
        handle, state = agent.post(op, local, lidx, remote, ridx, msg)
        post_s = time.monotonic() - t0
        if state == "PROC" and spin > 0:
            until = time.monotonic() + spin
            while state == "PROC" and time.monotonic() < until:
                state = agent.state(handle)
        tp.hit(tp.POSTED, request_id, state)
        if state == "DONE":
            self.rt.release_handle(agent, handle, settled=True)
            return None, state, post_s
        return handle, state, post_s

    def read_failed(self, w: Worker, request_id: str, source: RemoteWorker) -> None:
        """A posted READ of ``request_id`` ended in error; the load ends (or
        is tried again) when its other READs are done."""
        load = w.inflight.get(request_id)
        if load is not None and not load.failed:
            load.failed = f"transfer: NIXL error reading from {source.agent_name}"
            load.kind = K.TRANSFER
            self.peers.retire(w, source, "READ failed")

    def finish(self, w: Worker, request_id: str, now: float) -> None:
        """Every READ of ``request_id`` is done: ``RecvDone``, a second try
        (after a failed READ on a cached remote, within the deadline), or
        ``LoadFailed``."""
        load = w.inflight.pop(request_id, None)
        if load is None:
            return
        req = load.req
        if not load.failed:
            self._recv_done(w, req, load.nbytes, load.ndescs, now - load.started, load.post_s)
        elif load.retry and now < load.deadline:
            self.rt.lines.info(("retry", w.key), "%s request=%s: %s; retrying after a new handshake", w.label,
                               request_id, load.failed)
            asyncio.get_running_loop().create_task(self.load(w, req, retry_deadline=load.deadline))
        else:
            self._fail(w, req, load.kind or K.TRANSFER, load.failed)

    def _recv_done(self, w: Worker, req: LoadRequest, nbytes: int, ndescs: int, dur: float,
                   post_s: float = 0.0) -> None:
        """A load is done: counted, reported to metrics, ``RecvDone`` queued
        (units: bytes, descriptor rows, seconds)."""
        self.rt.counters.bytes_read += nbytes
        self.rt.counters.transfers_done += 1
        self.rt.on_event("transfer", {"bytes": nbytes, "seconds": dur, "descs": ndescs})
        log.debug("%s request=%s: %d bytes in %.2f ms", w.label, req.request_id, nbytes, dur * 1e3)
        self.rt.emit(w, RecvDone(req.request_id, nbytes, len(req.local_block_ids), ndescs, dur, post_s))

    def expire(self, now: float) -> None:
        """Fails every load past its deadline. One with a READ still in
        progress fails once that READ has ended for good
        (``settle.end_reads``): vLLM reuses the blocks of a failed load."""
        for w in list(self.rt.workers.values()):
            past = [l for l in w.inflight.values() if l.deadline <= now]
            if not past:
                continue
            # A coalesced READ is a part of each load it carries
            # (kvd.core.coalesce): given up for one, it is given up for all,
            # and they fail with it once it has ended for good. Not tried
            # again: the READ may have been done and notified the source, and
            # a second READ's notification would count twice there (with
            # several reader ranks, the lease would end before another rank
            # read).
            ending = {h for l in past for h, _ in l.parts}
            sharers = [l for l in w.inflight.values()
                       if l.deadline > now and any(h in ending for h, _ in l.parts)] if ending else []
            given_up: set = set()
            for load in past + sharers:
                w.inflight.pop(load.req.request_id)
                if load.parts and load.deadline <= now:
                    # Said now: ending a READ that never ends (replacing the
                    # agent) takes a while, and the engine may give up first.
                    log.info("%s request=%s: READ from %s still in progress at the deadline, %.1f s after "
                             "the load came; ending it", w.label, load.req.request_id,
                             ", ".join(r.agent_name for _, r in load.parts), now - load.started)
                for h, r in load.parts:
                    self.peers.retire(w, r, "transfer past its deadline")
                    if h not in given_up:
                        given_up.add(h)
                        self.rt.zombies.append((w.agent, h))
                if load.parts:
                    asyncio.get_running_loop().create_task(self._fail_when_ended(w, load.req))
                else:
                    self._fail(w, load.req, K.TIMEOUT, "timeout: transfer past its deadline")

    async def _fail_when_ended(self, w: Worker, req: LoadRequest) -> None:
        try:
            await settle.end_reads(self.rt, self.registry, w, f"request {req.request_id} past its deadline")
        finally:
            self._fail(w, req, K.TIMEOUT, "timeout: transfer past its deadline")

    async def cancel(self, w: Worker) -> None:
        """The worker's last session ended: the shim reports every load sent
        on the broken stream as failed and vLLM may reuse those blocks, so no
        READ of them, nor a source's WRITE into them (push mode), may go on.
        Returns once none can land any more (``kvd.core.settle``); the
        session's stream ends after that.
        The loop owns the loads' parts (``Progress.reads_ended``): a handle
        is in a part or in ``Runtime.zombies``, never both."""
        # Taken first: a push that ends while the READs are cancelled takes
        # its orders out of w.pushes, and returns without stopping anything
        # once it sees its session ended (an attacker review).
        agents = {o.reader.agent_name for orders in w.pushes.values() for o in orders}
        handles = {}  # once each: a coalesced READ is a part of each load it carries
        for load in list(w.inflight.values()):
            del w.inflight[load.req.request_id]
            self.rt.counters.transfers_failed += 1
            handles.update(dict.fromkeys(h for h, _ in load.parts))
            self.rt.lines.warning(("cancelled", w.key), "%s request=%s: session ended; load cancelled", w.label,
                                  load.req.request_id)
        await settle.cancel_reads(self.rt, self.registry, w, list(handles))
        if agents:
            # A source may still be WRITEing into blocks of the broken
            # stream's loads (a push not answered yet): stopped as at a
            # push's deadline, before the stream ends. Any order made counts,
            # sent or not: one may be on its way (its callee's proof first).
            await settle.stop_writes_into(self.rt, self.registry, w, "its session ended during a push", agents)

    async def abort_load(self, w: Worker, request_id: str, remote_engine_id: str, remote_address: str,
                         remote_request_id: str, remote_tp_size: int) -> None:
        """Tells the remote prefill ranks to free ``remote_request_id`` now.

        The decode request was aborted before its load: bare NIXL
        notifications end the remote lease, as READs' would. Failures are
        logged, never raised: the remote lease bounds the hold.
        """
        deadline = time.monotonic() + self.rt.limits.handshake_timeout_s
        PEER_CALLER.set(owner_uid(w))  # its own task (an abort slot's)
        if remote_tp_size > BOUNDS.max_tp_size:
            self.rt.lines.warning(("abort ignored", w.key), "%s request=%s: abort ignored: remote TP size %d "
                                  "exceeds %d", w.label, request_id, remote_tp_size, BOUNDS.max_tp_size)
            return
        remote_tp = remote_tp_size or w.tp_size
        mla = w.layout.kv_layout == "MLA"
        heads = w.layout.model_kv_heads(w.tp_size)
        try:
            _, notify = plan.source_ranks(w.key[1], w.tp_size, remote_tp, heads, mla)
            for p in notify:
                expected = plan.expected_notifications(p, remote_tp, w.tp_size, heads, mla)
                try:
                    remote, _ = await self.peers.remote(w, remote_address, remote_engine_id, p, remote_tp, deadline)
                except Incompatible:
                    # No NIXL pair with an incompatible peer (a refused layout
                    # or block size): PeerService.Notify frees it by gRPC.
                    await self.peers.notify_by_rpc(remote_address, remote_engine_id, p, remote_request_id,
                                                   expected, deadline, w.label)
                    continue
                await self.rt.nixl(w.agent.send_notif, remote.agent_name, notif_message(remote_request_id, expected))
                self.holds.notified(remote_address, remote_engine_id, p, remote_request_id, expected)
            self.rt.lines.info(("aborted", w.key), "%s request=%s: aborted; told %s to free %s", w.label,
                               request_id, remote_address, remote_request_id)
        except Exception as e:
            self.rt.lines.warning(("abort failed", w.key), "%s request=%s peer=%s: abort notification failed: %s",
                                  w.label, request_id, remote_address, e)
