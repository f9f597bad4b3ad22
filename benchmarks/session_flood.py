"""One engine floods its command socket; how long does another engine wait?

    .venv/bin/python -m benchmarks.session_flood [--kind load] [--frames 1000000] [--seconds 25] [--json FILE]

Starts one daemon with two engine workers: an attacker session on a raw
command-socket connection that writes ``--frames`` commands in one burst
(``load``: loads of an out-of-range block, each failing at once;
``holdrel``: a hold and its release, two frames per count; ``emptyload``:
loads with no fields),
reading its events as they come, and a victim session (the test harness's
``Engine``) that holds and releases one block in a loop meanwhile. Prints
the victim's round trips (median, p99, max, and each one over 20 ms with its
start), the daemon's RSS before and at its peak, whether it is alive, and
how many lines it logged. What it bounds: docs/SECURITY.md "Limits" (the
commands of one connection run per pass of the event loop), measured in
docs/PERFORMANCE.md "sixth round".
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import tempfile
import threading
import time

from kvd.command_wire import command_socket_path, frame
from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import Engine, KvShape
from kvd.v1 import kvd_pb2 as pb


def _cmd(**kw) -> bytes:
    return frame(pb.SessionCommand(**kw).SerializeToString())


def burst(kind: str, n: int) -> bytes:
    """``n`` commands of ``kind`` as frames."""
    if kind == "load":
        one = lambda i: _cmd(load=pb.LoadBlocks(  # noqa: E731
            request_id=f"l{i}", local_groups=[pb.BlockIds(ids=[10 ** 6])], remote_engine_id="x",
            remote_address="127.0.0.1:1", remote_groups=[pb.BlockIds(ids=[1])], remote_request_id="x"))
    elif kind == "holdrel":
        one = lambda i: (_cmd(hold=pb.HoldBlocks(request_id=f"h{i}", groups=[pb.BlockIds(ids=[1])], lease_s=60))  # noqa: E731
                         + _cmd(release=pb.ReleaseBlocks(request_id=f"h{i}")))
    elif kind == "emptyload":
        one = lambda i: _cmd(load=pb.LoadBlocks())  # noqa: E731
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return b"".join(one(i) for i in range(n))


def _rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    return 0


def run(kind: str, frames: int, seconds: float) -> dict:
    """Runs the flood (see the module); returns the figures it prints."""
    d = start_daemon(tempfile.mkdtemp(prefix="kvd-flood-"), "kvd", "--command-socket", "true", log_level="info")
    out: dict = {}
    try:
        victim = Engine(d, "victim", KvShape())
        Engine(d, "atk", KvShape(), open_session=False)
        data = burst(kind, frames)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(command_socket_path(d.socket))
        s.sendall(_cmd(open=pb.OpenSession(worker=pb.EngineWorker(engine_id="atk", tp_rank=0))))
        stop = threading.Event()

        def read() -> None:  # the attacker reads its events (a deaf one is bounded otherwise)
            while not stop.is_set():
                if select.select([s], [], [], 0.5)[0]:
                    try:
                        if not s.recv(1 << 20):
                            return
                    except OSError:
                        return

        threading.Thread(target=read, daemon=True).start()
        time.sleep(0.5)
        base = peak = _rss_mib(d.proc.pid)

        def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, _rss_mib(d.proc.pid))
                time.sleep(0.02)

        threading.Thread(target=watch, daemon=True).start()
        attacker = threading.Thread(target=lambda: s.sendall(data), daemon=True)
        t_start = time.monotonic()
        attacker.start()
        rtts, slow, i = [], [], 0
        while time.monotonic() - t_start < seconds:
            rid, t0 = f"v{i}", time.monotonic()
            i += 1
            victim.hold(rid, [2], lease_s=60)
            victim.release(rid)
            victim.wait(rid, timeout=60)
            rtts.append(time.monotonic() - t0)
            if rtts[-1] > 0.02:
                slow.append((round(t0 - t_start, 2), round(rtts[-1] * 1e3)))
            if not attacker.is_alive() and len(rtts) > 50 and time.monotonic() - t_start > 3:
                break
            time.sleep(0.005)
        attacker.join(60)
        stop.set()
        rtts.sort()
        out = {"kind": kind, "frames": frames, "bytes": len(data), "round_trips": len(rtts),
               "median_ms": statistics.median(rtts) * 1e3, "p99_ms": rtts[int(len(rtts) * 0.99)] * 1e3,
               "max_ms": rtts[-1] * 1e3, "slow": slow, "rss_base_mib": base, "rss_peak_mib": peak,
               "alive": d.proc.poll() is None}
        s.close()
    finally:
        d.stop()
    with open(d.log_path) as f:
        out["log_lines"] = f.read().count("\n")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=("load", "holdrel", "emptyload"), default="load")
    ap.add_argument("--frames", type=int, default=1_000_000, help="commands (holdrel: pairs) in the burst "
                    "(default 1,000,000)")
    ap.add_argument("--seconds", type=float, default=25.0, help="longest the victim keeps measuring (default 25)")
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args()
    r = run(args.kind, args.frames, args.seconds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "session_flood", **r, "loadavg": list(os.getloadavg())}, f,
                      indent=1)
    pairs = " (a hold and a release each)" if r["kind"] == "holdrel" else ""
    print(f"burst: {r['frames']:,} {r['kind']} commands{pairs}, {r['bytes']:,} bytes")
    print(f"victim round trips: {r['round_trips']}, median {r['median_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, "
          f"max {r['max_ms']:.1f} ms; over 20 ms (start s, ms): {r['slow']}")
    print(f"daemon RSS {r['rss_base_mib']} MiB, peak {r['rss_peak_mib']} MiB; alive {r['alive']}; "
          f"log lines {r['log_lines']:,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
