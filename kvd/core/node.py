"""The daemon's core: engine workers, their regions, leases and transfers.

``Node`` is what the gRPC services adapt; it knows neither gRPC nor vLLM.
It owns one NIXL agent per registered engine worker and drives every NIXL
call from one thread (``kvd-nixl``), so the asyncio event loop never blocks
on NIXL and no agent is used from two threads.

Pull mode (the seed connector's protocol, docs/DESIGN.md "Transfer protocol"):

1. prefill worker: ``hold(request, blocks)`` -> a lease (``kvd.core.leases``);
2. decode worker: ``load(request, local blocks, remote ...)`` -> handshake
   once per (local worker, remote worker) pair, which also prepares both
   descriptor lists of the pair's transfer plan (``kvd.core.plan``); then one
   NIXL READ per source rank, each with a notification naming the remote
   request; source ranks it does not read from get a bare notification;
3. prefill daemon: once every expected reader notified -> ``SendDone`` (or
   the lease expires -> ``SendDone(expired=True)``);
4. decode daemon: every READ done -> ``RecvDone``; any error or the deadline
   -> ``LoadFailed`` with the local block ids.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from kvd import __version__
from kvd.core import layout as lay
from kvd.core import cuda_ipc, plan
from kvd.core.events import (
    AlreadyExists,
    CommandRejected,
    Event,
    Incompatible,
    InvalidArgument,
    LoadFailed,
    NotFound,
    PeerUnavailable,
    PermissionDenied,
    RecvDone,
    SendDone,
)
from kvd.core.layout import Layout, LayoutError, Region
from kvd.core.leases import LeaseTable, notif_message, parse_notif
from kvd.core.memory import Access, SegmentAccessError, SegmentError, ShmMapping, create_shm, unlink_shm
from kvd.core.nixl_agent import NixlAgent, NixlError, metadata_agent_name
from kvd.core.state import (
    MAX_AGENT_METADATA,
    MAX_PENDING_EVENTS,
    MAX_TP_SIZE,
    POST_SPIN_S,
    PROTOCOL_VERSION,
    RETRY_HANDSHAKE_MIN_S,
    BlockGroups,
    Counters,
    HandshakeResult,
    InflightLoad,
    Limits,
    PeerKey,
    PeerLink,
    PushOrder,
    PushResult,
    RemoteWorker,
    Segment,
    Worker,
    WorkerKey,
    flat,
)

log = logging.getLogger("kvd.core")


def _check_peer(w: Worker, hs: HandshakeResult, what: str) -> None:
    """Validates a peer worker's description before any NIXL call uses it.

    Raises:
        Incompatible: protocol version or compatibility hash differ.
        InvalidArgument: metadata size, region list or layout is malformed.
    """
    if hs.protocol_version != PROTOCOL_VERSION:
        raise Incompatible(f"peer protocol version {hs.protocol_version} (kvd {hs.daemon_version}), "
                           f"this daemon speaks {PROTOCOL_VERSION} (kvd {__version__})")
    if hs.compat_hash != w.compat_hash:
        raise Incompatible(f"compatibility hash mismatch: local {w.compat_hash}, remote {hs.compat_hash}")
    if not 0 < len(hs.agent_metadata) <= MAX_AGENT_METADATA:
        raise InvalidArgument(f"{what}: agent metadata of {len(hs.agent_metadata)} bytes "
                              f"(1..{MAX_AGENT_METADATA} accepted)")
    if len(hs.region_bases) != len(hs.regions) or not hs.regions:
        raise InvalidArgument(f"{what}: region_base_addrs and regions differ in length")
    if not 1 <= hs.tp_size <= MAX_TP_SIZE:
        raise InvalidArgument(f"{what}: tp_size must be in 1..{MAX_TP_SIZE} (got {hs.tp_size})")
    if hs.memory not in ("DRAM", "VRAM") or not 0 <= hs.device < 1 << 16:
        raise InvalidArgument(f"{what}: memory {hs.memory!r} on device {hs.device}: DRAM or VRAM on a device 0..65535")
    try:
        lay.validate(hs.layout, hs.regions, [1 << 62] * (1 + max(r.segment for r in hs.regions)))
    except LayoutError as e:
        raise InvalidArgument(f"{what}: peer layout invalid: {e}") from None
    for i, (base, r) in enumerate(zip(hs.region_bases, hs.regions)):
        # Descriptor rows are int64 (issue 4, scenario 9: a forged base once
        # raised OverflowError in the descriptor maths and the load never ended).
        if base + (hs.layout.num_blocks - 1) * r.block_stride + r.block_len >= 1 << 63:
            raise InvalidArgument(f"{what}: region {i} at base address {base:#x} ends past the 64-bit range")


def _pair_plan(reader: plan.Geometry, source: plan.Geometry):
    """``(k, C, chunk_sets, reader_identity, source_identity)`` of a pair.

    ``reader_identity``: every chunk is a whole reader block (the reader's own
    prepped list serves); ``source_identity`` likewise for the source.

    Raises:
        Incompatible: the layouts cannot be combined (the message says why).
    """
    try:
        chunk_sets = [plan.chunks(reader, source, i) for i in range(len(reader.regions))]
    except plan.PlanError as e:
        raise Incompatible(f"layouts cannot be combined: {e}") from None
    k = reader.layout.block_size // source.layout.block_size
    C = len(chunk_sets[0]) // k
    if any(len(c) != k * C for c in chunk_sets):
        raise Incompatible("regions need different chunk counts (mixed region kinds)")
    one = k == 1 and C == 1
    reader_identity = one and all(c[0].tolist() == [0, 0, 0, r.block_len]
                                  for c, r in zip(chunk_sets, reader.regions))
    source_identity = one and all(c[0].tolist() == [0, 0, 0, r.block_len]
                                  for c, r in zip(chunk_sets, source.regions))
    return k, C, chunk_sets, reader_identity, source_identity


def _on_device(rows: np.ndarray, device: int) -> np.ndarray:
    """Descriptor rows with their device-id column set (VRAM: the GPU ordinal; DRAM: 0)."""
    if device:
        rows[:, 2] = device
    return rows


class Node:
    """The core of one kvd daemon.

    Args:
        limits: deadlines and bounds.
        peers: reaches remote daemons (the daemon's gRPC ``PeerClient``;
            tests may pass a fake).
        peer_address: ``host:port`` remote daemons use to reach this one.
        backends: NIXL backends for every agent (default ``["UCX"]``).
        on_event: hook ``(name, fields)`` for metrics: ``transfer``,
            ``failure``, ``handshake``, ``register``.

    Call :meth:`start` inside the event loop, :meth:`close` at shutdown.
    """

    def __init__(
        self,
        limits: Limits | None = None,
        peers: PeerLink | None = None,
        peer_address: str = "",
        backends: list[str] | None = None,
        on_event: Callable[[str, dict], None] | None = None,
    ):
        self.limits = limits or Limits()
        self.peers = peers
        self.peer_address = peer_address
        self.backends = backends or ["UCX"]
        self.workers: dict[WorkerKey, Worker] = {}
        self.counters = Counters()
        self.started = time.monotonic()
        self._nixl_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvd-nixl")
        self._handshakes: dict[tuple, asyncio.Future] = {}
        self._zombies: list[tuple[NixlAgent, object]] = []
        self._writes: dict[int, tuple[Worker, object, asyncio.Future, float]] = {}  # push WRITEs in flight
        self._progress_task: asyncio.Task | None = None
        self._kick = asyncio.Event()
        self._closing = False
        self.draining = False  # set at SIGTERM: no more second tries, loads in flight end by their deadlines
        self._on_event = on_event or (lambda name, fields: None)

    # ------------------------------------------------------------------ infra
    def _timeout(self, timeout_s: float) -> float:
        """A request's timeout: the daemon default for 0, negative or NaN; capped."""
        if not timeout_s > 0:
            return self.limits.transfer_timeout_s
        return min(timeout_s, self.limits.max_transfer_timeout_s)

    async def _nixl(self, fn, *args):
        """Runs ``fn(*args)`` on the NIXL thread."""
        return await asyncio.get_running_loop().run_in_executor(self._nixl_pool, fn, *args)

    def start(self) -> None:
        """Starts the progress loop (polls transfers, notifications, leases)."""
        self._progress_task = asyncio.get_running_loop().create_task(self._progress_loop(), name="kvd-progress")

    async def close(self) -> None:
        """Fails in-flight loads, releases leases, unregisters every worker.

        Segments of an engine whose owner process is already dead are
        unlinked here too (``engine_gone``): otherwise a daemon stopped
        within ``detach_grace_s`` of an engine crash would leave them in
        /dev/shm. A live engine's segments are never touched."""
        self._closing = True
        if self._progress_task:
            self._progress_task.cancel()
            try:
                await self._progress_task
            except (asyncio.CancelledError, Exception):
                pass
        for key in list(self.workers):
            await self.unregister(key, reason="daemon shutting down", engine_gone=True)
        self._nixl_pool.shutdown(wait=True)

    def _emit(self, w: Worker, ev: Event) -> None:
        if len(w.events) >= MAX_PENDING_EVENTS:
            dropped = w.events.popleft()
            log.warning("%s: event queue full, dropped %s", w.label, dropped)
        w.events.append(ev)
        w.wakeup.set()

    def worker(self, engine_id: str, tp_rank: int) -> Worker:
        """The registered worker ``(engine_id, tp_rank)``.

        Raises:
            NotFound: no such worker on this daemon.
        """
        w = self.workers.get((engine_id, tp_rank))
        if w is None:
            raise NotFound(f"engine {engine_id!r} rank {tp_rank} is not registered with this daemon")
        return w

    # ---------------------------------------------------------- registration
    async def register(
        self,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        layout: Layout,
        segments: list[Segment],
        regions: list[Region],
        model: str = "",
        compat_extra: str = "",
        staged: bool | None = False,
        owner_pid: int = 0,
        access: Access | None = None,
    ) -> Worker:
        """Maps the worker's segments, makes its NIXL agent, registers memory.

        ``staged``: the daemon makes a mirror segment of each size and
        registers those instead (``Worker.staging`` names them); the shim
        copies blocks between its cache and the mirror. CUDA IPC segments
        (issue 7, ``kvd.core.cuda_ipc``) are opened on their GPU and
        registered as VRAM; their mirrors are daemon-owned VRAM, and
        ``staged=None`` (``data_path = auto``) lets the daemon choose
        (``kvd.core.path_select``). Staged CUDA segments on a daemon
        without a GPU get shm mirrors (the shim copies through host
        memory). ``access``: the registering engine's credentials; each shm
        segment must be one it could read and write itself (None: not
        checked).

        Raises:
            InvalidArgument: bad ids, layout or regions, or a segment that is
                missing or smaller than asked (nothing stays mapped).
            PermissionDenied: ``access`` may not read and write a segment.
            AlreadyExists: the worker is registered already.
        """
        if not engine_id or len(engine_id) > 256:
            raise InvalidArgument("engine_id must be 1..256 characters")
        if not 1 <= tp_size <= MAX_TP_SIZE:
            raise InvalidArgument(f"tp_size must be in 1..{MAX_TP_SIZE} (got {tp_size})")
        if not 0 <= tp_rank < tp_size:
            raise InvalidArgument(f"tp_rank {tp_rank} must be in 0..tp_size-1 (tp_size {tp_size})")
        if (engine_id, tp_rank) in self.workers:
            raise AlreadyExists(f"engine {engine_id!r} rank {tp_rank} is already registered")
        if not segments or len(segments) > lay.MAX_REGIONS:
            raise InvalidArgument(f"a worker registers 1..{lay.MAX_REGIONS} segments (got {len(segments)})")
        try:
            lay.validate(layout, regions, [s.size for s in segments])
        except LayoutError as e:
            raise InvalidArgument(str(e)) from None
        mappings: list[ShmMapping] = []
        staging: list[str] = []
        cuda = None
        try:
            kinds = {s.kind for s in segments}
            if len(kinds) > 1:
                raise SegmentError(f"a worker's segments must all be of one kind (got {sorted(kinds)})")
            if cuda_ipc.KIND in kinds and cuda_ipc.wants_vram(staged):
                cuda = await self._nixl(cuda_ipc.open_segments, segments,
                                        "auto" if staged is None else "staged" if staged else "direct")
                mappings, staged = cuda.mappings, cuda.staged
            else:
                staged = bool(staged)
                for s in segments:
                    if staged:
                        staging.append(create_shm(s.size))
                    mappings.append(ShmMapping(staging[-1] if staged else s.name, s.size, None if staged else access))
        except (SegmentError, OSError) as e:
            for m in mappings:
                m.close()
            for n in staging:
                unlink_shm(n)
            raise (PermissionDenied if isinstance(e, SegmentAccessError) else InvalidArgument)(str(e)) from None
        name = f"kvd-{engine_id}-r{tp_rank}-{uuid.uuid4().hex[:8]}"
        try:
            agent, regs, dlist = await self._nixl(self._make_agent, name, mappings, layout, regions,
                                                  "VRAM" if cuda else "DRAM", cuda.device if cuda else 0)
        except NixlError as e:
            for m in mappings:
                m.close()
            for n in staging:
                unlink_shm(n)
            raise InvalidArgument(str(e)) from None
        w = Worker(
            key=(engine_id, tp_rank),
            tp_size=tp_size,
            model=model,
            layout=layout,
            regions=regions,
            compat_hash=lay.compat_hash(model, layout, tp_size, len(regions), compat_extra),
            agent=agent,
            mappings=mappings,
            registrations=regs,
            bases=[mappings[r.segment].addr + r.offset for r in regions],
            local_dlist=dlist,
            registered_bytes=sum(s.size for s in segments),
            staging=staging,
            owner_pid=owner_pid,
            segment_names=[] if staged or cuda else [s.name for s in segments],
            leases=LeaseTable(early_s=self.limits.early_notif_s),
            memory="VRAM" if cuda else "DRAM",
            device=cuda.device if cuda else 0,
            staged=staged,
            data_path_reason=cuda.choice.reason if cuda else "",
        )
        w.detached_since = time.monotonic()
        self.workers[w.key] = w
        log.info(
            "registered %s (TP %d): agent %s, %d regions x %d blocks of %d tokens (%s), %d bytes in %d segments, "
            "hash %s", w.label, tp_size, name, len(regions), layout.num_blocks, layout.block_size,
            layout.kv_layout, w.registered_bytes, len(segments), w.compat_hash,
        )
        if cuda:
            log.info("%s: VRAM on device %d, %s data path (%s)", w.label, w.device, "staged" if staged else "direct",
                     cuda.choice.reason)
            if cuda.choice.warning:
                log.warning("%s: %s", w.label, cuda.choice.warning)
        self._on_event("register", {"engine": engine_id})
        return w

    def _make_agent(self, name, mappings, layout, regions, memory="DRAM", device=0):
        agent = NixlAgent(name, self.backends)
        regs = []
        try:
            for m in mappings:
                regs.append(agent.register_memory(m.addr, m.size, memory, device))
            bases = [mappings[r.segment].addr + r.offset for r in regions]
            dlist = agent.prep_local(_on_device(lay.block_descriptors(bases, regions, layout.num_blocks), device),
                                     memory)
        except Exception:
            for r in regs:
                agent.deregister(r)
            raise
        return agent, regs, dlist

    async def unregister(self, key: WorkerKey, reason: str = "unregistered", engine_gone: bool = False) -> int:
        """Drops a worker: fails its loads, ends its leases, frees NIXL state.

        ``engine_gone``: the worker's session has been gone past the grace
        period; if its owner process is dead too, its segment names are
        unlinked (see ``RegisterEngineRequest.owner_pid``).
        Returns the number of leases released. Raises NotFound.
        """
        w = self.workers.pop(key, None)
        if w is None:
            raise NotFound(f"engine {key[0]!r} rank {key[1]} is not registered with this daemon")
        self.counters.transfers_failed += len(w.inflight)
        released = len(w.leases)
        await self._nixl(self._free_worker, w)
        for m in w.mappings:
            m.close()
        for n in w.staging:
            unlink_shm(n)
        if engine_gone and w.owner_pid > 0 and not os.path.exists(f"/proc/{w.owner_pid}"):
            for n in w.segment_names:
                unlink_shm(n)
            log.info("%s: engine process %d is gone; unlinked its %d segment(s)", w.label, w.owner_pid,
                     len(w.segment_names))
        log.info("unregistered %s (%s): %d leases, %d loads dropped", w.label, reason, released, len(w.inflight))
        w.inflight.clear()
        w.leases.leases.clear()
        return released

    def _free_worker(self, w: Worker) -> None:
        """NIXL thread: releases every handle, list, remote and registration of ``w``."""
        for load in w.inflight.values():
            for h, _ in load.parts:
                if not w.agent.release(h):
                    self._zombies.append((w.agent, h))
        for r in [*w.remotes.values(), *w.retired, *w.readers.values()]:
            self._free_remote(w, r)
        w.remotes.clear()
        w.retired.clear()
        w.readers.clear()
        try:
            w.agent.release_dlist(w.local_dlist)
        except Exception:
            pass
        for reg in w.registrations:
            try:
                w.agent.deregister(reg)
            except Exception as e:
                log.warning("%s: deregister: %s", w.label, e)

    # --------------------------------------------------------------- sessions
    def attach(self, engine_id: str, tp_rank: int) -> Worker:
        """A session stream opened for the worker; returns it. Raises NotFound."""
        w = self.worker(engine_id, tp_rank)
        w.sessions += 1
        w.detached_since = None
        return w

    def detach(self, w: Worker) -> None:
        """The worker's session stream ended (the engine may reconnect)."""
        w.sessions = max(0, w.sessions - 1)
        if w.sessions == 0:
            w.detached_since = time.monotonic()
            w.epoch += 1
            # The shim reports every load sent on the broken stream as failed
            # and vLLM may reuse those blocks: no READ of them may go on.
            for load in list(w.inflight.values()):
                del w.inflight[load.request_id]
                self.counters.transfers_failed += 1
                self._zombies.extend((w.agent, h) for h, _ in load.parts)  # the next poll cancels/releases
                log.warning("%s request=%s: session ended; load cancelled", w.label, load.request_id)

    # ------------------------------------------------------------- prefill side
    def hold(self, w: Worker, request_id: str, block_ids: BlockGroups, lease_s: float = 0.0) -> None:
        """Holds ``block_ids`` of ``request_id`` for its readers (a lease).

        ``lease_s`` 0 means the daemon default; capped at ``max_lease_s``. A
        second hold of the same request and blocks renews the lease (issue 4,
        scenario 4). Emits ``CommandRejected`` on bad input, ``SendDone`` when
        the lease ends.
        """
        if not request_id:
            self._emit(w, CommandRejected("", "hold: request_id is empty"))
            return
        if len(flat(block_ids)) > self.limits.max_blocks_per_request:
            self._emit(w, CommandRejected(request_id, "hold: too many blocks"))
            return
        try:
            lay.descriptor_indices(flat(block_ids), 1, w.layout.num_blocks)
        except LayoutError as e:
            self._emit(w, CommandRejected(request_id, f"hold: {e}"))
            return
        if request_id not in w.leases.leases and len(w.leases) >= self.limits.max_leases_per_worker:
            self._emit(w, CommandRejected(request_id, f"hold: {self.limits.max_leases_per_worker} leases held "
                                                      f"already (max_leases_per_worker)"))
            return
        now = time.monotonic()
        lease_s = min(lease_s if lease_s > 0 else self.limits.lease_s, self.limits.max_lease_s)
        result = w.leases.hold(request_id, [list(g) for g in block_ids], now + lease_s, now)
        if result == "conflict":
            self._emit(w, CommandRejected(request_id, "hold: request already holds other blocks"))
        elif result == "done":
            self.counters.leases_notified += 1
            self._emit(w, SendDone(request_id))
            log.info("%s request=%s: readers notified before the hold; blocks freed", w.label, request_id)

    def release(self, w: Worker, request_id: str) -> None:
        """Ends a lease now (the request was aborted); emits ``SendDone(released)``."""
        if not w.leases.release(request_id):
            self._emit(w, CommandRejected(request_id, "release: no lease for this request"))
            return
        self.counters.leases_released += 1
        self._emit(w, SendDone(request_id, released=True))

    def _on_notif(self, w: Worker, remote_agent: str, msg: bytes) -> None:
        parsed = parse_notif(msg)
        if parsed is None:
            log.warning("%s: malformed notification from %s ignored (%d bytes)", w.label, remote_agent, len(msg))
            return
        request_id, expected = parsed
        if w.leases.notify(request_id, expected, time.monotonic()):
            self.counters.leases_notified += 1
            log.debug("%s request=%s: every reader notified; lease ended", w.label, request_id)
            self._emit(w, SendDone(request_id))

    # -------------------------------------------------------------- decode side
    async def load(self, w: Worker, request_id: str, local_block_ids: BlockGroups, *args, **kwargs) -> None:
        """Pulls remote blocks into local blocks; emits RecvDone or LoadFailed
        (see :meth:`_load`). Never raises: an unexpected error (a bug, or peer
        input no check foresaw) still ends the request with LoadFailed, so no
        request is left without an answer (issue 4)."""
        try:
            await self._load(w, request_id, local_block_ids, *args, **kwargs)
        except Exception as e:
            log.exception("%s request=%s: load failed unexpectedly", w.label, request_id)
            w.pending_loads.discard(request_id)
            if request_id not in w.inflight:
                self.counters.transfers_failed += 1
                self._on_event("failure", {"reason": "internal"})
                self._emit(w, LoadFailed(request_id, flat(local_block_ids), f"internal: {type(e).__name__}: {e}"))

    async def _load(
        self,
        w: Worker,
        request_id: str,
        local_block_ids: BlockGroups,
        remote_engine_id: str,
        remote_address: str,
        remote_block_ids: BlockGroups,
        remote_request_id: str,
        remote_tp_size: int,
        timeout_s: float = 0.0,
        _deadline: float | None = None,
    ) -> None:
        """Pulls remote blocks into local blocks; emits RecvDone or LoadFailed.

        Block ids come per KV-cache group (one group without HMA):
        ``remote_block_ids[g][i]`` fills slot ``i % k`` of local block
        ``local_block_ids[g][i // k]`` (``k`` = local / remote block size).
        Reads from every source rank the plan needs (``remote_tp_size`` 0
        means the local TP size) and notifies all overlapping ones.

        Never raises: every failure becomes ``LoadFailed`` naming the local
        block ids, so the engine's recompute/fail policy applies. A READ that
        fails on a cached remote agent (the peer may have restarted with a new
        agent, issue 4 scenario 2) drops that agent, handshakes again and
        retries once, within the same deadline.
        """
        started = time.monotonic()
        epoch = w.epoch
        deadline = _deadline or started + self._timeout(timeout_s)
        args = (w, request_id, local_block_ids, remote_engine_id, remote_address, remote_block_ids,
                remote_request_id, remote_tp_size, timeout_s)

        def fail(reason: str) -> None:
            self.counters.transfers_failed += 1
            log.warning("%s request=%s peer=%s: load failed: %s", w.label, request_id, remote_address, reason)
            self._on_event("failure", {"reason": reason.split(":")[0]})
            self._emit(w, LoadFailed(request_id, flat(local_block_ids), reason))

        if not request_id or request_id in w.inflight or (request_id in w.pending_loads and _deadline is None):
            self._emit(w, CommandRejected(request_id, "load: empty or duplicate request_id"))
            return
        if not flat(remote_block_ids):
            # Nothing to move (a full local prefix hit, or the request ended
            # before its load): done at once, and the source is told nobody
            # will read, so it frees its blocks now rather than at lease end.
            self._emit(w, RecvDone(request_id, 0, 0, 0, 0.0))
            if remote_request_id and remote_address:
                asyncio.get_running_loop().create_task(self.abort_load(
                    w, request_id, remote_engine_id, remote_address, remote_request_id, remote_tp_size))
            return
        if max(len(flat(local_block_ids)), len(flat(remote_block_ids))) > self.limits.max_blocks_per_request:
            return fail(f"invalid: more than {self.limits.max_blocks_per_request} blocks")
        if len(w.inflight) + len(w.pending_loads) >= self.limits.max_inflight_per_worker:
            return fail("busy: too many loads in flight for this worker")
        try:  # local input is checked before any network or NIXL call
            lay.descriptor_indices(flat(local_block_ids), 1, w.layout.num_blocks)
        except LayoutError as e:
            return fail(f"invalid: local {e}")
        if remote_tp_size > MAX_TP_SIZE:
            return fail(f"invalid: remote TP size {remote_tp_size} exceeds {MAX_TP_SIZE}")
        remote_tp = remote_tp_size or w.tp_size
        geo = w.geometry()
        try:
            read_from, notify = plan.source_ranks(w.key[1], w.tp_size, remote_tp, geo.total_kv_heads,
                                                  w.layout.kv_layout == "MLA")
        except plan.PlanError as e:
            return fail(f"incompatible: {e}")
        if self.limits.transfer_mode == "push":
            w.pending_loads.add(request_id)
            try:
                return await self._load_push(w, request_id, local_block_ids, remote_engine_id, remote_address,
                                             remote_block_ids, remote_request_id, remote_tp, read_from, notify,
                                             started, deadline, fail)
            finally:
                w.pending_loads.discard(request_id)
        w.pending_loads.add(request_id)
        posted: list[tuple[object, RemoteWorker]] = []
        nbytes = ndescs = 0
        posts_s = 0.0
        fresh_any = False
        err = ""
        try:
            remotes: dict[int, RemoteWorker] = {}
            try:
                for p in notify:
                    remotes[p], fresh = await self._remote(w, remote_address, remote_engine_id, p, remote_tp,
                                                           deadline)
                    fresh_any |= fresh
            except Incompatible as e:
                # Nobody will ever read these blocks: free them on the source
                # now (by gRPC: there is no NIXL pair), not at its lease's end.
                heads, mla = geo.total_kv_heads, w.layout.kv_layout == "MLA"
                for p in notify:
                    asyncio.get_running_loop().create_task(self._notify_by_rpc(
                        remote_address, remote_engine_id, p, remote_request_id,
                        plan.expected_notifications(p, remote_tp, w.tp_size, heads, mla), deadline, w.label))
                return fail(f"handshake: {e}")
            except (NotFound, PeerUnavailable, InvalidArgument) as e:
                return fail(f"handshake: {e}")
            if w.key not in self.workers:
                return fail("worker unregistered")
            if w.epoch != epoch:
                log.info("%s request=%s: session ended during the handshake; load dropped", w.label, request_id)
                return
            for p in read_from:
                r = remotes[p]
                try:
                    lidx, ridx = plan.chunk_indices(local_block_ids, remote_block_ids, r.num_regions,
                                                    w.layout.num_blocks, r.layout.num_blocks, r.k, r.C,
                                                    r.region_groups)
                except LayoutError as e:
                    err = f"invalid: {e}"
                    break
                msg = notif_message(remote_request_id, plan.expected_notifications(
                    p, remote_tp, w.tp_size, geo.total_kv_heads, w.layout.kv_layout == "MLA"))
                try:
                    handle, state, post_s = await self._nixl(self._post, w.agent, "READ", r.local_dlist, lidx,
                                                             r.remote_dlist, ridx, msg)
                    posts_s += post_s
                except NixlError as e:
                    err = f"nixl: {e}"
                    break
                if handle is not None:
                    posted.append((handle, r))
                if state == "ERR":
                    err = "nixl: transfer post returned ERR"
                    break
                ndescs += len(lidx)
                nbytes += r.transfer_bytes(remote_block_ids)
            else:
                for p in notify:
                    if p not in read_from:
                        await self._nixl(w.agent.send_notif, remotes[p].agent_name, notif_message(
                            remote_request_id, plan.expected_notifications(
                                p, remote_tp, w.tp_size, geo.total_kv_heads, w.layout.kv_layout == "MLA")))
        except NixlError as e:
            err = f"nixl: {e}"
        finally:
            w.pending_loads.discard(request_id)
        retry = args if (not fresh_any and _deadline is None) else None
        if err:
            for h, r in posted:
                await self._nixl(self._release_handle, w.agent, h)
            if retry and err.startswith("nixl") and w.key in self.workers:
                for _, r in posted:
                    self._retire(w, r, err)
                for p in read_from:
                    self._retire(w, remotes[p], err)
                return await self.load(*retry, _deadline=deadline)
            return fail(err)
        w.inflight[request_id] = InflightLoad(
            request_id, flat(local_block_ids), posted, started, deadline, nbytes, ndescs, remote_address, retry,
            post_s=posts_s,
        )
        if not posted:  # every READ was done when posted: no poll round to wait for
            self._finish(w, request_id, time.monotonic())
            return
        self._kick.set()

    async def _load_push(self, w: Worker, request_id, local_block_ids, remote_engine_id, remote_address,
                         remote_block_ids, remote_request_id, remote_tp, read_from, notify, started, deadline,
                         fail) -> None:
        """Push mode: each source rank WRITEs into our blocks (PeerService.Push)."""
        me = await self.describe(w)
        heads, mla = w.layout.model_kv_heads(w.tp_size), w.layout.kv_layout == "MLA"

        async def one(p: int):
            expected = plan.expected_notifications(p, remote_tp, w.tp_size, heads, mla)
            left = max(0.1, deadline - time.monotonic())
            if p not in read_from:
                await self.peers.notify(remote_address, remote_engine_id, p, remote_request_id, expected, left)
                return None
            order = PushOrder(remote_engine_id, p, remote_request_id, remote_block_ids, me, w.key[1],
                              local_block_ids, expected, left)
            return await self.peers.push(remote_address, order, left)

        try:
            results = await asyncio.wait_for(asyncio.gather(*(one(p) for p in notify)),
                                             max(0.1, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return fail("timeout: push not done by the deadline")
        except (Incompatible, NotFound, PeerUnavailable, InvalidArgument) as e:
            return fail(f"push: {e}")
        if w.key not in self.workers:
            return
        done = [r for r in results if r is not None]
        nbytes, ndescs, dur = sum(r.bytes for r in done), sum(r.num_descriptors for r in done), \
            time.monotonic() - started
        self.counters.bytes_read += nbytes
        self.counters.transfers_done += 1
        self._on_event("transfer", {"bytes": nbytes, "seconds": dur, "descs": ndescs})
        self._emit(w, RecvDone(request_id, nbytes, len(flat(local_block_ids)), ndescs, dur))

    def _retire(self, w: Worker, remote: RemoteWorker, why: str) -> None:
        """Stops using a remote agent; its NIXL state is freed once no load uses it."""
        if w.remotes.get(remote.key) is remote:
            del w.remotes[remote.key]
            w.retired.append(remote)
            log.info("%s: dropped remote agent %s at %s (%s); next load handshakes again",
                     w.label, remote.agent_name, remote.address, why)

    def _load_agent(self, w: Worker, name: str, metadata: bytes) -> str:
        """NIXL thread: loads a peer's agent into ``w``'s agent once; counts its users.

        Several remotes may be one NIXL agent (the same peer under two
        addresses, a push reader that is also a source, or a peer description
        replayed by someone else), and NIXL keeps one entry per name: the
        entry is shared and removed with its last user. Before, the second
        load failed and dropping either remote broke the other (issue 4,
        scenario 9).

        Raises:
            NixlError: the metadata is rejected, names another agent than
                ``name``, or differs from what is loaded under ``name``.
        """
        embedded = metadata_agent_name(metadata)
        if embedded != name:
            raise NixlError(f"agent metadata names {embedded!r}, the peer said {name!r}")
        known = w.agents.get(name)
        if known is not None:
            if known[0] != metadata:
                raise NixlError(f"agent {name!r} is loaded already, with other metadata")
            w.agents[name] = (metadata, known[1] + 1)
            return name
        loaded = w.agent.add_remote(metadata)
        if loaded != name:  # not NIXL 1.5's format after all: undo what is ours to undo
            if loaded not in w.agents:
                w.agent.remove_remote(loaded)
            raise NixlError(f"agent metadata loaded as {loaded!r}, the peer said {name!r}")
        w.agents[name] = (metadata, 1)
        return name

    def _unload_agent(self, w: Worker, name: str) -> None:
        """NIXL thread: one user fewer of a peer agent; the last one removes it."""
        metadata, users = w.agents.pop(name, (b"", 1))
        if users > 1:
            w.agents[name] = (metadata, users - 1)
        else:
            w.agent.remove_remote(name)

    def _free_remote(self, w: Worker, r: RemoteWorker) -> None:
        """NIXL thread: releases a remote's prepped lists and forgets its agent."""
        lists = [r.remote_dlist] + ([r.local_dlist] if r.owns_local_dlist else [])
        for d in lists:
            try:
                w.agent.release_dlist(d)
            except Exception as e:
                log.debug("%s: release_dlist(%s): %s", w.label, r.agent_name, e)
        self._unload_agent(w, r.agent_name)

    async def abort_load(self, w: Worker, request_id: str, remote_engine_id: str, remote_address: str,
                         remote_request_id: str, remote_tp_size: int) -> None:
        """Tells the remote prefill ranks to free ``remote_request_id`` now.

        The decode request was aborted before its load (issue 4, scenario 3):
        bare NIXL notifications end the remote lease, as READs' would.
        Failures are logged, never raised: the remote lease bounds the hold.
        """
        deadline = time.monotonic() + self.limits.handshake_timeout_s
        if remote_tp_size > MAX_TP_SIZE:
            log.warning("%s request=%s: abort ignored: remote TP size %d exceeds %d", w.label, request_id,
                        remote_tp_size, MAX_TP_SIZE)
            return
        remote_tp = remote_tp_size or w.tp_size
        mla = w.layout.kv_layout == "MLA"
        heads = w.layout.model_kv_heads(w.tp_size)
        try:
            _, notify = plan.source_ranks(w.key[1], w.tp_size, remote_tp, heads, mla)
            for p in notify:
                expected = plan.expected_notifications(p, remote_tp, w.tp_size, heads, mla)
                try:
                    remote, _ = await self._remote(w, remote_address, remote_engine_id, p, remote_tp, deadline)
                except Incompatible:
                    # No NIXL pair with an incompatible peer (a refused layout
                    # or block size): PeerService.Notify frees it by gRPC.
                    await self._notify_by_rpc(remote_address, remote_engine_id, p, remote_request_id, expected,
                                              deadline, w.label)
                    continue
                await self._nixl(w.agent.send_notif, remote.agent_name, notif_message(remote_request_id, expected))
            log.info("%s request=%s: aborted; told %s to free %s", w.label, request_id, remote_address,
                     remote_request_id)
        except Exception as e:
            log.warning("%s request=%s peer=%s: abort notification failed: %s", w.label, request_id,
                        remote_address, e)

    async def _notify_by_rpc(self, address: str, engine_id: str, tp_rank: int, request_id: str, expected: int,
                             deadline: float, label: str) -> None:
        """One reader's notification of ``request_id`` to a source rank, over
        PeerService.Notify instead of NIXL (no handshake needed: used when
        the pair was refused). Failures are logged, never raised: the source's
        lease bounds the hold."""
        try:
            if self.peers is None:
                raise PeerUnavailable("this daemon has no peer client")
            await self.peers.notify(address, engine_id, tp_rank, request_id, expected,
                                    max(0.1, deadline - time.monotonic()))
            log.info("%s: told %s engine=%s rank=%d to free %s (no transfer possible)", label, address, engine_id,
                     tp_rank, request_id)
        except Exception as e:
            log.warning("%s: could not tell %s engine=%s rank=%d to free %s: %s", label, address, engine_id,
                        tp_rank, request_id, e)

    def _post(self, agent: NixlAgent, op: str, local, lidx, remote, ridx, msg: bytes):
        """NIXL thread: posts a transfer; ``(handle, state, seconds inside the
        post call)``. One already DONE
        (UCX moves shared-memory bytes inside the post) is released here and
        its handle is None: nothing is left to poll. One still in progress is
        checked again for up to ``POST_SPIN_S`` first (its notification is
        usually a moment from done): cheaper than a round through the
        progress loop (docs/PERFORMANCE.md, "fast path")."""
        t0 = time.monotonic()
        handle, state = agent.post(op, local, lidx, remote, ridx, msg)
        post_s = time.monotonic() - t0
        if state == "PROC" and POST_SPIN_S > 0:
            until = time.monotonic() + POST_SPIN_S
            while state == "PROC" and time.monotonic() < until:
                state = agent.state(handle)
        if state == "DONE":
            self._release_handle(agent, handle)
            return None, state, post_s
        return handle, state, post_s

    def _release_handle(self, agent: NixlAgent, handle) -> None:
        if not agent.release(handle):
            self._zombies.append((agent, handle))

    async def _remote(self, w: Worker, address: str, engine_id: str, tp_rank: int, tp_size: int,
                      deadline: float) -> tuple[RemoteWorker, bool]:
        """The remote worker, handshaking if needed; ``(remote, fresh)``.

        A handshake that fails as unreachable or slow (a transient
        ``PeerUnavailable``: the daemon's ``handshake_timeout_s``, a refused
        connection; not a peer failing its token proof) is tried
        once more when the request's own deadline leaves at least
        ``RETRY_HANDSHAKE_MIN_S`` seconds, unless the daemon is draining: a
        peer starved for a moment (seen on a loaded 2-core machine, the first
        handshake of a fresh pair taking > 10 s and the next 0.3 s) must not
        fail a load that still has most of its deadline. Other errors
        (incompatible, not found, invalid) are final.

        Raises:
            PeerUnavailable, Incompatible, NotFound, InvalidArgument.
        """
        try:
            return await self._remote_once(w, address, engine_id, tp_rank, tp_size, deadline)
        except PeerUnavailable as e:
            if not e.transient or self.draining or deadline - time.monotonic() < RETRY_HANDSHAKE_MIN_S:
                raise
            log.warning("%s: handshake with %s engine=%s rank=%d failed (%s); trying once more within the "
                        "request's deadline (%.1f s left)", w.label, address, engine_id, tp_rank, e,
                        deadline - time.monotonic())
        return await self._remote_once(w, address, engine_id, tp_rank, tp_size, deadline)

    async def _remote_once(self, w: Worker, address: str, engine_id: str, tp_rank: int, tp_size: int,
                           deadline: float) -> tuple[RemoteWorker, bool]:
        """The remote worker, handshaking if needed (one try); ``(remote, fresh)``."""
        key = (address, engine_id, tp_rank)
        r = w.remotes.get(key)
        if r is not None:
            return r, False
        fkey = (w.key, key)
        fut = self._handshakes.get(fkey)
        if fut is None:
            # One handshake per remote worker, shared by every request that
            # needs it. It runs to the daemon's handshake timeout; each request
            # waits for it only until its own deadline (issue 4: a request
            # that joined another's handshake once ended seconds late).
            fut = asyncio.get_running_loop().create_task(self._do_handshake(w, key, tp_size))
            self._handshakes[fkey] = fut

            def done(f: asyncio.Future) -> None:
                self._handshakes.pop(fkey, None)
                if not f.cancelled():
                    f.exception()  # retrieved: its waiters report it, asyncio need not log it

            fut.add_done_callback(done)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - time.monotonic())), True
        except asyncio.TimeoutError:
            raise PeerUnavailable(f"{address}: no handshake answer by the request's deadline") from None

    async def _do_handshake(self, w: Worker, key: PeerKey, tp_size: int) -> RemoteWorker:
        address, engine_id, tp_rank = key
        if self.peers is None:
            raise PeerUnavailable("this daemon has no peer client")
        if not address or ":" not in address:
            raise InvalidArgument(f"remote address {address!r} is not host:port")
        timeout = self.limits.handshake_timeout_s
        t0 = time.monotonic()
        hs = await self.peers.handshake(address, engine_id, tp_rank, w.compat_hash, timeout)
        if hs.tp_size != tp_size:
            raise Incompatible(f"remote engine {engine_id!r} has TP size {hs.tp_size}, the request says {tp_size}")
        _check_peer(w, hs, "handshake")
        # An agent of the same name still loaded (a retired one, or the peer's
        # old identity) is forgotten first: NIXL keeps one entry per name.
        for old in [o for o in w.retired if o.agent_name == hs.agent_name]:
            w.retired.remove(old)
            await self._nixl(self._free_remote, w, old)
        try:
            r = await self._pair(w, hs, tp_rank, we_read=True, address=address, engine_id=engine_id)
        except NixlError as e:
            raise InvalidArgument(f"agent metadata rejected: {e}") from None
        if w.key not in self.workers:
            raise NotFound("local worker unregistered during the handshake")
        w.remotes[key] = r
        self.counters.handshakes += 1
        self._on_event("handshake", {"seconds": time.monotonic() - t0})
        log.info("%s: handshake with %s engine=%s rank=%d/%d agent=%s (kvd %s) in %.1f ms: %d chunk(s) x %d slot(s)",
                 w.label, address, engine_id, tp_rank, hs.tp_size, r.agent_name, hs.daemon_version,
                 1e3 * (time.monotonic() - t0), r.C, r.k)
        return r

    async def _pair(self, w: Worker, hs: HandshakeResult, peer_rank: int, *, we_read: bool, address: str,
                    engine_id: str) -> RemoteWorker:
        """Loads a peer worker's agent into ``w``'s and prepares both
        descriptor lists of the pair's transfer plan (``kvd.core.plan``).

        ``we_read``: ``w`` is the reader (pull: it READs from the peer);
        otherwise ``w`` is the source (push: it WRITEs into the peer). The
        returned RemoteWorker's ``local_dlist`` is always ``w``'s side (its
        own prepped list when the plan is the identity on its side) and
        ``remote_dlist`` the peer's. Units: bytes in ``region_bytes``.

        Raises:
            Incompatible: the layouts cannot be combined.
            NixlError: NIXL refused the agent metadata or a list (the agent is
                unloaded again).
        """
        ours = w.geometry()
        theirs = plan.Geometry(peer_rank, hs.tp_size, hs.layout, tuple(hs.regions),
                               hs.layout.model_kv_heads(hs.tp_size))
        reader, source = (ours, theirs) if we_read else (theirs, ours)
        k, C, chunk_sets, reader_identity, source_identity = _pair_plan(reader, source)
        our_rows_of, their_rows_of = (plan.local_rows, plan.remote_rows) if we_read else (plan.remote_rows,
                                                                                          plan.local_rows)
        identity = reader_identity if we_read else source_identity
        our_rows = None if identity else our_rows_of(w.bases, w.regions, w.layout.num_blocks, chunk_sets, k)
        their_rows = their_rows_of(hs.region_bases, hs.regions, hs.layout.num_blocks, chunk_sets, k)

        def add():
            name = self._load_agent(w, hs.agent_name, hs.agent_metadata)
            try:
                theirs_dlist = w.agent.prep_remote(name, _on_device(their_rows, hs.device), hs.memory)
                ours_dlist = (w.local_dlist if our_rows is None
                              else w.agent.prep_local(_on_device(our_rows, w.device), w.memory))
                return name, theirs_dlist, ours_dlist
            except Exception:
                self._unload_agent(w, name)
                raise

        name, theirs_dlist, ours_dlist = await self._nixl(add)
        src_bytes = tuple(int(c[:C, 3].sum()) for c in chunk_sets)
        return RemoteWorker(address, engine_id, peer_rank, hs.tp_size, name, hs.layout, len(hs.regions), k, C,
                            ours_dlist, theirs_dlist, our_rows is not None, hs.daemon_version, src_bytes,
                            tuple(x.group for x in w.regions))

    # ------------------------------------------------------------- peer side
    async def handshake_info(self, engine_id: str, tp_rank: int, caller_hash: str,
                             protocol_version: int = PROTOCOL_VERSION) -> HandshakeResult:
        """Answers a remote daemon's handshake for our worker.

        Raises:
            NotFound: no such worker here.
            Incompatible: other protocol version, or ``caller_hash`` differs
                from the worker's hash (the message names both).
        """
        w = self.worker(engine_id, tp_rank)
        if protocol_version != PROTOCOL_VERSION:
            raise Incompatible(f"protocol version mismatch: caller speaks {protocol_version}, "
                               f"this daemon {PROTOCOL_VERSION} (kvd {__version__})")
        if caller_hash and caller_hash != w.compat_hash:
            raise Incompatible(
                f"compatibility hash mismatch for engine {engine_id!r} rank {tp_rank}: "
                f"caller {caller_hash}, this worker {w.compat_hash}"
            )
        return await self.describe(w)

    async def push(self, order: PushOrder) -> PushResult:
        """Source side of push mode: WRITE a held request's blocks into a reader.

        Counts as one reader's notification of the lease once the WRITE is
        done, as a READ's notification would in pull mode.

        Raises:
            NotFound: no such worker, or no lease for ``order.request_id``.
            InvalidArgument: block ids out of range, malformed reader.
            Incompatible: the layouts cannot be combined.
            PeerUnavailable: the WRITE failed or missed its deadline.
        """
        w = self.worker(order.engine_id, order.tp_rank)
        if order.request_id not in w.leases.leases:
            raise NotFound(f"engine {order.engine_id!r} rank {order.tp_rank} holds no blocks for request "
                           f"{order.request_id!r}")
        if not 0 < order.expected_notifications <= 1 << 16:
            raise InvalidArgument("push: expected_notifications must be in 1..65536")
        limit = self.limits.max_blocks_per_request  # as for a load
        if max(len(flat(order.source_block_ids)), len(flat(order.reader_block_ids))) > limit:
            raise InvalidArgument(f"push: more than {limit} blocks")
        held = w.leases.leases[order.request_id].block_ids
        if len(order.source_block_ids) > len(held) or any(
                not set(g) <= set(h) for g, h in zip(order.source_block_ids, held)):
            # Push is the one mode where the source moves the bytes: it writes
            # only blocks its engine holds for that request (docs/SECURITY.md).
            raise InvalidArgument(f"push: blocks not held for request {order.request_id!r}")
        t0 = time.monotonic()
        reader = order.reader
        _check_peer(w, reader, "push")
        r = w.readers.get(reader.agent_name)
        if r is None:
            try:
                # For a reader, "local" lists are ours (source rows), "remote" the reader's.
                r = await self._pair(w, reader, order.reader_tp_rank, we_read=False, address="",
                                     engine_id=reader.agent_name)
            except NixlError as e:
                raise InvalidArgument(f"push: reader agent metadata rejected: {e}") from None
            w.readers[reader.agent_name] = r
        try:
            dst_idx, src_idx = plan.chunk_indices(order.reader_block_ids, order.source_block_ids, r.num_regions,
                                                  r.layout.num_blocks, w.layout.num_blocks, r.k, r.C,
                                                  r.region_groups)
        except LayoutError as e:
            raise InvalidArgument(f"push: {e}") from None
        try:
            handle, state = await self._nixl(w.agent.post, "WRITE", r.local_dlist, src_idx, r.remote_dlist,
                                             dst_idx, b"")
        except NixlError as e:
            raise PeerUnavailable(f"push: {e}") from None
        fut = asyncio.get_running_loop().create_future()
        timeout = self._timeout(order.timeout_s)
        self._writes[id(handle)] = (w, handle, fut, time.monotonic() + timeout)
        self._kick.set()
        if state == "ERR":
            fut.set_result("ERR")
        st = await fut
        if st != "DONE":
            w.readers.pop(reader.agent_name, None)
            w.retired.append(r)
            raise PeerUnavailable(f"push: WRITE to {reader.agent_name} {st}")
        nbytes = r.transfer_bytes(order.source_block_ids)
        self.notify(order.engine_id, order.tp_rank, order.request_id, order.expected_notifications)
        return PushResult(nbytes, len(src_idx), time.monotonic() - t0)

    def notify(self, engine_id: str, tp_rank: int, request_id: str, expected: int) -> None:
        """One reader is done with ``request_id`` on this worker (push mode's
        bare notification, also used after a push WRITE). Raises NotFound."""
        w = self.worker(engine_id, tp_rank)
        if not 0 < expected <= 1 << 16:
            raise InvalidArgument("notify: expected_notifications must be in 1..65536")
        if w.leases.notify(request_id, expected, time.monotonic()):
            self.counters.leases_notified += 1
            self._emit(w, SendDone(request_id))

    async def describe(self, w: Worker) -> HandshakeResult:
        """``w`` as a handshake describes it (agent metadata, layout, regions)."""
        meta = await self._nixl(w.agent.metadata)
        return HandshakeResult(meta, w.agent.name, w.layout, w.regions, w.bases, w.compat_hash, __version__,
                               PROTOCOL_VERSION, w.tp_size, memory=w.memory, device=w.device)

    # --------------------------------------------------------------- progress
    def _poll(self):
        """NIXL thread: finished READs, new notifications, unused remotes."""
        done = []
        still = []
        for agent, h in self._zombies:
            if not agent.release(h):
                still.append((agent, h))
        self._zombies = still
        now = time.monotonic()
        for key, (w, h, fut, deadline) in list(self._writes.items()):
            st = w.agent.state(h)
            if st == "PROC" and now < deadline:
                continue
            self._writes.pop(key, None)
            if not w.agent.release(h):
                self._zombies.append((w.agent, h))
            done.append((w, fut, "WRITE", st if st != "PROC" else "past its deadline"))
        for w in list(self.workers.values()):
            for rid, load in list(w.inflight.items()):
                still = []
                for h, r in load.parts:
                    st = w.agent.state(h)
                    if st == "PROC":
                        still.append((h, r))
                        continue
                    if not w.agent.release(h):
                        self._zombies.append((w.agent, h))
                    if st != "DONE":
                        done.append((w, rid, "ERR", r))
                load.parts = still
                if not still:
                    done.append((w, rid, "END", None))
            if w.retired and not any(a is w.agent for a, _ in self._zombies):
                used = {id(r) for l in list(w.inflight.values()) for _, r in l.parts}
                for r in [r for r in w.retired if id(r) not in used]:
                    w.retired.remove(r)
                    self._free_remote(w, r)
            for agent_name, msgs in w.agent.notifs().items():
                for m in msgs:
                    done.append((w, agent_name, "NOTIF", m))
        return done

    async def _progress_loop(self) -> None:
        while not self._closing:
            try:
                results = await self._nixl(self._poll)
            except Exception:
                log.exception("progress poll failed")
                results = []
            now = time.monotonic()
            for w, a, st, extra in results:
                if w.key not in self.workers and st != "WRITE":
                    continue
                if st == "NOTIF":
                    self._on_notif(w, a, extra)
                elif st == "ERR":
                    load = w.inflight.get(a)
                    if load is not None and not load.failed:
                        load.failed = f"transfer: NIXL error reading from {extra.agent_name}"
                        self._retire(w, extra, "READ failed")
                elif st == "END":
                    self._finish(w, a, now)
                elif st == "WRITE" and not a.done():
                    a.set_result(extra)
            self._expire(now)
            busy = bool(self._writes) or any(w.inflight for w in self.workers.values())
            self._kick.clear()
            try:
                await asyncio.wait_for(self._kick.wait(), self.limits.poll_busy_s if busy else self.limits.poll_idle_s)
            except asyncio.TimeoutError:
                pass

    def _finish(self, w: Worker, request_id: str, now: float) -> None:
        load = w.inflight.pop(request_id, None)
        if load is None:
            return
        if not load.failed:
            dur = now - load.started
            self.counters.bytes_read += load.nbytes
            self.counters.transfers_done += 1
            self._on_event("transfer", {"bytes": load.nbytes, "seconds": dur, "descs": load.ndescs})
            log.debug("%s request=%s: %d bytes in %.2f ms", w.label, request_id, load.nbytes, dur * 1e3)
            self._emit(w, RecvDone(request_id, load.nbytes, len(load.local_block_ids), load.ndescs, dur,
                                   load.post_s))
        elif load.retry and now < load.deadline:
            log.info("%s request=%s: %s; retrying after a new handshake", w.label, request_id, load.failed)
            asyncio.get_running_loop().create_task(self.load(*load.retry, _deadline=load.deadline))
        else:
            self.counters.transfers_failed += 1
            self._on_event("failure", {"reason": "transfer"})
            log.warning("%s request=%s peer=%s: %s", w.label, request_id, load.peer, load.failed)
            self._emit(w, LoadFailed(request_id, load.local_block_ids, load.failed))

    def _expire(self, now: float) -> None:
        for w in list(self.workers.values()):
            for rid in w.leases.expire(now):
                self.counters.leases_expired += 1
                log.warning("%s request=%s: lease expired, nobody read the blocks", w.label, rid)
                self._emit(w, SendDone(rid, expired=True))
            for load in [l for l in w.inflight.values() if l.deadline <= now]:
                w.inflight.pop(load.request_id)
                self.counters.transfers_failed += 1
                self._on_event("failure", {"reason": "timeout"})
                log.warning("%s request=%s peer=%s: transfer past its deadline", w.label, load.request_id, load.peer)
                self._emit(w, LoadFailed(load.request_id, load.local_block_ids, "timeout: transfer past its deadline"))
                for h, r in load.parts:
                    self._retire(w, r, "transfer past its deadline")
                    self._zombies.append((w.agent, h))  # released (or cancelled) by the next poll
            if (w.detached_since is not None and not w.sessions
                    and now - w.detached_since > self.limits.detach_grace_s):
                w.detached_since = None
                asyncio.get_running_loop().create_task(self._drop_detached(w.key))

    async def _drop_detached(self, key: WorkerKey) -> None:
        try:
            await self.unregister(key, reason=f"no session for {self.limits.detach_grace_s:.0f} s", engine_gone=True)
        except NotFound:
            pass  # unregistered meanwhile

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """Counts for GetStats, ``kvd status`` and metrics."""
        ws = list(self.workers.values())
        return dict(
            engines=len(ws),
            regions=sum(len(w.regions) for w in ws),
            registered_bytes=sum(w.registered_bytes for w in ws),
            peers=len({(k[0], k[1]) for w in ws for k in w.remotes}),
            active_leases=sum(len(w.leases) for w in ws),
            inflight_transfers=sum(len(w.inflight) for w in ws),
            sessions=sum(w.sessions for w in ws),
            uptime_s=time.monotonic() - self.started,
            leaked_handles=len(self._zombies),
            # Push-mode readers are remote agents with prepped lists too.
            remote_agents=sum(len(w.remotes) + len(w.retired) + len(w.readers) for w in ws),
            early_notifications=sum(len(w.leases.early) for w in ws),
            pending_events=sum(len(w.events) for w in ws if not w.sessions),
            prepped_dlists=sum(1 + sum(1 + r.owns_local_dlist
                                       for r in [*w.remotes.values(), *w.retired, *w.readers.values()])
                               for w in ws),
            bytes_read=self.counters.bytes_read,
            transfers_done=self.counters.transfers_done,
            transfers_failed=self.counters.transfers_failed,
            leases_expired=self.counters.leases_expired,
        )
