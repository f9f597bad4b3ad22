"""What ``kvd health`` and ``kvd status`` ask a running daemon, and the exit
code each answer means (codes: :mod:`kvd.usage`). The CLI only parses flags
and prints what these return.

Status is served on the engine socket only (``EngineService.GetStats``);
health (``grpc.health.v1.Health``) on both the engine socket and the peer
port.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import stat
from dataclasses import dataclass

from kvd import command_wire, fd_wire
from kvd.logtext import clip, printable
from kvd.usage import EXIT_NOT_SERVING, EXIT_OK, EXIT_UNREACHABLE

# The services a daemon reports health for ('' is the whole server).

#: Characters of a failed call's details shown (a server chooses them).
DETAILS_SHOWN = 1000
HEALTH_SERVICES = ("", "kvd.v1.EngineService", "kvd.v1.PeerService")


@dataclass(frozen=True)
class Answer:
    """An exit code and the line(s) to print: ``text`` to stdout when
    ``code`` is 0, to stderr otherwise."""

    code: int
    text: str


def target(socket_path: str, address: str = "") -> str:
    """The gRPC target: ``address`` (host:port, the peer port) when given,
    else ``unix:<socket_path>`` (the engine socket)."""
    return address or f"unix:{socket_path}"


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _owner(st: os.stat_result) -> str:
    """``owner user:group`` of a file, by name where the host has one."""
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{user}:{group}"


def _denied(command: str, path: str, e) -> Answer | None:
    """The answer when this user may not open the engine socket at ``path``
    (connecting to a Unix socket needs write permission on it, and search
    permission on every directory above it), else None. Said plainly, with
    the socket's owner and mode: gRPC's own text ("failed to connect to all
    addresses ... FAILED_PRECONDITION ... Permission denied") names neither."""
    try:
        st = os.stat(path)
    except PermissionError:
        return Answer(EXIT_UNREACHABLE, f"kvd {command}: cannot reach {path}: permission denied on a directory "
                                        f"above it: run this as the daemon's user or root")
    except OSError:
        return None
    if "Permission denied" not in (e.details() or ""):
        return None
    return Answer(EXIT_UNREACHABLE, f"kvd {command}: cannot connect to {path}: permission denied (the socket is "
                                    f"owned by {_owner(st)}, mode {stat.S_IMODE(st.st_mode):04o}): run this as "
                                    f"the daemon's user or root, or as a member of the socket's group (the "
                                    f"daemon's engine_socket_group, docs/OPERATIONS.md)")


def _unreachable(command: str, target: str, e, timeout_s: float) -> Answer:
    """Exit code 2 and the line for an RPC that did not reach a daemon (or
    was refused): with no file at an engine socket's path, says so plainly
    rather than gRPC's connect error; an address where an HTTP/1 server
    answered is said to be one; no answer within ``timeout_s`` says what
    that can be."""
    import grpc

    if target.startswith("unix:"):
        path = target.removeprefix("unix:")
        denied = _denied(command, path, e)
        if denied is not None:
            return denied
        if not os.path.exists(path):
            return Answer(EXIT_UNREACHABLE, f"kvd {command}: no daemon at {path} (no such socket): start one "
                                            f"with `kvd serve`, or name its engine socket with --socket (or its config "
                                            f"file with --config)")
        if not _is_socket(path):
            return Answer(EXIT_UNREACHABLE, f"kvd {command}: {path} is not a socket: name the daemon's engine "
                                            f"socket with --socket")
        for side, suffix in (("command socket", command_wire.SUFFIX), ("fd side channel", fd_wire.SUFFIX)):
            if path.endswith(suffix) and _is_socket(path[:-len(suffix)]):
                return Answer(EXIT_UNREACHABLE, f"kvd {command}: {path} is a daemon's {side}, which serves no "
                                                f"gRPC: name its engine socket, --socket {path[:-len(suffix)]}")
        if "Connection refused" in (e.details() or ""):
            # Nothing listens: a daemon killed without its cleanup (SIGKILL,
            # a crash); the next `kvd serve` there takes the path over.
            return Answer(EXIT_UNREACHABLE, f"kvd {command}: no daemon at {path} (the socket is there but nothing "
                                            f"listens: a daemon that stopped without removing it); start one "
                                            f"with `kvd serve`")
    hint = ""
    if not target.startswith("unix:") and "Connection refused" in (e.details() or ""):
        return Answer(EXIT_UNREACHABLE, f"kvd {command}: nothing listens on {target} (connection refused): is "
                                        f"the daemon running, and is this its peer port (peer_listen)?")
    if not target.startswith("unix:") and "Failed parsing HTTP/2" in (e.details() or ""):
        # What gRPC's client says when the server's first bytes are not an
        # HTTP/2 SETTINGS frame: an HTTP/1 server answered (the metrics
        # port, a web server), not a daemon's peer port.
        hint = " (an HTTP server? --address takes the daemon's peer port, peer_listen)"
    elif not target.startswith("unix:") and any(w in (e.details() or "") for w in ("Socket closed",
                                                                                "Connection reset")):
        # What gRPC's plaintext client says when a TLS server hangs up on its
        # first bytes (seen against a peer port with peer_tls_* on).
        hint = (" (a peer port that serves TLS? `kvd health --address` speaks plaintext only: check the daemon "
                "on its engine socket with --socket, or probe the peer port with a TLS-aware gRPC client)")
    elif not target.startswith("unix:") and e.code() == grpc.StatusCode.UNIMPLEMENTED:
        # A daemon's peer port serves health: what answered there is another
        # server (an HTTP/2 404 reads so; seen from a network's proxy).
        hint = " (not a kvd daemon: --address takes the daemon's peer port, peer_listen)"
    elif e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        hint = (f" (no answer within --timeout {timeout_s:g} s: a daemon stopped or too busy to answer, "
                f"or something that is not a kvd daemon listening there)")
    # The details come from whatever answered: cut, and written as the status table writes its fields.
    details = printable(clip(e.details() or "", DETAILS_SHOWN))
    return Answer(EXIT_UNREACHABLE, f"kvd {command}: {target}: {e.code().name}: {details}{hint}")


def _not_the_daemon(command: str, target: str) -> Answer | None:
    """Exit 2 when the Unix socket of ``target`` is served by a process an
    engine would not take for the daemon (``kvd.client.channel.server_refusal``:
    another user's, in a directory others may write): its answers would be
    shown as the daemon's. None otherwise (a host:port, nothing listening,
    or a server that passes: the call goes on and says what it finds)."""
    from kvd.client.channel import is_impostor, probe_unix_socket

    if not target.startswith("unix:"):
        return None
    try:
        error = probe_unix_socket(target)
    except ValueError:  # a path gRPC would read as another: the call says what it finds
        return None
    if is_impostor(error):
        return Answer(EXIT_UNREACHABLE, f"kvd {command}: {printable(str(error))}")
    return None


def health(target: str, service: str = "", timeout_s: float = 2.0) -> Answer:
    """gRPC health check of ``service`` at ``target`` within ``timeout_s`` seconds.

    Returns code 0 (SERVING), 1 (NOT_SERVING: draining; or NOT_FOUND: the
    daemon answered but has no such service), or 2 (unreachable, past the
    deadline, or refused: PERMISSION_DENIED when this uid is not admitted on
    the engine socket, UNAUTHENTICATED on a TLS peer port)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    refused = _not_the_daemon("health", target)
    if refused:
        return refused
    try:
        with grpc.insecure_channel(target) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                     timeout=timeout_s)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:  # the daemon answered, but does not serve that service
            return Answer(EXIT_NOT_SERVING, f"kvd health: {target}: NOT_FOUND: no service {service!r} here "
                                            f"(known: '' for the whole server, {', '.join(HEALTH_SERVICES[1:])})")
        return _unreachable("health", target, e, timeout_s)
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    if r.status == health_pb2.HealthCheckResponse.SERVING:
        return Answer(EXIT_OK, f"{target}: {name}")
    return Answer(EXIT_NOT_SERVING, f"kvd health: {target}: {name}")


def get_stats(target: str, timeout_s: float = 2.0):
    """``EngineService.GetStats`` of the daemon at ``target`` (``unix:<engine
    socket>``) within ``timeout_s`` seconds: a ``kvd.v1.StatsResponse``.
    Raises grpc.RpcError (UNAVAILABLE while nothing serves there)."""
    import grpc

    from kvd.v1 import kvd_pb2, kvd_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        return kvd_pb2_grpc.EngineServiceStub(ch).GetStats(kvd_pb2.StatsRequest(), timeout=timeout_s)


def status(target: str, timeout_s: float = 2.0, as_json: bool = False) -> Answer:
    """The daemon's GetStats at ``target`` (engine socket only) within
    ``timeout_s`` seconds, as the table for people or as JSON
    (:mod:`kvd.daemon.status`). Returns code 0, or 2 when unreachable or refused."""
    import grpc

    from kvd.daemon.status import render, to_dict

    refused = _not_the_daemon("status", target)
    if refused:
        return refused
    try:
        s = get_stats(target, timeout_s)
    except grpc.RpcError as e:
        return _unreachable("status", target, e, timeout_s)
    d = to_dict(s)
    return Answer(EXIT_OK, json.dumps(d, indent=2, sort_keys=True) if as_json else render(d, target))
