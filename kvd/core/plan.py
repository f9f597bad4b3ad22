"""Transfer plans: which bytes of which remote block land where locally.

A reader (the decode worker) and a source (a prefill worker) may differ in
tensor-parallel size, KV layout (HND/NHD) and block size. The plan for one
(reader, source) pair is a list of *chunks*: byte ranges inside one block of
one region, ``(slot, local_offset, remote_offset, length)``, where ``slot``
says which of the ``k = local block_size / remote block_size`` source blocks
fill one reader block. Every chunk row becomes one NIXL descriptor on each
side (``RowMap``). A request computes indices (``chunk_indices``); a pair
whose lists are small has them prepared once at handshake, a larger one
makes each transfer's rows from those indices (``kvd.core.peers``).

Rules, as the seed connector (vLLM NixlConnector) applies them:

- TP rank ``r`` of ``T`` ranks holds KV heads ``[r*H//T, r*H//T + max(1, H//T))``
  of ``H`` heads (heads are replicated when ``T > H``).
- A reader reads each of its heads from exactly one source rank holding it
  (spread over replicas by reader rank), and notifies every source rank whose
  heads overlap its own: a source frees its blocks only after all of its
  expected readers notified it (as the seed connector does).
- MLA: one latent per token, replicated on every rank: one head of the whole
  block; every reader reads one source and notifies all of them.
- Block size: the reader's must be a multiple of the source's
  (``k`` source blocks per reader block); the inverse is refused at handshake.
- Layouts: HND blocks are ``[heads, tokens, head_dim]``, NHD/MLA blocks
  ``[tokens, heads, head_dim]``; when they differ, chunks are single
  ``head_dim`` vectors, so the transfer itself performs the permute.
- K and V in one block (``Layout.kv_in_block``, vLLM-CPU: a block is
  ``[heads, 2, tokens, head_dim / 2]``, K rows then V rows of each head,
  ``vllm/v1/attention/backends/cpu_attn.py:411-415``): both sides must say so
  and be HND; the K run and the V run of each head are separate chunks, so
  source block ``j`` of ``k`` fills rows ``[j*bs, (j+1)*bs)`` of the reader's
  K rows and the same rows of its V rows. ``Layout.k_dim_major`` (vLLM-CPU's
  vec kernels store K transposed, ``[head_size, tokens]``): K moves as one
  run of ``bs`` tokens per dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from kvd.core.layout import Layout, LayoutError, Region
from kvd.core.limits import BOUNDS

DTYPE_BYTES = {
    "float32": 4, "float": 4, "fp32": 4,
    "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "uint8": 1, "int8": 1,
    "float64": 8,
}


class PlanError(LayoutError):
    """No correct transfer exists between the two layouts; the message says why."""


@dataclass(frozen=True)
class Geometry:
    """What the planner needs of one worker (units: tokens, heads, bytes)."""

    tp_rank: int
    tp_size: int
    layout: Layout
    regions: tuple[Region, ...]
    total_kv_heads: int

    @property
    def heads_per_rank(self) -> int:
        if self.layout.kv_layout == "MLA":
            return 1
        return max(1, self.total_kv_heads // self.tp_size)

    @property
    def head_start(self) -> int:
        if self.layout.kv_layout == "MLA":
            return 0
        return (self.tp_rank * self.total_kv_heads) // self.tp_size

    @property
    def elem_bytes(self) -> int:
        try:
            return DTYPE_BYTES[self.layout.dtype.removeprefix("torch.")]
        except KeyError:
            raise PlanError(f"unknown dtype {self.layout.dtype!r}") from None


def head_range(rank: int, tp_size: int, total_heads: int, mla: bool = False) -> tuple[int, int]:
    """KV heads ``[start, end)`` held by ``rank`` of ``tp_size`` ranks."""
    if mla:
        return 0, 1
    start = (rank * total_heads) // tp_size
    return start, start + max(1, total_heads // tp_size)


def source_ranks(reader_rank: int, reader_tp: int, source_tp: int, total_heads: int,
                 mla: bool = False) -> tuple[list[int], list[int]]:
    """``(read_from, notify)``: source ranks a reader reads from and must notify.

    ``read_from`` covers the reader's heads once; ``notify`` is every source
    rank whose heads overlap the reader's (a superset of ``read_from``).
    Every load asks the same few questions: the answers are cached (fresh
    lists each call).

    Raises:
        PlanError: no source rank holds one of the reader's heads.
    """
    read_from, notify = _source_ranks(reader_rank, reader_tp, source_tp, total_heads, bool(mla))
    return list(read_from), list(notify)


@functools.lru_cache(maxsize=1024)
def _source_ranks(reader_rank: int, reader_tp: int, source_tp: int, total_heads: int,
                  mla: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    a, b = head_range(reader_rank, reader_tp, total_heads, mla)
    notify = [p for p in range(source_tp)
              if max(a, head_range(p, source_tp, total_heads, mla)[0]) < min(b, head_range(p, source_tp, total_heads, mla)[1])]
    read_from: list[int] = []
    covered = a
    while covered < b:
        holders = [p for p in notify if head_range(p, source_tp, total_heads, mla)[0] <= covered
                   < head_range(p, source_tp, total_heads, mla)[1]]
        if not holders:
            raise PlanError(f"no source rank holds KV head {covered}")
        p = holders[reader_rank % len(holders)]  # spread readers over replicas
        read_from.append(p)
        covered = head_range(p, source_tp, total_heads, mla)[1]
    return tuple(read_from), tuple(notify)


@functools.lru_cache(maxsize=1024)
def expected_notifications(source_rank: int, source_tp: int, reader_tp: int, total_heads: int,
                           mla: bool = False) -> int:
    """How many reader ranks will notify ``source_rank`` for one request."""
    return sum(source_rank in _source_ranks(r, reader_tp, source_tp, total_heads, bool(mla))[1]
               for r in range(reader_tp))


def compatible(local: Geometry, remote: Geometry) -> None:
    """Checks that ``local`` (reader) can be filled from ``remote`` ranks.

    Raises:
        PlanError: naming the first mismatch (rejected at handshake, never
            served with wrong bytes).
    """
    l, r = local.layout, remote.layout
    if (l.kv_layout == "MLA") != (r.kv_layout == "MLA"):
        raise PlanError(f"KV layout {r.kv_layout} cannot fill {l.kv_layout}")
    if l.kv_in_block != r.kv_in_block:
        raise PlanError(f"K and V in one block (vLLM-CPU) on one side only (source {r.kv_in_block}, "
                        f"reader {l.kv_in_block})")
    if l.k_dim_major != r.k_dim_major:
        raise PlanError(f"K stored dim-major (vLLM-CPU kernel) on one side only (source {r.k_dim_major}, "
                        f"reader {l.k_dim_major})")
    if l.kv_in_block and (l.kv_layout, r.kv_layout) != ("HND", "HND"):
        raise PlanError(f"K and V in one block needs HND on both sides (source {r.kv_layout}, "
                        f"reader {l.kv_layout})")
    if l.head_dim != r.head_dim or l.dtype != r.dtype:
        raise PlanError(f"head_dim/dtype differ: {r.head_dim}/{r.dtype} vs {l.head_dim}/{l.dtype}")
    if local.total_kv_heads != remote.total_kv_heads:
        raise PlanError(f"total KV heads differ: {remote.total_kv_heads} vs {local.total_kv_heads}")
    if len(local.regions) != len(remote.regions):
        raise PlanError(f"region count differs: {len(remote.regions)} vs {len(local.regions)}")
    if [x.group for x in local.regions] != [x.group for x in remote.regions]:
        raise PlanError("regions belong to different KV-cache groups on the two sides")
    if l.block_size < r.block_size or l.block_size % r.block_size:
        raise PlanError(f"reader block size {l.block_size} is not a multiple of source block size "
                        f"{r.block_size} (only source blocks smaller than or equal to the reader's are supported)")
    # Per pair, not per region (1,000 regions: the per-region form cost 8 ms of the handshake).
    same_shape = (l.block_size == r.block_size and local.heads_per_rank == remote.heads_per_rank
                  and l.kv_layout == r.kv_layout)
    widths = None  # (reader, source) bytes of one block of one region, made at the first region that needs them
    for i, (lr, rr) in enumerate(zip(local.regions, remote.regions)):
        if same_shape and lr.block_len == rr.block_len:
            continue
        if widths is None:
            widths = (l.block_size * local.heads_per_rank * l.head_dim * local.elem_bytes,
                      r.block_size * remote.heads_per_rank * r.head_dim * remote.elem_bytes)
        lw, rw = widths
        if lr.block_len != lw or rr.block_len != rw:
            raise PlanError(
                f"region {i}: block_len {rr.block_len}/{lr.block_len} bytes is not tokens x heads x head_dim x "
                f"dtype ({rw}/{lw}); only per-layer K/V (or MLA) regions can be re-sliced "
                f"(cross-layer regions need equal TP, block size and layout)")


def chunks(local: Geometry, remote: Geometry, region: int) -> np.ndarray:
    """Chunk rows ``(slot, local_offset, remote_offset, length)`` for one region.

    Offsets are bytes inside one block; ``slot`` in ``0..k-1`` names which of
    the ``k`` source blocks of one reader block the row belongs to. With
    ``kv_in_block`` (both sides, HND) and ``k > 1``, each head gives two rows
    per slot: its K run and its V run (``head_dim / 2`` elements per token);
    with ``k_dim_major`` the K run is ``head_dim / 2`` runs, one per dim.

    Raises:
        PlanError: the pair is not :func:`compatible` or shares no heads.
    """
    compatible(local, remote)
    return _region_chunks(local, remote, region)


def pair_chunks(local: Geometry, remote: Geometry) -> list[np.ndarray]:
    """:func:`chunks` of every region: the pair is checked once and regions
    of one shape share one array (checking per region was quadratic in the
    region count: 1,000 regions took 1.4 s of the event loop at handshake).

    Raises:
        PlanError: as :func:`chunks`.
    """
    compatible(local, remote)
    shared: dict[tuple[int, int], np.ndarray] = {}
    out = []
    for i, (lr, rr) in enumerate(zip(local.regions, remote.regions)):
        key = (lr.block_len, rr.block_len)
        if key not in shared:
            shared[key] = _region_chunks(local, remote, i)
        out.append(shared[key])
    return out


def _region_chunks(local: Geometry, remote: Geometry, region: int) -> np.ndarray:
    """:func:`chunks` of a pair already found :func:`compatible`."""
    l, r = local.layout, remote.layout
    lr, rr = local.regions[region], remote.regions[region]
    k = l.block_size // r.block_size
    if (k == 1 and local.heads_per_rank == remote.heads_per_rank and l.kv_layout == r.kv_layout
            and lr.block_len == rr.block_len and local.head_start == remote.head_start):
        return np.array([[0, 0, 0, lr.block_len]], dtype=np.int64)
    es, hd, bs_r, bs_l = local.elem_bytes, l.head_dim, r.block_size, l.block_size
    la, lb = local.head_start, local.head_start + local.heads_per_rank
    ra, rb = remote.head_start, remote.head_start + remote.heads_per_rank
    a, b = max(la, ra), min(lb, rb)
    if a >= b:
        raise PlanError(f"source rank {remote.tp_rank} holds none of the reader's heads")
    nh_l, nh_r = local.heads_per_rank, remote.heads_per_rank
    rows = []
    l_hnd, r_hnd = l.kv_layout == "HND", r.kv_layout == "HND"
    # Counted before any is made: the rows are Python tuples, ~1.1 us and
    # ~180 bytes each, made on the event loop, and the layouts (an engine's,
    # a peer's) set their number: a block of 2**24 tokens against a layout
    # of another order held the loop 76 s (attacker review).
    if l_hnd and r_hnd:
        parts = 2 if l.kv_in_block else 1
        per_head = (hd // parts if l.k_dim_major else 1) + (parts - 1)
        count = 1 if k == 1 else k * (b - a) * per_head
    elif not l_hnd and not r_hnd and (a, b) == (la, lb) == (ra, rb):
        count = k
    else:
        count = k * bs_r * (b - a)
    if count > BOUNDS.max_chunk_rows:
        raise PlanError(f"{count} chunk rows per block for region {region} (block sizes {bs_l} / {bs_r} tokens, "
                        f"{b - a} heads, layouts {l.kv_layout} / {r.kv_layout}): more than {BOUNDS.max_chunk_rows}")
    if l_hnd and r_hnd:
        # [heads, tokens, head_dim]: per head, the source's tokens are one run.
        # kv_in_block: [heads, 2, tokens, hd / 2]: (head, K|V) is one run of
        # tokens, as a head of an HND block with twice the heads.
        parts = 2 if l.kv_in_block else 1
        hp = hd // parts
        for j in range(k):
            if k == 1:
                rows.append((0, (a - la) * bs_l * hd * es, (a - ra) * bs_r * hd * es, (b - a) * bs_r * hd * es))
                continue
            for h in range(a, b):
                for p in range(parts):
                    lbase, rbase = ((h - la) * parts + p) * bs_l * hp, ((h - ra) * parts + p) * bs_r * hp
                    if p == 0 and l.k_dim_major:  # K is [hp, tokens]: the slot's tokens, dim by dim
                        for d in range(hp):
                            rows.append((j, (lbase + d * bs_l + j * bs_r) * es, (rbase + d * bs_r) * es,
                                         bs_r * es))
                        continue
                    rows.append((j, (lbase + j * bs_r * hp) * es, rbase * es, bs_r * hp * es))
    elif not l_hnd and not r_hnd and (a, b) == (la, lb) == (ra, rb):
        # [tokens, heads, head_dim] with the same heads: source block j is one run.
        for j in range(k):
            rows.append((j, j * bs_r * nh_l * hd * es, 0, bs_r * nh_r * hd * es))
    else:
        # General case: one head_dim vector per (token, head).
        for j in range(k):
            for t in range(bs_r):
                lt = j * bs_r + t
                for h in range(a, b):
                    lo = ((h - la) * bs_l + lt) if l_hnd else (lt * nh_l + (h - la))
                    ro = ((h - ra) * bs_r + t) if r_hnd else (t * nh_r + (h - ra))
                    rows.append((j, lo * hd * es, ro * hd * es, hd * es))
    return np.array(rows, dtype=np.int64)


@dataclass(frozen=True)
class RowMap:
    """The descriptor rows of one side of a pair, made on demand.

    Row ``((i * num_blocks + b) * P) + p`` is ``(bases[i] + b * strides[i] +
    offsets[i, p], lengths[i, p], device)``: region-major, then block, then
    position ``p`` inside the block (``P`` positions per block: ``k * C`` on
    the reader's side, slot-major; ``C`` on the source's, its slot 0 chunks).
    :meth:`rows` gives the rows of a request's indices only; :meth:`all`
    every row (what a prepped list needs: ``regions x blocks x P`` rows, 16M
    for an 80-layer model with 100k blocks). Units: bytes.
    """

    bases: np.ndarray     # (R,) int64: each region's first byte
    strides: np.ndarray   # (R,) int64: block stride in bytes
    offsets: np.ndarray   # (R, P) int64: byte offset of each position inside a block
    lengths: np.ndarray   # (R, P) int64: bytes of each position
    num_blocks: int
    device: int = 0

    def __len__(self) -> int:
        return self.offsets.size * self.num_blocks

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """Rows ``(addr, len, device)`` (``(n, 3)`` int64) of indices ``idx``
        (as :func:`chunk_indices` numbers them)."""
        idx = np.asarray(idx, dtype=np.int64)
        P = self.offsets.shape[1]
        q, p = np.divmod(idx, P)
        i, b = np.divmod(q, self.num_blocks)
        out = np.empty((len(idx), 3), dtype=np.int64)
        out[:, 0] = self.bases[i] + b * self.strides[i] + self.offsets[i, p]
        out[:, 1] = self.lengths[i, p]
        out[:, 2] = self.device
        return out

    def all(self) -> np.ndarray:
        """Every row, in index order."""
        return self.rows(np.arange(len(self), dtype=np.int64))

    def edges(self) -> np.ndarray:
        """The rows of each region's first and last block (``2 x R x P`` rows):
        the lowest and highest bytes the map can name, what a check that the
        map lies inside the peer's registered memory needs to look at (each
        region's blocks are evenly strided between them)."""
        P, nb = self.offsets.shape[1], self.num_blocks
        first = (np.arange(len(self.bases), dtype=np.int64) * nb)[:, None] * P + np.arange(P, dtype=np.int64)
        return self.rows(np.concatenate([first.ravel(), (first + (nb - 1) * P).ravel()]))


def _row_map(bases, regions, num_blocks: int, chunk_sets: list[np.ndarray], take, device: int) -> RowMap:
    """``take(chunk_set)`` -> ``(P, 2)`` (offset, length) columns, made once
    per distinct array: regions of one shape share one (``pair_chunks``), and
    per region the columns of 1,000 regions cost ~7 ms of a handshake."""
    seen: dict[int, int] = {}
    uniq: list[np.ndarray] = []
    pick = np.empty(len(chunk_sets), dtype=np.intp)
    for i, ch in enumerate(chunk_sets):
        j = seen.get(id(ch))
        if j is None:
            j = seen[id(ch)] = len(uniq)
            uniq.append(take(ch))
        pick[i] = j
    offsets = np.stack([u[:, 0] for u in uniq])[pick]
    lengths = np.stack([u[:, 1] for u in uniq])[pick]
    return RowMap(np.asarray(bases, dtype=np.int64), np.array([r.block_stride for r in regions], dtype=np.int64),
                  offsets, lengths, num_blocks, device)


def local_map(bases: list[int], regions, num_blocks: int, chunk_sets: list[np.ndarray], k: int,
              device: int = 0) -> RowMap:
    """The reader side's rows: position ``j * C + c`` is chunk ``c`` of slot ``j``."""
    return _row_map(bases, regions, num_blocks, chunk_sets, lambda ch: ch[:, [1, 3]], device)


def remote_map(bases: list[int], regions, num_blocks: int, chunk_sets: list[np.ndarray], k: int,
               device: int = 0) -> RowMap:
    """The source side's rows: slot 0's ``C`` chunks (remote offsets do not
    depend on the slot, so one set per source block serves every slot)."""
    return _row_map(bases, regions, num_blocks, chunk_sets, lambda ch: ch[:len(ch) // k][:, [2, 3]], device)


def local_rows(bases: list[int], regions, num_blocks: int, chunk_sets: list[np.ndarray], k: int) -> np.ndarray:
    """Every row of :func:`local_map` (device 0)."""
    return local_map(bases, regions, num_blocks, chunk_sets, k).all()


def remote_rows(bases: list[int], regions, num_blocks: int, chunk_sets: list[np.ndarray], k: int) -> np.ndarray:
    """Every row of :func:`remote_map` (device 0)."""
    return remote_map(bases, regions, num_blocks, chunk_sets, k).all()


def chunk_indices(local_blocks, remote_blocks, num_regions: int, local_num_blocks: int,
                  remote_num_blocks: int, k: int, C: int,
                  region_groups: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Indices into :func:`local_rows` / :func:`remote_rows` for one request.

    ``local_blocks``/``remote_blocks`` are block id lists per KV-cache group
    (``[[...], [...]]``, vLLM HMA) or one flat list (one group); region ``i``
    takes the lists of group ``region_groups[i]`` (default: all group 0).
    ``remote[g][i]`` fills slot ``i % k`` of ``local[g][i // k]``.

    Raises:
        LayoutError: a block id out of range, a missing group, or too few
            local blocks.
    """
    region_groups = tuple(region_groups) if region_groups is not None else (0,) * num_regions
    lgroups, rgroups = check_request(local_blocks, remote_blocks, local_num_blocks, remote_num_blocks, k,
                                     region_groups)
    return checked_indices(lgroups, rgroups, num_regions, local_num_blocks, remote_num_blocks, k, C, region_groups)


def checked_indices(lgroups: list, rgroups: list, num_regions: int, local_num_blocks: int, remote_num_blocks: int,
                    k: int, C: int, region_groups: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`chunk_indices` of ids :func:`check_request` checked already
    (``lgroups``, ``rgroups``: what it returned; ``region_groups``: each
    region's group, a tuple). A load checks its ids against every source
    rank before its claim and makes its rows after it: checking again here
    cost ~1-2 us of a one-block load (py-spy, 64 loads in flight)."""
    if k == 1 and len(rgroups[0]) * num_regions * C <= SMALL_PLAN_ROWS and not any(region_groups):
        # One group, whole blocks, a few rows: Python arithmetic on the ids
        # beats a dozen numpy calls on tiny arrays (measured here: 2.3 us
        # against 7.8 for one block of one region, 7.2 against 13.6 for 16).
        rb = rgroups[0]
        lb = lgroups[0][:len(rb)]
        lstep, rstep, chunks = local_num_blocks * C, remote_num_blocks * C, range(C)
        return (np.array([i * lstep + b * C + c for i in range(num_regions) for b in lb for c in chunks],
                         dtype=np.int32),
                np.array([i * rstep + b * C + c for i in range(num_regions) for b in rb for c in chunks],
                         dtype=np.int32))
    # A small load's whole plan is a few array operations: the per-region
    # bases and chunk offsets are cached, the slot arithmetic is skipped for
    # k = 1 (measured: 16 blocks, one region, in ~15 us against ~90 us with
    # a dozen more numpy calls per group).
    lout, rout = [], []
    ngroups = max(region_groups) + 1
    for g in range(ngroups):
        lb, rb = np.asarray(lgroups[g], dtype=np.int64), np.asarray(rgroups[g], dtype=np.int64)
        if k == 1:
            lpos = lb[:len(rb)]
        else:
            i = np.arange(len(rb), dtype=np.int64)
            lpos = lb[i // k] * k + i % k                   # (block, slot) of each remote block
        lbase, rbase, c = _index_bases(region_groups, g, local_num_blocks * k, remote_num_blocks, C)
        lout.append((lbase + (lpos * C)[None, :, None] + c).reshape(-1))
        rout.append((rbase + (rb * C)[None, :, None] + c).reshape(-1))
    if ngroups == 1:
        return lout[0].astype(np.int32), rout[0].astype(np.int32)
    return np.concatenate(lout).astype(np.int32), np.concatenate(rout).astype(np.int32)


def check_request(local_blocks, remote_blocks, local_num_blocks: int, remote_num_blocks: int, k: int,
                  region_groups) -> tuple[list, list]:
    """What :func:`chunk_indices` checks, without making a row: every group
    the regions use (``region_groups``, each region's group) has block ids
    on both sides, enough local blocks for its remote ones (``k`` per local
    block), and every id in range. Costs about the block ids: a load waits
    for its claim with them, and makes its rows (regions x blocks x chunks)
    after it.

    Returns the ids as ``(local, remote)`` lists of per-group sequences.

    Raises:
        LayoutError: as :func:`chunk_indices`.
    """
    lgroups = _as_groups(local_blocks)
    rgroups = _as_groups(remote_blocks)
    ngroups = max(region_groups) + 1
    if len(lgroups) != len(rgroups) or len(lgroups) < ngroups:
        raise LayoutError(f"block ids for {len(lgroups)} local / {len(rgroups)} remote groups, "
                          f"the regions use {ngroups}")
    for g in range(ngroups):
        lb, rb = lgroups[g], rgroups[g]
        if len(lb) * k < len(rb) or len(lb) < -(-len(rb) // k):
            raise LayoutError(f"group {g}: {len(rb)} remote blocks need {-(-len(rb) // k)} local blocks, "
                              f"got {len(lb)}")
        check_block_ids(lb, local_num_blocks, "local ")
        check_block_ids(rb, remote_num_blocks, "remote ")
    return lgroups, rgroups


#: Rows of a request (regions x blocks x chunks) up to which
#: :func:`chunk_indices` computes its indices in Python rather than numpy.
SMALL_PLAN_ROWS = 64


@functools.lru_cache(maxsize=256)
def _index_bases(region_groups: tuple[int, ...], g: int, local_rows_per_region: int, remote_blocks: int,
                 C: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(local, remote, chunk)`` offsets of :func:`chunk_indices` for group
    ``g``: each of its regions' first index on either side, shape ``(R, 1, 1)``,
    and ``0..C-1`` of shape ``(1, 1, C)``. Read-only (cached)."""
    regs = np.array([i for i, rg in enumerate(region_groups) if rg == g], dtype=np.int64)[:, None, None]
    out = (regs * local_rows_per_region * C, regs * remote_blocks * C, np.arange(C, dtype=np.int64)[None, None, :])
    for a in out:
        a.flags.writeable = False
    return out


def _as_groups(blocks) -> list:
    """A flat id list or a list of per-group lists -> a list of per-group id sequences."""
    if len(blocks) and isinstance(blocks[0], (list, tuple, np.ndarray)):
        return list(blocks)
    return [blocks]


def check_block_ids(ids, num_blocks: int, side: str = "") -> None:
    """Raises LayoutError naming an id of ``ids`` (a list or array of block
    ids) outside ``0..num_blocks-1``, the largest if any is too large, else
    the smallest; ``side`` prefixes the message (``"local "``). Python's
    ``min``/``max`` on a list: a few us for a small load, where numpy's
    conversion and reductions cost tens; naming an extreme, not the first
    bad id, needs no third pass (a Python loop: ~40 % of a refusal of 1M
    ids, measured with py-spy)."""
    if not len(ids):
        return
    lo, hi = (ids.min(), ids.max()) if isinstance(ids, np.ndarray) else (min(ids), max(ids))
    if lo < 0 or hi >= num_blocks:
        raise LayoutError(f"{side}block id {int(hi if hi >= num_blocks else lo)} out of range 0..{num_blocks - 1}")
