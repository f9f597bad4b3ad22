"""Every setting of the daemon, its default and its validation, in one place.

The CLI builds one :class:`Config` from flags and calls the daemon with it;
nothing else reads the environment for daemon settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

DEFAULT_SOCKET = "/run/kvd/engine.sock"
DEFAULT_PEER_LISTEN = "127.0.0.1:7700"

# gRPC message caps (DESIGN.md: messages are bounded). Registration and
# handshake carry region lists; 64 MiB covers 4096 regions with room to spare.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ConfigError(ValueError):
    """An invalid setting; the message names the key."""


def parse_host_port(value: str, key: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 as ``[::1]:7700``) -> ``(host, port)``.

    Raises:
        ConfigError: not host:port, or port outside 0..65535.
    """
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{key}: expected host:port, got {value!r}")
    try:
        p = int(port)
    except ValueError:
        raise ConfigError(f"{key}: port {port!r} is not a number") from None
    if not 0 <= p <= 65535:
        raise ConfigError(f"{key}: port {p} out of range 0..65535")
    return host.strip("[]"), p


@dataclass
class Config:
    """The daemon's settings (units: seconds, bytes).

    Attributes:
        engine_socket: Unix socket path of EngineService (local engines).
        peer_listen: ``host:port`` PeerService binds (remote daemons).
        peer_advertise: ``host:port`` put in ``kv_transfer_params`` for
            remote daemons; default: ``peer_listen`` (with its bound port).
        metrics_port: Prometheus HTTP port; 0 disables.
        backends: NIXL backends for every agent (default UCX).
        lease_s: default lease of held prefill blocks.
        transfer_timeout_s: a READ not done by then fails the request.
        handshake_timeout_s: deadline of one handshake with a peer.
        detach_grace_s: an engine whose session stream is gone this long
            (the engine died) is unregistered: leases, NIXL state, mappings.
        log_level: ``debug`` | ``info`` | ``warning`` | ``error``.
    """

    engine_socket: str = DEFAULT_SOCKET
    peer_listen: str = DEFAULT_PEER_LISTEN
    peer_advertise: str = ""
    metrics_port: int = 0
    backends: list[str] = field(default_factory=lambda: ["UCX"])
    lease_s: float = 120.0
    transfer_timeout_s: float = 30.0
    handshake_timeout_s: float = 10.0
    detach_grace_s: float = 10.0
    grace_s: float = 10.0
    log_level: str = "info"

    def validate(self) -> "Config":
        """Checks every field; returns self. Raises ConfigError naming the key."""
        if not self.engine_socket:
            raise ConfigError("engine_socket: must not be empty")
        if len(os.fsencode(self.engine_socket)) > 107:
            raise ConfigError(f"engine_socket: path longer than 107 bytes: {self.engine_socket!r}")
        parse_host_port(self.peer_listen, "peer_listen")
        if self.peer_advertise:
            parse_host_port(self.peer_advertise, "peer_advertise")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port: {self.metrics_port} out of range 0..65535")
        for key in ("lease_s", "transfer_timeout_s", "handshake_timeout_s", "grace_s", "detach_grace_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}: must be > 0 seconds (got {getattr(self, key)})")
        if not self.backends:
            raise ConfigError("backends: at least one NIXL backend is needed")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level: {self.log_level!r} is not debug|info|warning|error")
        return self
