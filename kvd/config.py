"""Every setting of the daemon, its default and its validation, in one place.

A setting is one field of :class:`Config`. Its value comes from the first of
these sources that sets it (highest first):

1. a flag of ``kvd serve``: ``--lease-s 60`` (the key, ``_`` as ``-``);
2. an environment variable: ``KVD_LEASE_S=60`` (``KVD_`` + the key in capitals;
   an empty one, ``KVD_LEASE_S=``, is unset);
3. the TOML file named by ``kvd serve --config FILE`` (or ``KVD_CONFIG``):
   ``lease_s = 60``, top-level keys only;
4. the default below.

``kvd health`` and ``kvd status`` find the engine socket the same way
(:func:`client_socket`), their ``--socket`` in place of the flag.

Flags and environment values are text and are parsed here (numbers; lists
are comma-separated); TOML values must already have the right type. An
unknown key in the file, a value of the wrong type, or a value out of range
is a :class:`ConfigError` whose message names the key and where the value
came from; ``kvd serve`` turns it into exit code 64 (``EX_USAGE``,
sysexits.h). ``kvd serve --print-config`` prints the effective settings as
TOML, each with its source. docs/OPERATIONS.md has the table of keys.

This module is the only place that reads the environment for settings, and
it also reads ``NOTIFY_SOCKET``, the datagram socket systemd names for
``Type=notify`` services, and ``WATCHDOG_USEC`` / ``WATCHDOG_PID``, set for
a unit with ``WatchdogSec=`` (sd_notify(3), sd_watchdog_enabled(3)).
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import math
import os
import pathlib
import re
import select
import stat
import time
import tomllib
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Mapping

from kvd.addresses import socket_file, split_host_port
from kvd.logtext import clip
from kvd.usage import did_you_mean

DEFAULT_SOCKET = "/run/kvd/engine.sock"
DEFAULT_PEER_LISTEN = "127.0.0.1:7700"
ENV_PREFIX = "KVD_"
# Characters a Unix socket path may not hold here: gRPC parses targets as URIs.
SOCKET_PATH_UNSAFE = "?#%"
# sun_path is 108 bytes with its NUL (unix(7)), and the daemon binds the
# engine socket plus "<path>.cmd" (kvd.command_wire) and "<path>.fd" (kvd.fd_wire).
MAX_ENGINE_SOCKET_BYTES = 107 - len(".cmd")  # kvd.command_wire.SUFFIX, the longer of the two
ENV_CONFIG_FILE = "KVD_CONFIG"      # names the TOML file when --config is not given
ENV_NOTIFY_SOCKET = "NOTIFY_SOCKET"  # set by systemd for Type=notify units
ENV_WATCHDOG_USEC = "WATCHDOG_USEC"  # set by systemd for units with WatchdogSec=
ENV_WATCHDOG_PID = "WATCHDOG_PID"    # the process the watchdog is for (absent: the main process)

# gRPC message caps (docs/DESIGN.md: messages are bounded). Registration and
# handshake carry region lists; 64 MiB covers 4096 regions with room to spare.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Longest request id, engine id or address accepted in a command or peer call
# (leases and early notifications keep them: a cap on their count alone would
# not bound memory).
MAX_ID_BYTES = 1024

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("human", "json")


class ConfigError(ValueError):
    """An invalid setting; the message names the key (and its source). A
    message is cut at ``MAX_MESSAGE_CHARS`` (with the length it had): most
    quote the value, and an environment variable's may be any length (a
    100,000-character ``KVD_PEER_LISTEN`` was quoted whole: attacker review)."""

    MAX_MESSAGE_CHARS = 1000

    def __init__(self, message: str = ""):
        super().__init__(clip(str(message), self.MAX_MESSAGE_CHARS))


def parse_host_port(value: str, key: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 as ``[::1]:7700``) -> ``(host, port)``; port 0
    (a free port) allowed (:func:`kvd.addresses.split_host_port`); the host
    must be an IP address or a host name (:func:`host_problem`).

    Raises:
        ConfigError: not host:port, a host that is neither an IP address nor
            a host name, or a port outside 0..65535; names ``key``.
    """
    try:
        host, port = split_host_port(value, key)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    problem = host_problem(value.rpartition(":")[0])
    if problem:
        raise ConfigError(f"{key}: {problem}")
    return host, port


# A host name's labels (RFC 1123 section 2.1): letters, digits and '-', not
# first or last, 63 characters at most; '_' as well, which getaddrinfo and
# DNS servers take (Docker Compose v1 names containers project_service_1).
_LABEL = r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


def host_problem(host: str, brackets: bool = True) -> str:
    """Why ``host``, as written, is neither an IP address nor a host name,
    or "" when it is one: an IPv4 or IPv6 address (an IPv6 one may be in
    brackets, when ``brackets``), or a name of dot-separated labels of
    letters, digits, '-' and '_' (253 characters at most). Whether a name
    resolves is not asked: DNS may answer only later at boot, and a daemon
    that cannot bind then exits 1, which systemd retries; a host such as
    ``"not a host"`` never becomes valid, so it is a configuration error."""
    if host.startswith("[") or host.endswith("]"):
        inner = host[1:-1] if host.startswith("[") and host.endswith("]") else ""
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            return f"host {host!r}: only an IPv6 address goes in brackets ([::1])"
        return "" if brackets else f"host {host!r}: no brackets here (write {inner})"
    try:
        ipaddress.ip_address(host)
        return ""
    except ValueError:
        pass
    if len(host) <= 253 and _HOST_NAME.fullmatch(host):
        return ""
    return (f"host {host!r} is neither an IP address nor a host name (letters, digits, '-' and '.'; an IPv6 "
            f"address in brackets)")


def _setting(default: Any, doc: str, *, factory=None, file_example: str = ""):
    """A Config field that is a setting (file key, ``KVD_`` variable, flag).

    ``file_example``: the setting names a file the daemon reads (a token, a
    PEM file); it must then be an absolute path, and this one (as in
    deploy/kvd.toml) is the example its error gives (:meth:`Config.validate`).
    """
    meta = {"doc": doc}
    if file_example:
        meta["file_example"] = file_example
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Config:
    """The daemon's settings (units: seconds, bytes; ports are TCP ports).

    Each setting's one-line description is in its field metadata (``doc``);
    ``kvd serve --help`` and docs/OPERATIONS.md repeat them. ``sources`` says
    where each value came from (``default``, ``file PATH``, ``env KVD_X``,
    ``flag --x``); ``notify_socket`` is systemd's ``NOTIFY_SOCKET`` and
    ``watchdog_s`` its ``WATCHDOG_USEC`` in seconds (0: no watchdog), not
    settings; ``warnings`` are messages for the log (misspelt ``KVD_*``
    variables).
    """

    engine_socket: str = _setting(DEFAULT_SOCKET, "Unix socket path of EngineService (local engines); "
                                                  "absolute")
    peer_listen: str = _setting(DEFAULT_PEER_LISTEN, "host:port PeerService binds for remote daemons; port 0 picks one")
    peer_advertise: str = _setting("", "host:port put in kv_transfer_params for remote daemons "
                                       "(empty: the listen address with its bound port; for a wildcard "
                                       "peer_listen an address of this host, chosen at startup and logged)")
    metrics_port: int = _setting(0, "TCP port of the Prometheus HTTP endpoint (/metrics); 0 disables it")
    metrics_host: str = _setting("0.0.0.0", "address the Prometheus endpoint binds")
    backends: list[str] = _setting(None, "NIXL backends for every agent (comma-separated in env and flags)",
                                   factory=lambda: ["UCX"])
    lease_s: float = _setting(120.0, "default lease of held prefill blocks, seconds")
    max_lease_life_s: float = _setting(600.0, "a lease renewed by its reader (a decode request still queued) "
                                              "ends this long after its hold at the latest, seconds (at most "
                                              "3600; a lease asked longer keeps its own length)")
    transfer_timeout_s: float = _setting(30.0, "a transfer not done by then fails its request, seconds")
    handshake_timeout_s: float = _setting(10.0, "deadline of one handshake with a remote daemon, seconds")
    stall_dump_s: float = _setting(10.0, "the event loop not run for this long: every thread's Python stack "
                                         "goes to the log (a watchdog thread, plain text), seconds; every stall "
                                         "over 2 s is logged at WARNING with each thread's CPU seconds and "
                                         "the machine's; 0: no stack dump, the WARNING only")
    detach_grace_s: float = _setting(10.0, "an engine whose session stream has been gone this long "
                                           "is unregistered, seconds")
    grace_s: float = _setting(10.0, "on SIGTERM, wait this long for loads in flight (handshaking or reading), "
                                    "seconds")
    # The core's completion poll (kvd.core.state.Limits): shorter means a load's
    # event sooner after NIXL is done and more CPU while idle or busy
    # (docs/PERFORMANCE.md measures both).
    poll_busy_s: float = _setting(0.0005, "interval of the completion poll while transfers are in flight and "
                                          "moving, seconds (a transfer that stalls is polled less and less often, "
                                          "down to poll_idle_s)")
    poll_idle_s: float = _setting(0.005, "interval of the poll for notifications and lease expiry otherwise, "
                                         "seconds")
    transfer_mode: str = _setting("auto", "auto | pull (decode daemon READs) | push (prefill daemon WRITEs, "
                                          "asked by the decode daemon); set on the decode side (a prefill daemon "
                                          "serves pushes in any mode, unless serve_pushes = false). auto: push "
                                          "where a READ would be UCX's software GET over TCP, which crashes the "
                                          "source when its reader dies mid-READ (UCX 1.23): every load when "
                                          "UCX_TLS leaves only tcp, loads from other hosts when this one has no RDMA device, and loads from a "
                                          "source whose handshake says a READ from it is TCP's (its UCX_TLS "
                                          "leaves only tcp, or it has no RDMA device and is another host); "
                                          "pull otherwise")
    serve_pushes: bool = _setting(True, "prefill (source) side: serve PeerService.Push, the WRITEs a decode "
                                        "daemon asks for in push mode; false: refuse every one "
                                        "(FAILED_PRECONDITION), so no reader's agent metadata is loaded and no "
                                        "connection to a reader is made. Set false only where every decode "
                                        "daemon reading from this one is set to transfer_mode = pull (any "
                                        "other's pushes are refused, and its loads fail)")
    vet_peer_metadata: bool = _setting(True, "with a peer token, mutual TLS or peer_insecure (other hosts' "
                                             "daemons may then send NIXL agent metadata): load each new one in "
                                             "a throwaway process first and refuse what crashes it (UCX crashes "
                                             "on some malformed worker addresses). No effect without those: "
                                             "metadata then comes only from this host's daemons of root or this "
                                             "uid. ~60 MiB, a few ms a new metadata")
    same_node_copy: bool = _setting(True, "a load whose prefill engine is registered with this daemon too is a "
                                          "copy by the daemon (no NIXL); false: every load goes through NIXL")
    copy_threads: int = _setting(0, "threads a same-node copy in host memory runs on, each taking at least 1 MiB "
                                    "of a piece, never more than the CPUs the daemon may use (its affinity and "
                                    "cgroup CPU quota); 0: those CPUs, at most 4. Without kvd's native row copy "
                                    "(`kvd version`) always 1")
    follow_holds: bool = _setting(True, "decode (reader) side: follow the holds of each remote engine this "
                                        "daemon pairs with (PeerService.Holds, a long poll) and READ blocks its "
                                        "copy shows held without a per-load PeerService.Claim; a hold the copy "
                                        "does not show within its next two answers (at most 50 ms), or any while "
                                        "the source is silent for 1.5 s, still claims; false: a claim "
                                        "per load and source rank. Either way this daemon answers authenticated "
                                        "peers' Holds polls")
    # Security (docs/SECURITY.md). Local engines: who may use the engine socket.
    engine_socket_group: str = _setting("", "group (name or gid) of the engine socket, created mode 0660 "
                                             "(empty: the daemon's group)")
    allowed_uids: list[str | int] = _setting(None, "uids (names or numbers) admitted on the engine socket, "
                                                   "besides root and the daemon's own uid (checked with "
                                                   "SO_PEERCRED)", factory=list)
    allowed_gids: list[str | int] = _setting(None, "gids (names or numbers) admitted on the engine socket: a "
                                                   "caller in one of them (primary or supplementary) is admitted",
                                             factory=list)
    max_engine_connections: int = _setting(1024, "connections open on the engine socket at once, all callers "
                                                 "together; one past it is closed at once")
    max_engine_connections_per_uid: int = _setting(128, "connections open on the engine socket at once per caller "
                                                        "uid (admitted or not); one past it is closed at once")
    engine_idle_timeout_s: float = _setting(10.0, "a connection to the engine socket that sends no byte this "
                                                  "long is closed, seconds (a gRPC client sends its preface "
                                                  "at once)")
    command_socket: bool = _setting(True, "offer engines their session on a Unix socket beside the engine "
                                          "socket (engine_socket + .cmd: frames, no gRPC per command; same "
                                          "admission and caps); false: sessions on the gRPC stream only")
    require_memfd: bool = _setting(False, "refuse named shm segments (MEMORY_KIND_SHM) in RegisterEngine: "
                                          "engines hand their KV cache over as sealed memfds (an engine "
                                          "could shrink a named segment under the daemon: SIGBUS)")
    require_session_token: bool = _setting(False, "OpenSession and UnregisterEngine must carry the "
                                                  "session_token of the registration (else the same process "
                                                  "that registered may omit it)")
    # Remote daemons: who may use PeerService.
    peer_tls_cert: str = _setting("", "PEM certificate (chain) of this daemon for PeerService TLS, as server "
                                      "and as client; with peer_tls_key and peer_tls_ca: mutual TLS; an "
                                      "absolute path", file_example="/etc/kvd/tls/tls.crt")
    peer_tls_key: str = _setting("", "PEM private key of peer_tls_cert; an absolute path",
                                 file_example="/etc/kvd/tls/tls.key")
    peer_tls_ca: str = _setting("", "PEM CA bundle that signs every daemon's certificate (peers must present "
                                    "one); an absolute path", file_example="/etc/kvd/tls/ca.crt")
    peer_tls_server_name: str = _setting("", "name to verify in a remote daemon's certificate instead of "
                                             "the host of its address (empty: the host)")
    peer_token_file: str = _setting("", "file holding a shared secret (16+ characters) every daemon of the "
                                        "cluster knows; peers prove it with an HMAC per call; an absolute path",
                                    file_example="/etc/kvd/peer-token")
    peer_insecure: bool = _setting(False, "serve PeerService on a non-loopback peer_listen with no TLS and no "
                                          "token (any host that reaches the port may read and write the KV "
                                          "caches); without it such a daemon binds loopback only")
    warm_peers: list[str] = _setting(None, "remote engines to handshake with ahead of the first load, "
                                           "comma-separated host:port/engine_id (a remote daemon's peer address "
                                           "and the engine_id of a prefill engine registered there: set a fixed "
                                           "one in its --kv-transfer-config): every TP rank of it, for each "
                                           "local worker at its registration, retried until every rank is "
                                           "paired (given up if incompatible before its first pairing), paired "
                                           "again after a pause whenever a pair is dropped (the engine "
                                           "restarted), never released as idle (peer_idle_s); an entry given "
                                           "twice counts once",
                                     factory=list)
    peer_check_s: float = _setting(15.0, "each remote worker this daemon reads from is asked (a handshake) "
                                         "this often whether its daemon and engine are still there, seconds")
    peer_dead_s: float = _setting(45.0, "a remote daemon that has not answered for this long has its agents "
                                        "and descriptor lists released here (the next load handshakes again; "
                                        "a warm_peers engine's: in the background), seconds")
    peer_idle_s: float = _setting(600.0, "a remote worker no load has used for this long is released "
                                         "(not one of a warm_peers engine: those stay paired, checked every "
                                         "peer_check_s), seconds")
    # Bounds.
    max_message_bytes: int = _setting(MAX_MESSAGE_BYTES, "largest gRPC message received or sent, bytes "
                                                         "(both ports)")
    max_inflight_per_worker: int = _setting(4096, "loads in flight (handshaking or reading) per engine worker; "
                                                  "more fail at once with reason busy")
    max_leases_per_worker: int = _setting(65536, "prefill leases held per engine worker; a hold past it is "
                                                 "rejected")
    max_blocks_per_request: int = _setting(1 << 20, "block ids in one load or hold (all groups together)")
    max_load_block_ids_per_worker: int = _setting(1 << 22, "block ids (local and remote) of one engine worker's "
                                                           "loads in flight, all together; a load past it "
                                                           "fails at once with reason busy")
    max_load_block_ids_per_uid: int = _setting(1 << 24, "the same, for the workers registered by one uid")
    max_held_blocks_per_worker: int = _setting(1 << 22, "block ids held by one engine worker's leases, all "
                                                         "together; a hold past it is rejected")
    max_queued_event_bytes: int = _setting(64 << 20, "events queued for one engine worker's session that it has "
                                                     "not read, bytes (40 per block id); past it the stream is "
                                                     "ended and the events dropped")
    max_workers: int = _setting(64, "engine workers (TP ranks) registered at once, all users; one more is "
                                    "refused RESOURCE_EXHAUSTED")
    max_workers_per_uid: int = _setting(32, "engine workers registered at once per caller uid")
    max_descriptors: int = _setting(1 << 28, "block descriptors (regions x blocks) registered at once, all "
                                             "workers")
    max_descriptors_per_uid: int = _setting(1 << 27, "block descriptors registered at once per caller uid")
    max_host_bytes_per_uid: int = _setting(0, "bytes of host memory (shm, memfd) registered at once per caller "
                                              "uid; 0: this host's physical memory")
    max_device_bytes_per_uid: int = _setting(0, "bytes of GPU memory the daemon allocates as staging mirrors of "
                                                "one caller uid's CUDA registrations (staged or auto), on all "
                                                "GPUs; 0: no cap of kvd's (each GPU's memory bounds it)")
    max_handshakes: int = _setting(4096, "handshakes with remote workers in flight at once (one per local worker "
                                         "and remote rank); one more fails its load (HANDSHAKE); those made in "
                                         "advance, for the other ranks of an engine a load meets, take at most "
                                         "half")
    max_handshakes_per_uid: int = _setting(1024, "the same, for the workers registered by one uid; keep it at "
                                                 "most half of max_handshakes")
    max_aborts: int = _setting(1024, "requests to a prefill daemon to free blocks early in flight at once, all "
                                     "sessions (an AbortLoad, or a load with nothing to read); one more AbortLoad "
                                     "is rejected")
    max_aborts_per_uid: int = _setting(256, "the same, for the sessions of one caller uid")
    log_level: str = _setting("info", "debug | info | warning | error")
    log_format: str = _setting("human", "human (one line of text) | json (one JSON object per line)")

    notify_socket: str = field(default="", repr=False, compare=False)
    watchdog_s: float = field(default=0.0, repr=False, compare=False)
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    warnings: list[str] = field(default_factory=list, repr=False, compare=False)

    def validate(self) -> "Config":
        """Checks every field; returns self. Raises ConfigError naming the key."""
        self._check_engine_socket()
        for f in file_settings():
            path = getattr(self, f.name)
            if path and not os.path.isabs(path):
                # As engine_socket above: the daemon opens the file from its
                # own working directory (/ under systemd, WorkingDirectory=
                # unset; the image's WORKDIR in a container), not from the
                # shell's or the config file's directory.
                raise self._error(f.name, f"{path!r} is a relative path; give an absolute path (such as "
                                          f"{f.metadata['file_example']}): the daemon would look for it in its "
                                          f"working directory (/ under systemd), not in the directory of the "
                                          f"shell or of the config file that named it")
        for key in ("peer_listen", "peer_advertise"):
            value = getattr(self, key)
            if value or key == "peer_listen":
                try:
                    parse_host_port(value, key)
                except ConfigError as e:
                    raise self._error(key, str(e).removeprefix(f"{key}: ")) from None
        # One entry per engine: a repeated one would start a second warm-up
        # of the same pairs that no drop of them wakes (Peers._keep_warm).
        self.warm_peers = list(dict.fromkeys(self.warm_peers))
        for entry in self.warm_peers:
            address, sep, engine_id = entry.partition("/")
            if not sep or not engine_id:
                raise self._error("warm_peers", f"{entry!r} is not host:port/engine_id")
            try:
                _, port = parse_host_port(address, "warm_peers")
            except ConfigError as e:
                raise self._error("warm_peers", f"{entry!r}: {str(e).removeprefix('warm_peers: ')}") from None
            if port == 0:  # a free port is for peer_listen: a remote daemon listens on a real one
                raise self._error("warm_peers", f"{entry!r}: port 0 names no daemon (1..65535)")
        if not 0 <= self.metrics_port <= 65535:
            raise self._error("metrics_port", f"{self.metrics_port} out of range 0..65535")
        if not self.metrics_host:
            raise self._error("metrics_host", "must not be empty")
        problem = host_problem(self.metrics_host, brackets=False)  # a host alone: getaddrinfo takes no brackets
        if problem:
            raise self._error("metrics_host", problem)
        self._check_metrics_beside_peers()
        for key in ("lease_s", "max_lease_life_s", "transfer_timeout_s", "handshake_timeout_s", "grace_s", "detach_grace_s",
                    "engine_idle_timeout_s", "peer_check_s", "peer_dead_s", "peer_idle_s"):
            v = getattr(self, key)
            if not math.isfinite(v) or v <= 0:
                raise self._error(key, f"must be a finite number of seconds > 0 (got {v})")
        if not math.isfinite(self.stall_dump_s) or self.stall_dump_s < 0:
            raise self._error("stall_dump_s", f"must be a finite number of seconds >= 0 (got {self.stall_dump_s})")
        for key in ("poll_busy_s", "poll_idle_s"):
            v = getattr(self, key)
            if not math.isfinite(v) or not 0 < v <= 1:
                raise self._error(key, f"must be a number of seconds in (0, 1] (got {v})")
        for key in ("lease_s", "max_lease_life_s"):
            if getattr(self, key) > 3600:
                # kvd.core.limits.Limits.max_lease_s caps every lease at one hour.
                raise self._error(key, f"at most 3600 seconds (got {getattr(self, key)})")
        if not self.backends or not all(b and b.strip() == b for b in self.backends):
            raise self._error("backends", f"need one or more NIXL backend names (got {self.backends!r})")
        if self.transfer_mode not in ("auto", "pull", "push"):
            raise self._error("transfer_mode", f"{self.transfer_mode!r} is not auto | pull | push")
        if self.engine_socket_group:
            try:
                resolve_gid(self.engine_socket_group)
            except ConfigError as e:
                raise self._error("engine_socket_group", str(e)) from None
        for key, resolve in (("allowed_uids", resolve_uid), ("allowed_gids", resolve_gid)):
            try:
                [resolve(x) for x in getattr(self, key)]
            except ConfigError as e:
                raise self._error(key, str(e)) from None
        tls = {k: getattr(self, k) for k in ("peer_tls_cert", "peer_tls_key", "peer_tls_ca")}
        if any(tls.values()) and not all(tls.values()):
            missing = ", ".join(k for k, v in tls.items() if not v)
            raise self._error(next(k for k, v in tls.items() if not v),
                              f"mutual TLS needs peer_tls_cert, peer_tls_key and peer_tls_ca (missing: {missing})")
        for key, low, high in (("max_message_bytes", 1 << 16, (1 << 31) - 1),
                               ("max_inflight_per_worker", 1, 1 << 20),
                               ("max_leases_per_worker", 1, 1 << 24),
                               ("max_engine_connections", 1, 1 << 20),
                               ("max_engine_connections_per_uid", 1, 1 << 20),
                               ("max_blocks_per_request", 1, 1 << 26),
                               ("max_load_block_ids_per_worker", 1, 1 << 32),
                               ("max_load_block_ids_per_uid", 1, 1 << 36),
                               ("max_held_blocks_per_worker", 1, 1 << 30),
                               ("max_queued_event_bytes", 1 << 16, 1 << 40),
                               ("max_workers", 1, 1 << 16), ("max_workers_per_uid", 1, 1 << 16),
                               ("max_descriptors", 1, 1 << 40), ("max_descriptors_per_uid", 1, 1 << 40),
                               ("max_host_bytes_per_uid", 0, 1 << 62), ("max_device_bytes_per_uid", 0, 1 << 62),
                               ("max_aborts", 1, 1 << 20), ("max_aborts_per_uid", 1, 1 << 20),
                               ("max_handshakes", 1, 1 << 20), ("max_handshakes_per_uid", 1, 1 << 20),
                               ("copy_threads", 0, 64)):
            v = getattr(self, key)
            if not low <= v <= high:
                raise self._error(key, f"{v} out of range {low}..{high}")
        self.log_level = self.log_level.lower()
        self.log_format = self.log_format.lower()
        if self.log_level not in LOG_LEVELS:
            raise self._error("log_level", f"{self.log_level!r} is not {' | '.join(LOG_LEVELS)}")
        if self.log_format not in LOG_FORMATS:
            raise self._error("log_format", f"{self.log_format!r} is not {' | '.join(LOG_FORMATS)}")
        return self

    def share_warnings(self) -> list[str]:
        """Warnings for per-uid caps that let one uid take all of a shared
        cap (the other users' engines are refused while it does): legal,
        and what a single-tenant node may want, so not an error. Handshakes
        made in advance take at most half of either cap
        (``kvd.core.peers``), so a per-uid handshake cap over half of
        ``max_handshakes`` lets one uid's warm-ups fill that half."""
        out = []
        for total, per_uid, share in (("max_engine_connections", "max_engine_connections_per_uid", 1),
                                      ("max_workers", "max_workers_per_uid", 1),
                                      ("max_descriptors", "max_descriptors_per_uid", 1),
                                      ("max_aborts", "max_aborts_per_uid", 1),
                                      ("max_handshakes", "max_handshakes_per_uid", 2)):
            limit = getattr(self, total) // share
            if getattr(self, per_uid) > limit:
                what = ("one uid's handshakes made in advance can take all of the half kept for them"
                        if share == 2 else f"one uid can take all of {total}")
                out.append(f"{per_uid} {getattr(self, per_uid)} is more than {'half of ' if share == 2 else ''}"
                           f"{total} {getattr(self, total)}: {what}, and other users' engines are refused while "
                           f"it does (keep it at most {limit})")
        return out

    def _check_engine_socket(self) -> None:
        """Checks ``engine_socket`` as the daemon binds it: absolute, short
        enough for the sockets beside it, a path gRPC can dial. The clients
        check one read from the daemon's config file the same way
        (:func:`client_socket`). Raises ConfigError naming the key and its
        source."""
        self.engine_socket = socket_file(self.engine_socket)  # gRPC's unix:/PATH forms name the same file
        if not self.engine_socket:
            raise self._error("engine_socket", "must not be empty")
        if not os.path.isabs(self.engine_socket):
            # A daemon's working directory is / under systemd and whatever the
            # image sets in a container: engines, `kvd health` and the unit's
            # RuntimeDirectory would all look elsewhere.
            raise self._error("engine_socket", f"{self.engine_socket!r} is a relative path; give an absolute "
                                               f"path (such as {DEFAULT_SOCKET}): the daemon's working "
                                               f"directory (/ under systemd) is not where engines look")
        if len(os.fsencode(self.engine_socket)) > MAX_ENGINE_SOCKET_BYTES:
            raise self._error("engine_socket", f"path longer than {MAX_ENGINE_SOCKET_BYTES} bytes "
                                               f"({len(os.fsencode(self.engine_socket))}): the daemon binds it and "
                                               f"'<path>.cmd' and '<path>.fd' beside it, and a Unix socket path "
                                               f"is at most 107 bytes (unix(7)): {self.engine_socket!r}")
        bad = _unsafe_socket_chars(self.engine_socket)
        if bad:
            raise self._error("engine_socket", f"path {self.engine_socket!r} has characters gRPC targets cannot "
                                               f"carry ({bad}); {SOCKET_PATH_UNSAFE!r} and control characters "
                                               f"are refused")

    def read_file_setting(self, key: str) -> bytes | None:
        """The contents of the file a setting names (None when unset); at
        startup and by ``kvd serve --print-config`` (which checks the
        configuration on the machine it runs on), not in :meth:`validate`
        (loading a configuration reads no other file). Raises ConfigError
        naming the key."""
        path = getattr(self, key)
        if not path:
            return None
        try:
            return read_regular(path)
        except OSError as e:
            raise self._error(key, f"cannot read {path}: {e.strerror or e}{access_hint(path, e)}") from None

    def _check_metrics_beside_peers(self) -> None:
        """Refuses ``metrics_port`` equal to ``peer_listen``'s port on an
        overlapping address: the second bind would fail at every start
        (exit 1, which systemd's ``Restart=on-failure`` repeats for ever),
        while it is a mistake of the configuration (exit 64)."""
        peer_host, peer_port = parse_host_port(self.peer_listen, "peer_listen")
        if not self.metrics_port or self.metrics_port != peer_port:
            return
        if not binds_overlap(peer_host, self.metrics_host):
            return
        src = self.sources.get("peer_listen", "default")
        where = f", from {src}" if src != "default" else ""
        raise self._error("metrics_port", f"{self.metrics_port} is also the port of peer_listen "
                                          f"({self.peer_listen}{where}), and metrics_host {self.metrics_host!r} "
                                          f"overlaps its address: the second bind would fail (Address already in "
                                          f"use); give metrics_port another port (0 turns metrics off)")

    def _error(self, key: str, msg: str) -> ConfigError:
        src = self.sources.get(key, "")
        where = f" (from {src})" if src and src != "default" else ""
        return ConfigError(f"{key}{where}: {msg}")

    def to_toml(self) -> str:
        """The settings as a TOML document ``tomllib`` reads back, each line
        commented with its source (for ``kvd serve --print-config``)."""
        lines = ["# kvd effective configuration (precedence: flag > env KVD_* > file > default)"]
        for s in settings():
            value = getattr(self, s.name)
            lines.append(f"{s.name} = {_toml_value(value)}  # {self.sources.get(s.name, 'default')}")
        return "\n".join(lines) + "\n"


def resolve_uid(value: str | int) -> int:
    """A uid from a user name or a number (text or int). Raises ConfigError for an unknown name."""
    import pwd

    value = str(value).strip()
    if value.isdigit():
        return int(value)
    try:
        return pwd.getpwnam(value).pw_uid
    except KeyError:
        raise ConfigError(f"no such user {value!r}") from None


def resolve_gid(value: str | int) -> int:
    """A gid from a group name or a number (text or int). Raises ConfigError for an unknown name."""
    import grp

    value = str(value).strip()
    if value.isdigit():
        return int(value)
    try:
        return grp.getgrnam(value).gr_gid
    except KeyError:
        raise ConfigError(f"no such group {value!r}") from None


#: Addresses a listener binds to take every address of the host (of one
#: family: ``0.0.0.0`` IPv4; ``::`` IPv6 and, dual-stack, IPv4 too).
WILDCARD_V4, WILDCARD_V6 = "0.0.0.0", "::"


def binds_overlap(a: str, b: str) -> bool:
    """True when two listeners on the same TCP port, one bound to host
    ``a`` and one to ``b``, would collide: the same host, or one of them a
    wildcard that covers the other (``0.0.0.0`` does not cover an IPv6
    address). Host names are compared as written (no lookup)."""
    a, b = a.strip("[]").lower(), b.strip("[]").lower()
    if a == b or WILDCARD_V6 in (a, b):
        return True
    if WILDCARD_V4 in (a, b):
        other = b if a == WILDCARD_V4 else a
        return ":" not in other  # an IPv6 literal is not in 0.0.0.0's family
    return False


def _user_name(uid: int) -> str:
    """The name of user ``uid``, or "" when it has none."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return ""


def _group_name(gid: int) -> str:
    """The name of group ``gid``, or "" when it has none."""
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return ""


def _id(kind: str, number: int, name: str) -> str:
    return f"{kind} {number} ({name})" if name else f"{kind} {number}"


def access_hint(path: str, error: OSError) -> str:
    """For a permission error opening ``path``: who this process is and who
    may read the file (its owner, group and mode), or which directory on
    the way does not let it through, so the fix is in the message (a token
    written by root for a daemon run as another user is the usual case).
    Empty for any other error."""
    if error.errno not in (errno.EACCES, errno.EPERM):
        return ""
    uid, gid = os.geteuid(), os.getegid()
    me = f"{_id('uid', uid, _user_name(uid))}, {_id('gid', gid, _group_name(gid))}"
    user = _user_name(uid) or str(uid)

    def owner(st: os.stat_result) -> str:
        return (f"owner {_id('uid', st.st_uid, _user_name(st.st_uid))}, "
                f"group {_id('gid', st.st_gid, _group_name(st.st_gid))}, mode {stat.S_IMODE(st.st_mode):04o}")

    effective = os.access in os.supports_effective_ids
    absolute = os.path.abspath(path)
    # Outermost first: the first directory this process may not search is the one to fix.
    for d in reversed([str(p) for p in pathlib.PurePath(absolute).parents]):
        if not os.access(d, os.X_OK, effective_ids=effective):
            try:
                shown = f" ({owner(os.stat(d))})"
            except OSError:
                shown = ""
            return (f"; directory {d}{shown} does not let this daemon ({me}) through: let its user or group "
                    f"search it (x permission)")
    try:
        st = os.stat(absolute)
    except OSError:
        return f"; this daemon runs as {me}"
    return (f"; the file's {owner(st)}, and this daemon runs as {me}: make it readable by that user "
            f"(chown {user}: {path}; mode 0600 or 0400)")


def settings() -> list:
    """The dataclass fields of :class:`Config` that are settings, in order."""
    return [f for f in fields(Config) if "doc" in f.metadata]


def file_settings() -> list:
    """The settings that name a file the daemon reads (``peer_tls_*``,
    ``peer_token_file``): absolute paths only (:meth:`Config.validate`)."""
    return [f for f in settings() if "file_example" in f.metadata]


def setting_names() -> list[str]:
    """Names of every setting (the keys of flags, ``KVD_*`` env and the TOML file)."""
    return [f.name for f in settings()]


def env_name(key: str) -> str:
    """``lease_s`` -> ``KVD_LEASE_S``."""
    return ENV_PREFIX + key.upper()


def flag_name(key: str) -> str:
    """``lease_s`` -> ``--lease-s``."""
    return "--" + key.replace("_", "-")


def metavar(key: str) -> str:
    """The placeholder ``kvd serve --help`` shows for setting ``key``'s value,
    from its unit suffix (``_s`` seconds, ``_port``, ``_listen``/``_advertise``
    host:port) or its default's type."""
    default = _default(next(f for f in settings() if f.name == key))
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


def help_text(key: str) -> str:
    """``kvd serve --help``'s line for setting ``key``: its description, its
    default as a flag or the environment would spell it, and its variable."""
    f = next(f for f in settings() if f.name == key)
    default = _default(f)
    shown = (",".join(default) if isinstance(default, list) else
             str(default).lower() if isinstance(default, bool) else default)
    shown = shown if shown != "" else '""'
    also = "; 1/0 and yes/no work too" if isinstance(default, bool) else ""
    return f"{f.metadata['doc']} (default {shown}{also}; env {env_name(key)})"


def _default(f) -> Any:
    return f.default_factory() if f.default is MISSING else f.default


#: List settings of users or groups: a TOML array of names, numbers or both.
ID_LIST_KEYS = frozenset({"allowed_uids", "allowed_gids"})
#: The highest uid or gid: (uid_t)-1 means "no id" to the kernel.
MAX_ID = (1 << 32) - 2


def _ids(value: Any, where: str) -> list[str | int]:
    """A TOML array of user or group names and numbers (``[65534, "kvd"]``),
    kept as given: numbers as ints, names as strings (resolved in
    :meth:`Config.validate`)."""
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected an array of names or numbers, got {_shown(value)}")
    for x in value:
        # bool is an int to Python; TOML's true is no id.
        if isinstance(x, bool) or not isinstance(x, (str, int)):
            raise ConfigError(f"{where}: expected an array of names or numbers, got {_shown(x)} in "
                              f"{_shown(value)}")
        if isinstance(x, int) and not 0 <= x <= MAX_ID:
            raise ConfigError(f"{where}: id {x} out of range 0..{MAX_ID}")
    return list(value)


def _coerce(f, value: Any, source: str, from_text: bool) -> Any:
    """``value`` as the type of setting ``f``; ConfigError names key and
    source, and shows a file's value as TOML writes it (``true``, not
    Python's ``True``)."""
    default = _default(f)
    where = f"{f.name} (from {source})"
    if from_text and not isinstance(value, str):
        value = str(value)  # a flag parsed by argparse already
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError as e:  # an environment or argv byte that is not UTF-8 (surrogateescape)
            raise ConfigError(f"{where}: not UTF-8 (character {e.start}); settings are UTF-8 text") from None
    shown = clip(repr(value), _SHOWN_CHARS) if from_text else _shown(value)
    if isinstance(default, list):
        if from_text:
            return [x.strip() for x in value.split(",") if x.strip()]
        if f.name in ID_LIST_KEYS:
            return _ids(value, where)
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise ConfigError(f"{where}: expected an array of strings, got {shown}")
        return list(value)
    if isinstance(default, bool):
        if from_text:
            # Flags and KVD_* variables alike: true/false, 1/0, yes/no, any case.
            low = value.strip().lower()
            if low in ("1", "true", "yes"):
                return True
            if low in ("0", "false", "no"):
                return False
            raise ConfigError(f"{where}: expected true or false (or 1/0, yes/no), got {value!r}")
        if not isinstance(value, bool):
            hint = (" (a string: write it without quotes)"
                    if isinstance(value, str) and value.strip().lower() in ("true", "false") else "")
            raise ConfigError(f"{where}: expected true or false, got {shown}{hint}")
        return value
    if isinstance(default, int):
        if from_text:
            try:
                return int(value.strip(), 10)
            except ValueError:
                raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {shown}{_quoted_number(value)}")
        return value
    if isinstance(default, float):
        if from_text:
            try:
                return float(value.strip())
            except ValueError:
                raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {shown}{_quoted_number(value)}")
        return float(value)
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {shown}")
    return value


def _quoted_number(value: Any) -> str:
    """A hint for a number written as a TOML string (``lease_s = "60"``), or ""."""
    if isinstance(value, str):
        try:
            float(value)
            return " (a string: write it without quotes)"
        except ValueError:
            pass
    return ""


#: The largest file a setting names or ``--config`` reads (bytes): a token,
#: a PEM chain, a TOML file are kilobytes; more is a mistaken path.
MAX_FILE_BYTES = 1 << 20


#: How long a FIFO named as a file (a shell's process substitution,
#: ``--config <(...)``) may take to deliver its contents (seconds).
FIFO_WAIT_S = 10.0


def read_regular(path: str, limit: int = MAX_FILE_BYTES, fifo_wait_s: float = FIFO_WAIT_S,
                 what: str = "a regular file") -> bytes:
    """The bytes of file ``path``, at most ``limit`` bytes: a regular file,
    or a FIFO whose writer ends within ``fifo_wait_s`` seconds.

    Opened non-blocking, so that a FIFO with no writer, a device or a
    socket named by mistake is refused instead of blocking startup for
    ever (a plain ``open()`` of a FIFO waits for a writer); a file over
    ``limit`` is refused rather than cut (a cut token or certificate chain
    fails later, less clearly). ``what``: what the file should have been,
    in the message of one that is not (``"a socket, not a regular file"``).

    Raises:
        OSError: unreadable; not a regular file or FIFO (``EINVAL``); a FIFO
            with no writer or no end in time (``ETIMEDOUT``); larger than
            ``limit`` (``EFBIG``). ``strerror`` says which.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        # open(2) of a Unix socket fails ENXIO, "No such device or address":
        # say what the path is instead.
        if e.errno == errno.ENXIO and _is_socket(path):
            raise OSError(errno.EINVAL, f"a socket, not {what}") from None
        raise
    try:
        st = os.fstat(fd)
        fifo = stat.S_ISFIFO(st.st_mode)
        if not (fifo or stat.S_ISREG(st.st_mode)):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) \
                else "a device"
            raise OSError(errno.EINVAL, f"{kind}, not {what}")
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes")
        deadline = time.monotonic() + fifo_wait_s
        chunks, n = [], 0
        while True:
            if fifo and not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise OSError(errno.ETIMEDOUT, f"a FIFO that did not end within {fifo_wait_s:g} s")
            try:
                chunk = os.read(fd, limit + 1 - n)
            except BlockingIOError:  # a FIFO's writer is still there: wait on
                continue
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
            if n > limit:
                raise OSError(errno.EFBIG, f"larger than {limit} bytes")
        if fifo and not n:
            raise OSError(errno.ETIMEDOUT, "a FIFO with no writer (or an empty one)")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


#: Dotted parts a line's key may have before tomllib is asked (see read_file).
_MAX_KEY_PARTS = 64


def read_file(path: str, hint=None, source: str = "") -> dict:
    """The top-level table of TOML file ``path``. ``hint(path, error)``:
    what to add to the message of an OSError (default :func:`access_hint`,
    the daemon's own). ``source``: where the path came from, when not
    from the command line (``env KVD_CONFIG``), put in every message as
    the other settings' sources are.

    Raises:
        ConfigError: unreadable file (a socket, a directory: "not a config
            file") or invalid TOML (the message has tomllib's line and
            column, and the line's text).
    """
    name = f"config file {path}" + (f" (from {source})" if source else "")
    try:
        text = read_regular(path, what="a config file").decode()
    except OSError as e:
        raise ConfigError(f"{name}: {e.strerror or e}{(hint or access_hint)(path, e)}") from None
    except UnicodeDecodeError as e:  # TOML files are UTF-8 (tomllib decodes before parsing)
        raise ConfigError(f"{name}: not UTF-8 (byte {e.start}: {e.reason}); TOML files are UTF-8") from None
    for n, line in enumerate(text.splitlines(), 1):
        # tomllib's memory grows with the square of a dotted key's parts: a
        # key of 20,000 parts (a 40 KB file) took 1.6 GB and 6 s, 40,000 a
        # MemoryError (attacker review). A setting is a top-level key.
        key = line.split("=", 1)[0] if "=" in line else line if line.lstrip().startswith("[") else ""
        if key.count(".") >= _MAX_KEY_PARTS:
            raise ConfigError(f"{name}: line {n}: a key of {key.count('.') + 1} dotted parts; settings are "
                              f"top-level keys (lease_s = 30)")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{name}: {toml_error(e, text)}") from None
    except RecursionError:  # tomllib parses nested arrays and tables recursively: ~600 levels ran out of stack
        raise ConfigError(f"{name}: arrays or tables nested too deeply to read (a setting's value is at most "
                          f"an array of numbers or strings)") from None


def toml_error(error: tomllib.TOMLDecodeError, text: str) -> str:
    """tomllib's message with the text of the line it names (``Invalid value
    (at line 2, column 17): engine_socket = /run/kvd.sock``), cut at 120
    characters. For tomllib's "Invalid value", the cause: a key with no
    value (``lease_s =``), else the usual one, an unquoted string, which
    TOML does not have (``name = word`` reads ``word`` as a value and finds
    none). For its "Cannot overwrite a value" of a key given twice in one
    table: both lines (``lease_s is set twice (lines 54 and 91)``)."""
    message = str(error)
    m = re.search(r"\(at line (\d+), column \d+\)$", message)
    lines = text.splitlines()
    line = ""
    if m and 1 <= int(m[1]) <= len(lines):
        line = lines[int(m[1]) - 1].strip()
        if message.startswith("Cannot overwrite a value"):
            twice = _set_twice(lines, int(m[1]))
            if twice:
                return twice
        message += f": {line[:117] + '...' if len(line) > 120 else line}"
    if message.startswith("Invalid value"):
        key = _KEY_LINE.match(line)
        if key and not key["rest"].strip():
            message += f" (the value is missing: give {key['key']} one, or remove the line)"
        else:
            message += " (TOML strings need quotes)"
    return message


# A line that sets a key (bare, quoted or dotted): its key and what follows
# the '=' up to a comment (a '#' inside a string on the line is rare enough
# for a hint).
_KEY_PART = r"""(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')"""
_KEY_LINE = re.compile(rf"\s*(?P<key>{_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*=(?P<rest>[^#]*)")
# A table header, [name] or [[name]]: keys after it are in that table.
_TABLE_LINE = re.compile(r"\s*\[")


def _key_name(key: str) -> str:
    """A key as TOML compares it: the parts of a dotted key, unquoted."""
    parts = re.findall(_KEY_PART, key)
    return ".".join(p[1:-1] if p[0] in "\"'" else p for p in parts)


def _set_twice(lines: list[str], number: int) -> str:
    """``"KEY is set twice (lines A and B)"`` when line ``number`` (1-based)
    sets a key that an earlier line of the same table set, else "" (the
    caller keeps tomllib's message). Found by reading lines, not TOML: a
    line inside a multi-line string could fool it, so only a line that
    itself reads as ``KEY = ...`` with the same key counts."""
    m = _KEY_LINE.match(lines[number - 1])
    if not m:
        return ""
    key = _key_name(m["key"])
    for i in range(number - 2, -1, -1):
        if _TABLE_LINE.match(lines[i]):
            return ""  # another table starts between them: not this key's first line
        earlier = _KEY_LINE.match(lines[i])
        if earlier and _key_name(earlier["key"]) == key:
            return f"{key} is set twice (lines {i + 1} and {number}): keep one"
    return ""


def env_value(environ: Mapping[str, str], var: str) -> str | None:
    """The value of ``KVD_*`` variable ``var``, or None when it is unset or
    empty (blanks only count as empty).

    An empty value is unset, as ``${VAR:-default}`` in a shell: an
    EnvironmentFile (``/etc/default/kvd``), a ``docker --env-file`` or a pod
    spec often lists variables with no value, meaning "not set here"; the
    file's value or the default then applies rather than an error (a number)
    or an empty setting (a path, a list). Every ``KVD_*`` setting, the
    ``KVD_CONFIG`` file name and the clients' ``KVD_ENGINE_SOCKET`` are read
    through here.
    """
    value = environ.get(var)
    return value if value is not None and value.strip() else None


def load_config(
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    file: str | None = None,
) -> Config:
    """Builds and validates the effective :class:`Config`.

    Args:
        flags: settings given on the command line (key -> value; text or
            already parsed); only keys the user actually gave.
        environ: the environment (default ``os.environ``); ``KVD_<KEY>``
            variables set settings (an empty one is unset: :func:`env_value`),
            ``KVD_CONFIG`` names the file when ``file`` is not given,
            ``NOTIFY_SOCKET`` is kept for sd_notify.
        file: path of a TOML file.

    Raises:
        ConfigError: naming the key (and source) of the first bad value, an
            unknown key in the file, or an unreadable file.
    """
    environ = os.environ if environ is None else environ
    flags = dict(flags or {})
    file, file_source = config_file(environ, file)
    by_name = {f.name: f for f in settings()}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {name: "default" for name in by_name}

    if file:
        table = read_file(file, source=file_source)
        for key, value in table.items():
            f = by_name.get(key)
            if f is None:
                hint = " (keys are top-level; no tables)" if isinstance(value, dict) else ""
                # With a close match the hint is enough; without one, the list.
                near = did_you_mean(key, by_name)
                raise ConfigError(f"{key} (from file {file}): unknown setting{hint}"
                                  + (near if near else f"; known: {', '.join(by_name)}"))
            values[key] = _coerce(f, value, f"file {file}", from_text=False)
            sources[key] = f"file {file}"
    for key, f in by_name.items():
        var = env_name(key)
        value = env_value(environ, var)
        if value is not None:
            values[key] = _coerce(f, value, f"env {var}", from_text=True)
            sources[key] = f"env {var}"
    for key, value in flags.items():
        f = by_name.get(key)
        if f is None:
            raise ConfigError(f"{key}: unknown setting")
        values[key] = _coerce(f, value, f"flag {flag_name(key)}", from_text=True)
        sources[key] = f"flag {flag_name(key)}"

    cfg = Config(**values)
    cfg.sources = sources
    cfg.notify_socket = environ.get(ENV_NOTIFY_SOCKET, "")
    cfg.watchdog_s = watchdog_seconds(environ)
    cfg.warnings = unknown_env_warnings(environ)
    cfg.validate()
    cfg.warnings += cfg.share_warnings()  # once: the daemon validates its config again
    return cfg


def config_file(environ: Mapping[str, str], file: str | None) -> tuple[str | None, str]:
    """The TOML file to read and where its name came from: ``file`` (the
    ``--config`` flag; source "") when given, else the file ``KVD_CONFIG``
    names (source ``env KVD_CONFIG``, for messages: a variable set in a
    profile or unit and forgotten is otherwise hard to find), else
    ``(None, "")``."""
    if file:
        return file, ""
    from_env = env_value(environ, ENV_CONFIG_FILE)
    return (from_env, f"env {ENV_CONFIG_FILE}") if from_env else (None, "")


def watchdog_seconds(environ) -> float:
    """systemd's watchdog interval for this process (``WATCHDOG_USEC``, in
    seconds), or 0: none set, not a positive number, or ``WATCHDOG_PID``
    names another process (sd_watchdog_enabled(3))."""
    pid = environ.get(ENV_WATCHDOG_PID, "")
    if pid and pid != str(os.getpid()):
        return 0.0
    try:
        usec = int(environ.get(ENV_WATCHDOG_USEC, "0"))
    except ValueError:
        return 0.0
    return usec / 1e6 if usec > 0 else 0.0


# KVD_* variables that are read elsewhere, not settings (tools, tests, the
# demo): never reported as misspelt settings.
OTHER_ENV = frozenset({ENV_CONFIG_FILE, "KVD_CUDART", "KVD_NVRTC", "KVD_TINY_MODEL_DIR", "KVD_TINY_HYBRID_DIR", "KVD_TINY_MLA_DIR",
                       "KVD_SKIP_VLLM", "KVD_E2E_CONNECTOR", "KVD_E2E_MLA_CPU_ROPE", "KVD_FUZZ_EXAMPLES",
                       "KVD_FUZZ_PROFILE", "KVD_SOAK_REQUESTS", "KVD_SOAK_SEED", "KVD_VENV"})


def unknown_env_warnings(environ: Mapping[str, str]) -> list[str]:
    """One message per ``KVD_*`` variable that is no setting and looks like a
    misspelt one (``KVD_LEESE_S`` -> did you mean ``KVD_LEASE_S``?).

    A misspelt variable would otherwise be ignored silently and the default
    used; it is not an error, since other tools may use the ``KVD_`` prefix.
    The daemon logs these at startup; ``--print-config`` prints them.
    """
    known = {env_name(n) for n in setting_names()}
    out = []
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var in known or var in OTHER_ENV:
            continue
        out.append(f"environment variable {var} is not a kvd setting and is ignored{did_you_mean(var, known)}")
    return out


def client_socket(environ: Mapping[str, str] | None = None, file: str | None = None) -> str:
    """The engine socket ``kvd health`` / ``kvd status`` ask when ``--socket``
    is not given, found as the daemon finds it (flag aside):
    ``KVD_ENGINE_SOCKET`` when set, else ``engine_socket`` of the TOML file
    ``file`` (``--config``; else the file ``KVD_CONFIG`` names) when it sets
    one, else the default. The file is read only when the variable is unset,
    and only for ``engine_socket`` (the other keys are the daemon's to check).
    :func:`client_socket_source` says which of these it was.

    Raises:
        ConfigError: the file is unreadable or not TOML, or its
            ``engine_socket`` is one ``kvd serve`` would refuse (not a string,
            relative, too long); the message names the file (and
            ``env KVD_CONFIG`` when that variable named it).
    """
    return client_socket_source(environ, file)[0]


def client_socket_source(environ: Mapping[str, str] | None = None, file: str | None = None) -> tuple[str, str]:
    """:func:`client_socket`'s path and where it came from, for the clients'
    messages: ``"env KVD_ENGINE_SOCKET"``, ``"file PATH"`` (``"file PATH,
    named by env KVD_CONFIG"`` when the variable named it) or
    ``"default"``. Raises ConfigError as :func:`client_socket`."""
    environ = os.environ if environ is None else environ
    var = env_name("engine_socket")
    from_env = env_value(environ, var)
    if from_env is not None:
        return socket_file(from_env), f"env {var}"
    file, file_source = config_file(environ, file)
    if not file:
        return DEFAULT_SOCKET, "default"
    table = read_file(file, _client_access_hint, file_source)
    by_name = {f.name for f in settings()}
    for key in table:
        if key not in by_name:  # as `kvd serve` refuses it: a misspelt engine_socket would ask the default
            near = did_you_mean(key, by_name)
            raise ConfigError(f"{key!r} (from file {file}): unknown setting" + (near if near else
                              f"; known: {', '.join(sorted(by_name))}"))
    if "engine_socket" not in table:
        return DEFAULT_SOCKET, "default"
    source = f"file {file}" + (f", named by {file_source}" if file_source else "")
    f = next(f for f in settings() if f.name == "engine_socket")
    cfg = Config(engine_socket=_coerce(f, table["engine_socket"], source, from_text=False))
    cfg.sources = {"engine_socket": source}
    cfg._check_engine_socket()
    return cfg.engine_socket, source


def _unsafe_socket_chars(path: str) -> str:
    """Which characters of a socket path gRPC's ``unix:PATH`` target cannot
    carry ("" when none): it reads the target as a URI, so '?' and '#' cut
    the path and '%' starts an escape (an engine or ``kvd health`` would
    dial another path); control characters (and DEL) besides."""
    bad = sorted(set(path) & set(SOCKET_PATH_UNSAFE))
    return " ".join(bad) or ("control characters" if any(ord(c) < 32 or ord(c) == 127 for c in path) else "")


def client_socket_problem(path: str) -> str:
    """Why a client cannot dial the engine socket ``path`` (``--socket``,
    ``$KVD_ENGINE_SOCKET``), or "": empty, not encodable, characters gRPC's
    ``unix:`` target reads as URI syntax (it would dial another path), or
    longer than a Unix socket path (107 bytes, unix(7)). The daemon's own
    ``engine_socket`` is checked the same way (``Config._check_engine_socket``)."""
    if not path:
        return "the engine socket path is empty"
    try:
        full = os.fsencode(os.path.abspath(path))
        path.encode("utf-8")  # gRPC's target is a str it sends as UTF-8
    except (OSError, UnicodeError) as e:  # a removed working directory; surrogate-escaped bytes
        return f"{path!r}: cannot be used as a socket path ({e})"
    bad = _unsafe_socket_chars(path)
    if bad:
        return f"{path!r} has characters gRPC targets cannot carry ({bad}): gRPC would dial another path"
    if len(full) > 107:
        return (f"{path!r}: a Unix socket path is at most 107 bytes (unix(7)); this one is {len(full)}, so no "
                f"daemon can be listening there")
    return ""


def _client_access_hint(path: str, error: OSError) -> str:
    """For a client (``kvd health``) that may not read the daemon's config
    file (the unit's is mode 0640, group kvd): who it runs as and what to do
    instead; not :func:`access_hint`'s advice to hand the file over. For a
    socket given as the file (the daemon's engine socket, most likely): the
    flag that takes it. Empty for any other error."""
    if error.errno == errno.EINVAL and _is_socket(path):
        return f"; did you mean --socket {path}?"
    if error.errno not in (errno.EACCES, errno.EPERM):
        return ""
    uid = os.geteuid()
    return (f"; this command runs as {_id('uid', uid, _user_name(uid))}: run it as a user that may read the "
            f"file (root, or the daemon's user), or name the engine socket with --socket")


# A bad value is quoted in its error at most this long, its arrays and tables
# at most this deep: a file's value nested 400 levels once ended in a
# RecursionError's traceback instead of the error (attacker review).
_SHOWN_CHARS = 200
_SHOWN_DEPTH = 8


def _shown(v: Any) -> str:
    """A bad value as an error quotes it: :func:`_toml_value`, cut."""
    return clip(_toml_value(v, _SHOWN_DEPTH), _SHOWN_CHARS)


def _toml_value(v: Any, depth: int = -1) -> str:
    """``v`` as TOML writes it: ``true``, ``60``, ``inf``, ``"text"``,
    ``[1, 2]``, ``{a = 1}``, a date or time in RFC 3339 (tomllib's types).
    ``depth`` >= 0: arrays and tables nested deeper are written ``[...]``
    and ``{...}`` (the text is then for a message, not TOML)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)  # inf, -inf and nan as TOML spells them
    if isinstance(v, list):
        if depth == 0:
            return "[...]"
        return "[" + ", ".join(_toml_value(x, depth - 1) for x in v) + "]"
    if isinstance(v, dict):
        if depth == 0:
            return "{...}"
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x, depth - 1)}" for k, x in v.items()) + "}"
    if isinstance(v, (datetime.date, datetime.time)):  # datetime is a date
        return v.isoformat()
    # A TOML basic string: backslash, quote and control characters escaped
    # (TOML forbids them raw, U+007F included); everything else as is.
    out = []
    for c in str(v):
        if c in '"\\':
            out.append("\\" + c)
        elif ord(c) < 32 or ord(c) == 127:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def _toml_key(k: str) -> str:
    """A TOML key: bare when it may be, else quoted."""
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml_value(k)
