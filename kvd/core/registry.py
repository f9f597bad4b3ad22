"""Registry: the engine workers registered with this daemon.

Registration maps a worker's segments (POSIX shm, or CUDA IPC opened on its
GPU, ``kvd.core.cuda_ipc``; mirrors for the staged data path), makes its NIXL
agent and registers its memory; unregistration frees all of it. Sessions
attach to and detach from a worker; a worker detached past
``Limits.detach_grace_s`` is dropped by the progress loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid

from kvd import cuda_copy
from kvd.core import cuda_ipc
from kvd.core import layout as lay
from kvd.core.events import (AlreadyExists, FailureKind, InvalidArgument, NotFound, PermissionDenied,
                             ResourceExhausted)
from kvd.core.layout import Layout, LayoutError, Region
from kvd.core.leases import LeaseTable
from kvd.core.limits import BOUNDS
from kvd.core.memory import (MEMFD_KIND, Access, FdMapping, SegmentAccessError, SegmentError, ShmMapping, create_shm,
                             unlink_shm)
from kvd.core.nixl_agent import DRAM, NixlAgent, NixlError
from kvd.core.peers import Peers, on_device
from kvd.core.runtime import Runtime
from kvd.core.state import Owner, Segment, Worker, WorkerKey, WorkerMemory

log = logging.getLogger("kvd.core")

#: How long a replaced agent may wait for the last handle bound to it (seconds; measured: one NIXL call).
CLOSE_WAIT_S = 2.0


class Registry:
    """Registers and drops engine workers (``Runtime.workers``).

    Args:
        rt: the core's shared state.
        peers: frees a dropped worker's remote agents.
        backends: NIXL backends of every agent (``["UCX"]`` by default).
    """

    def __init__(self, rt: Runtime, peers: Peers, backends: list[str]):
        self.rt = rt
        self.peers = peers
        self.backends = backends
        # Registrations under way (they await mapping and NIXL before the
        # worker lands in rt.workers): key -> (uid or None, block descriptors,
        # host bytes, VRAM mirror bytes). The caps and the engine id checks count them, or
        # concurrent calls all passed (an attacker review registered 100
        # workers at once past max_workers_per_uid 32).
        self._registering: dict[WorkerKey, tuple[int | None, int, int, int]] = {}
        # Registrations cancelled (the caller's deadline) while the NIXL
        # thread made their mirrors or agent: the task that frees what it made
        # -> the registration's reservation, counted as _registering until
        # then (_made_on_nixl_thread); awaited at shutdown (released()).
        self._releasing: dict[asyncio.Task, tuple[int | None, int, int, int]] = {}

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
        owner: Owner | None = None,
    ) -> Worker:
        """Maps the worker's segments, makes its NIXL agent, registers memory.

        ``staged``: the daemon makes a mirror segment of each size and
        registers those instead (``WorkerMemory.staging`` names them); the shim
        copies blocks between its cache and the mirror. CUDA IPC segments
        (``kvd.core.cuda_ipc``) are opened on their GPU and
        registered as VRAM; their mirrors are daemon-owned VRAM, and
        ``staged=None`` (``data_path = auto``) lets the daemon choose
        (``kvd.core.path_select``). Staged CUDA segments on a daemon
        without a GPU get shm mirrors (the shim copies through host
        memory). ``owner``: who registered (the gate's view of the caller);
        each shm segment must be one it could read and write itself (None:
        not checked). ``owner_pid``: the process that made the segments
        (``RegisterEngineRequest.owner_pid``; 0: unknown).

        Raises:
            InvalidArgument: bad ids, layout or regions, or a segment that is
                missing or smaller than asked (nothing stays mapped).
            PermissionDenied: ``owner`` may not read and write a segment, or
                another uid owns ``engine_id``.
            AlreadyExists: the worker is registered already.
            ResourceExhausted: past a cap on workers, descriptors, host
                memory or VRAM mirrors (:meth:`_check_caps`).
        """
        if not engine_id or len(engine_id) > BOUNDS.max_engine_id_chars:
            raise InvalidArgument(f"engine_id must be 1..{BOUNDS.max_engine_id_chars} characters")
        if not 1 <= tp_size <= BOUNDS.max_tp_size:
            raise InvalidArgument(f"tp_size must be in 1..{BOUNDS.max_tp_size} (got {tp_size})")
        if not 0 <= tp_rank < tp_size:
            raise InvalidArgument(f"tp_rank {tp_rank} must be in 0..tp_size-1 (tp_size {tp_size})")
        self._check_engine_id(engine_id, tp_rank, owner)
        if not segments or len(segments) > BOUNDS.max_regions:
            raise InvalidArgument(f"a worker registers 1..{BOUNDS.max_regions} segments (got {len(segments)})")
        try:
            lay.validate(layout, regions, [s.size for s in segments])
        except LayoutError as e:
            raise InvalidArgument(str(e)) from None
        kinds = {s.kind for s in segments}
        # VRAM is the device's to bound; CUDA segments staged on a daemon
        # without a GPU get shm mirrors of their sizes: host memory.
        vram = cuda_ipc.KIND in kinds and cuda_ipc.wants_vram(staged)
        host = 0 if vram else sum(s.size for s in segments)
        # Staged, or auto (which may stage): the daemon allocates mirrors of
        # these sizes on the GPU, counted before any is made.
        mirrors = sum(s.size for s in segments) if vram and staged is not False else 0
        descriptors = len(regions) * layout.num_blocks
        self._check_caps(descriptors, owner, host, mirrors)
        with self._reserved((engine_id, tp_rank), owner, descriptors, host, mirrors):
            access = Access(owner.uid, owner.gids) if owner is not None else None
            mappings: list[ShmMapping] = []
            staging: list[str] = []
            cuda = None
            try:
                if len(kinds) > 1:
                    raise SegmentError(f"a worker's segments must all be of one kind (got {sorted(kinds)})")
                if vram:
                    async def close_opened(made):
                        for m in made.mappings if made is not None else ():
                            m.close()

                    cuda = await self._made_on_nixl_thread(
                        (engine_id, tp_rank), close_opened, cuda_ipc.open_segments, segments,
                        "auto" if staged is None else "staged" if staged else "direct")
                    mappings, staged = cuda.mappings, cuda.staged
                    if self.rt.limits.same_node_copy:
                        # Built now, not in a load's way (NVRTC: ~0.1-0.3 s). Not awaited: a
                        # registration cancelled here would leave its mirrors allocated.
                        self.rt.nixl(warm_copy_kernel, cuda.device)
                else:
                    staged = bool(staged)
                    for s in segments:
                        if staged:
                            staging.append(create_shm(s.size, uid=owner.uid if owner is not None else -1))
                        if s.kind == MEMFD_KIND and not staged:  # handed over by fd: nothing named, nothing to unlink
                            mappings.append(FdMapping(s.fd, s.size, s.name))
                            continue
                        mappings.append(ShmMapping(staging[-1] if staged else s.name, s.size,
                                                   None if staged else access))
            except (SegmentError, OSError) as e:
                for m in mappings:
                    m.close()
                for n in staging:
                    unlink_shm(n)
                raise (PermissionDenied if isinstance(e, SegmentAccessError) else InvalidArgument)(str(e)) from None
            name = f"kvd-{engine_id}-r{tp_rank}-{uuid.uuid4().hex[:8]}"

            async def free_made(made):
                try:
                    if made is not None:  # the agent first: its registrations name the mappings
                        await self.rt.nixl(self._free_made_agent, *made)
                finally:  # whatever became of the agent, no mirror outlives the daemon
                    for m in mappings:
                        m.close()
                    for n in staging:
                        unlink_shm(n)

            try:
                agent, regs, dlist = await self._made_on_nixl_thread(
                    (engine_id, tp_rank), free_made, self._make_agent, name, mappings, layout, regions,
                    "VRAM" if cuda else "DRAM", cuda.device if cuda else 0)
            except NixlError as e:
                for m in mappings:
                    m.close()
                for n in staging:
                    unlink_shm(n)
                why = str(e)
                if cuda and not staged:
                    # Seen on an H200 (docs/GPU.md): UCX's cuda_ipc packs a key for registered VRAM
                    # with cuIpcGetMemHandle, which fails on memory this process opened from an IPC
                    # handle, and NIXL 1.5.1 then refuses the whole registration (NIXL_ERR_BACKEND).
                    why += ("; the engine's CUDA memory was opened here from its IPC handle, which UCX cannot "
                            "export again (cudaIpcGetMemHandle fails on an imported mapping): register with "
                            "data path auto or staged (daemon-owned mirrors; vLLM: \"kvd_data_path\": \"auto\" in "
                            "kv_connector_extra_config)")
                raise InvalidArgument(why) from None
            w = Worker(
                key=(engine_id, tp_rank),
                tp_size=tp_size,
                model=model,
                layout=layout,
                regions=regions,
                compat_hash=lay.compat_hash(model, layout, tp_size, len(regions), compat_extra),
                mem=WorkerMemory(
                    agent=agent,
                    mappings=mappings,
                    registrations=regs,
                    bases=[mappings[r.segment].addr + r.offset for r in regions],
                    local_dlist=dlist,
                    registered_bytes=sum(s.size for s in segments),
                    memory="VRAM" if cuda else "DRAM",
                    device=cuda.device if cuda else 0,
                    staged=staged,
                    staging=staging,
                    segment_names=[] if staged or cuda else [s.name for s in segments if s.kind != MEMFD_KIND],
                    owner_pid=owner_pid,
                    data_path_reason=cuda.choice.reason if cuda else "",
                ),
                owner=owner,
                leases=LeaseTable(early_s=self.rt.limits.early_notif_s, budget=self.rt.early_budget,
                                  on_change=self.rt.feeds.recorder(engine_id, tp_rank)),
            )
            w.session.detached_since = time.monotonic()
            self.rt.workers[w.key] = w
            log.info(
                "registered %s (TP %d): agent %s, %d regions x %d blocks of %d tokens (%s), %d bytes in %d segments, "
                "hash %s", w.label, tp_size, name, len(regions), layout.num_blocks, layout.block_size,
                layout.kv_layout, w.mem.registered_bytes, len(segments), w.compat_hash,
            )
            if cuda:
                log.info("%s: VRAM on device %d, %s data path (%s)", w.label, w.mem.device,
                         "staged" if staged else "direct", cuda.choice.reason)
                if cuda.choice.warning:
                    log.warning("%s: %s", w.label, cuda.choice.warning)
            self.rt.on_event("register", {"engine": engine_id})
            return w

    @contextlib.contextmanager
    def _reserved(self, key: WorkerKey, owner: Owner | None, descriptors: int, host_bytes: int,
                  mirror_bytes: int = 0):
        """``with``: a registration under way of ``key``, counted by
        :meth:`_check_caps` and :meth:`_check_engine_id` until it ends
        (registered or failed)."""
        self._registering[key] = (owner.uid if owner is not None else None, descriptors, host_bytes, mirror_bytes)
        try:
            yield
        finally:
            del self._registering[key]

    async def _made_on_nixl_thread(self, key: WorkerKey, release, fn, *args):
        """``await rt.nixl(fn, *args)`` for a call of registration ``key``
        that makes something (VRAM mirrors, an agent and its registrations).
        When the registration is cancelled meanwhile (its caller's deadline
        passed), the call still ends on the NIXL thread, and then the
        coroutine ``release(result)`` (None when the call raised: it
        cleaned up after itself) frees what it made, with the
        registration's reservation counted against the caps until it has.
        Measured before: cancelled staged registrations left 2 GiB of
        mirrors mapped and counted nowhere, and their shm objects in
        /dev/shm after the daemon exited (attacker review). Re-raises the
        cancellation."""
        fut = self.rt.nixl(fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            async def free() -> None:
                try:
                    try:
                        made = await fut
                    except Exception:
                        made = None
                    await release(made)
                except Exception:
                    log.exception("registration of %s/%d cancelled: freeing what it made failed", *key)

            task = asyncio.get_running_loop().create_task(free())
            self._releasing[task] = self._registering[key]
            task.add_done_callback(self._releasing.pop)
            raise

    async def released(self) -> None:
        """Returns once what cancelled registrations made is freed (the
        daemon's shutdown waits for it before it stops the NIXL thread,
        which the frees use)."""
        while self._releasing:
            await asyncio.gather(*list(self._releasing), return_exceptions=True)

    def _free_made_agent(self, agent: NixlAgent, regs: list, dlist) -> None:
        """NIXL thread: frees an agent :meth:`_make_agent` made for a
        registration that was cancelled before the worker existed."""
        try:
            agent.release_dlist(dlist)
        except Exception:
            pass
        for r in regs:
            try:
                agent.deregister(r)
            except Exception as e:
                log.warning("agent %s: deregister: %s", agent.name, e)
        agent.close(defer=True)

    def _check_engine_id(self, engine_id: str, tp_rank: int, owner: Owner | None) -> None:
        """An engine id belongs to the uid that registered it first, while any
        of its ranks is registered (docs/SECURITY.md): otherwise one user could
        squat another's id, keep its engine out and answer reads meant for it.

        Raises:
            AlreadyExists: ``(engine_id, tp_rank)`` is registered (the message
                names the owner's uid).
            PermissionDenied: another rank of ``engine_id`` is registered by
                another uid.
        """
        w = self.rt.workers.get((engine_id, tp_rank))
        if w is not None:
            raise AlreadyExists(f"engine {engine_id!r} rank {tp_rank} is already registered"
                                + (f" (by uid {w.owner.uid})" if w.owner is not None else ""))
        if (engine_id, tp_rank) in self._registering:
            raise AlreadyExists(f"engine {engine_id!r} rank {tp_rank} is being registered by another call")
        if owner is None:
            return
        for (eid, rank), (uid, *_) in self._registering.items():
            if eid == engine_id and uid is not None and uid != owner.uid:
                raise PermissionDenied(f"engine id {engine_id!r} is being registered by uid {uid} (rank {rank}); "
                                       f"uid {owner.uid} may not register rank {tp_rank}")
        for (eid, rank), other in self.rt.workers.items():
            if eid == engine_id and other.owner is not None and other.owner.uid != owner.uid:
                raise PermissionDenied(f"engine id {engine_id!r} belongs to uid {other.owner.uid} while its rank "
                                       f"{rank} is registered; uid {owner.uid} may not register rank {tp_rank}")

    def _check_caps(self, descriptors: int, owner: Owner | None, host_bytes: int = 0, mirror_bytes: int = 0) -> None:
        """Refuses a registration past ``Limits.max_workers`` /
        ``max_descriptors`` (all workers) or their ``_per_uid`` caps,
        ``max_host_bytes_per_uid`` with its ``host_bytes`` of host memory, or
        ``max_device_bytes_per_uid`` (when set) with its ``mirror_bytes`` of
        VRAM mirrors the daemon may allocate (the owner's uid; None: not
        checked per uid). Registrations under way count as registered.
        Raises ResourceExhausted."""
        # Quarantined workers still hold their memory, agent and threads
        # (an attacker review: a uid unregistering under stalled WRITEs kept
        # 1 GiB mapped against a 256 MiB cap): they count.
        lim, ws = self.rt.limits, [*self.rt.workers.values(), *self.rt.quarantine]
        mine = [w for w in ws if owner is not None and w.owner is not None and w.owner.uid == owner.uid]
        descs = lambda group: sum(len(w.regions) * w.layout.num_blocks for w in group)  # noqa: E731
        # Registrations under way count as registered (self._registering).
        going = [*self._registering.values(), *self._releasing.values()]
        my_going = [r for r in going if owner is not None and r[0] == owner.uid]
        host = (sum(w.mem.registered_bytes for w in mine if w.mem.memory == "DRAM") + sum(r[2] for r in my_going)
                + host_bytes)
        device = (sum(w.mem.registered_bytes for w in mine if w.mem.memory == "VRAM" and w.mem.staged)
                  + sum(r[3] for r in my_going) + mirror_bytes)
        for what, used, cap, key in (
                ("workers", len(ws) + len(going) + 1, lim.max_workers, "max_workers"),
                ("block descriptors", descs(ws) + sum(r[1] for r in going) + descriptors, lim.max_descriptors,
                 "max_descriptors"),
                *((("workers of uid", len(mine) + len(my_going) + 1, lim.max_workers_per_uid, "max_workers_per_uid"),
                   ("block descriptors of uid", descs(mine) + sum(r[1] for r in my_going) + descriptors,
                    lim.max_descriptors_per_uid, "max_descriptors_per_uid"),
                   ("bytes of host memory registered by uid", host, lim.max_host_bytes_per_uid or physical_memory(),
                    "max_host_bytes_per_uid"),
                   *((("bytes of GPU staging mirrors of uid", device, lim.max_device_bytes_per_uid,
                       "max_device_bytes_per_uid"),) if lim.max_device_bytes_per_uid and mirror_bytes else ()),
                   ) if owner is not None else ())):
            if used > cap:
                who = f" {owner.uid}" if "uid" in what else ""
                held = [w for w in self.rt.quarantine if "uid" not in what or any(w is m for m in mine)]
                why = (f" ({len(held)} of them unregistered workers whose memory stays mapped until a transfer "
                       "through them ends: quarantined_workers in kvd status)" if held else "")
                raise ResourceExhausted(f"register: {what}{who} would be {used}, more than {key} {cap}{why}")

    def _make_agent(self, name, mappings, layout, regions, memory="DRAM", device=0):
        agent = NixlAgent(name, self.backends)
        regs = []
        try:
            for m in mappings:
                regs.append(agent.register_memory(m.addr, m.size, memory, device))
            if memory == DRAM:
                agent.register_scratch()  # warm-up READs of new pairs (kvd.core.peers)
            bases = [mappings[r.segment].addr + r.offset for r in regions]
            dlist = agent.prep_local(on_device(lay.block_descriptors(bases, regions, layout.num_blocks), device),
                                     memory)
        except Exception:
            for r in regs:
                agent.deregister(r)
            raise
        agent.warm_up()  # UCX's per-agent set-up now, not on the first load to a new peer
        return agent, regs, dlist

    async def unregister(self, key: WorkerKey, reason: str = "unregistered", engine_gone: bool = False) -> int:
        """Drops a worker: fails its loads, ends its leases, frees NIXL state.

        ``engine_gone``: the worker's session has been gone past the grace
        period; if its owner process is dead too, its segment names are
        unlinked (see ``RegisterEngineRequest.owner_pid``).
        Returns the number of leases released. Raises NotFound.
        """
        w = self.rt.workers.pop(key, None)
        if w is None:
            raise NotFound(f"engine {key[0]!r} rank {key[1]} is not registered with this daemon")
        self.rt.counters.transfers_failed += len(w.inflight)
        released = len(w.leases)
        # Ended now, before any await: a follower of its holds
        # (kvd.core.hold_feed) learns it while the agent is being freed.
        w.leases.clear()
        if not any(k[0] == key[0] for k in self.rt.workers):
            self.rt.feeds.drop(key[0])  # its followers start over if the engine registers again
        freed = await self.rt.nixl(self._free_worker, w)
        if not freed:
            self.rt.quarantine.append(w)
            earlier = f" (or one replaced earlier: {', '.join(w.mem.lingering)})" if w.mem.lingering else ""
            log.warning("%s: a transfer was in progress (a READ into its memory, or a push WRITE out of it) and its "
                        "NIXL agent%s could not be destroyed yet; the worker's memory stays mapped until it is "
                        "(quarantined_workers in stats)", w.label, earlier)
        owner_gone = engine_gone and w.mem.owner_pid > 0 and not os.path.exists(f"/proc/{w.mem.owner_pid}")
        # Off the event loop: the last unmap or unlink of memory an engine
        # filled frees its pages inside the call (4 GiB: 0.67 s, attacker review).
        gone = await asyncio.to_thread(self._release, w, freed, owner_gone)
        if owner_gone:
            log.info("%s: engine process %d is gone; unlinked %d of its %d segment(s)", w.label,
                     w.mem.owner_pid, gone, len(w.mem.segment_names))
        log.info("unregistered %s (%s): %d leases, %d loads dropped", w.label, reason, released, len(w.inflight))
        w.inflight.clear()
        return released

    @staticmethod
    def _unmap(w: Worker) -> None:
        for m in w.mem.mappings:
            m.close()

    @classmethod
    def _release(cls, w: Worker, unmap: bool, owner_gone: bool) -> int:
        """A thread's part of :meth:`unregister`: unmaps ``w``'s memory
        (``unmap``: its agent is destroyed), unlinks its staging mirrors'
        names and, ``owner_gone``, its segments' names, only the very objects
        mapped (:func:`kvd.core.memory.unlink_shm`: a name made again since by
        someone else is left alone). Returns the segment names unlinked."""
        if unmap:
            cls._unmap(w)
        for n in w.mem.staging:
            unlink_shm(n)  # the names only: a quarantined worker keeps its mappings
        if not owner_gone:
            return 0
        names = set(w.mem.segment_names)  # empty for staged and CUDA workers (their mappings are ours)
        return sum(unlink_shm(m.name, m.identity) for m in w.mem.mappings if names and m.name in names)

    async def free_quarantined(self) -> None:
        """Event loop: unmaps each quarantined worker (``Runtime.quarantine``)
        once its old agent can be destroyed; the progress loop calls it each
        round it has one (none: no call at all)."""
        for w in list(self.rt.quarantine):
            if await self.rt.nixl(self._free_worker, w, False):
                self.rt.quarantine.remove(w)
                await asyncio.to_thread(self._unmap, w)
                log.info("%s: its NIXL agent is destroyed at last; memory unmapped", w.label)

    async def replace_agent(self, w: Worker, why: str) -> bool:
        """Stops every transfer of ``w`` now: makes it a new NIXL agent over
        the same memory (a new name: peers handshake it on their next load,
        as after a restart), then destroys the old one
        (:meth:`NixlAgent.close`: UCX closes its endpoints with force and
        purges their requests). Each load of ``w`` in flight has its READs
        ended as failed (``why``; the progress loop ends it, or tries it
        again within its deadline); every pair with a remote agent is freed.

        Only for a READ that has not ended when it must (its deadline, its
        session's end): NIXL 1.5 cannot cancel one that needs a peer that
        does not answer. Costs one agent's set-up on the NIXL thread
        (registration, prepared list, warm-up; docs/RELIABILITY.md).

        Returns False when no new agent could be made, or the old one could
        not be destroyed (a handle of it still bound): then nothing is known
        to have stopped, and an error is logged.
        """
        if not self.rt.registered(w):
            return False
        name = f"kvd-{w.key[0]}-r{w.key[1]}-{uuid.uuid4().hex[:8]}"
        t0 = time.monotonic()
        old = w.agent
        try:
            closed = await self.rt.nixl(self._replace, w, name, why)
        except NixlError as e:
            log.error("%s: cannot make a new NIXL agent to stop a READ (%s): %s", w.label, why, e)
            return False
        for warm in w.pairs.warm:
            warm.dropped.set()  # its pairs went with the old agent: Peers._keep_warm pairs the new one
        # A remote taken out of the pairs by a handshake under way is freed
        # by its next NIXL call (kvd.core.peers): its lists bind the old agent
        # until then.
        while not closed and time.monotonic() - t0 < CLOSE_WAIT_S:
            await asyncio.sleep(0.005)
            closed = await self.rt.nixl(old.close)
        if closed:
            log.warning("%s: NIXL agent %s replaced by %s in %.0f ms to stop its transfers (%s)", w.label,
                        old.name, name, (time.monotonic() - t0) * 1e3, why)
        else:
            w.mem.lingering[old.name] = old  # kept: its unregistration waits until it is destroyed
            log.error("%s: NIXL agent %s replaced by %s but not destroyed after %.0f s (a handle still bound): its "
                      "READs may still land (%s)", w.label, old.name, name, CLOSE_WAIT_S, why)
        return closed

    def _replace(self, w: Worker, name: str, why: str) -> bool:
        """NIXL thread: :meth:`replace_agent`; True once the old agent is destroyed."""
        if not self.rt.registered(w):
            return False
        mem, old = w.mem, w.agent
        agent, regs, dlist = self._make_agent(name, mem.mappings, w.layout, w.regions, mem.memory, mem.device)
        # A copy (one C call, atomic under the GIL): the loop may add a load
        # to w.inflight meanwhile, and iterating the dict itself from this
        # thread would then raise "dictionary changed size during iteration".
        for load in list(w.inflight.values()):
            if load.parts and not load.failed:
                load.failed, load.kind = f"transfer: {why}", FailureKind.TRANSFER
        self._end_transfers(w)
        self._free_nixl(w)
        mem.agent, mem.registrations, mem.local_dlist = agent, regs, dlist
        return old.close()

    def _end_transfers(self, w: Worker) -> int:
        """NIXL thread: releases every transfer handle of ``w``'s agent (its
        loads' and those in ``Runtime.zombies``), by force where one is still
        in progress; returns how many were."""
        agent, running = w.agent, 0
        loads = list(w.inflight.values())  # a copy, as in _replace: the loop may add loads meanwhile
        handles = [h for load in loads for h, _ in load.parts]
        for load in loads:
            load.parts = []
        for item in [z for z in self.rt.zombies if z[0] is agent]:
            self.rt.zombies.remove(item)
            handles.append(item[1])
        self.rt.release_warm_ups(time.monotonic(), agent)  # by force: they can land only in its scratch page
        for h in dict.fromkeys(handles):  # once each: a coalesced READ is a part of each load it carries
            if agent.state(h) == "PROC":
                running += 1
            agent.release(h, settled=True)
        return running

    def _free_nixl(self, w: Worker) -> None:
        """NIXL thread: frees ``w``'s pairs, prepared list and registrations (not its agent)."""
        for r in w.pairs.all():
            self.peers.free_remote(w, r)
        w.pairs.remotes.clear()
        w.pairs.retired.clear()
        w.pairs.readers.clear()
        w.pairs.agents.clear()  # the peers' agents go with this agent (a next one loads them afresh)
        if w.mem.local_dlist is not None:
            try:
                w.agent.release_dlist(w.mem.local_dlist)
            except Exception:
                pass
        for reg in w.mem.registrations:
            try:
                w.agent.deregister(reg)
            except Exception as e:
                log.warning("%s: deregister: %s", w.label, e)
        # Once: a quarantined worker is freed again later (free_quarantined),
        # and NIXL must not be handed a released list or registration twice.
        w.mem.local_dlist, w.mem.registrations = None, []

    def _writing(self, w: Worker) -> bool:
        """NIXL thread: True while a push WRITE out of ``w``'s memory is in
        ``Runtime.writes`` (not yet ended and released by the progress loop)."""
        return any(e[0] is w for e in list(self.rt.writes.values()))  # a copy: the loop adds WRITEs meanwhile

    def _await_writes(self, w: Worker) -> None:
        """NIXL thread, ``w`` unregistered while a push WRITE out of its
        memory runs: its loads' READ handles go to ``Runtime.zombies`` (the
        unregistration drops its loads; a handle lost there would keep the
        agent alive for good, and never be released on this thread), and
        its WRITEs get at most ``transfer_timeout_s`` more (the reader named
        their deadline, up to ``max_transfer_timeout_s``: an hour of memory
        kept mapped after the engine left). A READ into the memory may land
        until the agent is destroyed, once the WRITEs have ended."""
        loads = list(w.inflight.values())  # a copy: the loop may add loads meanwhile
        # Once each: a coalesced READ is a part of each load it carries, and
        # a handle released twice is NIXL's use-after-free.
        handles = dict.fromkeys(h for load in loads for h, _ in load.parts)
        for load in loads:
            load.parts = []
        self.rt.zombies.extend((w.agent, h) for h in handles)
        bound = time.monotonic() + self.rt.limits.transfer_timeout_s
        for key, (x, h, fut, deadline) in list(self.rt.writes.items()):
            if x is w and deadline > bound:
                self.rt.writes[key] = (x, h, fut, bound)

    def _free_worker(self, w: Worker, defer: bool = True) -> bool:
        """NIXL thread: releases every handle, list, remote and registration
        of ``w`` and destroys its agent. False when its agent could not be
        destroyed (a handle still bound to it), or a push WRITE out of its
        memory has not ended: its memory must then stay mapped (quarantine),
        since UCX would go on moving bytes through it, landing in whatever
        is mapped there next or killing the daemon with SIGSEGV (measured
        with ``UCX_TLS=tcp`` and a SIGSTOPped peer: a READ's late bytes;
        a source's WRITE went on sending another engine's KV, mapped at the
        same address after the unregistration, to the reader, and freeing
        the reader under it made NIXL say the WRITE failed while its bytes
        still went). Nothing is freed while such a WRITE runs; the progress
        loop calls this again (:meth:`free_quarantined`, ``defer`` False)
        once the WRITE has ended. The same holds for an agent an earlier
        :meth:`replace_agent` could not destroy (``WorkerMemory.lingering``):
        its transfers may still land, so the memory stays mapped until it is
        destroyed (each call tries again). ``defer``: :meth:`NixlAgent.close`'s."""
        if self._writing(w):
            self._await_writes(w)
            return False
        running = self._end_transfers(w)
        self._free_nixl(w)
        closed = w.agent.close(defer=defer and not running)
        for name, old in list(w.mem.lingering.items()):
            if old.close():
                del w.mem.lingering[name]
                log.info("%s: NIXL agent %s, replaced earlier, is destroyed at last", w.label, name)
        return closed and not w.mem.lingering

    def attach(self, engine_id: str, tp_rank: int) -> Worker:
        """A session stream opened for the worker; returns it. Raises NotFound."""
        w = self.rt.worker(engine_id, tp_rank)
        w.session.streams += 1
        w.session.sink = None  # a second stream: events go through the queue (either may read them)
        w.session.on_overflow = None
        w.session.detached_since = None
        w.session.overflowed = ""
        return w

    def detach(self, w: Worker) -> bool:
        """The worker's session stream ended (the engine may reconnect).
        True when it was the last one: its loads must end (``Pull.cancel``)."""
        s = w.session
        s.streams = max(0, s.streams - 1)
        if s.streams:
            return False
        s.detached_since = time.monotonic()
        s.epoch += 1
        return True


def physical_memory() -> int:
    """This host's physical memory (bytes): ``max_host_bytes_per_uid``'s
    default (an engine's KV cache in host memory is real memory, at most
    this)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def warm_copy_kernel(device: int) -> None:
    """NIXL thread: loads kvd's row-copy kernel on ``device`` for the
    same-node copy (``kvd.cuda_copy``) at a VRAM registration, so the first
    same-node load does not hold the thread while NVRTC compiles. Never
    raises: a kernel that cannot load leaves the batch copies (logged)."""
    try:
        cuda_copy.engine().ready(device)
    except Exception as e:  # noqa: BLE001 (a warm-up: the copy itself reports failures)
        log.info("row-copy kernel not loaded on device %d: %s", device, e)
