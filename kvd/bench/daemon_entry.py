"""``python -m kvd.bench.daemon_entry [--set module.ATTR=value ...] serve ...``

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


def main(argv: list[str]) -> int:
    while argv[:1] == ["--set"]:
        apply(argv[1])
        argv = argv[2:]
    from kvd.cli import main as kvd_main

    return kvd_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
