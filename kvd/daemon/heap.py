"""The daemon's Python heap once it serves: startup's objects frozen, young
collections rare.

CPython's cyclic garbage collector runs a young collection whenever the
tracked objects allocated less those freed pass ``threshold0`` (700 by
default), and every tenth one is older, every hundredth a full collection
that walks every tracked object: ~41,000 once the daemon's modules
(grpc, numpy, NIXL's bindings, protobuf) are imported, more once it serves. A decode daemon serving one-block
loads crosses 700 within one pass of its event loop (a pass of 64 loads
makes their tasks, futures, plans and messages at once), so it collected
all the time. Measured on a decode daemon during ``python -m
benchmarks.cpu_per_load --seconds 10`` (35,000-48,000 one-block loads a
run, 2-core VM), ``gc.callbacks`` timing each collection:

==========================  ===============================  ==================  =============
heap (runs)                 collections, generation 0/1/2    seconds (a load)    longest pause
==========================  ===============================  ==================  =============
CPython's defaults (4)      1,544-2,048 / 140-186 / 13-17    0.46-0.53 (10-15us) 24-32 ms
startup's objects frozen    1,791 / 162 / 14                 0.23                3.2 ms
frozen, (10,000, 10, 10)    2-3 / 0 / 0                      0.0025-0.0034       1.3-2.1 ms
frozen, (5,000, 2, 2) (2)   5-7 / 1-2 / 0                    0.007-0.011         1.6-5.1 ms
==========================  ===============================  ==================  =============

That is 10-15 us of the loop's CPU a load (of ~125-190) and a 24-32 ms
stall at every full collection, gone; the prefill daemon's full
collections stalled it 16-28 ms too. vLLM's engine core freezes its
startup heap the same way (``vllm/utils/gc_utils.py``, ``freeze_gc_heap``).

Why the older generations are collected sooner than CPython's defaults
(every 2 collections of the one below, not 10): a flood of loads naming
dead peers (``tests/test_reliability_peers.py``, 100 failed handshakes in
flight, three rounds of 1,000) leaves cyclic garbage (exceptions and their
frames) that survives a young collection; at (10,000, 10, 10) it waited for
an older one and the decode daemon's RSS grew +4 to +13 MiB a round
(+8.6 / +5.4 / +4.1, +9.8 / +0.5 / +8.4, +12.8 / +1.7 / +5.7), against
-2.8 to +4.2 with CPython's defaults and -1.0 to +2.3 at (5,000, 2, 2).

What it costs: cyclic garbage made while serving waits for up to
``THRESHOLDS[0]`` net allocations before it is freed (a few MB at most;
objects without cycles are freed at once by reference counting, as
always); objects frozen at startup are never collected, so startup must
not leave cycles it later drops (what it makes lives until the daemon
stops; a frozen object no longer referenced is still freed by reference
counting)."""

from __future__ import annotations

import gc

#: ``gc.set_threshold`` while serving: young collections every 5,000 net
#: tracked allocations (CPython: 700), each older generation every 2
#: collections of the one below (CPython: 10); measured above.
THRESHOLDS = (5_000, 2, 2)


def settle() -> None:
    """Collects what startup left, freezes every object still tracked
    (``gc.freeze``: collections skip them from now on) and sets
    :data:`THRESHOLDS` (see the module for the measurements). Call once,
    after startup, before serving. Never raises."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
