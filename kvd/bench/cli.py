"""``kvd bench``: a short run of benchmark 1 (data plane: kvd vs plain NIXL vs
memcpy, and the same-node copy of one daemon against memcpy), benchmark 2
(the shim's cost per engine step) and the throughput of 64 one-block loads
in flight (kvd vs plain NIXL), with a progress display; prints the figures
against the goals of docs/PERFORMANCE.md.

The full-size benchmarks are the ``benchmarks`` package (``python -m
benchmarks.<name>`` from the checkout's root).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys

from kvd.bench import common as cm
from kvd.bench.kvd_pair import HOLD_AHEAD_S
from kvd.testing.processes import KVD_ROOT
from kvd.testing.shm import cleanup_segments
from kvd.usage import EXIT_UNAVAILABLE, UsageParser, missing_modules

#: What every benchmark of ``kvd bench`` runs: kvd daemons (their NIXL
#: agents) and plain NIXL processes. A dependency of kvd, so missing only
#: where kvd was installed without its dependencies (``pip install
#: --no-deps``) or NIXL was removed.
BENCH_MODULES = ("nixl",)


def missing_line(missing: list[str]) -> str:
    """The one line ``kvd bench`` prints when ``missing`` modules are not
    installed: what is missing and how to install it. From a checkout:
    scripts/setup.sh (the CPU build of torch first, which NIXL's package
    requires). Otherwise kvd's own requirement on NIXL (its metadata's pin),
    for this interpreter."""
    what = (f"kvd bench: {', '.join(missing)} not installed (the benchmarks start kvd daemons and plain NIXL "
            f"processes)")
    setup = KVD_ROOT / "scripts" / "setup.sh"
    if setup.is_file() and (KVD_ROOT / "pyproject.toml").is_file():
        return f"{what}: run {setup}, which installs kvd with its dependencies, NIXL among them"
    try:
        requires = importlib.metadata.requires("kvd") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    pin = next((r.split(";")[0].strip() for r in requires if re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0] == "nixl"),
               "nixl")
    return f"{what}: install it into this environment: {sys.executable} -m pip install '{pin}'"


def main(argv: list[str] | None = None) -> int:
    """``kvd bench``: the short data-plane benchmark (kvd vs plain NIXL vs memcpy),
    unless ``--skip-step`` the shim's per-step cost, and the throughput of 64
    one-block loads in flight (kvd vs plain NIXL), with figures against
    docs/PERFORMANCE.md's goals. ``argv``: the arguments after ``bench``.
    Returns the exit code (64 on a usage error, 69 before anything starts
    when NIXL is not installed)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C: the pairs' and daemons' cleanup ran on the way out; no traceback
        import multiprocessing

        for child in multiprocessing.active_children():  # plain NIXL peers ignore SIGINT: stopped here
            child.kill()
            child.join(5)
        cleanup_segments(cm.SHM_PREFIX)
        print("\nkvd bench: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    """:func:`main` itself."""
    ap = UsageParser(  # usage errors exit 64, as every kvd command
        prog="kvd bench",
        description="Short benchmarks: (1) data plane, kvd vs plain NIXL vs memcpy; (1s) same-node copy, one "
                    "daemon for both engines vs memmove; (2) the shim's cost per engine step; (3) throughput, 64 "
                    "one-block loads in flight, kvd vs plain NIXL. Each prints its goals (docs/PERFORMANCE.md). "
                    "Starts its own daemons (and two plain NIXL processes) on this machine.")
    ap.add_argument("--quick", action="store_true", help="seconds, not minutes (a smoke test)")
    ap.add_argument("--skip-step", action="store_true",
                    help="skip (2), the shim's cost per engine step (it needs vLLM); (1), (1s) and (3) still run")
    ap.add_argument("--reps", type=int, default=None, metavar="N",
                    help="rounds of the data-plane cells (default 5, quick 2)")
    ap.add_argument("--small-load-reps", type=int, default=None, metavar="N",
                    help="more rounds of (a) and (b) alone on the small-load cell (16 x 64 KiB), whose goal is "
                         "the median of every round's ratio (default 20, quick 4)")
    ap.add_argument("--throughput-reps", type=int, default=None, metavar="N",
                    help="rounds of (3), 64 loads each (default 20, quick 5)")
    ap.add_argument("--hold-ahead-ms", type=float, default=HOLD_AHEAD_S * 1e3, metavar="MS",
                    help="the prefill hold of each kvd load is sent this long before the load, untimed, as "
                         "in serving (default %(default)g); 0: with the load, its way to the prefill daemon "
                         "timed too")
    ap.add_argument("--json", default="", metavar="FILE", help="write every figure here")
    ap.add_argument("--no-progress", action="store_true", help="no progress display")
    args = ap.parse_args(argv)
    if not 0 <= args.hold_ahead_ms <= 1000:
        ap.error("--hold-ahead-ms must be in 0..1000")
    for flag, value, least in (("--reps", args.reps, 1), ("--throughput-reps", args.throughput_reps, 1),
                               ("--small-load-reps", args.small_load_reps, 0)):
        if value is not None and value < least:
            ap.error(f"{flag} must be >= {least}")
    missing = missing_modules(BENCH_MODULES)
    if missing:  # else the first daemon's startup fails, and with it the run, in a traceback
        print(missing_line(missing), file=sys.stderr)
        return EXIT_UNAVAILABLE
    hold_ahead_s = args.hold_ahead_ms / 1e3
    progress = not args.no_progress

    from kvd.bench import dataplane, throughput

    cleanup_segments(cm.SHM_PREFIX)
    info = cm.machine()
    print(f"kvd bench on {info['cpu']} ({info['cores']} cores), load average "
          f"{' '.join(f'{x:.2f}' for x in info['loadavg_start'])}", flush=True)
    if args.quick:
        # 16 x 64 KiB: the small-load goal's cell.
        cells = dataplane.cells_for([64 * cm.KiB, 256 * cm.KiB], [16], 4 * cm.MiB)
    else:
        cells = dataplane.cells_for([64 * cm.KiB, cm.MiB], [16, 256], 256 * cm.MiB)
    reps = args.reps if args.reps is not None else (2 if args.quick else 5)
    out: dict = {"machine": info}
    small_reps = args.small_load_reps if args.small_load_reps is not None else (4 if args.quick else 20)
    dp = dataplane.run(cells, reps, progress=progress, title="(1) data plane", methods="abcsm",
                       hold_ahead_s=hold_ahead_s, small_load_reps=small_reps)
    out["dataplane"] = dp
    print("\n(1) data plane: (a) kvd daemons, (b) plain NIXL processes, (c) memcpy; medians of "
          f"{reps} interleaved rounds; each kvd load's hold sent {args.hold_ahead_ms:g} ms before it; "
          "a/b, a/c, b/c: ratios of GB/s (higher: the first is faster)")
    print(dataplane.table(dp))
    g = dataplane.goals(dp)
    split = (f" ({g['a_over_b_cells_split']} with rounds on both sides of 0.97: noise decides them, more --reps "
             f"tell)" if g["a_over_b_cells_split"] else "")
    print(f"    goals: (a)/(b) >= 0.97 for requests >= 1 MiB: {g['a_over_b_cells_met']} cells{split}; "
          f"(a)/(c) >= 0.7 (docs/PERFORMANCE.md, Summary): {g['a_over_c_cells_met']} cells")
    bl, nb = dataplane.SMALL_LOAD
    if g["small_load_met"] is not None:
        print(f"    goal small load ({nb} x {cm.fmt_bytes(bl)}), kvd time / plain NIXL time <= "
              f"{dataplane.SMALL_LOAD_GOAL}x: {'met' if g['small_load_met'] else 'NOT met'} "
              f"({g['small_load_a_time_over_b']:.2f}x: median of {g['small_load_rounds']} rounds' ratios, the "
              f"table's {reps} and {g['small_load_rounds'] - reps} more of (a) and (b) alone; rounds "
              f"{g['small_load_min']:.2f}-{g['small_load_max']:.2f}x)")
    out["dataplane_goals"] = g
    setup = dataplane.same_node_setup()
    out["same_node_setup"] = setup
    print(f"\n(1s) same node: (s) both engines on one kvd daemon (the daemon copies, {setup['daemon_copy_threads']} "
          f"thread(s)), against (m) a single-thread memcpy in one process ({setup['m']}), (c) and (a)")
    print(dataplane.same_node_table(dp))
    sm = [c["s_over_m"] for c in dp["cells"]]
    print(f"    goal (s)/(m) >= 0.8: {sum(x >= 0.8 for x in sm)}/{len(sm)} cells")
    rc = 0
    if not args.skip_step:
        from kvd.bench import step

        why = step.unavailable()
        if why:
            print(f"\n(2) engine step: skipped, {why}")
        else:
            st = step.run((0, 16) if args.quick else (0, 16, 256), steps=30 if args.quick else 200,
                          warmup=5 if args.quick else 20, unary_n=20 if args.quick else 100, progress=progress)
            out["engine_step"] = st
            print("\n(2) engine step: time in the shim per step (scheduler + worker calls)")
            print(step.table(st))
            sg = step.goals(st)
            u = st["unary_getstats"]
            print(f"    goal p50 <= 30 us, p99 <= 200 us: loads held in flight: "
                  f"{'met' if sg['held_met'] else 'NOT met'} (worst p50 {sg['held_p50_max_us']:.0f} us, p99 "
                  f"{sg['held_p99_max_us']:.0f} us); loads starting and ending every step: "
                  f"{'met' if sg['met'] else 'NOT met'} (worst p50 {sg['p50_max_us']:.0f} us, p99 "
                  f"{sg['p99_max_us']:.0f} us); one blocking unary RPC: p50 {u['p50_us']:.0f} us")
            print(f"    {step.goals_text(sg)}")
    else:
        print("\n(2) engine step: skipped (--skip-step)")
    treps = args.throughput_reps if args.throughput_reps is not None else (5 if args.quick else 20)
    tp = throughput.run(treps, progress=progress, hold_ahead_s=hold_ahead_s)
    out["throughput"] = tp
    print(f"\n(3) throughput: batches of {tp['concurrency']} concurrent one-block loads "
          f"({cm.fmt_bytes(tp['block_len'])}), median of {treps} rounds")
    print(throughput.text(tp))
    print(f"\nload average now {' '.join(f'{x:.2f}' for x in cm.loadavg())} (figures on a busy machine are noisy; "
          "see docs/PERFORMANCE.md for the full runs)")
    print("Goals NOT met here are kvd's open performance work, not a fault of this install: docs/PERFORMANCE.md's "
          "summary tables say where each stands and what holds it back.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
