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
from kvd.testing.sessions import Engine, KvShape, Session, one_group
from kvd.testing.util import peer_token_file
from kvd.v1 import kvd_pb2 as pb

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
from kvd.daemon.h2_refusal import PREFACE, _frame
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
        s.sendall(PREFACE)
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


# A caller of PeerService that proves nothing: as ``uid`` (0: stays root),
# one Claim call of ``mib`` MiB of empty KV-cache groups (2 bytes each on the
# wire: field 4, length 0), with a malformed token header when ``header``.
# Prints the status it got.
_UNPROVEN_CLAIM = r"""
import json, os, sys, grpc
addr, uid, mib, header = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
ch = grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 128 << 20)])
claim = ch.unary_unary("/kvd.v1.PeerService/Claim")
body = b"\x22\x00" * (mib << 19)
if uid:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
md = (("x-kvd-peer-auth", f"v2 {addr} 0 00 00"),) if header else ()
try:
    claim(body, metadata=md, timeout=60)
    out = {"code": "OK"}
except grpc.RpcError as e:
    out = {"code": e.code().name, "details": e.details()}
print(json.dumps(out), flush=True)
"""

CLAIM_MIB = 24  # 12.6M empty groups: ~370 MiB once parsed (upb), 24 MiB as bytes


@pytest.mark.parametrize("credential", ["token", "none"])
def test_a_peer_call_that_proves_nothing_is_refused_before_its_request_is_parsed(tmp_path, credential):
    """A PeerService call without the credential: with a token configured,
    from any host that reaches the port (a wrong header, or none); with no
    credential, from a local user whose socket the daemon does not admit.
    Its request is a 24 MiB ClaimRequest of 12.6M empty KV-cache groups.
    Before: gRPC parsed the request before the interceptor looked at the
    caller (the token check even kept the parsed message beside its bytes),
    ~16x its size in the daemon (24 MiB -> ~370 MiB, and ~0.6 s of the
    event loop) for a caller refused UNAUTHENTICATED; a few such calls at
    once, up to ``max_message_bytes`` (64 MiB) each, take gigabytes of an
    unauthenticated host's choosing. Expected: refused from the bytes
    received, never parsed: the daemon's peak RSS grows by a few times the
    request's bytes at most."""
    flags = ["--log-level", "info"]
    if credential == "token":
        flags += ["--peer-token-file", peer_token_file(tmp_path, "t" * 32)]
    elif os.geteuid() != 0:
        pytest.skip("needs root to run a caller as another user")
    d = start_daemon(reachable_dir(), "kvd", *flags[2:], log_level="info")
    try:
        base = _status_kib(d, "VmHWM")
        for header in ("0", "1") if credential == "token" else ("0",):
            r = subprocess.run([sys.executable, "-c", _UNPROVEN_CLAIM, d.peer_address,
                                "0" if credential == "token" else str(OUTSIDER), str(CLAIM_MIB), header],
                               capture_output=True, text=True, timeout=120, env=child_env())
            lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
            assert lines, r.stderr[-3000:]
            assert json.loads(lines[-1])["code"] == "UNAUTHENTICATED", lines[-1]
        grown = (_status_kib(d, "VmHWM") - base) >> 10
        print(f"{credential}: peak RSS +{grown} MiB for refused {CLAIM_MIB} MiB calls")
        # gRPC keeps the bytes as it received them and as one bytes object (2-3
        # copies); parsed they were 16x.
        assert grown < 6 * CLAIM_MIB, f"peak RSS grew {grown} MiB for a refused {CLAIM_MIB} MiB call"
        _serves_an_engine(d, f"unproven-{credential}")
    finally:
        assert d.stop() == 0


HOLD_GROUPS = 1 << 20  # empty KV-cache groups in one hold: 2 MiB on the wire
PARSED_GROUPS = 30_000  # 60 KB: under kvd.daemon.wire_shape.WALK_FROM_BYTES, parsed as it comes


def test_a_hold_of_a_million_empty_groups_is_refused_not_kept_for_its_lease(tmp_path):
    """An admitted engine holds block 1 for a request, and names besides it
    a million empty KV-cache groups (its worker's regions use one): 2 MiB
    of one session command. Every cap on holds counts block ids (one here:
    ``max_blocks_per_request``, ``max_held_blocks_per_worker``), none counts
    groups; before, the lease kept an int32 array per group (~120 MiB a
    hold, for the lease's life, ``max_leases_per_worker`` of them per
    worker). Expected: a command that long is walked before it is parsed
    and past an engine's bounds ends the session, naming the bound
    (``kvd.daemon.wire_shape``), and the daemon keeps nothing for it; a
    shorter hold naming more groups than the worker's regions use is
    rejected (``CommandRejected`` naming them), and so is a load naming as
    many (``LoadFailed``)."""
    d = start_daemon(str(tmp_path), "kvd", log_level="info")
    wide = Engine(d, "liar-wide", SHAPE)
    e = Engine(d, "liar-p", SHAPE)
    try:
        base = _status_kib(d, "VmRSS")
        wide.session.send(hold=pb.HoldBlocks.FromString(
            pb.HoldBlocks(request_id="wide", lease_s=600, groups=one_group([1])).SerializeToString()
            + b"\x22\x00" * HOLD_GROUPS))
        with pytest.raises(AssertionError, match="INVALID_ARGUMENT.*more than [0-9]+ fields in one SessionCommand"):
            wide.wait("wide", 60)
        grown = (_status_kib(d, "VmRSS") - base) >> 10
        print(f"RSS +{grown} MiB after a hold of {HOLD_GROUPS} empty groups")
        assert d.stats().active_leases == 0 and grown < 64, f"RSS +{grown} MiB for a hold of one block id"
        Session(d, wide.engine_id).close()  # the engine may open a new session
        for i in range(2):
            e.session.send(hold=pb.HoldBlocks.FromString(
                pb.HoldBlocks(request_id=f"wide-{i}", lease_s=600, groups=one_group([1])).SerializeToString()
                + b"\x22\x00" * PARSED_GROUPS))
        e.release("marker")  # commands run in order: its rejection comes after the holds'
        assert e.wait("marker", 60).WhichOneof("event") == "rejected"
        assert d.stats().active_leases == 0
        for i in range(2):
            ev = e.wait(f"wide-{i}", 5)
            assert ev.WhichOneof("event") == "rejected" and "groups" in ev.rejected.reason, ev
        # A load naming as many groups (kept while it waits for its claim): refused at once.
        e.session.send(load=pb.LoadBlocks.FromString(
            pb.LoadBlocks(request_id="wide-load", remote_engine_id="liar-p", remote_address=d.peer_address,
                          remote_request_id="wide-0", local_groups=one_group([2]), remote_groups=one_group([1]),
                          timeout_s=5).SerializeToString() + b"\x4a\x00\x52\x00" * (PARSED_GROUPS // 2)))
        ev = e.wait("wide-load", 30)
        assert ev.WhichOneof("event") == "load_failed" and "groups" in ev.load_failed.reason, ev
        e.hold("fine", [1, 2])  # a hold of the worker's own groups still works
        e.release("fine")
        assert e.wait("fine").send_done.released
    finally:
        wide.close()
        e.close()
        assert d.stop() == 0


ADMITTED = 65533  # admitted by allowed_uids; reaches the sockets through group nogroup

# An admitted user's process: opens n connections to the fd side channel
# and sends nothing on them (each may wait timeout_s, 5 s, for its request);
# prints how many the daemon kept open, then holds them until told.
_FILLS_FD_CHANNEL = r"""
import json, os, select, socket, sys, time
path, uid, gid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
os.setgroups([]); os.setgid(gid); os.setuid(uid)
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.connect(path); socks.append(s)
# A refused connection gets its answer and is closed at once: readable.
time.sleep(0.5)
kept = n - len(select.select(socks, [], [], 0)[0])
print(json.dumps({"kept": kept}), flush=True)
sys.stdin.readline()
"""


@needs_root
def test_one_user_cannot_take_every_fd_channel_connection_from_the_others():
    """An admitted user (another tenant's engine) opens the fd side
    channel's 64 connections (``FdChannel.max_connections``, all callers)
    and sends nothing, reconnecting each 5 s as its connections time out.
    Before: every other engine's handover was refused ("64 fd channel
    connections open ...; try again") while it did, and a memfd engine whose
    handover fails does not register: one user kept every other user's
    engines from starting. Expected: connections are capped per uid too (as
    the engine socket's), so another user's handover gets through."""
    from kvd.client.fd_handover import hand_over
    from kvd.fd_wire import fd_socket_path

    d = start_daemon(reachable_dir(), "kvd", "--engine-socket-group", str(NOBODY), "--allowed-uids", str(ADMITTED),
                     log_level="info")
    p = subprocess.Popen([sys.executable, "-c", _FILLS_FD_CHANNEL, fd_socket_path(d.socket), str(ADMITTED),
                          str(NOBODY), "80"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=child_env())
    try:
        line = p.stdout.readline()
        assert line, f"hostile child exited {p.wait()}"
        kept = json.loads(line)["kept"]
        fd = os.memfd_create("kvd-attack5", os.MFD_CLOEXEC)
        try:
            ids = hand_over(d.socket, [fd], timeout_s=3)  # root: another user's engine
        finally:
            os.close(fd)
        assert len(ids) == 1, (kept, ids)
        assert 0 < kept < 64, kept  # it still got some: a cap per uid, not a refusal of the user
        print(f"the hostile user kept {kept} of 80 fd channel connections; another user's handover went through")
    finally:
        p.communicate("\n", timeout=30)
        assert d.stop() == 0


# A caller of the socket's group that is not admitted hands a memfd over
# with kvd's own client; prints what it was told.
_NOT_ADMITTED_HANDS_OVER = r"""
import os, sys
from kvd.client.fd_handover import HandoverError, hand_over
sock, uid, gid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.setgroups([]); os.setgid(gid); os.setuid(uid)
fd = os.memfd_create("kvd-not-admitted", os.MFD_CLOEXEC)
try:
    print("ids", hand_over(sock, [fd], timeout_s=5))
except HandoverError as e:
    print("refused", e)
"""


@needs_root
def test_a_caller_refused_at_once_on_the_fd_channel_reads_why():
    """A caller the fd side channel refuses as it connects (not admitted, a
    cap) got "Connection reset by peer": the daemon answered and closed
    with the caller's request unread, which resets the caller's socket
    (attacker review). Its request is read (its fds closed) before the
    answer now, and the client reads the answer left after the close."""
    d = start_daemon(reachable_dir(), "kvd", "--engine-socket-group", str(NOBODY), "--allowed-uids", str(ADMITTED),
                     log_level="info")
    try:
        for _ in range(3):  # the request may arrive before or after the refusal: either way the reason
            r = subprocess.run([sys.executable, "-c", _NOT_ADMITTED_HANDS_OVER, d.socket, str(NOBODY), str(NOBODY)],
                               capture_output=True, text=True, timeout=60, env=child_env())
            assert r.returncode == 0, r.stderr[-2000:]
            assert r.stdout.startswith("refused") and "is not admitted" in r.stdout, r.stdout
    finally:
        assert d.stop() == 0
