"""``python -m benchmarks.daemon_entry [--trace] [--set module.ATTR=value ...] serve ...``

Runs ``kvd`` in this process after two optional changes, for benchmarks only:

- ``--trace``: installs a :mod:`kvd.tracepoints` sink that keeps every hit
  in memory and, when the daemon stops, prints one line per hit on stderr,
  ``HIT <point> <request id|-> <detail|-> <perf_counter>``
  (``time.perf_counter`` is CLOCK_MONOTONIC, so comparable with the engine
  process's clock); :mod:`benchmarks.trace` joins them with the engine's times.
  Kept, not printed as they come: a flushed line per hit was a ``write`` on
  the daemon's loop at every point, which the legs then counted.
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


_HITS: list[tuple[str, str, str, float]] = []


def keep_hit(point: str, request_id: str, detail: str, t: float) -> None:
    """The ``--trace`` sink: keeps the hit (a list append, safe from any
    thread under the GIL) for :func:`print_hits`."""
    _HITS.append((point, request_id, detail, t))


def print_hits() -> None:
    """Prints the hits kept so far, one ``HIT`` line each, on stderr, and forgets them."""
    hits = _HITS[:]
    del _HITS[:len(hits)]
    sys.stderr.write("".join(f"HIT {p} {r or '-'} {d or '-'} {t:.6f}\n" for p, r, d, t in hits))
    sys.stderr.flush()


def main(argv: list[str]) -> int:
    """Applies the leading ``--trace`` / ``--set ASSIGNMENT`` options, then runs
    ``kvd`` with the rest of ``argv``; returns its exit code."""
    while argv[:1] in (["--set"], ["--trace"]):
        if argv[0] == "--trace":
            tracepoints.install(keep_hit)
            argv = argv[1:]
            continue
        apply(argv[1])
        argv = argv[2:]
    from kvd.cli import main as kvd_main

    try:
        return kvd_main(argv)
    finally:
        print_hits()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
