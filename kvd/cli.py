"""The ``kvd`` command line: parses flags into one Config and calls the daemon,
the client or the demo. No logic of its own (settings, their sources and
precedence: kvd/config.py).

    kvd serve    run the daemon
    kvd health   exit 0 when a daemon is serving (for probes)
    kvd status   what a daemon holds (engines, leases, transfers)
    kvd demo     the main job: two daemons, two vLLM-CPU engines, P/D requests
    kvd bench    short benchmarks: kvd vs plain NIXL vs memcpy, the shim's step cost
    kvd version  print versions
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kvd import __version__
from kvd.config import ConfigError, client_socket, env_name, flag_name, load_config, setting_names, settings

EXIT_OK, EXIT_NOT_SERVING, EXIT_UNREACHABLE, EXIT_USAGE = 0, 1, 2, 64


def _target(args) -> str:
    # Status is served on the engine socket only (EngineService.GetStats);
    # health on both ports.
    if getattr(args, "address", ""):
        return args.address
    return f"unix:{args.socket}"


def cmd_serve(args) -> int:
    """``kvd serve``: loads the settings (flags > env > file > defaults) and runs
    the daemon until it stops. Returns 0, 64 for an invalid setting, 1 when
    startup fails (a port in use, a NIXL backend that does not load)."""
    # Only the flags the user gave (the others are argparse.SUPPRESS): they
    # override env and file; config.py parses and validates them.
    flags = {k: v for k, v in vars(args).items() if k in setting_names()}
    try:
        cfg = load_config(flags, file=args.config)
    except ConfigError as e:
        print(f"kvd serve: invalid setting: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.print_config:
        for w in cfg.warnings:
            print(f"kvd serve: warning: {w}", file=sys.stderr)
        sys.stdout.write(cfg.to_toml())
        return EXIT_OK
    from kvd.daemon.logs import configure
    from kvd.daemon.server import run

    configure(cfg.log_level, cfg.log_format)

    try:
        run(cfg)
    except ConfigError as e:  # a file a setting names (TLS, token) is missing or bad
        print(f"kvd serve: invalid setting: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        logging.getLogger("kvd").error("startup failed: %s", e)
        return 1
    except Exception as e:  # a NIXL backend that fails to load, say
        logging.getLogger("kvd").error("startup failed: %s", e)
        return 1
    return EXIT_OK


def cmd_health(args) -> int:
    """``kvd health``: gRPC health check of the daemon. Returns 0 serving, 1 not
    serving (draining, or an unknown ``--service``), 2 unreachable within
    ``--timeout`` seconds or refused."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = _target(args)
    try:
        with grpc.insecure_channel(target) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            # The daemon answered, but does not serve that service.
            print(f"kvd health: {target}: NOT_FOUND: no service {args.service!r} here (known: '' for the whole "
                  f"server, kvd.v1.EngineService, kvd.v1.PeerService)", file=sys.stderr)
            return EXIT_NOT_SERVING
        # Unreachable, past --timeout, or refused (PERMISSION_DENIED: this uid
        # is not admitted on the engine socket; UNAUTHENTICATED: TLS peer port).
        print(f"kvd health: {target}: {e.code().name}: {e.details()}", file=sys.stderr)
        return EXIT_UNREACHABLE
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    if r.status == health_pb2.HealthCheckResponse.SERVING:
        if not args.quiet:
            print(f"{target}: {name}")
        return EXIT_OK
    print(f"kvd health: {target}: {name}", file=sys.stderr)
    return EXIT_NOT_SERVING


def cmd_status(args) -> int:
    """``kvd status``: prints the daemon's GetStats (engine socket only) as text
    or ``--json``. Returns 0, or 2 when unreachable or refused."""
    import grpc

    from kvd.v1 import kvd_pb2, kvd_pb2_grpc

    target = _target(args)
    try:
        with grpc.insecure_channel(target) as ch:
            s = kvd_pb2_grpc.EngineServiceStub(ch).GetStats(kvd_pb2.StatsRequest(), timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"kvd status: {target}: {e.code().name}: {e.details()}", file=sys.stderr)
        return EXIT_UNREACHABLE
    from kvd.daemon.status import render, to_dict

    d = to_dict(s)
    if args.json:
        print(json.dumps(d, indent=2, sort_keys=True))
    else:
        print(render(d, target))
    return EXIT_OK


def cmd_version(args) -> int:
    """``kvd version``: prints kvd's version and those of nixl, grpcio and protobuf when installed. Returns 0."""
    print(f"kvd {__version__}")
    try:
        from importlib.metadata import version

        for pkg in ("nixl", "grpcio", "protobuf"):
            print(f"{pkg} {version(pkg)}")
    except Exception:
        pass
    return EXIT_OK


def cmd_bench(args) -> int:
    """``kvd bench``: runs ``kvd.bench.cli.main`` with the remaining arguments; returns its exit code."""
    from kvd.bench.cli import main as bench_main

    return bench_main(args.bench_args)


def cmd_demo(args) -> int:
    """``kvd demo``: runs ``kvd.demo.run.main`` with the remaining arguments; returns its exit code."""
    from kvd.demo.run import main as demo_main

    return demo_main(args.demo_args)


def _seconds(text: str) -> float:
    """argparse type of a deadline: a finite number of seconds > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be > 0 and finite")
    return v


def _metavar(key: str, default) -> str:
    if key.endswith("_s"):
        return "SECONDS"
    if key.endswith("_port"):
        return "PORT"
    if key.endswith(("_listen", "_advertise")):
        return "HOST:PORT"
    if isinstance(default, bool):
        return "true|false"
    if key.startswith("max_") and not key.endswith("_bytes"):
        return "N"
    if isinstance(default, list):
        return "LIST"
    return "PATH" if key.endswith("socket") else key.rsplit("_", 1)[-1].upper()


class UsageParser(argparse.ArgumentParser):
    """argparse with usage errors exiting EXIT_USAGE (64, sysexits' EX_USAGE),
    not argparse's 2, which ``kvd health`` uses for "unreachable"."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``kvd`` argument parser: one ``serve`` flag per setting of kvd/config.py
    (default SUPPRESS, so env and file still apply), and the health, status,
    demo, bench and version subcommands. Usage errors exit 64."""
    p = UsageParser(
        prog="kvd",
        description="kvd: per-node KV-cache transfer daemon for disaggregated prefill/decode serving.",
    )
    p.add_argument("--version", action="version", version=f"kvd {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=UsageParser)

    s = sub.add_parser("serve", help="run the daemon",
                       description="Run the kvd daemon: EngineService on a Unix socket for local engines, "
                                   "PeerService on TCP for remote daemons, gRPC health on both.")
    s.add_argument("--config", metavar="FILE", default=None,
                   help="TOML file of settings (env KVD_CONFIG); flags > KVD_* env > file > defaults")
    s.add_argument("--print-config", action="store_true",
                   help="print the effective settings as TOML, each with its source, and exit")
    # One flag per setting of kvd/config.py, default SUPPRESS: a flag not
    # given leaves the key to the environment, the file or the default.
    for f in settings():
        default = f.default_factory() if callable(f.default_factory) else f.default
        shown = (",".join(default) if isinstance(default, list) else
                 str(default).lower() if isinstance(default, bool) else default)
        shown = shown if shown != "" else '""'
        s.add_argument(flag_name(f.name), dest=f.name, default=argparse.SUPPRESS, metavar=_metavar(f.name, default),
                       help=f"{f.metadata['doc']} (default {shown}; env {env_name(f.name)})")
    s.set_defaults(func=cmd_serve)

    for name, func, helptext in (
        ("health", cmd_health, "exit 0 when the daemon is serving, 1 when not serving (draining, or an unknown "
                               "--service), 2 when unreachable within --timeout or refused (this uid not "
                               "admitted), 64 on a usage error"),
        ("status", cmd_status, "show what the daemon holds: engines, regions, peers, leases, transfers"),
    ):
        c = sub.add_parser(name, help=helptext, description=helptext)
        c.add_argument("--socket", default=client_socket(), metavar="PATH",
                       help="the daemon's engine socket (default: $KVD_ENGINE_SOCKET or %(default)s)")
        if name == "health":
            c.add_argument("--address", default="", metavar="HOST:PORT",
                           help="ask over TCP (the peer port) instead of the Unix socket")
        c.add_argument("--timeout", type=_seconds, default=2.0, metavar="SECONDS", help="deadline (default 2)")
        if name == "health":
            c.add_argument("--service", default="", help="service name to check (default: the whole server)")
            c.add_argument("-q", "--quiet", action="store_true", help="print nothing when serving")
        else:
            c.add_argument("--json", action="store_true", help="machine-readable output")
        c.set_defaults(func=func)

    d = sub.add_parser("demo", help="the main job: a real P/D transfer between two daemons and two vLLM-CPU engines",
                       description="Run the demo; arguments after 'demo' go to it (kvd demo --help).",
                       add_help=False)
    d.add_argument("demo_args", nargs=argparse.REMAINDER)
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="short benchmarks: data plane (kvd vs plain NIXL vs memcpy) and the shim's "
                                     "cost per engine step, with the ratios",
                       description="Run the short benchmarks; arguments after 'bench' go to them (kvd bench --help).",
                       add_help=False)
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)

    v = sub.add_parser("version", help="print versions")
    v.set_defaults(func=cmd_version)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvd``: ``argv`` without the program name (default
    ``sys.argv[1:]``); ``bench`` and ``demo`` hand the rest to their own
    parsers. Returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        from kvd.bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["demo"]:
        # Everything after "demo" belongs to the demo's own parser (argparse's
        # REMAINDER would not take leading options such as --help).
        from kvd.demo.run import main as demo_main

        return demo_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
