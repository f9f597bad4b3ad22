"""Start, watch and stop the demo's child processes: kvd daemons and vLLM-CPU
OpenAI api_servers.

Every child runs in its own session (hence its own process group), writes its
stdout and stderr to ``<run dir>/<name>.log`` and is waited for with a
deadline; when it dies or times out, ``ChildFailed`` carries the tail of its
log. ``ProcessSet.close()`` stops every group (SIGTERM, then SIGKILL after a
grace period) and removes the POSIX shared memory objects (``/dev/shm``) that
the run's processes created and left behind.

Shared memory attribution: other programs on the node may create ``/dev/shm``
objects while the demo runs, so ``ShmTracker`` removes only objects that (a)
did not exist when the run started, (b) were seen mapped or open by one of the
run's processes (sampled once a second), or carry one of their pids in their
name (``/torch_<pid>_...``), and (c) are no longer in use by any live process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

SHM_DIR = Path("/dev/shm")
REPO_ROOT = Path(__file__).resolve().parents[2]


class ChildFailed(RuntimeError):
    """A child process exited or did not become ready before its deadline."""

    def __init__(self, name: str, what: str, log_tail: str):
        super().__init__(f"{name}: {what}\n--- last lines of {name}'s log ---\n{log_tail}")
        self.name = name
        self.what = what
        self.log_tail = log_tail


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines of the log at ``path`` (reading at most its last
    ``max_bytes`` bytes); ``"(no log: ...)"`` when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(data.splitlines()[-lines:])


# ----------------------------------------------------------------- /proc scans

def _proc_pids() -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            out.append(int(d))
    return out


def _pgid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("utf-8", errors="replace")
        # comm may contain spaces/parens: split after the last ')'
        fields = data[data.rindex(")") + 2:].split()
        return int(fields[2])  # state ppid pgrp ...
    except (OSError, ValueError, IndexError):
        return None


def pids_in_groups(pgids: Iterable[int]) -> list[int]:
    """Live pids whose process group is one of ``pgids``."""
    groups = set(pgids)
    if not groups:
        return []
    return [pid for pid in _proc_pids() if _pgid_of(pid) in groups]


def shm_in_use_by(pid: int) -> set[str]:
    """Names of /dev/shm objects that ``pid`` maps or holds open."""
    names: set[str] = set()
    prefix = str(SHM_DIR) + "/"
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            for line in f:
                idx = line.find(prefix.encode())
                if idx >= 0:
                    path = line[idx:].decode("utf-8", errors="replace").rstrip("\n")
                    path = path.removesuffix(" (deleted)")
                    names.add(path[len(prefix):])
    except OSError:
        pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                names.add(target[len(prefix):].removesuffix(" (deleted)"))
    except OSError:
        pass
    return names


def _list_shm() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


class ShmTracker:
    """Tracks the /dev/shm objects a set of process groups creates."""

    def __init__(self, pgids_fn: Callable[[], Iterable[int]], interval_s: float = 1.0):
        self.before = _list_shm()
        self._pgids_fn = pgids_fn
        self._interval = interval_s
        self.ours: set[str] = set()
        self.pids_seen: set[int] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="kvd-demo-shm", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        """Records the pids in the watched process groups and the /dev/shm names
        they hold that were not there before the run."""
        pids = pids_in_groups(self._pgids_fn())
        new_names: set[str] = set()
        for pid in pids:
            new_names |= shm_in_use_by(pid)
        with self._lock:
            self.pids_seen.update(pids)
            self.ours |= {n for n in new_names if n not in self.before}

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.sample()
            except Exception:  # never let the sampler kill the run
                pass

    def stop(self) -> None:
        """Stops the background sampler (waits up to 5 s)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def cleanup(self) -> tuple[list[str], list[str]]:
        """Remove the run's leftover objects. Returns (removed, left_alone)."""
        self.stop()
        now = _list_shm()
        added = now - self.before
        with self._lock:
            ours = set(self.ours)
            pids = set(self.pids_seen)
        pid_strs = {str(p) for p in pids}
        in_use: set[str] = set()
        for pid in _proc_pids():
            if pid == os.getpid():
                continue
            in_use |= shm_in_use_by(pid)
        removed, left = [], []
        for name in sorted(added):
            mine = name in ours or bool(set(re.findall(r"\d+", name)) & pid_strs)
            if mine and name not in in_use:
                try:
                    os.unlink(SHM_DIR / name)
                    removed.append(name)
                except FileNotFoundError:
                    pass
                except OSError:
                    left.append(name)
            else:
                left.append(name)
        return removed, left


# ----------------------------------------------------------------- children

@dataclass
class Child:
    """A started child process (daemon or engine): its name, argv, log file,
    Popen handle, start time (monotonic seconds) and free-form ``meta``."""
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    meta: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.proc.pid

    def alive(self) -> bool:
        """True while the process has not exited."""
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the child's log."""
        return tail(self.log_path, lines)

    def fail(self, what: str) -> ChildFailed:
        """A :class:`ChildFailed` for this child saying ``what``, with its log tail (to raise)."""
        return ChildFailed(self.name, what, self.log_tail())


class ProcessSet:
    """Owns the run's children; a context manager that always cleans up."""

    def __init__(self, run_dir: Path, log: Callable[[str], None] = print):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self._pgids: set[int] = set()
        self._log = log
        self.shm = ShmTracker(lambda: set(self._pgids))
        self._closed = False

    # -- start
    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None, wave: int | None = None) -> Child:
        """Start ``argv`` in a new session, output to ``<run dir>/<name>.log``.

        ``wave``: ``close()`` stops higher waves first, one wave at a time
        (default: its start index, i.e. reverse start order). The demo puts
        the daemons in wave 0 and the engines in wave 1, so the engines
        unregister from live daemons.
        """
        log_path = self.run_dir / f"{name}.log"
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        # the engines import kvd.shim.vllm: make the repo importable even when
        # kvd is not installed in the venv.
        pp = full_env.get("PYTHONPATH", "")
        full_env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + pp if pp else "")
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        logf = open(log_path, "ab", buffering=0)
        logf.write(("$ " + " ".join(argv) + "\n").encode())
        try:
            proc = subprocess.Popen(
                argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=full_env, cwd=str(cwd or self.run_dir), start_new_session=True,
            )
        finally:
            logf.close()
        self._pgids.add(proc.pid)  # new session: pgid == pid
        child = Child(name, list(argv), log_path, proc)
        child.meta["wave"] = len(self.children) if wave is None else wave
        self.children.append(child)
        return child

    # -- wait
    def wait_ready(self, child: Child, check: Callable[[], bool], timeout_s: float,
                   interval_s: float = 0.5, what: str = "ready") -> float:
        """Poll ``check()`` until it returns True. Returns seconds waited.

        Raises ``ChildFailed`` when the child exits or ``timeout_s`` passes.
        """
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while True:
            if not child.alive():
                raise child.fail(f"exited with code {child.proc.returncode} before {what}")
            try:
                if check():
                    return time.monotonic() - t0
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise child.fail(f"not {what} after {timeout_s:.0f} s")
            time.sleep(interval_s)

    def check_alive(self) -> None:
        """Raises ChildFailed for the first child that has exited."""
        for c in self.children:
            if not c.alive():
                raise c.fail(f"exited unexpectedly with code {c.proc.returncode}")

    # -- stop
    def stop(self, child: Child, grace_s: float = 10.0) -> None:
        """Stops ``child``'s process group (SIGTERM, then SIGKILL after ``grace_s`` seconds)."""
        _stop_groups([child.pid], [child.proc], grace_s)

    def close(self, grace_s: float = 10.0) -> tuple[list[str], list[str]]:
        """Stop every child (reverse start order) and clean /dev/shm."""
        if self._closed:
            return [], []
        self._closed = True
        try:
            self.shm.sample()
        except Exception:
            pass
        waves = sorted({c.meta.get("wave", 0) for c in self.children}, reverse=True)
        for w in waves:
            group = [c for c in self.children if c.meta.get("wave", 0) == w]
            _stop_groups([c.pid for c in group], [c.proc for c in group], grace_s)
        removed, left = self.shm.cleanup()
        return removed, left

    def __enter__(self) -> "ProcessSet":
        return self

    def __exit__(self, *exc) -> None:
        removed, left = self.close()
        if removed:
            self._log(f"removed {len(removed)} leftover /dev/shm object(s) of this run")


def _stop_groups(pgids: list[int], procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM each group's leader, wait up to ``grace_s`` for the whole
    groups to exit, then SIGKILL whatever is left in them.

    Only the leader gets SIGTERM: it shuts its own children down in order
    (vLLM's api_server stops its engine core and workers; torch_shm_manager
    then unlinks the workers' shared memory). Signalling the whole group at
    once would kill those helpers before they clean up.
    """
    for pgid in pgids:
        try:
            os.kill(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        for p in procs:
            p.poll()
        if not pids_in_groups(pgids):
            break
        time.sleep(0.2)
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    # grandchildren re-parented to init die with SIGKILL too; give the kernel a
    # moment so that their mappings are gone before /dev/shm is cleaned.
    deadline = time.monotonic() + 5
    while pids_in_groups(pgids) and time.monotonic() < deadline:
        time.sleep(0.1)


# ----------------------------------------------------------------- readiness

def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET ``url`` answers 2xx within ``timeout_s`` seconds; False on any error."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def kvd_health(socket_path: str, timeout_s: float = 10.0) -> bool:
    """``python -m kvd.cli health --socket SOCK`` exits 0."""
    env = dict(os.environ)
    pp = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + pp if pp else "")
    try:
        r = subprocess.run(
            [sys.executable, "-m", "kvd.cli", "health", "--socket", socket_path],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0


# ----------------------------------------------------------------- commands

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


def daemon_argv(socket_path: str, peer_port: int, metrics_port: int | None = None,
                log_level: str = "info", extra: list[str] | None = None) -> list[str]:
    """``kvd serve`` command line for a demo daemon: engine socket
    ``socket_path``, peers on ``127.0.0.1:peer_port``, optional metrics port,
    plus ``extra`` flags."""
    argv = [sys.executable, "-m", "kvd.cli", "serve", "--engine-socket", socket_path,
            "--peer-listen", f"127.0.0.1:{peer_port}", "--log-level", log_level]
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    return argv + list(extra or [])


def engine_argv(model_dir: str, port: int, kv_transfer_config: dict | None,
                served_name: str = "tiny", block_size: int = 32,
                max_model_len: int = 2048, max_num_seqs: int = 8,
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
