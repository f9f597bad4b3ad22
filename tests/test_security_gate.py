"""The engine socket's gate under hostile local users (docs/SECURITY.md,
"Local engines: limits"): relay names nobody can squat, refused callers
closed before gRPC, connection caps and the idle timeout, and a shutdown that
removes only its own socket. Real daemons; hostile users are real
unprivileged uids in child processes (root needed)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from kvd.daemon import local_gate
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc
from kvd import ops
from kvd.testing.daemons import start_daemon, stats_of
from kvd.testing.processes import child_env
from kvd.testing.security import NOBODY, OUTSIDER, call_as, reachable_dir
from kvd.testing.sessions import Engine, KvShape
from kvd.testing.util import free_port, wait_until

ADMITTED = 65533  # admitted by allowed_uids; reaches the socket through group nogroup
SHAPE = KvShape(num_layers=1, num_blocks=8, block_len=1024)
PER_UID, OVERALL, IDLE_S = 16, 24, 10.0

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run callers as other users")

# A hostile local process: becomes uid:gid, then does ``action``, prints one
# JSON line, and waits for a line on stdin (holding what it made) before the
# next step; "eof" then reports, per raw connection, seconds until the daemon
# closed it (None: still open after 15 s).
_HOSTILE = r"""
import json, os, re, select, socket, sys, time
sock_path, uid, gid, action, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
if action == "grpc":
    import grpc
    from kvd.v1 import kvd_pb2 as pb, kvd_pb2_grpc as pb_grpc
    channels = [grpc.insecure_channel(f"unix:{sock_path}") for _ in range(n)]
os.setgroups([]); os.setgid(gid); os.setuid(uid)
out, held = {}, []

def closed_within(s, seconds):
    # Seconds until EOF (the gate may first send HTTP/2 SETTINGS), or None.
    start = time.monotonic()
    while (left := start + seconds - time.monotonic()) > 0:
        if not select.select([s], [], [], left)[0]:
            break
        try:
            if not s.recv(65536):
                return round(time.monotonic() - start, 3)
        except ConnectionResetError:
            return round(time.monotonic() - start, 3)
    return None

if action == "squat":
    # Bind the relay names the target daemon would use next, guessed from its
    # names (argv: the target's), which every user can see in /proc/net/unix
    # ('@' = abstract).
    seen = [l.split()[-1][1:] for l in open("/proc/net/unix").read().splitlines()[1:]
            if l.split()[-1][1:] in sys.argv[6:]]
    for name in seen:
        m = re.match(r"(.*-)(\d+)$", name)
        for k in range(1, n + 1) if m else ():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.bind("\0" + m[1] + str(int(m[2]) + k)); held.append(s)
            except OSError:
                s.close()
    out = {"seen": seen, "bound": len(held)}
elif action == "hold":
    # n raw connections that never send a byte; which ones did the daemon close at once?
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(sock_path); held.append(s)
    # The last one first (a busy machine may take a moment), well before the idle timeout.
    last = closed_within(held[-1], 3) is not None
    out = {"closed_at_once": [closed_within(s, 0.01) is not None for s in held[:-1]] + [last]}
elif action == "grpc":
    # n channels, one call each, all kept open.
    codes = []
    for ch in channels:
        try:
            pb_grpc.EngineServiceStub(ch).GetStats(pb.StatsRequest(), timeout=10); codes.append("OK")
        except grpc.RpcError as e:
            codes.append(e.code().name)
    out = {"codes": codes}
print(json.dumps(out), flush=True)
if sys.stdin.readline().strip() == "eof":
    print(json.dumps({"closed_after": [closed_within(s, 15) for s in held]}), flush=True)
    sys.stdin.readline()
"""


class Hostile:
    """A ``_HOSTILE`` child as ``uid:gid``; ``first`` is its first JSON line."""

    def __init__(self, socket_path: str, uid: int, gid: int, action: str, n: int = 1, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-c", _HOSTILE, socket_path, str(uid), str(gid), action,
                                      str(n), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=child_env())
        self.first = self._line()

    def _line(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"hostile child exited {self.proc.wait()}"
        return json.loads(line)

    def closed_after(self) -> list:
        self.proc.stdin.write("eof\n")
        self.proc.stdin.flush()
        return self._line()["closed_after"]

    def exit(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("\n\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            self.proc.wait(30)


@pytest.fixture
def daemon():
    metrics = free_port()
    d = start_daemon(reachable_dir(), "kvd", "--engine-socket-group", str(NOBODY), "--allowed-uids", str(ADMITTED),
                     "--max-engine-connections-per-uid", str(PER_UID), "--max-engine-connections", str(OVERALL),
                     "--engine-idle-timeout-s", str(IDLE_S), "--metrics-port", str(metrics),
                     "--metrics-host", "127.0.0.1")
    d.metrics = f"http://127.0.0.1:{metrics}/metrics"
    yield d
    assert d.stop() == 0


def _fds(d) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def _metric(d, name: str, **labels) -> float:
    from kvd.daemon.metrics import RENDER_REUSE_S

    time.sleep(RENDER_REUSE_S)  # an answer is reused that long: this one is rendered after what came before
    text = urllib.request.urlopen(d.metrics, timeout=5).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} " if want else f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{want}}} not in {d.metrics}")


def _settled(d, fds: int, timeout: float = 10.0) -> int:
    """The daemon's fd count once it is back to ``fds`` (or the last seen)."""
    deadline = time.monotonic() + timeout
    while (now := _fds(d)) > fds and time.monotonic() < deadline:
        time.sleep(0.1)
    return now


def _serves_an_engine(d, tag: str) -> None:
    """A normal engine registers, holds and releases blocks."""
    e = Engine(d, f"normal-{tag}", SHAPE)
    try:
        e.hold("r", [1, 2])
        e.release("r")
        assert e.wait("r").send_done.released
    finally:
        e.close()


def _raw_closed_at_once(path: str) -> bool:
    """True when a connection of this process (root) is closed without a byte."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        s.settimeout(3.0)  # "at once": well before the idle timeout
        return s.recv(1) == b""
    except (TimeoutError, socket.timeout):
        return False
    finally:
        s.close()


def _relay_names(d) -> list[str]:
    """The abstract names the daemon's relay sockets are bound to (its fds'
    inodes in /proc/net/unix): only this daemon's, not other daemons' on the host."""
    fd_dir = f"/proc/{d.proc.pid}/fd"
    inodes = set()
    for fd in os.listdir(fd_dir):
        try:
            inodes.add(os.readlink(f"{fd_dir}/{fd}").removeprefix("socket:[").removesuffix("]"))
        except OSError:
            pass
    rows = [line.split() for line in open("/proc/net/unix").read().splitlines()[1:]]
    return [r[7][1:] for r in rows if len(r) > 7 and r[7].startswith("@kvd-") and r[6] in inodes]


def test_relay_names_seen_in_proc_net_unix_cannot_be_squatted(daemon):
    # An engine connection is open: its relay name is in /proc/net/unix.
    keep = grpc.insecure_channel(f"unix:{daemon.socket}")
    pb_grpc.EngineServiceStub(keep).GetStats(pb.StatsRequest(), timeout=5)
    names = _relay_names(daemon)
    # A user with no access to the socket at all sees them, and binds the "next" ones.
    squatter = Hostile(daemon.socket, OUTSIDER, OUTSIDER, "squat", 64, *names)
    try:
        assert names and sorted(squatter.first["seen"]) == sorted(names), (names, squatter.first)
        for i in range(8):  # every new engine connection still gets through
            ch = grpc.insecure_channel(f"unix:{daemon.socket}")
            assert pb_grpc.EngineServiceStub(ch).GetStats(pb.StatsRequest(), timeout=5).daemon_version, i
            ch.close()
        _serves_an_engine(daemon, "squat")
    finally:
        squatter.exit()
        keep.close()
    assert all(re.fullmatch(r"kvd-[0-9a-f]{32}", n) for n in names), names  # nothing to count on
    assert _metric(daemon, "kvd_engine_connections_refused_total", reason="relay") == 0


def test_a_taken_relay_name_is_replaced_not_a_refusal(monkeypatch):
    taken = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    taken.bind("\0" + (name := local_gate.relay_name()))
    fresh = local_gate.relay_name()
    names = iter([name, name, fresh])
    monkeypatch.setattr(local_gate, "relay_name", lambda: next(names))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert local_gate.bind_relay(s) == fresh and s.getsockname() == b"\0" + fresh.encode()
        monkeypatch.setattr(local_gate, "relay_name", lambda: name)  # every try taken: bounded, then an error
        with pytest.raises(OSError, match="no free relay name after 8 tries"):
            local_gate.bind_relay(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    finally:
        s.close()
        taken.close()


def test_a_refused_caller_is_answered_and_closed_by_the_gate_before_grpc(daemon):
    before, open_before = _fds(daemon), _metric(daemon, "kvd_engine_connections")
    # nobody may open the socket (group nogroup) but is not admitted: 12
    # channels, one call each, all kept open by the caller.
    h = Hostile(daemon.socket, NOBODY, NOBODY, "grpc", 12)
    try:
        assert h.first["codes"] == ["PERMISSION_DENIED"] * 12, h.first
        # The gate closed each connection after its answer: nothing is held
        # for the caller (before: 3 daemon fds per connection, for as long as
        # the caller liked).
        assert _settled(daemon, before) <= before, (before, _fds(daemon))
        assert _metric(daemon, "kvd_engine_connections") <= open_before
    finally:
        h.exit()
    assert _metric(daemon, "kvd_engine_connections_refused_total", reason="not_admitted") == 12
    r = call_as(daemon.socket, NOBODY, NOBODY)  # the message names the uid and the settings
    assert r["code"] == "PERMISSION_DENIED" and f"uid {NOBODY}" in r["details"] and "allowed_uids" in r["details"]
    assert "its connection is refused and closed" in daemon.log()
    _serves_an_engine(daemon, "refused")


def test_closed_callers_leave_no_connection_open(daemon):
    """Callers that hang up after their call (``kvd status`` and ``kvd
    health`` do, once a probe period) leave nothing open: a relay whose
    two sides have both ended is closed. Before, one call in a few left
    both relay sockets open for good, and a liveness probe's calls filled
    max_engine_connections_per_uid (then every engine of that uid was
    refused)."""
    open_before, fds_before = _metric(daemon, "kvd_engine_connections"), _fds(daemon)
    for i in range(3 * PER_UID):
        stats_of(daemon.socket)
        if i % 4 == 0:
            assert ops.health(f"unix:{daemon.socket}").code == 0
    wait_until(lambda: _metric(daemon, "kvd_engine_connections") <= open_before, 10,
               "every relay closed once its caller hung up")
    assert _settled(daemon, fds_before) <= fds_before, (fds_before, _fds(daemon))
    assert _metric(daemon, "kvd_engine_connections_refused_total", reason="max_engine_connections_per_uid") == 0


def test_connections_are_capped_per_uid_and_overall_and_silent_ones_time_out(daemon):
    before = _fds(daemon)
    # nobody (not admitted) opens one connection more than its uid may have.
    a = Hostile(daemon.socket, NOBODY, NOBODY, "hold", PER_UID + 1)
    b = None
    try:
        assert a.first["closed_at_once"] == [False] * PER_UID + [True], a.first
        # An admitted user fills the rest of the overall cap (this test's own
        # channels from start_daemon may still hold one or two)...
        rest = OVERALL - int(_metric(daemon, "kvd_engine_connections"))
        assert rest >= OVERALL - PER_UID - 2
        b = Hostile(daemon.socket, ADMITTED, NOBODY, "hold", rest)
        assert b.first["closed_at_once"] == [False] * rest, b.first
        # ...and the next connection, even root's, is closed at once.
        assert _raw_closed_at_once(daemon.socket)
        # None of them ever sends a byte: each is closed at the idle timeout.
        for who, closed in (("nobody", a.closed_after()[:PER_UID]), ("admitted", b.closed_after())):
            assert all(t is not None for t in closed), closed
            print(f"{who}: silent connections closed {max(closed):.2f} s after the test asked "
                  f"(idle timeout {IDLE_S} s from connect)")
    finally:
        a.exit()
        if b is not None:
            b.exit()
    assert _settled(daemon, before) <= before, (before, _fds(daemon))
    assert _metric(daemon, "kvd_engine_connections_refused_total", reason="max_engine_connections_per_uid") == 1
    assert _metric(daemon, "kvd_engine_connections_refused_total", reason="max_engine_connections") == 1
    assert _metric(daemon, "kvd_engine_connections_refused_total", reason="idle") == PER_UID + rest
    log = daemon.log()
    assert "max_engine_connections_per_uid" in log and "engine_idle_timeout_s" in log
    _serves_an_engine(daemon, "capped")


def test_shutdown_leaves_the_socket_another_daemon_bound_on_the_same_path(tmp_path):
    a = start_daemon(str(tmp_path), "a")
    b = None
    try:
        # The path is cleaned up under daemon A (a tmp cleaner, an operator),
        # and daemon B binds it.
        os.unlink(a.socket)
        other = tmp_path / "b"
        other.mkdir()
        # start_daemon waits for <dir>/<name>.sock: a link to the shared path.
        os.symlink(a.socket, other / "b.sock")
        b = start_daemon(str(other), "b", "--engine-socket", a.socket)
        assert a.stop() == 0
        assert os.path.exists(a.socket) and b.stats().daemon_version  # B's socket is still there
        assert "is not the one this daemon bound" in a.log()
        _serves_an_engine(b, "b")
    finally:
        a.stop()
        if b is not None:
            assert b.stop() == 0
    assert not os.path.lexists(a.socket)  # B removed its own


class _Transport:
    """What Refusal writes, and whether it closed (a unit test's stand-in)."""

    def __init__(self, eof_ok: bool = False):
        self.out, self.closed, self.eof_ok, self.eof = b"", False, eof_ok, False

    def write(self, data: bytes) -> None:
        assert not self.closed and not self.eof
        self.out += data

    def can_write_eof(self) -> bool:
        return self.eof_ok

    def write_eof(self) -> None:
        self.eof = True

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0  # everything written has gone out

    def abort(self) -> None:
        self.closed = True


class _Timer:
    def __init__(self, delay, fn):
        self.delay, self.fn, self.cancelled = delay, fn, False

    def cancel(self) -> None:
        self.cancelled = True


def _frames(data: bytes) -> list[tuple[int, int, int]]:
    out = []
    while data:
        n = int.from_bytes(data[:3], "big")
        out.append((data[3], data[4], int.from_bytes(data[5:9], "big")))
        data = data[9 + n:]
    return out


def test_the_refusal_answers_http2_byte_by_byte_and_closes_anything_else():
    from kvd.daemon.h2_refusal import PREFACE, Refusal, _frame

    t = _Transport()
    r = Refusal(t, grpc.StatusCode.PERMISSION_DENIED, "kvd: pid 1 uid 2 gid 3 is not admitted \u00e9%")
    client = PREFACE + _frame(0x4, 0, 0, bytes(6)) + _frame(0x1, 0x4, 3, b"\x82")
    for i in range(len(client)):  # however the bytes arrive
        assert not t.closed
        r.feed(client[i:i + 1])
    # SETTINGS, SETTINGS ACK, the trailers-only HEADERS on the caller's stream, GOAWAY; then closed.
    assert _frames(t.out) == [(0x4, 0, 0), (0x4, 1, 0), (0x1, 0x5, 3), (0x7, 0, 0)] and t.closed
    assert b"grpc-status\x017" in t.out and b"not admitted %C3%A9%25" in t.out
    for junk in (b"GET / HTTP/1.1\r\n\r\n", PREFACE + (1 << 20).to_bytes(3, "big") + bytes(6)):
        t = _Transport()
        Refusal(t, grpc.StatusCode.PERMISSION_DENIED, "no").feed(junk)
        assert t.closed and _frames(t.out) == [(0x4, 0, 0)]


def test_the_refusal_half_closes_after_its_answer_and_closes_when_the_caller_does_or_at_the_bound():
    from kvd.daemon.h2_refusal import LINGER_S, PREFACE, Refusal, _frame

    client = PREFACE + _frame(0x1, 0x4, 1, b"\x82")
    for caller_closes in (True, False):
        t, timers = _Transport(eof_ok=True), []
        r = Refusal(t, grpc.StatusCode.PERMISSION_DENIED, "no", lambda d, fn: timers.append(_Timer(d, fn)) or timers[-1])
        r.feed(client)
        # Answered and half-closed, still open for the caller's late frames (a
        # SETTINGS ACK, the request's DATA), which are dropped.
        assert _frames(t.out) == [(0x4, 0, 0), (0x1, 0x5, 1), (0x7, 0, 0)] and t.eof and not t.closed
        assert [x.delay for x in timers] == [LINGER_S]
        r.feed(_frame(0x4, 1, 0) + _frame(0x0, 0x1, 1, bytes(5)))
        assert not t.closed
        if caller_closes:
            r.eof()
            assert t.closed and timers[0].cancelled
        else:
            timers[0].fn()
            assert t.closed
