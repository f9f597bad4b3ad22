"""Scheduler side of KvdConnector: decides loads, holds and saves; builds the step's metadata.

Runs in vLLM's engine core (``KVConnectorRole.SCHEDULER``). Per request, in
the order vLLM's scheduler calls the facade (``kvd.shim.vllm.connector``):

- decode (D): ``get_num_new_matched_tokens`` (how many tokens come from P,
  maybe called more than once), ``update_state_after_alloc`` (the blocks to
  fill: a :class:`~kvd.shim.vllm.metadata.LoadSpec`);
- prefill (P): ``update_state_after_alloc`` (staged: start tracking the
  blocks to save), ``request_finished`` (the ``kv_transfer_params`` for D, a
  :class:`~kvd.shim.vllm.metadata.HoldSpec`);
- decode (D), while a request waits to load: ``on_new_request`` starts
  renewing P's lease (:mod:`kvd.shim.vllm.renewals`), ``update_connector_output``
  (received or failed) and ``request_finished`` stop it;
- every step: ``build_connector_meta`` hands what was queued to the workers
  (and sends the lease renewals that are due).

No method blocks on I/O: the constructor asks the daemon's peer address
once; lease renewals are unary calls whose answers are taken on a later step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.config import VllmConfig
from vllm.v1.request import RequestStatus

from kvd.addresses import split_host_port
from kvd.client import EngineClient
from kvd.requests import MAX_ID_BYTES, BlockGroups
from kvd.shim.vllm.config import KvdShimConfig
from kvd.shim.vllm.groups import TransferGroups, cdiv, check_counts
from kvd.shim.vllm.metadata import HoldSpec, KvdConnectorMetadata, LoadRules, LoadSpec, SaveSpec
from kvd.shim.vllm.params import (REMOTE_KEYS, SPARE_BLOCK_IDS, blocks_per_local_block, checked_fields, has_remote,
                                   remote_fields)
from kvd.shim.vllm.renewals import LeaseRenewals
from kvd.shim.vllm.worker import daemon_peer_address

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvd.shim.vllm")

#: A prefill that ended in one of these hands its blocks to D (others were
#: aborted), as NixlConnector's ``request_finished`` (pull_scheduler.py).
_HANDED_OFF = frozenset((RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED))

#: The engine id, host and request id together, in characters, past which a
#: spec's fields are checked on the step (each may be MAX_ID_BYTES).
_MAX_TEXT = 3 * MAX_ID_BYTES

#: ``kv_transfer_params.transfer_mode``: the decode side's daemon reads
#: (NixlConnector's ``_TRANSFER_MODE`` of its pull scheduler).
TRANSFER_MODE = "pull"


@dataclass
class _SaveState:
    """A request being staged: its block table per transfer group, and how
    many of its tokens' blocks the workers were already told to save."""

    request: Request
    table: BlockGroups = field(default_factory=list)
    saved_tokens: int = 0


class KvdScheduler:
    """Scheduler-side state: loads and holds waiting for the next step's metadata."""

    def __init__(self, vllm_config: VllmConfig, cfg: KvdShimConfig, engine_id: str,
                 groups: TransferGroups | None = None):
        self.cfg = cfg
        self.engine_id = engine_id
        pc = vllm_config.parallel_config
        self.tp_size = pc.tensor_parallel_size
        self.pp_size = int(getattr(pc, "pipeline_parallel_size", 1))
        self.dcp_size = int(getattr(pc, "decode_context_parallel_size", 1))
        self.groups = groups or TransferGroups()
        self.block_size = int(vllm_config.cache_config.block_size)
        self.rules = LoadRules(cfg.load_timeout_s, self.block_size, any(self.groups.window_blocks))
        self._loads: dict[str, LoadSpec] = {}
        self._holds: list[HoldSpec] = []
        # Staged path: do_remote_decode requests whose computed blocks the
        # workers copy into their mirrors (request, block table, tokens saved).
        # ``auto`` stages until the workers say they share directly
        # (set_worker_paths): a save the worker ignores costs a little, a
        # missing one would hand the reader stale mirrors.
        self._stage = cfg.data_path != "direct"
        self._saving: dict[str, _SaveState] = {}
        self.peer_host: str | None = None
        self.peer_port: int | None = None
        self._client: EngineClient | None = None  # for lease renewals, made at the first one
        self.renewals = LeaseRenewals(self._renew, max_groups=len(self.groups.group_ids))
        kv = vllm_config.kv_transfer_config
        if kv is not None and kv.is_kv_producer:
            key = "kv_connector_extra_config.kvd_peer_address" if cfg.peer_address else "the daemon's peer_address"
            self.peer_host, self.peer_port = split_host_port(cfg.peer_address or daemon_peer_address(cfg), key,
                                                             min_port=1)

    def set_worker_paths(self, paths: dict[int, Any]) -> None:
        """The workers' :class:`~kvd.shim.vllm.metadata.KvdWorkerPath` by TP
        rank (``KvdConnector.set_xfer_handshake_metadata``, once after they
        registered). With ``kvd_data_path = auto``, when every TP rank
        reports that it shares its KV cache directly (``may_stage`` False:
        the CPU resolved auto to direct), blocks are no longer tracked for
        saving; anything else (a rank missing, or one that may be staged)
        keeps them tracked."""
        if not self._stage or self.cfg.data_path != "auto":
            return
        ranks = {rank: getattr(p, "may_stage", True) for rank, p in (paths or {}).items()}
        if len(ranks) < self.tp_size or any(ranks.values()):
            log.info("kvd engine=%s: kvd_data_path auto: %s; the scheduler tracks blocks for staging copies",
                     self.engine_id, "some TP ranks did not report their data path" if len(ranks) < self.tp_size
                     else f"TP ranks {sorted(r for r, m in ranks.items() if m)} may be staged")
            return
        self._stage = False
        self._saving.clear()
        log.info("kvd engine=%s: kvd_data_path auto: every TP rank shares its KV cache directly; "
                 "no staging copies", self.engine_id)

    def _renew(self, remote_engine_id: str, remote_address: str, renewals):
        """Sends one ``RenewLeases`` through this scheduler's own client of the
        daemon (no registration: the workers own those)."""
        if self._client is None:
            self._client = EngineClient(self.cfg.socket)
        return self._client.renew_leases(remote_engine_id, remote_address, renewals)

    def on_new_request(self, request: Request) -> None:
        """Decode side (``KvdConnector.on_new_request``): a request with
        ``do_remote_prefill`` and every remote field has P's lease renewed
        while it waits (:mod:`kvd.shim.vllm.renewals`). No I/O."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and has_remote(params):
            self.renewals.track(request, params)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Stops renewing P's lease for requests that received their blocks
        or failed to (``KvdConnector.update_connector_output``)."""
        for rid in (output.finished_recving or ()):
            self.renewals.stop(rid)
        for rid in (getattr(output, "failed_recving", None) or ()):
            self.renewals.stop(rid)

    def shutdown(self) -> None:
        """Closes the renewals' client of the daemon (if one was made)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Decode side (``KvdConnector.get_num_new_matched_tokens``): for a request
        with ``do_remote_prefill`` and complete remote params, ``(prompt tokens -
        num_computed_tokens, True)`` (loaded asynchronously); else ``(0, False)``.
        No side effects."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and has_remote(params):
            count = request.num_prompt_tokens - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def _spec(self, request: Request, params: dict[str, Any], local: BlockGroups, awaiting: bool,
              error: str | None = None) -> LoadSpec:
        """The :class:`LoadSpec` of D's ``request`` from P's
        ``kv_transfer_params`` (:func:`has_remote` true; ``local``: the blocks
        to fill per transfer group, [] for none). P's fields go in as given
        when they are ints and text of at most ``_MAX_TEXT`` characters
        together (what JSON gives an honest P): the engine client's sender
        thread checks and converts them (``LoadSpec.resolve``), off the
        engine's step; others are checked here (:meth:`_odd_spec`). A spec
        with no READ to make (``error`` set, or notify-only) carries none of
        P's block ids. Never raises."""
        # Positional, and the fields taken by one C call: this runs on the
        # engine's step for every load (docs/PERFORMANCE.md, engine step).
        remote, tp, bs = remote_fields(params), params.get("tp_size"), params.get("block_size")
        engine, host, port, remote_rid, _ = remote
        if (type(port) is not int or type(engine) is not str or type(host) is not str or type(remote_rid) is not str
                or (tp is not None and type(tp) is not int) or (bs is not None and type(bs) is not int)
                or len(engine) + len(host) + len(remote_rid) > _MAX_TEXT):
            # Rare (JSON gives ints and short strings): anything else is
            # checked here, so that no value of unbounded size goes to the
            # workers (vLLM pickles the metadata to each TP rank's process).
            return self._odd_spec(request, remote, tp, bs, local, awaiting, error)
        if error is not None or not awaiting:  # rare: no READ, so P's block ids (their count unchecked) stay here
            remote = (engine, host, port, remote_rid, [])
        return LoadSpec(request.request_id, local, remote, awaiting, self.rules, error, tp, bs,
                        request.num_prompt_tokens + SPARE_BLOCK_IDS)

    def _odd_spec(self, request: Request, remote: tuple, tp: Any, bs: Any, local: BlockGroups, awaiting: bool,
                  error: str | None) -> LoadSpec:
        """:meth:`_spec` for fields of other types or long text: checked now
        (:func:`~kvd.shim.vllm.params.checked_fields`,
        :func:`~kvd.shim.vllm.params.blocks_per_local_block`); the spec
        carries them converted, or, when they name no prefill engine, none
        (nobody to tell) and the error."""
        engine, host, port, remote_rid, block_ids = remote
        rid, max_ids = request.request_id, request.num_prompt_tokens + SPARE_BLOCK_IDS
        try:
            engine, host, port, remote_rid, tp = checked_fields(engine, host, port, remote_rid, tp)
        except ValueError as e:
            return LoadSpec(rid, local, ("", "", 0, "", []), awaiting, self.rules,
                            error or f"invalid: kv_transfer_params: {e}", None, None, max_ids)
        try:  # P's block size as the int it names (a string may be padded to any length: int() takes that)
            k = blocks_per_local_block(bs, self.block_size, self.rules.windowed)
            bs = self.block_size // k if k > 1 else None
        except ValueError as e:
            bs, error = None, error or str(e)
        if error is not None or not awaiting:
            block_ids = []  # no READ: P's block ids stay here
        return LoadSpec(rid, local, (engine, host, port, remote_rid, block_ids), awaiting, self.rules, error, tp, bs,
                        max_ids)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Decode side (``KvdConnector.update_state_after_alloc``): queues the request's
        load (blocks to fill per transfer group: not from the prefix cache, windows
        clipped; P's blocks are matched to them off the step, ``LoadSpec.resolve``),
        or a notify-only spec when ``num_external_tokens`` is 0; clears
        ``do_remote_prefill`` (one transfer per request, as NixlConnector). A
        mismatch fails the load (reported by the worker), it does not raise.
        Prefill side, staged path: starts tracking a ``do_remote_decode``
        request's blocks for saving."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and self._stage and self.peer_host is not None:
            self._saving.setdefault(request.request_id, _SaveState(request))
        if not params or not params.get("do_remote_prefill"):
            return
        # One transfer per request, as NixlConnector does (pull_scheduler.py:188).
        params["do_remote_prefill"] = False
        if not has_remote(params):
            log.warning("kvd engine=%s request=%s: kv_transfer_params lack remote fields %s; no transfer",
                        self.engine_id, request.request_id, [k for k in (*REMOTE_KEYS, "remote_block_ids") if not params.get(k)])
            return
        if num_external_tokens <= 0:  # full local prefix hit (or nothing to load): only tell P
            self.renewals.stop(request.request_id)
            self._loads[request.request_id] = self._spec(request, params, [], False)
            return
        error = None
        try:
            # The blocks to fill: those not from D's prefix cache, padding
            # (null) blocks skipped, sliding windows clipped as P clipped them
            # (pull_scheduler.py:149-156).
            local = self.groups.to_transfer(blocks.get_unhashed_block_ids_all_groups())
        except ValueError as e:
            local, error = [], f"invalid: {e}"
        if error is None:
            try:  # converted off the step, but counted here (a len a group): what goes to the workers is bounded
                check_counts(params["remote_block_ids"], request.num_prompt_tokens + SPARE_BLOCK_IDS, len(local))
            except (TypeError, ValueError) as e:
                error = f"invalid: remote_block_ids: {e}"
        self._loads[request.request_id] = self._spec(request, params, local, True, error)

    def build_connector_meta(self, scheduler_output: SchedulerOutput | None = None) -> KvdConnectorMetadata:
        """The loads, holds (and, staged, saves) queued since the last step, for the
        workers (``KvdConnector.build_connector_meta``, once per engine step);
        clears the queues."""
        meta = KvdConnectorMetadata(loads=list(self._loads.values()), holds=self._holds)
        self._loads = {}
        self._holds = []
        if len(self.renewals):
            self.renewals.poll()
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
        # yield_req_data's third element: vLLM 0.32 "resumed from preemption",
        # 0.33 "is_full_table" (True for new requests too). Either way True
        # means new_ids is the whole block table, which replaces ours; a new
        # request under 0.32 (False) has no table yet, so it is replaced too.
        for rid, new_ids, full_table in yield_req_data(scheduler_output):
            st = self._saving.get(rid)
            if st is None:
                continue
            if new_ids is not None:
                try:
                    new_groups = self.groups.select(new_ids)
                except ValueError:
                    continue
                if full_table or not st.table:  # a new or preempted-and-resumed request: its whole table
                    st.table, st.saved_tokens = new_groups, 0
                else:
                    for g, ids in zip(st.table, new_groups):
                        g.extend(ids)
            end = st.request.num_computed_tokens + scheduled.get(rid, 0)
            first, last = st.saved_tokens // self.block_size, cdiv(end, self.block_size)
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
        self._saving.pop(request.request_id, None)
        self.renewals.stop(request.request_id)
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Decode request finished before it was scheduled (aborted): tell P
            # nobody will read, as NixlConnector does (pull_scheduler.py:219-230).
            if has_remote(params):
                self._loads[request.request_id] = self._spec(request, params, [], False)
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in _HANDED_OFF:
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
        return delay_free, self._prefill_params(request, groups)

    def _prefill_params(self, request: Request, groups: BlockGroups) -> dict[str, Any]:
        """P's ``kv_transfer_params`` for D: NixlConnector's keys
        (``nixl/pull_scheduler.py:278-292``, 0.32 and 0.33), which routers key
        on, plus kvd's ``block_size``.

        - ``remote_host``/``remote_port``: P's *daemon* peer address;
        - ``transfer_mode``: ``"pull"`` (D's daemon reads; routers dispatch
          both legs at once only for ``"push"``);
        - ``remote_blocks_expiry_time``: when the lease ends, wall clock
          seconds (``time.time()``), taken now, a step before the hold reaches
          the daemon and its lease starts: never later than the real end.
          None when the lease is the daemon's default (``kvd_lease_s``
          unset), whose length the engine does not know;
        - ``tp_size``, ``pp_size``, ``dcp_size``: P's parallel sizes (PP and
          DCP are 1: :func:`~kvd.shim.vllm.config.check_supported`);
        - ``remote_num_tokens``: the tokens P computed.
        """
        lease_s = self.cfg.lease_s
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": groups,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.peer_host,
            "remote_port": self.peer_port,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "dcp_size": self.dcp_size,
            "block_size": self.block_size,  # D maps k = D's / P's block size P blocks per D block
            "remote_num_tokens": request.num_computed_tokens,
            "remote_blocks_expiry_time": time.time() + lease_s if lease_s > 0 else None,
            "transfer_mode": TRANSFER_MODE,
        }
