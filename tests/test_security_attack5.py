"""Attacker scenarios against real daemons, fifth review: the gate's
refusal of a caller it does not admit (kvd/daemon/h2_refusal.py, its
lingering close) and PeerService calls before they are authenticated
(kvd/daemon/peer_auth.py, kvd/daemon/peer_local.py).

Each test runs the hostile sequence as a real unprivileged uid (or, for the
token, as a host without it) and asserts what docs/SECURITY.md promises;
then the daemon still serves a normal engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvd.testing.daemons import start_daemon
from kvd.testing.processes import child_env
from kvd.testing.security import NOBODY, OUTSIDER, reachable_dir
from kvd.testing.sessions import Engine, KvShape

SHAPE = KvShape(num_layers=1, num_blocks=8, block_len=1024)
IDLE_S = 3.0

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run callers as other users")


def _fds(d) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def _status_kib(d, field: str) -> int:
    for line in open(f"/proc/{d.proc.pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def _settled(d, fds: int, timeout: float) -> int:
    """The daemon's fd count once it is back to ``fds`` (or the last seen after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while (now := _fds(d)) > fds and time.monotonic() < deadline:
        time.sleep(0.1)
    return now


def _serves_an_engine(d, tag: str) -> None:
    e = Engine(d, f"normal-{tag}", SHAPE)
    try:
        e.hold("r", [1, 2])
        e.release("r")
        assert e.wait("r").send_done.released
    finally:
        e.close()


# A caller the gate does not admit (it reaches the socket through its group):
# n raw connections that speak HTTP/2 but never read what the gate answers
# (a tiny receive buffer), then hold their sockets open until told. Prints
# one JSON line per connection after sending: bytes the daemon took before it
# closed the connection (None: still open, taking nothing, when the send
# timed out or ended).
_NEVER_READS = r"""
import json, os, socket, sys
from kvd.daemon.h2_refusal import _PREFACE, _frame
path, uid, n, mode, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
settings = _frame(0x4, 0, 0)  # an empty SETTINGS frame: 9 bytes, each one answered with an ACK
socks, out = [], []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(path)
    s.settimeout(5.0)
    socks.append(s)
    sent, closed = 0, False
    try:
        s.sendall(_PREFACE)
        if mode == "flood":  # SETTINGS frames, as fast as the daemon takes them
            chunk = settings * 7000
            while sent < limit:
                s.sendall(chunk)
                sent += len(chunk)
        else:  # a few hundred SETTINGS (their ACKs fill the daemon's side), then the first call
            s.sendall(settings * limit + (_frame(0x1, 0x4, 1, b"\x82") if mode == "call" else b""))
            sent = 9 * limit
    except (BrokenPipeError, ConnectionResetError):
        closed = True
    except (TimeoutError, socket.timeout):
        pass
    out.append(sent if closed else None)
print(json.dumps(out), flush=True)
sys.stdin.readline()
"""


def _never_reads(sock: str, n: int, mode: str, limit: int) -> tuple[subprocess.Popen, list]:
    p = subprocess.Popen([sys.executable, "-c", _NEVER_READS, sock, str(NOBODY), str(n), mode, str(limit)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env())
    line = p.stdout.readline()
    assert line, f"hostile child exited {p.wait()}"
    return p, json.loads(line)


@pytest.fixture
def gated():
    d = start_daemon(reachable_dir(), "kvd", "--engine-socket-group", str(NOBODY),
                     "--engine-idle-timeout-s", str(IDLE_S), log_level="info")
    yield d
    assert d.stop() == 0


@needs_root
def test_a_refused_caller_flooding_settings_frames_is_cut_off_not_parsed_without_bound(gated):
    """A caller the gate does not admit sends HTTP/2 SETTINGS frames (9
    bytes each) before any call, as fast as the daemon takes them, and never
    reads. Before: the gate parsed each frame by slicing its whole buffer
    (quadratic: ~1 s of the event loop per 256 KiB received, every engine's
    calls waiting) and wrote an ACK for each into a write buffer that grew
    with what was sent; at the idle timeout it stopped reading but its close
    waited for that buffer to drain, which never happens: the connection was
    held until the caller left. Expected: the gate answers a bounded
    preamble only, closes the connection (the caller's sends fail) long
    before 2 MiB, and keeps nothing for it."""
    before = _fds(gated)
    p, taken = _never_reads(gated.socket, 4, "flood", 2 << 20)
    try:
        assert all(t is not None and t < (1 << 20) for t in taken), \
            f"bytes the daemon took before closing each flooding connection (None: still open): {taken}"
        assert _settled(gated, before, IDLE_S + 5) <= before, (before, _fds(gated))
        _serves_an_engine(gated, "flood")
    finally:
        p.communicate("\n", timeout=30)


@needs_root
@pytest.mark.parametrize("answered", [True, False], ids=["after-its-call", "before-any-call"])
def test_a_refused_caller_that_never_reads_does_not_keep_its_connection(gated, answered):
    """A caller the gate does not admit sends a few hundred SETTINGS frames
    (the gate's ACKs fill its side of the socket) and then its first call
    (``after-its-call``: answered, then the lingering close) or nothing more
    (``before-any-call``: the idle timeout), and never reads nor closes.
    Before: the close at the linger bound (2 s) or the idle timeout waited
    for the unsent bytes, forever: each connection held a daemon fd and a
    slot of ``max_engine_connections`` (and of its uid's) until the caller
    left; a few such uids fill the overall cap and every engine is refused.
    Expected: closed by ``engine_idle_timeout_s`` (and the linger) at most."""
    before = _fds(gated)
    p, _ = _never_reads(gated.socket, 8, "call" if answered else "silent", 600)
    try:
        assert _settled(gated, before, IDLE_S + 5) <= before, \
            f"daemon fds {before} before, {_fds(gated)} {IDLE_S + 5} s after 8 refused connections that never read"
        _serves_an_engine(gated, "never-reads")
    finally:
        p.communicate("\n", timeout=30)
