"""Test helpers: real kvd daemons in subprocesses, real POSIX shm segments."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import numpy as np

from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc


def die_with_parent() -> None:
    """preexec_fn: SIGTERM the child when the test process dies (even killed),
    so no daemon outlives a test run (Linux PR_SET_PDEATHSIG).

    Not for children of a process that uses gRPC: a ``preexec_fn`` makes
    ``subprocess`` fork() instead of vfork(), and gRPC's fork handlers can then
    abort the child (seen here: SIGABRT, "epoll_wait error: Bad file
    descriptor"). ``start_daemon`` uses :data:`DIE_WITH_PARENT` instead.
    """
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


# Command prefix with the effect of die_with_parent and no preexec_fn: sets
# PR_SET_PDEATHSIG (kept across exec) and execs the rest of the command line.
DIE_WITH_PARENT = (sys.executable, "-S", "-c",
                   "import ctypes, os, signal, sys; ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM, 0, 0, 0); "
                   "os.execvp(sys.argv[1], sys.argv[1:])")


@dataclass
class Daemon:
    """A running ``kvd serve`` subprocess."""

    proc: subprocess.Popen
    socket: str
    log_path: str
    peer_address: str = ""

    def stub(self) -> pb_grpc.EngineServiceStub:
        ch = grpc.insecure_channel(f"unix:{self.socket}")
        return pb_grpc.EngineServiceStub(ch)

    def stats(self) -> pb.StatsResponse:
        return self.stub().GetStats(pb.StatsRequest(), timeout=5)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM, timeout=20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_daemon(tmpdir: str, name: str, *extra: str, env: dict | None = None, timeout: float = 30.0,
                 wrap: tuple[str, ...] = ()) -> Daemon:
    """Starts ``kvd serve`` on a socket in ``tmpdir`` and a free loopback port.

    ``extra`` flags come last (``--peer-listen`` given there wins); ``wrap``
    prefixes the command (e.g. ``("ip", "netns", "exec", ns)``, which execs,
    so ``proc.pid`` is still the daemon's). Waits (up to ``timeout`` seconds)
    for the daemon to answer GetStats.
    """
    sock = os.path.join(tmpdir, f"{name}.sock")
    log_path = os.path.join(tmpdir, f"{name}.log")
    logf = open(log_path, "w")
    proc = subprocess.Popen(
        [*DIE_WITH_PARENT, *wrap, sys.executable, "-m", "kvd.cli", "serve", "--engine-socket", sock,
         "--peer-listen", "127.0.0.1:0", "--log-level", "debug", *extra],
        stdout=logf, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True,
    )
    d = Daemon(proc, sock, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon {name} exited {proc.returncode}:\n{d.log()}")
        if os.path.exists(sock):
            try:
                d.peer_address = d.stats().peer_address
                return d
            except grpc.RpcError:
                pass
        time.sleep(0.1)
    d.stop(signal.SIGKILL)
    raise RuntimeError(f"daemon {name} not serving after {timeout} s:\n{d.log()}")


class ShmSegment:
    """A POSIX shm object made by the test (an engine's KV cache stand-in)."""

    def __init__(self, size: int, prefix: str = "kvdtest"):
        self.name = f"/{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.path = "/dev/shm" + self.name
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self.array = np.frombuffer(self.mm, dtype=np.uint8)

    def close(self) -> None:
        self.array = None
        try:
            self.mm.close()
        except BufferError:
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclass
class KvShape:
    """A per-layer K/V layout: ``layers x 2 regions x num_blocks x block_len`` bytes."""

    num_layers: int = 4
    num_blocks: int = 64
    block_len: int = 4096
    block_size: int = 16

    @property
    def num_regions(self) -> int:
        return self.num_layers * 2

    @property
    def size(self) -> int:
        return self.num_regions * self.num_blocks * self.block_len

    def regions(self) -> list[pb.Region]:
        return [
            pb.Region(segment_index=0, offset=i * self.num_blocks * self.block_len, block_len=self.block_len,
                      block_stride=self.block_len, name=f"layer{i // 2}/{'kv'[i % 2]}")
            for i in range(self.num_regions)
        ]

    def layout(self) -> pb.Layout:
        return pb.Layout(num_blocks=self.num_blocks, block_size=self.block_size, kv_layout=pb.KV_LAYOUT_NHD,
                         dtype="float16", num_kv_heads=2, head_dim=self.block_len // (2 * 2 * self.block_size),
                         num_layers=self.num_layers, block_lens=[self.block_len] * self.num_regions)

    def block_bytes(self, seg: ShmSegment, region: int, block: int) -> bytes:
        off = (region * self.num_blocks + block) * self.block_len
        return bytes(seg.mm[off:off + self.block_len])


def register_request(engine_id: str, shape: KvShape, seg: ShmSegment, rank: int = 0, size: int = 1,
                     model: str = "test-model") -> pb.RegisterEngineRequest:
    return pb.RegisterEngineRequest(
        worker=pb.EngineWorker(engine_id=engine_id, tp_rank=rank, tp_size=size),
        layout=shape.layout(),
        segments=[pb.Segment(kind=pb.MEMORY_KIND_SHM, name=seg.name, size=seg.size)],
        regions=shape.regions(),
        model=model,
    )


class Session:
    """A raw session stream (no shim): send commands, wait for events."""

    def __init__(self, daemon: Daemon, engine_id: str, rank: int = 0):
        import queue
        import threading

        self._out: "queue.Queue" = queue.Queue()
        self.events: "queue.Queue" = queue.Queue()
        # The daemon's own message bound (64 MiB) both ways: a LoadFailed names
        # every block of a command, however large the command was.
        self._channel = grpc.insecure_channel(f"unix:{daemon.socket}", options=[
            ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)])
        stub = pb_grpc.EngineServiceStub(self._channel)
        self._out.put(pb.SessionCommand(open=pb.OpenSession(worker=pb.EngineWorker(engine_id=engine_id, tp_rank=rank))))

        def gen():
            while True:
                c = self._out.get()
                if c is None:
                    return
                yield c

        self._call = stub.Session(gen())

        def read():
            try:
                for e in self._call:
                    self.events.put(e)
            except grpc.RpcError as e:
                self.events.put(e)

        threading.Thread(target=read, daemon=True).start()
        first = self.next(10)
        if isinstance(first, grpc.RpcError):
            raise first
        assert first.WhichOneof("event") == "opened", first

    def send(self, **kw) -> None:
        self._out.put(pb.SessionCommand(**kw))

    def next(self, timeout: float = 10.0):
        return self.events.get(timeout=timeout)

    def close(self) -> None:
        self._out.put(None)
        self._call.cancel()
        self._channel.close()


def one_group(block_ids) -> list[pb.BlockIds]:
    """Block ids as the wire carries them for a model without HMA: one group."""
    return [pb.BlockIds(ids=list(block_ids))]


@contextmanager
def segments(*sizes: int):
    segs = [ShmSegment(s) for s in sizes]
    try:
        yield segs
    finally:
        for s in segs:
            s.close()


# =====================================================================
# Reliability helpers (issue 4; tests/test_reliability_*.py). Everything
# above is unchanged for the other tests.
# =====================================================================

import collections
import contextlib
import socket as _socket
import threading
from concurrent.futures import ThreadPoolExecutor


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for daemons restarted on a fixed address)."""
    with _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (``VmRSS`` of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def maps_of(pid: int) -> str:
    """``/proc/<pid>/maps``: what the process has mapped (shm segments show as /dev/shm/<name>)."""
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02) -> float:
    """Polls ``predicate()`` until true; returns the seconds it took.

    Raises AssertionError naming ``what`` after ``timeout`` seconds.
    """
    t0 = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not true after {timeout} s: {what}")
        time.sleep(interval)


LEAK_FIELDS = ("active_leases", "inflight_transfers", "leaked_handles", "remote_agents", "early_notifications",
               "pending_events", "prepped_dlists")


def leak_counts(daemon: Daemon) -> dict[str, int]:
    """The StatsResponse fields that must return to their baseline when nothing is going on."""
    st = daemon.stats()
    return {k: getattr(st, k) for k in LEAK_FIELDS}


def fill(seg: ShmSegment, seed: int) -> None:
    """Fills a segment with bytes unique per 8-byte word and per ``seed``
    (fast: a few hundred ms for 512 MiB, where random bytes take seconds)."""
    words = seg.size // 8
    w = np.frombuffer(seg.mm, dtype=np.uint64, count=words)
    w[:] = np.arange(words, dtype=np.uint64)
    w *= np.uint64(0x9E3779B97F4A7C15)
    w ^= np.uint64((seed * 0xD6E8FEB86659FD93) & 0xFFFFFFFFFFFFFFFF)
    del w
    seg.array[words * 8:] = seed & 0xFF


class Engine:
    """An engine worker played by the test: one shm segment holding its KV
    cache (``shape``), registered with ``daemon``, driven over a raw session.

    Events are filed by request id as they arrive, whatever their order;
    :meth:`wait` returns the next one for a request. ``kv`` views the cache
    as ``[region, block, byte]``.
    """

    def __init__(self, daemon: Daemon, engine_id: str, shape: KvShape, *, rank: int = 0, tp_size: int = 1,
                 model: str = "test-model", seed: int | None = None, open_session: bool = True,
                 seg: ShmSegment | None = None):
        self.daemon = daemon
        self.engine_id = engine_id
        self.rank = rank
        self.shape = shape
        self._own_seg = seg is None  # a segment passed in outlives the engine
        self.seg = seg if seg is not None else ShmSegment(shape.size)
        self.kv = self.seg.array.reshape(shape.num_regions, shape.num_blocks, shape.block_len)
        if seed is not None:
            fill(self.seg, seed)
        try:
            self.registered = daemon.stub().RegisterEngine(
                register_request(engine_id, shape, self.seg, rank=rank, size=tp_size, model=model), timeout=60)
            self.session = Session(daemon, engine_id, rank) if open_session else None
        except BaseException:
            if self._own_seg:
                self.seg.close()
            raise
        self._filed: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._cond = threading.Condition()
        self.broken: grpc.RpcError | None = None
        self.arrived = 0.0
        if self.session is not None:
            threading.Thread(target=self._file_events, daemon=True, name=f"events-{engine_id}").start()

    @property
    def peer_address(self) -> str:
        return self.daemon.peer_address

    # -- commands (all non-blocking) -------------------------------------------------
    def hold(self, request_id: str, block_ids, lease_s: float = 600.0) -> None:
        self.session.send(hold=pb.HoldBlocks(request_id=request_id, groups=one_group(block_ids), lease_s=lease_s))

    def release(self, request_id: str) -> None:
        self.session.send(release=pb.ReleaseBlocks(request_id=request_id))

    def load(self, request_id: str, local_ids, src: "Engine | None", remote_ids, remote_request_id: str, *,
             timeout_s: float = 0.0, remote_engine_id: str | None = None, remote_address: str | None = None,
             remote_tp_size: int = 1) -> None:
        self.session.send(load=pb.LoadBlocks(
            request_id=request_id, local_groups=one_group(local_ids),
            remote_engine_id=remote_engine_id if remote_engine_id is not None else src.engine_id,
            remote_address=remote_address if remote_address is not None else src.peer_address,
            remote_groups=one_group(remote_ids), remote_request_id=remote_request_id,
            remote_tp_size=remote_tp_size, timeout_s=timeout_s))

    def abort_load(self, request_id: str, src: "Engine", remote_request_id: str) -> None:
        self.session.send(abort_load=pb.AbortLoad(
            request_id=request_id, remote_engine_id=src.engine_id, remote_address=src.peer_address,
            remote_request_id=remote_request_id, remote_tp_size=1))

    # -- events ------------------------------------------------------------------------
    @staticmethod
    def request_of(ev: pb.SessionEvent) -> str:
        return getattr(ev, ev.WhichOneof("event")).request_id

    def _file_events(self) -> None:
        """Background thread: files each event with its arrival time (monotonic)."""
        while True:
            ev = self.session.events.get()
            with self._cond:
                if isinstance(ev, grpc.RpcError):
                    self.broken = ev
                    self._cond.notify_all()
                    return
                self._filed[self.request_of(ev)].append((time.monotonic(), ev))
                self._cond.notify_all()

    def _take(self, request_id: str, timeout: float) -> tuple[float, pb.SessionEvent] | None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._filed.get(request_id):
                left = deadline - time.monotonic()
                if left <= 0 or self.broken is not None:
                    return None
                self._cond.wait(left)
            got = self._filed[request_id].popleft()
            if not self._filed[request_id]:
                del self._filed[request_id]
            return got

    def wait(self, request_id: str, timeout: float = 30.0) -> pb.SessionEvent:
        """The next event for ``request_id``; ``self.arrived`` is when it arrived.

        Raises AssertionError after ``timeout`` seconds, or if the session broke.
        """
        got = self._take(request_id, timeout)
        if got is None:
            if self.broken is not None:
                raise AssertionError(f"session of {self.engine_id} broke: {self.broken.code()}: "
                                     f"{self.broken.details()}")
            raise AssertionError(f"{self.engine_id}: no event for request {request_id!r} within {timeout} s")
        self.arrived = got[0]
        return got[1]

    def take_any(self, timeout: float = 0.0) -> tuple[str, pb.SessionEvent] | None:
        """Any one filed event, oldest request first: ``(request id, event)``; None if none came."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(self._filed.values()):
                left = deadline - time.monotonic()
                if left <= 0 or self.broken is not None:
                    return None
                self._cond.wait(left)
            rid = next(r for r, evs in self._filed.items() if evs)
            t, ev = self._filed[rid].popleft()
            if not self._filed[rid]:
                del self._filed[rid]
            self.arrived = t
            return rid, ev

    def quiet(self, request_id: str, seconds: float) -> bool:
        """True when no event for ``request_id`` arrives within ``seconds`` (none is consumed)."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while not self._filed.get(request_id):
                left = deadline - time.monotonic()
                if left <= 0:
                    return True
                self._cond.wait(left)
        return False

    def drain(self, seconds: float = 0.0) -> list[pb.SessionEvent]:
        """Every event received so far (waiting ``seconds`` first), unfiled."""
        time.sleep(seconds)
        with self._cond:
            out = [ev for evs in self._filed.values() for _, ev in evs]
            self._filed.clear()
        return out

    def same_blocks(self, local_ids, src: "Engine", remote_ids) -> bool:
        """Every region of local blocks ``local_ids`` equals ``src``'s ``remote_ids``."""
        return bool(np.array_equal(self.kv[:, list(local_ids)], src.kv[:, list(remote_ids)]))

    def close(self, unregister: bool = True) -> None:
        """Ends the session, unregisters (if the daemon still runs), removes the segment."""
        try:
            if self.session is not None:
                self.session.close()
            if unregister and self.daemon.proc.poll() is None:
                try:
                    self.daemon.stub().UnregisterEngine(
                        pb.UnregisterEngineRequest(worker=pb.EngineWorker(engine_id=self.engine_id, tp_rank=self.rank)),
                        timeout=10)
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.NOT_FOUND:
                        raise
        finally:
            self.kv = None
            if self._own_seg:
                self.seg.close()


def event_kind(ev) -> str:
    """``"recv_done"``, ``"load_failed"``, ``"send_done"``, ``"rejected"`` or ``"opened"``."""
    return ev.WhichOneof("event")


class FakePeer:
    """An in-process ``PeerService`` on ``127.0.0.1:<free port>`` that answers
    every handshake with ``respond(request, context)`` (a forged
    ``HandshakeResponse``, or ``context.abort(...)``). Counts the calls."""

    def __init__(self, respond):
        self.respond = respond
        self.calls = 0
        peer = self

        class _Servicer(pb_grpc.PeerServiceServicer):
            def Handshake(self, request, context):
                peer.calls += 1
                return peer.respond(request, context)

        self.server = grpc.server(ThreadPoolExecutor(max_workers=4), options=[
            ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)])
        pb_grpc.add_PeerServiceServicer_to_server(_Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=0.5).wait()


@contextlib.contextmanager
def blackhole():
    """``host:port`` of a TCP listener that accepts connections and never answers
    (a peer daemon that hangs: every handshake with it can only time out)."""
    srv = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    conns, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join(2)
        for c in conns:
            c.close()
        srv.close()


def closed_address() -> str:
    """``127.0.0.1:<port>`` where nothing listens (connection refused)."""
    return f"127.0.0.1:{free_port()}"


class NetnsPair:
    """Two network namespaces joined by a veth pair: two "hosts" on one machine.

    ``a`` and ``b`` are the namespace names, ``ip_a``/``ip_b`` their addresses
    on 10.<x>.<y>.0/24, ``dev_a``/``dev_b`` the veth ends. :meth:`link`
    cuts or restores the wire. Made in ``__enter__``, removed in ``__exit__``
    whatever happened. Raises OSError (with ip's message) when namespaces
    cannot be made here (not root, no CAP_NET_ADMIN, no ``ip``).
    """

    def __init__(self):
        tag = uuid.uuid4().hex[:6]
        n = int(tag, 16)
        self.a, self.b = f"kvdA{tag}", f"kvdB{tag}"
        self.dev_a, self.dev_b = f"kva{tag}", f"kvb{tag}"
        self.ip_a, self.ip_b = f"10.{200 + n % 50}.{(n >> 8) % 250}.1", f"10.{200 + n % 50}.{(n >> 8) % 250}.2"

    @staticmethod
    def _ip(*args: str) -> None:
        r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
        if r.returncode:
            raise OSError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")

    def __enter__(self) -> "NetnsPair":
        try:
            self._ip("netns", "add", self.a)
            self._ip("netns", "add", self.b)
            self._ip("link", "add", self.dev_a, "type", "veth", "peer", "name", self.dev_b)
            for ns, dev, ip in ((self.a, self.dev_a, self.ip_a), (self.b, self.dev_b, self.ip_b)):
                self._ip("link", "set", dev, "netns", ns)
                self._ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                self._ip("-n", ns, "link", "set", dev, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def wrap(self, ns: str) -> tuple[str, ...]:
        """Command prefix that runs a program inside namespace ``ns``."""
        return ("ip", "netns", "exec", ns)

    def limit_rate(self, mbit: int) -> bool:
        """Caps each end's sending rate (``tc`` token bucket), so that a
        transfer lasts long enough to be cut in the middle. False (and no
        cap) where ``tc``/``sch_tbf`` is not available."""
        try:
            for ns, dev in ((self.a, self.dev_a), (self.b, self.dev_b)):
                r = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                                    "burst", "64kb", "latency", "200ms"], capture_output=True, text=True, timeout=20)
                if r.returncode:
                    return False
        except (OSError, subprocess.TimeoutExpired):
            return False
        return True

    def link(self, up: bool) -> None:
        """Cuts (``up=False``) or restores the wire, on both ends."""
        for ns, dev in ((self.a, self.dev_a), (self.b, self.dev_b)):
            self._ip("-n", ns, "link", "set", dev, "up" if up else "down")

    def __exit__(self, *exc) -> None:
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", self.dev_a], capture_output=True, timeout=20)
