"""What the scheduler-side connector tells the workers each engine step.

``KvdConnector.build_connector_meta`` (scheduler, once per step) returns a
:class:`KvdConnectorMetadata`; vLLM ships it to every worker, whose
``start_load_kv`` and ``wait_for_save`` act on it. Block ids are
:data:`kvd.requests.BlockGroups` throughout (per transfer group).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from kvd.requests import BlockGroups, LoadRequest, flat
from kvd.shim.vllm.params import resolve_load, source_of


@dataclass(frozen=True, slots=True)
class LoadRules:
    """What a decode engine's loads are checked against, made once by its
    scheduler and shared by every :class:`LoadSpec`.

    ``timeout_s``: each load's deadline in seconds (``kvd_load_timeout_s``,
    0: the daemon's default); ``block_size``: this engine's tokens per block;
    ``windowed``: some transfer group has a sliding window (a P block size
    other than D's is refused then).
    """

    timeout_s: float = 0.0
    block_size: int = 0
    windowed: bool = False


@dataclass(slots=True)
class LoadSpec:
    """One decode-side load, scheduler -> worker, and a
    :class:`~kvd.requests.DeferredLoad`: the worker hands it to the engine
    client, whose sender thread resolves it (:meth:`resolve`) as it builds
    the command, off the engine's step.

    Attributes:
        request_id: the local (decode) request id.
        local_groups: the local blocks to fill, per transfer group (for a
            notify-only spec, none).
        remote: P's ``(remote_engine_id, remote_host, remote_port,
            remote_request_id, remote_block_ids)`` as the decode engine's API
            request gave them when they are ints and short text (what JSON
            gives an honest P), checked on the scheduler otherwise (and, when
            they name no prefill engine, ``("", "", 0, "", [])`` with
            ``error`` set); the block ids only counted there
            (:func:`~kvd.shim.vllm.groups.check_counts`). ``tp_size`` and
            ``remote_block_size`` the same (``tp_size`` and ``block_size``
            there, None when absent), and ``max_ids`` the block ids a group
            may name (prompt tokens + ``SPARE_BLOCK_IDS``).
        awaiting: vLLM parked the request in WAITING_FOR_REMOTE_KVS and waits
            for it in ``finished_recving``. False for notify-only loads (full
            local prefix hit, or a request aborted before it was scheduled):
            the worker only sends ``AbortLoad`` (P frees its blocks now), and
            nothing is reported to vLLM (it asserts on it).
        rules: the scheduler's :class:`LoadRules`.
        error: set when the scheduler already knows the load cannot work; the
            worker reports it failed without a transfer (and tells P to free).
    """

    request_id: str
    local_groups: BlockGroups
    remote: tuple
    awaiting: bool
    rules: LoadRules
    error: str | None = None
    tp_size: object = None
    remote_block_size: object = None
    max_ids: int = 0

    @property
    def timeout_s(self) -> float:
        """This load's deadline in seconds (0: the daemon's default)."""
        return self.rules.timeout_s

    @property
    def local_block_ids(self) -> list[int]:
        """Every local block id (what a failure names)."""
        return flat(self.local_groups)

    def resolve(self) -> LoadRequest:
        """The load as the daemon takes it (:func:`~kvd.shim.vllm.params.resolve_load`).

        Raises:
            InvalidLoad: P's fields name no load into these blocks.
        """
        return resolve_load(self)

    @property
    def request(self) -> LoadRequest:
        """:meth:`resolve`'s load (for readers of a spec; the worker does not
        resolve on the engine's step). Raises InvalidLoad."""
        return self.resolve()

    def source(self) -> LoadRequest | None:
        """The load with P's engine, address, request and TP size, and no
        blocks (what an ``AbortLoad`` names), or None when those fields
        name no prefill engine (nobody to tell)."""
        return source_of(self)


@dataclass(slots=True)
class HoldSpec:
    """One prefill-side hold, scheduler -> worker: keep these blocks for a reader.

    ``groups``: block ids per transfer group; ``lease_s``: seconds (0: the
    daemon's default lease).
    """

    request_id: str
    groups: BlockGroups
    lease_s: float


@dataclass(slots=True)
class SaveSpec:
    """Staged path, prefill side: blocks whose KV this step's forward pass
    writes, for a request that will be handed off (``do_remote_decode``);
    the worker copies them into the staging mirror in ``wait_for_save``.

    ``groups``: block ids per transfer group. The copy happens in the step
    that computes the KV, as NixlConnector's host buffer does
    (``nixl/base_scheduler.py:437-472``), not when the hold goes out one step
    later: the params reach D as soon as the request finishes, and D's READ
    must find the bytes in the mirror already.
    """

    request_id: str
    groups: BlockGroups


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):
    """What one engine step asks of the workers (built by ``build_connector_meta``)."""

    loads: list[LoadSpec] = field(default_factory=list)
    holds: list[HoldSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(frozen=True)
class KvdWorkerPath(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler once, after registering its KV cache:
    whether the daemon may ever serve it from staging mirrors.

    vLLM's engine core collects every worker's ``get_handshake_metadata()``
    after the KV caches are registered and hands them to the scheduler-side
    connector's ``set_xfer_handshake_metadata`` (``vllm/v1/engine/core.py``,
    0.32 and 0.33), keyed by TP rank.

    ``may_stage``: False only when the registration asked for the direct path
    (``data_path`` direct, or ``auto`` resolved to direct on the CPU), which
    no re-registration changes; the scheduler then stops tracking blocks to
    save. True for ``staged`` and for an ``auto`` the daemon decides (CUDA):
    a restarted daemon may decide otherwise.
    """

    may_stage: bool
