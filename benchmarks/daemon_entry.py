"""``python -m benchmarks.daemon_entry [--trace] [--set module.ATTR=value ...] serve ...``

Runs ``kvd`` in this process after two optional changes, for benchmarks only:

- ``--trace``: installs a :mod:`kvd.tracepoints` sink that prints one line
  per hit on stderr, ``HIT <point> <request id|-> <detail|-> <perf_counter>``
  (``time.perf_counter`` is CLOCK_MONOTONIC, so comparable with the engine
  process's clock); :mod:`benchmarks.trace` joins them with the engine's times.
- ``--set module.ATTR=value``: sets a module-level constant that has no
  setting of its own (e.g. the NIXL progress thread off:
  ``--set kvd.core.nixl_agent.PROGRESS_US=0``); a value is parsed as a
  Python literal. Settings of ``kvd serve`` are flags, not ``--set``.

:func:`entry` builds the ``python`` arguments that start a daemon this way
(``kvd.testing.daemons.start_daemon(..., entry=...)``).
"""

from __future__ import annotations

import ast
import importlib
import sys

from kvd import tracepoints


def entry(sets=(), trace: bool = False, tree: str = "") -> tuple[str, ...]:
    """What python runs to start a daemon with these ``--set`` assignments
    (and ``--trace``): plain ``-m kvd.cli`` when there is nothing to change.

    ``tree``: a checkout of kvd (e.g. ``git worktree add /tmp/base HEAD~3``)
    whose daemon code runs instead of this one's, for a before/after run in
    one benchmark (``benchmarks.variants``: ``--variant 'before=tree:/tmp/base'``);
    that checkout must have this module."""
    flags = (*(("--trace",) if trace else ()), *[x for a in sets for x in ("--set", a)])
    if tree:
        boot = (f"import sys; sys.path.insert(0, {str(tree)!r}); from benchmarks.daemon_entry import main; "
                f"sys.exit(main(sys.argv[1:]))")
        return ("-c", boot, *flags)
    if not flags:
        return ("-m", "kvd.cli")
    return ("-m", "benchmarks.daemon_entry", *flags)


def apply(assignment: str) -> None:
    """Applies one ``module.ATTR=value``: imports ``module`` (the longest
    importable prefix) and sets its attribute ``ATTR`` to ``value`` parsed as
    a Python literal. Raises ImportError when no prefix imports,
    ValueError/SyntaxError for a value that is not a literal, AttributeError
    when ``ATTR`` is not an existing module-level name (a typo must not pass
    silently)."""
    target, _, value = assignment.partition("=")
    module, _, attr = target.rpartition(".")
    val = ast.literal_eval(value)
    try:
        obj = importlib.import_module(module)
    except ImportError:
        raise ImportError(f"no module {module!r} in {target!r}") from None
    if not hasattr(obj, attr):
        raise AttributeError(f"{module} has no {attr!r}")
    setattr(obj, attr, val)


def print_hit(point: str, request_id: str, detail: str, t: float) -> None:
    """The ``--trace`` sink: one ``HIT`` line per trace point on stderr."""
    print(f"HIT {point} {request_id or '-'} {detail or '-'} {t:.6f}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    """Applies the leading ``--trace`` / ``--set ASSIGNMENT`` options, then runs
    ``kvd`` with the rest of ``argv``; returns its exit code."""
    while argv[:1] in (["--set"], ["--trace"]):
        if argv[0] == "--trace":
            tracepoints.install(print_hit)
            argv = argv[1:]
            continue
        apply(argv[1])
        argv = argv[2:]
    from kvd.cli import main as kvd_main

    return kvd_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
