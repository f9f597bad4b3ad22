"""What a native data path would buy: the CPU per one-block load of NIXL
driven from C (no Python anywhere), of plain NIXL driven from Python, and of
kvd (one P and one D daemon), for the same batches of 64 one-block READs
with a notification each (``kvd bench``'s throughput case).

    .venv/bin/python -m benchmarks.native_floor [--seconds 5] [--rounds 3] [--json FILE]

The native case is ``benchmarks/native/nixl_reads.c``, built here with the C
compiler (``$CC``, else ``cc``) against the nixl wheel's own
``libnixl_capi.so`` (NIXL's C API) into ``build/native/``. Both NIXL cases
run twice: with the agents vLLM's NixlConnector makes (NIXL's progress
thread spinning, ``pthrDelay`` 0; UCX ``num_threads`` 4) and with the ones
kvd's daemons make (the progress thread sleeping in ``poll()`` up to
``kvd.core.nixl_agent.PROGRESS_US``; the backend's default threads); with
kvd's agents once more with each batch as one transfer (``coalesced``: what
a decode daemon posts for small loads of one pass). CPU is
each process's user + system time over the window (every thread), divided
by the loads done in it; loads/s is the median batch's and the window's
(batches and the gaps between them: NIXL's spinning progress thread makes
some batches much slower than the median). Rounds alternate
the cases; the medians of the rounds are printed and written to ``--json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import time

from kvd.bench import common as cm
from kvd.bench.nixl_pair import NixlPair, PeerConfig
from kvd.bench.throughput import BLOCK_LEN, CONCURRENCY, nixl_batch, segments
from kvd.core.nixl_agent import PROGRESS_US

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "benchmarks" / "native" / "nixl_reads.c"
BINARY = ROOT / "build" / "native" / "nixl_reads"
NUM_BLOCKS = 128
#: (name, progress thread's poll timeout in us (0: it spins), UCX num_threads (0: the backend's default))
AGENTS = (("vLLM NixlConnector's agents", 0, 4), ("kvd's agents", PROGRESS_US, 0))


class BuildError(RuntimeError):
    """The native benchmark could not be built (no C compiler, no NIXL C API)."""


def capi_dir() -> str:
    """The directory of the ``libnixl_capi.so`` that ships with the nixl
    wheel kvd imports (``nixl_cu13`` or ``nixl_cu12``: meson-python puts a
    wheel's libraries in ``site-packages/.<package>.mesonpy.libs``).
    Raises BuildError when there is none."""
    from kvd.core.nixl_agent import _nixl

    agent_cls, _ = _nixl()
    package = agent_cls.__module__.split(".")[0]
    site = pathlib.Path(sys.modules[package].__file__).resolve().parent.parent
    found = glob.glob(str(site / f".{package}.mesonpy.libs" / "libnixl_capi.so"))
    if not found:
        raise BuildError(f"no libnixl_capi.so beside {package} in {site}")
    return os.path.dirname(found[0])


def build(cc: str | None = None) -> str:
    """Compiles :data:`SOURCE` into :data:`BINARY` (again when the source is
    newer); returns the binary's path. Raises BuildError (no compiler, or the
    compiler's message)."""
    cc = cc or os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise BuildError(f"no C compiler ({cc!r} not found; set CC)")
    libdir = capi_dir()
    stamp = BINARY.with_suffix(".libdir")  # the library it was linked against (its rpath)
    if (BINARY.exists() and BINARY.stat().st_mtime >= SOURCE.stat().st_mtime and stamp.exists()
            and stamp.read_text() == libdir):
        return str(BINARY)
    BINARY.parent.mkdir(parents=True, exist_ok=True)
    tmp = BINARY.with_name(f"{BINARY.name}.{os.getpid()}.tmp")  # built aside, then renamed: no half-written binary
    try:
        r = subprocess.run([cc, "-O2", "-Wall", "-o", str(tmp), str(SOURCE), f"-L{libdir}", "-l:libnixl_capi.so",
                            f"-Wl,-rpath,{libdir}", "-lm"], capture_output=True, text=True)
        if r.returncode:
            raise BuildError(f"{cc} failed:\n{r.stderr.strip()}")
        os.replace(tmp, BINARY)
        stamp.write_text(libdir)
    finally:
        tmp.unlink(missing_ok=True)
    return str(BINARY)


def native(binary: str, seconds: float, progress_us: int, num_threads: int, batch: int = CONCURRENCY,
           block_len: int = BLOCK_LEN, num_blocks: int = NUM_BLOCKS) -> dict:
    """One run of the native benchmark ``binary`` (:func:`build`'s), its JSON
    line as a dict. Raises RuntimeError with its stderr when it fails."""
    r = subprocess.run([binary, str(seconds), str(batch), str(block_len), str(num_blocks), str(progress_us),
                        str(num_threads)], capture_output=True, text=True, timeout=seconds + 120)
    if r.returncode:
        raise RuntimeError(f"nixl_reads exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout)


def plain(seconds: float, progress_us: int, num_threads: int, batch: int = CONCURRENCY,
          block_len: int = BLOCK_LEN, poll_s: float = 50e-6, coalesced: bool = False) -> dict:
    """Batches of ``batch`` one-block READs between two plain-NIXL Python
    processes (:class:`kvd.bench.nixl_pair.NixlPair`, as ``kvd bench``'s
    throughput case), for ``seconds`` after 3 untimed batches: loads/s
    (median batch) and each process's CPU per load (us). ``coalesced``:
    each batch is one transfer of ``batch`` blocks whose notification holds
    a piece per load (``kvd.core.leases.notif_message``), as a decode daemon
    posts small loads of one pass (``kvd.core.coalesce``)."""
    from kvd.core.leases import notif_message

    src, dst, ids = segments(batch, block_len, 1)
    pair = None
    merged = [(list(range(batch)), list(range(batch, 2 * batch)),
               b"".join(notif_message(f"req-{i}", 1) for i in range(batch)))]

    def one() -> float:
        if not coalesced:
            return nixl_batch(pair, block_len, src.size, ids, batch, poll_s)[0]
        return max(pair.read_many(pair.prep(block_len, src.size // block_len), merged, poll_s))

    try:
        pair = NixlPair(src.name, src.size, dst.name, dst.size,
                        PeerConfig(pthr_delay_us=progress_us, num_threads=num_threads))
        for _ in range(3):
            one()
        pids = (pair.reader.pid, pair.source.pid)
        c0 = [cm.cpu_seconds(p) for p in pids]
        t0 = time.monotonic()
        walls = []
        while time.monotonic() - t0 < seconds:
            walls.append(one())
        elapsed = time.monotonic() - t0
        c1 = [cm.cpu_seconds(p) for p in pids]
    finally:
        if pair is not None:
            pair.close()
        src.close()
        dst.close()
    n = batch * len(walls)
    return dict(loads=n, seconds=elapsed, loads_s=n / elapsed, median_batch_loads_s=batch / cm.median(walls),
                reader_cpu_us_per_load=(c1[0] - c0[0]) / n * 1e6, source_cpu_us_per_load=(c1[1] - c0[1]) / n * 1e6)


def run(seconds: float, rounds: int) -> dict:
    """``rounds`` rounds of every case, alternating; the medians per case."""
    from benchmarks import cpu_per_load

    binary = build()
    runs: dict[str, list[dict]] = {}
    for r in range(rounds):
        for name, progress_us, threads in AGENTS:
            runs.setdefault(f"NIXL from C, {name}", []).append(native(binary, seconds, progress_us, threads))
            runs.setdefault(f"NIXL from Python, {name}", []).append(plain(seconds, progress_us, threads))
        runs.setdefault("NIXL from Python, kvd's agents, coalesced", []).append(
            plain(seconds, PROGRESS_US, 0, coalesced=True))
        k = cpu_per_load.run(seconds)
        runs.setdefault("kvd (one P, one D daemon)", []).append(dict(
            loads=k["loads"], loads_s=k["loads"] / k["seconds"], median_batch_loads_s=k["loads_s_median"],
            reader_cpu_us_per_load=k["d_cpu_us"],
            source_cpu_us_per_load=k["p_cpu_us"], engine_cpu_us_per_load=k["engine_cpu_us"]))
        print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    keys = ("median_batch_loads_s", "loads_s", "reader_cpu_us_per_load", "source_cpu_us_per_load",
            "engine_cpu_us_per_load")
    summary = {case: {k: cm.median([x[k] for x in xs]) for k in keys if k in xs[0]} for case, xs in runs.items()}
    return dict(seconds=seconds, rounds=rounds, batch=CONCURRENCY, block_len=BLOCK_LEN, summary=summary, runs=runs,
                loadavg=os.getloadavg(), machine=cm.machine())


def text(res: dict) -> str:
    """The summary as a table: loads/s (the median batch's, and over the
    whole window: batches and the gaps between them), and CPU per load of
    the reader (D), the source (P) and, for kvd, the engine process."""
    rows = [f"{'case':<46} {'batch/s':>9} {'window/s':>9} {'reader us':>10} {'source us':>10} {'engine us':>10} "
            f"{'total us':>9}"]
    for case, s in res["summary"].items():
        eng = s.get("engine_cpu_us_per_load")
        total = s["reader_cpu_us_per_load"] + s["source_cpu_us_per_load"] + (eng or 0)
        rows.append(f"{case:<46} {s['median_batch_loads_s']:>9,.0f} {s.get('loads_s', 0):>9,.0f} "
                    f"{s['reader_cpu_us_per_load']:>10.1f} "
                    f"{s['source_cpu_us_per_load']:>10.1f} {'-' if eng is None else format(eng, '.1f'):>10} "
                    f"{total:>9.1f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.native_floor",
                                 description=__doc__.split("\n\n")[0].replace("``", ""))
    ap.add_argument("--seconds", type=float, default=5.0, help="timed window of each case (default 5)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every case (default 3)")
    ap.add_argument("--json", metavar="FILE", help="write the result here")
    args = ap.parse_args(argv)
    if not (math.isfinite(args.seconds) and 0 < args.seconds <= 3600) or args.rounds < 1:
        ap.error("--seconds must be a number in (0, 3600] and --rounds >= 1")
    out = None
    if args.json:  # opened first: a path that cannot be written is said before the run, not after it
        try:
            out = open(args.json, "w")
        except OSError as e:
            ap.error(f"--json {args.json}: {e.strerror or e}")
    try:
        res = run(args.seconds, args.rounds)
        print(text(res))
        if out is not None:
            json.dump(res, out, indent=1)
    except BuildError as e:
        print(f"native_floor: {e}", file=sys.stderr)
        return 1
    finally:
        if out is not None:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
