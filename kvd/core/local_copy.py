"""Same-node copy: a load whose source workers are registered with this daemon.

When the prefill and the decode engines of a load share one daemon (both on
one node), the daemon moves the bytes itself: ``memmove`` between its own
mappings of the two workers' segments, with no NIXL agent pair, handshake or
notification. Everything else is the load of ``kvd.core.pull``:

- the same transfer plan (``kvd.core.plan`` through ``kvd.core.peers.pair_plan``:
  block remapping, block-size ratio ``k``, chunks, TP ratios, KV-cache groups),
  and the checks a handshake makes (compatibility hash, TP size, layouts);
- authority: a READ of another engine's blocks needs that engine's hold on
  those blocks for that request: every source block read must be held by the
  source worker's lease of ``remote_request_id`` (as a push WRITE requires,
  ``kvd.core.push``). A load that comes before its hold waits for it (vLLM
  sends the hold with the prefill worker's next step, which may reach the
  daemon after the decode engine's load), up to the load's deadline;
- completion: each source rank the reader must notify is notified as a NIXL
  notification would (``Holds.notify``: the lease ends with ``SendDone`` once
  every expected reader did), then the reader gets ``RecvDone`` (the caller,
  ``Pull``, emits it) or ``LoadFailed``;
- bounds: every block of every region of the pair's plan is checked once,
  when the plan is made, to lie inside the mapping of its region's segment;
  block ids are checked per request by ``plan.chunk_indices``. The plan
  keeps chunk offsets per region, not descriptor lists: a request's
  addresses are computed from its rows' indices.

Copies run under the NIXL thread's rules (one call at a time, in order), in
pieces of about :data:`COPY_PIECE_BYTES`, each a call of kvd's native row
copy (``kvd.core._rowcopy``: no GIL, the piece's bytes cut among up to
``copy_threads`` threads) or, in an install without it, one
``ctypes.memmove`` a row: on that thread (``Runtime.nixl``),
or, for a piece of at most ``BOUNDS.inline_post_max_bytes`` while the thread
is idle, on the loop itself (``Runtime.nixl_now``: no hand-off there and
back, as a small READ's post). Unregistering a worker drops it from the
registry, then frees its NIXL state on that thread, then unmaps its
segments, so a piece queued while both workers are registered (checked
just before) has finished before either mapping goes away; and a piece
holds the thread for a millisecond or two, so polls and posts of other
loads go on between pieces (behind at most :data:`PIECES_AHEAD` more of
this load's). Before queuing each piece the load checks that both sides
are still registered, the reader's session is the same, and the deadline
has not passed; a piece already queued when a check fails is skipped, and
the load is answered only once the thread has passed its pieces.

VRAM: when both sides' memory is the daemon's VRAM staging mirrors on one
GPU (``data_path`` staged or auto on a GPU), the same rows are
a device copy instead of a memmove: one launch of kvd's copy kernel over the
rows of a piece on the daemon's own stream, then a synchronize
(``kvd.cuda_copy``; ``cudaMemcpyBatchAsync``, or one ``cudaMemcpyAsync`` per
row, where the kernel cannot load),
on the NIXL thread, in pieces of :data:`VRAM_PIECE_BYTES` (and at most
:data:`VRAM_PIECE_ROWS` rows): no UCX
descriptor per block (about 7 us each for ``cuda_ipc`` on an H200,
docs/GPU.md). A load whose two sides are DRAM and VRAM, or VRAM of two
GPUs (peer access is not set up here), takes the NIXL path
(``kvd.core.pull``).

``Limits.same_node_copy = False`` (config key ``same_node_copy``) sends every
load through NIXL, which the tests proving the NIXL path between engines of
one daemon use.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvd import cuda_copy, cudart
from kvd import tracepoints as tp
from kvd.core import cuda_ipc, plan
from kvd.core.events import CoreError, FailureKind, Incompatible
from kvd.core.holds import Holds
from kvd.core.layout import LayoutError
from kvd.core.limits import BOUNDS
from kvd.core.memory import MEMFD_KIND
from kvd.core.peers import pair_plan
from kvd.core.runtime import Runtime
from kvd.core.state import Worker, WorkerKey
from kvd.core.throttle import Throttled
from kvd.requests import LoadRequest

log = logging.getLogger("kvd.core")

K = FailureKind

# Bytes copied by one call on the NIXL thread, per copy thread: about 1-2 ms
# at this machine's single-thread memcpy (5.6 GB/s, docs/DESIGN.md), so other
# loads' polls wait that long at most, while the hand-off per piece stays a
# small part of it (16 MiB pieces on 2 threads: a 16 MiB load 2.41-2.47 ms
# against 2.93-2.99 with 8 MiB ones, docs/PERFORMANCE.md "Same-node copy on
# threads").
COPY_PIECE_BYTES = 8 << 20
# Bytes of one device copy call on the NIXL thread when both sides are VRAM:
# about 0.5 ms at a GPU's ~2 TB/s device-to-device rate (docs/GPU.md, an
# H200), so other loads' polls wait about as long as behind a DRAM piece.
VRAM_PIECE_BYTES = 1 << 30
# Rows of one VRAM piece at most: its segment table (24 bytes a row, on the
# device) stays under ~6 MiB and its numpy work a few ms on the NIXL thread,
# however small the rows a layout makes (a 1 GiB piece of 256-byte rows
# would be 4M rows).
VRAM_PIECE_ROWS = 1 << 18
# Loads of at most this many descriptor rows get their addresses in Python
# (CopyPlan.small_pieces): 16 blocks x 4 regions is 64.
SMALL_COPY_ROWS = 256
# A DRAM piece is cut among threads only where each copies at least this
# many bytes: starting and joining a thread costs ~30 us here, and two
# threads copied 1 MiB of 64 KiB rows slower than one (0.10-0.11 against
# 0.07-0.08 ms), 16 MiB in 0.76 against 1.35-1.44 ms (docs/PERFORMANCE.md,
# "Same-node copy on threads").
MIN_THREAD_BYTES = 1 << 20
# Copy threads when the config leaves it to kvd (copy_threads = 0): the
# CPUs this process may use, at most this many; a copy is bound by memory
# bandwidth, which a few cores fill, and the engines share the node.
AUTO_COPY_THREADS = 4
# Pieces of one load queued on the NIXL thread beyond the one copying: the
# thread starts the next without a wake-up of the loop between them, while
# another load's call waits behind at most this many more pieces (~1-2 ms each).
PIECES_AHEAD = 1


@dataclass
class Side:
    """One side of a pair's plan, as addresses in this daemon's mappings.

    Row ``r`` of the side's descriptor list (``plan.local_rows`` /
    ``plan.remote_rows`` order: region-major, then block, then ``per_block``
    chunk rows) is ``base[i] + b * stride[i] + offset[i, c]``, ``length[i, c]``
    bytes, with ``i, rest = divmod(r, num_blocks * per_block)`` and
    ``b, c = divmod(rest, per_block)``. Only the chunk table is kept (regions
    x chunks), never the full list (regions x blocks x chunks: millions of
    rows for a large cache).
    """

    base: np.ndarray     # int64 [regions]
    stride: np.ndarray   # int64 [regions]
    offset: np.ndarray   # int64 [regions, per_block]
    length: np.ndarray   # int64 [regions, per_block]
    num_blocks: int
    _table: list | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, w: Worker, chunk_sets: list[np.ndarray], col: int, per_block: int) -> "Side":
        """``w``'s side: chunk column ``col`` (1: reader offsets, every slot;
        2: source offsets, slot 0's rows). Raises Incompatible when a block of
        a region would reach outside the mapping of its segment."""
        offset = np.stack([c[:per_block, col] for c in chunk_sets]).astype(np.int64)
        length = np.stack([c[:per_block, 3] for c in chunk_sets]).astype(np.int64)
        side = cls(np.array(w.mem.bases, dtype=np.int64), np.array([r.block_stride for r in w.regions], np.int64),
                   offset, length, w.layout.num_blocks)
        start = np.array([w.mem.mappings[r.segment].addr for r in w.regions], dtype=np.int64)
        end = start + np.array([w.mem.mappings[r.segment].size for r in w.regions], dtype=np.int64)
        lo = side.base + side.offset.min(axis=1)
        hi = side.base + (side.num_blocks - 1) * side.stride + (side.offset + side.length).max(axis=1)
        if (lo < start).any() or (hi > end).any() or (side.length < 0).any():
            # Never true of regions the registry validated; checked because a
            # wrong row would read or write another process's memory.
            raise Incompatible(f"{w.label}: transfer plan row outside the registered regions")
        return side

    def table(self) -> list[tuple[int, int, list[int], list[int]]]:
        """Per region ``(base, stride, chunk offsets, chunk lengths)`` as
        Python ints (made once, for :meth:`CopyPlan.small_pieces`)."""
        if self._table is None:
            self._table = [(b, s, o, n) for b, s, o, n in zip(self.base.tolist(), self.stride.tolist(),
                                                              self.offset.tolist(), self.length.tolist())]
        return self._table

    def rows(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(addresses, lengths)`` of descriptor rows ``idx`` (from ``plan.chunk_indices``)."""
        per = self.offset.shape[1]
        i, rest = np.divmod(idx.astype(np.int64), self.num_blocks * per)
        b, c = np.divmod(rest, per)
        return self.base[i] + b * self.stride[i] + self.offset[i, c], self.length[i, c]


@dataclass
class CopyPlan:
    """The plan of one (reader, source) pair: ``k`` source blocks per reader
    block, ``C`` chunks per source block and region; each side's addresses;
    ``region_bytes``: bytes one source block gives per region."""

    reader: Worker
    source: Worker
    k: int
    C: int
    reader_side: Side
    source_side: Side
    region_bytes: tuple[int, ...]
    region_groups: tuple[int, ...]

    def small_pieces(self, local_groups, remote_groups, piece: int = COPY_PIECE_BYTES
                     ) -> list[tuple[list[int], list[int], list[int]]] | None:
        """The pieces of one small load (block ids per group, as
        ``plan.check_request`` returns them) as ``(dst, src, len)`` lists,
        made in Python: what :func:`split_pieces` makes of the rows of
        ``plan.chunk_indices`` (rows contiguous on both sides merged, cut
        into pieces of about ``piece`` bytes, in the same order),
        when the plan has one group, ``k`` 1 and the load at most
        :data:`SMALL_COPY_ROWS` rows; else None (the numpy path).

        Why: on a daemon's loop woken for one load, the numpy path's dozen
        calls on tiny arrays took ~250 us for 16 blocks and ~0.5 ms for 256
        (a 16 MiB load), this ~20-60 us (benchmarks.trace --same-node,
        docs/PERFORMANCE.md "twelfth round" and "thirteenth round"). The ids
        were checked by ``plan.check_request``."""
        if self.k != 1 or any(self.region_groups):
            return None
        rb = remote_groups[0]
        C = self.C
        if len(rb) * len(self.region_groups) * C > SMALL_COPY_ROWS:
            return None
        lb = local_groups[0]
        if isinstance(rb, np.ndarray) or isinstance(lb, np.ndarray):  # Python ints for memmove's addresses
            lb, rb = list(map(int, lb)), list(map(int, rb))
        dst: list[int] = []
        src: list[int] = []
        ln: list[int] = []
        for (dbase, dstride, doff, lens), (sbase, sstride, soff, _) in zip(self.reader_side.table(),
                                                                            self.source_side.table()):
            for lid, rid in zip(lb, rb):
                d0, s0 = dbase + lid * dstride, sbase + rid * sstride
                for c in range(C):
                    d, s_, n = d0 + doff[c], s0 + soff[c], lens[c]
                    if ln and dst[-1] + ln[-1] == d and src[-1] + ln[-1] == s_:
                        ln[-1] += n
                    else:
                        dst.append(d)
                        src.append(s_)
                        ln.append(n)
        return split_runs(dst, src, ln, piece)

    def transfer_bytes(self, source_groups) -> int:
        """Bytes a copy of ``source_groups`` (block ids per group) moves."""
        return sum(b * len(source_groups[g]) for b, g in zip(self.region_bytes, self.region_groups))


class LocalCopy:
    """Same-node loads of one daemon.

    Args:
        rt: the core's shared state.
        holds: the sources' leases (checked before, notified after a copy).

    ``addresses``: the ``host:port`` names of this daemon's PeerService that
    ``kv_transfer_params`` carry (``Node.peer_address``); a load naming one of
    them, for an engine registered here, is a same-node load.
    """

    def __init__(self, rt: Runtime, holds: Holds):
        self.rt = rt
        self.holds = holds
        self.addresses: set[str] = set()
        self._plans: dict[tuple[WorkerKey, WorkerKey], CopyPlan] = {}
        #: Threads a DRAM piece is copied on (:func:`copy_threads`).
        self.threads = copy_threads(rt.limits.copy_threads)
        if rt.limits.same_node_copy:
            if _native is None:
                log.warning("same-node copies in host memory: one memmove a row on one thread: kvd's native row "
                            "copy (kvd.core._rowcopy) is not installed (kvd was installed without a C compiler; "
                            "reinstall with gcc present: `kvd version` says which)")
            elif rt.limits.copy_threads > self.threads:
                log.warning("same-node copies in host memory: copy_threads = %d capped to %d, the CPUs this "
                            "daemon may use (its affinity and cgroup CPU quota)", rt.limits.copy_threads, self.threads)
            else:
                log.info("same-node copies in host memory: %d copy thread(s) (native row copy)", self.threads)
        #: Why VRAM loads no longer take the same-node copy ("" while they
        #: do): a device copy failed with an error that loses the daemon's
        #: CUDA context (``cudart.STICKY_ERRORS``); restart the daemon.
        self.vram_off = ""
        #: Called once with the reason when that happens (the daemon turns
        #: its health NOT_SERVING, so that a supervisor restarts it).
        self.on_cuda_lost: Callable[[str], None] | None = None

    def sources(self, w: Worker, req: LoadRequest, notify: list[int]) -> dict[int, Worker] | None:
        """The source workers by rank when ``req`` is a same-node load, else None.

        None as well (the NIXL path serves it) when ``same_node_copy`` is off,
        when a source rank is not registered here, when one side's memory
        is DRAM and the other's VRAM, when VRAM is not the daemon's staging
        mirrors or is on more than one GPU, after a device copy lost the
        CUDA context (:attr:`vram_off`), or when DRAM on either side is not
        a sealed memfd (a named shm segment can be
        truncated under the copy: SIGBUS in the daemon, found by an attacker
        review; NIXL's READ fails cleanly instead).
        """
        if not self.rt.limits.same_node_copy or req.remote_address not in self.addresses:
            return None
        found = {p: self.rt.workers.get((req.remote_engine_id, p)) for p in notify}
        if any(s is None for s in found.values()):
            return None
        kinds = {x.mem.memory for x in (w, *found.values())}
        if kinds == {"VRAM"}:
            # Only the daemon's own mirrors (the staged path): memory it
            # allocated at the registered size, on the GPU it chose; an
            # engine allocation it opened (direct) is sized by the driver's
            # answer where libcuda gives one. One GPU only: a kernel reading
            # another GPU needs peer access between them, or it faults and
            # the daemon's CUDA context is lost for every engine (UCX moves
            # those). None either once a copy lost the context.
            if self.vram_off or not all(x.mem.staged for x in (w, *found.values())):
                return None
            devices = {m.device for x in (w, *found.values()) for m in x.mem.mappings}
            return found if len(devices) == 1 else None
        if kinds != {"DRAM"}:
            return None
        # A memmove touches the mappings directly: memory an engine could
        # still truncate (a named shm segment, not a sealed memfd) would
        # raise SIGBUS in the daemon, where UCX fails such a READ cleanly.
        if any(m.kind != MEMFD_KIND for x in (w, *found.values()) for m in x.mem.mappings):
            return None
        return found

    async def load(self, w: Worker, req: LoadRequest, sources: dict[int, Worker], remote_tp: int,
                   read_from: list[int], notify: list[int], deadline: float
                   ) -> tuple[int, int] | tuple[FailureKind, str] | None:
        """Copies ``req.remote_groups`` of ``sources`` into ``req.local_groups`` of ``w``.

        Returns ``(bytes, descriptor rows)`` when done (every source rank in
        ``notify`` notified), ``(kind, reason)`` of a failure, or None when
        the reader's session ended or it was unregistered meanwhile (no
        event: as a NIXL load cancelled by ``Pull.cancel``).
        """
        epoch = w.session.epoch
        try:
            plans = {p: self._plan(w, sources[p], remote_tp) for p in read_from}
        except Incompatible as e:
            self._notify(w, req, sources, notify, remote_tp)  # nobody will read them: free them now
            return K.HANDSHAKE, f"handshake: {e}"
        for p in read_from:
            cp = plans[p]
            try:
                ids = plan.check_request(req.local_groups, req.remote_groups, w.layout.num_blocks,
                                         cp.source.layout.num_blocks, cp.k, cp.region_groups)
            except LayoutError as e:
                return K.INVALID, f"invalid: {e}"
        # No copy of another engine's blocks without its hold on them, the
        # same claim a READ makes (kvd.core.holds, docs/SECURITY.md). Rows
        # are made after it: a load waiting for its hold keeps only its block
        # ids (measured: 4 loads of 64 regions x 32k shuffled blocks waiting
        # grew the daemon by 547 MiB with their rows, under 64 MiB without).
        tp.hit(tp.CLAIM, req.request_id)
        denied = await self.holds.claim_sources(w, req, read_from, deadline)
        tp.hit(tp.CLAIMED, req.request_id)
        if denied:
            return denied
        why = self._still(w, epoch, sources, deadline)
        if why:
            return why if isinstance(why, tuple) else None
        pieces = []
        nbytes = 0
        device = w.mem.mappings[0].device if w.mem.memory == "VRAM" else None
        # A DRAM piece is 8 MiB a thread, for up to AUTO_COPY_THREADS threads: memory
        # bandwidth stops growing with threads long before 64, and a piece holds the
        # NIXL thread (every other load's poll) while it copies.
        piece = COPY_PIECE_BYTES * min(self.threads, AUTO_COPY_THREADS) if device is None else VRAM_PIECE_BYTES
        for p in read_from:
            cp = plans[p]
            small = cp.small_pieces(*ids, piece=piece)  # ids as lists per group: the same for every rank
            if small is not None:
                pieces += small
            else:
                lidx, ridx = plan.chunk_indices(req.local_groups, req.remote_groups, len(w.regions),
                                                w.layout.num_blocks, cp.source.layout.num_blocks, cp.k, cp.C,
                                                cp.region_groups)
                dst, ln = cp.reader_side.rows(lidx)
                src, _ = cp.source_side.rows(ridx)
                pieces += split_pieces(dst, src, ln, piece)
            nbytes += cp.transfer_bytes(req.remote_groups)
        if device is not None:
            pieces = cap_rows(pieces, VRAM_PIECE_ROWS)
        ndescs = sum(len(x[0]) for x in pieces)
        tp.hit(tp.POST, req.request_id, "copy")
        # While a piece may still be copying, the reader's session end waits
        # (kvd.core.settle): no byte lands in blocks already reported failed.
        w.posting[req.request_id] = ()
        try:
            why = await self._copy(w, epoch, sources, deadline, pieces, device)
        except Exception as e:  # noqa: BLE001 (only device copies raise here; the load is answered either way)
            if device is None:
                raise
            return self._device_failure(w, req, e)
        finally:
            w.posting.pop(req.request_id, None)
        if why:
            return why if isinstance(why, tuple) else None
        # A source gone after the last piece still fails the load (its lease
        # ended unread): only a reader gone (True) is answered by no event.
        why = self._still(w, epoch, sources, float("inf"))
        if why:
            return why if isinstance(why, tuple) else None
        tp.hit(tp.POSTED, req.request_id, "COPIED")
        self._notify(w, req, sources, notify, remote_tp)
        self.rt.counters.same_node_copies += 1
        if device is not None:
            self.rt.counters.same_node_vram_copies += 1
        return nbytes, ndescs

    # ---------------------------------------------------------------- parts
    async def _copy(self, w: Worker, epoch: int, sources: dict[int, Worker], deadline: float, pieces: list,
                    device: int | None = None):
        """Copies ``pieces`` (``(dst, src, len)`` rows) in order; returns None
        when all were copied, else what :meth:`_still` said before a piece.
        ``device``: None for DRAM (memmove), else the CUDA device whose
        stream copies VRAM rows (always on the NIXL thread).

        A piece of up to ``BOUNDS.inline_post_max_bytes`` is copied here, on
        the loop, when the NIXL thread is idle (``Runtime.nixl_now``: the
        thread's rules hold, and no hand-off there and back), as a READ of
        that size is posted (its CMA copy is inside the post). Larger ones
        go to the NIXL thread with the next one queued behind (at most
        :data:`PIECES_AHEAD` there), so the thread goes from one to the next
        without waiting for the loop: each hand-off back and forth is a
        wake-up, 0.1-0.3 ms here (docs/PERFORMANCE.md, "thirteenth round").
        Before each piece is queued, the load checks it may go on; a piece
        already queued when a check fails is skipped (``stop``), and every
        piece queued has ended or been skipped before this returns or
        raises (:meth:`_passed`, also when the task is cancelled), so no
        byte lands after the load was answered."""
        stop: list[bool] = []
        queued: collections.deque = collections.deque()  # a future leaves once it has resolved
        try:
            for dst, src, ln in pieces:
                why = self._still(w, epoch, sources, deadline)
                if why:
                    return why
                nb = int(ln.sum()) if isinstance(ln, np.ndarray) else sum(ln)  # numpy: rows may be 100k+
                if (device is None and not queued and nb <= BOUNDS.inline_post_max_bytes
                        and self.rt.nixl_now(nb, copy_rows, dst, src, ln)[0]):
                    continue
                queued.append(self.rt.nixl(copy_unless, stop, dst, src, ln, device, self.threads))
                while len(queued) > PIECES_AHEAD:
                    await queued[0]
                    queued.popleft()
            while queued:
                await queued[0]
                queued.popleft()
        finally:
            if queued:  # left early (a check, an error, this task cancelled): the rest are skipped
                stop.append(True)
                await self._passed(queued)
        return None

    async def _passed(self, queued: collections.deque) -> None:
        """Returns once the NIXL thread has passed every call in ``queued``
        (run or skipped): a no-op queued behind them has run. A cancelled
        future may still be running on the thread, so the futures alone
        cannot say. Cancelling this task again does not cut the wait short;
        the cancellation is raised after it."""
        try:
            barrier = self.rt.nixl(_nothing)
        except RuntimeError:  # the thread is shut down: it ran every queued call first
            return
        cancelled = False
        while not barrier.done():
            try:
                await asyncio.shield(barrier)
            except asyncio.CancelledError:
                cancelled = True
        for f in queued:  # retrieved: a second piece's error is not logged as never retrieved
            if f.done() and not f.cancelled():
                f.exception()
        if cancelled:
            raise asyncio.CancelledError

    def _device_failure(self, w: Worker, req: LoadRequest, e: Exception) -> tuple[FailureKind, str]:
        """The answer to a device copy that raised ``e``: the load fails
        (``TRANSFER``). An error that loses the CUDA context
        (``cudart.STICKY_ERRORS``) also turns VRAM same-node copies off and
        calls :attr:`on_cuda_lost`, once."""
        if isinstance(e, cudart.CudaError) and e.code in cudart.STICKY_ERRORS:
            if not self.vram_off:
                self.vram_off = str(e)
                log.error("%s: a same-node device copy lost this daemon's CUDA context (%s): every GPU transfer "
                          "here will fail until the daemon restarts; same-node VRAM copies are off", w.label, e)
                if self.on_cuda_lost is not None:
                    self.on_cuda_lost(str(e))
        else:
            log.warning("%s: same-node device copy of request=%s failed: %s", w.label, req.request_id, e,
                        exc_info=not isinstance(e, (cudart.CudaError, cuda_ipc.CudaIpcError)))
        return K.TRANSFER, f"transfer: same-node device copy failed: {e}"

    def _plan(self, w: Worker, s: Worker, remote_tp: int) -> CopyPlan:
        """The pair's plan, made once per (reader, source) registration.

        Raises:
            Incompatible: TP size, compatibility hash or layouts differ (the
                checks of a handshake, ``kvd.core.peers``).
        """
        if s.tp_size != remote_tp:
            raise Incompatible(f"remote engine {s.key[0]!r} has TP size {s.tp_size}, the request says {remote_tp}")
        key = (w.key, s.key)
        cp = self._plans.get(key)
        if cp is not None and cp.reader is w and cp.source is s:
            return cp
        if s.compat_hash != w.compat_hash:
            raise Incompatible(f"compatibility hash mismatch: local {w.compat_hash}, remote {s.compat_hash}")
        k, C, chunk_sets, _, _ = pair_plan(w.geometry(), s.geometry())
        cp = CopyPlan(w, s, k, C, Side.of(w, chunk_sets, 1, k * C), Side.of(s, chunk_sets, 2, C),
                      tuple(int(c[:C, 3].sum()) for c in chunk_sets), tuple(x.group for x in w.regions))
        for old in [k2 for k2, v in self._plans.items()
                    if self.rt.workers.get(k2[0]) is not v.reader or self.rt.workers.get(k2[1]) is not v.source]:
            del self._plans[old]  # a side re-registered or left: its addresses name unmapped memory
        self._plans[key] = cp
        log.info("%s: same-node copy plan with engine=%s rank=%d: %d chunk(s) x %d slot(s), %s", w.label, s.key[0],
                 s.key[1], C, k, "device copies" if w.mem.memory == "VRAM" else
                 f"{self.threads} copy thread(s)" if _native is not None else "one memmove a row (no native row copy)")
        return cp

    def _still(self, w: Worker, epoch: int, sources: dict[int, Worker], deadline: float):
        """Why the copy must stop now: ``(kind, reason)``, True (the reader
        left: no event), or None (go on)."""
        if self.rt.workers.get(w.key) is not w:
            return K.UNREGISTERED, "worker unregistered"
        if w.session.epoch != epoch:
            self.rt.lines.info(("dropped", w.key), "%s: session ended during a same-node copy; load dropped", w.label)
            return True
        for s in sources.values():
            if self.rt.workers.get(s.key) is not s:
                return K.TRANSFER, f"transfer: source engine {s.key[0]!r} rank {s.key[1]} unregistered"
        if time.monotonic() >= deadline:
            return K.TIMEOUT, "timeout: transfer past its deadline"
        return None

    def _notify(self, w: Worker, req: LoadRequest, sources: dict[int, Worker], notify: list[int],
                remote_tp: int) -> None:
        """Reader ``w``'s notification of ``req.remote_request_id`` to each
        source rank in ``notify`` (the count a NIXL notification carries)."""
        heads, mla = w.layout.model_kv_heads(w.tp_size), w.layout.kv_layout == "MLA"
        for p in notify:
            s = sources[p]
            expected = plan.expected_notifications(p, remote_tp, w.tp_size, heads, mla)
            try:
                self.holds.notify(s.key[0], s.key[1], req.remote_request_id, expected)
            except CoreError as e:
                self.rt.lines.info(("not notified", s.key), "engine=%s rank=%d request=%s: not notified: %s",
                                   s.key[0], s.key[1], req.remote_request_id, e)


def split_pieces(dst: np.ndarray, src: np.ndarray, ln: np.ndarray, piece: int = COPY_PIECE_BYTES):
    """``[(dst, src, len), ...]``: int64 arrays of about ``piece`` bytes each
    (at most ``2 * piece``).

    Rows contiguous on both sides are merged first (consecutive block ids of a
    cross-layer or per-layer region are one run), rows longer than ``piece``
    are cut. A load of at most ``piece`` bytes is one piece (the common case:
    a few numpy calls, ~10 us; ``np.split`` and ``np.r_`` cost ~100 us here)."""
    if not len(ln):
        return []
    dst, src, ln = (np.asarray(a, dtype=np.int64) for a in (dst, src, ln))
    if len(ln) > 1:
        brk = (dst[1:] != dst[:-1] + ln[:-1]) | (src[1:] != src[:-1] + ln[:-1])
        if not brk.all():
            starts = np.flatnonzero(np.concatenate(([True], brk)))
            dst, src, ln = dst[starts], src[starts], np.add.reduceat(ln, starts)
    ends = np.cumsum(ln)
    total = int(ends[-1])
    if total <= piece:
        return [(dst, src, ln)]
    if int(ln.max()) > piece:
        dst, src, ln = cuda_copy.cut_rows(dst, src, ln, piece)
        ends = np.cumsum(ln)
    bounds = [0, *(np.searchsorted(ends, np.arange(piece, total, piece), side="left") + 1).tolist(), len(ln)]
    return [(dst[i:j], src[i:j], ln[i:j]) for i, j in zip(bounds, bounds[1:]) if j > i]


_memmove = ctypes.memmove  # a ctypes foreign function: releases the GIL while it copies

_THREADS_NOT_STARTED = Throttled(log)

try:  # kvd's one native piece (setup.py; optional: an install without a C compiler lacks it)
    from kvd.core import _rowcopy as _native
except ImportError:  # pragma: no cover - an install without a C compiler
    _native = None


def split_runs(dst: list[int], src: list[int], ln: list[int], piece: int = COPY_PIECE_BYTES
               ) -> list[tuple[list[int], list[int], list[int]]]:
    """:func:`split_pieces` for rows already merged, as Python lists (a
    small load's, :meth:`CopyPlan.small_pieces`): rows longer than
    ``piece`` cut, then a piece ends after the first row whose cumulative
    end reaches each multiple of ``piece`` below the total (the rule of
    ``split_pieces``' ``searchsorted``); ``tests/test_same_node.py`` checks
    the two agree."""
    if not ln:
        return []
    if max(ln) > piece:
        cut_d, cut_s, cut_l = [], [], []
        for d, s, n in zip(dst, src, ln):
            for off in range(0, n, piece):
                cut_d.append(d + off)
                cut_s.append(s + off)
                cut_l.append(min(n - off, piece))
        dst, src, ln = cut_d, cut_s, cut_l
    total = sum(ln)
    if total <= piece:
        return [(dst, src, ln)]
    out = []
    start = end = 0
    mark = piece  # the next multiple of piece that closes a piece
    for i, n in enumerate(ln):
        end += n
        if end >= mark and mark < total:
            out.append((dst[start:i + 1], src[start:i + 1], ln[start:i + 1]))
            start = i + 1
            while mark <= end:
                mark += piece
    if start < len(ln):
        out.append((dst[start:], src[start:], ln[start:]))
    return out


def cap_rows(pieces: list, max_rows: int) -> list:
    """``pieces`` with any of more than ``max_rows`` rows cut into pieces of
    at most ``max_rows`` rows, in order (arrays or lists alike)."""
    out = []
    for dst, src, ln in pieces:
        if len(ln) <= max_rows:
            out.append((dst, src, ln))
            continue
        for i in range(0, len(ln), max_rows):
            out.append((dst[i:i + max_rows], src[i:i + max_rows], ln[i:i + max_rows]))
    return out


def _nothing() -> None:
    """A no-op call: once it ran, the NIXL thread has passed every call queued before it."""


def copy_unless(stop: list, dst, src, ln, device: int | None = None, threads: int = 1) -> None:
    """NIXL thread: :func:`copy_rows` (``device`` None, on up to
    ``threads`` threads) or :func:`copy_device_rows` unless ``stop`` is
    non-empty (the load gave up after the piece was queued)."""
    if stop:
        return
    if device is None:
        copy_rows(dst, src, ln, threads)
    else:
        copy_device_rows(device, dst, src, ln)


def copy_device_rows(device: int, dst, src, ln) -> None:
    """NIXL thread's rules: the rows of :func:`copy_rows` between device
    pointers of this process, on the daemon's stream of ``device``, waited
    for (``kvd.cuda_copy``: one kernel launch, or ``cudaMemcpyBatchAsync``).

    Raises:
        CudaIpcError: no CUDA runtime; CudaError: a copy failed."""
    cuda_ipc.runtime()  # the clear NO_GPU error first
    cuda_copy.engine().copy_rows(device, dst, src, ln)


def copy_rows(dst, src, ln, threads: int = 1) -> None:
    """NIXL thread's rules: ``memmove(dst[i], src[i], ln[i])`` for each row
    (int64 arrays or lists of ints; addresses in this process, checked by
    the caller's plan), on up to ``threads`` threads of at least
    :data:`MIN_THREAD_BYTES` each.

    With kvd's native piece (``kvd.core._rowcopy``, built by the install
    where a C compiler is found) the whole call runs without the GIL; without
    it, one ``ctypes.memmove`` a row on this thread (``threads`` unused)."""
    if _native is not None:
        if not isinstance(ln, np.ndarray):
            dst, src, ln = (np.array(a, dtype=np.int64) for a in (dst, src, ln))
        if _native.copy_rows(dst, src, ln, threads, MIN_THREAD_BYTES):
            _THREADS_NOT_STARTED.warning("same-node copy: copy thread(s) could not start (pthread_create "
                                         "failed: a thread or memory limit); the NIXL thread copied their bytes")
        return
    if isinstance(dst, np.ndarray):
        dst, src, ln = dst.tolist(), src.tolist(), ln.tolist()
    for d, s, n in zip(dst, src, ln):
        _memmove(d, s, n)


def copy_threads(setting: int, cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Threads a DRAM same-node piece is copied on: ``setting`` (the
    ``copy_threads`` config key) if positive, else
    :data:`AUTO_COPY_THREADS`, at most :func:`usable_cpus` either way
    (threads past the CPUs only wait, and a piece is
    :data:`COPY_PIECE_BYTES` a thread: 64 threads on 2 CPUs held the NIXL
    thread 100-300 ms a piece, attacker review); 1 without the native
    piece (``ctypes.memmove`` holds the GIL between rows: a second thread
    was slower with 64 KiB rows, docs/PERFORMANCE.md)."""
    if _native is None:
        return 1
    return max(1, min(setting if setting > 0 else AUTO_COPY_THREADS, usable_cpus(cgroup_root)))


def _read_ints(path: str) -> list[int]:
    """The whitespace-separated integers of a one-line file; [] where it is
    missing or holds anything else ("max", "inf", "1e400")."""
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may keep busy: its affinity mask's count, capped by
    a CPU quota of its cgroup (a Kubernetes sidecar's ``limits.cpu``: cgroup
    v2 ``cpu.max`` "QUOTA PERIOD" in microseconds, or v1
    ``cpu/cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, as the container sees
    its own cgroup at the root), rounded up; at least 1. Threads past a quota
    only wait for it (CFS throttling). A file that is missing or holds no
    positive integers ("max", v1's -1) sets no quota."""
    n = len(os.sched_getaffinity(0))
    quota_period = _read_ints(os.path.join(cgroup_root, "cpu.max"))[:2]
    if len(quota_period) != 2:
        quota_period = (_read_ints(os.path.join(cgroup_root, "cpu", "cpu.cfs_quota_us"))[:1]
                        + _read_ints(os.path.join(cgroup_root, "cpu", "cpu.cfs_period_us"))[:1])
    if len(quota_period) == 2 and quota_period[0] > 0 and quota_period[1] > 0:
        quota, period = quota_period
        n = min(n, -(-quota // period))
    return max(1, n)
