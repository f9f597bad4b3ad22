"""Worker side of KvdConnector: registration, the session, and the requests in flight.

Runs in each vLLM worker process (``KVConnectorRole.WORKER``), one per TP
rank. The only module of the shim that talks to the daemon
(:class:`kvd.client.engine_client.EngineClient`): blocking RPCs at startup
(``RegisterEngine`` here, ``GetStats`` for the scheduler's
:func:`daemon_peer_address`) and shutdown (``UnregisterEngine``); every
per-step call only queues commands on the session stream or drains its
local event queue. The KV cache reaches the daemon through the sharing
implementation ``kvd.shim.memory.auto`` picks by the tensors' device.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from vllm.config import VllmConfig

from kvd.addresses import split_host_port
from kvd.client.channel import unix_path
from kvd.client.engine_client import EngineClient, EngineClientError, EngineSocketDenied
from kvd.requests import BlockGroups, LoadRequest, flat
from kvd.shim.memory import auto
from kvd.shim.memory.base import KvSharing
from kvd.shim.memory.staged import StagingError, StagingMirror
from kvd.shim.vllm import cpu_kv_probe
from kvd.shim.vllm.config import KvdShimConfig
from kvd.shim.vllm.groups import TransferGroups, own_groups
from kvd.shim.vllm.metadata import KvdConnectorMetadata, LoadSpec
from kvd.shim.vllm.stats import KvdKVConnectorStats
from kvd.v1 import kvd_pb2 as pb

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("kvd.shim.vllm")

#: vLLM KVCacheLayout names (``vllm/v1/kv_cache_layout.py``, and the legacy
#: aliases of ``vllm/config/cache.py``) -> the order inside one block.
_BLOCK_LAYOUTS = {
    "LBHNC": "HND", "BLHNC": "HND", "LHBNC": "HND", "BHLNC": "HND", "HND": "HND",
    "LBNHC": "NHD", "BLNHC": "NHD", "NHD": "NHD",
}


def daemon_peer_address(cfg: KvdShimConfig) -> str:
    """The daemon's ``GetStats.peer_address`` (one RPC, scheduler startup):
    where remote decode engines reach this engine's KV.

    Raises:
        RuntimeError: the daemon does not answer within
            ``kvd_connect_timeout_s`` or reports no peer address (the message
            says to set ``kvd_peer_address``).
    """
    client = EngineClient(cfg.socket)
    try:
        stats = client.get_stats(timeout_s=cfg.connect_timeout_s)
    except EngineSocketDenied as e:  # at once: waiting would not help
        raise RuntimeError(f"KvdConnector: cannot ask the kvd daemon at {cfg.socket} for its peer address: "
                           f"{e}") from None
    except EngineClientError as e:
        path = unix_path(cfg.socket)
        missing = (f"; nothing is at {path}: is kv_connector_extra_config.kvd_socket the daemon's "
                   f"--engine-socket?" if path and not os.path.exists(path) else "")
        raise RuntimeError(
            f"KvdConnector: cannot ask the kvd daemon at {cfg.socket} for its peer address "
            f"within {cfg.connect_timeout_s:.0f} s ({e}){missing}; start `kvd serve` first "
            "(or set kv_connector_extra_config.kvd_peer_address, which spares this question)"
        ) from None
    finally:
        client.close()
    if not stats.peer_address:
        raise RuntimeError("KvdConnector: the kvd daemon reports no peer_address; set kvd_peer_address")
    host, _ = split_host_port(stats.peer_address, "the daemon's peer_address", min_port=1)
    if host in ("0.0.0.0", "::", ""):
        log.warning("kvd peer address %s is a wildcard; remote decode engines cannot reach it "
                    "(set kvd_peer_address or the daemon's advertised address)", stats.peer_address)
    log.info("kvd: this engine's KV is served at %s (daemon %s)", stats.peer_address, stats.daemon_version)
    return stats.peer_address


class KvdWorker:
    """Worker-side state: the daemon client, the KV cache's sharing, and the
    requests in flight.

    Every method the engine calls per step is O(commands + events) of local
    queue work (plus, on the staged path, copies of the requests' blocks;
    on CUDA, a device sync before a hold); none performs I/O.
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
        self._retired: list[StagingMirror] = []  # mirrors of an earlier registration, closed at shutdown
        self.sharing: KvSharing | None = None
        self.stats = KvdKVConnectorStats()
        self._recving: dict[str, BlockGroups] = {}   # awaiting loads: local block ids per group
        self._holding: dict[str, BlockGroups] = {}   # held requests: block ids per group
        self._done_recving: set[str] = set()    # failures known before any RPC
        self._failed_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._closed = False

    @property
    def label(self) -> str:
        """``engine=<id> rank=<n>`` (the engine client's label), for logs."""
        return self.client.label

    @property
    def may_stage(self) -> bool:
        """Whether the daemon may serve this worker from staging mirrors, now
        or after a re-registration: the registration did not ask for the
        direct path (``staged``, or an ``auto`` the daemon decides; a staged
        answer to a direct request is refused, ``_on_reregister``). False
        before registration."""
        return self.sharing is not None and self.sharing.wire_data_path != pb.DATA_PATH_DIRECT

    @property
    def staging(self) -> StagingMirror | None:
        """The daemon's staging mirrors, mapped (staged path), else None."""
        return self.sharing.staging if self.sharing is not None else None

    # ------------------------------------------------------------ startup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], vllm_config: VllmConfig,
                           kv_cache_config: KVCacheConfig | None, groups: TransferGroups) -> pb.RegisterEngineResponse:
        """Shares the KV cache with the daemon, registers it, opens the session
        (blocking, ``kvd_connect_timeout_s``; ``KvdConnector.register_kv_caches``).

        Only the layers of transfer groups are registered, each region with
        its group. The memory kind follows the tensors' device
        (``kvd.shim.memory.auto.choose``): POSIX shm for CPU, CUDA IPC for CUDA.

        Raises:
            ValueError: no KVCacheConfig, transfer groups with different block
                sizes, an unknown KV cache layout.
            KvShareError (``CpuShareError``, ``CudaShareError``): the KV cache
                cannot be shared or described (the message says why: mixed
                devices, CPU and CUDA together, expandable segments, ...).
            EngineClientError: the daemon refused or is unreachable.
            StagingError: the daemon's mirrors cannot be mapped.
        """
        kcc = kv_cache_config
        if kcc is None or not kcc.kv_cache_groups:
            raise ValueError("KvdConnector needs the KVCacheConfig to register the KV cache")
        if len(set(groups.block_sizes)) > 1:
            raise ValueError(f"KvdConnector: the KV-cache groups have different block sizes {groups.block_sizes}; "
                             "a kvd layout has one block size")
        spec = kcc.kv_cache_groups[groups.group_ids[0]].kv_cache_spec
        caches = {name: t for name, t in kv_caches.items() if name in groups.layer_group} \
            if groups.layer_group else dict(kv_caches)
        mc = vllm_config.model_config
        kv_layout = kv_layout_name(vllm_config, kcc)
        sharing = auto.choose(caches, self.cfg.data_path)
        shared = sharing.share(
            caches,
            num_blocks=kcc.num_blocks,
            block_size=spec.block_size,
            kv_layout=kv_layout,
            num_kv_heads=getattr(spec, "num_kv_heads", 0),
            head_dim=getattr(spec, "head_size", 0),
            total_kv_heads=total_kv_heads(mc),
            groups=groups.layer_group or None,
        )
        self.sharing = sharing
        if shared.layout.kv_in_block:
            # A block-size remap needs the exact place of every K and V row
            # inside the block, which the CPU kernel decides: ask it.
            k_layout = cpu_kv_probe.kv_block_layout(
                next(iter(caches.values())).dtype, spec.block_size, spec.head_size,
                str(vllm_config.cache_config.cache_dtype))
            if k_layout is None:
                shared.layout.kv_in_block = False  # unknown inside: blocks move whole, equal sizes only
            else:
                shared.layout.k_dim_major = k_layout == "dim_major"
        import vllm

        compat_extra = (
            f"vllm={vllm.__version__};cache_dtype={vllm_config.cache_config.cache_dtype};"
            f"kv_cache_layout={getattr(kcc, 'kv_cache_layout', None) or kv_layout}"
        )
        if shared.kv_in_block:
            # K and V of a head share a block. vLLM-CPU (HND): the layout says
            # so (Layout.kv_in_block) and the daemon moves K and V runs apart,
            # so P block < D block works; any other such layout (FlashInfer's
            # [2, tokens, heads, head_dim] block) cannot be re-sliced by
            # tokens, so only equal block sizes pair.
            compat_extra += ";kv_in_block=1" if shared.layout.kv_in_block else f";kv_in_block={spec.block_size}"
        request = pb.RegisterEngineRequest(
            worker=self.worker,
            layout=shared.layout,
            segments=shared.segments,
            regions=shared.regions,
            model=str(mc.model),
            compat_extra=compat_extra,
            data_path=sharing.wire_data_path,
            owner_pid=os.getpid(),
        )
        # memfds: fresh ids each registration; the first one waits for a daemon
        # started after this engine, within kvd_connect_timeout_s in all.
        self.client.before_register = lambda req, deadline: sharing.prepare(req, self.client.address, deadline)
        self.registered = self.client.register(request, timeout_s=self.cfg.connect_timeout_s)
        sharing.attach(self.registered)
        self.client.on_register = self._on_reregister
        self.client.start_session()
        if not self.client.wait_opened(min(10.0, self.cfg.connect_timeout_s)):
            log.warning("kvd %s: session not open yet; commands wait for it", self.label)
        log.info("kvd %s: registered %d bytes of %s memory as agent %s (compat %s, data path %s)", self.label,
                 self.registered.registered_bytes, sharing.kind, self.registered.agent_name,
                 self.registered.compat_hash, pb.DataPath.Name(self.registered.data_path))
        return self.registered

    def _on_reregister(self, response: pb.RegisterEngineResponse) -> None:
        """Session thread: the daemon registered this worker anew (it restarted or
        had dropped it), before the client sends the holds again.

        Staged: map the new mirrors and copy the whole KV cache into them
        (besides held requests, requests still being computed, chunked
        prefill, or finished with their hold not yet sent had blocks saved
        into the old mirror). Under CUDA ``auto`` the daemon decides at each
        registration, so a restarted daemon may answer otherwise than the
        first: staged after direct gets mirrors filled the same way; direct
        after staged stops the copies (the old mirror stays mapped until
        shutdown: the engine thread may be copying through it right now).

        Raises:
            StagingError: the mirrors cannot be mapped; a staged answer to a
                registration that asked for the direct path (a daemon that
                contradicts its request; the client unregisters).
        """
        self.registered = response
        sharing = self.sharing
        if sharing is None:
            return
        if response.data_path == pb.DATA_PATH_STAGED:
            if sharing.wire_data_path == pb.DATA_PATH_DIRECT:
                raise StagingError("the daemon answered the staged data path to a registration that asked for "
                                   "the direct one")
            fresh = sharing.staging is None
            sharing.attach(response)
            moved = sharing.staging.copy_all()
            log.info("kvd %s: %s staging mirrors %s; KV cache copied in (%d bytes)", self.label,
                     "the daemon now stages: " if fresh else "new", ", ".join(sharing.staging.names), moved)
        elif sharing.staging is not None:
            log.warning("kvd %s: the daemon registered this worker on the direct path now; staging copies stop",
                        self.label)
            self._retired.append(sharing.staging)
            sharing.staging = None

    # ----------------------------------------------------------- per step
    def start(self, meta: KvdConnectorMetadata) -> None:
        """Queues this step's holds and loads (no I/O)."""
        if meta.holds and self.sharing is not None:
            self.sharing.sync()  # the held blocks' bytes are final before the daemon may read them
        for h in meta.holds:
            groups = h.groups  # staged: in the mirror since the steps that computed them (save)
            self._holding[h.request_id] = groups
            self.client.hold(h.request_id, groups, lease_s=h.lease_s)
        for ld in meta.loads:
            if ld.error is not None or not ld.awaiting:  # rare: resolved here, on the step
                self._fail_or_notify(ld)
                continue
            # P's fields are checked and converted by the client's sender
            # thread (LoadSpec.resolve), off the step; a bad one fails the
            # load through the client's events, as a daemon refusal would.
            self._recving[ld.request_id] = own_groups(ld.local_groups)
            self.client.load(ld)

    def _fail_or_notify(self, ld: LoadSpec) -> None:
        """A load the scheduler already found invalid fails now; either way,
        and for a notify-only one, P frees its blocks when its fields say
        where it is (else its lease ends the hold)."""
        if ld.error is not None:
            log.warning("kvd %s request=%s: load not sent: %s", self.label, ld.request_id, ld.error)
            if ld.awaiting:
                self._fail_now(ld.request_id, ld.local_block_ids)
        src = ld.source()
        if src is not None:
            self._abort(src)
        elif ld.error is None:
            log.warning("kvd %s request=%s: kv_transfer_params name no prefill engine to tell", self.label,
                        ld.request_id)

    def save(self, meta: KvdConnectorMetadata) -> None:
        """Staged path: copies the blocks this step's forward pass wrote, for
        requests to be handed off, into the mirror (no I/O; a memcpy)."""
        staging = self.staging
        if staging is None:
            return
        for sv in meta.saves:
            try:
                staging.copy_in(sv.groups)
            except StagingError as e:
                log.error("kvd %s request=%s: copy to the staging mirror failed: %s", self.label, sv.request_id, e)

    def _abort(self, req: LoadRequest) -> None:
        """P frees the request's blocks now (nobody will read them)."""
        self.client.abort_load(req.request_id, remote_engine_id=req.remote_engine_id,
                               remote_address=req.remote_address, remote_request_id=req.remote_request_id,
                               remote_tp_size=req.remote_tp_size)

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
        if not events and not recving:  # most steps: nothing ended (engine-step cost)
            return set(), set(), set()
        sending: set[str] = set()
        staging = self.staging
        self._done_recving, self._failed_recving = set(), set()
        # Asked once per call, not per load: the debug line's arguments
        # (four protobuf fields, the label) cost ~1 us a load even when the
        # line is not logged (hot loop, docs/PERFORMANCE.md fifteenth round).
        debug = log.isEnabledFor(logging.DEBUG)
        for ev in events:
            kind = ev.WhichOneof("event")
            if kind == "recv_done":
                done = ev.recv_done
                rid = done.request_id
                local = self._recving.pop(rid, None)
                if local is None:
                    continue
                if staging is not None:
                    try:
                        staging.copy_out(local)  # before vLLM may read the blocks
                    except StagingError as e:
                        log.error("kvd %s request=%s: copy from the staging mirror failed: %s", self.label, rid, e)
                        self._fail_load(rid, local, recving, failed)
                        continue
                recving.add(rid)
                self.stats.record_transfer(done)
                if debug:
                    log.debug("kvd %s request=%s: loaded %d blocks, %d bytes in %.1f ms", self.label, rid,
                              done.num_blocks, done.bytes, done.duration_s * 1e3)
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

    def _fail_load(self, rid: str, local: BlockGroups, recving: set[str], failed: set[str],
                   failed_ids: list[int] | None = None) -> None:
        self.stats.record_failed_transfer()
        recving.add(rid)
        failed.add(rid)
        if self.num_groups == 1:  # block-level errors only make sense with one group (scheduler.py:3365)
            self._invalid_blocks.update(failed_ids or flat(local))

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
        """Lets go of the shared memory (shm names unlinked, mirror mappings
        closed), then unregisters (2 s deadline) and stops the session
        (idempotent).

        The names go first, before any I/O: vLLM's api_server stops with
        ``mode=abort timeout=0s`` and force-kills the worker processes
        right after asking them to stop (seen in ``tests/test_vllm_e2e.py``'s
        logs: the workers' UnregisterEngine arrived, the process was gone
        before the session thread joined). The daemon has mapped the memory
        already and never needs the names again but to re-register after its
        own restart, which a stopping engine will not do. The mirrors are
        closed before ``UnregisterEngine`` too: the daemon frees them then,
        and a VRAM mirror must not be freed while another process maps it
        (``kvd.core.cuda_ipc.VramMirror.close``).
        """
        if self._closed:
            return
        self._closed = True
        if self.sharing is not None:
            released = self.sharing.close()
            if released:
                log.info("kvd %s: unlinked KV cache segment(s) %s", self.label, ", ".join(released))
        for mirror in self._retired:
            mirror.close()
        self._retired.clear()
        try:
            if self.registered is not None:
                self.client.unregister(timeout_s=2.0)
        except EngineClientError as e:
            log.warning("kvd %s: unregister at shutdown: %s", self.label, e)
        finally:
            self.client.close()


def kv_layout_name(vllm_config: VllmConfig, kv_cache_config: Any) -> str:
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


def total_kv_heads(model_config: Any) -> int:
    """KV heads of the whole model (all TP ranks); 0 when vLLM cannot say."""
    try:
        return int(model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        return 0


def tp_rank(vllm_config: VllmConfig) -> int:
    """This worker's TP rank (0 without tensor parallelism)."""
    if vllm_config.parallel_config.tensor_parallel_size <= 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
