"""Engines played by a harness over raw gRPC (no shim): a per-layer KV
layout in one shm segment, its registration, a session stream, and an
:class:`Engine` that files the daemon's events by request id."""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np

from kvd.client.command_socket import CommandConnection
from kvd.command_wire import refusal
from kvd.testing.daemons import Daemon
from kvd.testing.shm import ShmSegment
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

# The daemon's own message bound (64 MiB) both ways: a LoadFailed names every
# block of a command, however large the command was.
MESSAGE_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def one_group(block_ids) -> list[pb.BlockIds]:
    """Block ids as the wire carries them for a model without HMA: one group."""
    return [pb.BlockIds(ids=list(block_ids))]


@dataclass
class KvShape:
    """A per-layer K/V layout: ``layers x 2 regions x num_blocks x block_len``
    bytes in one segment (NHD, float16, 2 KV heads; ``block_size`` tokens per block)."""

    num_layers: int = 4
    num_blocks: int = 64
    block_len: int = 4096
    block_size: int = 16

    @property
    def num_regions(self) -> int:
        """Regions: one K and one V per layer."""
        return self.num_layers * 2

    @property
    def size(self) -> int:
        """Bytes of the whole cache."""
        return self.num_regions * self.num_blocks * self.block_len

    def regions(self) -> list[pb.Region]:
        """The proto regions, back to back in segment 0."""
        return [
            pb.Region(segment_index=0, offset=i * self.num_blocks * self.block_len, block_len=self.block_len,
                      block_stride=self.block_len, name=f"layer{i // 2}/{'kv'[i % 2]}")
            for i in range(self.num_regions)
        ]

    def layout(self) -> pb.Layout:
        """The proto layout (head_dim derived from ``block_len``)."""
        return pb.Layout(num_blocks=self.num_blocks, block_size=self.block_size, kv_layout=pb.KV_LAYOUT_NHD,
                         dtype="float16", num_kv_heads=2, head_dim=self.block_len // (2 * 2 * self.block_size),
                         num_layers=self.num_layers, block_lens=[self.block_len] * self.num_regions)

    def block_bytes(self, seg: ShmSegment, region: int, block: int) -> bytes:
        """The ``block_len`` bytes of block ``block`` of region ``region`` in ``seg``."""
        off = (region * self.num_blocks + block) * self.block_len
        return bytes(seg.mm[off:off + self.block_len])


def register_request(engine_id: str, shape: KvShape, seg: ShmSegment, rank: int = 0, size: int = 1,
                     model: str = "test-model") -> pb.RegisterEngineRequest:
    """The ``RegisterEngineRequest`` of engine worker ``engine_id`` (TP rank
    ``rank`` of ``size``) whose KV cache is ``seg`` laid out as ``shape``
    (``seg`` needs only ``name`` and ``size``, or a ``segment()`` that gives
    its proto segment: ``kvd.testing.memfd.MemfdSegment``)."""
    return pb.RegisterEngineRequest(
        worker=pb.EngineWorker(engine_id=engine_id, tp_rank=rank, tp_size=size),
        layout=shape.layout(),
        segments=[seg.segment() if hasattr(seg, "segment") else
                  pb.Segment(kind=pb.MEMORY_KIND_SHM, name=seg.name, size=seg.size)],
        regions=shape.regions(),
        model=model,
    )


class SessionError(grpc.RpcError):
    """How a command-socket session ends, read as the gRPC stream's end
    would be: ``code()`` (a ``grpc.StatusCode``) and ``details()``."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details



class Session:
    """A raw session (no shim) of worker ``engine_id``/``rank``: send
    commands, wait for events. ``events`` queues each SessionEvent, or the
    grpc.RpcError that ended the session. Raises grpc.RpcError when the daemon
    refuses to open it.

    On the daemon's command socket when it offers one (``kvd.command_wire``;
    ``KVD_COMMAND_SOCKET=false`` turns it off in the daemons tests start),
    else on the gRPC ``Session`` stream; a refusal on the socket is a
    :class:`SessionError` with the status the stream would have ended with.
    """

    def __init__(self, daemon: Daemon, engine_id: str, rank: int = 0):
        self._out: "queue.Queue" = queue.Queue()
        self.events: "queue.Queue" = queue.Queue()
        self._channel = self._call = self._conn = None
        self._out.put(pb.SessionCommand(open=pb.OpenSession(worker=pb.EngineWorker(engine_id=engine_id, tp_rank=rank))))

        def gen():
            while True:
                c = self._out.get()
                if c is None:
                    return
                yield c

        try:
            self._conn = CommandConnection.connect(daemon.socket, max_message_bytes=64 << 20, timeout_s=10)
        except OSError:
            self._channel = grpc.insecure_channel(f"unix:{daemon.socket}", options=MESSAGE_OPTIONS)
            self._call = pb_grpc.EngineServiceStub(self._channel).Session(gen())
        #: "socket" or "grpc": what carries this session.
        self.transport = "socket" if self._conn is not None else "grpc"

        def read():
            if self._conn is None:
                try:
                    for e in self._call:
                        self.events.put(e)
                except grpc.RpcError as e:
                    self.events.put(e)
                return
            try:
                for e in self._conn.events():
                    end = refusal(e.rejected.request_id, e.rejected.reason) if e.HasField("rejected") else None
                    if end is not None:
                        self.events.put(SessionError(getattr(grpc.StatusCode, end[0]), end[1]))
                        return
                    self.events.put(e)
                self.events.put(SessionError(grpc.StatusCode.UNAVAILABLE, "the daemon closed the command socket"))
            except OSError as e:
                self.events.put(SessionError(grpc.StatusCode.UNAVAILABLE, f"command socket: {e}"))

        def send():
            try:
                for c in gen():
                    self._conn.send([c])
            except OSError:
                pass

        threading.Thread(target=read, daemon=True).start()
        if self._conn is not None:
            threading.Thread(target=send, daemon=True).start()
        first = self.next(10)
        if isinstance(first, grpc.RpcError):
            raise first
        if first.WhichOneof("event") != "opened":
            raise RuntimeError(f"session of {engine_id}: first event is not 'opened': {first}")

    def send(self, **kw) -> None:
        """Queues ``SessionCommand(**kw)`` (e.g. ``hold=pb.HoldBlocks(...)``); never blocks."""
        self._out.put(pb.SessionCommand(**kw))

    def next(self, timeout: float = 10.0):
        """The next event (or the stream's RpcError); raises queue.Empty after ``timeout`` seconds."""
        return self.events.get(timeout=timeout)

    def close(self) -> None:
        """Ends the command stream and cancels the call (shuts the command socket)."""
        self._out.put(None)
        if self._conn is not None:
            self._conn.shutdown()
            return
        self._call.cancel()
        self._channel.close()


class Engine:
    """An engine worker played by the test: one shm segment holding its KV
    cache (``shape``), registered with ``daemon``, driven over a raw session.

    Events are filed by request id as they arrive, whatever their order;
    :meth:`wait` returns the next one for a request. ``kv`` views the cache
    as ``[region, block, byte]``. ``memfd``: the cache is a sealed memfd
    handed over on the daemon's fd side channel instead of a named segment.
    """

    def __init__(self, daemon: Daemon, engine_id: str, shape: KvShape, *, rank: int = 0, tp_size: int = 1,
                 model: str = "test-model", seed: int | None = None, open_session: bool = True,
                 seg: ShmSegment | None = None, memfd: bool = False):
        self.daemon = daemon
        self.engine_id = engine_id
        self.rank = rank
        self.shape = shape
        self._own_seg = seg is None  # a segment passed in outlives the engine
        if seg is None and memfd:  # handed over sealed, as the shim does where memfds work
            from kvd.testing.memfd import MemfdSegment

            seg = MemfdSegment(shape.size, daemon.socket)
            self._own_seg = True
        self.seg = seg if seg is not None else ShmSegment(shape.size)
        self.kv = self.seg.array.reshape(shape.num_regions, shape.num_blocks, shape.block_len)
        if seed is not None:
            self.seg.fill(seed)
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
        """The daemon's PeerService address (what a decode engine loads from)."""
        return self.daemon.peer_address

    # -- commands (all non-blocking) -------------------------------------------------
    def hold(self, request_id: str, block_ids, lease_s: float = 600.0) -> None:
        """Holds ``block_ids`` (one group) for ``request_id`` under a ``lease_s``
        second lease, as a prefill worker does."""
        self.session.send(hold=pb.HoldBlocks(request_id=request_id, groups=one_group(block_ids), lease_s=lease_s))

    def held(self, request_id: str, block_ids, timeout_s: float = 10.0) -> None:
        """Returns once the daemon holds ``block_ids`` for ``request_id``
        (a hold is a session command, not answered): asked as a reader's
        daemon asks, ``PeerService.Claim`` with a wait. For a test that calls
        the source's PeerService itself (a Push waits for no hold). Raises
        grpc.RpcError (PERMISSION_DENIED: not held within ``timeout_s``)."""
        with grpc.insecure_channel(self.daemon.peer_address) as ch:
            pb_grpc.PeerServiceStub(ch).Claim(pb.ClaimRequest(
                engine_id=self.engine_id, tp_rank=self.rank, request_id=request_id, groups=one_group(block_ids),
                wait_s=timeout_s), timeout=timeout_s + 5)

    def release(self, request_id: str) -> None:
        """Ends the lease of ``request_id`` (the daemon answers send_done(released))."""
        self.session.send(release=pb.ReleaseBlocks(request_id=request_id))

    def load(self, request_id: str, local_ids, src: "Engine | None", remote_ids, remote_request_id: str, *,
             timeout_s: float = 0.0, remote_engine_id: str | None = None, remote_address: str | None = None,
             remote_tp_size: int = 1) -> None:
        """Loads ``remote_ids`` of ``src`` (or the engine id and address given)
        into ``local_ids`` (one group each side, as the wire carries block ids:
        groups only); ``timeout_s`` 0: the daemon's default."""
        self.session.send(load=pb.LoadBlocks(
            request_id=request_id, local_groups=one_group(local_ids),
            remote_engine_id=remote_engine_id if remote_engine_id is not None else src.engine_id,
            remote_address=remote_address if remote_address is not None else src.peer_address,
            remote_groups=one_group(remote_ids), remote_request_id=remote_request_id,
            remote_tp_size=remote_tp_size, timeout_s=timeout_s))

    def abort_load(self, request_id: str, src: "Engine", remote_request_id: str) -> None:
        """Tells the daemon that ``request_id``'s load from ``src`` will not happen (frees src's lease)."""
        self.session.send(abort_load=pb.AbortLoad(
            request_id=request_id, remote_engine_id=src.engine_id, remote_address=src.peer_address,
            remote_request_id=remote_request_id, remote_tp_size=1))

    # -- events ------------------------------------------------------------------------
    @staticmethod
    def request_of(ev: pb.SessionEvent) -> str:
        """The request id an event is about."""
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
                request = pb.UnregisterEngineRequest(worker=pb.EngineWorker(engine_id=self.engine_id, tp_rank=self.rank))
                for attempt in (1, 2):
                    try:
                        self.daemon.stub().UnregisterEngine(request, timeout=10)
                    except grpc.RpcError as e:
                        # Once more on UNAVAILABLE while the daemon runs: the harness's one channel
                        # lost its connection under the call ("Stream removed (Socket closed)", seen
                        # once in a whole-suite run; unregistering is idempotent: NOT_FOUND after).
                        running = self.daemon.proc.poll() is None
                        if e.code() == grpc.StatusCode.UNAVAILABLE and attempt == 1 and running:
                            continue
                        if e.code() != grpc.StatusCode.NOT_FOUND:
                            raise
                    break
        finally:
            self.kv = None
            if self._own_seg:
                self.seg.close()


def event_kind(ev) -> str:
    """``"recv_done"``, ``"load_failed"``, ``"send_done"``, ``"rejected"`` or ``"opened"``."""
    return ev.WhichOneof("event")

