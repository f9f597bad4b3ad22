"""Real ``kvd serve`` daemons in subprocesses, and what a harness asks them
(``GetStats``, health). Nothing here imports nixl: NIXL runs only inside the
daemons."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc

from kvd.ops import get_stats
from kvd.testing.processes import DIE_WITH_PARENT, child_env
from kvd.testing.util import tail, wait_until
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

# StatsResponse counts that return to their baseline when nothing is going on
# (a leak shows as one that does not).
LEAK_FIELDS = ("active_leases", "inflight_transfers", "leaked_handles", "remote_agents", "early_notifications",
               "pending_events", "prepped_dlists")


def stats_of(socket_path: str, timeout_s: float = 5.0) -> pb.StatsResponse:
    """``EngineService.GetStats`` of the daemon on the Unix socket
    ``socket_path`` (``timeout_s`` seconds), as ``kvd status`` asks it
    (:func:`kvd.ops.get_stats`). Raises grpc.RpcError (UNAVAILABLE while it
    is not serving)."""
    return get_stats(f"unix:{socket_path}", timeout_s)


def stats_dict(socket_path: str, timeout_s: float = 5.0) -> dict:
    """:func:`stats_of` as a dict, as ``kvd status --json`` prints it (every
    field, proto field names, integers as numbers)."""
    from kvd.daemon.status import to_dict

    return to_dict(stats_of(socket_path, timeout_s))


@dataclass
class Daemon:
    """A running ``kvd serve`` subprocess (``proc`` None: one started by
    another process, known by its socket only)."""

    proc: subprocess.Popen | None
    socket: str
    log_path: str
    peer_address: str = ""
    name: str = ""
    # The one channel of stub(): a channel per call would leave a connection
    # to the engine socket open per call until garbage collection.
    _channel: grpc.Channel | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def pid(self) -> int:
        """The daemon's process id."""
        return self.proc.pid

    def stub(self) -> pb_grpc.EngineServiceStub:
        """A stub on this daemon's one channel to the engine socket (opened at
        the first call, closed by :meth:`stop` or :meth:`close_channel`)."""
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"unix:{self.socket}")
        return pb_grpc.EngineServiceStub(self._channel)

    def close_channel(self) -> None:
        """Closes the channel of :meth:`stub` (idempotent; the next call opens another)."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def stats(self, timeout_s: float = 5.0) -> pb.StatsResponse:
        """The daemon's StatsResponse (:func:`stats_of`). Raises grpc.RpcError."""
        return stats_of(self.socket, timeout_s)

    def settled_stats(self, timeout_s: float = 30.0) -> pb.StatsResponse:
        """The StatsResponse once no pair's descriptor lists are still being
        prepared (``dlists_preparing`` 0: a daemon prepares them about a
        second after each handshake, ``kvd.core.peers.PREP_DELAY_S``), so
        that ``prepped_dlists`` is a baseline to compare with. Raises
        AssertionError after ``timeout_s`` seconds."""
        wait_until(lambda: self.stats().dlists_preparing == 0, timeout_s, "descriptor lists prepared")
        return self.stats()

    def log(self) -> str:
        """The daemon's whole log."""
        with open(self.log_path) as f:
            return f.read()

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the daemon's log."""
        return tail(self.log_path, lines)

    def pause(self, on: bool) -> None:
        """SIGSTOP / SIGCONT (keeps an idle daemon off the CPU while another case is timed)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP if on else signal.SIGCONT)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        """Sends ``sig`` (resuming a paused daemon first), then SIGKILL after
        ``timeout_s`` seconds; returns the exit code (negative: killed by a signal).
        Closes the channel of :meth:`stub` first."""
        self.close_channel()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def daemon_argv(socket_path: str, peer_listen: str = "127.0.0.1:0", log_level: str = "debug",
                metrics_port: int | None = None, extra=(), entry: tuple[str, ...] = ("-m", "kvd.cli")) -> list[str]:
    """``python <entry> serve`` with engine socket ``socket_path``, peers on
    ``peer_listen`` (port 0: any free one, read back from GetStats), an
    optional metrics port, then ``extra`` flags (a ``--peer-listen`` given
    there wins). ``entry`` is what python runs (a module that traces the
    daemon, say)."""
    argv = [sys.executable, *entry, "serve", "--engine-socket", socket_path, "--peer-listen", peer_listen,
            "--log-level", log_level]
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    return argv + list(extra)


def launch_daemon(workdir: str, name: str, *extra: str, env: dict | None = None, wrap: tuple[str, ...] = (),
                  log_level: str = "debug", entry: tuple[str, ...] = ("-m", "kvd.cli")) -> Daemon:
    """Starts ``kvd serve`` on ``<workdir>/<name>.sock`` and a free loopback
    port, log in ``<workdir>/<name>.log``, without waiting (see
    :func:`wait_serving`). ``wrap`` prefixes the command (e.g. ``("ip",
    "netns", "exec", ns)``, which execs, so ``proc.pid`` is still the
    daemon's). The daemon gets SIGTERM when the calling thread ends."""
    sock = os.path.join(workdir, f"{name}.sock")
    log_path = os.path.join(workdir, f"{name}.log")
    with open(log_path, "w") as logf:
        proc = subprocess.Popen([*DIE_WITH_PARENT, *wrap, *daemon_argv(sock, log_level=log_level, extra=extra,
                                                                       entry=entry)],
                                stdout=logf, stderr=subprocess.STDOUT, env=child_env(env), start_new_session=True)
    return Daemon(proc, sock, log_path, name=name)


def wait_serving(d: Daemon, deadline: float) -> bool:
    """Polls ``d`` until it answers GetStats (sets ``d.peer_address``; True),
    it exits or ``deadline`` (monotonic seconds) passes (False)."""
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            return False
        if os.path.exists(d.socket):
            try:
                d.peer_address = d.stats().peer_address
                return True
            except grpc.RpcError:
                pass
        time.sleep(0.05)
    return False


def start_daemon(workdir: str, name: str, *extra: str, env: dict | None = None, timeout: float = 30.0,
                 wrap: tuple[str, ...] = (), log_level: str = "debug",
                 entry: tuple[str, ...] = ("-m", "kvd.cli")) -> Daemon:
    """:func:`launch_daemon`, then waits (up to ``timeout`` seconds) until it
    answers GetStats. Raises RuntimeError with the daemon's log when it
    exits or does not serve in time (it is killed then)."""
    d = launch_daemon(workdir, name, *extra, env=env, wrap=wrap, log_level=log_level, entry=entry)
    if not wait_serving(d, time.monotonic() + timeout):
        code = d.proc.poll()
        d.stop(signal.SIGKILL)
        what = f"exited {code}" if code is not None else f"not serving after {timeout} s"
        raise RuntimeError(f"daemon {name} {what}:\n{d.log_tail(60)}")
    return d


def start_daemons(*specs, timeout: float = 60.0) -> list[Daemon]:
    """Starts several daemons at once (``specs``: ``(workdir, name, *flags)``,
    as :func:`start_daemon` takes them) and waits until each one serves.
    Raises RuntimeError (every daemon stopped) when one does not.

    Launched from this thread: PR_SET_PDEATHSIG fires when the thread that
    started a child ends, so no worker threads here.
    """
    daemons = [launch_daemon(workdir, name, *extra) for workdir, name, *extra in specs]
    deadline = time.monotonic() + timeout
    for d in daemons:
        if not wait_serving(d, deadline):
            for x in daemons:
                x.stop()
            raise RuntimeError(f"daemon {d.socket} did not start:\n{d.log_tail(60)}")
    return daemons


def stop_daemons(daemons) -> None:
    """SIGTERMs every daemon at once, then checks each exited 0 (AssertionError with its log)."""
    for d in daemons:
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
    for d in daemons:
        assert d.stop() == 0, d.log()[-2000:]


def leak_counts(daemon: Daemon) -> dict[str, int]:
    """The :data:`LEAK_FIELDS` of the daemon's StatsResponse."""
    st = daemon.stats()
    return {k: getattr(st, k) for k in LEAK_FIELDS}


def kvd_health(socket_path: str, timeout_s: float = 10.0) -> bool:
    """True when ``python -m kvd.cli health --socket SOCK`` exits 0 within
    ``timeout_s`` seconds (the probe a deployment uses)."""
    try:
        r = subprocess.run([sys.executable, "-m", "kvd.cli", "health", "--socket", socket_path],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0
