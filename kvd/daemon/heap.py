"""The daemon's Python heap once it serves: what startup made is frozen.

CPython's cyclic garbage collector runs a young collection whenever the
tracked objects allocated less those freed pass 700, an older one at every
11th of those and a full one, which walks every tracked object, at every
11th older one (``gc.get_threshold()``: 700, 10, 10; a generation is
collected when its count exceeds its threshold). A daemon's imports (grpc,
numpy, NIXL's bindings, protobuf) leave ~41,000 tracked objects that live
as long as it does, and every full collection walked them all. A decode
daemon serving one-block loads crosses 700 within one pass of its event
loop (64 loads make their tasks, futures, plans and messages at once).
Measured on a decode daemon during ``python -m benchmarks.cpu_per_load
--seconds 10`` (35,000-48,000 one-block loads a run, 2-core VM),
``gc.callbacks`` timing each collection:

=================================  =============================  ===========  =============
heap (runs)                        collections, generation 0/1/2  seconds      longest pause
=================================  =============================  ===========  =============
as imported (4)                    1,544-2,048 / 140-186 / 13-17  0.46-0.53    24-32 ms
startup frozen (2)                 1,791-1,805 / 162-164 / 14     0.21-0.23    2.0-3.2 ms
startup frozen, then collected (2) 1,669-1,857 / 151-168 / 13-15  0.23-0.24    3.5-4.2 ms
=================================  =============================  ===========  =============

So freezing halves the collector's CPU (10-15 us a load of the loop's
~125-190 -> 5-6) and ends the 24-32 ms stall at every full collection
(the prefill daemon's were 16-28 ms). vLLM's engine core freezes its
startup heap the same way (``vllm/utils/gc_utils.py``, ``freeze_gc_heap``).

The thresholds stay CPython's. Raising them cut the rest (at (5,000, 2, 2):
5-7 / 1-2 / 0 collections, 0.01 s a run, loads/s within the machine's
noise), but it also lets more cyclic garbage wait for a collection, and
garbage can hold a whole request. A refused gRPC call answered by
``context.abort()`` held its request in a cycle with grpc's handler frames:
at 5,000 a peer's flood of refused 32 MiB Handshake calls took the
daemon's peak RSS from 2.6 GB to 8.2 GB, and 16 MiB junk frames on the
command socket from 0.5 to 1.7 GB (an attacker review's scripts; 7x more
such calls wait at 5,000 than at 700), and at (10,000, 10, 10) the
suite's flood of loads naming 1,000 dead peers grew the daemon past its
bound (each failed handshake's exception held its grpc call and channel,
and the loads that waited on it, in cycles). None of the three leaves a
cycle now (``kvd.daemon.call_refusal``; the command socket writes nothing
after a rejection's half-close; ``kvd.core.peers`` copies a handshake's
exception for each load and lets go of its task): a collector probe in a
daemon under a flood of loads from a refused address found 488,220
objects in cyclic garbage a 2 s window before, none after, and
(10,000, 10, 10) passes the dead-peers test (two runs). It still buys
nothing measurable in the steady state: six alternating pairs of
``python -m benchmarks.cpu_per_load --seconds 12``, loads/s median 1.006x,
D's CPU per load 1.01x. Under that flood it would (full collections 66 ->
7 in 12 s, ``kvd health`` p50 1.56 -> 1.0 s); CPython's are kept, since
garbage from a path not yet found would wait 14x longer. Freezing alone
raised the 32 MiB flood's peak, less (2.66-2.72 -> 3.05-3.23 GB, measured
before refusals stopped leaving cycles).

The collection after the freeze matters for that garbage too: CPython
skips a full collection while the objects that survived older ones are
fewer than a quarter of those that survived the last full one, and that
count, taken before the freeze, would stay at the ~41,000 frozen objects
until a full collection ran; after it, full collections count only what
the daemon made while serving, as they should.

Objects frozen are never collected, so startup must not leave cycles it
later drops (what it makes lives until the daemon stops; a frozen object
no longer referenced is still freed by reference counting)."""

from __future__ import annotations

import gc


def settle() -> None:
    """Collects what startup left, freezes every object still tracked
    (``gc.freeze``: collections skip them from now on), then collects once
    more so that the full collections' rule counts only objects made while
    serving (see the module for the measurements). Call once, after
    startup, before serving. Never raises."""
    gc.collect()
    gc.freeze()
    gc.collect()
