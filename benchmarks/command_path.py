"""What one engine <-> daemon command round trip costs, by transport (a microbenchmark).

    .venv/bin/python -m benchmarks.command_path [--reps 3000] [--rounds 5] [--json FILE]

The engine sends a command of ``--size`` bytes (a small ``LoadBlocks`` is
~150 bytes) and waits for a reply of the same size, the daemon side
answering on an asyncio (uvloop) event loop in another process, as the
daemon does. Transports, run in rotating order, ``--rounds`` times:

- ``grpc``: a grpc.aio bidi stream over a Unix socket with raw bytes (no
  protobuf, no engine-socket gate): the session stream's transport alone;
- ``unix``: a plain Unix stream socket, length-prefixed frames; the daemon
  reads it with ``loop.add_reader``;
- ``ring``: a shared-memory ring per direction (fixed 256-byte slots, head
  and tail counters) with an eventfd per direction to wake the other side:
  the daemon with ``loop.add_reader`` on its eventfd, the engine blocked in
  ``read`` on its own (what a per-session command ring would be).

Prints the median and p90 round trip (us) of each transport per round and
over all rounds. This measures transports only: the daemon's work on a
command and the client's threads are not in it (``benchmarks.trace`` has the
whole path).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

SLOT = 256
SLOTS = 64
_HDR = struct.Struct("<QQ")  # head (written by the producer), tail (written by the consumer)


class Ring:
    """One direction: single producer, single consumer, over ``buf[off:]``."""

    def __init__(self, buf: mmap.mmap, off: int, efd: int):
        self.buf, self.off, self.efd = buf, off, efd
        self.data = off + _HDR.size

    def put(self, msg: bytes) -> None:
        head, tail = _HDR.unpack_from(self.buf, self.off)
        if head - tail >= SLOTS:
            raise RuntimeError("ring full")
        s = self.data + (head % SLOTS) * SLOT
        self.buf[s:s + 2] = len(msg).to_bytes(2, "little")
        self.buf[s + 2:s + 2 + len(msg)] = msg
        struct.pack_into("<Q", self.buf, self.off, head + 1)
        os.eventfd_write(self.efd, 1)

    def take(self) -> list[bytes]:
        head, tail = _HDR.unpack_from(self.buf, self.off)
        out = []
        while tail < head:
            s = self.data + (tail % SLOTS) * SLOT
            n = int.from_bytes(self.buf[s:s + 2], "little")
            out.append(bytes(self.buf[s + 2:s + 2 + n]))
            tail += 1
        struct.pack_into("<Q", self.buf, self.off + 8, tail)
        return out


RING_BYTES = _HDR.size + SLOTS * SLOT


def _daemon(kind: str, arg: list[str]) -> None:
    """The daemon side (``--serve KIND ARG...``): echoes every message until closed."""
    import uvloop

    async def ring_main(buf, efd_cmd, efd_evt):
        cmd, evt = Ring(buf, 0, efd_cmd), Ring(buf, RING_BYTES, efd_evt)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def readable():
            os.eventfd_read(efd_cmd)
            for m in cmd.take():
                if m == b"":  # the engine is done
                    loop.remove_reader(efd_cmd)
                    done.set_result(None)
                    return
                evt.put(m)

        loop.add_reader(efd_cmd, readable)
        await done

    async def unix_main(path):
        loop = asyncio.get_running_loop()
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        conn, _ = await loop.sock_accept(srv)
        conn.setblocking(False)
        done = loop.create_future()
        pending = bytearray()

        def readable():
            data = conn.recv(65536)
            if not data:  # the engine closed
                loop.remove_reader(conn.fileno())
                done.set_result(None)
                return
            pending.extend(data)
            while len(pending) >= 2:
                n = int.from_bytes(pending[:2], "little")
                if len(pending) < 2 + n:
                    break
                conn.send(bytes(pending[:2 + n]))
                del pending[:2 + n]

        loop.add_reader(conn.fileno(), readable)
        await done

    async def grpc_main(path):
        import grpc

        async def echo(it, context):
            async for m in it:
                yield m

        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "bench.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo)})
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        await server.wait_for_termination()

    uvloop.install()
    if kind == "ring":
        mfd, efd_cmd, efd_evt = map(int, arg)
        asyncio.run(ring_main(mmap.mmap(mfd, 2 * RING_BYTES), efd_cmd, efd_evt))
    elif kind == "unix":
        asyncio.run(unix_main(arg[0]))
    else:
        asyncio.run(grpc_main(arg[0]))


def _spawn(kind: str, *args, fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """The daemon side in a fresh interpreter (no fork: gRPC is loaded here)."""
    return subprocess.Popen([sys.executable, "-m", "benchmarks.command_path", "--serve", kind, *map(str, args)],
                            pass_fds=fds, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_ring(reps: int, size: int) -> list[float]:
    mfd = os.memfd_create("kvd-cmd-ring")
    os.ftruncate(mfd, 2 * RING_BYTES)
    buf = mmap.mmap(mfd, 2 * RING_BYTES)
    efd_cmd, efd_evt = os.eventfd(0), os.eventfd(0)
    proc = _spawn("ring", mfd, efd_cmd, efd_evt, fds=(mfd, efd_cmd, efd_evt))
    cmd, evt = Ring(buf, 0, efd_cmd), Ring(buf, RING_BYTES, efd_evt)
    msg, out = b"x" * size, []
    try:
        for i in range(reps + 50):
            t0 = time.perf_counter()
            cmd.put(msg)
            got = []
            while not got:
                os.eventfd_read(efd_evt)  # blocks until the daemon answers
                got = evt.take()
            if i >= 50:
                out.append(time.perf_counter() - t0)
        cmd.put(b"")
    finally:
        proc.wait(30)
        for fd in (mfd, efd_cmd, efd_evt):
            os.close(fd)
    return out


def run_unix(reps: int, size: int, workdir: str) -> list[float]:
    path = os.path.join(workdir, "unix.sock")
    proc = _spawn("unix", path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for _ in range(500):
        try:
            s.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.01)
    frame, out = len(b"x" * size).to_bytes(2, "little") + b"x" * size, []
    try:
        for i in range(reps + 50):
            t0 = time.perf_counter()
            s.sendall(frame)
            got = 0
            while got < len(frame):
                got += len(s.recv(65536))
            if i >= 50:
                out.append(time.perf_counter() - t0)
    finally:
        s.close()
        proc.wait(30)
    return out


def run_grpc(reps: int, size: int, workdir: str) -> list[float]:
    import queue

    import grpc

    path = os.path.join(workdir, "grpc.sock")
    proc = _spawn("grpc", path)
    ch = grpc.insecure_channel(f"unix:{path}")
    grpc.channel_ready_future(ch).result(timeout=30)
    call = ch.stream_stream("/bench.Echo/Stream")
    q: queue.SimpleQueue = queue.SimpleQueue()

    def commands():
        while (m := q.get()) is not None:
            yield m

    replies = call(commands())
    msg, out = b"x" * size, []
    try:
        for i in range(reps + 50):
            t0 = time.perf_counter()
            q.put(msg)
            next(replies)
            if i >= 50:
                out.append(time.perf_counter() - t0)
    finally:
        q.put(None)
        ch.close()
        proc.terminate()
        proc.wait(30)
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    """Runs every transport ``--rounds`` times (rotating order); prints a table. Returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", type=int, default=150, help="bytes per command and per reply (< 254)")
    ap.add_argument("--json", default="")
    ap.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)  # the daemon side (internal)
    args = ap.parse_args(argv)
    if args.serve:
        _daemon(args.serve[0], args.serve[1:])
        return 0
    kinds = ["grpc", "unix", "ring"]
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    per_round: dict[str, list[float]] = {k: [] for k in kinds}
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvd-cmdpath-") as wd:
        for r in range(args.rounds):
            for k in kinds[r % 3:] + kinds[:r % 3]:
                xs = (run_ring(args.reps, args.size) if k == "ring" else
                      run_unix(args.reps, args.size, wd) if k == "unix" else run_grpc(args.reps, args.size, wd))
                samples[k] += xs
                per_round[k].append(statistics.median(xs) * 1e6)
                if os.path.exists(os.path.join(wd, f"{k}.sock")):
                    os.unlink(os.path.join(wd, f"{k}.sock"))
    res = {"benchmark": "command_path", "reps": args.reps, "rounds": args.rounds, "size": args.size,
           "loadavg_start": load0, "loadavg_end": os.getloadavg(),
           "by": {k: {"p50_us": statistics.median(v) * 1e6, "p90_us": _pct(v, 90) * 1e6,
                      "round_p50s_us": per_round[k]} for k, v in samples.items()}}
    print(f"{'transport':>9}  {'p50 us':>8}  {'p90 us':>8}  round p50s (us)")
    for k, v in res["by"].items():
        print(f"{k:>9}  {v['p50_us']:8.1f}  {v['p90_us']:8.1f}  " + " ".join(f"{x:.0f}" for x in v["round_p50s_us"]))
    print(f"load average {tuple(round(x, 2) for x in load0)} -> {tuple(round(x, 2) for x in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
