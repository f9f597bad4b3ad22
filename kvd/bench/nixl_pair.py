"""Case (b) of the data-plane benchmark: two NIXL agents in two plain
processes, no daemon: the in-process connector's path.

Each :class:`NixlPeer` is a child process (``spawn``) that owns one NIXL agent,
maps a shm segment the benchmark made, registers it as DRAM and obeys commands
sent over a pipe. The reader prepares both descriptor lists once per block
length (as vLLM's ``NixlConnector`` does at handshake), then each transfer is
``make_prepped_xfer`` + ``transfer`` with a notification, and a poll of
``check_xfer_state`` until DONE, timed inside the reader process. The source
process collects notifications (``get_new_notifs``) while it waits for
commands, as the prefill worker does every engine step.

The dependency rule of docs/DESIGN.md holds: this module never imports nixl;
the child gets NIXL's own classes (``nixl_agent``, ``nixl_agent_config``)
from :mod:`kvd.core.nixl_agent`, so the plain-NIXL case runs the same NIXL
calls vLLM's connector makes, with no kvd wrapper in between.

The agents are configured as vLLM 0.32's ``NixlConnector`` configures its own
(``nixl_agent_config(num_threads=4, capture_telemetry=True)``, NIXL's default
progress thread on), unless told otherwise (``prog_thread``, ``num_threads``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass


@dataclass
class PeerConfig:
    """How one plain-NIXL process sets up its agent."""

    prog_thread: bool = True       # NIXL's progress thread (the NIXL and vLLM default)
    num_threads: int = 4           # vLLM NixlConnector's default "num_threads" (UCX backend workers)
    capture_telemetry: bool = False
    pthr_delay_us: int = 0         # progress thread's poll() timeout (the Python API fixes 0: a spinning thread)
    idle_poll_s: float = 0.001     # source: get_new_notifs() this often while waiting for commands
    env: dict | None = None        # extra environment (UCX_* settings), set before NIXL loads


def _peer_main(conn, name: str, cfg: PeerConfig) -> None:  # pragma: no cover - runs in the child
    # Ctrl-C reaches the whole process group: the bench's process stops this
    # peer (PlainPeer.close), which would otherwise die with a traceback first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for k, v in (cfg.env or {}).items():
        os.environ[k] = str(v)
    import numpy as np
    import logging

    # NIXL's own Python API, as vLLM's NixlConnector drives it, loaded through
    # kvd's one NIXL module (the only one that may import nixl).
    from kvd.core.nixl_agent import _nixl

    nixl_agent, nixl_agent_config = _nixl()

    logging.getLogger("nixl").setLevel(logging.WARNING)

    from kvd.core.memory import ShmMapping

    kw = dict(enable_prog_thread=cfg.prog_thread, capture_telemetry=cfg.capture_telemetry)
    if cfg.num_threads:
        kw["num_threads"] = cfg.num_threads
    if cfg.pthr_delay_us:
        from kvd.core.nixl_agent import progress_delay

        with progress_delay(cfg.pthr_delay_us):
            agent = nixl_agent(name, nixl_agent_config(**kw))
    else:
        agent = nixl_agent(name, nixl_agent_config(**kw))
    maps: dict[str, ShmMapping] = {}
    regs = []
    lists: dict[str, tuple] = {}  # key -> (local prepped, remote prepped)
    notifs: list[bytes] = []
    conn.send(("ok", os.getpid()))
    while True:
        if not conn.poll(cfg.idle_poll_s):
            for msgs in agent.get_new_notifs().values():
                notifs.extend(msgs)
            continue
        cmd, *args = conn.recv()
        try:
            if cmd == "map":
                seg, size = args
                m = ShmMapping(seg, size)
                maps[seg] = m
                regs.append(agent.register_memory([(m.addr, m.size, 0, "")], "DRAM"))
                out = m.addr
            elif cmd == "meta":
                out = agent.get_agent_metadata()
            elif cmd == "add_remote":
                n = agent.add_remote_agent(args[0])
                out = n.decode() if isinstance(n, bytes) else str(n)
            elif cmd == "prep":
                key, remote, local_base, remote_base, block_len, num_blocks = args
                rows = np.arange(num_blocks, dtype=np.int64) * block_len
                mk = lambda base: np.stack([base + rows, np.full(num_blocks, block_len, np.int64),  # noqa: E731
                                            np.zeros(num_blocks, np.int64)], axis=1)
                local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", mk(local_base), "DRAM")
                rem = agent.prep_xfer_dlist(remote, mk(remote_base), "DRAM")
                lists[key] = (local, rem)
                out = True
            elif cmd == "read":
                key, lidx, ridx, notif, poll_s = args
                local, rem = lists[key]
                lidx = np.asarray(lidx, dtype=np.int32)
                ridx = np.asarray(ridx, dtype=np.int32)
                t0 = time.perf_counter()
                h = agent.make_prepped_xfer("READ", local, lidx, rem, ridx, notif)
                st = agent.transfer(h)
                while st == "PROC":
                    if poll_s:
                        time.sleep(poll_s)
                    st = agent.check_xfer_state(h)
                dt = time.perf_counter() - t0
                agent.release_xfer_handle(h)
                if st != "DONE":
                    raise RuntimeError(f"READ ended {st}")
                out = dt
            elif cmd == "read_many":
                # Several transfers posted back to back, polled together (concurrent
                # requests); returns each one's seconds from the first post to its DONE.
                key, reqs, poll_s = args
                local, rem = lists[key]
                t0 = time.perf_counter()
                hs = []
                for lidx, ridx, notif in reqs:
                    h = agent.make_prepped_xfer("READ", local, np.asarray(lidx, dtype=np.int32), rem,
                                                np.asarray(ridx, dtype=np.int32), notif)
                    agent.transfer(h)
                    hs.append(h)
                times = [0.0] * len(hs)
                left = set(range(len(hs)))
                while left:
                    for i in list(left):
                        st = agent.check_xfer_state(hs[i])
                        if st == "PROC":
                            continue
                        if st != "DONE":
                            raise RuntimeError(f"READ ended {st}")
                        times[i] = time.perf_counter() - t0
                        agent.release_xfer_handle(hs[i])
                        left.discard(i)
                    if left and poll_s:
                        time.sleep(poll_s)
                out = times
            elif cmd == "notifs":
                for msgs in agent.get_new_notifs().values():
                    notifs.extend(msgs)
                out, notifs = notifs, []
            elif cmd == "wait_notif":
                msg, timeout_s = args
                deadline = time.monotonic() + timeout_s
                while msg not in notifs and time.monotonic() < deadline:
                    for msgs in agent.get_new_notifs().values():
                        notifs.extend(msgs)
                    if msg not in notifs:
                        time.sleep(0.0001)
                out = msg in notifs
                if out:
                    notifs.remove(msg)
            elif cmd == "telemetry":
                out = None
            elif cmd == "quit":
                for local, rem in lists.values():
                    agent.release_dlist_handle(local)
                    agent.release_dlist_handle(rem)
                for r in regs:
                    agent.deregister_memory(r)
                for m in maps.values():
                    m.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", out))
        except Exception as e:  # report, keep serving
            conn.send(("err", f"{type(e).__name__}: {e}"))


class NixlPeer:
    """A plain process with one NIXL agent, driven over a pipe (see module docstring)."""

    def __init__(self, name: str, cfg: PeerConfig | None = None, start_timeout_s: float = 60.0):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.name = name
        self.proc = ctx.Process(target=_peer_main, args=(child, name, cfg or PeerConfig()), daemon=True,
                                name=f"nixl-{name}")
        # Started with SIGINT ignored, which the spawned interpreter keeps: a
        # Ctrl-C while it imports would otherwise end it in a traceback.
        try:
            was = signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread: it cannot set handlers (nor receive SIGINT)
            was = None
        try:
            self.proc.start()
        finally:
            if was is not None:
                signal.signal(signal.SIGINT, was)
        if not self._conn.poll(start_timeout_s):
            self.proc.kill()
            raise RuntimeError(f"NIXL peer {name} did not start in {start_timeout_s} s")
        _, self.pid = self._conn.recv()

    def call(self, *cmd, timeout_s: float = 120.0):
        """Sends command ``cmd`` to the peer process and returns its result. Raises
        TimeoutError with no answer in ``timeout_s`` seconds, RuntimeError when the
        peer reports an error."""
        self._conn.send(cmd)
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"NIXL peer {self.name}: no answer to {cmd[0]} in {timeout_s} s")
        st, out = self._conn.recv()
        if st != "ok":
            raise RuntimeError(f"NIXL peer {self.name}: {cmd[0]}: {out}")
        return out

    def pause(self, on: bool) -> None:
        """SIGSTOP / SIGCONT: a paused peer uses no CPU (its progress thread spins otherwise)."""
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGSTOP if on else signal.SIGCONT)

    def close(self) -> None:
        """Resumes the peer, asks it to quit (10 s), then kills it if still alive."""
        self.pause(False)
        if self.proc.is_alive():
            try:
                self.call("quit", timeout_s=10)
            except Exception:
                pass
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()


class NixlPair:
    """A reader and a source process, each with its segment registered, connected
    (agent metadata exchanged after registration, as a handshake does).

    ``prep(bl, n)`` prepares the descriptor lists for ``n`` blocks of ``bl``
    bytes at the start of both segments; ``read(...)`` moves blocks and
    returns the reader's seconds from post to DONE.
    """

    def __init__(self, src_seg: str, src_size: int, dst_seg: str, dst_size: int,
                 cfg: PeerConfig | None = None, tag: str = ""):
        tag = tag or f"{os.getpid()}-{time.monotonic_ns() % 100000}"
        self.source = NixlPeer(f"bench-src-{tag}", cfg)
        self.reader = NixlPeer(f"bench-dst-{tag}", cfg)
        try:
            self._bases = (self.source.call("map", src_seg, src_size), self.reader.call("map", dst_seg, dst_size))
            self.src_name = self.reader.call("add_remote", self.source.call("meta"))
            self.source.call("add_remote", self.reader.call("meta"))
        except BaseException:
            self.close()
            raise
        self._prepped: set = set()

    def prep(self, block_len: int, num_blocks: int) -> str:
        """Prepares the reader's descriptor lists for ``num_blocks`` blocks of
        ``block_len`` bytes at the start of both segments (once per shape);
        returns the key for :meth:`read`."""
        key = f"{block_len}x{num_blocks}"
        if key not in self._prepped:
            src_base, dst_base = self._bases
            self.reader.call("prep", key, self.src_name, dst_base, src_base, block_len, num_blocks)
            self._prepped.add(key)
        return key

    def read(self, key: str, local_ids, remote_ids, notif: bytes, poll_s: float = 0.0) -> float:
        """READs ``remote_ids`` into ``local_ids`` with notification ``notif``
        (``poll_s`` seconds between polls); the reader's seconds from post to DONE."""
        return self.reader.call("read", key, list(local_ids), list(remote_ids), notif, poll_s)

    def read_many(self, key: str, reqs: list[tuple[list[int], list[int], bytes]], poll_s: float = 0.0) -> list[float]:
        """Posts every ``(local_ids, remote_ids, notif)`` at once; each one's
        seconds from the first post to its DONE."""
        return self.reader.call("read_many", key, [(list(l), list(r), n) for l, r, n in reqs], poll_s)

    def pause(self, on: bool) -> None:
        """Pauses (SIGSTOP) or resumes (SIGCONT) both processes."""
        self.reader.pause(on)
        self.source.pause(on)

    def close(self) -> None:
        """Stops the reader and the source process."""
        self.reader.close()
        self.source.close()
