"""``kv_connector_extra_config`` of KvdConnector, and what it refuses at startup.

``kv_connector_extra_config`` keys (all optional but ``kvd_socket``):

===================== ======= ==================================================
key                   default meaning
===================== ======= ==================================================
kvd_socket            --      the daemon's engine socket (path or ``unix://``)
kvd_peer_address      (ask)   ``host:port`` remote daemons reach ours at; default:
                              ``GetStats.peer_address``, asked once at startup
kvd_lease_s           daemon  seconds the prefill daemon holds finished blocks
                              for a reader (like NIXL's ``kv_lease_duration``);
                              default: the daemon's ``--lease-s``; a waiting
                              decode request renews it
                              (``kvd.shim.vllm.renewals``) up to the prefill
                              daemon's ``max_lease_life_s``
kvd_load_timeout_s    daemon  seconds a load may take before it fails; default:
                              the daemon's ``--transfer-timeout-s``
kvd_connect_timeout_s 60      startup wait for the daemon (register, GetStats):
                              an engine started first waits this long in all
                              for ``kvd serve`` (memfd handover and
                              RegisterEngine together), then fails naming
                              ``kvd_socket``; one whose user may not connect
                              to it fails at once, naming its owner and mode
kvd_data_path         auto    how blocks reach NIXL (docs/DESIGN.md "Memory
                              sharing"): ``direct`` (the daemon maps the KV
                              cache itself: POSIX shm, a memfd or CUDA IPC),
                              ``staged`` (the daemon owns staging mirrors;
                              this worker copies blocks in before a hold and
                              out after a load), ``auto`` (CPU: direct, or
                              staged when the KV cache cannot be shared;
                              CUDA: the daemon chooses,
                              ``kvd.core.path_select``); the memory kind
                              follows the KV cache's device
                              (``kvd.shim.memory.auto``). ``direct`` on a GPU
                              is refused with NIXL 1.5.1 (UCX cannot export
                              memory the daemon imported by CUDA IPC;
                              docs/GPU.md), hence the default
===================== ======= ==================================================

Any other ``kvd_`` key is ignored with one WARNING naming it and the closest
of these (:func:`warn_unknown_keys`); keys without the prefix are other
connectors' and are left alone.

Refused at startup (:func:`check_supported`) with a clear error, and why:

- KV-cache groups that are not attention over token positions (Mamba/SSM
  state), bounded-replay sliding windows (DSV41) and drafters that read
  prefill lookahead tokens (MTP/EAGLE): NixlConnector serves them by making P
  stop short of the last prompt tokens and D recompute them
  (``nixl/base_scheduler.py:379-435``, ``_prefill_backoff``) and by clipping
  SSM state slots; kvd moves whole blocks by position only.
- More than one transfer group on a vLLM without
  ``KVConnectorTransferResults``: block-level load errors with more than
  one group make vLLM's scheduler raise (``scheduler.py:3365-3374``).
- Decode context parallelism and pipeline parallelism (one registration per
  TP rank). Transfer groups with different block sizes are refused at
  registration (``Layout.block_size`` is one number).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig

from kvd.addresses import split_host_port
from kvd.shim.memory.base import DATA_PATHS
from kvd.usage import did_you_mean

try:  # vLLM >= 0.32: failed receives reported with the completions
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

log = logging.getLogger("kvd.shim.vllm")

#: Every ``kv_connector_extra_config`` key :meth:`KvdShimConfig.from_extra`
#: reads (the module table).
SETTINGS = ("kvd_socket", "kvd_peer_address", "kvd_lease_s", "kvd_load_timeout_s", "kvd_connect_timeout_s",
            "kvd_data_path")
PREFIX = "kvd_"


def warn_unknown_keys(extra: Mapping[Any, Any]) -> list[str]:
    """Logs one WARNING per key of ``extra`` that starts with ``kvd_`` (any
    case) and is not in :data:`SETTINGS`, naming the closest setting (difflib,
    as the daemon's hint for a misspelt ``KVD_*`` variable) or, with none
    close, all of them; returns the messages. Other keys are not looked at:
    vLLM hands a connector the whole ``kv_connector_extra_config``, which a
    MultiConnector shares among its connectors.

    Warned, not refused, like the daemon's misspelt ``KVD_*`` variables
    (``kvd.config.unknown_env_warnings``): a key a newer kvd reads, in a
    config shared with engines still on an older one (a rolling upgrade),
    must not stop those engines; the WARNING still says that the default is
    used instead. Logged once per key and process: vLLM makes a scheduler
    connector and a worker connector in the engine-core process, each
    reading the same dict."""
    out = []
    for key in extra:
        if not isinstance(key, str) or not key.lower().startswith(PREFIX) or key in SETTINGS:
            continue
        # Lower case for the match: keys are case-sensitive, KVD_LEASE_S is not kvd_lease_s.
        hint = did_you_mean(key.lower(), SETTINGS) or f"; known: {', '.join(SETTINGS)}"
        out.append(f"kv_connector_extra_config.{key} is not a KvdConnector setting and is ignored{hint}")
        if key not in _WARNED and len(_WARNED) < 64:  # bounded: keys come from a config, not a peer
            _WARNED.add(key)
            log.warning("kvd: %s", out[-1])
    return out


#: Keys :func:`warn_unknown_keys` has logged in this process.
_WARNED: set[str] = set()


@dataclass(frozen=True)
class KvdShimConfig:
    """Settings read from ``kv_connector_extra_config`` (see the module table)."""

    socket: str
    peer_address: str | None = None
    lease_s: float = 0.0            # 0: the daemon's default lease
    load_timeout_s: float = 0.0     # 0: the daemon's default transfer timeout
    connect_timeout_s: float = 60.0
    data_path: str = "auto"         # "direct" | "staged" | "auto"

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KvdShimConfig:
        """Raises ValueError naming the bad key; an unknown ``kvd_`` key is
        only logged (:func:`warn_unknown_keys`)."""
        extra = dict(extra or {})
        warn_unknown_keys(extra)
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
            split_host_port(str(peer), "kv_connector_extra_config.kvd_peer_address", min_port=1)  # validate early
        data_path = str(extra.get("kvd_data_path") or "auto").lower()
        if data_path not in DATA_PATHS:
            raise ValueError(f"kv_connector_extra_config.kvd_data_path must be one of {', '.join(DATA_PATHS)} "
                             f"(got {extra.get('kvd_data_path')!r})")
        return cls(
            socket=socket,
            peer_address=str(peer) if peer is not None else None,
            lease_s=seconds("kvd_lease_s", 0.0),
            load_timeout_s=seconds("kvd_load_timeout_s", 0.0),
            connect_timeout_s=seconds("kvd_connect_timeout_s", 60.0),
            data_path=data_path,
        )


def check_supported(vllm_config: VllmConfig, kv_cache_config: Any) -> None:
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
