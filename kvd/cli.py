"""The ``kvd`` command line: parses flags into one Config and calls the daemon,
the health and status checks, the benchmarks or the demo. No logic of its
own (settings, their sources, precedence and help: kvd/config.py; what
health and status ask and the exit codes: kvd/ops.py, kvd/usage.py).

    kvd serve    run the daemon
    kvd health   exit 0 when a daemon is serving (for probes)
    kvd status   what a daemon holds (engines, leases, transfers)
    kvd demo     the main job: two daemons, two vLLM-CPU engines, P/D requests
    kvd bench    short benchmarks: kvd vs plain NIXL vs memcpy, same-node copy, step cost, throughput
    kvd version  print versions
"""

from __future__ import annotations

import argparse
import os
import logging
import platform
import sys

from kvd import __version__, ops
from kvd.addresses import join_host_port, socket_file, split_host_port
from kvd.config import (DEFAULT_SOCKET, ENV_CONFIG_FILE, ConfigError, client_socket_problem, client_socket_source,
                        env_name, env_value, flag_name, help_text, load_config, metavar, setting_names, settings)
from kvd.usage import EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, UsageParser, positive


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
        # The files the settings name (TLS, token) are read as serve would:
        # a configuration the daemon would refuse is not reported as good.
        from kvd.daemon.peer_auth import PeerAuth, secret_file_warnings

        try:
            auth = PeerAuth.from_config(cfg)
        except ConfigError as e:
            print(f"kvd serve: invalid setting: {e}", file=sys.stderr)
            return EXIT_USAGE
        for w in secret_file_warnings(cfg):  # as serve logs them first
            print(f"kvd serve: warning: {w}", file=sys.stderr)
        from kvd.addresses import is_loopback, split_host_port

        host = split_host_port(cfg.peer_listen)[0]
        if not (auth.secured or cfg.peer_insecure or is_loopback(host)):
            # What serve would log at startup (kvd.daemon.server._peer_host).
            print(f"kvd serve: warning: peer_listen {cfg.peer_listen} with no peer authentication (no "
                  f"peer_tls_*, no peer_token_file): the daemon will bind loopback instead, out of other "
                  f"nodes' reach (docs/SECURITY.md)", file=sys.stderr)
        return EXIT_OK
    from kvd.daemon.logs import configure
    from kvd.daemon.server import StartupFailed, run

    configure(cfg.log_level, cfg.log_format)

    try:
        run(cfg)
    except ConfigError as e:  # a file a setting names (TLS, token) is missing or bad
        print(f"kvd serve: invalid setting: {e}", file=sys.stderr)
        return EXIT_USAGE
    except StartupFailed:  # logged by the daemon, before its release
        return 1
    except Exception as e:  # before startup (the event loop's own set-up)
        logging.getLogger("kvd").error("startup failed: %s", e)
        return 1
    return EXIT_OK


def _print(answer: ops.Answer, quiet: bool = False) -> int:
    """Prints an :class:`ops.Answer` (stdout when ok, stderr otherwise); returns its exit code."""
    if answer.code != EXIT_OK:
        print(answer.text, file=sys.stderr)
    elif not quiet:
        print(answer.text)
    return answer.code


def _engine_socket(args) -> tuple[str, str] | None:
    """The engine socket a client subcommand asks and where it came from:
    ``--socket`` (source ``flag --socket``), else
    :func:`kvd.config.client_socket_source` (``$KVD_ENGINE_SOCKET``, else the
    ``engine_socket`` of ``--config``'s file, else the default). Prints the
    error and returns None when that file is unreadable or its
    ``engine_socket`` invalid, or the path is longer than a Unix socket's
    (the caller exits 64)."""
    try:
        found = ((socket_file(args.socket), "flag --socket") if args.socket is not None
                 else client_socket_source(file=args.config))
    except ConfigError as e:
        print(f"kvd {args.command}: {e}", file=sys.stderr)
        return None
    problem = client_socket_problem(found[0])  # else gRPC prints its own parse errors, or dials another path
    if problem:
        print(f"kvd {args.command}: {problem}", file=sys.stderr)
        return None
    return found


def _say_origin(answer: ops.Answer, path: str, source: str, args) -> ops.Answer:
    """``answer`` with where the engine socket ``path`` came from added to
    its message when no daemon was reached there and the source is one the
    user may not have in mind: ``$KVD_ENGINE_SOCKET``, which takes
    precedence over ``--config`` (the message's own advice, to name the
    config file, would then change nothing), a file ``$KVD_CONFIG``
    named, or ``--config``'s file (whose naming the message advises: it
    says the path came from there). Other answers, and a path from
    ``--socket`` or the default, are returned as they are."""
    if answer.code != EXIT_UNREACHABLE:
        return answer
    var, named = env_name("engine_socket"), env_value(os.environ, ENV_CONFIG_FILE)
    if source == f"env {var}":
        file = f"--config {args.config}" if args.config else f"${ENV_CONFIG_FILE} ({named})" if named else ""
        note = (f"{path} is from ${var}, which takes precedence over --config and ${ENV_CONFIG_FILE}"
                + (f": unset it to ask the engine_socket of {file}" if file else ""))
    elif named and source == f"file {named}, named by env {ENV_CONFIG_FILE}":
        note = f"{path} is the engine_socket of {named}, the file ${ENV_CONFIG_FILE} names"
    elif args.config and source.startswith("file ") and ", named by" not in source:
        # The message's advice, to name a config file, is what the user did:
        # say what that file gave.
        note = f"{path} is the engine_socket of {source.removeprefix('file ')}: is its daemon running?"
    else:
        return answer
    return ops.Answer(answer.code, f"{answer.text}; {note}")


def cmd_health(args) -> int:
    """``kvd health``: gRPC health check of the daemon (:func:`kvd.ops.health`).
    Returns 0 serving, 1 not serving (draining, or an unknown ``--service``),
    2 unreachable within ``--timeout`` seconds or refused, 64 when ``--socket``
    or ``--config`` is given with ``--address`` (one target per check), or
    ``--config``'s file is unreadable or names an invalid engine socket."""
    if args.address is not None:
        for flag, given in (("--socket", args.socket), ("--config", args.config)):
            if given is not None:
                print(f"kvd health: error: {flag} and --address are mutually exclusive (one daemon per check: "
                      f"{flag} finds its engine socket, --address asks its peer port)", file=sys.stderr)
                return EXIT_USAGE
        return _print(ops.health(ops.target("", args.address), args.service, args.timeout), args.quiet)
    found = _engine_socket(args)
    if found is None:
        return EXIT_USAGE
    answer = ops.health(ops.target(found[0]), args.service, args.timeout)
    return _print(_say_origin(answer, *found, args), args.quiet)


def dial_address(text: str) -> str:
    """An argparse ``type`` for ``--address``: ``host:port`` with a port
    1..65535 (:func:`kvd.addresses.split_host_port`); anything else is a usage
    error (exit 64), not a dial to gRPC's default port 443. Returns it as
    gRPC reads it: an IPv6 host in brackets, as ``kvd serve`` reads
    ``peer_listen`` (gRPC took ``::1:7712`` for host ``::1:7712``, port 443)."""
    try:
        host, port = split_host_port(text, "--address", min_port=1)
    except ValueError as e:
        # argparse names the option itself ("argument --address: ...").
        raise argparse.ArgumentTypeError(str(e).removeprefix("--address: ")) from None
    return join_host_port(host, port)


def cmd_status(args) -> int:
    """``kvd status``: prints the daemon's GetStats (engine socket only) as text
    or ``--json`` (:func:`kvd.ops.status`). Returns 0, 2 when unreachable or
    refused, 64 when ``--config``'s file is unreadable or names an invalid
    engine socket."""
    found = _engine_socket(args)
    if found is None:
        return EXIT_USAGE
    return _print(_say_origin(ops.status(ops.target(found[0]), args.timeout, args.json), *found, args))


def cmd_version(args) -> int:
    """``kvd version``: prints kvd's version, those of nixl, grpcio and protobuf (``nixl not
    installed`` for one that is missing: the others are still listed), Python's, and whether kvd's
    native row copy was built (``kvd.core._rowcopy``). Returns 0."""
    from importlib.metadata import PackageNotFoundError, version

    print(f"kvd {__version__}")
    for pkg in ("nixl", "grpcio", "protobuf"):
        try:
            print(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            print(f"{pkg} not installed")
    print(f"python {platform.python_version()}")
    # kvd's one native piece (setup.py builds it where a C compiler is found):
    # imported, as the daemon does, not just looked for (a file that does not
    # load is no native copy).
    try:
        from kvd.core import _rowcopy

        del _rowcopy  # whether it loads is the answer
        native = "yes"
    except ImportError as e:
        native = (f"no ({e}; kvd was installed without a C compiler, or its build failed: same-node copies "
                  "run one memmove a row on one thread)")
    print(f"native row copy: {native}")
    return EXIT_OK


# kvd health's and kvd status's help: where the engine socket comes from.
#: ``kvd serve --help``'s groups of setting flags: the first setting of each
#: group (in ``kvd.config.Config``'s order, which the groups follow) and its title.
SERVE_FLAG_GROUPS = {
    "engine_socket": "where it listens",
    "lease_s": "leases, deadlines and polling (seconds)",
    "transfer_mode": "how blocks move",
    "engine_socket_group": "local engines: who may use the engine socket",
    "peer_tls_cert": "remote daemons: who may use the peer port, and which to pair with",
    "max_message_bytes": "bounds (per worker, per caller uid, per daemon)",
    "log_level": "logging",
}

CLIENT_SOCKET_EPILOG = ("The engine socket asked is, first found: --socket; $KVD_ENGINE_SOCKET; engine_socket in "
                        "the --config file (or the file $KVD_CONFIG names), as `kvd serve` reads them; "
                        f"{DEFAULT_SOCKET}. A daemon started with `kvd serve --config /etc/kvd/kvd.toml` "
                        "(the systemd unit, the image) is found with --config /etc/kvd/kvd.toml.")


# Engines are configured on their side, not by these flags: say where.
ENGINE_SIDE_EPILOG = ("Engines: vLLM loads kvd's connector with --kv-transfer-config "
                      "'{\"kv_connector\": \"KvdConnector\", \"kv_connector_module_path\": \"kvd.shim.vllm\", ...}'; its "
                      "settings (kvd_socket, this daemon's engine socket; kvd_data_path, kvd_lease_s, ...) are "
                      "kv_connector_extra_config keys, listed in docs/OPERATIONS.md \"The engine's connector\".")


def build_parser() -> argparse.ArgumentParser:
    """The ``kvd`` argument parser: one ``serve`` flag per setting of kvd/config.py
    (default SUPPRESS, so env and file still apply), and the health, status,
    demo, bench and version subcommands. Usage errors exit 64."""
    p = UsageParser(
        prog="kvd",
        description="kvd: per-node KV-cache transfer daemon for disaggregated prefill/decode serving.",
        epilog=ENGINE_SIDE_EPILOG,
    )
    p.add_argument("--version", action="version", version=f"kvd {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=UsageParser)

    s = sub.add_parser("serve", help="run the daemon",
                       description="Run the kvd daemon: EngineService on a Unix socket for local engines, "
                                   "PeerService on TCP for remote daemons, gRPC health on both.",
                       epilog=ENGINE_SIDE_EPILOG,
                       flag_hints={"--socket": "--engine-socket (kvd status and kvd health call it --socket)"})
    s.add_argument("--config", metavar="FILE", default=None,
                   help="TOML file of settings (env KVD_CONFIG); flags > KVD_* env > file > defaults")
    s.add_argument("--print-config", action="store_true",
                   help="print the effective settings as TOML, each with its source, and exit "
                        "(64 when a file a setting names, TLS or token, is missing or bad)")
    # One flag per setting of kvd/config.py, default SUPPRESS: a flag not
    # given leaves the key to the environment, the file or the default. In
    # groups (SERVE_FLAG_GROUPS): sixty flags in one list were a wall (a
    # new-user trial).
    group = s
    for f in settings():
        if f.name in SERVE_FLAG_GROUPS:
            group = s.add_argument_group(SERVE_FLAG_GROUPS[f.name])
        group.add_argument(flag_name(f.name), dest=f.name, default=argparse.SUPPRESS, metavar=metavar(f.name),
                           help=help_text(f.name))
    s.set_defaults(func=cmd_serve, parser=s)

    for name, func, helptext in (
        ("health", cmd_health, "exit 0 when the daemon is serving, 1 when not serving (draining, or an unknown "
                               "--service), 2 when unreachable within --timeout or refused (this uid not "
                               "admitted), 64 on a usage error (or a --config file it cannot use)"),
        ("status", cmd_status, "show what the daemon holds: engines, regions, peers, leases, transfers"),
    ):
        c = sub.add_parser(name, help=helptext, description=helptext, epilog=CLIENT_SOCKET_EPILOG)
        # None marks "not given": the socket is then found as the daemon
        # finds it (kvd.config.client_socket), and for health --socket or
        # --config with --address is refused while $KVD_ENGINE_SOCKET or
        # $KVD_CONFIG (defaults) with --address is not.
        c.add_argument("--socket", default=None, metavar="PATH",
                       help=f"the daemon's engine socket (default: $KVD_ENGINE_SOCKET, else engine_socket in the "
                            f"--config file, else {DEFAULT_SOCKET}); a relative path is taken from here; unix:PATH as "
                            f"kvd health prints it works too")
        c.add_argument("--config", default=None, metavar="FILE",
                       help="the daemon's TOML config file, as given to `kvd serve --config` (default: "
                            "$KVD_CONFIG): its engine_socket is the socket asked when neither --socket nor "
                            "$KVD_ENGINE_SOCKET is given; its other settings are not read (a key kvd serve does not know "
                            "is refused, as kvd serve refuses it)"
                       + ("; not with --address" if name == "health" else ""))
        if name == "health":
            c.add_argument("--address", default=None, metavar="HOST:PORT", type=dial_address,
                           help="ask over TCP (the peer port) instead of the Unix socket; not with --socket or "
                                "--config")
        c.add_argument("--timeout", type=positive(float), default=2.0, metavar="SECONDS", help="deadline (default 2)")
        if name == "health":
            c.add_argument("--service", default="", help="service name to check (default: the whole server)")
            c.add_argument("-q", "--quiet", action="store_true", help="print nothing when serving")
        else:
            c.add_argument("--json", action="store_true", help="machine-readable output")
        c.set_defaults(func=func, parser=c)

    # demo and bench are listed here for ``kvd --help`` only: main() hands
    # everything after them to their own parsers before this one runs.
    d = sub.add_parser("demo", help="the main job: a real P/D transfer between two daemons and two vLLM-CPU engines",
                       description="Run the demo; arguments after 'demo' go to it (kvd demo --help).",
                       add_help=False)
    d.add_argument("demo_args", nargs=argparse.REMAINDER)

    b = sub.add_parser("bench", help="short benchmarks with their ratios and goals: data plane (kvd vs plain "
                                     "NIXL vs memcpy), same-node copy, the shim's cost per engine step, "
                                     "throughput",
                       description="Run the short benchmarks; arguments after 'bench' go to them (kvd bench --help).",
                       add_help=False)
    b.add_argument("bench_args", nargs=argparse.REMAINDER)

    v = sub.add_parser("version", help="print versions",
                       description="Print the versions of kvd and of what it runs on (NIXL, grpcio, protobuf, Python): "
                                   "what a bug report needs. Starts nothing, needs no daemon.")
    v.set_defaults(func=cmd_version, parser=v)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvd``: ``argv`` without the program name (default
    ``sys.argv[1:]``); ``bench`` and ``demo`` hand the rest to their own
    parsers. Returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # gRPC's core logs each failed TLS handshake on the peer port to stderr
    # (at INFO), below kvd's own throttles: anyone who reaches the port wrote
    # ~6,000 lines a second (attacker review). Its errors still show; a
    # GRPC_VERBOSITY the operator set wins. Read at gRPC's first channel or
    # server, which comes later.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    if argv[:1] == ["serve"]:
        from kvd.daemon.early_stop import note_stops

        note_stops()  # before argparse: a stop asked from here on stops the daemon once started
    # Everything after "bench" or "demo" belongs to its own parser (argparse's
    # REMAINDER would not take leading options such as --help).
    if argv[:1] == ["bench"]:
        from kvd.bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["demo"]:
        from kvd.demo.run import main as demo_main

        return demo_main(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # after a subcommand: its usage, not the top-level one argparse would print
        after = argv[argv.index(args.command) + 1:] if args.command in argv else []
        (args.parser if unknown[0] in after else parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except BrokenPipeError:
        # The reader of stdout went away (`kvd status | head -1`): what it read
        # was complete; no traceback. stdout goes to /dev/null so the flush at
        # exit does not raise again (docs.python.org, signal: "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
