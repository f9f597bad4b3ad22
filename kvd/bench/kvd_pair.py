"""Case (a) of the data-plane benchmark: blocks moved between two kvd daemons.

The benchmark process plays both engines with the real engine-side client
(:class:`kvd.client.engine_client.EngineClient`, the one the vLLM shim uses):
a prefill worker registered with daemon P that holds blocks, a decode worker
registered with daemon D that loads them. Each block length gets its own pair
of workers (a layout has one block length), all on the same two shm segments.

A transfer is timed as the engine sees it: from ``load()`` (what the shim's
``start_load_kv`` does) to ``recv_done`` coming out of ``drain_events()`` (what
``get_finished`` does), polling every ``poll_s``. The prefill worker's hold
goes out ``hold_ahead_s`` before the load (``HOLD_AHEAD_S`` in ``kvd bench``
and the benchmarks), as in serving: vLLM's prefill worker sends it in the
step after the request finished, while the proxy forwards the
``kv_transfer_params`` to the decode engine, whose load comes a scheduling
step later. With 0 the hold and the load go out at once, and the load's
time includes the hold's way to its daemon (the protocol before the
followed holds; ``--hold-ahead-ms 0``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from kvd.client.engine_client import EngineClient
from kvd.requests import LoadRequest
from kvd.testing.daemons import Daemon, start_daemon
from kvd.testing.memfd import MemfdSegment
from kvd.v1 import kvd_pb2 as pb

#: How long before a load its hold is sent (seconds; see the module docstring).
HOLD_AHEAD_S = 0.005


def register_request(engine_id: str, seg_name: str, seg_size: int, block_len: int,
                     num_blocks: int, offset: int = 0, segment: pb.Segment | None = None) -> pb.RegisterEngineRequest:
    """One region of ``num_blocks`` blocks of ``block_len`` bytes at ``offset``
    of the named shm segment ``seg_name``, or of ``segment`` (a memfd handed over)."""
    return pb.RegisterEngineRequest(
        worker=pb.EngineWorker(engine_id=engine_id, tp_rank=0, tp_size=1),
        layout=pb.Layout(num_blocks=num_blocks, block_size=16, kv_layout=pb.KV_LAYOUT_NHD, dtype="float16",
                         num_kv_heads=1, head_dim=64, num_layers=1, block_lens=[block_len]),
        segments=[segment or pb.Segment(kind=pb.MEMORY_KIND_SHM, name=seg_name, size=seg_size)],
        regions=[pb.Region(segment_index=0, offset=offset, block_len=block_len, block_stride=block_len,
                           name="bench")],
        model="kvd-bench",
    )


@dataclass
class Worker:
    """One engine worker registered on a daemon of the pair: its engine id, its
    engine client and the number of blocks its region holds."""
    engine_id: str
    client: EngineClient
    num_blocks: int


class KvdPair:
    """Daemons P and D (started here unless given) and engine workers on them.

    Args:
        src: (name, size) of the source segment (P's engine memory).
        dst: (name, size) of the destination segment (D's engine memory).
        daemon_args: extra ``kvd serve`` flags for both daemons.
        env: extra environment for both daemons.
        daemons: ``(P, D)`` already running (not stopped by :meth:`close`);
            ``(S, S)``, one daemon for both workers, makes every load a
            same-node one (``kvd.core.local_copy``).
        prefix: of the daemons' names and of the workers' engine ids.
        same_node: start one daemon ``S`` for both workers (when ``daemons``
            is None). Its workers hand their memory over as sealed memfds
            (``src_mem``, ``dst_mem``: the caller fills and reads them), as the
            shim does: the daemon copies only between sealed memfds (a named
            segment could be truncated under its memmove), and takes the NIXL
            path for named ones.
    """

    def __init__(self, workdir: str, src: tuple[str, int], dst: tuple[str, int],
                 daemon_args: tuple[str, ...] = (), env: dict | None = None,
                 daemons: tuple[Daemon, Daemon] | None = None, entry: tuple[str, ...] = ("-m", "kvd.cli"),
                 prefix: str = "", same_node: bool = False):
        self.src, self.dst = src, dst
        self.prefix = prefix
        self._own_daemons = daemons is None
        if daemons is None and same_node:
            self.p = self.d = start_daemon(workdir, f"{prefix}S", *daemon_args, env=env, entry=entry,
                                           timeout=60.0, log_level="warning")
        elif daemons is None:
            self.p = start_daemon(workdir, f"{prefix}P", *daemon_args, env=env, entry=entry, timeout=60.0,
                                log_level="warning")
            try:
                self.d = start_daemon(workdir, f"{prefix}D", *daemon_args, env=env, entry=entry, timeout=60.0,
                                log_level="warning")
            except BaseException:
                self.p.stop()
                raise
        else:
            self.p, self.d = daemons
        self._sources: dict[tuple, Worker] = {}
        self._readers: dict[int, Worker] = {}
        self._ids = itertools.count()
        self.src_mem = self.dst_mem = None
        if same_node:
            try:
                self.src_mem = MemfdSegment(src[1], self.p.socket)
                self.dst_mem = MemfdSegment(dst[1], self.d.socket)
            except BaseException:
                self.close()
                raise

    def _client(self, daemon: Daemon, req: pb.RegisterEngineRequest) -> EngineClient:
        c = EngineClient(daemon.socket, unknown_lease_wait_s=600)
        c.register(req, timeout_s=60)
        c.start_session()
        if not c.wait_opened(30):
            raise RuntimeError(f"no session with daemon {daemon.name}")
        return c

    def source(self, block_len: int, tag: str = "") -> Worker:
        """The prefill worker for ``block_len`` (registered on P on first use);
        each ``tag`` is another engine worker on P: another remote peer for D."""
        key = (block_len, tag)
        if key not in self._sources:
            ns = self.src[1] // block_len
            eid = f"{self.prefix}src{tag}-{block_len}"
            seg = self.src_mem.segment() if self.src_mem is not None else None
            self._sources[key] = Worker(eid, self._client(self.p, register_request(
                eid, self.src[0], self.src[1], block_len, ns, segment=seg)), ns)
        return self._sources[key]

    def reader(self, block_len: int) -> Worker:
        """The decode worker for ``block_len`` (registered on D on first use)."""
        if block_len not in self._readers:
            nd = self.dst[1] // block_len
            eid = f"{self.prefix}dst-{block_len}"
            seg = self.dst_mem.segment() if self.dst_mem is not None else None
            self._readers[block_len] = Worker(eid, self._client(self.d, register_request(
                eid, self.dst[0], self.dst[1], block_len, nd, segment=seg)), nd)
        return self._readers[block_len]

    def hold(self, block_len: int, remote_ids, tag: str = "") -> int:
        """Holds ``remote_ids`` on P (non-blocking); returns the request's number
        ``n`` (prefill request ``p<n>``, the decode request :meth:`load` makes ``d<n>``)."""
        n = next(self._ids)
        self.source(block_len, tag).client.hold(f"p{n}", [list(remote_ids)], lease_s=300)
        return n

    def load(self, block_len: int, local_ids, remote_ids, n: int, tag: str = "") -> str:
        """Loads request ``n``'s ``remote_ids`` into ``local_ids`` on D
        (non-blocking); returns the decode request id."""
        pw, dw = self.source(block_len, tag), self.reader(block_len)
        dw.client.load(LoadRequest(f"d{n}", [list(local_ids)], pw.engine_id, self.p.peer_address,
                                   [list(remote_ids)], f"p{n}", remote_tp_size=1, timeout_s=120))
        return f"d{n}"

    def start(self, block_len: int, local_ids, remote_ids, tag: str = "", hold: bool = True) -> str:
        """Holds on P (unless ``hold`` is False) and loads on D at once
        (non-blocking); returns the decode request id."""
        n = self.hold(block_len, remote_ids, tag) if hold else next(self._ids)
        return self.load(block_len, local_ids, remote_ids, n, tag)

    def wait(self, block_len: int, rids: set[str], poll_s: float, timeout_s: float = 300.0) -> dict[str, float]:
        """Polls D's client until every request in ``rids`` is done; returns
        each one's completion time (``time.perf_counter``). Raises on a failed load."""
        dw = self.reader(block_len)
        left = set(rids)
        done: dict[str, float] = {}
        deadline = time.monotonic() + timeout_s
        while left:
            for ev in dw.client.drain_events():
                kind = ev.WhichOneof("event")
                if kind == "recv_done" and ev.recv_done.request_id in left:
                    left.discard(ev.recv_done.request_id)
                    done[ev.recv_done.request_id] = time.perf_counter()
                elif kind == "load_failed":
                    raise RuntimeError(f"load {ev.load_failed.request_id} failed: {ev.load_failed.reason}")
            if not left:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(left)} loads not done in {timeout_s} s")
            if poll_s:
                time.sleep(poll_s)
        return done

    def timed_start(self, block_len: int, local_ids, remote_ids, hold_ahead_s: float = 0.0) -> tuple[str, float]:
        """Starts one load, its hold sent ``hold_ahead_s`` seconds before it
        (0: at once); returns the decode request id and the load's start
        (``time.perf_counter``: after the hold's lead, before the hold when 0)."""
        if hold_ahead_s > 0:
            n = self.hold(block_len, remote_ids)
            time.sleep(hold_ahead_s)
            t0 = time.perf_counter()
            return self.load(block_len, local_ids, remote_ids, n), t0
        t0 = time.perf_counter()
        return self.start(block_len, local_ids, remote_ids), t0

    def transfer(self, block_len: int, local_ids, remote_ids, poll_s: float, hold_ahead_s: float = 0.0) -> float:
        """One load, start to finish, as the engine sees it (seconds), its
        hold sent ``hold_ahead_s`` before it (untimed; 0: at once, timed)."""
        rid, t0 = self.timed_start(block_len, local_ids, remote_ids, hold_ahead_s)
        return self.wait(block_len, {rid}, poll_s)[rid] - t0

    def pause(self, on: bool) -> None:
        """Pauses (SIGSTOP) or resumes both daemons (or the one)."""
        for d in {id(self.p): self.p, id(self.d): self.d}.values():
            d.pause(on)

    def drain_sources(self) -> int:
        """Drops P-side events (send_done of the holds); returns how many."""
        return sum(len(pw.client.drain_events()) for pw in self._sources.values())

    def close(self) -> None:
        """Unregisters every worker (10 s deadline each, errors ignored), closes
        their clients and stops the daemons started here."""
        for w in [*self._sources.values(), *self._readers.values()]:
            try:
                w.client.unregister(timeout_s=10)
            except Exception:
                pass
            w.client.close()
        self._sources.clear()
        self._readers.clear()
        for m in (self.src_mem, self.dst_mem):
            if m is not None:
                m.close()
        if self._own_daemons:
            self.d.stop()
            if self.p is not self.d:
                self.p.stop()
