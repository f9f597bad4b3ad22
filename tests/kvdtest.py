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
        [*wrap, sys.executable, "-m", "kvd.cli", "serve", "--engine-socket", sock, "--peer-listen", "127.0.0.1:0",
         "--log-level", "debug", *extra],
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
        self._channel = grpc.insecure_channel(f"unix:{daemon.socket}")
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


@contextmanager
def segments(*sizes: int):
    segs = [ShmSegment(s) for s in sizes]
    try:
        yield segs
    finally:
        for s in segs:
            s.close()
