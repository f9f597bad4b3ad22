"""Peers: the remote workers one local worker transfers with.

The handshake cache (one handshake per (local worker, remote worker), shared
by every request that needs it), the pairing of two agents (peer agent
loaded, UCX wire-up started, both descriptor lists of the pair's transfer
plan prepared, ``kvd.core.plan``, or left to each transfer when they are
too large), the users of each loaded peer agent, retiring a remote whose
transfer failed, and the answer to a remote daemon's handshake.

First contact with a remote engine starts the handshakes of every (local
rank, remote rank) pair of the two engines at once (:meth:`Peers.warm`);
``Limits.warm_peers`` starts them at registration and keeps them: a pair of
a listed engine that is dropped is made again in the background
(:meth:`Peers._keep_warm`); any other retired remote is handshaken again in
the background once.

A remote is *fresh* when this request's own handshake made it; a READ that
fails on a cached remote is retried once after a new handshake
(``kvd.core.pull``).

A remote no load should use any more (its daemon silent, its engine gone,
idle) is retired by ``kvd.core.liveness``; ``RemoteWorker.last_used`` is
when a load last took it.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import time

import numpy as np

from kvd import __version__
from kvd.core import agent_names
from kvd.core import layout as lay
from kvd.core import plan
from kvd.core.events import Incompatible, InvalidArgument, NotFound, PeerUnavailable, PermissionDenied
from kvd.core.hold_mirror import HoldMirror
from kvd.core.layout import LayoutError
from kvd.core.limits import BOUNDS, UidCounts
from kvd.core.metadata_vet import MetadataVet
from kvd.core.nixl_agent import SCRATCH_BYTES, NixlError, Unprepped, metadata_agent_name, metadata_problem
from kvd.core.runtime import Runtime
from kvd.core.state import (
    PEER_CALLER,
    PROTOCOL_VERSION,
    HandshakeResult,
    PeerKey,
    PeerLink,
    RemoteWorker,
    WarmPeer,
    Worker,
    owner_uid,
)
from kvd.core.throttle import Throttled
from kvd.core.transfer_mode import TransferModes
from kvd.logtext import clip

log = logging.getLogger("kvd.core")

# How often a handshake looks whether an old READ through a retired agent of
# the same name has ended (seconds; Peers.retired_in_use).
RETIRED_POLL_S = 0.01


def _remove_same(items: list, item) -> None:
    """Removes ``item`` itself from ``items`` (``list.remove`` compares
    dataclasses by value: another remote equal to it would go instead)."""
    for i, o in enumerate(items):
        if o is item:
            del items[i]
            return

#: Longest pause, seconds, before a ``warm_peers`` engine is paired again
#: after a drop (:meth:`Peers._keep_warm`), and the pace of tries once a
#: peer paired before answers as incompatible.
REPAIR_PAUSE_MAX_S = 30.0

# Seconds from a handshake to the preparation of its pair's descriptor
# lists: the load that caused the handshake posts its READ first (idle: a
# claim round trip, ~1 ms); until then, and for a pair past
# BOUNDS.max_prepped_rows always, each transfer makes its own rows (about
# the same cost above a few hundred descriptors; 0.04 ms more for 8).
PREP_DELAY_S = 1.0
#: A pair's agent is loaded and wired up (``add_remote_agent``, then its
#: warm-up READ) only once no other warm-up READ of this daemon is in
#: flight, waiting at most this long (seconds): one UCX wire-up at a time
#: per daemon. Seen on this 2-core machine in full-suite runs (a TP 1 -> 2
#: stack beside a running TP 1 -> 1 one): decode rank 1's
#: ``add_remote_agent`` of the prefill agent blocked the NIXL thread for
#: 63.8 s while rank 0's warm-up READ from that same agent, posted just
#: before, stayed in progress, and both loads passed their deadline. A
#: warm-up normally ends within milliseconds (docs/PERFORMANCE.md, "First
#: contact"), so waiting costs a TP-N first contact a few ms per rank.
WIRE_UP_WAIT_S = 2.0



def _paired_ranks(w: Worker, tp_size: int) -> list[int]:
    """The ranks of a remote engine of TP size ``tp_size`` that local worker
    ``w`` reads from or notifies (``plan.source_ranks``); none when no plan
    fits (the load that names the pair reports it)."""
    try:
        _, ranks = plan.source_ranks(w.key[1], w.tp_size, tp_size, w.layout.model_kv_heads(w.tp_size),
                                     w.layout.kv_layout == "MLA")
    except plan.PlanError:
        return []
    return list(ranks)


# kvd names its agents ``kvd-<engine id>-r<rank>-<hex>`` (``kvd.core.agent_names``), the engine id at
# most ``MAX_ID_BYTES`` (1,024); a peer's name is quoted in errors and shown in ``kvd status``.
MAX_AGENT_NAME_CHARS = 2048


def check_peer(w: Worker, hs: HandshakeResult, what: str) -> None:
    """Validates a peer worker's description before any NIXL call uses it.

    Raises:
        Incompatible: protocol version or compatibility hash differ.
        InvalidArgument: metadata size, region list or layout is malformed,
            or the agent name is longer than ``MAX_AGENT_NAME_CHARS``.
    """
    if hs.protocol_version != PROTOCOL_VERSION:
        raise Incompatible(f"peer protocol version {hs.protocol_version} (kvd {clip(hs.daemon_version, 64)}), "
                           f"this daemon speaks {PROTOCOL_VERSION} (kvd {__version__})")
    if hs.compat_hash != w.compat_hash:
        raise Incompatible(f"compatibility hash mismatch: local {w.compat_hash}, remote {clip(hs.compat_hash, 80)}")
    if not 0 < len(hs.agent_metadata) <= BOUNDS.max_agent_metadata:
        raise InvalidArgument(f"{what}: agent metadata of {len(hs.agent_metadata)} bytes "
                              f"(1..{BOUNDS.max_agent_metadata} accepted)")
    if len(hs.region_bases) != len(hs.regions) or not hs.regions:
        raise InvalidArgument(f"{what}: region_base_addrs and regions differ in length")
    if not 1 <= hs.tp_size <= BOUNDS.max_tp_size:
        raise InvalidArgument(f"{what}: tp_size must be in 1..{BOUNDS.max_tp_size} (got {hs.tp_size})")
    if len(hs.agent_name) > MAX_AGENT_NAME_CHARS:
        raise InvalidArgument(f"{what}: agent name of {len(hs.agent_name)} characters (at most "
                              f"{MAX_AGENT_NAME_CHARS})")
    if hs.memory not in ("DRAM", "VRAM") or not 0 <= hs.device < BOUNDS.max_device:
        raise InvalidArgument(f"{what}: memory {clip(hs.memory, 16)!r} on device {hs.device}: DRAM or VRAM on a "
                              f"device 0..{BOUNDS.max_device - 1}")
    # A worker registers at most BOUNDS.max_regions segments; a peer's
    # segment_index (a uint32) once sized the list below: 2**32-1 was a
    # MemoryError, 2**28 +2 GiB and 6 s of the event loop.
    for i, r in enumerate(hs.regions):
        if not 0 <= r.segment < BOUNDS.max_regions:
            raise InvalidArgument(f"{what}: region {i}: segment_index {r.segment} out of range "
                                  f"(a worker registers 0..{BOUNDS.max_regions - 1})")
    try:
        lay.validate(hs.layout, hs.regions, [1 << 62] * (1 + max(r.segment for r in hs.regions)))
    except LayoutError as e:
        raise InvalidArgument(f"{what}: peer layout invalid: {e}") from None
    for i, (base, r) in enumerate(zip(hs.region_bases, hs.regions)):
        # Descriptor rows are int64 (a forged base once raised OverflowError
        # in the descriptor maths and the load never ended).
        if base + (hs.layout.num_blocks - 1) * r.block_stride + r.block_len >= 1 << 63:
            raise InvalidArgument(f"{what}: region {i} at base address {base:#x} ends past the 64-bit range")
    if not 0 <= hs.warm_up_addr < (1 << 63) - SCRATCH_BYTES:
        raise InvalidArgument(f"{what}: warm_up_addr {hs.warm_up_addr:#x} is past the 64-bit range")
    # Last: the other checks' messages stay what they were for a description
    # that also carries junk metadata.
    problem = metadata_problem(hs.agent_metadata)
    if problem:
        raise InvalidArgument(f"{what}: agent metadata refused: {problem}")


def pair_plan(reader: plan.Geometry, source: plan.Geometry):
    """``(k, C, chunk_sets, reader_identity, source_identity)`` of a pair.

    ``reader_identity``: every chunk is a whole reader block (the reader's own
    prepped list serves); ``source_identity`` likewise for the source.

    Raises:
        Incompatible: the layouts cannot be combined (the message says why).
    """
    try:
        chunk_sets = plan.pair_chunks(reader, source)
    except plan.PlanError as e:
        raise Incompatible(f"layouts cannot be combined: {e}") from None
    k = reader.layout.block_size // source.layout.block_size
    C = len(chunk_sets[0]) // k
    if any(len(c) != k * C for c in chunk_sets):
        raise Incompatible("regions need different chunk counts (mixed region kinds)")
    one = k == 1 and C == 1
    reader_identity = one and all(c[0].tolist() == [0, 0, 0, r.block_len]
                                  for c, r in zip(chunk_sets, reader.regions))
    source_identity = one and all(c[0].tolist() == [0, 0, 0, r.block_len]
                                  for c, r in zip(chunk_sets, source.regions))
    return k, C, chunk_sets, reader_identity, source_identity


def on_device(rows: np.ndarray, device: int) -> np.ndarray:
    """Descriptor rows with their device-id column set (VRAM: the GPU ordinal; DRAM: 0)."""
    if device:
        rows[:, 2] = device
    return rows


def _said(e: BaseException) -> str:
    """An error as ``kvd status`` shows it: its text, at most 200 characters."""
    text = str(e) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _own_copy(e: BaseException) -> BaseException:
    """A copy of ``e`` (its type, arguments and attributes; no traceback,
    cause or context), or ``e`` itself where its type cannot be copied."""
    try:
        return copy.copy(e)
    except Exception:  # an exception type whose __init__ takes other arguments than its args
        return e


class Peers:
    """Remote workers of every local worker, and handshakes with their daemons.

    Args:
        rt: the core's shared state.
        link: reaches remote daemons (the daemon's gRPC ``PeerClient``; tests
            may pass a fake; None: no peer can be reached).
        mirror: follows the holds of each remote engine once paired with
            one of its ranks (``kvd.core.hold_mirror``; None: not followed).
        vet: loads each new peer metadata in a throwaway process first
            (``kvd.core.metadata_vet``; None: not).
        modes: the node's transfer modes, for what this daemon's handshakes
            say of a READ from it and which sources get no warm-up READ
            (None: handshakes say nothing, every source is warmed up).
    """

    def __init__(self, rt: Runtime, link: PeerLink | None, mirror: HoldMirror | None = None,
                 vet: MetadataVet | None = None, modes: TransferModes | None = None):
        self.rt = rt
        self.vet = vet
        # How a READ from this daemon travels, as handshakes say it ("": unknown).
        self.read_transport = modes.read_transport() if modes else ""
        # No warm-up READ from a source whose handshake says one of these
        # (its loads are pushes).
        self.no_warm_up_from: frozenset[str] = modes.no_warm_up_from() if modes else frozenset()
        self.link = link
        self.mirror = mirror
        self._handshakes: dict[tuple, asyncio.Future] = {}  # (local key, peer key) -> handshake task
        self._counts = UidCounts()  # handshake tasks by owner uid (-1: none)
        self._ahead_skipped = Throttled(log)
        self._warming: set[asyncio.Task] = set()  # Limits.warm_peers handshakes, retried until one answers
        self._preparing: set[asyncio.Task] = set()  # descriptor lists prepared after a handshake
        self._wiring = asyncio.Lock()  # one agent load + warm-up READ at a time (WIRE_UP_WAIT_S)

    def warm_configured(self, w: Worker) -> None:
        """Starts handshakes of ``w`` with every ``Limits.warm_peers`` engine
        (all its ranks), in the background (:meth:`_keep_warm`)."""
        for address, engine_id in self.rt.limits.warm_peers:
            task = asyncio.get_running_loop().create_task(self._keep_warm(w, address, engine_id))
            self._warming.add(task)
            task.add_done_callback(self._warming.discard)

    async def _keep_warm(self, w: Worker, address: str, engine_id: str) -> None:
        """Keeps ``w`` paired with every rank of ``warm_peers`` engine
        ``engine_id`` at ``address`` that it reads from or notifies, for as
        long as ``w`` is registered: pairs them (:meth:`_pair_warm`), then
        waits until a pair is dropped (``WarmPeer.dropped``, set by
        :meth:`retire`, e.g. its engine gone or its daemon silent at a
        liveness check, and when ``w``'s agent is replaced) or found missing
        (looked at locally every ``peer_check_s``), and pairs again after a
        pause, so the first load after a prefill engine's restart does not
        pay for first contact either. The pause is 1 s, doubled up to
        ``REPAIR_PAUSE_MAX_S`` while pairs keep being dropped within a
        minute of their pairing: a peer that answers and is dropped at once
        (two engines of a hostile daemon describing one agent name retire
        each other's pairs, ``kvd.core.agent_names``) makes this a handshake
        every 30 s, not a loop. Ends when the peer is given up at its first
        pairing; once it has been paired, an incompatible answer is tried
        again (a rolling upgrade)."""
        state = WarmPeer(address, engine_id, since=time.monotonic())
        w.pairs.warm.append(state)
        pause, paired_at = 0.0, None
        while self._keeps_warming(w):
            tp_size = await self._pair_warm(w, state, give_up=paired_at is None)
            if tp_size is None:
                return
            paired_at = time.monotonic()
            while self._keeps_warming(w):
                state.dropped.clear()
                if self._unpaired(w, address, engine_id, tp_size):
                    break
                try:
                    async with asyncio.timeout(self.rt.limits.peer_check_s):
                        await state.dropped.wait()
                except TimeoutError:
                    pass
            else:
                return
            pause = min(REPAIR_PAUSE_MAX_S, 2 * pause) if time.monotonic() - paired_at < 60.0 else 0.0
            pause = max(pause, 1.0)
            log.info("%s: warm_peers %s/%s: a pair was dropped; pairing again in %.0f s", w.label, address,
                     engine_id, pause)
            state.state, state.since = "trying", time.monotonic()
            await asyncio.sleep(pause)

    def _keeps_warming(self, w: Worker) -> bool:
        """Whether ``w``'s ``warm_peers`` handshakes go on (``w`` still
        registered, the daemon not closing or draining)."""
        return self.rt.workers.get(w.key) is w and not (self.rt.closing or self.rt.draining)

    async def _pair_warm(self, w: Worker, state: WarmPeer, give_up: bool = True) -> int | None:
        """Asks rank 0 of ``state``'s engine for its TP size, then
        handshakes with the ranks ``w`` pairs with (:meth:`warm`) until each
        is paired; asked again every second for the first minute while the
        peer does not answer or a rank is not paired (P and D engines start
        together, and a TP engine's ranks register one after the other: a
        rank that registers a few seconds after its rank 0 must be paired
        before D's first request, which on the demo's tiny engines comes 1-2
        s after registration), then after 2, 4 .. 30 s. Rank 0 is asked at
        each try, so a TP size that changed (the prefill engine restarted)
        is followed. Returns the TP size once every rank is paired; None
        when ``w`` is gone, the daemon stops, or the peer is given up: a
        rank 0 incompatible or described out of bounds (:func:`check_peer`:
        a TP size past ``BOUNDS.max_tp_size``, a foreign hash) is logged
        once and not tried again (``give_up``; else tried again every 30
        s); another rank's error is tried again at the same pace. A peer
        that refuses this daemon (UNAUTHENTICATED or PERMISSION_DENIED: its
        peer token differs) is said at WARNING at once and tried again
        after 1, 2, 4 .. 30 s from the start."""
        PEER_CALLER.set(owner_uid(w))  # first contacts are budgeted per uid
        address, engine_id = state.address, state.engine_id
        delay, warned, refused, started = 1.0, False, False, time.monotonic()
        while self._keeps_warming(w):
            grow = False
            try:
                if self.link is None:
                    return None
                # Rank 0 is asked at every try: it says the engine's TP size
                # now (a prefill engine restarted with another TP size is
                # followed), and a peer it describes badly (a TP size past
                # BOUNDS.max_tp_size, a foreign layout) is given up here.
                state.tries += 1
                hs = await self.link.handshake(address, engine_id, 0, w.compat_hash,
                                               self.rt.limits.handshake_timeout_s)
                check_peer(w, hs, f"warm_peers {address}/{engine_id} rank 0")
                if state.state != "answered":
                    state.state, state.since = "answered", time.monotonic()
                state.last_error = ""
                running = self.warm(w, address, engine_id, hs.tp_size)
                if running:
                    # asyncio.wait, not gather: this task's cancellation must
                    # not cancel handshakes that loads share.
                    await asyncio.wait(running)
                missing = self._unpaired(w, address, engine_id, hs.tp_size)
                if not missing:
                    return hs.tp_size
                # A rank's own error (not registered yet, a restart under
                # way) is retried at the same bounded pace; only rank 0's
                # description gives the peer up.
                errors = [f.exception() for f in running if not f.cancelled() and f.exception() is not None]
                shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8
                                                            else "")
                raise PeerUnavailable(f"rank(s) {shown} not paired" + (f": {errors[-1]}" if errors else ""))
            except (Incompatible, InvalidArgument) as e:
                state.last_error = _said(e)
                if give_up:
                    state.state, state.since = "given up", time.monotonic()
                    log.warning("%s: warm_peers %s/%s: %s; not tried again", w.label, address, engine_id, e)
                    return None
                log.log(logging.INFO if refused else logging.WARNING,
                        "%s: warm_peers %s/%s: %s; paired before, so tried again every %.0f s", w.label, address,
                        engine_id, e, REPAIR_PAUSE_MAX_S)
                refused, delay = True, REPAIR_PAUSE_MAX_S
            except Exception as e:
                state.last_error = _said(e)
                late = time.monotonic() - started > 60.0
                if isinstance(e, PermissionDenied) or ": UNAUTHENTICATED:" in str(e):
                    # The peer answered and refused this daemon (another
                    # peer token, say): said at WARNING at once, as
                    # "refused", which points at the token, not the network;
                    # it lasts until an operator changes a token file, so it
                    # is tried again at a pace doubling to 30 s, not every
                    # second (measured: 63 INFO lines a minute otherwise).
                    log.log(logging.INFO if warned else logging.WARNING,
                            "%s: warm_peers %s/%s refused (%s); next try in %.0f s", w.label, address, engine_id,
                            e, delay)
                    warned, late = True, True
                else:
                    # A peer starting after this daemon is expected for a
                    # while (an engine's start-up); still unreached after a
                    # minute, it may be a typo: said once at WARNING.
                    log.log(logging.WARNING if late and not warned else logging.INFO,
                            "%s: warm_peers %s/%s not reached (%s); next try in %.0f s", w.label, address,
                            engine_id, e, delay)
                    warned = warned or late
                grow = late
            await asyncio.sleep(delay)
            if grow:
                delay = min(REPAIR_PAUSE_MAX_S, 2 * delay)
        return None

    def _unpaired(self, w: Worker, address: str, engine_id: str, tp_size: int) -> list[int]:
        """The ranks of remote engine ``engine_id`` (TP size ``tp_size``) at
        ``address`` that ``w`` reads from or notifies and has no pair with
        (none for a TP size out of ``1..BOUNDS.max_tp_size``: never planned)."""
        if not 1 <= tp_size <= BOUNDS.max_tp_size:
            return []
        return [r for r in _paired_ranks(w, tp_size) if (address, engine_id, r) not in w.pairs.remotes]

    async def close(self) -> None:
        """Stops handshakes and list preparations under way (at shutdown)."""
        tasks = [*self._warming, *self._handshakes.values(), *self._preparing]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def retire(self, w: Worker, remote: RemoteWorker, why: str, again: bool = True) -> None:
        """Stops using a remote agent; its NIXL state is freed once no load
        uses it. ``again``: handshake with that peer again in the background
        (the peer may have restarted with new agents: the new handshake is
        under way before the next load needs it); else the next load does."""
        if w.pairs.remotes.get(remote.key) is remote:
            del w.pairs.remotes[remote.key]
            w.pairs.retired.append(remote)
            log.info("%s: dropped remote agent %s at %s (%s)%s", w.label, remote.agent_name, remote.address, why,
                     "; handshaking again in the background" if again else "")
            if again:
                self.warm(w, remote.address, remote.engine_id, remote.tp_size)
            warm = w.pairs.warm_peer(remote.address, remote.engine_id)
            if warm is not None:
                warm.dropped.set()  # _keep_warm pairs it again

    def _load_agent(self, w: Worker, name: str, metadata: bytes, introducer: PeerKey,
                    phases: dict[str, float] | None = None) -> str:
        """NIXL thread: loads a peer's agent into ``w``'s agent once; counts its users.

        Several remotes may be one NIXL agent (the same peer under two
        addresses, a push reader that is also a source, or a peer description
        replayed by someone else), and NIXL keeps one entry per name: the
        entry is shared and removed with its last user. Before, the second
        load failed and dropping either remote broke the other.

        ``introducer``: the peer whose description loads it first (its
        ``(address, engine_id, tp_rank)``; address ``""`` for a push reader),
        the one asked again when another peer describes another agent by that
        name (``kvd.core.agent_names``).

        ``phases`` (if given) gets the seconds NIXL's ``add_remote_agent`` and
        ``make_connection`` took, as ``add_remote`` and ``connect``.

        Raises:
            NixlError: the metadata is rejected, names another agent than
                ``name``, or differs from what is loaded under ``name``.
        """
        phases = {} if phases is None else phases
        embedded = metadata_agent_name(metadata)
        if embedded != name:
            raise NixlError(f"agent metadata names {clip(embedded, 256)!r}, the peer said {clip(name, 256)!r}")
        known = w.pairs.agents.get(name)
        if known is not None:
            if known[0] != metadata:
                raise NixlError(f"agent {name!r} is loaded already, with other metadata")
            w.pairs.agents[name] = (metadata, known[1] + 1, known[2])
            return name
        t0 = time.monotonic()
        loaded = w.agent.add_remote(metadata)
        phases["add_remote"] = time.monotonic() - t0
        if loaded != name:  # not NIXL 1.5's format after all: undo what is ours to undo
            if loaded not in w.pairs.agents:
                w.agent.remove_remote(loaded)
            raise NixlError(f"agent metadata loaded as {loaded!r}, the peer said {name!r}")
        w.pairs.agents[name] = (metadata, 1, introducer)
        t0 = time.monotonic()
        w.agent.connect(name)
        phases["connect"] = time.monotonic() - t0
        return name

    def _unload_agent(self, w: Worker, name: str) -> None:
        """NIXL thread: one user fewer of a peer agent; the last one removes it."""
        metadata, users, introducer = w.pairs.agents.pop(name, (b"", 1, ("", "", 0)))
        if users > 1:
            w.pairs.agents[name] = (metadata, users - 1, introducer)
        else:
            w.agent.remove_remote(name)

    def _read_users(self, w: Worker) -> set[int] | None:
        """The ids of the remotes of ``w`` a load has a READ through, or may
        post one through: in flight (``Worker.inflight``) or between its
        claim and its last post (``Worker.posting``: a post queued on the
        NIXL thread is not in ``inflight`` yet, and a poll queued behind it
        would otherwise free its remote under it). None when ``w``'s agent
        has a READ handle in ``Runtime.zombies`` (one given up at its
        deadline: it records no remote, so every retired remote counts as
        used). Copies of the loop's dicts (one C call each): callable from
        the NIXL thread."""
        if any(a is w.agent for a, _ in self.rt.zombies):
            return None
        users = {id(p) for load in list(w.inflight.values()) for _, p in load.parts}
        users.update(id(r) for through in list(w.posting.values()) for r in through)
        return users

    def retired_in_use(self, w: Worker, r: RemoteWorker) -> bool:
        """True while a READ may still go through retired remote ``r`` of
        ``w`` (:meth:`_read_users`). Until then ``r`` is not freed.

        Why: removing a peer's agent closes the UCX endpoint under the READ.
        NIXL 1.5 then reports the READ ``ERR`` while its UCX requests go on
        (``NixlAgent.remove_remote``), and the source's UCX (1.23, ``tcp``)
        still holds the answers it could not send: when that connection
        later failed (this worker's agent destroyed at its unregistration),
        the source daemon died with SIGSEGV purging them
        (``ucp_worker_discard_uct_ep`` -> ``uct_tcp_ep_pending_purge`` ->
        ``ucp_request_send_state_ff`` -> ``ucp_request_memory_dereg``, a core
        dump of a source daemon after a cut veth link, where the reader
        could not replace its agent because ``UCX_NET_DEVICES``' device was
        down)."""
        users = self._read_users(w)
        return users is None or id(r) in users

    def free_retired(self, w: Worker, r: RemoteWorker) -> bool:
        """NIXL thread: frees retired remote ``r`` of ``w`` if no READ may
        still go through it (looked at again here: a load may have posted
        since the caller looked). True once ``r`` is gone (freed now, or by
        :meth:`free_unused_retired` before: both run on this thread, no
        double free)."""
        if not any(o is r for o in w.pairs.retired):
            return True
        if self.retired_in_use(w, r):
            return False
        _remove_same(w.pairs.retired, r)
        self.free_remote(w, r)
        return True

    def free_unused_retired(self, w: Worker) -> None:
        """NIXL thread (the progress loop's poll): frees every retired remote
        of ``w`` that no READ can still go through (:meth:`retired_in_use`'s
        rule, looked up once for all of them)."""
        users = self._read_users(w) if w.pairs.retired else None
        if users is None:
            return
        for r in [r for r in w.pairs.retired if id(r) not in users]:
            _remove_same(w.pairs.retired, r)
            self.free_remote(w, r)

    def free_remote(self, w: Worker, r: RemoteWorker) -> None:
        """NIXL thread: releases a remote's prepped lists and forgets its agent."""
        r.freed = True
        lists = [r.remote_dlist] + ([r.local_dlist] if r.owns_local_dlist else [])
        for d in lists:
            try:
                w.agent.release_dlist(d)
            except Exception as e:
                log.debug("%s: release_dlist(%s): %s", w.label, r.agent_name, e)
        self._unload_agent(w, r.agent_name)

    async def notify_by_rpc(self, address: str, engine_id: str, tp_rank: int, request_id: str, expected: int,
                            deadline: float, label: str) -> None:
        """One reader's notification of ``request_id`` to a source rank, over
        PeerService.Notify instead of NIXL (no handshake needed: used when
        the pair was refused). Failures are logged, never raised: the source's
        lease bounds the hold."""
        try:
            if self.link is None:
                raise PeerUnavailable("this daemon has no peer client")
            await self.link.notify(address, engine_id, tp_rank, request_id, expected,
                                    max(0.1, deadline - time.monotonic()))
            self.rt.lines.info(("told to free", label), "%s: told %s engine=%s rank=%d to free %s (no transfer "
                               "possible)", label, address, engine_id, tp_rank, request_id)
        except Exception as e:
            self.rt.lines.warning(("not told to free", label), "%s: could not tell %s engine=%s rank=%d to free "
                                  "%s: %s", label, address, engine_id, tp_rank, request_id, e)

    async def remote(self, w: Worker, address: str, engine_id: str, tp_rank: int, tp_size: int,
                     deadline: float) -> tuple[RemoteWorker, bool]:
        """The remote worker, handshaking if needed; ``(remote, fresh)``.

        A handshake that fails as unreachable or slow (a transient
        ``PeerUnavailable``: the daemon's ``handshake_timeout_s``, a refused
        connection; not a peer failing its token proof) is tried
        once more when the request's own deadline leaves at least
        ``BOUNDS.retry_handshake_min_s`` seconds, unless the daemon is draining: a
        peer starved for a moment (seen on a loaded 2-core machine, the first
        handshake of a fresh pair taking > 10 s and the next 0.3 s) must not
        fail a load that still has most of its deadline. Other errors
        (incompatible, not found, invalid) are final.

        Raises:
            PeerUnavailable, Incompatible, NotFound, InvalidArgument.
        """
        try:
            return await self._remote_once(w, address, engine_id, tp_rank, tp_size, deadline)
        except PeerUnavailable as e:
            if not e.transient or self.rt.draining or deadline - time.monotonic() < BOUNDS.retry_handshake_min_s:
                raise
            self.rt.lines.warning(("handshake retried", w.key), "%s: handshake with %s engine=%s rank=%d failed "
                                  "(%s); trying once more within the request's deadline (%.1f s left)", w.label,
                                  address, engine_id, tp_rank, e, deadline - time.monotonic())
        return await self._remote_once(w, address, engine_id, tp_rank, tp_size, deadline)

    async def remotes(self, w: Worker, address: str, engine_id: str, ranks: list[int], tp_size: int,
                      deadline: float) -> tuple[dict[int, RemoteWorker], bool]:
        """The remote workers of ``ranks`` (``{rank: remote}``) and whether
        any is fresh, handshaking with them in parallel; every other rank of
        the remote engine is handshaken in the background too (:meth:`warm`),
        so that the next load needing it finds it ready. Before, ranks were
        handshaken one after the other on the first load's path (a TP 2
        prefill engine on a busy 2-core machine: 52 s, then 8 s).

        Raises:
            as :meth:`remote`: the first rank's error, in ``ranks`` order.
        """
        cached = [w.pairs.remotes.get((address, engine_id, p)) for p in ranks]
        if all(r is not None and r.tp_size == tp_size for r in cached):
            # Every pair made already (the steady state): no task per rank.
            now = time.monotonic()
            for r in cached:
                r.last_used = now
            return dict(zip(ranks, cached)), False
        for p in ranks:  # this load's own handshakes first: warm() makes the others, ahead of need
            key = (address, engine_id, p)
            if key not in w.pairs.remotes and address and ":" in address:
                self._handshake_task(w, key, tp_size)
        self.warm(w, address, engine_id, tp_size)
        got = await asyncio.gather(*(self.remote(w, address, engine_id, p, tp_size, deadline) for p in ranks),
                                   return_exceptions=True)
        for g in got:
            if isinstance(g, BaseException):
                # A copy: a failed handshake's exception is one object shared
                # by every load that waited on it, and raising it again put
                # this load's frames ahead of the last raiser's on its
                # traceback, so it held the frames, requests and closures of
                # every load that failed on it, freed only by a full
                # collection (a flood of loads from a refused address: ~40
                # objects a load in cyclic garbage, 1.49M collected in 12 s;
                # measured with a collector probe in the daemon).
                raise _own_copy(g) from None
        return {p: r for p, (r, _) in zip(ranks, got)}, any(fresh for _, fresh in got)

    def warm(self, w: Worker, address: str, engine_id: str, tp_size: int) -> list[asyncio.Future]:
        """Starts a background handshake of every local worker of ``w``'s
        engine with each rank of remote engine ``engine_id`` (TP size
        ``tp_size``) at ``address`` that it will read from or notify
        (``plan.source_ranks``) and has none with yet: each TP rank of a
        vLLM engine loads the same request on its own, a moment apart. A
        failure is logged; the next load that needs the pair tries again
        (and :meth:`_keep_warm`, for a ``warm_peers`` engine). Returns the
        handshakes of ``w``'s own pairs now under way (started here or
        before)."""
        running: list[asyncio.Future] = []
        if self.link is None or self.rt.closing or not 1 <= tp_size <= BOUNDS.max_tp_size:
            return running
        for lw in [x for x in self.rt.workers.values() if x.key[0] == w.key[0]]:
            for rank in _paired_ranks(lw, tp_size):
                key = (address, engine_id, rank)
                if key in lw.pairs.remotes:
                    continue
                fut = self._handshakes.get((lw.key, key))
                if fut is None:
                    full = self._no_room(lw, ahead=True)
                    if full:  # optional: the load that needs the pair makes it
                        self._ahead_skipped.warning("%s: no handshake ahead of need with %s engine=%s rank=%d: %s",
                                                    lw.label, *key, full)
                        continue
                    fut = self._handshake_task(lw, key, tp_size, ahead=True)
                    fut.add_done_callback(functools.partial(self._ahead_failed, lw, key))
                if lw is w:
                    running.append(fut)
        return running

    def _ahead_failed(self, w: Worker, key: PeerKey, fut: asyncio.Future) -> None:
        """Done callback of a handshake ahead of need: a failure is logged at
        most once a second per worker, with the count, its engine id
        clipped. Each load naming a new engine id of a dead address starts
        one (an engine of TP 2 wrote 38,800 lines, 18.7 MB, in 15 s:
        attacker review); the load that needs the pair reports its own."""
        if fut.cancelled() or fut.exception() is None:
            return
        address, engine_id, rank = key
        self.rt.lines.info(("ahead failed", w.key), "%s: handshake ahead of need with %s engine=%s rank=%d failed: %s",
                           w.label, clip(address, 256), clip(engine_id, 256), rank, fut.exception())

    def _no_room(self, w: Worker, ahead: bool) -> str | None:
        """Why no handshake of ``w`` may start now, or None: ``max_handshakes``
        in flight, or ``max_handshakes_per_uid`` of its owner's workers;
        handshakes ahead of need (:meth:`warm`) only up to half of each, so
        that the loads' own find room (a decode engine of TP 8 meeting 16
        prefill engines of TP 8 at once warms 1,024 pairs)."""
        uid, lim, n = owner_uid(w), self.rt.limits, self._counts
        cap, cap_uid = (lim.max_handshakes // 2, lim.max_handshakes_per_uid // 2) if ahead else (
            lim.max_handshakes, lim.max_handshakes_per_uid)
        if not n.full(uid, cap, cap_uid):
            return None
        return (f"{n.total} handshakes in flight ({n.of(uid)} of uid {uid}'s workers): max_handshakes "
                f"{lim.max_handshakes}, max_handshakes_per_uid {lim.max_handshakes_per_uid}"
                + (" (half of each for handshakes ahead of need)" if ahead else ""))

    def _handshake_task(self, w: Worker, key: PeerKey, tp_size: int, ahead: bool = False) -> asyncio.Future:
        """The handshake of ``w`` with remote worker ``key``: the one running,
        or a new one (``ahead``: no load is waiting for it, :meth:`warm`)."""
        fkey = (w.key, key)
        fut = self._handshakes.get(fkey)
        if fut is None:
            # At most max_handshakes (per owner uid: _per_uid) in flight: each
            # may run to handshake_timeout_s after its load ended, and an
            # engine names how many remote ranks a load needs.
            full = self._no_room(w, ahead)
            if full:
                fut = asyncio.get_running_loop().create_future()
                fut.set_exception(PeerUnavailable(full))
                fut.add_done_callback(lambda f: f.exception())  # retrieved: its waiters report it
                return fut
            # One handshake per remote worker, shared by every request that
            # needs it. It runs to the daemon's handshake timeout; each request
            # waits for it only until its own deadline (a request
            # that joined another's handshake once ended seconds late).
            fut = asyncio.get_running_loop().create_task(self._do_handshake(w, key, tp_size, ahead))
            self._handshakes[fkey] = fut
            uncount = self._counts.add(owner_uid(w))

            def done(f: asyncio.Future) -> None:
                self._handshakes.pop(fkey, None)
                uncount()
                if not f.cancelled():
                    f.exception()  # retrieved: its waiters report it, asyncio need not log it

            fut.add_done_callback(done)
        return fut

    async def _remote_once(self, w: Worker, address: str, engine_id: str, tp_rank: int, tp_size: int,
                           deadline: float) -> tuple[RemoteWorker, bool]:
        """The remote worker, handshaking if needed (one try); ``(remote, fresh)``."""
        key = (address, engine_id, tp_rank)
        r, fresh = w.pairs.remotes.get(key), False
        if r is None:
            fut = self._handshake_task(w, key, tp_size)
            late = False
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    r = await asyncio.shield(fut)
            except TimeoutError:
                late = True
            finally:
                # The handshake's exception, which the task holds, has this
                # frame on its traceback: holding the task here made a cycle
                # (with the failed call's grpc channel on the exception's
                # context) that only a full collection freed.
                del fut
            if late:
                # Raised here, not in the except: there it would hold the
                # TimeoutError as its context, whose traceback holds asyncio's
                # Timeout, which holds the task that keeps this error (a
                # cycle; ~17 objects a load past its deadline).
                raise PeerUnavailable(f"{address}: no handshake answer by the request's deadline")
            fresh = True
        if r.tp_size != tp_size:  # a cached remote, or a handshake another request started
            raise Incompatible(f"remote engine {engine_id!r} has TP size {r.tp_size}, the request says {tp_size}")
        r.last_used = time.monotonic()
        return r, fresh

    async def _do_handshake(self, w: Worker, key: PeerKey, tp_size: int, ahead: bool = False) -> RemoteWorker:
        address, engine_id, tp_rank = key
        PEER_CALLER.set(owner_uid(w))  # its own task: first contacts are budgeted per uid
        if self.link is None:
            raise PeerUnavailable("this daemon has no peer client")
        if not address or ":" not in address:
            raise InvalidArgument(f"remote address {address!r} is not host:port")
        timeout = self.rt.limits.handshake_timeout_s
        t0 = time.monotonic()
        hs = await self.link.handshake(address, engine_id, tp_rank, w.compat_hash, timeout)
        t_rpc = time.monotonic() - t0
        if hs.tp_size != tp_size:
            raise Incompatible(f"remote engine {engine_id!r} has TP size {hs.tp_size}, the request says {tp_size}")
        check_peer(w, hs, f"{clip(address, 256)} answered")  # the caller says "handshake: "
        await agent_names.settle(self, w, key, hs)
        # An agent of the same name still loaded (a retired one, or the peer's
        # old identity) is forgotten first: NIXL keeps one entry per name.
        # Not while a READ may still go through it (retired_in_use).
        t_old = time.monotonic()
        for old in [o for o in w.pairs.retired if o.agent_name == hs.agent_name]:
            while self.retired_in_use(w, old) or not await self.rt.nixl(self.free_retired, w, old):
                if time.monotonic() - t0 > timeout:
                    raise PeerUnavailable(
                        f"{address}: a READ from agent {hs.agent_name} through its previous connection is still in "
                        f"progress after {timeout:.0f} s (handshake_timeout_s; a stalled network?): that agent is "
                        "loaded again once it ends", transient=True)
                await asyncio.sleep(RETIRED_POLL_S)
        phases: dict[str, float] = {}
        if time.monotonic() - t_old > 0.001:  # named only when it took time: a first contact after a cut READ
            phases["old_read_wait"] = time.monotonic() - t_old
        try:
            r = await self.pair(w, hs, tp_rank, we_read=True, address=address, engine_id=engine_id,
                                phases=phases, prep_delay_s=0.0 if ahead else PREP_DELAY_S)
        except NixlError as e:
            raise InvalidArgument(f"agent metadata rejected: {e}") from None
        if not self.rt.registered(w):
            raise NotFound("local worker unregistered during the handshake")
        w.pairs.remotes[key] = r
        if self.mirror is not None:
            self.mirror.follow(address, engine_id)  # its loads then READ without a claim each
        self.rt.counters.handshakes += 1
        self.rt.on_event("handshake", {"seconds": time.monotonic() - t0})
        # Where the time went (ms): the peer's answer, the wait for an old
        # READ through a retired agent of that name, the plan, the wait for
        # the NIXL thread, NIXL's add_remote_agent, make_connection and the
        # check of the peer's rows: a slow first contact names its phase in
        # the log (the rest is waiting for the event loop).
        phases["rpc"] = t_rpc
        spent = " ".join(f"{k} {1e3 * v:.1f}" for k, v in phases.items())
        log.info("%s: handshake with %s engine=%s rank=%d/%d agent=%s (kvd %s) in %.1f ms (%s): %d chunk(s) x "
                 "%d slot(s)%s", w.label, clip(address, 256), clip(engine_id, 256), tp_rank, hs.tp_size,
                 clip(r.agent_name, 256), clip(hs.daemon_version, 64),
                 1e3 * (time.monotonic() - t0), spent, r.C, r.k,
                 ", lists prepared in the background" if r.prepare_later else ", rows per transfer")
        return r

    async def pair(self, w: Worker, hs: HandshakeResult, peer_rank: int, *, we_read: bool, address: str,
                    engine_id: str, phases: dict[str, float] | None = None,
                    prep_delay_s: float = PREP_DELAY_S) -> RemoteWorker:
        """Loads a peer worker's agent into ``w``'s and prepares both
        descriptor lists of the pair's transfer plan (``kvd.core.plan``).

        ``we_read``: ``w`` is the reader (pull: it READs from the peer);
        otherwise ``w`` is the source (push: it WRITEs into the peer). The
        returned RemoteWorker's ``local_dlist`` is always ``w``'s side (its
        own prepped list when the plan is the identity on its side) and
        ``remote_dlist`` the peer's. Units: bytes in ``region_bytes``.
        ``prep_delay_s``: seconds until the lists are prepared (0 for a
        handshake ahead of need: no load is about to post on the NIXL thread).

        Raises:
            Incompatible: the layouts cannot be combined.
            NixlError: NIXL refused the agent metadata or a list (the agent is
                unloaded again), or it names one of this daemon's own agents.
        """
        phases = {} if phases is None else phases
        agent_names.refuse_own(self.rt, hs, address or "a push reader")
        t0 = time.monotonic()
        if self.vet is not None:
            known, problem = self.vet.remembered(hs.agent_metadata)
            if not known:
                vetting = asyncio.get_running_loop().run_in_executor(self.vet.executor, self.vet.problem,
                                                                      hs.agent_metadata)
                try:
                    problem = await asyncio.wait_for(vetting, self.rt.limits.handshake_timeout_s)
                except TimeoutError:
                    problem = (f"not vetted within {self.rt.limits.handshake_timeout_s:.0f} s (the vetting "
                               "process is busy with other peers' metadata)")
            phases["vet"] = time.monotonic() - t0
            if problem is not None:
                self.rt.lines.warning(("metadata vet",), "%s: agent metadata of %s (engine=%s rank=%d) refused: %s",
                                      w.label, address or "a push reader", clip(engine_id, 200), peer_rank, problem)
                raise NixlError(f"peer agent metadata refused: {problem}")
            t0 = time.monotonic()
        ours = w.geometry()
        theirs = plan.Geometry(peer_rank, hs.tp_size, hs.layout, tuple(hs.regions),
                               hs.layout.model_kv_heads(hs.tp_size))
        reader, source = (ours, theirs) if we_read else (theirs, ours)
        k, C, chunk_sets, reader_identity, source_identity = pair_plan(reader, source)
        our_map_of, their_map_of = (plan.local_map, plan.remote_map) if we_read else (plan.remote_map,
                                                                                       plan.local_map)
        identity = reader_identity if we_read else source_identity
        our_map = our_map_of(w.mem.bases, w.regions, w.layout.num_blocks, chunk_sets, k, w.mem.device)
        their_map = their_map_of(hs.region_bases, hs.regions, hs.layout.num_blocks, chunk_sets, k, hs.device)
        phases["plan"] = time.monotonic() - t0
        queued = time.monotonic()

        def add():
            phases["nixl_wait"] = time.monotonic() - queued
            name = self._load_agent(w, hs.agent_name, hs.agent_metadata, (address, engine_id, peer_rank),
                                    phases)
            # A description that names memory the peer's agent never
            # registered (a mangled relay, a lying peer) is refused here, as a
            # prepared list of the whole map would be: NIXL checks each row
            # against the remote registrations; the edges bound every row.
            t_check = time.monotonic()
            try:
                w.agent.release_dlist(w.agent.prep_remote(name, their_map.edges(), hs.memory))
            except Exception:
                self._unload_agent(w, name)
                raise
            phases["check"] = time.monotonic() - t_check
            if we_read and hs.warm_up_addr and hs.read_transport not in self.no_warm_up_from:
                self._warm_read(w, name, hs.warm_up_addr)
            return name

        if we_read:
            async with self._wiring:
                await self._wire_ups_ended(w, phases)
                queued = time.monotonic()  # nixl_wait: behind other NIXL calls, after the wire-up wait
                name = await self.rt.nixl(add)
        else:
            name = await self.rt.nixl(add)
        src_bytes = tuple(int(c[:C, 3].sum()) for c in chunk_sets)
        # Transfers make their own rows until the lists are prepared: the
        # first load never waits for the whole cache's lists.
        r = RemoteWorker(address, engine_id, peer_rank, hs.tp_size, name, hs.layout, len(hs.regions), k, C,
                         lists=(Unprepped(our_map.rows, w.mem.memory), Unprepped(their_map.rows, hs.memory, name)),
                         owns_local_dlist=False, daemon_version=hs.daemon_version, region_bytes=src_bytes,
                         region_groups=tuple(x.group for x in w.regions), last_used=time.monotonic(),
                         read_transport=hs.read_transport)
        # Prepared lists cost time per row of both caches (29k rows: 10 ms
        # idle, 0.1-1.1 s with both cores busy, GIL held), so they are made
        # off the request's path, PREP_DELAY_S after the handshake; past
        # BOUNDS.max_prepped_rows never (docs/PERFORMANCE.md, "First contact").
        if len(their_map) + (0 if identity else len(our_map)) <= BOUNDS.max_prepped_rows:
            r.prepare_later = True
            self._prepare_later(w, r, our_map, their_map, identity, hs.memory, prep_delay_s)
        return r

    async def _wire_ups_ended(self, w: Worker, phases: dict[str, float]) -> None:
        """Waits until no warm-up READ of this daemon is in flight, at most
        ``WIRE_UP_WAIT_S`` (``phases["wire_up_wait"]``: seconds waited). The
        warm-ups are released by the progress loop's polls; it is kicked so
        that one that ended is seen at once."""
        t0 = time.monotonic()
        deadline = t0 + WIRE_UP_WAIT_S
        while self.rt.warm_ups and time.monotonic() < deadline:
            self.rt.kick.set()
            await asyncio.sleep(0.002)
        phases["wire_up_wait"] = time.monotonic() - t0
        if self.rt.warm_ups:
            log.info("%s: a warm-up READ still in flight after %.0f s; wiring up the next pair anyway", w.label,
                     WIRE_UP_WAIT_S)

    def _warm_read(self, w: Worker, name: str, addr: int) -> None:
        """NIXL thread: the pair's first READ, of the peer agent's scratch
        page at ``addr`` (the handshake's ``warm_up_addr``: daemon memory,
        no engine's data) into ``w``'s agent's own
        (:meth:`NixlAgent.warm_read`), now rather than in a request's: UCX
        wires up the pair's lanes here, so a load after a handshake ahead of
        need (``Limits.warm_peers``, the other ranks of a remote engine) does
        not pay it. Measured (``benchmarks/first_contact.py --warm-peers``,
        idle, 2 cores, a variant reading a page of the peer's first block):
        the first load 6.5-8.2 ms over the steady one without a warm-up
        READ, 1.2-4.4 ms with one (docs/PERFORMANCE.md, "First contact").
        No READ of an engine's memory without a claim: the scratch pages
        are the daemons' own. DRAM workers only (a VRAM worker has no
        scratch page). The handle is given up at ``handshake_timeout_s``
        (``Runtime.warm_ups``); a failure is logged: the request's READ
        wires the pair up anyway."""
        if not w.agent.scratch_addr:  # a VRAM worker's agent has none
            return
        try:
            handle, state = w.agent.warm_read(name, addr)
        except NixlError as e:
            log.info("%s: warm-up READ from %s failed (%s); the first load wires the pair up", w.label, name, e)
            return
        self.rt.warm_up_posted(w.agent, handle, state)

    def _prepare_later(self, w: Worker, r: RemoteWorker, our_map, their_map, identity: bool, memory: str,
                       delay_s: float = PREP_DELAY_S) -> None:
        """Prepares ``r``'s two descriptor lists on the NIXL thread,
        ``delay_s`` seconds from now (``PREP_DELAY_S`` after a load's own
        handshake: that load usually posts within it and is not queued
        behind the preparation; 0 ahead of need, so that a first request
        soon after, e.g. 1-2 s after the engines registered, finds the
        NIXL thread free),
        and swaps them in. Nothing happens if ``r`` or ``w`` is gone by then;
        a NIXL error is logged and the pair keeps making rows per transfer."""

        def prepare() -> None:  # NIXL thread, serial with free_remote
            if r.freed or not self.rt.registered(w):
                return
            t0 = time.monotonic()
            theirs = w.agent.prep_remote(r.agent_name, their_map.all(), memory)
            try:
                ours = w.mem.local_dlist if identity else w.agent.prep_local(our_map.all(), w.mem.memory)
            except Exception:
                w.agent.release_dlist(theirs)
                raise
            r.owns_local_dlist = not identity
            r.lists = (ours, theirs)
            log.debug("%s: lists of %s prepared in %.1f ms (%d rows)", w.label, r.agent_name,
                      1e3 * (time.monotonic() - t0), len(their_map) + (0 if identity else len(our_map)))

        async def run() -> None:
            try:
                await asyncio.sleep(delay_s)
                await self.rt.nixl(prepare)
            except Exception as e:
                log.info("%s: preparing the lists of %s failed (%s); transfers keep making their rows",
                         w.label, r.agent_name, e)
            finally:
                r.prepare_later = False  # done, failed, or the pair is gone: nothing pending (stats)

        task = asyncio.get_running_loop().create_task(run())
        self._preparing.add(task)
        task.add_done_callback(self._preparing.discard)

    # ------------------------------------------------------------- peer side
    async def handshake_info(self, engine_id: str, tp_rank: int, caller_hash: str,
                             protocol_version: int = PROTOCOL_VERSION) -> HandshakeResult:
        """Answers a remote daemon's handshake for our worker.

        Raises:
            NotFound: no such worker here.
            Incompatible: other protocol version, or ``caller_hash`` differs
                from the worker's hash (the message names both).
        """
        w = self.rt.worker(engine_id, tp_rank)
        if protocol_version != PROTOCOL_VERSION:
            raise Incompatible(f"protocol version mismatch: caller speaks {protocol_version}, "
                               f"this daemon {PROTOCOL_VERSION} (kvd {__version__})")
        if caller_hash and caller_hash != w.compat_hash:
            raise Incompatible(
                f"compatibility hash mismatch for engine {engine_id!r} rank {tp_rank}: "
                f"caller {clip(caller_hash, 80)}, this worker {w.compat_hash}"
            )
        return await self.describe(w)

    async def describe(self, w: Worker) -> HandshakeResult:
        """``w`` as a handshake describes it (agent metadata, layout, regions).
        Needs no NIXL call (the metadata is the agent's cached bytes). Marks
        the agent :attr:`~kvd.core.nixl_agent.NixlAgent.described`: a peer
        may move bytes through it from here on."""
        a = w.agent  # one read: the NIXL thread may replace it meanwhile (Registry.replace_agent)
        a.described = True
        return HandshakeResult(a.metadata(), a.name, w.layout, w.regions, w.mem.bases, w.compat_hash, __version__,
                               PROTOCOL_VERSION, w.tp_size, memory=w.mem.memory, device=w.mem.device,
                               warm_up_addr=a.scratch_addr, read_transport=self.read_transport)

    # --------------------------------------------------------------- progress
