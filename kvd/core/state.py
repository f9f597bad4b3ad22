"""The daemon core's state: engine workers, remote workers, loads in flight,
limits and counters (plain data, no behaviour beyond small accessors).

``kvd.core.node.Node`` owns and changes these; the gRPC services read them.
Units: seconds, bytes, counts.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from kvd.core import plan
from kvd.core.layout import Layout, Region
from kvd.core.leases import LeaseTable
from kvd.core.memory import ShmMapping
from kvd.core.nixl_agent import NixlAgent

WorkerKey = tuple[str, int]  # (engine_id, tp_rank)
BlockGroups = list[list[int]]  # block ids per KV-cache group (one group without HMA)


def flat(groups: BlockGroups) -> list[int]:
    """Every block id of every group, in order (what vLLM's load errors name)."""
    return [b for g in groups for b in g]
PeerKey = tuple[str, str, int]  # (address, engine_id, tp_rank)

# After posting a transfer that is not done at once, the NIXL thread checks it
# again for this long before leaving it to the progress loop (seconds).
POST_SPIN_S = 0.0002

# Events kept for a worker whose session is not attached (reconnecting shim).
MAX_PENDING_EVENTS = 100_000

# The daemon-to-daemon protocol; a peer with another number is refused at
# handshake (issue 4, scenario 7). Bump on any incompatible PeerService or
# notification change.
PROTOCOL_VERSION = 1

# Agent metadata accepted from a peer (NIXL metadata is a few KiB per backend).
MAX_AGENT_METADATA = 1 << 20

# Largest TP size accepted from an engine or a peer. Transfer plans loop over
# ranks (issue 4, scenario 9: a LoadBlocks with remote_tp_size 2**32-1 made
# the daemon build a list of ranks until the OOM killer stopped it).
MAX_TP_SIZE = 256

# A handshake that failed as unreachable is tried once more only when the
# request's deadline leaves at least this long (seconds).
RETRY_HANDSHAKE_MIN_S = 2.0


@dataclass
class Limits:
    """Per-daemon bounds and deadlines (units: seconds, counts)."""

    lease_s: float = 120.0           # default lease of held prefill blocks (vLLM's abort timeout is 480 s)
    max_lease_s: float = 3600.0
    transfer_timeout_s: float = 30.0  # a load not done by then fails
    max_transfer_timeout_s: float = 3600.0  # cap on a request's own timeout_s (inf or 1e300 would never end)
    handshake_timeout_s: float = 10.0
    early_notif_s: float = 120.0     # a notification that beat its hold is kept this long
    max_blocks_per_request: int = 1 << 20
    max_inflight_per_worker: int = 4096
    max_leases_per_worker: int = 65536  # prefill leases held at once (each keeps its request id and blocks)
    poll_busy_s: float = 0.0005      # poll interval while transfers are in flight
    poll_idle_s: float = 0.005       # otherwise (notifications, leases)
    transfer_mode: str = "pull"      # "pull": decode READs; "push": prefill WRITEs on request
    detach_grace_s: float = 10.0     # an engine whose session is gone this long is unregistered


@dataclass(frozen=True)
class Segment:
    """An engine memory segment as the shim describes it: a POSIX shm object
    (``kind`` ``"shm"``, by ``name``) or a CUDA allocation (``kind``
    ``"cuda_ipc"``: its IPC ``handle`` on ``device``; issue 7)."""

    name: str
    size: int
    kind: str = "shm"
    handle: bytes = b""
    device: int = 0


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
    memory: str = "DRAM"  # NIXL memory type of its regions in the peer's agent (issue 7)
    device: int = 0       # VRAM: the device id they are registered with there


@dataclass
class PushOrder:
    """What a reader asks a source rank to WRITE (push mode, issue 3 capability 7)."""

    engine_id: str               # source (prefill) engine
    tp_rank: int                 # source rank
    request_id: str              # source request id (its lease)
    source_block_ids: "BlockGroups"
    reader: HandshakeResult      # the reader worker, described as at handshake
    reader_tp_rank: int
    reader_block_ids: "BlockGroups"
    expected_notifications: int
    timeout_s: float


@dataclass
class PushResult:
    """A finished WRITE (units: bytes, seconds)."""

    bytes: int
    num_descriptors: int
    duration_s: float


class PeerLink(Protocol):
    """How the core reaches remote daemons (the daemon's gRPC PeerClient).

    Every method raises ``Incompatible``, ``NotFound``, ``InvalidArgument`` or
    ``PeerUnavailable`` with the peer's message.
    """

    async def handshake(self, address: str, engine_id: str, tp_rank: int, compat_hash: str,
                        timeout_s: float) -> HandshakeResult: ...

    async def push(self, address: str, order: PushOrder, timeout_s: float) -> PushResult: ...

    async def notify(self, address: str, engine_id: str, tp_rank: int, request_id: str, expected: int,
                     timeout_s: float) -> None: ...


@dataclass
class RemoteWorker:
    """A remote (source) worker as one local worker's agent sees it.

    Holds the pair's transfer plan: ``k`` source blocks per local block, ``C``
    chunks per source block and region, and the two prepped descriptor lists
    (``local_dlist`` is the worker's own list when the plan is the identity).
    Both are released when the remote is dropped.
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
    local_dlist: object
    remote_dlist: object
    owns_local_dlist: bool
    daemon_version: str
    region_bytes: tuple[int, ...] = ()  # bytes one source block contributes, per region
    region_groups: tuple[int, ...] = ()  # KV-cache group of each region

    def transfer_bytes(self, source_groups: "BlockGroups") -> int:
        """Bytes a transfer of ``source_groups`` moves from this source."""
        return sum(b * len(source_groups[g]) for b, g in zip(self.region_bytes, self.region_groups))

    @property
    def key(self) -> PeerKey:
        return (self.address, self.engine_id, self.tp_rank)


@dataclass
class InflightLoad:
    """A load's posted READs (one per source rank); released as each ends."""

    request_id: str
    local_block_ids: list[int]
    parts: list[tuple[object, RemoteWorker]]  # (xfer handle, source) still PROC
    started: float
    deadline: float
    nbytes: int
    ndescs: int
    peer: str
    retry: tuple | None = None  # load() args, when a retry after re-handshake is allowed
    post_s: float = 0.0  # seconds inside NIXL's post calls, summed over the parts
    failed: str = ""


@dataclass
class Worker:
    """One registered engine worker (engine id + TP rank) and all it owns."""

    key: WorkerKey
    tp_size: int
    model: str
    layout: Layout
    regions: list[Region]
    compat_hash: str
    agent: NixlAgent
    mappings: list[ShmMapping]
    registrations: list
    bases: list[int]
    local_dlist: object
    registered_bytes: int
    staging: list[str] = field(default_factory=list)  # staged data path: shm names we made (unlinked at the end)
    owner_pid: int = 0  # the engine process that made segment_names (0: unknown)
    segment_names: list[str] = field(default_factory=list)  # the engine's own shm names (direct path)
    memory: str = "DRAM"  # NIXL memory type of its segments: "DRAM" (POSIX shm) or "VRAM" (CUDA IPC, issue 7)
    device: int = 0       # VRAM: the GPU its segments are on (the descriptors' device id)
    staged: bool = False  # staged data path (shm mirrors in ``staging``, or VRAM mirrors in ``mappings``)
    data_path_reason: str = ""  # why this path (kvd.core.path_select), for logs
    leases: LeaseTable = field(default_factory=LeaseTable)
    remotes: dict[PeerKey, RemoteWorker] = field(default_factory=dict)
    retired: list[RemoteWorker] = field(default_factory=list)  # dropped; NIXL state freed once unused
    readers: dict[str, RemoteWorker] = field(default_factory=dict)  # push mode: readers we WRITE to, by agent
    agents: dict[str, tuple[bytes, int]] = field(default_factory=dict)  # peer agents loaded: name -> (metadata, users)
    inflight: dict[str, InflightLoad] = field(default_factory=dict)
    pending_loads: set[str] = field(default_factory=set)
    events: deque = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    sessions: int = 0
    detached_since: float | None = None
    epoch: int = 0  # +1 each time the last session ends: loads of an older epoch are dropped

    @property
    def label(self) -> str:
        return f"engine={self.key[0]} rank={self.key[1]}"

    def geometry(self) -> plan.Geometry:
        return plan.Geometry(self.key[1], self.tp_size, self.layout, tuple(self.regions),
                             self.layout.model_kv_heads(self.tp_size))


@dataclass
class Counters:
    """Cumulative counters since start (units: bytes, counts)."""

    bytes_read: int = 0
    transfers_done: int = 0
    transfers_failed: int = 0
    leases_expired: int = 0
    leases_notified: int = 0
    leases_released: int = 0
    handshakes: int = 0
