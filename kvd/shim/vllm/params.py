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

import operator
import reprlib
from typing import TYPE_CHECKING, Any

from kvd.addresses import join_host_port
from kvd.requests import MAX_ID_BYTES, InvalidLoad, LoadRequest
from kvd.shim.vllm.groups import as_groups

if TYPE_CHECKING:
    from kvd.shim.vllm.metadata import LoadSpec

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


#: P's fields a load names, read by one C call: ``(remote_engine_id,
#: remote_host, remote_port, remote_request_id, remote_block_ids)`` (the
#: order of ``LoadSpec.remote``); KeyError when one is absent.
remote_fields = operator.itemgetter("remote_engine_id", "remote_host", "remote_port", "remote_request_id",
                                    "remote_block_ids")


def has_remote(params: dict[str, Any]) -> bool:
    """True when ``kv_transfer_params`` name remote blocks and every remote
    field (none absent or None). Three times per load on the decode
    scheduler's step (``on_new_request``, ``get_num_new_matched_tokens``,
    ``update_state_after_alloc``): one ``itemgetter`` call, not five
    ``get``s (docs/PERFORMANCE.md, engine step)."""
    try:
        engine, host, port, rid, block_ids = remote_fields(params)
    except KeyError:
        return False
    return bool(block_ids) and engine is not None and rid is not None and host is not None and port is not None


def remote_of(params: dict[str, Any]) -> tuple[str, str, str, int]:
    """Where the P blocks that ``params`` name are (:func:`has_remote` true):
    ``(P's engine id, P's daemon "host:port", P's request id, P's TP size)``,
    a plain tuple (a named one cost 0.3 us more a load, hot). ``tp_size``
    absent, None or 0 means 1 (NixlConnector's default).

    Raises ValueError naming the field: a ``remote_port`` that is not an
    integer in 1-65535, a ``tp_size`` that is not an integer in
    1..2**32-1.
    """
    return checked_remote(params["remote_engine_id"], params["remote_host"], params["remote_port"],
                          params["remote_request_id"], params.get("tp_size"))


def checked_remote(engine: Any, host: Any, port: Any, remote_rid: Any, tp: Any) -> tuple[str, str, str, int]:
    """:func:`remote_of` of the fields themselves (``tp`` None or 0: 1)."""
    engine, host, port, remote_rid, tp = checked_fields(engine, host, port, remote_rid, tp)
    return engine, join_host_port(host, port), remote_rid, tp


def checked_fields(engine: Any, host: Any, port: Any, remote_rid: Any, tp: Any) -> tuple[str, str, int, str, int]:
    """P's fields checked and converted: ``(engine id, host, port, request
    id, TP size)``; ``tp`` None or 0 means 1.

    Raises ValueError naming the field: an id or host that is not text (a
    number is taken as its digits), not valid UTF-8 or longer than the
    daemon takes (:data:`~kvd.requests.MAX_ID_BYTES`, also for
    ``host:port``: a longer one would fail the whole session's command, or
    its AbortLoad), a port not an integer in 1-65535, a TP size not an
    integer in 1..2**32-1.
    """
    # The type checks first: an int (what JSON gives) skips the conversion.
    tp = tp or 1
    if type(port) is not int:
        try:
            port = int(port)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"remote_port {shown(port)} is not a port number") from None
    if not 0 < port < 65536:
        raise ValueError(f"remote_port {port} is not in 1-65535")
    if type(tp) is not int:
        try:
            tp = int(tp)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"tp_size {shown(tp)} is not an integer") from None
    if not 0 < tp < UINT32:
        raise ValueError(f"tp_size {tp} is not in 1..{UINT32 - 1}")
    host = _text(host, "remote_host")
    _text(join_host_port(host, port), "remote_host:remote_port")
    return _text(engine, "remote_engine_id"), host, port, _text(remote_rid, "remote_request_id"), tp


def _text(value: Any, field: str) -> str:
    """``value`` as the text of an id (see :func:`checked_fields`)."""
    if type(value) is not str:
        if not isinstance(value, (int, float)):
            raise ValueError(f"{field} must be text, not {type(value).__name__}")
        value = str(value)
    if len(value) > MAX_ID_BYTES:  # a character is at least a byte: no encoding needed to refuse it
        raise ValueError(f"{field} of {len(value)} characters, more than {MAX_ID_BYTES} bytes")
    try:
        n = len(value.encode())
    except UnicodeEncodeError:  # a lone surrogate: protobuf refuses it, as the daemon would
        raise ValueError(f"{field} is not valid UTF-8 text") from None
    if n > MAX_ID_BYTES:
        raise ValueError(f"{field} of {n} bytes, more than {MAX_ID_BYTES}")
    return value


class _Shown(reprlib.Repr):
    """``reprlib``'s bounded repr, but a dict or set only by its size:
    ``reprlib`` sorts every key of one before it shows four (a dict of 1M
    shuffled keys took ~0.95 s: attacker review)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxstring = self.maxother = self.maxlong = 40
        self.maxlist = self.maxtuple = 4

    def repr_dict(self, x, level):
        return f"<dict of {len(x)} items>"

    def repr_set(self, x, level):
        return f"<set of {len(x)} items>"

    repr_frozenset = repr_set


_SHOWN = _Shown()


def shown(value: Any) -> str:
    """A bounded repr of an API client's value for an error message:
    ``f"{v!r:.40}"`` built the whole repr first (~74 ms for a list of 1M
    ints: attacker review)."""
    return _SHOWN.repr(value)


def source_of(spec: LoadSpec) -> LoadRequest | None:
    """``spec``'s prefill side as a load with no blocks (what an
    ``AbortLoad`` names), or None when its fields name no reachable
    prefill engine (:func:`checked_remote` refuses them)."""
    engine, host, port, remote_rid, _ = spec.remote
    try:
        remote = checked_remote(engine, host, port, remote_rid, spec.tp_size)
    except ValueError:
        return None
    return _blockless(spec, remote)


def _blockless(spec: LoadSpec, remote: tuple[str, str, str, int]) -> LoadRequest:
    """``spec``'s load with no blocks, from P's checked fields ``remote``."""
    engine, address, remote_rid, tp = remote
    return LoadRequest(spec.request_id, [], engine, address, [], remote_rid, tp, spec.rules.timeout_s)


def blocks_per_local_block(remote_bs: Any, block_size: int, windowed: bool) -> int:
    """Prefill blocks per local block, ``k``: ``remote_bs`` is P's tokens
    per block (``kv_transfer_params`` ``block_size``, sent by this shim's
    prefill side; None: equal sizes), ``block_size`` this engine's.

    ``k`` > 1 when P's block is a divisor of this engine's (the daemon
    fills one decode block from ``k`` prefill blocks). Raises ValueError (an
    ``"invalid: ..."`` reason) for a P block that does not divide D's (the
    daemon refuses it at handshake as well), a remap with sliding-window
    groups (``windowed``: their windows are clipped in each side's own
    blocks), or a value that is no integer (the API request's).
    """
    if remote_bs is None or remote_bs == block_size:
        return 1  # equal block sizes, the common case: nothing to check
    try:
        remote_bs = int(remote_bs or block_size)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"invalid: the prefill engine's block size {shown(remote_bs)} is not an integer") from None
    if remote_bs <= 0 or block_size % remote_bs:
        raise ValueError(f"invalid: the prefill engine's block size {remote_bs} does not divide this engine's "
                         f"{block_size} tokens (kvd fills a decode block from whole prefill blocks only: "
                         f"prefill block <= decode block)")
    k = block_size // remote_bs
    if k > 1 and windowed:
        raise ValueError(f"invalid: prefill block size {remote_bs} != decode block size {block_size} "
                         f"with sliding-window KV-cache groups (not supported)")
    return k


def resolve_load(spec: LoadSpec) -> LoadRequest:
    """The :class:`~kvd.requests.LoadRequest` that ``spec`` names: P's
    fields checked (:func:`checked_remote`), its block ids converted
    (:func:`~kvd.shim.vllm.groups.as_groups`: integers only, at most
    ``spec.max_ids`` a group), one group of them per local group, and, when
    D's prefix cache already holds the leading blocks, the tail of P's
    blocks taken to match (``k`` P blocks per D block,
    :func:`blocks_per_local_block`). Runs on the engine client's sender
    thread (``EngineClient.load`` of a deferred load), off the step.

    Raises:
        InvalidLoad: the reason (``"invalid: ..."``); its ``abort`` names P
            when the fields still say where P is (it frees its blocks now).
    """
    engine, host, port, remote_rid, block_ids = spec.remote
    try:
        checked = checked_remote(engine, host, port, remote_rid, spec.tp_size)
    except ValueError as e:
        raise InvalidLoad(f"invalid: kv_transfer_params: {e}") from None
    local, rules = spec.local_groups, spec.rules
    try:
        remote = as_groups(block_ids, spec.max_ids, len(local))
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidLoad(f"invalid: remote_block_ids: {e}", _blockless(spec, checked)) from None
    for g in remote:  # the wire's ids are uint32: protobuf would refuse the command, and P would not be told
        if g and not (0 <= min(g) and max(g) < UINT32):
            raise InvalidLoad(f"invalid: remote_block_ids: ids outside 0..{UINT32 - 1}", _blockless(spec, checked))
    if len(remote) != len(local):
        raise InvalidLoad(f"invalid: the prefill engine sent block ids for {len(remote)} KV-cache groups, "
                          f"this engine has {len(local)}", _blockless(spec, checked))
    try:
        k = blocks_per_local_block(spec.remote_block_size, rules.block_size, rules.windowed)
    except ValueError as e:
        raise InvalidLoad(str(e), _blockless(spec, checked)) from None
    for g, (lg, rg) in enumerate(zip(local, remote)):
        n = -(-len(rg) // k)
        if len(lg) > n:
            raise InvalidLoad(f"invalid: group {g}: {len(lg)} local blocks to fill, the prefill engine sent "
                              f"{len(rg)}", _blockless(spec, checked))
        # D's prefix cache already holds the leading blocks: the blocks to
        # fill are the tail, so take the tail of P's blocks
        # (nixl/base_worker.py:3446-3455). P block < D block (k P blocks per
        # D block): D's hit is whole D blocks, k P blocks each. Every P block
        # wanted (the common case, no prefix hit): rg as it is, not a copy.
        if len(lg) < n:
            remote[g] = rg[k * (n - len(lg)):] if lg else []
    engine, address, remote_rid, tp = checked
    # Positional: by keyword it took twice as long (docs/PERFORMANCE.md, fifteenth round).
    return LoadRequest(spec.request_id, local, engine, address, remote, remote_rid, tp, rules.timeout_s)
