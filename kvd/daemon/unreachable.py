"""Peer addresses that did not answer: one call at a time to each.

A decode engine whose prefill node died keeps naming that node's address in
its loads until its router notices, each load failing at once. Before this
gate every such load made a call of its own there (a claim, a handshake),
each on a fresh gRPC channel (``PeerClient`` drops a channel whose peer was
unavailable, so that a restarted peer is dialed anew): with 512 loads in
flight, gRPC's per-call work piled up faster than it ended, the daemon's
RSS grew ~20 MiB a second, and its gRPC servers (health on both ports,
``GetStats``, other daemons' calls) answered only once the loads stopped
(attacker review, measured with ``kvd health`` beside such a flood).

Once a call to an address fails ``UNAVAILABLE`` (nothing accepted the
connection, or the peer is stopping), the next calls to it go one at a
time: the first made while no other is in flight is sent, and the others
wait for its outcome within their own timeouts. If it fails again, they
fail with its error and send nothing; if the peer answered (anything but
``UNAVAILABLE`` or ``DEADLINE_EXCEEDED``), the address is unmarked and
they go on as usual. So a dead address costs one call at a time whatever
the load rate, and a peer that comes back is found by the next call, not
after a fixed pause (a restarted prefill daemon's first load waits for no
timer). The long polls of followed holds and pushes are not gated (one
poll per source, its own back-off; a push's callee is checked first).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from kvd.core import events as ev

#: A waiter's view of the call in flight: it ended without saying whether
#: the peer is up (cancelled with its load, a timeout, a local error).
_NO_OUTCOME = object()
#: The peer answered: the address is no longer marked.
_ANSWERED = object()


class Outcome:
    """What the one call of a :meth:`Unreachable.turn` learnt about its peer;
    the caller says it with :meth:`answered` or :meth:`unavailable`
    (neither: no outcome, the next waiter makes its own call)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: object = _NO_OUTCOME

    def answered(self) -> None:
        """The peer answered (a result, or an error of its own)."""
        self.value = _ANSWERED

    def unavailable(self, message: str) -> None:
        """The call failed ``UNAVAILABLE``: ``message`` is its error, which
        the calls waiting for this one fail with."""
        self.value = message


class Unreachable:
    """The addresses whose last call failed ``UNAVAILABLE`` (at most
    ``max_addresses``, the least recently marked dropped first: an engine
    names addresses at will), each with its call in flight.

    Event loop only.
    """

    def __init__(self, max_addresses: int = 256):
        self.max_addresses = max_addresses
        # address -> the future of its call in flight (None: none now)
        self._marked: dict[str, asyncio.Future | None] = {}
        #: calls that waited for another's outcome and failed with it (a metric of the flood)
        self.shared_failures = 0

    def __contains__(self, address: str) -> bool:
        return address in self._marked

    def __len__(self) -> int:
        return len(self._marked)

    @contextlib.asynccontextmanager
    async def turn(self, address: str, timeout_s: float):
        """Waits until a call to ``address`` may go, then yields an
        :class:`Outcome` for the caller to fill. An address not marked
        yields at once (no bookkeeping: the steady state's cost is a dict
        lookup).

        Raises:
            PeerUnavailable (transient): the call in flight to ``address``
                failed ``UNAVAILABLE`` meanwhile (its error, said to be
                shared), or did not end within ``timeout_s`` seconds.
        """
        out = Outcome()
        mine = None
        if address in self._marked:
            deadline = time.monotonic() + timeout_s
            while (busy := self._marked.get(address)) is not None:
                done, _ = await asyncio.wait((busy,), timeout=max(0.0, deadline - time.monotonic()))
                if not done:
                    raise ev.PeerUnavailable(f"{address}: DEADLINE_EXCEEDED: the call to it in flight (it did not "
                                             f"answer the last one) did not end within {timeout_s:.1f} s",
                                             transient=True)
                value = busy.result()
                if isinstance(value, str):
                    self.shared_failures += 1
                    raise ev.PeerUnavailable(f"{value} (not sent again: the call in flight to this address failed "
                                             f"so; one goes at a time to an address that did not answer)",
                                             transient=True)
                # answered (unmarked now), or no outcome (this one may go): look again
            if address in self._marked:  # marked, no call in flight: this one is it
                mine = asyncio.get_running_loop().create_future()
                self._marked[address] = mine
        try:
            yield out
        finally:
            self._settle(address, out, mine)

    def _settle(self, address: str, out: Outcome, mine: asyncio.Future | None) -> None:
        """Records what a call to ``address`` learnt (``mine``: the future
        its waiters wait on, None when it went unmarked)."""
        value = out.value
        if value is _ANSWERED:
            self._marked.pop(address, None)
        elif isinstance(value, str):
            if self._marked.get(address) is mine or address not in self._marked:
                self._marked.pop(address, None)
                self._marked[address] = None  # newest last: the oldest goes first past the bound
                while len(self._marked) > self.max_addresses:
                    old = next(iter(self._marked))
                    if self._marked[old] is not None:  # its call still runs: keep it (bounded by callers)
                        break
                    del self._marked[old]
        elif mine is not None and self._marked.get(address) is mine:
            self._marked[address] = None  # no outcome: still marked, no call in flight
        if mine is not None and not mine.done():
            mine.set_result(value)
