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
    """Logs, per load, when it reached the core, its post and its event
    (``TRACE`` lines on stderr, ``time.perf_counter`` = CLOCK_MONOTONIC, so
    comparable with the engine process's clock): ``kvd.bench.trace``."""
    import time

    from kvd.core import node as core
    from kvd.daemon import engine_service as es

    pc = time.perf_counter
    loads: dict[str, float] = {}
    posts: list[tuple[float, float, str]] = []
    orig_load, orig_post, orig_pb = core.Node.load, core.Node._post, es.event_to_pb

    async def load(self, w, request_id, *a, **k):
        loads[request_id] = pc()
        return await orig_load(self, w, request_id, *a, **k)

    def post(self, agent, op, *a):
        t0 = pc()
        r = orig_post(self, agent, op, *a)
        posts.append((t0, pc(), r[1]))
        return r

    def event_to_pb(ev):
        rid = getattr(ev, "request_id", None)
        t = loads.pop(rid, None)
        if t is not None and posts:
            p0, p1, st = posts[-1]
            posts.clear()
            print(f"TRACE {rid} load {t:.6f} post {p0:.6f} posted {p1:.6f} state {st} event {pc():.6f}",
                  file=sys.stderr, flush=True)
        return orig_pb(ev)

    core.Node.load, core.Node._post, es.event_to_pb = load, post, event_to_pb

    # Finer legs (issue 5): when the engine socket's gate got bytes from an
    # engine (GATEIN) and from gRPC towards an engine (GATEOUT), and when the
    # session reader had a load command in hand (READ).
    from kvd.daemon import local_gate as lg

    orig_front, orig_relay, orig_groups = lg._Front.data_received, lg._Relay.data_received, es.groups_from_pb

    def front_received(self, data):
        print(f"GATEIN {pc():.6f}", file=sys.stderr, flush=True)
        return orig_front(self, data)

    def relay_received(self, data):
        if not isinstance(self, lg._Front):
            print(f"GATEOUT {pc():.6f}", file=sys.stderr, flush=True)
        return orig_relay(self, data)

    def groups_from_pb(*a):
        print(f"READ {pc():.6f}", file=sys.stderr, flush=True)
        return orig_groups(*a)

    lg._Front.data_received, lg._Relay.data_received, es.groups_from_pb = front_received, relay_received, groups_from_pb


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
