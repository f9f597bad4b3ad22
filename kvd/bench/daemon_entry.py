"""``python -m kvd.bench.daemon_entry [--trace] [--set module.ATTR=value ...] serve ...``

Runs ``kvd`` with module-level defaults changed first: how the benchmarks
compare daemon variants that have no setting of their own (e.g. the NIXL
progress thread off: ``--set kvd.core.nixl_agent.PROGRESS_US=0``, or the poll
intervals: ``--set kvd.core.node.Limits.poll_busy_s=0.0002``). Benchmarks
only; a value is parsed as a Python literal.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import sys


def apply(assignment: str) -> None:
    """Applies one ``module.ATTR=value`` (or ``module.Class.field=value``, a
    dataclass field default): imports the longest importable module prefix
    and sets the attribute to ``value`` parsed as a Python literal. Raises
    ImportError when no prefix imports, ValueError/SyntaxError for a value that
    is not a literal, AttributeError for an unknown attribute."""
    target, _, value = assignment.partition("=")
    parts = target.split(".")
    val = ast.literal_eval(value)
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:-1]:
            obj = getattr(obj, p)
        if dataclasses.is_dataclass(obj):  # a dataclass field default (e.g. Limits.poll_busy_s)
            obj.__dataclass_fields__[parts[-1]].default = val
            defaults = list(obj.__init__.__defaults__ or ())
            names = [f.name for f in dataclasses.fields(obj) if f.init]
            idx = names.index(parts[-1]) - (len(names) - len(defaults))
            defaults[idx] = val
            obj.__init__.__defaults__ = tuple(defaults)
        setattr(obj, parts[-1], val)
        return
    raise ImportError(f"no module in {target!r}")


def install_trace() -> None:
    """Records every trace point the daemon passes (``kvd.tracepoints``:
    the gate's bytes in and out, the session reader, the core's load, post
    and posted, the event) in memory, and writes them at exit as ``TP
    <point> <time> <request id> <detail>`` lines on stderr (``time.perf_counter``
    = CLOCK_MONOTONIC, comparable with the engine process's clock):
    ``kvd.bench.trace``. Nothing is printed on the hot path."""
    import atexit

    from kvd import tracepoints as tp

    hits: list[tuple[str, str, str, float]] = []

    def sink(point: str, request_id: str, detail: str, t: float) -> None:
        hits.append((point, request_id, detail, t))

    def dump() -> None:
        for point, rid, detail, t in hits:
            print(f"TP {point} {t:.6f} {rid or '-'} {detail or '-'}", file=sys.stderr)
        sys.stderr.flush()

    tp.install(sink)
    atexit.register(dump)


def main(argv: list[str]) -> int:
    """Applies the leading ``--trace`` / ``--set ASSIGNMENT`` options, then runs
    ``kvd`` with the rest of ``argv``; returns its exit code."""
    while argv[:1] in (["--set"], ["--trace"]):
        if argv[0] == "--trace":
            install_trace()
            argv = argv[1:]
            continue
        apply(argv[1])
        argv = argv[2:]
    from kvd.cli import main as kvd_main

    return kvd_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
