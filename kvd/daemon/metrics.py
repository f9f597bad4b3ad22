"""Prometheus metrics of one daemon (``kvd_`` prefix, seconds and bytes).

Counters and histograms are fed by the core's event hook; gauges are read
from ``Node.stats()`` at scrape time, so they can never drift from the core.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from kvd.core.node import Node


class Metrics:
    """The daemon's metrics on their own registry (tests may make several)."""

    def __init__(self, node: Node):
        self.registry = CollectorRegistry()
        r = self.registry
        self.bytes = Counter("kvd_transferred_bytes", "Bytes moved by completed transfers", registry=r)
        self.transfers = Counter("kvd_transfers", "Completed transfers", registry=r)
        self.failures = Counter("kvd_transfer_failures", "Failed transfers by reason", ["reason"], registry=r)
        self.duration = Histogram(
            "kvd_transfer_duration_seconds", "Transfer duration, command to NIXL DONE", registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
        )
        self.handshake = Histogram("kvd_handshake_duration_seconds", "Handshake duration", registry=r)
        self.descs = Histogram("kvd_transfer_descriptors", "Descriptors per transfer", registry=r,
                               buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536))
        node_ref = node

        class _Gauges:
            def collect(self):
                s = node_ref.stats()
                for name, key, doc in (
                    ("kvd_engines", "engines", "Registered engine workers"),
                    ("kvd_regions", "regions", "Registered KV regions"),
                    ("kvd_registered_bytes", "registered_bytes", "Bytes of registered engine memory"),
                    ("kvd_peers", "peers", "Remote workers handshaken with"),
                    ("kvd_active_leases", "active_leases", "Held prefill leases"),
                    ("kvd_inflight_transfers", "inflight_transfers", "Transfers in flight"),
                    ("kvd_sessions", "sessions", "Open engine session streams"),
                ):
                    yield GaugeMetricFamily(name, doc, value=s[key])
                c = GaugeMetricFamily("kvd_expired_leases", "Leases that expired unread (cumulative)",
                                      value=s["leases_expired"])
                yield c

        r.register(_Gauges())

    def on_event(self, name: str, fields: dict) -> None:
        """The core's event hook (``Node(on_event=...)``)."""
        if name == "transfer":
            self.bytes.inc(fields["bytes"])
            self.transfers.inc()
            self.duration.observe(fields["seconds"])
            self.descs.observe(fields["descs"])
        elif name == "failure":
            self.failures.labels(reason=fields.get("reason", "unknown")).inc()
        elif name == "handshake":
            self.handshake.observe(fields["seconds"])

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Starts the HTTP exporter on ``port``; returns (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)
