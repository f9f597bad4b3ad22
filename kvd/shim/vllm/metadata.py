"""What the scheduler-side connector tells the workers each engine step.

``KvdConnector.build_connector_meta`` (scheduler, once per step) returns a
:class:`KvdConnectorMetadata`; vLLM ships it to every worker, whose
``start_load_kv`` and ``wait_for_save`` act on it. Block ids are
:data:`kvd.requests.BlockGroups` throughout (per transfer group).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from kvd.requests import BlockGroups, LoadRequest


@dataclass(slots=True)
class LoadSpec:
    """One decode-side load, scheduler -> worker.

    Attributes:
        request: the load as the daemon takes it (``EngineClient.load``); for
            a notify-only spec its groups are empty and only the remote
            fields count (``EngineClient.abort_load``).
        awaiting: vLLM parked the request in WAITING_FOR_REMOTE_KVS and waits
            for it in ``finished_recving``. False for notify-only loads (full
            local prefix hit, or a request aborted before it was scheduled):
            the worker only sends ``AbortLoad`` (P frees its blocks now), and
            nothing is reported to vLLM (it asserts on it).
        error: set when the scheduler already knows the load cannot work; the
            worker reports it failed without a transfer (and tells P to free).
    """

    request: LoadRequest
    awaiting: bool
    error: str | None = None

    @property
    def request_id(self) -> str:
        """The local (decode) request id."""
        return self.request.request_id


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
