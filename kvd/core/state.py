"""The daemon core's state: engine workers (in named parts), remote workers,
loads in flight and counters (plain data, no behaviour beyond small
accessors).

The core's rooms (``kvd.core.registry``, ``peers``, ``holds``, ``pull``,
``push``, ``progress``) change these; the gRPC services read them.
Units: seconds, bytes, counts.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvd.core import plan
from kvd.core.events import Event, EventQueue, FailureKind
from kvd.core.hold_feed import HoldsAnswer
from kvd.core.layout import Layout, Region
from kvd.core.leases import LeaseTable
from kvd.core.memory import ShmMapping
from kvd.core.nixl_agent import NixlAgent, Unprepped
from kvd.requests import BlockGroups, LeaseRenewal, LoadRequest, RenewResult

log = logging.getLogger("kvd.core")

WorkerKey = tuple[str, int]  # (engine_id, tp_rank)
PeerKey = tuple[str, str, int]  # (address, engine_id, tp_rank)

# The daemon-to-daemon protocol; a peer with another number is refused at
# handshake. Bump on any incompatible PeerService or notification change.
# PeerService.Claim came later without a bump (a reader asks, an older source
# answers UNIMPLEMENTED and the load fails with that message; docs/SECURITY.md).
# 2: a READ's notification is length-prefixed pieces, one per load it
# carries (kvd.core.leases, kvd.core.coalesce); version 1's bare
# "<request id>:<expected>" is malformed to it, and its pieces were to 1:
# the two handshaked and READ, and no lease ended until its deadline.
PROTOCOL_VERSION = 2


@dataclass(frozen=True)
class Segment:
    """An engine memory segment as the shim describes it: a POSIX shm object
    (``kind`` ``"shm"``, by ``name``), a CUDA allocation (``kind``
    ``"cuda_ipc"``: its IPC ``handle`` on the GPU ``device_uuid`` names, or on
    ``device`` when that is empty) or a sealed memfd the
    engine handed over (``kind`` ``"memfd"``: ``fd``, owned by the caller of
    ``Registry.register``, which closes it afterwards)."""

    name: str
    size: int
    kind: str = "shm"
    handle: bytes = b""
    device: int = 0
    fd: int = -1
    device_uuid: bytes = b""  # cuda_ipc: the GPU's UUID; when set it, not ``device``, names the GPU


@dataclass
class HandshakeResult:
    """What a remote daemon says about one of its workers (PeerService.Handshake)."""

    agent_metadata: bytes
    agent_name: str
    layout: Layout
    regions: list[Region]
    region_bases: list[int]
    compat_hash: str
    daemon_version: str
    protocol_version: int = PROTOCOL_VERSION
    tp_size: int = 1
    memory: str = "DRAM"  # NIXL memory type of its regions in the peer's agent
    device: int = 0       # VRAM: the device id they are registered with there
    warm_up_addr: int = 0  # its agent's scratch page (NixlAgent.register_scratch); 0: none
    # How a READ from that daemon travels (transfer_mode.READ_TRANSPORTS; "": unknown).
    read_transport: str = ""


@dataclass
class PushOrder:
    """What a reader asks a source rank to WRITE (push mode)."""

    engine_id: str               # source (prefill) engine
    tp_rank: int                 # source rank
    request_id: str              # source request id (its lease)
    source_groups: BlockGroups   # source block ids per KV-cache group, held for request_id
    reader: HandshakeResult      # the reader worker, described as at handshake
    reader_tp_rank: int
    reader_groups: BlockGroups   # reader block ids per KV-cache group (as a LoadRequest's local_groups)
    expected_notifications: int
    timeout_s: float
    # Set by the link just before the PushRequest goes out (after the
    # callee proved itself): from then on a WRITE into the reader may come.
    sent: bool = False
    # Its last Push call answered (done, or refused before any WRITE): no
    # WRITE of it can come any more. False while one is out, and after an
    # answer that leaves it unknown (UNAVAILABLE, a cut, a cancellation).
    settled: bool = False


@dataclass
class PushResult:
    """A finished WRITE (units: bytes, seconds)."""

    bytes: int
    num_descriptors: int
    duration_s: float


#: The uid whose engine's work a ``PeerLink`` call is for (-1: the daemon's
#: own), set by the core in the task that makes the call: the daemon's peer
#: client budgets first contacts with new addresses per caller uid
#: (``kvd.daemon.unreachable.FirstContacts``), so that one uid's engines
#: naming dead addresses at will spend their own turns only.
PEER_CALLER: contextvars.ContextVar[int] = contextvars.ContextVar("kvd_peer_caller", default=-1)


def owner_uid(w: Any) -> int:
    """The uid that registered worker ``w`` (-1: registered without the gate,
    or a worker-shaped stand-in with no owner)."""
    owner = getattr(w, "owner", None)
    return owner.uid if owner is not None else -1


class PeerLink(Protocol):
    """How the core reaches remote daemons (the daemon's gRPC PeerClient).

    Every method raises ``Incompatible``, ``NotFound``, ``InvalidArgument`` or
    ``PeerUnavailable`` with the peer's message; ``claim`` also
    ``PermissionDenied`` (the source holds no lease on those blocks).
    """

    async def handshake(self, address: str, engine_id: str, tp_rank: int, compat_hash: str,
                        timeout_s: float) -> HandshakeResult: ...

    async def push(self, address: str, order: PushOrder, timeout_s: float) -> PushResult: ...

    async def notify(self, address: str, engine_id: str, tp_rank: int, request_id: str, expected: int,
                     timeout_s: float) -> None: ...

    async def claim(self, address: str, engine_id: str, tp_rank: int, request_id: str, groups: BlockGroups,
                    wait_s: float, timeout_s: float) -> None: ...

    async def renew(self, address: str, engine_id: str, renewals: list[LeaseRenewal],
                    timeout_s: float) -> list[RenewResult]: ...

    async def holds(self, address: str, engine_id: str, epoch: str, after: int, wait_s: float,
                    timeout_s: float) -> HoldsAnswer: ...

    async def holds_agent(self, address: str, engine_id: str, tp_rank: int,
                          timeout_s: float) -> tuple[str, str]: ...


@dataclass
class RemoteWorker:
    """A remote (source) worker as one local worker's agent sees it.

    Holds the pair's transfer plan: ``k`` source blocks per local block, ``C``
    chunks per source block and region, and the two descriptor lists
    ``lists = (local, remote)`` (the local one is the worker's own list when
    the plan is the identity): both ``nixl_agent.Unprepped`` after the
    handshake (each transfer makes its own rows), then, for a pair small
    enough (``Bounds.max_prepped_rows``), both prepped handles once the
    background preparation has run (``kvd.core.peers``), released when the
    remote is dropped. One attribute: a post reads both lists at once while
    the NIXL thread may swap them. ``freed`` (NIXL thread) is set when the
    remote's NIXL state is gone: nothing may be prepared for it after.
    """

    address: str
    engine_id: str
    tp_rank: int
    tp_size: int
    agent_name: str
    layout: Layout
    num_regions: int
    k: int
    C: int
    lists: tuple[object, object]
    owns_local_dlist: bool
    daemon_version: str
    region_bytes: tuple[int, ...] = ()  # bytes one source block contributes, per region
    region_groups: tuple[int, ...] = ()  # KV-cache group of each region
    last_used: float = 0.0  # monotonic seconds a load (or push) last took it (idle eviction, kvd.core.liveness)
    # Push reader only: pushes using it, from taking it until their WRITE
    # has ended (kvd.core.push): it is not released while one does.
    pushes: int = 0
    freed: bool = False
    prepare_later: bool = False  # small enough: lists prepared after the handshake
    read_transport: str = ""  # its handshake's (HandshakeResult.read_transport)

    @property
    def local_dlist(self) -> object:
        """The local side's list (see ``lists``)."""
        return self.lists[0]

    @property
    def remote_dlist(self) -> object:
        """The remote side's list (see ``lists``)."""
        return self.lists[1]

    def transfer_bytes(self, source_groups: BlockGroups) -> int:
        """Bytes a transfer of ``source_groups`` moves from this source."""
        return sum(b * len(source_groups[g]) for b, g in zip(self.region_bytes, self.region_groups))

    @property
    def key(self) -> PeerKey:
        return (self.address, self.engine_id, self.tp_rank)

    @property
    def prepped_lists(self) -> int:
        """NIXL prepped lists this remote owns (0, 1 or 2)."""
        return (not isinstance(self.remote_dlist, Unprepped)) + self.owns_local_dlist


@dataclass
class InflightLoad:
    """A load's posted READs (one per source rank); released as each ends."""

    req: LoadRequest
    parts: list[tuple[object, RemoteWorker]]  # (xfer handle, source) still PROC
    started: float
    deadline: float
    nbytes: int
    ndescs: int
    retry: bool = False  # a failed READ may be tried again after a new handshake
    post_s: float = 0.0  # seconds inside NIXL's post calls, summed over the parts
    failed: str = ""
    kind: FailureKind | None = None  # set with ``failed``


@dataclass(frozen=True)
class Owner:
    """Who registered a worker, as the engine socket's gate saw the caller
    (kernel credentials: ``SO_PEERCRED``), and the session token it got.

    ``pid`` 0: the daemon cannot see the caller's PID namespace (another
    container); ``gids``: its primary and supplementary groups."""

    uid: int
    gid: int
    gids: frozenset[int]
    pid: int
    token: str

    def __str__(self) -> str:  # as kvd.daemon.local_gate.Caller prints itself
        return f"pid {self.pid or '?'} uid {self.uid} gid {self.gid}"


@dataclass
class WorkerMemory:
    """A worker's memory as its NIXL agent has it registered.

    ``local_dlist``: the prepped list of every block of every region (the
    identity plan's side); ``bases``: each region's first byte (address).
    ``memory``: ``"DRAM"`` (POSIX shm) or ``"VRAM"`` (CUDA IPC) on ``device``.
    ``staged``: the staged data path (shm mirrors in ``staging``, or VRAM
    mirrors in ``mappings``); ``segment_names``: the engine's own shm names
    (direct path), made by process ``owner_pid`` (0: unknown).
    """

    agent: NixlAgent
    mappings: list[ShmMapping]
    registrations: list
    bases: list[int]
    local_dlist: object
    registered_bytes: int
    memory: str = "DRAM"
    device: int = 0
    staged: bool = False
    staging: list[str] = field(default_factory=list)  # shm names we made (unlinked at the end)
    segment_names: list[str] = field(default_factory=list)
    owner_pid: int = 0
    data_path_reason: str = ""  # why this path (kvd.core.path_select), for logs
    # Agents of this worker replaced but not destroyed (a handle still
    # bound: Registry.replace_agent), by name: a transfer through one may
    # land, so the memory stays mapped until each is (Registry._free_worker).
    lingering: dict[str, NixlAgent] = field(default_factory=dict)


@dataclass
class WarmPeer:
    """One ``warm_peers`` entry as one local worker sees it (``kvd status``).

    ``state``: ``"trying"`` (its daemon not answered yet, or not since a
    pair with it was dropped), ``"answered"`` (its TP size known, its ranks
    handshaken or under way: ``kvd.core.peers.Peers.warm``), ``"given up"``
    (incompatible or invalid, not tried again). ``since``: monotonic
    seconds it entered the state; ``tries``: handshakes asked of its rank
    0; ``last_error``: the last try's error ("" after an answer).
    ``dropped``: set when a pair with it is retired
    (``kvd.core.peers.Peers.retire``), so pairing starts again at once.
    """

    address: str
    engine_id: str
    state: str = "trying"
    since: float = 0.0
    tries: int = 0
    last_error: str = ""
    dropped: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)


@dataclass
class WorkerPairs:
    """The remote agents one worker's agent knows (``kvd.core.peers``).

    ``remotes``: sources it READs from, by peer key; ``readers``: push-mode
    readers it WRITEs to, by agent name (at most ``BOUNDS.max_push_readers``,
    released when idle: ``kvd.core.push``); ``retired``: dropped ones whose NIXL
    state is freed once no load uses them; ``agents``: peer agents loaded
    into its agent, name -> (metadata, users, the peer key whose description
    loaded it first: ``kvd.core.peers``); ``warm``: its ``warm_peers``
    handshakes ahead of need and where each stands.
    """

    remotes: dict[PeerKey, RemoteWorker] = field(default_factory=dict)
    readers: dict[str, RemoteWorker] = field(default_factory=dict)
    retired: list[RemoteWorker] = field(default_factory=list)
    agents: dict[str, tuple[bytes, int, PeerKey]] = field(default_factory=dict)
    warm: list[WarmPeer] = field(default_factory=list)  # Limits.warm_peers, in their order

    def all(self) -> list[RemoteWorker]:
        """Every remote with prepped lists (sources, retired, readers)."""
        return [*self.remotes.values(), *self.retired, *self.readers.values()]

    def warm_peer(self, address: str, engine_id: str) -> WarmPeer | None:
        """The ``warm_peers`` entry naming remote engine ``engine_id`` at
        ``address``, or None when it is not one."""
        return next((p for p in self.warm if (p.address, p.engine_id) == (address, engine_id)), None)


@dataclass
class WorkerSession:
    """A worker's session streams and the events queued for them.

    ``epoch``: +1 each time the last stream ends; loads of an older epoch are
    dropped. ``detached_since``: monotonic time the last stream ended (None
    while one is open)."""

    events: EventQueue = field(default_factory=EventQueue)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    # The one open session's direct writer (the command socket's): an event
    # emitted while ``events`` is empty is written at once, without a round
    # of the session's task (docs/PERFORMANCE.md, "sixth round"); it returns
    # False, and the event is queued, while the engine's socket is full or
    # closing. None with no session, or with two at once (which reads the
    # queue is not known).
    sink: Callable[[Event], bool] | None = None
    # Called when the session is dropped for not reading (``overflow``): the
    # command socket ends its connection at once (its writer may be waiting
    # for the engine to read, and would never see the flag).
    on_overflow: Callable[[], None] | None = None
    # Set when the queued events passed ``Limits.max_queued_event_bytes``: the
    # session's stream is ended (its engine does not read); cleared at attach.
    overflowed: str = ""  # the limit passed, in words
    streams: int = 0
    detached_since: float | None = None
    epoch: int = 0
    settling: asyncio.Task | None = None  # cancelling the ended session's READs (kvd.core.settle)


@dataclass
class Worker:
    """One registered engine worker (engine id + TP rank) and all it owns,
    in named parts: its memory, its owner, its pairs with remote agents, its
    leases (prefill side), its loads (decode side) and its session."""

    key: WorkerKey
    tp_size: int
    model: str
    layout: Layout
    regions: list[Region]
    compat_hash: str
    mem: WorkerMemory
    owner: Owner | None = None  # None: registered without the gate (tests)
    leases: LeaseTable = field(default_factory=LeaseTable)
    pairs: WorkerPairs = field(default_factory=WorkerPairs)
    inflight: dict[str, InflightLoad] = field(default_factory=dict)  # READs posted
    pending_loads: dict[str, str] = field(default_factory=dict)  # loads before their posts: id -> peer address
    # Push loads not answered yet: id -> the orders asked of its source ranks
    # (PushOrder.sent: a WRITE may come; kvd.core.settle stops such WRITEs).
    pushes: dict[str, list[PushOrder]] = field(default_factory=dict)
    # Load tasks a session started and that have not ended (the engine service
    # refuses more past Limits.max_inflight_per_worker, before a task exists).
    loads_started: int = 0
    # Block ids of this worker's loads in flight: one entry a load read (by
    # identity), and their sum (kvd.core.load_ids: an upper bound, made
    # exact when a load would pass Limits.max_load_block_ids_per_worker).
    load_ids: dict[int, Any] = field(default_factory=dict)
    load_ids_total: int = 0
    # Loads between their claim and their last post: id -> the remotes they
    # READ through (none for a same-node copy). Kvd.core.peers frees no
    # retired remote a load here may still post through.
    posting: dict[str, tuple[RemoteWorker, ...]] = field(default_factory=dict)
    session: WorkerSession = field(default_factory=WorkerSession)
    # Set at each hold: wakes claims waiting for one; a claim that waits makes
    # a fresh one when it finds it set (kvd.core.holds).
    hold_added: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def label(self) -> str:
        return f"engine={self.key[0]} rank={self.key[1]}"

    @functools.cached_property
    def num_groups(self) -> int:
        """KV-cache groups the worker's regions use (groups are numbered
        0..G-1): the most a hold or a load may name block ids for. Cached:
        the regions are fixed at registration, and a load reads it (a
        1,000-region worker would pay a scan per load)."""
        return max((r.group for r in self.regions), default=0) + 1

    @property
    def agent(self) -> NixlAgent:
        """The worker's own NIXL agent."""
        return self.mem.agent

    def geometry(self) -> plan.Geometry:
        return plan.Geometry(self.key[1], self.tp_size, self.layout, tuple(self.regions),
                             self.layout.model_kv_heads(self.tp_size))


def overflow(w: Worker, limit: str) -> None:
    """``w``'s session queued more events than ``limit`` allows (its words,
    e.g. ``"max_queued_event_bytes 1048576"``) that it does not read: they
    are dropped, and so is its stream (the engine service ends it; the shim
    then reports its loads failed and reconnects)."""
    s = w.session
    log.warning("%s: %d events (%d bytes) queued, more than %s: the session's engine does not read them; events "
                "dropped%s", w.label, len(s.events), s.events.nbytes, limit, ", stream ended" if s.streams else "")
    s.events.clear()
    s.overflowed = limit if s.streams else ""
    if s.overflowed and s.on_overflow is not None:
        s.on_overflow()


@dataclass
class Counters:
    """Cumulative counters since start (units: bytes, counts)."""

    bytes_read: int = 0
    transfers_done: int = 0
    transfers_failed: int = 0
    leases_expired: int = 0
    leases_notified: int = 0
    leases_released: int = 0
    leases_renewed: int = 0    # renewals granted (PeerService.Renew), one per lease, rank and call
    claims_sent: int = 0       # claims asked of a source's daemon (PeerService.Claim), one per source rank
    claims_followed: int = 0   # source ranks whose hold the followed holds showed (no claim asked)
    claims_waited: int = 0     # source ranks whose load waited for the followed holds' next answers first
    coalesced_reads: int = 0      # coalesced READs posted (kvd.core.coalesce): one for one or more loads
    same_node_copies: int = 0  # loads the daemon copied itself (kvd.core.local_copy), DRAM and VRAM
    same_node_vram_copies: int = 0  # of those, device copies (kvd.cuda_copy)
    handshakes: int = 0
