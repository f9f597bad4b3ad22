"""Named points on a load's path that a benchmark can time, without
monkeypatching the daemon.

The daemon (and the engine client) calls :func:`hit` at each point; by
default no sink is installed and a hit costs one global lookup and a
``None`` check (measured: about 0.2 us, the cost of a Python call). A
benchmark (the per-hop latency trace in ``benchmarks/``) installs a sink
before it starts the daemon in-process, with :func:`install`. Times are ``time.perf_counter()``
(CLOCK_MONOTONIC on Linux), so they compare with the engine process's clock.

This module imports nothing of kvd's: every layer may call it.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter

# The points, in the order a pull load passes them (engine client, daemon, engine client).
SENT = "sent"                  # engine client: a load's command was built on the sender thread
GATE_IN = "gate_in"            # command socket: a frame from an engine was read (gRPC path: bytes reached the gate)
SESSION_READ = "session_read"  # session adapter: a LoadBlocks command is in hand
LOAD = "load"                  # core: the load reached the pull path
CLAIM = "claim"                # core: the claim on the source's hold is sent (kvd.core.holds)
CLAIMED = "claimed"            # core: every source rank confirmed its hold
POST = "post"                  # core: the NIXL post of a transfer starts (detail: "", or "copy": a same-node copy)
POSTED = "posted"              # core: it returned (detail: the NIXL state, e.g. "DONE", "PROC"; "COPIED")
EVENT = "event"                # session adapter: the load's event is converted for the engine
GATE_OUT = "gate_out"          # command socket: an event frame was written (gRPC path: bytes left the gate)
RECEIVED = "received"          # engine client: the load's event reached the session thread (detail: its kind)

Sink = Callable[[str, str, str, float], None]
"""``sink(point, request_id, detail, perf_counter_s)``; must not raise or block."""

_sink: Sink | None = None


def install(sink: Sink | None) -> None:
    """Sets the process-wide sink (``None`` removes it). Not thread-safe
    against concurrent hits: install before the daemon starts."""
    global _sink
    _sink = sink


def enabled() -> bool:
    """True when a sink is installed (lets a caller skip building details)."""
    return _sink is not None


def hit(point: str, request_id: str = "", detail: str = "") -> None:
    """Reports ``point`` for ``request_id`` to the sink, if one is installed."""
    s = _sink
    if s is not None:
        s(point, request_id, detail, perf_counter())
