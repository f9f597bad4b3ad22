"""Every bound and deadline of the daemon, in one place.

- :class:`Limits`: what an operator may set (``kvd serve`` flags, the TOML
  config); one instance per daemon, handed to ``Node``.
- :data:`BOUNDS` (a frozen :class:`Bounds`): what the protocol fixes; the
  core, the gRPC adapters and the lease table import it, nothing redefines
  a number of it.

Units: seconds, bytes, counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.requests import MAX_ID_BYTES, MAX_RENEWALS_PER_CALL


@dataclass
class Limits:
    """Per-daemon bounds and deadlines (units: seconds, counts)."""

    lease_s: float = 120.0           # default lease of held prefill blocks (vLLM's abort timeout is 480 s)
    max_lease_s: float = 3600.0
    # Longest life of a renewed lease, from its hold (readers renew while
    # their request waits; vLLM's NIXL abort timeout is 480 s); never past
    # max_lease_s.
    max_lease_life_s: float = 600.0
    transfer_timeout_s: float = 30.0  # a load not done by then fails
    max_transfer_timeout_s: float = 3600.0  # cap on a request's own timeout_s (inf or 1e300 would never end)
    handshake_timeout_s: float = 10.0
    early_notif_s: float = 120.0     # a notification that beat its hold is kept this long
    max_blocks_per_request: int = 1 << 20
    max_inflight_per_worker: int = 4096
    # Block ids (local and remote) of the loads in flight, per worker and per
    # owner uid (kvd.core.load_ids): a load keeps its ids, ~40 bytes each,
    # while it waits, and max_inflight_per_worker counts loads (attacker
    # review: one session, +4.5 GiB in ~20 s). Per worker: two loads of
    # max_blocks_per_request on each side.
    max_load_block_ids_per_worker: int = 1 << 22
    max_load_block_ids_per_uid: int = 1 << 24
    max_leases_per_worker: int = 65536  # prefill leases held at once (each keeps its request id and blocks)
    # Block ids held by one worker's leases, all together (4 bytes each; a
    # block shared by several requests' prefixes counts once per hold).
    max_held_blocks_per_worker: int = 1 << 22
    poll_busy_s: float = 0.0005      # poll interval while transfers are in flight
    poll_idle_s: float = 0.005       # otherwise (notifications, leases)
    # "pull": decode READs; "push": prefill WRITEs on request; "auto": per
    # load, push where a READ would be TCP's (kvd.core.transfer_mode).
    transfer_mode: str = "auto"
    # Serve PeerService.Push (source side); False refuses every one.
    serve_pushes: bool = True
    same_node_copy: bool = True      # a load from an engine of this daemon is a memmove (kvd.core.local_copy)
    copy_threads: int = 0            # threads of a same-node DRAM copy; 0: kvd.core.local_copy.copy_threads picks
    # Follow the holds of remote engines this daemon pairs with
    # (PeerService.Holds, kvd.core.hold_mirror): a load of blocks shown held
    # READs without a per-load claim.
    follow_holds: bool = True
    # Load each new peer's agent metadata in a throwaway process first
    # (kvd.core.metadata_vet); the server sets it where peers may be of
    # other hosts (a token, mTLS or peer_insecure) and the setting allows.
    vet_peer_metadata: bool = False
    detach_grace_s: float = 10.0     # an engine whose session is gone this long is unregistered
    # Remote engines handshaken ahead of need: (peer address, engine id)
    # pairs (the ``warm_peers`` setting, kvd/config.py).
    warm_peers: tuple[tuple[str, str], ...] = ()
    max_queued_event_bytes: int = 64 << 20  # events queued for one worker's session (kvd.core.events.event_bytes)
    # What the engines may make the daemon hold (each worker is a NIXL agent
    # with its thread and ~15 fds; measured: 100 registrations took fds from
    # 22 to 1530 and RSS from 81 to 578 MiB). A real node: 8 GPUs x a few
    # engines x their TP ranks. Per uid: the caller's kernel uid (the gate).
    max_workers: int = 64
    max_workers_per_uid: int = 32
    max_descriptors: int = 1 << 28          # registered block descriptors (regions x blocks), all workers
    max_descriptors_per_uid: int = 1 << 27
    # Host memory (shm, memfd) registered per uid (bytes; 0: this host's
    # physical memory). Sparse sealed memfds cost the daemon address space
    # only, and one uid mapped ~128 TiB of them in 10 s (attacker review);
    # a transport that pins registered memory would make that real memory.
    max_host_bytes_per_uid: int = 0
    # VRAM the daemon allocates as staging mirrors of one uid's CUDA
    # registrations, on all its GPUs (bytes; 0: no cap of kvd's, each GPU's
    # memory bounds it). A caller with X bytes on a GPU has the daemon
    # allocate X more there per registration (attacker review).
    max_device_bytes_per_uid: int = 0
    # Handshakes in flight (each may wait handshake_timeout_s, and goes on
    # after the load that started it failed): one per local worker and
    # remote rank, so an engine that names a remote TP size of 256 starts
    # 256 a load (attacker review: 20 loads, 5,120 in flight, +230 MiB).
    # Handshakes ahead of need (Peers.warm) take at most half of each.
    max_handshakes: int = 4096
    max_handshakes_per_uid: int = 1024     # of the local workers of one owner uid
    max_aborts: int = 1024                  # AbortLoads in flight (each may wait a handshake timeout)
    max_aborts_per_uid: int = 256
    # Remote workers' liveness (kvd.core.liveness.Liveness.check): each remote is
    # asked (a handshake) every peer_check_s; one whose daemon has not
    # answered for peer_dead_s, whose engine is gone, or no load has used for
    # peer_idle_s is released (its peer agent and descriptor lists); the next
    # load handshakes again. A dead peer's state goes within about
    # peer_dead_s + peer_check_s. A push-mode reader no push has used for
    # peer_idle_s is released too (kvd.core.push), at the same checks.
    peer_check_s: float = 15.0
    peer_dead_s: float = 45.0
    peer_idle_s: float = 600.0


@dataclass(frozen=True)
class Bounds:
    """Bounds the protocol fixes (not settable; units: bytes, counts, seconds)."""

    # Longest request id, engine id or address accepted in a command or peer
    # call (leases and early notifications keep them: a cap on their count
    # alone would not bound memory).
    max_id_bytes: int = MAX_ID_BYTES
    # Longest engine id a worker registers with (characters).
    max_engine_id_chars: int = 256
    # Largest TP size accepted from an engine or a peer. Transfer plans loop
    # over ranks: a LoadBlocks with remote_tp_size 2**32-1 once made the
    # daemon build a list of ranks until the OOM killer stopped it.
    max_tp_size: int = 256
    # What one worker may register (docs/DESIGN.md: messages are bounded):
    # regions (and segments), blocks per region, descriptors in all.
    max_regions: int = 4096
    max_blocks: int = 1 << 24
    max_descriptors: int = 1 << 26
    # GPU ordinals accepted in a peer's description.
    max_device: int = 1 << 16
    # Leases one RenewLeases call may name (the shim sends more in several calls).
    max_renewals_per_call: int = MAX_RENEWALS_PER_CALL
    # Readers one source rank may wait for, per request (a notification's count).
    max_notifications: int = 1 << 16
    # Notifications kept for requests not held yet (early notifications), all
    # of a daemon's workers together (kvd.core.leases.EarlyBudget); a worker
    # alone keeps as many. Each keeps its request id: up to ~82 MiB with
    # 1,000-byte ids. Per worker only, an admitted peer's flood grew with the
    # workers registered (attacker review: 4 workers, +327 MiB for 120 s).
    max_early_notifications: int = 1 << 16
    # Loads one coalesced READ carries at most, and pieces one NIXL
    # notification may hold (kvd.core.pull: small READs of one worker from
    # one source rank, posted in the same pass of the loop, go out as one
    # transfer with one notification). NIXL's cost is per transfer, not per
    # descriptor: 64 one-block READs of 4 KiB cost ~40 + 22 us of CPU a load
    # (reader + source) as 64 transfers, ~3 + 1 as one (two plain NIXL
    # processes, `python -m benchmarks.native_floor`'s coalesced case).
    max_loads_per_read: int = 64
    # Agent metadata accepted from a peer (NIXL metadata is a few KiB per backend).
    max_agent_metadata: int = 1 << 20
    # Events queued for a worker: past it, one whose session is not attached
    # (a reconnecting shim) drops its oldest; an open session is ended
    # (Runtime.emit), so no engine waits for an event silently dropped.
    max_pending_events: int = 100_000
    # A session stream's first command (OpenSession) must come within this (seconds).
    open_session_timeout_s: float = 30.0
    # gRPC channels to remote daemons kept open (least recently used closed first).
    max_peer_channels: int = 256
    # Push-mode readers one source worker keeps paired (kvd.core.push; each
    # a peer agent loaded into its agent, a UCX endpoint: ~1 fd, and the
    # pair's lists): past it the least recently used one no push is using
    # is released (it pairs again on its next push, a first contact's cost),
    # and with every one in use a push to a new reader is refused. A
    # prefill worker is pushed to by the decode workers of its cluster that
    # read its rank: tens to a few hundred; 512 leaves twice that. Not a
    # setting: a larger cluster only pays more pairings. 64 workers x 512 is
    # 32,768 fds, under the systemd unit's LimitNOFILE (65,536); one worker's
    # 512 under the 1,024 of a shell's default (an unbounded number once
    # took every fd there, and every peer call was refused).
    max_push_readers: int = 512
    # After posting a transfer that is not done at once, the NIXL thread checks
    # it again for this long before leaving it to the progress loop (seconds;
    # docs/PERFORMANCE.md, "fast path"). A READ posted on the loop is not
    # checked again ("sixth round": with many loads in flight the checks held
    # up the others and cost CPU, for no gain on a small load alone).
    post_spin_s: float = 0.0002
    # A READ that moves at most this many bytes is posted on the event loop
    # when the NIXL thread is idle (``Runtime.nixl_now``), saving two
    # thread hand-offs (~0.1-0.2 ms); a larger one goes to the NIXL thread,
    # because NIXL's ``transfer()`` moves shared-memory bytes inside the call
    # with the GIL released (benchmarks/gil_transfer.py: a 256 MiB READ's
    # post took 60-96 ms while another Python thread ran 60-84 % as often as
    # in a sleep), time the loop keeps serving on the thread path. 1 MiB is
    # ~0.25 ms of CMA here.
    inline_post_max_bytes: int = 1 << 20
    # READs posted on the loop in one pass of the loop move at most this many
    # bytes in all, each counted as at least ``inline_post_min_bytes`` (its
    # fixed cost); the next go to the NIXL thread: a stream of small loads
    # must not turn the loop, which serves every session and peer, into a
    # copy engine (8 MiB: ~2 ms of CMA here, or 512 small posts). Measured
    # with 64 one-block loads in flight: 2 MiB and 64 KiB sent most of them
    # through the NIXL thread, 4,240 loads/s against 5,030-5,100 with these
    # (docs/PERFORMANCE.md, "sixth round").
    inline_bytes_per_pass: int = 8 << 20
    inline_post_min_bytes: int = 16 << 10
    # A pair whose two descriptor lists have more rows than this in all has
    # none prepared: each transfer makes the rows of its own blocks
    # (NIXL initialize_xfer). Preparing costs time per row of the whole cache
    # on the first load's path (measured: 262,144 rows about 10 ms idle, the
    # 2M rows of a 65,536-block cache re-sliced per token 0.9 s); a transfer
    # of n descriptors costs about the same either way (docs/PERFORMANCE.md,
    # "First contact").
    max_prepped_rows: int = 1 << 18
    # Chunk rows one block of a pair's plan may need (kvd.core.plan): the
    # rows are made per pair on the event loop (~1.1 us each), so a layout
    # that makes millions (a block of 2**24 tokens against a layout of another
    # order: 76 s, attacker review) is refused. vLLM layouts make at most a
    # few thousand (a block's tokens x heads when the orders differ).
    max_chunk_rows: int = 1 << 16
    # A handshake that failed as unreachable is tried once more only when the
    # request's deadline leaves at least this long (seconds).
    retry_handshake_min_s: float = 2.0

    # A claim (PeerService.Claim) waits this long at most for a hold still on
    # its way from the prefill engine (seconds): the shim sends the hold on
    # its session while the proxy already forwards kv_transfer_params, so a
    # decode daemon's claim can arrive first.
    max_claim_wait_s: float = 5.0
    # Claims waiting for a hold at once on this daemon, and the block ids
    # they carry in all. A waiting claim keeps its ids as Python ints
    # (~50 bytes each with the request); unbounded, 48 claims of 1M ids for
    # a request never held took the daemon to 2.7 GB (attacker review).
    # Honest waits are a hold one engine step behind its reader's claim:
    # a few per reader in flight, each a request's blocks.
    max_waiting_claims: int = 1024
    max_waiting_claim_ids: int = 1 << 22

    @property
    def max_notif_bytes(self) -> int:
        """Longest piece of a notification accepted: a request id, ``:`` and
        the count (kvd.core.leases.notif_message; less than 65,536, the
        piece's 2-byte length)."""
        return self.max_id_bytes + 1 + len(str(self.max_notifications))


BOUNDS = Bounds()


class UidCounts:
    """Things in flight (abort notifications, handshakes), counted per uid
    and in all, for the ``max_*`` / ``max_*_per_uid`` pairs of
    :class:`Limits`: :meth:`add` counts one and returns what uncounts it."""

    def __init__(self) -> None:
        self._of: dict[int, int] = {}
        self.total = 0

    def of(self, uid: int) -> int:
        """In flight for ``uid`` now."""
        return self._of.get(uid, 0)

    def full(self, uid: int, cap: int, cap_uid: int) -> bool:
        """True when ``cap`` are in flight in all, or ``cap_uid`` for ``uid``."""
        return self.total >= cap or self._of.get(uid, 0) >= cap_uid

    def add(self, uid: int):
        """Counts one for ``uid``; returns ``done(*_)``, which uncounts it
        (once: a task's done callback)."""
        self._of[uid] = self._of.get(uid, 0) + 1
        self.total += 1

        def done(*_) -> None:
            self.total -= 1
            left = self._of[uid] - 1
            if left:
                self._of[uid] = left
            else:
                del self._of[uid]
        return done
