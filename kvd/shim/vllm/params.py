"""P's ``kv_transfer_params`` as the decode side reads them.

They reach the decode engine in its API request: vLLM's proxy or a router
copies what P returned into the request's ``kv_transfer_params``, a
free-form dict (``vllm/entrypoints/openai/completion/protocol.py``, and
``chat_completion/`` alike). Anyone who can send the decode engine a
request chooses them. Whatever is in them must fail that request's load,
never raise out of the scheduler's connector calls: vLLM's engine core
stops on an exception there ("EngineCore encountered a fatal error",
``vllm/v1/engine/core.py``), and with it every request of every user.
"""

from __future__ import annotations

from typing import Any

from kvd.addresses import join_host_port

#: The fields that name P's blocks (besides ``remote_block_ids``), as
#: NixlConnector's pull scheduler reads them (``nixl/pull_scheduler.py``).
REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")

UINT32 = 1 << 32  # the wire's remote_tp_size and block ids are uint32 (proto/kvd/v1/kvd.proto)

#: Block ids per KV-cache group that ``remote_block_ids`` may hold beyond
#: the prompt's token count: a block holds at least one token, so P's
#: blocks for an N-token prompt number at most N, plus slots P may
#: allocate ahead (vLLM's lookahead for speculative decoding). More is no
#: honest P's: refused before any id is converted (``as_groups``).
SPARE_BLOCK_IDS = 16


def has_remote(params: dict[str, Any]) -> bool:
    """True when ``kv_transfer_params`` name remote blocks and every remote field."""
    if not params.get("remote_block_ids"):
        return False
    for k in REMOTE_KEYS:  # a loop, not all(<generator>): twice per request on the scheduler (engine-step cost)
        if params.get(k) is None:
            return False
    return True


def remote_of(params: dict[str, Any]) -> tuple[str, str, str, int]:
    """Where the P blocks that ``params`` name are (:func:`has_remote` true):
    ``(P's engine id, P's daemon "host:port", P's request id, P's TP size)``,
    a plain tuple (a named one cost 0.3 us more a load, hot). ``tp_size``
    absent, None or 0 means 1 (NixlConnector's default).

    Raises ValueError naming the field: a ``remote_port`` that is not an
    integer in 1-65535, a ``tp_size`` that is not an integer in
    1..2**32-1.
    """
    # The type checks first: an int (what JSON gives) skips the conversion,
    # on the decode scheduler's per-load path (docs/PERFORMANCE.md, engine step).
    port, tp = params["remote_port"], params.get("tp_size") or 1
    if type(port) is not int:
        try:
            port = int(port)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"remote_port {port!r:.40} is not a port number") from None
    if not 0 < port < 65536:
        raise ValueError(f"remote_port {port} is not in 1-65535")
    if type(tp) is not int:
        try:
            tp = int(tp)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"tp_size {tp!r:.40} is not an integer") from None
    if not 0 < tp < UINT32:
        raise ValueError(f"tp_size {tp} is not in 1..{UINT32 - 1}")
    return (str(params["remote_engine_id"]), join_host_port(params["remote_host"], port),
            str(params["remote_request_id"]), tp)
