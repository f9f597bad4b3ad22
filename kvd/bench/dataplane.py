"""Benchmark 1, data plane: the same blocks moved three ways, side by side.

(a) between two kvd daemons (:mod:`kvd.bench.kvd_pair`): engine-side client
    ``load`` -> daemon D READs from daemon P -> ``recv_done`` back;
(b) between two NIXL agents in two plain processes, no daemon
    (:mod:`kvd.bench.nixl_pair`): the in-process connector's path;
(c) a single-thread memcpy of the same blocks in one process (``numpy.take``
    gathering the source blocks into the destination: one ``memcpy`` per
    block), the limit here.

Every case moves ``blocks`` blocks of ``block_len`` bytes, from scattered
source block ids (random, unordered) into destination blocks ``0..n-1``, of
one shm segment into another. Reps are interleaved (a, b, c in a rotating
order, every cell once per round) so that the machine's load drifts over all
three alike; each figure is the median over rounds, and each ratio the median
of the per-round ratios (a and b measured back to back). Byte-exactness of
(a) and (b) is checked once per cell.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from kvd.bench import common as cm
from kvd.testing.shm import ShmSegment, cleanup_segments
from kvd.bench.kvd_pair import KvdPair
from kvd.bench.nixl_pair import NixlPair, PeerConfig

BLOCK_LENS = [4 * cm.KiB, 16 * cm.KiB, 64 * cm.KiB, 256 * cm.KiB, cm.MiB, 4 * cm.MiB]
BLOCKS = [1, 16, 256, 4096]
MAX_BYTES = 256 * cm.MiB
QUICK_BLOCK_LENS = [16 * cm.KiB, 256 * cm.KiB, 2 * cm.MiB]
QUICK_BLOCKS = [16, 256]
QUICK_MAX_BYTES = 16 * cm.MiB


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
                    a_s=self.a, b_s=self.b, c_s=self.c)


def entry_for(daemon_set) -> tuple[str, ...]:
    """How python starts a daemon: ``kvd.cli``, or the benchmark entry with module defaults set."""
    if not daemon_set:
        return ("-m", "kvd.cli")
    return ("-m", "kvd.bench.daemon_entry", *[x for a in daemon_set for x in ("--set", a)])


def cells_for(block_lens, blocks, max_bytes) -> list[Cell]:
    """Every cell of ``block_lens`` (bytes) x ``blocks`` with at most
    ``max_bytes`` bytes per request."""
    return [Cell(bl, n) for bl in block_lens for n in blocks if bl * n <= max_bytes]


class Bench:
    """The three movers over one source and one destination segment."""

    def __init__(self, seg_bytes: int, poll_s: float, peer_cfg: PeerConfig, daemon_args=(), daemon_env=None,
                 seed: int = 1, daemon_set=()):
        self.poll_s = poll_s
        self.rng = np.random.default_rng(seed)
        self.workdir = cm.workdir()
        self.src = ShmSegment(seg_bytes, cm.SHM_PREFIX)
        self.dst = ShmSegment(seg_bytes, cm.SHM_PREFIX)
        self.kvd = self.nixl = None
        try:
            self.src.fill(seed)
            self.dst.fill(seed + 1)
            self.kvd = KvdPair(self.workdir, (self.src.name, seg_bytes), (self.dst.name, seg_bytes),
                               tuple(daemon_args), env=daemon_env, entry=entry_for(daemon_set))
            self.nixl = NixlPair(self.src.name, seg_bytes, self.dst.name, seg_bytes, peer_cfg)
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

    def run_a(self, cell: Cell) -> float:
        """One kvd transfer of ``cell`` through the two daemons; seconds."""
        local, remote = self.ids_for(cell)
        self.isolate("a")
        t = self.kvd.transfer(cell.block_len, local, remote, self.poll_s)
        self.kvd.drain_sources()
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
        self.dst.array[:cell.nbytes] = 0
        getattr(self, f"run_{which}")(cell)
        got = self.dst.array[:cell.nbytes].reshape(cell.blocks, cell.block_len)
        want = self.src.array.reshape(-1, cell.block_len)[remote]
        if not np.array_equal(got, want):
            raise AssertionError(f"({which}) {cell.blocks} x {cell.block_len} B: bytes differ")

    def close(self) -> None:
        """Resumes paused processes, stops both pairs, frees the segments and the workdir."""
        try:
            if self.nixl is not None:
                self.nixl.pause(False)
            if self.kvd is not None:
                self.kvd.pause(False)
        except Exception:
            pass
        for x in (self.nixl, self.kvd):
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
        methods: str = "abc", daemon_set=()) -> dict:
    """Runs every cell ``reps`` rounds; returns the results (see :func:`summarize`)."""
    seg = max(c.nbytes for c in cells)
    seg = max(seg, max(c.block_len for c in cells) * 2)
    load0 = cm.loadavg()
    t_start = time.time()
    bench = Bench(seg, poll_s, peer_cfg or PeerConfig(), daemon_args, daemon_env, daemon_set=daemon_set)
    prog = cm.Progress(total=len(cells) * (reps + 1), title=title, enabled=progress)
    try:
        for cell in cells:  # warm-up round: first use (handshake, page faults), byte checks
            for m in methods:
                if m != "c":
                    bench.verify(cell, m)
                else:
                    bench.run_c(cell)
            prog.step(f"warm-up {cm.fmt_bytes(cell.block_len)} x {cell.blocks}")
        for r in range(reps):
            for i, cell in enumerate(cells):
                order = methods[(r + i) % len(methods):] + methods[:(r + i) % len(methods)]
                for m in order:
                    getattr(cell, m).append(getattr(bench, f"run_{m}")(cell))
                prog.step(f"round {r + 1}/{reps}: {cm.fmt_bytes(cell.block_len)} x {cell.blocks}")
    finally:
        prog.close()
        bench.close()
    return dict(benchmark="dataplane", reps=reps, poll_us=poll_s * 1e6, peer_config=asdict(peer_cfg or PeerConfig()),
                daemon_args=list(daemon_args), daemon_set=list(daemon_set), daemon_env=daemon_env or {}, seconds=time.time() - t_start,
                loadavg_start=load0, loadavg_end=cm.loadavg(), cells=[c.summary() for c in cells])


def latency(block_len: int = 64 * cm.KiB, blocks: int = 16, reps: int = 200, poll_s: float = 50e-6,
            peer_cfg: PeerConfig | None = None, daemon_args=(), daemon_env=None, progress: bool = True,
            daemon_set=()) -> dict:
    """Benchmark 3: completion latency of one small request, (a) vs (b), ``reps``
    times each, alternating; from ``load`` (start_load_kv) to ``recv_done`` in
    the engine's poll (get_finished), and for (b) from post to DONE."""
    cell = Cell(block_len, blocks)
    load0 = cm.loadavg()
    t_start = time.time()
    bench = Bench(max(cell.nbytes * 4, 4 * cm.MiB), poll_s, peer_cfg or PeerConfig(), daemon_args, daemon_env,
                  daemon_set=daemon_set)
    prog = cm.Progress(total=reps + 10, title="latency", enabled=progress)
    try:
        bench.verify(cell, "a")
        bench.verify(cell, "b")
        for i in range(10):  # warm-up
            bench.run_a(cell)
            bench.run_b(cell)
            prog.step("warm-up")
        idle = bench.idle_cpu()
        for i in range(reps):
            for m in ("ab" if i % 2 == 0 else "ba"):
                getattr(cell, m).append(getattr(bench, f"run_{m}")(cell))
            if i % 10 == 9:
                prog.step(f"{i + 1}/{reps}", 10)
    finally:
        prog.close()
        bench.close()
    q = lambda xs, p: cm.pct(xs, p) * 1e3  # noqa: E731
    return dict(benchmark="latency", block_len=block_len, blocks=blocks, bytes=cell.nbytes, reps=reps,
                poll_us=poll_s * 1e6, peer_config=asdict(peer_cfg or PeerConfig()), daemon_args=list(daemon_args),
                daemon_env=daemon_env or {}, daemon_set=list(daemon_set),
                a_p50_ms=q(cell.a, 50), a_p90_ms=q(cell.a, 90), a_p99_ms=q(cell.a, 99),
                b_p50_ms=q(cell.b, 50), b_p90_ms=q(cell.b, 90), b_p99_ms=q(cell.b, 99),
                a_over_b_p50=cm.pct(cell.a, 50) / cm.pct(cell.b, 50),
                a_over_b_paired=cm.median([a / b for a, b in zip(cell.a, cell.b) if b > 0]),
                a_s=cell.a, b_s=cell.b, idle_cpu_pct=idle, seconds=time.time() - t_start, loadavg_start=load0,
                loadavg_end=cm.loadavg())


def latency_table(res: dict, markdown: bool = False) -> str:
    """Benchmark 3's result as a table of p50/p90/p99 ms for (a) kvd and (b)
    plain NIXL, the kvd / NIXL ratio at p50 and the idle CPU (% of a core)."""
    rows = [["(a) kvd", f"{res['a_p50_ms']:.3f}", f"{res['a_p90_ms']:.3f}", f"{res['a_p99_ms']:.3f}"],
            ["(b) plain NIXL", f"{res['b_p50_ms']:.3f}", f"{res['b_p90_ms']:.3f}", f"{res['b_p99_ms']:.3f}"]]
    return cm.fmt_table(["path", "p50 ms", "p90 ms", "p99 ms"], rows, markdown) + (
        f"\nkvd / plain NIXL at p50: {res['a_over_b_p50']:.2f}x (paired median {res['a_over_b_paired']:.2f}x)"
        f"\nidle CPU, % of a core: " + ", ".join(f"{k} {v:.1f}" for k, v in res.get("idle_cpu_pct", {}).items()))


def latency_main(argv: list[str] | None = None) -> int:
    """Benchmark 3 (``benchmarks/latency.py``): completion latency of a small
    request, kvd vs plain NIXL; prints the table and the <= 1.5x goal, writes
    ``--json``. Returns 0."""
    ap = argparse.ArgumentParser(description="kvd benchmark 3: completion latency of a small request, kvd vs plain NIXL")
    ap.add_argument("--block-len", default="64K")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--reps", type=int, default=200)
    add_common_args(ap)
    args = ap.parse_args(argv)
    cleanup_segments(cm.SHM_PREFIX)
    info = cm.machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load average {info['loadavg_start']}", flush=True)
    res = latency(parse_sizes(args.block_len)[0], args.blocks, args.reps, args.poll_us * 1e-6, peer_cfg_from(args),
                  args.daemon_arg, dict(e.split("=", 1) for e in args.env) or None, progress=not args.no_progress,
                  daemon_set=args.daemon_set)
    res["machine"] = info
    res["command"] = " ".join(["benchmarks/latency.py", *(argv if argv is not None else sys.argv[1:])])
    print(latency_table(res))
    print(f"goal <= 1.5x: {'met' if res['a_over_b_p50'] <= 1.5 else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def goals(res: dict) -> dict:
    """The issue's goals on these results: (a)/(b) >= 0.97 for blocks >= 64 KiB,
    (a)/(c) >= 0.7 (both as medians of per-round ratios)."""
    big = [c for c in res["cells"] if c["block_len"] >= 64 * cm.KiB]
    ab = [c["a_over_b"] for c in big]
    ac = [c["a_over_c"] for c in res["cells"]]
    return dict(
        a_over_b_min_ge64k=min(ab) if ab else float("nan"),
        a_over_b_median_ge64k=cm.median(ab),
        a_over_b_cells_met=f"{sum(x >= 0.97 for x in ab)}/{len(ab)}",
        a_over_c_cells_met=f"{sum(x >= 0.7 for x in ac)}/{len(ac)}",
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


def parse_sizes(s: str) -> list[int]:
    """Comma-separated sizes with optional K/KiB/M/MiB suffixes (binary) -> bytes;
    ``"4K,1M"`` -> ``[4096, 1048576]``. Raises ValueError on a bad number."""
    out = []
    for x in s.split(","):
        x = x.strip().upper()
        mult = 1
        for suf, m in (("KIB", cm.KiB), ("MIB", cm.MiB), ("K", cm.KiB), ("M", cm.MiB)):
            if x.endswith(suf):
                x, mult = x[: -len(suf)], m
                break
        out.append(int(float(x) * mult))
    return out


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """Adds the options benchmarks 1 and 3 share: poll interval (us), the plain
    NIXL side's progress-thread settings, daemon flags and module defaults,
    environment, ``--json`` and ``--no-progress``."""
    ap.add_argument("--poll-us", type=float, default=50.0,
                    help="completion poll interval of the engine side in (a) and the reader in (b) (default 50)")
    ap.add_argument("--nixl-prog-thread", choices=("on", "off"), default="on",
                    help="(b): NIXL progress thread (vLLM's NixlConnector: on)")
    ap.add_argument("--nixl-num-threads", type=int, default=4, help="(b): UCX backend threads (vLLM: 4)")
    ap.add_argument("--nixl-pthr-delay-us", type=int, default=0,
                    help="(b): progress thread poll() timeout (NIXL's Python API: 0, a spinning thread)")
    ap.add_argument("--daemon-arg", action="append", default=[], metavar="FLAG",
                    help="extra `kvd serve` flag for (a)'s daemons (repeat; e.g. --daemon-arg=--log-level=info)")
    ap.add_argument("--daemon-set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="(a)'s daemons: change a module default first (kvd.bench.daemon_entry), e.g. "
                         "kvd.core.nixl_agent.PROGRESS_US=0")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for (a)'s daemons and (b)'s processes (e.g. UCX_TLS=...)")
    ap.add_argument("--json", default="", metavar="FILE", help="write the results here")
    ap.add_argument("--no-progress", action="store_true")


def peer_cfg_from(args) -> PeerConfig:
    """The plain-NIXL processes' ``PeerConfig`` from the parsed common options."""
    env = dict(e.split("=", 1) for e in args.env)
    return PeerConfig(prog_thread=args.nixl_prog_thread == "on", num_threads=args.nixl_num_threads,
                      pthr_delay_us=args.nixl_pthr_delay_us, env=env)


def main(argv: list[str] | None = None) -> int:
    """Benchmark 1 (``benchmarks/dataplane.py``): (a) kvd vs (b) plain NIXL vs (c)
    memcpy over the cells, with the goals (a)/(b) >= 0.97 for blocks >= 64 KiB
    and (a)/(c) >= 0.7; prints the table, writes ``--json``. Returns 0."""
    ap = argparse.ArgumentParser(description="kvd benchmark 1: data plane, (a) kvd vs (b) plain NIXL vs (c) memcpy")
    ap.add_argument("--quick", action="store_true", help="a short run (seconds)")
    ap.add_argument("--block-lens", default="", help="comma-separated, e.g. 4K,64K,1M (default 4K..4M)")
    ap.add_argument("--blocks", default="", help="blocks per request, e.g. 1,16,256,4096")
    ap.add_argument("--max-mib", type=int, default=0, help="skip cells above this many MiB per request (default 256)")
    ap.add_argument("--reps", type=int, default=0, help="rounds (default 7, quick 3)")
    add_common_args(ap)
    args = ap.parse_args(argv)
    bls = parse_sizes(args.block_lens) if args.block_lens else (QUICK_BLOCK_LENS if args.quick else BLOCK_LENS)
    blocks = [int(x) for x in args.blocks.split(",")] if args.blocks else (QUICK_BLOCKS if args.quick else BLOCKS)
    max_bytes = args.max_mib * cm.MiB if args.max_mib else (QUICK_MAX_BYTES if args.quick else MAX_BYTES)
    reps = args.reps or (3 if args.quick else 7)
    cleanup_segments(cm.SHM_PREFIX)
    info = cm.machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load average {info['loadavg_start']}", flush=True)
    res = run(cells_for(bls, blocks, max_bytes), reps, args.poll_us * 1e-6, peer_cfg_from(args),
              args.daemon_arg, dict(e.split("=", 1) for e in args.env) or None, progress=not args.no_progress,
              daemon_set=args.daemon_set)
    res["machine"] = info
    res["command"] = " ".join([os.path.basename(sys.argv[0]), *(argv if argv is not None else sys.argv[1:])])
    print(table(res))
    g = goals(res)
    res["goals"] = g
    print(f"(a)/(b) for blocks >= 64 KiB: min {g['a_over_b_min_ge64k']:.2f}, median {g['a_over_b_median_ge64k']:.2f}"
          f" ({g['a_over_b_cells_met']} cells >= 0.97); (a)/(c) >= 0.7 in {g['a_over_c_cells_met']} cells")
    print(f"load average {res['loadavg_start']} -> {res['loadavg_end']}, {res['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
