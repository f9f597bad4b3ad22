"""Values that cross from the engine client to the daemon core, one type each.

A load is one :class:`LoadRequest` from the shim to the core: the engine
client builds its ``pb.LoadBlocks`` from it, the daemon's session adapter
turns that message back into the same value, and the core's pull (or push)
path takes it whole. Nothing else spells out the fields of a load.

Block ids are always per KV-cache group (:data:`BlockGroups`): vLLM's hybrid
memory allocator (HMA) gives one list per group
(``request_finished_all_groups``); a model without HMA has one group, so its
ids are ``[[...]]``. There is no flat encoding.

This module imports nothing of kvd's and no third-party package: the engine
side (the shim, the client) and the daemon core both import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

BlockGroups = list[list[int]]
"""Block ids per KV-cache group, each in prompt order (one group without HMA)."""

MAX_RENEWALS_PER_CALL = 256
"""Leases one ``RenewLeases`` call may name (EngineService and PeerService):
the shim batches its renewals by it, the daemon refuses a longer list
(``INVALID_ARGUMENT``)."""

MAX_ID_BYTES = 1024
"""Longest request id, engine id or address (UTF-8 bytes) a daemon accepts
in a command or a call; a renewal naming a longer one gets its whole call
refused (``INVALID_ARGUMENT``), so the shim checks it per request first."""

MAX_RENEWAL_GROUPS = 256
"""KV-cache groups one renewal may name: vLLM models have a handful (one
per attention type). Each group becomes a list when a call is converted,
so the daemon checks the count first: one renewal of 132k empty groups
(257 KiB) took 147 ms to convert (attacker review). Past it the whole call
is refused, so the shim checks it per request first."""


def flat(groups: BlockGroups) -> list[int]:
    """Every block id of every group, in order: what vLLM's load errors name
    (``get_block_ids_with_load_errors`` takes local block ids of any group).
    One group's list is returned as it is, not copied (a failed load of 1M
    ids spent ~9 % of its refusal copying them): read it, never change it."""
    if len(groups) == 1:
        return groups[0]
    return [b for g in groups for b in g]


class LoadRequest(NamedTuple):
    """One decode-side load: pull the remote engine's blocks into local blocks.

    - ``request_id``: the local (decode) request id; the load's events name it.
    - ``local_groups`` / ``remote_groups``: block ids per KV-cache group, the
      same number of groups on both sides. ``remote_groups[g][i]`` fills
      slot ``i % k`` of local block ``local_groups[g][i // k]`` where ``k`` is
      local block size / remote block size (tokens); sliding-window groups
      carry only the blocks inside the window (the shim clips them).
    - ``remote_engine_id``: the prefill engine's id (its ``kv_transfer_params``).
    - ``remote_address``: the prefill daemon's PeerService ``host:port``.
    - ``remote_request_id``: the prefill request id, named in the notification
      that ends its lease.
    - ``remote_tp_size``: the prefill engine's TP size (0: the local TP size).
    - ``timeout_s``: this load's deadline in seconds (0: the daemon default).

    Immutable: the client keeps it for a retry after a reconnect and the core
    keeps it for a retry after a failed handshake; neither copies it
    (``_replace`` makes a changed copy). A named tuple, not a frozen
    dataclass: one is made per load on the engine's scheduler step and
    again in the daemon, and a frozen dataclass's ``__init__`` took 3.4 us
    here against 0.6-1.2 us (docs/PERFORMANCE.md, engine step).
    """

    request_id: str
    local_groups: BlockGroups
    remote_engine_id: str
    remote_address: str
    remote_groups: BlockGroups
    remote_request_id: str
    remote_tp_size: int = 1
    timeout_s: float = 0.0

    @property
    def local_block_ids(self) -> list[int]:
        """Every local block id (what a ``LoadFailed`` names)."""
        return flat(self.local_groups)


class DeferredLoad(Protocol):
    """A load whose remote fields are checked and converted off the engine's
    step: ``EngineClient.load`` takes one in place of a :class:`LoadRequest`
    and its sender thread calls :meth:`resolve` as it builds the command.
    What the engine's step needs of it (the local request id, the local
    blocks a failure names, the timeout) is known without resolving.

    Why: the decode scheduler checked P's fields (from the API request) for
    every load on the engine's step: ``update_state_after_alloc`` took 12.3
    us a load there with them, 6.5 without (medians of eleven runs,
    docs/PERFORMANCE.md "twenty-fourth session").
    """

    request_id: str
    local_groups: BlockGroups

    @property
    def timeout_s(self) -> float:
        """This load's deadline in seconds (0: the client's default)."""

    @property
    def local_block_ids(self) -> list[int]:
        """Every local block id (what a ``LoadFailed`` names)."""

    def resolve(self) -> LoadRequest:
        """The load as the daemon takes it. Raises :class:`InvalidLoad`."""


class InvalidLoad(ValueError):
    """A load whose fields name no load the daemon could take: raised by a
    deferred load's ``resolve()`` (see ``EngineClient.load``) on the
    client's sender thread, which then fails the load locally with this
    message as its reason, and, when ``abort`` is set (the fields still
    name the prefill engine, request and address), sends an ``AbortLoad``
    of it so that the prefill side frees its blocks now rather than at the
    end of its lease."""

    def __init__(self, reason: str, abort: LoadRequest | None = None):
        super().__init__(reason)
        self.abort = abort


@dataclass(frozen=True, slots=True)
class LeaseRenewal:
    """A reader's renewal of one prefill lease, while its request waits to load.

    - ``request_id``: the prefill request id (``kv_transfer_params``
      ``remote_request_id``), whose lease is renewed.
    - ``groups``: block ids per KV-cache group the reader will read (a subset
      per group of the held ones, as a claim names them): the prefill daemon
      renews only a lease that holds them (docs/SECURITY.md).
    """

    request_id: str
    groups: BlockGroups


@dataclass(frozen=True, slots=True)
class RenewResult:
    """What the prefill daemon answered for one :class:`LeaseRenewal`.

    - ``left_s``: seconds until the lease ends after the renewal (the least
      over the engine's TP ranks); 0 when not renewed.
    - ``reason``: ``""`` when renewed, else why not (``not_held``: no lease of
      the request holds those blocks: never held, read already, released or
      expired).
    """

    request_id: str
    left_s: float = 0.0
    reason: str = ""

    @property
    def renewed(self) -> bool:
        return not self.reason
