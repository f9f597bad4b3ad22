"""Benchmark 1, data plane: the same blocks moved three ways, side by side.

(a) between two kvd daemons (:mod:`kvd.bench.kvd_pair`): engine-side client
    ``load`` -> daemon D READs from daemon P -> ``recv_done`` back;
(b) between two NIXL agents in two plain processes, no daemon
    (:mod:`kvd.bench.nixl_pair`): the in-process connector's path;
(c) a single-thread memcpy of the same blocks in one process (``numpy.take``
    gathering the source blocks into the destination: one ``memcpy`` per
    block), the limit here;
(s) optionally (method ``s``), both engines on one kvd daemon: the daemon
    copies the blocks itself (``kvd.core.local_copy``), timed as (a);
(m) optionally, one ``memmove`` per block in this process, on one thread
    (kvd's native row copy in one call where it was built, else one
    ``ctypes.memmove`` a block): the single-thread memcpy the same-node copy
    is held to (here often faster than ``numpy.take``).

Every case moves ``blocks`` blocks of ``block_len`` bytes, from scattered
source block ids (random, unordered) into destination blocks ``0..n-1``, of
one shm segment into another. Reps are interleaved (a, b, c in a rotating
order, every cell once per round) so that the machine's load drifts over all
three alike; each figure is the median over rounds, and each ratio the median
of the per-round ratios (a and b measured back to back). Byte-exactness of
(a) and (b) is checked once per cell.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from kvd.bench import common as cm
from kvd.core import local_copy
from kvd.testing.shm import ShmSegment
from kvd.bench.kvd_pair import HOLD_AHEAD_S, KvdPair
from kvd.bench.nixl_pair import NixlPair, PeerConfig

BLOCK_LENS = [4 * cm.KiB, 16 * cm.KiB, 64 * cm.KiB, 256 * cm.KiB, cm.MiB, 4 * cm.MiB]
BLOCKS = [1, 16, 256, 4096]
MAX_BYTES = 256 * cm.MiB
QUICK_BLOCK_LENS = [16 * cm.KiB, 256 * cm.KiB, 2 * cm.MiB]
QUICK_BLOCKS = [16, 256]
QUICK_MAX_BYTES = 16 * cm.MiB
# What python runs to start a daemon: ``kvd serve`` itself.
KVD_ENTRY = ("-m", "kvd.cli")


@dataclass
class Cell:
    """One benchmark cell: ``blocks`` blocks of ``block_len`` bytes per request,
    and the seconds per request of each round for (a) kvd, (b) plain NIXL and
    (c) memcpy."""
    block_len: int
    blocks: int
    a: list[float] = field(default_factory=list)  # seconds per request
    b: list[float] = field(default_factory=list)
    c: list[float] = field(default_factory=list)
    s: list[float] = field(default_factory=list)  # same-node: one daemon
    m: list[float] = field(default_factory=list)  # memmove per block

    @property
    def nbytes(self) -> int:
        """Bytes per request: ``block_len * blocks``."""
        return self.block_len * self.blocks

    def gbs(self, which: str) -> float:
        """Throughput of case ``which`` ("a", "b" or "c") in GB/s (1e9 bytes/s),
        from the median round time; NaN without rounds."""
        t = cm.median(getattr(self, which))
        return self.nbytes / t / 1e9 if t > 0 else float("nan")

    def ratio(self, x: str, y: str) -> float:
        """Median over rounds of throughput(x) / throughput(y) (= time y / time x)."""
        xs, ys = getattr(self, x), getattr(self, y)
        return cm.median([ty / tx for tx, ty in zip(xs, ys) if tx > 0])

    def summary(self) -> dict:
        """The cell's figures as a dict: medians in ms and GB/s, ratios, raw seconds."""
        return dict(block_len=self.block_len, blocks=self.blocks, bytes=self.nbytes,
                    a_gbs=self.gbs("a"), b_gbs=self.gbs("b"), c_gbs=self.gbs("c"),
                    a_ms=cm.median(self.a) * 1e3, b_ms=cm.median(self.b) * 1e3, c_ms=cm.median(self.c) * 1e3,
                    a_over_b=self.ratio("a", "b"), a_over_c=self.ratio("a", "c"), b_over_c=self.ratio("b", "c"),
                    a_s=self.a, b_s=self.b, c_s=self.c,
                    **(dict(s_gbs=self.gbs("s"), s_ms=cm.median(self.s) * 1e3, s_over_c=self.ratio("s", "c"),
                            s_over_a=self.ratio("s", "a"), s_s=self.s) if self.s else {}),
                    **(dict(m_gbs=self.gbs("m"), m_ms=cm.median(self.m) * 1e3, s_over_m=self.ratio("s", "m"),
                            m_s=self.m) if self.m else {}))


def cells_for(block_lens, blocks, max_bytes) -> list[Cell]:
    """Every cell of ``block_lens`` (bytes) x ``blocks`` with at most
    ``max_bytes`` bytes per request."""
    return [Cell(bl, n) for bl in block_lens for n in blocks if bl * n <= max_bytes]


class Bench:
    """The movers over one source and one destination segment (``same_node``:
    also case (s), a third daemon for both engines)."""

    def __init__(self, seg_bytes: int, poll_s: float, peer_cfg: PeerConfig, daemon_args=(), daemon_env=None,
                 seed: int = 1, entry: tuple[str, ...] = KVD_ENTRY, same_node: bool = False,
                 hold_ahead_s: float = HOLD_AHEAD_S):
        self.poll_s = poll_s
        self.hold_ahead_s = hold_ahead_s
        self.rng = np.random.default_rng(seed)
        self.workdir = cm.workdir()
        self.src = ShmSegment(seg_bytes, cm.SHM_PREFIX)
        self.dst = ShmSegment(seg_bytes, cm.SHM_PREFIX)
        self.kvd = self.nixl = self.same = None
        try:
            self.src.fill(seed)
            self.dst.fill(seed + 1)
            self.kvd = KvdPair(self.workdir, (self.src.name, seg_bytes), (self.dst.name, seg_bytes),
                               tuple(daemon_args), env=daemon_env, entry=entry)
            self.nixl = NixlPair(self.src.name, seg_bytes, self.dst.name, seg_bytes, peer_cfg)
            if same_node:
                self.same = KvdPair(self.workdir, (self.src.name, seg_bytes), (self.dst.name, seg_bytes),
                                    tuple(daemon_args), env=daemon_env, entry=entry, same_node=True)
                self.same.src_mem.array[:] = self.src.array  # its engines' memory: sealed memfds
        except BaseException:
            self.close()
            raise
        self.ids: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def ids_for(self, cell: Cell) -> tuple[list[int], list[int]]:
        """``(local, remote)`` block ids of ``cell``: the first ``blocks`` local
        blocks and a random permutation of source blocks (fixed per cell)."""
        key = (cell.block_len, cell.blocks)
        if key not in self.ids:
            nsrc = self.src.size // cell.block_len
            remote = self.rng.permutation(nsrc)[:cell.blocks].tolist()
            self.ids[key] = (list(range(cell.blocks)), remote)
        return self.ids[key]

    def isolate(self, which: str) -> None:
        """Only the processes of case ``which`` run; the others are paused
        (SIGSTOP): an idle NIXL agent with its progress thread spins a core,
        which on a 2-core machine would slow whatever is timed next to it."""
        if self.nixl is not None:
            self.nixl.pause(which != "b")
        if self.kvd is not None:
            self.kvd.pause(which != "a")
        if self.same is not None:
            self.same.pause(which != "s")

    def run_a(self, cell: Cell) -> float:
        """One kvd transfer of ``cell`` through the two daemons; seconds."""
        local, remote = self.ids_for(cell)
        self.isolate("a")
        t = self.kvd.transfer(cell.block_len, local, remote, self.poll_s, self.hold_ahead_s)
        self.kvd.drain_sources()
        return t

    def run_s(self, cell: Cell) -> float:
        """One same-node kvd load of ``cell`` (both engines on one daemon); seconds."""
        local, remote = self.ids_for(cell)
        self.isolate("s")
        t = self.same.transfer(cell.block_len, local, remote, self.poll_s, self.hold_ahead_s)
        self.same.drain_sources()
        return t

    def run_b(self, cell: Cell) -> float:
        """One plain-NIXL READ of ``cell``; seconds."""
        local, remote = self.ids_for(cell)
        self.isolate("b")
        key = self.nixl.prep(cell.block_len, self.src.size // cell.block_len)
        return self.nixl.read(key, local, remote, b"bench", self.poll_s)

    def run_c(self, cell: Cell) -> float:
        """One memcpy of ``cell``'s blocks (``np.take``); seconds."""
        self.isolate("c")
        return self._memcpy(cell)

    def run_m(self, cell: Cell) -> float:
        """A single-thread memcpy of ``cell``'s blocks in this process, one
        ``memmove`` a block: kvd's native row copy on one thread (one call,
        no Python between blocks) where it was built, else one
        ``ctypes.memmove`` a block; seconds."""
        self.isolate("m")
        local, remote = self.ids_for(cell)
        bl, sa, da = cell.block_len, self.src.array.ctypes.data, self.dst.array.ctypes.data
        if local_copy._native is not None:
            d = da + np.arange(len(remote), dtype=np.int64) * bl
            s = sa + np.asarray(remote, dtype=np.int64) * bl
            n = np.full(len(remote), bl, dtype=np.int64)
            t0 = time.perf_counter()
            local_copy._native.copy_rows(d, s, n, 1, 1)
            return time.perf_counter() - t0
        pairs = [(da + i * bl, sa + r * bl) for i, r in enumerate(remote)]
        t0 = time.perf_counter()
        for d, s in pairs:
            ctypes.memmove(d, s, bl)
        return time.perf_counter() - t0

    def _memcpy(self, cell: Cell) -> float:
        local, remote = self.ids_for(cell)
        src = self.src.array.reshape(-1, cell.block_len)
        dst = self.dst.array[:cell.nbytes].reshape(cell.blocks, cell.block_len)
        idx = np.asarray(remote, dtype=np.intp)
        t0 = time.perf_counter()
        np.take(src, idx, axis=0, out=dst, mode="clip")  # one memcpy per block, no temporary
        return time.perf_counter() - t0

    def idle_cpu(self, seconds: float = 3.0) -> dict:
        """CPU use (% of one core) of each process while nothing moves: the two
        daemons (with their workers, agents and peers set up) and the two
        plain-NIXL processes, all running."""
        self.kvd.pause(False)
        self.nixl.pause(False)
        pids = {"kvd P": self.kvd.p.pid, "kvd D": self.kvd.d.pid, "nixl source": self.nixl.source.pid,
                "nixl reader": self.nixl.reader.pid}
        time.sleep(0.5)
        c0 = {k: cm.cpu_seconds(p) for k, p in pids.items()}
        time.sleep(seconds)
        return {k: 100 * (cm.cpu_seconds(p) - c0[k]) / seconds for k, p in pids.items()}

    def verify(self, cell: Cell, which: str) -> None:
        """Runs case ``which`` once on a zeroed destination; raises AssertionError
        when the bytes differ from the source blocks."""
        local, remote = self.ids_for(cell)
        dst = self.same.dst_mem if which == "s" else self.dst
        dst.array[:cell.nbytes] = 0
        getattr(self, f"run_{which}")(cell)
        got = dst.array[:cell.nbytes].reshape(cell.blocks, cell.block_len)
        want = self.src.array.reshape(-1, cell.block_len)[remote]
        if not np.array_equal(got, want):
            raise AssertionError(f"({which}) {cell.blocks} x {cell.block_len} B: bytes differ")

    def close(self) -> None:
        """Resumes paused processes, stops both pairs, frees the segments and the workdir."""
        try:
            for x in (self.nixl, self.kvd, self.same):
                if x is not None:
                    x.pause(False)
        except Exception:
            pass
        for x in (self.nixl, self.kvd, self.same):
            if x is not None:
                try:
                    x.close()
                except Exception:
                    pass
        self.src.close()
        self.dst.close()
        cm.remove_workdir(self.workdir)


def run(cells: list[Cell], reps: int, poll_s: float = 50e-6, peer_cfg: PeerConfig | None = None,
        daemon_args=(), daemon_env=None, progress: bool = True, title: str = "data plane",
        methods: str = "abc", entry: tuple[str, ...] = KVD_ENTRY, hold_ahead_s: float = HOLD_AHEAD_S,
        small_load_reps: int = 0) -> dict:
    """Runs every cell ``reps`` rounds, the cases of ``methods`` (``a``, ``b``,
    ``c``, ``s``, ``m``) in a rotating order; returns the results (a dict: its
    ``cells`` are :meth:`Cell.summary` dicts). ``entry``: what python runs to
    start a daemon (:data:`KVD_ENTRY`, or a benchmark's tracing entry);
    ``hold_ahead_s``: how long before a kvd load its hold is sent
    (``kvd.bench.kvd_pair``; 0: with the load, timed). ``small_load_reps``:
    that many more rounds of (a) and (b) alone on the :data:`SMALL_LOAD`
    cell, when it is one of ``cells`` (``small_load``: their seconds; the
    small-load goal reads them too, :func:`goals`): plain NIXL's time of
    that cell is 1.3-11 ms instead of ~0.5 in one or two rounds of five
    here, so five rounds do not settle its ratio (docs/PERFORMANCE.md, "Noise")."""
    seg = max(c.nbytes for c in cells)
    seg = max(seg, max(c.block_len for c in cells) * 2)
    load0 = cm.loadavg()
    t_start = time.time()
    bench = Bench(seg, poll_s, peer_cfg or PeerConfig(), daemon_args, daemon_env, entry=entry,
                  same_node="s" in methods, hold_ahead_s=hold_ahead_s)
    small = ([c for c in cells if (c.block_len, c.blocks) == SMALL_LOAD]
             if small_load_reps > 0 and "a" in methods and "b" in methods else [])
    extra: dict[str, list[float]] = {"a": [], "b": []}
    prog = cm.Progress(total=len(cells) * (reps + 1) + (small_load_reps if small else 0), title=title,
                       enabled=progress)
    try:
        for cell in cells:  # warm-up round: first use (handshake, page faults), byte checks
            for m in methods:
                if m not in "cm":
                    bench.verify(cell, m)
                else:
                    getattr(bench, f"run_{m}")(cell)
            prog.step(f"warm-up {cm.fmt_bytes(cell.block_len)} x {cell.blocks}")
        for r in range(reps):
            for i, cell in enumerate(cells):
                order = methods[(r + i) % len(methods):] + methods[:(r + i) % len(methods)]
                for m in order:
                    getattr(cell, m).append(getattr(bench, f"run_{m}")(cell))
                same = f", same-node/memmove {cell.ratio('s', 'm'):.2f}" if cell.s and cell.m else ""
                prog.step(f"round {r + 1}/{reps}: {cm.fmt_bytes(cell.block_len)} x {cell.blocks}{same}")
        if small:
            for r in range(small_load_reps):
                for m in ("ab" if r % 2 else "ba"):
                    extra[m].append(getattr(bench, f"run_{m}")(small[0]))
                prog.step(f"small load round {r + 1}/{small_load_reps}")
    finally:
        prog.close()
        bench.close()
    return dict(benchmark="dataplane", reps=reps, poll_us=poll_s * 1e6, hold_ahead_ms=hold_ahead_s * 1e3,
                peer_config=asdict(peer_cfg or PeerConfig()),
                daemon_args=list(daemon_args), daemon_entry=list(entry), daemon_env=daemon_env or {},
                seconds=time.time() - t_start,
                loadavg_start=load0, loadavg_end=cm.loadavg(), cells=[c.summary() for c in cells],
                **({"small_load": dict(a_s=extra["a"], b_s=extra["b"])} if extra["a"] else {}))


SMALL_LOAD = (64 * cm.KiB, 16)  # (block_len, blocks) of the small-load goal: kvd time / (b) time <= 1.5
SMALL_LOAD_GOAL = 1.5


def goals(res: dict) -> dict:
    """The goals on these results: (a)/(b) >= 0.97 for requests >= 1 MiB
    of blocks >= 64 KiB (docs/PERFORMANCE.md's data-plane goal; every cell
    ``kvd bench`` runs is one),
    (a)/(c) >= 0.7 (both as medians of per-round ratios), and the small
    load's (16 x 64 KiB) kvd time / plain NIXL time <= 1.5 (median of the
    per-round ratios, the cell's rounds and the ``small_load`` ones;
    ``small_load_rounds`` of them, ``small_load_min``/``_max`` their range;
    NaN and ``small_load_met`` None without that cell).
    ``a_over_b_cells_split``: cells >= 64 KiB whose rounds fall on both
    sides of 0.97, whose verdict is the noise's (a short ``--quick`` run:
    one slow round of (b) passed a 4 MiB cell that is ~0.3 in longer runs)."""
    big = [c for c in res["cells"] if c["block_len"] >= 64 * cm.KiB and c["block_len"] * c["blocks"] >= cm.MiB]
    small = [c for c in res["cells"] if (c["block_len"], c["blocks"]) == SMALL_LOAD]
    pairs = []
    if small:
        more = res.get("small_load", {})
        pairs = [(ta, tb) for ta, tb in zip(small[0]["a_s"] + more.get("a_s", []), small[0]["b_s"] + more.get("b_s", []))
                 if tb > 0]
    ratios = [ta / tb for ta, tb in pairs]
    sr = cm.median(ratios) if pairs else float("nan")
    ab = [c["a_over_b"] for c in big]
    ac = [c["a_over_c"] for c in res["cells"]]

    def split(c: dict) -> bool:
        rounds = [tb / ta for ta, tb in zip(c["a_s"], c["b_s"]) if ta > 0]
        return bool(rounds) and min(rounds) < 0.97 <= max(rounds)

    return dict(
        a_over_b_cells_split=sum(split(c) for c in big),
        small_load_min=min(ratios) if pairs else float("nan"),
        small_load_max=max(ratios) if pairs else float("nan"),
        a_over_b_min_ge64k=min(ab) if ab else float("nan"),
        a_over_b_median_ge64k=cm.median(ab),
        a_over_b_cells_met=f"{sum(x >= 0.97 for x in ab)}/{len(ab)}",
        a_over_c_cells_met=f"{sum(x >= 0.7 for x in ac)}/{len(ac)}",
        small_load_a_time_over_b=sr,
        small_load_rounds=len(pairs),
        small_load_met=(sr <= SMALL_LOAD_GOAL) if pairs else None,
    )


def table(res: dict, markdown: bool = False) -> str:
    """Benchmark 1's cells as a text (or ``markdown``) table: ms, GB/s and ratios."""
    rows = []
    for c in res["cells"]:
        rows.append([cm.fmt_bytes(c["block_len"]), c["blocks"], cm.fmt_bytes(c["bytes"]),
                     f"{c['a_ms']:.3f}", f"{c['b_ms']:.3f}", f"{c['c_ms']:.3f}",
                     f"{c['a_gbs']:.2f}", f"{c['b_gbs']:.2f}", f"{c['c_gbs']:.2f}",
                     f"{c['a_over_b']:.2f}", f"{c['a_over_c']:.2f}", f"{c['b_over_c']:.2f}"])
    return cm.fmt_table(["block", "blocks", "bytes", "a ms", "b ms", "c ms", "a GB/s", "b GB/s", "c GB/s",
                         "a/b", "a/c", "b/c"], rows, markdown)


def same_node_table(res: dict, markdown: bool = False) -> str:
    """Case (s) against (m) memmove per block (the same-node goal: s/m >=
    0.8), (c) ``numpy.take`` and (a) two daemons, per cell: ms, GB/s, ratios
    ("-" for a case not run)."""
    def val(c: dict, key: str, case: str, fmt: str) -> str:
        return fmt.format(c[key]) if c.get(f"{case}_s") else "-"

    rows = [[cm.fmt_bytes(c["block_len"]), c["blocks"], cm.fmt_bytes(c["bytes"]),
             *(val(c, f"{x}_ms", x, "{:.3f}") for x in "smca"), val(c, "s_gbs", "s", "{:.2f}"),
             val(c, "m_gbs", "m", "{:.2f}"), *(val(c, f"s_over_{x}", x, "{:.2f}") for x in "mca")]
            for c in res["cells"] if "s_ms" in c]
    return cm.fmt_table(["block", "blocks", "bytes", "s ms", "m ms", "c ms", "a ms", "s GB/s", "m GB/s", "s/m",
                         "s/c", "s/a"], rows, markdown)


def same_node_setup() -> dict:
    """What (s) and (m) of this install are: ``m``, how (m) copies (kvd's
    native row copy on one thread, one call for all blocks, where it was
    built; else one ``ctypes.memmove`` a block), and ``daemon_copy_threads``,
    the threads a daemon started with the defaults copies (s) on
    (``kvd.core.local_copy.copy_threads``, this machine's CPUs)."""
    native = local_copy._native is not None
    return {"m": "native row copy, 1 thread, one call" if native else "ctypes.memmove a block",
            "daemon_copy_threads": local_copy.copy_threads(0)}

