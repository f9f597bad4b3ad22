"""The daemon's core: engine workers, their regions, leases and transfers.

``Node`` is what the gRPC services adapt; it knows neither gRPC nor vLLM. It
wires the core's rooms and delegates to them; each room is one module:

- ``registry``: register / unregister workers (segments, NIXL agent,
  memory registration), attach / detach sessions;
- ``peers``: handshakes with remote daemons, the pairs of agents and their
  descriptor lists, the answer to a remote handshake;
- ``holds``: the prefill side's leases (``kvd.core.leases``);
- ``pull``: the decode side's load path (NIXL READs);
- ``local_copy``: a load whose source is registered here too (a memmove);
- ``push``: push mode, both sides (NIXL WRITEs);
- ``progress``: the loop that polls NIXL and ends transfers and leases;
- ``runtime``: what they share (workers, counters, the NIXL thread, events).

Pull mode (the seed connector's protocol, docs/DESIGN.md "Transfer protocol"):

1. prefill worker: ``hold(request, groups)`` -> a lease;
2. decode worker: ``load(LoadRequest)`` -> handshake once per (local worker,
   remote worker) pair, then one NIXL READ per source rank, each with a
   notification naming the remote request;
3. prefill daemon: once every expected reader notified -> ``SendDone`` (or
   the lease expires -> ``SendDone(expired=True)``);
4. decode daemon: every READ done -> ``RecvDone``; any error or the deadline
   -> ``LoadFailed`` with the local block ids.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

from kvd import cuda_copy
from kvd.core import nixl_agent, settle
from kvd.core.events import CommandRejected
from kvd.core.hold_feed import HoldsAnswer
from kvd.core.hold_mirror import HoldMirror
from kvd.core.holds import Holds
from kvd.core.layout import Layout, Region
from kvd.core.limits import Limits
from kvd.core.liveness import Liveness
from kvd.core.local_copy import LocalCopy
from kvd.core.metadata_vet import MetadataVet
from kvd.core.own_addresses import OwnAddresses
from kvd.core.peers import Peers
from kvd.core.progress import Progress
from kvd.core.pull import Pull
from kvd.core.push import Push
from kvd.core.registry import Registry
from kvd.core.runtime import Runtime
from kvd.core.state import (
    PROTOCOL_VERSION,
    Counters,
    HandshakeResult,
    Owner,
    PeerLink,
    PushOrder,
    PushResult,
    Segment,
    Worker,
    WorkerKey,
)
from kvd.core.transfer_mode import TransferModes
from kvd.logtext import clip
from kvd.requests import BlockGroups, LeaseRenewal, LoadRequest, RenewResult


class Node:
    """The core of one kvd daemon.

    Args:
        limits: deadlines and bounds.
        peers: reaches remote daemons (the daemon's gRPC ``PeerClient``;
            tests may pass a fake).
        peer_address: ``host:port`` remote daemons use to reach this one.
        backends: NIXL backends for every agent (default ``["UCX"]``).
        on_event: hook ``(name, fields)`` for metrics: ``transfer``,
            ``failure`` (``kind``: a ``FailureKind``), ``handshake``,
            ``register``.

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
        self.rt = Runtime(limits or Limits(), on_event)
        self.own = OwnAddresses()
        self.mirror = HoldMirror(self.rt, peers)
        vet = MetadataVet(backends or ["UCX"]) if self.rt.limits.vet_peer_metadata else None
        # Whether a load is a pull or a push; what this daemon's handshakes
        # say of its READs. Read by the handshakes (Peers) and loads (Pull).
        self.modes = TransferModes(self.rt.limits.transfer_mode, said=self._mode_said,
                                   serves_pushes=self.rt.limits.serve_pushes)
        self.peers = Peers(self.rt, peers, self.mirror, vet, modes=self.modes)
        self.liveness = Liveness(self.rt, self.peers)
        self.registry = Registry(self.rt, self.peers, backends or ["UCX"])
        self.holds = Holds(self.rt, peers, peer_address, self.mirror)
        self.push_mode = Push(self.rt, self.peers, self.holds)
        self.local_copy = LocalCopy(self.rt, self.holds)
        self.pull = Pull(self.rt, self.peers, self.push_mode, self.local_copy, self.holds, self.registry,
                         self.modes)
        self.peer_address = peer_address
        # Set by the server once PeerService is bound, for GetStats: its
        # authentication (kvd.daemon.peer_auth.PeerAuth.mode; "" = not
        # reported) and the host:port it is bound to.
        self.peer_auth = ""
        self.peer_listen = ""
        self.progress = Progress(self.rt, self.registry, self.peers, self.holds, self.pull, self.push_mode)

    def _mode_said(self, host: str, local: bool) -> None:
        # One key: a request names the host, so fresh ones could come at will.
        self.rt.lines.info(("transfer mode",), "transfer mode auto: loads from %s are %s", clip(host, 100),
                           "READs (a host of this one's)" if local else
                           "pushes (another host's, reached over TCP)")

    # ------------------------------------------------------------ lifecycle
    @property
    def peer_address(self) -> str:
        """``host:port`` remote daemons reach this one at (what
        ``kv_transfer_params`` carry; set by the server once bound); a load
        naming it is a same-node load (``kvd.core.local_copy``), and a claim
        on it is answered by this daemon's own holds."""
        return self.holds.own_address

    @peer_address.setter
    def peer_address(self, value: str) -> None:
        self.holds.own_address = value
        self.local_copy.addresses = {value} if value else set()
        self.own.advertised = value

    def listening(self, host: str, port: int) -> None:
        """PeerService is bound to ``host`` and TCP ``port``: a load naming
        this daemon by another spelling of an address that reaches it is a
        same-node load too (``kvd.core.own_addresses``)."""
        self.own.listening(host, port)

    @property
    def limits(self) -> Limits:
        return self.rt.limits

    @property
    def workers(self) -> dict[WorkerKey, Worker]:
        """The registered workers (read-only for callers)."""
        return self.rt.workers

    @property
    def counters(self) -> Counters:
        return self.rt.counters

    @property
    def draining(self) -> bool:
        """True from SIGTERM on: new loads fail, sessions and registrations
        are refused, handshakes are not tried twice."""
        return self.rt.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.rt.draining = value

    def start(self) -> None:
        """Starts the progress loop (polls transfers, notifications, leases)
        and the remote workers' liveness check (``kvd.core.liveness``)."""
        self.progress.start()
        self.liveness.start()
        if self.peers.vet is not None:  # its child's imports (~1 s) off the first handshake's path
            threading.Thread(target=self.peers.vet.start, name="kvd-vet-start", daemon=True).start()

    async def close(self) -> None:
        """Fails in-flight loads, releases leases, unregisters every worker.

        Segments of an engine whose owner process is already dead are
        unlinked here too (``engine_gone``): otherwise a daemon stopped
        within ``detach_grace_s`` of an engine crash would leave them in
        /dev/shm. A live engine's segments are never touched."""
        self.rt.closing = True
        await self.liveness.close()
        if self.peers.vet is not None:
            await asyncio.to_thread(self.peers.vet.close)
        await self.mirror.close()
        await self.peers.close()
        await self.progress.stop()
        for key in list(self.rt.workers):
            await self.registry.unregister(key, reason="daemon shutting down", engine_gone=True)
        await self.registry.released()  # cancelled registrations' agents and mirrors, on the NIXL thread
        await self.rt.nixl(nixl_agent.destroy_deferred, float("inf"))  # agents closed just after their warm-up
        self.rt.shutdown()

    # --------------------------------------------------------- registration
    def worker(self, engine_id: str, tp_rank: int) -> Worker:
        """The registered worker ``(engine_id, tp_rank)``. Raises NotFound."""
        return self.rt.worker(engine_id, tp_rank)

    async def register(self, engine_id: str, tp_rank: int, tp_size: int, layout: Layout, segments: list[Segment],
                       regions: list[Region], *, model: str = "", compat_extra: str = "",
                       staged: bool | None = False, owner_pid: int = 0, owner: Owner | None = None) -> Worker:
        """See :meth:`kvd.core.registry.Registry.register`; then handshakes
        with the configured ``Limits.warm_peers`` start in the background."""
        w = await self.registry.register(engine_id, tp_rank, tp_size, layout, segments, regions, model=model,
                                         compat_extra=compat_extra, staged=staged, owner_pid=owner_pid,
                                         owner=owner)
        self.peers.warm_configured(w)
        return w

    async def unregister(self, key: WorkerKey, reason: str = "unregistered", engine_gone: bool = False) -> int:
        """See :meth:`kvd.core.registry.Registry.unregister`."""
        return await self.registry.unregister(key, reason, engine_gone)

    async def attach(self, engine_id: str, tp_rank: int) -> Worker:
        """A session stream opened for the worker; returns it once no READ of
        its previous session can land any more (``kvd.core.settle``).
        Raises NotFound."""
        w = self.registry.attach(engine_id, tp_rank)
        try:
            await settle.settled(w)
        except BaseException:  # the opening stream went (cancelled): it is not counted as a session
            if self.registry.detach(w):
                asyncio.get_running_loop().create_task(self.pull.cancel(w))
            raise
        return w

    async def detach(self, w: Worker) -> None:
        """The worker's session stream ended; the last one cancels its loads
        and returns once none of their READs can land (``kvd.core.settle``)."""
        if self.registry.detach(w):
            await self.pull.cancel(w)

    # -------------------------------------------------------------- session
    def reject(self, w: Worker, request_id: str, reason: str) -> None:
        """Refuses a session command: a ``CommandRejected`` for ``w``'s engine
        (the adapter's own checks: ids too long, an unknown command)."""
        self.rt.emit(w, CommandRejected(request_id, reason))

    def hold(self, w: Worker, request_id: str, groups: BlockGroups, lease_s: float = 0.0) -> None:
        """See :meth:`kvd.core.holds.Holds.hold` (a claim waiting for this
        hold, local or from a peer, is answered by it)."""
        self.holds.hold(w, request_id, groups, lease_s)

    def release(self, w: Worker, request_id: str) -> None:
        """See :meth:`kvd.core.holds.Holds.release`."""
        self.holds.release(w, request_id)

    async def load(self, w: Worker, req: LoadRequest, epoch: int | None = None, *, uid: int | None = None) -> None:
        """See :meth:`kvd.core.pull.Pull.load` (never raises). A
        ``remote_address`` that reaches this daemon is replaced by its
        advertised one first (``kvd.core.own_addresses``). ``epoch``: the
        worker's session epoch when the command was read (None: now); a
        load whose session ended before it started is dropped. ``uid``:
        the caller uid of the session that sent it (None: the worker's
        owner's), whose abort slots an empty load's notification takes."""
        address = await self.own.canonical(req.remote_address)
        if address != req.remote_address:
            req = req._replace(remote_address=address)
        await self.pull.load(w, req, epoch=epoch, uid=uid)

    async def abort_load(self, w: Worker, request_id: str, remote_engine_id: str, remote_address: str,
                         remote_request_id: str, remote_tp_size: int) -> None:
        """See :meth:`kvd.core.pull.Pull.abort_load` (never raises)."""
        remote_address = await self.own.canonical(remote_address)
        await self.pull.abort_load(w, request_id, remote_engine_id, remote_address, remote_request_id,
                                   remote_tp_size)

    def loads_in_flight(self) -> list[tuple[str, str, str]]:
        """``(worker label, request id, peer address)`` of every load not
        finished: READs posted, and loads before their posts (handshaking,
        claiming, copying on this node)."""
        out = []
        for w in list(self.rt.workers.values()):
            out += [(w.label, rid, load.req.remote_address) for rid, load in list(w.inflight.items())]
            out += [(w.label, rid, peer) for rid, peer in list(w.pending_loads.items())]
        return out

    # ------------------------------------------------------------ peer side
    async def handshake_info(self, engine_id: str, tp_rank: int, caller_hash: str,
                             protocol_version: int = PROTOCOL_VERSION) -> HandshakeResult:
        """See :meth:`kvd.core.peers.Peers.handshake_info`."""
        return await self.peers.handshake_info(engine_id, tp_rank, caller_hash, protocol_version)

    async def push(self, order: PushOrder) -> PushResult:
        """See :meth:`kvd.core.push.Push.push`."""
        return await self.push_mode.push(order)

    def notify(self, engine_id: str, tp_rank: int, request_id: str, expected: int) -> None:
        """See :meth:`kvd.core.holds.Holds.notify`."""
        self.holds.notify(engine_id, tp_rank, request_id, expected)

    async def claim(self, engine_id: str, tp_rank: int, request_id: str, groups: BlockGroups,
                    wait_s: float = 0.0) -> None:
        """See :meth:`kvd.core.holds.Holds.claim`."""
        await self.holds.claim(engine_id, tp_rank, request_id, groups, wait_s)

    async def follow_holds(self, engine_id: str, epoch: str, after: int, wait_s: float) -> HoldsAnswer:
        """A reader daemon's poll of ``engine_id``'s holds (``kvd.core.hold_feed``).
        Raises NotFound, ResourceExhausted."""
        return await self.rt.feeds.poll(engine_id, self._registered(engine_id), epoch, after, wait_s)

    def _registered(self, engine_id: str) -> bool:
        """Whether ``engine_id`` has a worker here."""
        return any(k[0] == engine_id for k in self.rt.workers)

    def holds_epoch(self, engine_id: str) -> str:
        """The epoch of ``engine_id``'s hold feed here (a Handshake's
        ``holds_epoch``); "" for an engine with no worker here (no feed is
        made for it: only a registered engine's feed is dropped with it)."""
        return self.rt.feeds.epoch(engine_id) if self._registered(engine_id) else ""

    def renew(self, engine_id: str, renewals: list[LeaseRenewal]) -> list[RenewResult]:
        """See :meth:`kvd.core.holds.Holds.renew`."""
        return self.holds.renew(engine_id, renewals)

    async def renew_at(self, address: str, engine_id: str, renewals: list[LeaseRenewal],
                       timeout_s: float) -> list[RenewResult]:
        """See :meth:`kvd.core.holds.Holds.renew_at`; an ``address`` that
        reaches this daemon is replaced by its advertised one first
        (``kvd.core.own_addresses``)."""
        address = await self.own.canonical(address)
        return await self.holds.renew_at(address, engine_id, renewals, timeout_s)

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict:
        """Counts for GetStats, ``kvd status`` and metrics."""
        rt = self.rt
        ws = list(rt.workers.values())
        c = rt.counters
        return dict(
            engines=len(ws),
            regions=sum(len(w.regions) for w in ws),
            registered_bytes=sum(w.mem.registered_bytes for w in ws),
            peers=len({(k[0], k[1]) for w in ws for k in w.pairs.remotes}),
            active_leases=sum(len(w.leases) for w in ws),
            inflight_transfers=sum(len(w.inflight) for w in ws),
            sessions=sum(w.session.streams for w in ws),
            uptime_s=time.monotonic() - rt.started,
            leaked_handles=len(rt.zombies),
            # Push-mode readers are remote agents with prepped lists too.
            remote_agents=sum(len(w.pairs.all()) for w in ws),
            early_notifications=sum(len(w.leases.early) for w in ws),
            pending_events=sum(len(w.session.events) for w in ws if not w.session.streams),
            prepped_dlists=sum(1 + sum(r.prepped_lists for r in w.pairs.all()) for w in ws),
            dlists_preparing=sum(r.prepare_later for w in ws for r in w.pairs.all()),
            quarantined_workers=len(rt.quarantine),
            bytes_read=c.bytes_read,
            transfers_done=c.transfers_done,
            transfers_failed=c.transfers_failed,
            leases_expired=c.leases_expired,
            leases_renewed=c.leases_renewed,
            claims_sent=c.claims_sent,
            claims_followed=c.claims_followed,
            claims_waited=c.claims_waited,
            holds_followed=self.mirror.fresh(),
            holds_answers_applied=self.mirror.answers_applied,
            holds_answers_sent=self.rt.feeds.answers_sent,
            notifications_dropped=self.progress.notifs_dropped,
            coalesced_reads=c.coalesced_reads,
            same_node_copies=c.same_node_copies,
            same_node_vram_copies=c.same_node_vram_copies,
            copy_kernel_devices=cuda_copy.kernel_devices(),
            cuda_context_lost=int(bool(self.local_copy.vram_off)),
        )
