"""Who may have a peer agent loaded under a name.

NIXL keeps one remote agent per name (``loadRemoteMD`` takes the name from
the metadata), and ``kvd.core.peers`` refuses a second description under a
loaded name ("loaded already, with other metadata"): one agent is loaded
once and shared by every remote that describes it exactly. So a peer that
answers first with an agent of its own named like another engine's (names
show in notifications, logs, ``kvd status``: ``kvd-<engine>-r<rank>-<hex>``)
would keep a worker from that engine. The rules:

- a name of one of this daemon's own agents is refused in any description
  with other metadata than that agent's (:func:`refuse_own`): only the
  agent itself is described by its name, and an exact replay loads that
  very agent;
- a name loaded already is bound to the peer that loaded it first (its
  ``(address, engine_id, tp_rank)``, kept with the loaded agent in
  ``WorkerPairs.agents``). Another peer's description of another agent by
  that name makes this daemon ask that peer again (:func:`settle`): the
  newcomer is loaded only when the holder now describes another agent or
  has no such engine any more, else it is refused naming the holder; the
  holder's own address describing its agent anew replaces it.

Without a peer credential this cannot tell which of two peers that both
keep describing one name lies: the first keeps it (docs/SECURITY.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvd.core.events import InvalidArgument, NotFound
from kvd.core.nixl_agent import NixlError
from kvd.core.runtime import Runtime
from kvd.core.state import HandshakeResult, PeerKey, Worker

if TYPE_CHECKING:
    from kvd.core.peers import Peers


def refuse_own(rt: Runtime, hs: HandshakeResult, what: str) -> None:
    """Refuses a description (``what``: where it came from, for the message)
    that names one of this daemon's own agents with other metadata than
    that agent's.

    Raises:
        NixlError: naming the engine and rank whose agent it is.
    """
    for x in rt.workers.values():
        if x.agent.name == hs.agent_name and x.agent.metadata() != hs.agent_metadata:
            raise NixlError(f"{what} describes an agent named {hs.agent_name!r}, which is this daemon's agent "
                            f"of engine {x.key[0]!r} rank {x.key[1]}")


async def settle(peers: Peers, w: Worker, key: PeerKey, hs: HandshakeResult) -> None:
    """Before remote worker ``key``'s agent is loaded into ``w``'s under the
    name its handshake ``hs`` gives: nothing to do when no agent of that name
    is loaded, or the same one; else the holder is asked again
    (:func:`_holder_keeps`) unless it is ``key``'s own address, and when it
    no longer keeps the name its remotes of that name are retired (the
    handshake frees them before loading the new agent).

    Raises:
        InvalidArgument: the holder keeps the name (the message names it and why).
    """
    name = hs.agent_name
    known = w.pairs.agents.get(name)
    if known is None or known[0] == hs.agent_metadata:
        return
    holder = known[2]
    if holder[0] != key[0]:
        why = await _holder_keeps(peers, w, holder, name, known[0])
        if why:
            raise InvalidArgument(f"agent metadata rejected: {key[0]} describes another agent named {name!r} "
                                  f"than {holder[0]} engine={holder[1]} rank={holder[2]}, which loaded it first "
                                  f"and {why}")
    for r in [r for r in w.pairs.remotes.values() if r.agent_name == name]:
        peers.retire(w, r, f"{key[0]} engine={key[1]} rank={key[2]} describes another agent by its name",
                     again=False)


async def _holder_keeps(peers: Peers, w: Worker, holder: PeerKey, name: str, metadata: bytes) -> str:
    """Why ``holder`` keeps agent ``name``, as a clause: it still describes
    it with ``metadata``, or cannot be asked now (unreachable, slow: the
    daemon's ``handshake_timeout_s``; a push reader, which has no address);
    ``""`` when it answers with another agent or has no such engine."""
    address, engine_id, rank = holder
    if not address or peers.link is None:
        return "is not a peer this daemon can ask again"
    try:
        hs = await peers.link.handshake(address, engine_id, rank, w.compat_hash,
                                        peers.rt.limits.handshake_timeout_s)
    except NotFound:
        return ""
    except Exception as e:
        return f"cannot be asked again now ({e})"
    if hs.agent_name == name and hs.agent_metadata == metadata:
        return "still describes it"
    return ""
