"""Peer addresses that did not answer: one probe at a time, not a call a load.

A decode engine whose prefill node died keeps naming that node's address in
its loads until its router notices, each load failing at once. Before this
gate every such load made calls of its own there (a claim, a handshake),
each on a fresh gRPC channel (``PeerClient`` drops a channel whose peer was
unavailable, so that a restarted peer is dialed anew): with 512 loads in
flight, gRPC's per-call work piled up faster than it ended, the daemon's
RSS grew ~20 MiB a second, and its gRPC servers (health on both ports,
``GetStats``, other daemons' calls) answered only once the loads stopped
(attacker review, measured with ``kvd health`` beside such a flood).

Once a call to an address fails ``UNAVAILABLE`` (nothing accepted the
connection, or the peer is stopping), the address is marked, and a call
to it first asks whether the peer is back with a probe (``PeerClient``'s:
the peer port's gRPC health check, which the peer answers at once), one
probe at a time: the other callers wait for its outcome within their own
timeouts. A probe that fails fails them all with its error, and they send
nothing; one the peer answered unmarks the address and they all go on. So a
dead address costs one probe at a time, at most one each ``PROBE_GAP_S``
(callers in between fail with the last probe's error), whatever the load
rate; a peer that comes back is found by the next call, and no caller
waits behind another's long call (a claim may wait seconds for its hold at
the source: a review measured a 5 s stall of every engine's calls when the
real call was the one in flight).
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import grpc

from kvd.core import events as ev

#: A probe's outcome for its waiters: the peer answered (the address is unmarked).
ANSWERED = "answered"
#: A probe's outcome for its waiters: none (a timeout, cancelled with its
#: caller); the next waiter probes again.
NO_OUTCOME = "no outcome"

#: ``probe(address, timeout_s)``: ANSWERED, NO_OUTCOME, or the error of a
#: failed probe (a ``str`` starting with the address).
Probe = Callable[[str, float], Awaitable[str]]

#: Seconds between the end of a probe of an address and the next: a caller
#: in that gap after a failed probe fails with its error at once, and after
#: one with no outcome waits for the gap's end. Without it a peer that
#: answered its health check at once with a code saying nothing (UNKNOWN)
#: was probed back to back, ~1,200-2,500 times a second (review).
PROBE_GAP_S = 0.05


class Unreachable:
    """The addresses whose last call failed ``UNAVAILABLE`` (at most
    ``max_addresses``, the least recently marked without a probe in flight
    dropped first: an engine names addresses at will), each with its probe
    in flight. Event loop only.

    Attributes:
        not_sent: calls failed with a probe's error, sending nothing (the
            caller's own probe's, or another's).
        probes: probes sent.
    """

    def __init__(self, probe: Probe, max_addresses: int = 256):
        self.probe = probe
        self.max_addresses = max_addresses
        # address -> its probe in flight (None: none now); oldest first
        self._marked: dict[str, asyncio.Future | None] = {}
        # address (marked) -> (monotonic end, outcome) of its last probe
        self._last: dict[str, tuple[float, str]] = {}
        self.not_sent = 0
        self.probes = 0

    def collect(self):
        """Prometheus collector (``registry.register(gate)``, read in the
        scrape's thread): ``kvd_peer_addresses_unanswered`` (marked now),
        ``kvd_peer_probes_total`` and ``kvd_peer_calls_not_sent_total``
        (calls failed with a probe's error, sending nothing)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily("kvd_peer_addresses_unanswered", "Peer addresses whose last call failed "
                                "UNAVAILABLE, each probed before its next calls", value=len(self._marked))
        yield CounterMetricFamily("kvd_peer_probes", "Probes (the peer port's health check) of peer addresses "
                                  "that did not answer", value=self.probes)
        yield CounterMetricFamily("kvd_peer_calls_not_sent", "Peer calls failed with a probe's error instead of "
                                  "being sent (an address that did not answer)", value=self.not_sent)

    def __contains__(self, address: str) -> bool:
        return address in self._marked

    def __len__(self) -> int:
        return len(self._marked)

    def failed(self, address: str) -> None:
        """A call to ``address`` failed ``UNAVAILABLE``: it is marked (again:
        newest last)."""
        busy = self._marked.pop(address, None)
        self._marked[address] = busy
        if len(self._marked) > self.max_addresses:
            # Oldest first, skipping those with a probe in flight (their
            # waiters hold them; a probe ends within its timeout).
            for old in [a for a, f in self._marked.items() if f is None][:len(self._marked) - self.max_addresses]:
                del self._marked[old]
                self._last.pop(old, None)

    def answered(self, address: str) -> None:
        """The peer at ``address`` answered a call: no longer marked."""
        if self._marked:
            self._marked.pop(address, None)
        if self._last:
            self._last.pop(address, None)

    async def admit(self, address: str, timeout_s: float) -> None:
        """Returns when a call to ``address`` may go: at once when it is not
        marked (a dict lookup), else once a probe found its peer answering
        (this caller's own probe when none is in flight).

        Raises:
            PeerUnavailable (transient): the probe failed (its error; said
                to be shared when it was another's, or one that ended less
                than ``PROBE_GAP_S`` ago), or no probe ended within
                ``timeout_s`` seconds.
        """
        if address not in self._marked:
            return
        deadline = time.monotonic() + timeout_s
        while address in self._marked:
            busy = self._marked[address]
            now = time.monotonic()
            left = deadline - now
            if busy is None:  # marked, no probe in flight
                ended, last = self._last.get(address, (-PROBE_GAP_S, NO_OUTCOME))
                if now - ended < PROBE_GAP_S:
                    if last not in (ANSWERED, NO_OUTCOME):
                        self.not_sent += 1
                        raise ev.PeerUnavailable(f"{last} (not sent again: a probe of this address failed so "
                                                 f"{(now - ended) * 1e3:.0f} ms ago)", transient=True)
                    await asyncio.sleep(min(ended + PROBE_GAP_S - now, max(0.0, left)))
                else:  # this caller's probe
                    outcome = await self._probe(address, max(0.0, left))
                    if outcome not in (ANSWERED, NO_OUTCOME):
                        self.not_sent += 1
                        raise ev.PeerUnavailable(outcome, transient=True)
            else:
                done, _ = await asyncio.wait((busy,), timeout=max(0.0, left))
                if done and busy.result() not in (ANSWERED, NO_OUTCOME):
                    self.not_sent += 1
                    raise ev.PeerUnavailable(f"{busy.result()} (not sent again: a probe of this address failed so; "
                                             f"one goes at a time to an address that did not answer)",
                                             transient=True)
            if address in self._marked and time.monotonic() >= deadline:
                raise ev.PeerUnavailable(f"{address}: DEADLINE_EXCEEDED: it did not answer a call, and no probe "
                                         f"of it ended within {timeout_s:.1f} s", transient=True)

    async def _probe(self, address: str, timeout_s: float) -> str:
        """This caller's probe of marked ``address``; its outcome is recorded
        and handed to the callers waiting for it."""
        mine = asyncio.get_running_loop().create_future()
        self._marked[address] = mine
        self.probes += 1
        outcome = NO_OUTCOME
        try:
            outcome = await self.probe(address, timeout_s)
        finally:
            current = self._marked.get(address)
            if outcome == ANSWERED:
                self._marked.pop(address, None)
                self._last.pop(address, None)
            elif outcome == NO_OUTCOME:
                if current is mine:  # still marked, no probe in flight (a call may have unmarked it meanwhile)
                    self._marked[address] = None
                    self._last[address] = (time.monotonic(), outcome)
            elif current is mine or address not in self._marked:
                self._marked.pop(address, None)
                self.failed(address)
                if address in self._marked:  # not dropped by the bound at once (every other one probing)
                    self._last[address] = (time.monotonic(), outcome)
            mine.set_result(outcome)
        return outcome


#: First contacts (see :class:`FirstContacts`): per caller uid, a second's
#: worth and at once; a contact waits its turn at most FIRST_CONTACT_WAIT_S.
FIRST_CONTACTS_PER_S = 50.0
FIRST_CONTACTS_BURST = 128
FIRST_CONTACT_WAIT_S = 1.0
#: Addresses a daemon answered at, kept as proven (the most recently answered).
PROVEN_KEPT = 1024
#: Caller uids whose next turn is kept; past this many, those whose budget
#: is whole again are dropped (they say nothing a fresh entry would not).
CALLERS_KEPT = 1024
#: Codes only a kvd daemon's PeerService sends (besides OK): gRPC maps no
#: HTTP status to them, so an HTTP/2 server or a gRPC server of another
#: kind answering (403 -> PERMISSION_DENIED, 404 -> UNIMPLEMENTED) proves nothing.
PROVING_CODES = frozenset({grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
                           grpc.StatusCode.ABORTED})


class FirstContacts:
    """A budget for contacts with peer addresses no daemon has answered at.

    :class:`Unreachable` holds back calls to an address whose last call
    failed; an address never named before is not in it. Loads each naming a
    new dead address (an admitted engine, or an API user of a decode engine:
    the address is in ``kv_transfer_params``; or a router naming many dead
    prefill ports) so made a fresh gRPC channel and a call each: with 4,096
    such loads in flight, ~2,000 channels a second, health on the engine
    socket past its 10 s deadline and RSS +110 MiB, not given back
    (attacker review, each load naming another refused ``127.a.b.c:1``).

    A contact (a handshake, any call, a probe, a push) with an address that
    is not proven (no kvd daemon answered there since this daemon started:
    :meth:`answered`, for an OK answer or a code in :data:`PROVING_CODES`)
    goes alone: the others for that address wait for its end (at most
    ``FIRST_CONTACT_WAIT_S``), and go once it proved the address or the
    unreachable gate holds it (which then probes it, one at a time); else,
    or past that wait, each takes a turn of its own. Turns are
    budgeted per caller uid (:data:`kvd.core.state.PEER_CALLER`, set by the
    core for each engine's work): ``burst`` at once, then ``per_s`` a second
    (the generic cell rate algorithm). A contact waits for its turn at most
    ``FIRST_CONTACT_WAIT_S`` (and its own deadline): past that it fails at
    once, sending nothing, and reserves nothing, so a flood leaves no
    backlog (a review: turns reserved up to a push's hour-long deadline
    refused every first contact for minutes after the flood). One uid's
    flood spends its own turns only; another uid's engines meet new prefill
    daemons as before, and a proven address dropped from the
    ``PROVEN_KEPT`` kept costs its next contact one turn of its caller's.
    Event loop only.

    Attributes:
        waited: contacts that waited for their turn.
        refused: contacts failed, their turn too far off.
    """

    def __init__(self, per_s: float = FIRST_CONTACTS_PER_S, burst: int = FIRST_CONTACTS_BURST,
                 kept: int = PROVEN_KEPT, max_wait_s: float = FIRST_CONTACT_WAIT_S,
                 clock: Callable[[], float] = time.monotonic):
        self._per_s, self._burst, self._max_wait = per_s, burst, max_wait_s
        self._interval = 1.0 / per_s
        self._tolerance = (burst - 1) * self._interval
        self._next: dict[int, float] = {}  # caller uid -> the theoretical time of its next turn
        self._proven: dict[str, None] = {}  # least recently answered first
        self._alone: dict[str, asyncio.Future] = {}  # address not proven -> its contact in flight
        self._kept = kept
        self._clock = clock
        self.waited = 0
        self.refused = 0

    def collect(self):
        """Prometheus collector: ``kvd_peer_first_contacts_waited_total`` and
        ``kvd_peer_first_contacts_refused_total``."""
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily("kvd_peer_first_contacts_waited", "Contacts with peer addresses no daemon "
                                  "answered at that waited for their turn (past their uid's burst)",
                                  value=self.waited)
        yield CounterMetricFamily("kvd_peer_first_contacts_refused", "Contacts with peer addresses no daemon "
                                  "answered at failed unsent: their turn too far off", value=self.refused)

    def proven(self, address: str) -> bool:
        """Whether a daemon answered at ``address`` (one of the last ``kept`` answered)."""
        return address in self._proven

    def answered(self, address: str) -> None:
        """A kvd daemon at ``address`` answered: proven (most recent last);
        the contacts waiting for the one in flight go now."""
        p = self._proven
        p.pop(address, None)
        p[address] = None
        if len(p) > self._kept:
            del p[next(iter(p))]
        alone = self._alone.get(address)
        if alone is not None and not alone.done():
            alone.set_result(None)

    def answered_with(self, address: str, code) -> None:
        """:meth:`answered` when ``code`` (a ``grpc.StatusCode``) is one only a daemon sends."""
        if code in PROVING_CODES:
            self.answered(address)

    async def admit(self, address: str, timeout_s: float, uid: int,
                    held: Callable[[str], bool] = lambda a: False) -> tuple[float, object]:
        """Waits until a contact with ``address`` may go; returns ``(seconds
        left of timeout_s, ticket)``. The ticket is None when no turn was
        taken (proven; held by the unreachable gate, ``held(address)``;
        or another contact proved it meanwhile); else the caller hands it to
        :meth:`ended` when its contact ends, however it ends.

        Raises:
            PeerUnavailable (not transient: a later try within the same
                deadline would fare no better): ``uid``'s next turn is more
                than ``FIRST_CONTACT_WAIT_S`` (or ``timeout_s``) away, or the
                contact in flight did not end within ``timeout_s``; nothing
                was sent.
        """
        if address in self._proven or held(address):
            return timeout_s, None
        deadline = time.monotonic() + timeout_s
        while (alone := self._alone.get(address)) is not None:
            # At most FIRST_CONTACT_WAIT_S behind one contact: a long call (a
            # claim waits up to 5 s at its source for a hold) answered with a
            # code that proves nothing held every other uid's contacts with the
            # address behind it, chained (review); past that, a turn of its own.
            left = deadline - time.monotonic()
            if not alone.done():
                await asyncio.wait((alone,), timeout=max(0.0, min(left, self._max_wait)))
            if address in self._proven or held(address):
                return max(0.01, deadline - time.monotonic()), None
            if alone.done():
                if self._alone.get(address) is alone:
                    break  # ended without a proof, still named: a turn of this one's own
                continue  # another contact took its place meanwhile
            if left <= self._max_wait:
                raise ev.PeerUnavailable(f"{address}: not contacted: the contact with it in flight did not "
                                         f"end within {timeout_s:.1f} s")
            break
        now = self._clock()
        turn = max(self._next.get(uid, now), now)
        wait = turn - self._tolerance - now
        if wait > min(deadline - time.monotonic(), self._max_wait):
            self.refused += 1
            raise ev.PeerUnavailable(
                f"{address}: not contacted: uid {uid}'s engines' next contact with an address no daemon answered "
                f"at is {wait:.1f} s off (they go {self._burst} at once, then {self._per_s:g} a second: loads "
                f"naming many dead or new addresses)")
        if len(self._next) > CALLERS_KEPT:
            self._next = {u: t for u, t in self._next.items() if t > now}
        self._next[uid] = turn + self._interval
        ticket = asyncio.get_running_loop().create_future()
        self._alone[address] = ticket
        if wait > 0:
            self.waited += 1
            try:
                await asyncio.sleep(wait)
            except BaseException:
                self.ended((address, ticket))
                raise
        return max(0.01, deadline - time.monotonic()), (address, ticket)

    def ended(self, ticket: object) -> None:
        """The contact of ``ticket`` (from :meth:`admit`) ended; the others
        for its address look again."""
        if ticket is None:
            return
        address, fut = ticket
        if self._alone.get(address) is fut:
            del self._alone[address]
        if not fut.done():
            fut.set_result(None)
