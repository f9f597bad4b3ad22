"""Log injection (CWE-117): ids from other processes never forge a log line.

A request id or engine id is chosen by an engine (and, through
``kv_transfer_params``, by API clients); the daemon logs them. The log
formatters escape control characters in every record (kvd/daemon/logs.py),
so every call site is covered.
"""

from __future__ import annotations

import io
import json
import logging
import re
import time

from kvd.daemon import logs
from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import Engine, KvShape, event_kind

SHAPE = KvShape(num_layers=1, num_blocks=8, block_len=1024)
FORGED = "2026-01-01 00:00:00,000 WARNING kvd.core: engine=admin request=x: FORGED"
START = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \S+: ")


def test_a_newline_in_a_request_or_engine_id_never_forges_a_log_line(tmp_path):
    d = start_daemon(str(tmp_path), "kvd")
    try:
        e = Engine(d, f"inj\n{FORGED}", SHAPE)
        try:
            rid = f"r1\r\n{FORGED}\x1b[2K\u2028{FORGED}"
            e.load(rid, [1], None, [1], "x", remote_engine_id=f"P\n{FORGED}", remote_address="127.0.0.1:1",
                   timeout_s=3)
            assert event_kind(e.wait(rid, 30)) == "load_failed"
        finally:
            e.close()
        log = d.log()
        assert "\\n" + FORGED in log and "\\r\\n" + FORGED in log and "\\x1b[2K\\u2028" in log
        for line in log.splitlines():
            assert "FORGED" not in line or not line.startswith("2026-01-01"), line
            # Every line of the daemon's own is a whole record (or a native library's line).
            assert not line.startswith(FORGED)
        assert d.stats().daemon_version  # and it keeps serving
    finally:
        assert d.stop() == 0


def _record(msg: str, *args, exc=None) -> logging.LogRecord:
    return logging.LogRecord("kvd.core", logging.WARNING, __file__, 1, msg, args, exc)


def test_both_formats_escape_every_control_character_and_keep_tracebacks_inside_the_record():
    rec = _record("engine=%s request=%s: load failed", "e\x00\x7f", "r\n\x85\u2029")
    human = logs.HumanFormatter().format(rec)
    assert human.endswith("engine=e\\x00\\x7f request=r\\n\\x85\\u2029: load failed") and "\n" not in human
    out = json.loads(logs.JsonFormatter().format(rec))
    assert out["msg"] == "engine=e\\x00\\x7f request=r\\n\\x85\\u2029: load failed"
    assert out["request"] == "r\\n\\x85\\u2029"
    try:
        raise ValueError(f"bad id\n{FORGED}")
    except ValueError:
        import sys

        rec = _record("handshake failed", exc=sys.exc_info())
    lines = logs.HumanFormatter().format(rec).splitlines()
    assert START.match(lines[0]) and all(line.startswith("  ") for line in lines[1:]), lines
    assert any(FORGED in line for line in lines[1:])
    # The record given to the handler is left as it was (other handlers see it unchanged).
    assert rec.getMessage() == "handshake failed"


def test_throttled_warnings_say_how_many_were_left_out():
    stream = io.StringIO()
    logger = logging.getLogger("kvd.test-throttled")
    logger.addHandler(logging.StreamHandler(stream))
    logger.propagate = False
    t = logs.Throttled(logger, interval_s=0.5)
    for i in range(5):
        t.warning("refused %d", i)
    time.sleep(0.5)
    t.warning("refused %d", 5)
    assert stream.getvalue().splitlines() == ["refused 0", "refused 5 (4 more like it since the last message)"]


def test_throttles_keep_a_line_a_second_per_key_and_forget_the_oldest_key():
    stream = io.StringIO()
    logger = logging.getLogger("kvd.test-throttles")
    logger.addHandler(logging.StreamHandler(stream))
    logger.propagate = False
    t = logs.Throttles(logger, interval_s=3600, max_keys=2)
    for i in range(100):
        t.warning(65534, "uid 65534 refused %d", i)  # one caller's flood ...
    t.warning(0, "uid 0 refused")                   # ... hides no other caller's line
    t.warning("third", "a third key")                # the oldest key (65534) is forgotten
    t.warning(65534, "uid 65534 again")
    assert stream.getvalue().splitlines() == ["uid 65534 refused 0", "uid 0 refused", "a third key",
                                              "uid 65534 again"]


def test_refusals_anyone_may_repeat_are_logged_at_most_once_a_second_with_the_count(tmp_path):
    """Sessions refused on the command socket (any admitted uid, no worker
    of its own needed) and loads of blocks their source does not hold
    (``not_held``) are each logged at most once a second, with the count of
    those left out: each was a line of up to ~4 KiB (an id the caller
    chose), and an attacker review wrote 24k of them in 10 s."""
    import socket
    import time

    from kvd.command_wire import command_socket_path, frame
    from kvd.v1 import kvd_pb2 as pb

    d = start_daemon(str(tmp_path), "kvd", log_level="info")
    p = dst = None
    try:
        p, dst = Engine(d, "logs-p", SHAPE), Engine(d, "logs-d", SHAPE)
        p.hold("mine", [0, 1, 2])
        n = 200
        t0 = time.monotonic()
        for i in range(n):
            dst.load(f"thief-{i}", [1], p, [5], "mine")  # block 5 is not held
        for i in range(n):
            assert dst.wait(f"thief-{i}", 30).load_failed.reason.startswith("not_held:")
        opened = pb.SessionCommand(open=pb.OpenSession(worker=pb.EngineWorker(engine_id="x" * 1000)))
        for _ in range(n):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                s.connect(command_socket_path(d.socket))
                s.sendall(frame(opened.SerializeToString()))
                assert s.recv(65536)  # the refusal
        for i in range(n):  # refused as read: no abort slot, no task, no line each
            dst.session.send(abort_load=pb.AbortLoad(request_id=f"ab-{i}", remote_engine_id="x",
                                                     remote_address="127.0.0.1:1", remote_request_id="y",
                                                     remote_tp_size=10**6))
        for i in range(n):
            assert dst.wait(f"ab-{i}", 30).rejected.reason == "abort_load: remote TP size 1000000 exceeds 256"
        elapsed = time.monotonic() - t0
        time.sleep(1.2)
        dst.load("thief-last", [1], p, [5], "mine")  # after a quiet second: logged, with the count
        assert dst.wait("thief-last", 30).load_failed.reason.startswith("not_held:")
        log = d.log()
        held = [line for line in log.splitlines() if "load failed: not_held" in line]
        refused = [line for line in log.splitlines() if "session of" in line and " refused: " in line]
        assert 1 <= len(held) <= elapsed + 3 and 1 <= len(refused) <= elapsed + 3, (len(held), len(refused), elapsed)
        assert "more like it since the last message" in held[-1], held[-1]
        assert "abort ignored" not in log
    finally:
        for e in (p, dst):
            if e is not None:
                e.close()
        d.stop()


def test_leases_an_engine_lets_expire_at_will_are_logged_at_most_once_a_second_with_the_count(tmp_path):
    """An admitted engine holds blocks under leases of a microsecond (a
    lease has no floor) with ids of 1,000 ESC characters: each lease ended
    with a WARNING of ~4 KiB, 18,200 lines (75 MB) in 10 s in an attacker
    review. Expected: one line a second per worker with the count of those
    left out; every expiry still ends its hold and is counted."""
    d = start_daemon(str(tmp_path), "kvd", log_level="info")
    p = None
    try:
        p = Engine(d, "exp-p", SHAPE)
        n = 300
        t0 = time.monotonic()
        for i in range(n):
            p.hold(f"exp-{i}-" + "\x1b" * 1000, [i % 8], lease_s=1e-6)
        for i in range(n):
            ev = p.wait(f"exp-{i}-" + "\x1b" * 1000, 30)
            assert ev.WhichOneof("event") == "send_done" and ev.send_done.expired, ev
        elapsed = time.monotonic() - t0
        time.sleep(1.2)
        p.hold("exp-last", [0], lease_s=1e-6)  # after a quiet second: logged, with the count
        assert p.wait("exp-last", 30).send_done.expired
        lines = [line for line in d.log().splitlines() if "lease expired, nobody read the blocks" in line]
        assert 1 <= len(lines) <= elapsed + 3, (len(lines), elapsed)
        assert "more like it since the last message" in lines[-1], lines[-1]
        assert d.stats().leases_expired == n + 1
    finally:
        if p is not None:
            p.close()
        d.stop()


def test_failed_handshakes_ahead_of_need_are_logged_at_most_once_a_second_per_worker(tmp_path):
    """A decode engine of TP 2 (any API client through ``kv_transfer_params``)
    loads from a fresh remote engine id at a dead address, with a remote TP
    size of 2: each load starts a handshake ahead of need for the other
    rank's pair, which fails at once. That was an INFO line each, the engine
    id unclipped (38,800 lines, 18.7 MB in 15 s, attacker review)."""
    d = start_daemon(str(tmp_path), "kvd", log_level="info")
    r0 = r1 = None
    try:
        r0 = Engine(d, "ahead", SHAPE, rank=0, tp_size=2)
        r1 = Engine(d, "ahead", SHAPE, rank=1, tp_size=2)
        n = 200
        t0 = time.monotonic()
        for i in range(n):
            r0.load(f"a{i}", [1], None, [1], f"p{i}", remote_engine_id="E" * 1000 + str(i),
                    remote_address="127.0.0.1:1", remote_tp_size=2, timeout_s=5)
        for i in range(n):
            assert event_kind(r0.wait(f"a{i}", 30)) == "load_failed"
        elapsed = time.monotonic() - t0
        lines = [line for line in d.log().splitlines() if "handshake ahead of need" in line and "failed" in line]
        assert 1 <= len(lines) <= elapsed + 3, (len(lines), elapsed)
        assert all(len(line) < 2000 for line in lines), max(map(len, lines))  # ids clipped
    finally:
        for e in (r0, r1):
            if e is not None:
                e.close()
        d.stop()


def test_failed_tls_handshakes_on_the_peer_port_write_no_line_each(tmp_path):
    """gRPC's core logged every failed TLS handshake on the peer port to
    stderr, below kvd's throttles: anyone who reaches the port wrote ~3,400
    lines a second with garbage bytes (attacker review). ``kvd serve`` runs
    gRPC at GRPC_VERBOSITY=ERROR unless the operator set it."""
    import socket

    from kvd.testing.security import Pki

    pki = Pki(str(tmp_path / "pki"))
    d = start_daemon(str(tmp_path), "kvd", "--peer-listen", "127.0.0.1:0", *pki.flags("tls-node"))
    try:
        host, port = d.peer_address.rsplit(":", 1)
        for _ in range(50):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(b"\x00garbage, not a TLS ClientHello\r\n" * 4)
                try:
                    s.recv(1024)
                except OSError:
                    pass
        assert d.stats().uptime_s > 0
        log = d.log()
        assert "andshake failed" not in log and "ssl_transport_security" not in log, log[-2000:]
    finally:
        d.stop()
