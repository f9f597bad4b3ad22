"""An admitted engine-socket caller that pipelines unary calls and never
reads the answers, then hangs up (docs/SECURITY.md, "Local engines:
limits"): gRPC keeps no more than a bounded number of its answers, its
connection is gone once it is, and the daemon still serves and stops on
SIGTERM. Real daemon; the caller speaks raw HTTP/2 (RFC 9113) so that
nothing reads for it."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from kvd.bench.common import proc_status
from kvd.daemon.h2_refusal import PREFACE, _frame, _hpack_string
from kvd.testing.daemons import start_daemon
from kvd.testing.util import wait_until


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field, not indexed, new name (RFC 7541 6.2.2)."""
    return b"\x00" + _hpack_string(name) + _hpack_string(value)


_HEADERS = b"".join(_literal(k, v) for k, v in (
    (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/kvd.v1.EngineService/GetStats"),
    (b":authority", b"localhost"), (b"content-type", b"application/grpc"), (b"te", b"trailers")))


def _get_stats(stream: int) -> bytes:
    """HEADERS then DATA (an empty GetStatsRequest, gRPC's 5-byte prefix) ending the stream."""
    return _frame(0x1, 0x4, stream, _HEADERS) + _frame(0x0, 0x1, stream, b"\0" * 5)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def daemon(tmp_path):
    d = start_daemon(str(tmp_path), "pipelined")
    yield d
    if d.proc.poll() is None:
        d.stop()


def test_pipelined_calls_never_read_are_bounded_and_leave_nothing_after_the_caller_hangs_up(daemon):
    pid = daemon.proc.pid
    fds0, rss0 = _fds(pid), proc_status(pid)["VmRSS"]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # reads nothing, and holds little for the daemon
    s.connect(daemon.socket)
    # The preface, empty SETTINGS, a large connection window; then calls, as fast as the socket takes them.
    s.sendall(PREFACE + _frame(0x4, 0, 0) + _frame(0x8, 0, 0, (1 << 30).to_bytes(4, "big")))
    s.settimeout(5)
    sent = 0
    try:
        # Until the daemon stops reading, or 300,000 calls: with the relay closing
        # (not aborting) gRPC's side, ~110,000 were enough to leave it open for good.
        for i in range(300_000):
            s.sendall(_get_stats(2 * i + 1))
            sent += 1
    except (socket.timeout, BrokenPipeError, ConnectionResetError):
        pass  # the daemon stopped reading (or refused the connection): what it holds is measured below
    grew_mib = (proc_status(pid)["VmRSS"] - rss0) / 1024
    print(f"\n{sent} calls sent unread; daemon RSS {grew_mib:+.1f} MiB")
    # Unbounded, gRPC kept every answer: ~47,000 calls held +106 MiB.
    assert grew_mib < 40, (sent, grew_mib)
    s.close()
    # The caller is gone: so is its relay, and gRPC's side of it.
    assert wait_until(lambda: _fds(pid) <= fds0, 15, interval=0.1) is not None, (fds0, _fds(pid))
    assert daemon.stats().peer_address
    t0 = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(30) == 0
    # Before, gRPC's stop waited for that connection: still running 20 s after SIGTERM.
    assert time.monotonic() - t0 < 15, daemon.log_tail(40)


def test_the_grpc_side_of_a_relay_is_dropped_with_its_queue_when_the_engine_hangs_up():
    """The gate's relay alone: gRPC's side has megabytes queued that its peer
    does not read (as gRPC stops reading while its answers pile up). When the
    engine's side goes, gRPC's side must end now, its queue dropped; a close
    would wait for a write that never happens and keep the connection for
    good (before: +2 fds, and a daemon deaf to SIGTERM)."""
    import asyncio

    from kvd.daemon import local_gate

    assert local_gate._Front.abort_other and not local_gate._Relay.abort_other

    async def main() -> bool:
        loop = asyncio.get_running_loop()
        engine, front_sock = socket.socketpair()
        back_sock, grpc_side = socket.socketpair()  # grpc_side: never read
        lost = loop.create_future()
        front, back = local_gate._Relay(), local_gate._Relay(on_lost=lambda: lost.set_result(True))
        front.abort_other = True  # as local_gate._Front
        await loop.create_unix_connection(lambda: front, sock=front_sock)
        await loop.create_unix_connection(lambda: back, sock=back_sock)
        front.pair(back)
        engine.setblocking(False)
        grpc_side.setblocking(False)
        chunk = b"x" * 65536
        deadline = time.monotonic() + 10
        # Both ways full, neither end reading: requests queued towards gRPC,
        # answers queued towards the engine (so the relay learns of the
        # hang-up when its write fails, as in a real daemon).
        while time.monotonic() < deadline and (back.transport.get_write_buffer_size() < (1 << 20)
                                               or front.transport.get_write_buffer_size() < (1 << 20)):
            for end in (engine, grpc_side):
                try:
                    end.send(chunk)
                except BlockingIOError:
                    pass
            await asyncio.sleep(0.001)
        queued = back.transport.get_write_buffer_size()
        engine.close()
        try:
            return queued, await asyncio.wait_for(lost, 5)
        except asyncio.TimeoutError:
            return queued, False
        finally:
            grpc_side.close()

    queued, ended = asyncio.run(main())
    assert queued >= 1 << 20, queued
    assert ended, "gRPC's side of the relay was still open 5 s after the engine hung up"
