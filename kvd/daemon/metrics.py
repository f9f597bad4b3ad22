"""Prometheus metrics of one daemon, served over HTTP (``GET /metrics``).

Names follow the Prometheus naming rules (prometheus.io/docs/practices/naming):
the ``kvd_`` prefix, base units (seconds, bytes), ``_total`` on counters.

Fed by the core's event hook (``Node(on_event=...)``), as things happen:

- ``kvd_transferred_bytes_total``          bytes moved by completed transfers (READs into this node)
- ``kvd_transfers_total``                  completed transfers
- ``kvd_transfer_failures_total{reason}``  failed transfers; ``reason`` is the failure's kind
  (``kvd.core.events.FailureKind``: ``handshake``, ``timeout``, ``transfer``, ``nixl``,
  ``invalid``, ``busy``, ``draining``, ``shutdown``, ...): a small, fixed set
- ``kvd_transfer_duration_seconds``        histogram, load command to NIXL DONE
- ``kvd_handshake_duration_seconds``       histogram, one handshake with a remote daemon
- ``kvd_claim_duration_seconds``           histogram, a load's claim on the source's hold: sent to
  answered by every source rank (includes the source daemon's wait for the hold to arrive)
- ``kvd_transfer_descriptors``             histogram, NIXL descriptors per transfer
- ``kvd_event_loop_lag_seconds``           histogram, how late the event loop's 1 s tick ran
  (``kvd.daemon.stall_watch``): a loop that keeps up reads ~0; every session, handshake
  and health check waits that long
- ``kvd_event_loop_stalls_total``          ticks later than the stall watch's warning (2 s),
  each one a WARNING in the log

Read in the metrics thread at scrape time, without the event loop:

- ``kvd_event_loop_tick_age_seconds``: seconds since the loop last ticked; grows
  while a stall lasts (the stats below are then not served: they are read on the loop)
- ``kvd_nixl_call_age_seconds``: seconds the NIXL thread has been inside its
  current call, 0 between calls; grows while a NIXL call hangs (every load
  that needs NIXL waits meanwhile, the loop serves on)

Read from ``Node.stats()`` at scrape time (they cannot drift from the core):

- ``kvd_engines``, ``kvd_regions``, ``kvd_registered_bytes``: registered engine
  workers, their KV regions and the bytes of their segments
- ``kvd_peers``: remote workers handshaken with
- ``kvd_active_leases``, ``kvd_leases_expired_total``,
  ``kvd_leases_renewed_total``: held prefill leases, leases that ran out
  unread since start, and renewals granted to readers still waiting
- ``kvd_claims_sent_total``, ``kvd_claims_followed_total``,
  ``kvd_claims_waited_total``, ``kvd_holds_followed``: source ranks a READ
  asked to confirm their hold (PeerService.Claim), those whose hold the
  followed holds showed (no round trip), those whose load first waited for
  the copy's next answers (its hold on its way: either of the first two
  follows), and the remote engines followed (PeerService.Holds)
- ``kvd_holds_answers_applied_total``, ``kvd_holds_answers_sent_total``:
  poll answers this daemon applied to its copies of followed holds (the
  reader's side), and answers it made for followers' polls of its own
  engines (the source's side)
- ``kvd_inflight_transfers``: READs posted and not finished
- ``kvd_session_streams``: open engine session streams
- ``kvd_leaked_transfer_handles``: NIXL handles that could not be released yet
- ``kvd_notifications_dropped_total``: NIXL notifications dropped unread past
  the progress loop's backlog (``kvd.core.progress.MAX_BACKLOG``,
  ``MAX_BACKLOG_BYTES``): 0 unless a peer sent them faster than the loop
  handles them
- ``kvd_uptime_seconds``
- ``kvd_gc_frozen_objects``: objects startup made, frozen out of the garbage
  collector's walks once the daemon serves (``kvd.daemon.heap``)

Plus ``kvd_build_info{version,nixl,grpcio}`` (always 1) and the standard
``process_*`` (CPU, memory, open fds, start time) and ``python_gc_*``
(collections and objects collected, by generation) metrics.
"""

from __future__ import annotations

import bisect
import gc
import io
import logging
import socket
import socketserver
import sys
import threading
import time
from typing import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Gauge, Histogram, ProcessCollector,
                               disable_created_metrics, make_wsgi_app)
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from kvd import __version__
from kvd.core.events import FailureKind
from kvd.core.throttle import Throttled

log = logging.getLogger("kvd.metrics")

#: Scrapes served at once; a connection past them is closed at once. The
#: port answers anyone who reaches it, without credentials: prometheus_client's
#: own server starts a thread per connection, and 2,000 connections finishing
#: their requests together held the event loop 10-20 s (attacker review).
#: Prometheus scrapes one target with one connection at a time.
MAX_SCRAPES = 4
#: Seconds a connection has to send its whole request head (not per read: a
#: byte every few seconds would hold a slot for days).
REQUEST_TIMEOUT_S = 5.0
#: Bytes a connection may send in all (its request head; a scrape has no
#: body): Python's parser takes 100 headers of 64 KiB, ~50-65 ms of CPU to
#: parse (attacker review). Prometheus sends a few hundred bytes.
MAX_REQUEST_BYTES = 16 * 1024
#: Seconds one rendered answer serves further scrapes (per format: text or
#: OpenMetrics, gzipped or not): rendering costs ~3 ms of CPU, and one client
#: scraping back to back, 4 at a time, kept the daemon's core busy (346
#: scrapes/s, attacker review); now at most 4 formats x 5 renderings a
#: second. Prometheus scrapes every 15-60 s.
RENDER_REUSE_S = 0.2

# Seconds: 0.5 ms (a small READ over shared memory) to the 30 s default deadline.
DURATION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
# Seconds late: a loop that keeps up (<1 ms) to the stalls seen on a starved 2-core machine (tens of s).
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60)
HANDSHAKE_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)
DESCRIPTOR_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)

# (metric, Node.stats() key, help); gauges unless the name ends in _total.
STATS_METRICS = (
    ("kvd_engines", "engines", "Registered engine workers (engine id + TP rank)"),
    ("kvd_regions", "regions", "Registered KV cache regions"),
    ("kvd_registered_bytes", "registered_bytes", "Bytes of engine memory registered with NIXL"),
    ("kvd_peers", "peers", "Remote workers this daemon has handshaken with"),
    ("kvd_active_leases", "active_leases", "Prefill leases held for a reader"),
    ("kvd_leases_expired_total", "leases_expired", "Leases that ran out before a reader read the blocks"),
    ("kvd_leases_renewed_total", "leases_renewed", "Lease renewals granted to readers still waiting to read"),
    ("kvd_claims_sent_total", "claims_sent", "Claims asked of source daemons before a READ, per source rank"),
    ("kvd_claims_followed_total", "claims_followed",
     "Source ranks READ without a claim: the followed holds showed the blocks held"),
    ("kvd_claims_waited_total", "claims_waited",
     "Source ranks whose load waited for the followed holds' next answers before its READ or claim"),
    ("kvd_holds_followed", "holds_followed", "Remote engines whose holds are followed, answers current"),
    ("kvd_holds_answers_applied_total", "holds_answers_applied",
     "Followed holds' poll answers applied to this daemon's copies (PeerService.Holds, reader side)"),
    ("kvd_holds_answers_sent_total", "holds_answers_sent",
     "Answers to followers' polls of this daemon's engines' holds (PeerService.Holds, source side)"),
    ("kvd_inflight_transfers", "inflight_transfers", "Transfers (READs) in flight"),
    ("kvd_session_streams", "sessions", "Open engine session streams"),
    ("kvd_leaked_transfer_handles", "leaked_handles", "NIXL transfer handles not yet released"),
    ("kvd_notifications_dropped_total", "notifications_dropped",
     "NIXL notifications dropped unread, past the progress loop's backlog (a peer flooding them)"),
    ("kvd_coalesced_reads_total", "coalesced_reads",
     "Coalesced READs posted: small READs of one or more loads from one source rank, one NIXL transfer"),
    ("kvd_same_node_copies_total", "same_node_copies",
     "Loads this daemon copied itself (source and reader both registered here), no NIXL"),
    ("kvd_same_node_vram_copies_total", "same_node_vram_copies",
     "Of those, copies between VRAM mirrors on one GPU (kvd's copy kernel, or its slower fallbacks)"),
    ("kvd_copy_kernel_devices", "copy_kernel_devices",
     "GPUs kvd's row-copy kernel is loaded on (0 where it could not load: the log says why)"),
    ("kvd_cuda_context_lost", "cuda_context_lost",
     "1 after a device copy lost this daemon's CUDA context: GPU transfers fail until it restarts"),
    ("kvd_uptime_seconds", "uptime_s", "Seconds since the daemon started"),
)


def _version(pkg: str) -> str:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:
        return ""


class _StatsCollector:
    """Gauges and counters read from ``stats()`` at each scrape."""

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats
        self._unavailable = Throttled(log)

    def collect(self):
        try:
            s = self._stats()
        except Exception as e:  # a scrape must never take the daemon down
            # A stalled loop: the future's TimeoutError has no text of its own.
            self._unavailable.warning("metrics: stats unavailable: %s", e or (
                f"{type(e).__name__} (the event loop did not answer; kvd_event_loop_tick_age_seconds says "
                "for how long)"))
            return
        for name, key, doc in STATS_METRICS:
            if key not in s:
                continue
            if name.endswith("_total"):
                yield CounterMetricFamily(name[: -len("_total")], doc, value=s[key])
            else:
                yield GaugeMetricFamily(name, doc, value=s[key])
        info = GaugeMetricFamily("kvd_build_info", "Versions of kvd and its transfer stack (value 1)",
                                 labels=["version", "nixl", "grpcio"])
        info.add_metric([__version__, _version("nixl"), _version("grpcio")], 1)
        yield info


class _Histogram:
    """One histogram's numbers: observations per bucket (upper bounds
    ``bounds``, +Inf last) and their sum."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(bounds) + (float("inf"),)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, prometheus_client's rule (value <= le)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        cum, buckets = 0, []
        for b, n in zip(self.bounds, list(self.counts)):
            cum += n
            buckets.append((floatToGoString(b), cum))
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=self.sum)


class _TransferCollector:
    """``kvd_transferred_bytes_total``, ``kvd_transfers_total``,
    ``kvd_transfer_duration_seconds`` and ``kvd_transfer_descriptors``:
    counted in plain numbers on the event loop (:meth:`observe`), read by
    the scrape's thread (a custom collector, prometheus_client's documented
    way to serve numbers kept elsewhere).

    Why not its ``Counter``/``Histogram``: every ``inc`` takes a lock and
    ``observe`` walks the buckets in Python; the four calls of one load took
    ~3 us, ~3 % of a decode daemon's samples with 64 one-block loads in
    flight (py-spy), against ~0.6 us here. A scrape can see one transfer in
    the counts and not yet in a sum (the loop thread between two adds), as
    prometheus_client's own metrics can (a lock per value, not per metric).
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.transfers = 0
        self.duration = _Histogram(DURATION_BUCKETS)
        self.descs = _Histogram(DESCRIPTOR_BUCKETS)

    def observe(self, nbytes: int, seconds: float, descs: int) -> None:
        """One completed transfer: ``nbytes`` bytes, ``seconds`` from its load
        command to NIXL DONE, ``descs`` descriptors."""
        self.bytes += nbytes
        self.transfers += 1
        self.duration.observe(seconds)
        self.descs.observe(descs)

    def collect(self):
        yield CounterMetricFamily("kvd_transferred_bytes", "Bytes moved by completed transfers", value=self.bytes)
        yield CounterMetricFamily("kvd_transfers", "Completed transfers", value=self.transfers)
        yield self.duration.family("kvd_transfer_duration_seconds", "Transfer duration, load command to NIXL DONE")
        yield self.descs.family("kvd_transfer_descriptors", "NIXL descriptors per transfer")


class Metrics:
    """The daemon's metrics on their own registry (tests may make several).

    Args:
        stats: returns ``Node.stats()``; called from the HTTP server's thread
            at each scrape (the daemon passes one that runs on its event loop).
    """

    def __init__(self, stats: Callable[[], dict]):
        # No ``*_created`` series (prometheus_client's default gives every
        # counter and histogram one, a timestamp few use, doubling them).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry
        self.transfers = _TransferCollector()
        r.register(self.transfers)
        self.failures = Counter("kvd_transfer_failures", "Failed transfers, by reason", ["reason"], registry=r)
        for kind in FailureKind:  # every reason's series from the start, at 0: an alert on a rate sees it
            self.failures.labels(reason=kind.value)
        self.handshake = Histogram("kvd_handshake_duration_seconds", "Handshake duration with a remote daemon",
                                   registry=r, buckets=HANDSHAKE_BUCKETS)
        self.claim = Histogram("kvd_claim_duration_seconds",
                               "A load's claim on the source's hold, sent to answered (incl. its wait for the hold)",
                               registry=r, buckets=DURATION_BUCKETS)
        self.loop_lag = Histogram("kvd_event_loop_lag_seconds", "How late the event loop's 1 s tick ran",
                                  registry=r, buckets=LAG_BUCKETS)
        self.loop_stalls = Counter("kvd_event_loop_stalls", "Event loop ticks late past the stall warning",
                                   registry=r)
        self.loop_tick_age = Gauge("kvd_event_loop_tick_age_seconds",
                                   "Seconds since the event loop last ticked (grows during a stall)", registry=r)
        self.nixl_call_age = Gauge("kvd_nixl_call_age_seconds",
                                   "Seconds the NIXL thread has been inside its current call (0: between calls)",
                                   registry=r)
        r.register(_StatsCollector(stats))
        ProcessCollector(registry=r)
        GCCollector(registry=r)  # python_gc_*: collections by generation
        Gauge("kvd_gc_frozen_objects", "Objects startup made that the garbage collector skips (kvd.daemon.heap)",
              registry=r).set_function(gc.get_freeze_count)
        self._http = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def on_event(self, name: str, fields: dict) -> None:
        """The core's event hook: ``transfer`` (bytes, seconds, descs),
        ``failure`` (kind: a ``FailureKind``), ``handshake`` and ``claim``
        (seconds); others are ignored."""
        if name == "transfer":
            self.transfers.observe(fields["bytes"], fields["seconds"], fields["descs"])
        elif name == "failure":
            self.failures.labels(reason=FailureKind(fields["kind"]).value).inc()
        elif name == "handshake":
            self.handshake.observe(fields["seconds"])
        elif name == "claim":
            self.claim.observe(fields["seconds"])

    def watch_nixl(self, nixl_call: Callable[[], tuple[str, float] | None]) -> None:
        """Serves the age of the NIXL thread's current call (``nixl_call()``:
        ``(name, time.monotonic() at its start)`` or None, read in the
        scrape's thread: ``Runtime.nixl_call``) as ``kvd_nixl_call_age_seconds``."""
        def age() -> float:
            call = nixl_call()
            return 0.0 if call is None else max(0.0, time.monotonic() - call[1])

        self.nixl_call_age.set_function(age)

    def watch_loop(self, tick_age: Callable[[], float]) -> Callable[[float, bool], None]:
        """Serves ``tick_age()`` (seconds, read in the scrape's thread) as
        ``kvd_event_loop_tick_age_seconds``; returns the stall watch's
        ``on_tick`` that feeds the lag histogram and the stall counter."""
        self.loop_tick_age.set_function(tick_age)

        def on_tick(late_s: float, stalled: bool) -> None:
            self.loop_lag.observe(late_s)
            if stalled:
                self.loop_stalls.inc()
        return on_tick

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Starts the HTTP exporter on ``addr:port`` (a daemon thread, and one
        per scrape, at most :data:`MAX_SCRAPES`); returns the bound port.

        Raises:
            OSError: the address cannot be bound (``socket.gaierror``: a
                host that does not resolve).
        """
        family, host = _family(addr, port)
        server_class = type("_Server", (_BoundedServer,), {"address_family": family})
        self._http = make_server(host, port, _Rendered(make_wsgi_app(self.registry)), server_class,
                                 handler_class=_Handler)
        self._thread = threading.Thread(target=self._http.serve_forever, name="kvd-metrics", daemon=True)
        self._thread.start()
        self.port = self._http.server_port
        return self.port

    def stop(self) -> None:
        """Stops the HTTP exporter and closes its socket; idempotent."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def _family(addr: str, port: int) -> tuple[int, str]:
    """The socket family and host to bind ``addr`` with (IPv6 where it is one)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, sockaddr[0]


class _BoundedServer(socketserver.ThreadingMixIn, WSGIServer):
    """A thread per scrape, at most :data:`MAX_SCRAPES` at once: a connection
    past them is closed unanswered (a WARNING at most once a second)."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 64  # the listen backlog (socketserver's 5 dropped back-to-back connects' SYNs)

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(MAX_SCRAPES)
        self._busy = Throttled(log)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self._busy.warning("metrics: %d scrapes in progress; connection from %s closed unanswered",
                               MAX_SCRAPES, client_address[0] if client_address else "?")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        # socketserver prints a traceback to stderr; a client that sent no
        # whole request in time (or hung up) is not the daemon's error.
        log.debug("metrics: request from %s ended early: %r", client_address, sys.exc_info()[1])


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each allowed only what is left until ``deadline``
    (``time.monotonic()``), :data:`MAX_REQUEST_BYTES` in all; past either,
    ``TimeoutError`` or ``ValueError``."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock = sock
        self._deadline = deadline
        self._left = MAX_REQUEST_BYTES

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request head not read in time")
        if self._left <= 0:
            raise ValueError(f"request longer than {MAX_REQUEST_BYTES} bytes")
        self._sock.settimeout(left)
        n = self._sock.recv_into(memoryview(b)[:self._left])
        self._left -= n
        return n


class _Rendered:
    """prometheus_client's WSGI app with each rendered answer reused for
    :data:`RENDER_REUSE_S` seconds, per format (what ``Accept`` and
    ``Accept-Encoding`` choose: at most four). The query string is not read:
    ``name[]`` filters would make an answer per caller's choice."""

    def __init__(self, app):
        self._app = app
        self._lock = threading.Lock()
        self._answers: dict[tuple[str, bool], tuple[float, str, list, bytes]] = {}

    def __call__(self, environ, start_response):
        if environ["REQUEST_METHOD"] != "GET":
            return self._app(environ, start_response)
        key = (choose_encoder(environ.get("HTTP_ACCEPT"))[1], gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING")))
        with self._lock:  # one render at a time: the others wait and reuse it
            answer = self._answers.get(key)
            if answer is None or time.monotonic() - answer[0] >= RENDER_REUSE_S:
                got: list = []
                body = b"".join(self._app(dict(environ, QUERY_STRING="", PATH_INFO="/metrics"),
                                          lambda status, headers, exc_info=None: got.extend((status, headers))))
                answer = self._answers[key] = (time.monotonic(), got[0], got[1], body)
        start_response(answer[1], list(answer[2]))
        return [answer[3]]


class _Handler(WSGIRequestHandler):
    """One scrape: its request head within :data:`REQUEST_TIMEOUT_S` in all,
    nothing logged per request."""

    timeout = REQUEST_TIMEOUT_S  # each write of the answer

    def setup(self) -> None:
        super().setup()
        plain, self.rfile = self.rfile, io.BufferedReader(_DeadlineReader(self.connection,
                                                                        time.monotonic() + REQUEST_TIMEOUT_S))
        plain.close()

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.connection.settimeout(self.timeout)  # the head is read: the answer's writes get their own
        return ok

    def log_message(self, format, *args) -> None:
        pass
