"""kvd's vLLM connector under the class name ``NixlConnector``, for
orchestrators that accept a P/D connector by name only: point
``kv_connector_module_path`` at this module (``kvd.shim.vllm.nixl_name``).

Dynamo (``dynamo/vllm/kv_connector_protocols.py``, ``KV_CONNECTOR_PROTOCOLS``
and ``_resolve_multi_connector_protocol``) picks its P/D protocol from
``kv_transfer_config.kv_connector`` and, for a ``MultiConnector``, from the
child's ``kv_connector``; ``KvdConnector`` is refused there ("Unsupported
kv_connector" / "has no PD-capable sub-connector"). kvd speaks
NixlConnector's ``kv_transfer_params``, so the child
``{"kv_connector": "NixlConnector", "kv_connector_module_path":
"kvd.shim.vllm.nixl_name", ...}`` is accepted by Dynamo as NIXL, and vLLM
loads this class for it: an external ``kv_connector_module_path`` takes
priority over vLLM's registry (``kv_connector/factory.py``,
``get_connector_class``). vLLM's config checks then treat the engine as
NixlConnector (``KVTransferConfig.has_connector``): the DCP, SSM-layout and
routed-experts rules of NIXL apply.
"""

from kvd.shim.vllm.connector import KvdConnector as NixlConnector

__all__ = ["NixlConnector"]
