"""Decode side: renew the prefill leases of requests still waiting to load.

P's daemon holds a finished prefill's blocks for a lease (``kvd_lease_s``,
default the daemon's ``lease_s``). A decode request can wait in D's queue
longer than that (a long queue, a full KV cache); its blocks would be freed
and the request recomputed. vLLM's NixlConnector renews the lease from D
while the request waits (0.32+: ``nixl/base_scheduler.py`` ``on_new_request``
tracks it, ``build_connector_meta`` packs heartbeats every
``kv_lease_duration // 6`` seconds, ``update_connector_output`` and
``request_finished`` stop them; P's ``_handle_heartbeat`` moves the
deadline). kvd does the same from the scheduler process, through the local
daemon (``EngineService.RenewLeases`` -> ``PeerService.Renew``):

- :meth:`LeaseRenewals.track` a request with ``do_remote_prefill`` and every
  remote field (``on_new_request``); :meth:`LeaseRenewals.stop` it when it
  has loaded (``finished_recving``), failed, or finished (aborted).
- :meth:`LeaseRenewals.poll` (every engine step) sends one call per prefill
  engine when its renewals are due (at most ``MAX_RENEWALS_PER_CALL``
  requests a call), a third of the shortest lease left (as the daemon
  answered; before the first answer, a third of what
  ``remote_blocks_expiry_time`` says, or :data:`FIRST_UNKNOWN_S` when P
  used its daemon's default). Calls never block the step: each is a
  future looked at on a later step.
- A request P answers ``not_held`` for after it was renewed once has lost
  its lease (read, released, expired, or the cap reached): it is no longer
  renewed. One never renewed yet stays (P's hold may still be on its way).
- A call refused whole as invalid (``INVALID_ARGUMENT``, from the local
  daemon or passed on from P's: a per-call bound the shim cannot know, such
  as P's ``max_blocks_per_request``) teaches the shim a smaller call for that
  prefill engine: at most half the refused call's block ids from then on
  (its requests count when it named no ids), and the requests go again at
  the next poll. A request past that alone goes in a call of its own; one
  refused alone stops its renewals (a warning with the reason): one
  request's ``remote_block_ids`` (an API client's) may be what is past P's
  bound. The others are renewed meanwhile, in as few calls as the learnt
  bound allows (no fewer than half of what P takes: the bound only falls to
  half a call P refused). Before, the whole call was retried each second and
  no request of that prefill engine was renewed. Other failures
  (``UNAVAILABLE``, a deadline) are retried every :data:`RETRY_S`.

P caps a renewed lease's life (its daemon's ``max_lease_life_s``): a request
that never loads does not pin P's blocks past that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from kvd.client import EngineClientError
from kvd.requests import MAX_ID_BYTES, MAX_RENEWAL_GROUPS, MAX_RENEWALS_PER_CALL, BlockGroups, LeaseRenewal, RenewResult
from kvd.shim.vllm.groups import as_groups
from kvd.shim.vllm.params import SPARE_BLOCK_IDS, UINT32, remote_of

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("kvd.shim.vllm")

#: Seconds to the first renewal when the lease's length is unknown (P used
#: its daemon's default): the answer gives the time left.
FIRST_UNKNOWN_S = 1.0
#: Shortest interval between two calls for one prefill engine (seconds).
MIN_INTERVAL_S = 0.25
#: Wait before retrying after a failed call (seconds).
RETRY_S = 1.0
#: Block ids per call, all requests together: well under the daemon's
#: ``max_blocks_per_request`` default (1M), which bounds a call's total. A
#: daemon set lower refuses a call past it: the calls get smaller (``_refused``).
MAX_BLOCKS_PER_CALL = 1 << 18
#: Characters of a refusal's reason logged (it may quote P's daemon: any
#: server an API request names).
LOGGED_REASON_CHARS = 512

Send = Callable[[str, str, list[LeaseRenewal]], "Future[list[RenewResult]]"]


def _is_invalid(error: BaseException) -> bool:
    """True when a call failed because the daemon refused what it carried
    (``INVALID_ARGUMENT``: ``EngineService.RenewLeases`` gives P's daemon's
    own refusal that status too): the same call would be refused again."""
    return isinstance(error, EngineClientError) and error.code == grpc.StatusCode.INVALID_ARGUMENT


def _check_renewable(remote_request_id: str, groups: BlockGroups) -> None:
    """Raises ValueError when a renewal of ``remote_request_id``'s ``groups``
    would get its whole call refused or fail to encode: an id empty or over
    ``MAX_ID_BYTES`` UTF-8 bytes (or not encodable), more than
    ``MAX_RENEWAL_GROUPS`` groups, a block id outside the wire's uint32.
    They come from the API request (:mod:`kvd.shim.vllm.params`), and a
    call carries the renewals of every waiting request of one prefill
    engine: one bad one would keep the others from being renewed."""
    try:
        n = len(remote_request_id.encode())
    except UnicodeEncodeError:
        raise ValueError("remote_request_id is not valid UTF-8 text") from None
    if not 0 < n <= MAX_ID_BYTES:
        raise ValueError(f"remote_request_id of {n} bytes (1-{MAX_ID_BYTES})")
    if len(groups) > MAX_RENEWAL_GROUPS:
        raise ValueError(f"remote_block_ids in {len(groups)} groups, more than {MAX_RENEWAL_GROUPS}")
    for g in groups:
        if g and not (0 <= min(g) and max(g) < UINT32):
            raise ValueError(f"remote_block_ids has ids outside 0..{UINT32 - 1}")


@dataclass
class _Waiting:
    """One waiting request's lease at P."""

    remote_request_id: str
    groups: BlockGroups
    renewed: bool = False  # P renewed it once: a later not_held means the lease is gone


@dataclass
class _Remote:
    """The waiting requests of one prefill engine (at one daemon address)."""

    waiting: dict[str, _Waiting] = field(default_factory=dict)  # local request id ->
    due: float = float("inf")                                    # monotonic seconds
    calls: list[tuple[Future, list[str]]] = field(default_factory=list)  # in flight, local ids sent
    failing: bool = False                                        # the last call failed (logged once)
    # A call's bounds for this prefill engine, lowered by calls refused as invalid (_refused).
    max_blocks: int = MAX_BLOCKS_PER_CALL                        # block ids a call
    max_requests: int = MAX_RENEWALS_PER_CALL                    # requests a call


class LeaseRenewals:
    """Which prefill leases this decode engine renews, and when.

    Args:
        send: ``(remote_engine_id, remote_address, renewals) -> Future`` of one
            result per renewal (``EngineClient.renew_leases``).
        max_groups: KV-cache groups a request's ``remote_block_ids`` may name:
            the engine's transfer groups (more fail the load as well, and
            are no renewal's to convert).
        clock: monotonic seconds; ``wall``: ``time.time`` (for
            ``remote_blocks_expiry_time``, which P sends in wall-clock seconds).
    """

    def __init__(self, send: Send, *, max_groups: int = MAX_RENEWAL_GROUPS,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.send = send
        self.max_groups = min(max_groups, MAX_RENEWAL_GROUPS)
        self.clock = clock
        self.wall = wall
        self._remotes: dict[tuple[str, str], _Remote] = {}
        self._of: dict[str, tuple[str, str]] = {}  # local request id -> its remote key
        # Tracked requests not looked at yet, oldest first: local request id ->
        # (kv_transfer_params, prompt tokens, monotonic and wall seconds when tracked).
        self._arrived: dict[str, tuple[dict[str, Any], int, float, float]] = {}
        # Before this (monotonic seconds) nothing can be due, and no call was
        # answered since the last pass (_answered, set by a call's done
        # callback on the client's thread): poll returns at once. It runs on
        # every engine step while requests wait (~1 us a pass hot, for
        # nothing on most steps: docs/PERFORMANCE.md, engine step).
        self._quiet_until = float("inf")
        self._answered = False

    def __len__(self) -> int:
        """Requests tracked."""
        return len(self._of) + len(self._arrived)

    def track(self, request: Request, params: dict[str, Any]) -> None:
        """Starts renewing the lease of ``request`` (its ``kv_transfer_params``
        ``params``: remote fields checked by the caller).

        Only notes the request and the time: no renewal can be due sooner
        than :data:`MIN_INTERVAL_S` after it arrived, and most requests load
        well before that, so :meth:`poll` reads their params only once they
        are that old (this runs on the engine step for every decode request:
        docs/PERFORMANCE.md, engine step). Bad block ids in the params are
        logged then, not raised (the load reports them)."""
        rid = request.request_id
        if rid in self._arrived or rid in self._of:  # most are new: no call to stop
            self.stop(rid)  # tracked again: its old renewals end, it moves to the newest end
        since = self.clock()
        self._arrived[rid] = (params, request.num_prompt_tokens, since, self.wall())
        if since + MIN_INTERVAL_S < self._quiet_until:
            self._quiet_until = since + MIN_INTERVAL_S

    def _start(self, rid: str, params: dict[str, Any], tokens: int, since: float, wall: float) -> None:
        """Renewals for request ``rid`` (a prompt of ``tokens`` tokens), tracked
        at monotonic ``since`` (wall clock ``wall``): its first is due a third
        of the lease P announced after that (``remote_blocks_expiry_time``),
        at least :data:`MIN_INTERVAL_S`, or :data:`FIRST_UNKNOWN_S` when P
        sent none. Block ids past what the prompt fills are refused by length
        (``SPARE_BLOCK_IDS``), as the load does, not converted on the step."""
        try:
            groups = as_groups(params["remote_block_ids"], tokens + SPARE_BLOCK_IDS, self.max_groups)
        except (TypeError, ValueError, OverflowError) as e:
            log.warning("kvd request=%s: remote_block_ids %s; its lease is not renewed", rid, e)
            return
        try:
            engine, address, remote_rid, _ = remote_of(params)
            _check_renewable(remote_rid, groups)
        except ValueError as e:
            log.warning("kvd request=%s: %s; its lease is not renewed", rid, e)
            return
        key = (engine, address)
        remote = self._remotes.get(key)
        if remote is None:
            remote = self._remotes[key] = _Remote()
        remote.waiting[rid] = _Waiting(remote_rid, groups)
        self._of[rid] = key
        expiry = params.get("remote_blocks_expiry_time")
        first = FIRST_UNKNOWN_S
        if isinstance(expiry, (int, float)) and expiry > 0:
            first = max(MIN_INTERVAL_S, (expiry - wall) / 3)
        remote.due = min(remote.due, since + first)

    def stop(self, request_id: str) -> None:
        """No more renewals for ``request_id`` (loaded, failed, finished);
        a no-op for a request not tracked."""
        if self._arrived.pop(request_id, None) is not None:
            return
        key = self._of.pop(request_id, None)
        if key is None:
            return
        remote = self._remotes[key]
        remote.waiting.pop(request_id, None)
        if not remote.waiting and not remote.calls:
            del self._remotes[key]

    def poll(self) -> int:
        """Takes the answers of finished calls, then sends the renewals that
        are due (never blocks). Returns the calls sent."""
        now = self.clock()
        if now < self._quiet_until and not self._answered:
            return 0
        self._answered = False  # before the answers are read: one that comes meanwhile is read next time
        while self._arrived:  # oldest first: stop at the first too young to be due
            rid, (params, tokens, since, wall) = next(iter(self._arrived.items()))
            if now - since < MIN_INTERVAL_S:
                break
            del self._arrived[rid]
            self._start(rid, params, tokens, since, wall)
        sent = 0
        for key, remote in list(self._remotes.items()):
            self._collect(key, remote, now)
            if not remote.waiting and not remote.calls:
                del self._remotes[key]
                continue
            if remote.calls or now < remote.due:
                continue
            remote.due = float("inf")  # set again by the answers
            for ids in self._batches(remote):
                renewals = [LeaseRenewal(remote.waiting[i].remote_request_id, remote.waiting[i].groups) for i in ids]
                try:
                    call = self.send(key[0], key[1], renewals)
                except (TypeError, ValueError) as e:
                    # Arguments protobuf refuses (what _check_renewable does
                    # not foresee): those requests are not renewed; the
                    # other batches go (one bad request kept every request
                    # of its prefill engine unrenewed, retried each second).
                    log.warning("kvd: lease renewal for engine %s at %s not sent: %s; requests %s are not "
                                "renewed", key[0], key[1], e, ids)
                    for rid in ids:
                        self.stop(rid)
                    continue
                except Exception as e:  # the client could not even start the call
                    log.warning("kvd: lease renewal for engine %s at %s not sent: %s", key[0], key[1], e)
                    remote.due = now + RETRY_S
                    break
                remote.calls.append((call, ids))
                call.add_done_callback(self._on_answer)
                sent += 1
        quiet = min((r.due for r in self._remotes.values()), default=float("inf"))
        if self._arrived:
            quiet = min(quiet, next(iter(self._arrived.values()))[2] + MIN_INTERVAL_S)
        self._quiet_until = quiet
        return sent

    def _on_answer(self, _call: Future) -> None:
        """A call ended (the client's thread): the next :meth:`poll` reads it."""
        self._answered = True

    @staticmethod
    def _batches(remote: _Remote) -> list[list[str]]:
        """Local request ids in calls of at most ``remote.max_requests``
        requests and ``remote.max_blocks`` block ids (:data:`MAX_RENEWALS_PER_CALL`
        and :data:`MAX_BLOCKS_PER_CALL` until P refuses a call: :meth:`_refused`);
        a request past the block bound alone still goes, in a call of its
        own (P's hold bounded it, or P refuses it alone)."""
        out, ids, blocks = [], [], 0
        max_requests, max_blocks = remote.max_requests, remote.max_blocks
        for rid, w in remote.waiting.items():
            n = sum(len(g) for g in w.groups)
            if ids and (len(ids) >= max_requests or blocks + n > max_blocks):
                out.append(ids)
                ids, blocks = [], 0
            ids.append(rid)
            blocks += n
        if ids:
            out.append(ids)
        return out

    def _collect(self, key: tuple[str, str], remote: _Remote, now: float) -> None:
        """Applies the answers of ``remote``'s finished calls; sets when the
        next renewal is due."""
        still = []
        for call, ids in remote.calls:
            if not call.done():
                still.append((call, ids))
                continue
            try:
                results = call.result()
            except Exception as e:
                if _is_invalid(e):
                    self._refused(key, remote, ids, e, now)
                    continue
                if not remote.failing:
                    log.warning("kvd: lease renewal for engine %s at %s failed: %s (retried every %g s)",
                                key[0], key[1], e, RETRY_S)
                remote.failing = True
                remote.due = min(remote.due, now + RETRY_S)
                continue
            remote.failing = False
            left = []
            for rid, r in zip(ids, results):
                w = remote.waiting.get(rid)
                if w is None:
                    continue  # stopped while the call was out
                if r.renewed:
                    w.renewed = True
                    left.append(r.left_s)
                elif w.renewed:
                    log.info("kvd request=%s: prefill lease of %s gone (%s); no more renewals", rid,
                             w.remote_request_id, r.reason)
                    self.stop(rid)
            if left:
                remote.due = min(remote.due, now + max(MIN_INTERVAL_S, min(left) / 3))
            elif remote.waiting:
                remote.due = min(remote.due, now + FIRST_UNKNOWN_S)
        remote.calls = still

    def _refused(self, key: tuple[str, str], remote: _Remote, ids: list[str], error: Exception,
                 now: float) -> None:
        """A call of ``ids`` refused whole as invalid (``error``): one request
        alone is not renewed any more (logged); for several, the calls to
        this prefill engine get smaller (at most half the refused call's
        block ids, or, when it named fewer than two, half its requests) and
        go again at the next poll. Each refusal makes the refused call's
        size unpackable, so a request past P's bound is soon alone; the
        bound falls no lower than half a call P refused, so the other
        requests go in few calls (a part per refused half, kept while its
        requests waited, made 277 calls a poll of 256 requests with 128
        hostile ones among them: attacker review)."""
        live = [rid for rid in ids if rid in remote.waiting]  # some stopped while the call was out
        if len(ids) == 1:
            for rid in live:
                log.warning("kvd request=%s: prefill lease renewal refused: %.*s; its lease is not renewed", rid,
                            LOGGED_REASON_CHARS, error)
                self.stop(rid)
            return
        if not live:
            return
        blocks = sum(len(g) for rid in live for g in remote.waiting[rid].groups)
        if blocks >= 2:
            remote.max_blocks = min(remote.max_blocks, blocks // 2)
        else:  # no ids to halve (empty groups): fewer requests a call
            remote.max_requests = min(remote.max_requests, max(1, len(live) // 2))
        log.debug("kvd: lease renewal of %d requests for engine %s at %s refused (%.*s): calls of at most %d "
                  "block ids, %d requests from now on", len(ids), key[0], key[1], LOGGED_REASON_CHARS, error,
                  remote.max_blocks, remote.max_requests)
        remote.due = min(remote.due, now)
