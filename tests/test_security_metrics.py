"""The metrics port answers anyone who reaches it, without credentials
(docs/SECURITY.md "Metrics"): what one scrape, or a herd of connections,
may cost the daemon is bounded.

prometheus_client's own server started a thread per connection with no
read deadline: 2,000 connections that finished their requests together
held the event loop 10-20 s (every engine's session and ``kvd health``
with it), and 3,000 left unfinished held ~1,700 threads.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.request

from kvd.daemon.metrics import MAX_SCRAPES, REQUEST_TIMEOUT_S
from kvd.testing.daemons import start_daemon
from kvd.testing.util import free_port, wait_until


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_unfinished_scrapes_hold_at_most_a_few_threads_each_for_a_bounded_time(tmp_path):
    port = free_port()
    d = start_daemon(str(tmp_path), "kvd", "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    held: list[socket.socket] = []
    try:
        base = _threads(d.pid)
        for _ in range(64):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # the head never ends
            held.append(s)
        # Past MAX_SCRAPES each connection is closed unanswered.
        t0 = time.monotonic()
        closed = []
        for s in held:
            s.settimeout(max(0.1, 5 - (time.monotonic() - t0)))
            try:
                closed.append(s.recv(1) == b"")
            except TimeoutError:
                closed.append(False)
        assert sum(closed) >= len(held) - MAX_SCRAPES, closed
        assert _threads(d.pid) <= base + MAX_SCRAPES, (base, _threads(d.pid))
        assert d.stats().uptime_s > 0  # the event loop serves meanwhile
        # Those served get REQUEST_TIMEOUT_S for the whole head, then are closed.
        for s, gone in zip(held, closed):
            if not gone:
                s.settimeout(REQUEST_TIMEOUT_S + 5)
                assert s.recv(1) == b""
        assert time.monotonic() - t0 < REQUEST_TIMEOUT_S + 5
        wait_until(lambda: _threads(d.pid) <= base, 10, "the scrapes' threads ended")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert b"kvd_uptime_seconds" in r.read()
        assert "Traceback" not in d.log()
        assert d.proc.poll() is None
    finally:
        for s in held:
            s.close()
        d.stop()


def test_scrapes_back_to_back_reuse_one_rendering_and_a_long_request_is_cut(tmp_path):
    """A client scraping as fast as it can gets one rendering per
    RENDER_REUSE_S (rendering is what costs the daemon: ~3 ms each); a
    request past MAX_REQUEST_BYTES (Python's parser takes 100 headers of
    64 KiB) is closed unanswered, not parsed."""
    from kvd.daemon.metrics import MAX_REQUEST_BYTES, RENDER_REUSE_S

    port = free_port()
    d = start_daemon(str(tmp_path), "kvd", "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    try:
        def uptime() -> bytes:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                return next(line for line in r.read().splitlines() if line.startswith(b"kvd_uptime_seconds "))

        t0 = time.monotonic()
        seen = [uptime() for _ in range(20)]
        elapsed = time.monotonic() - t0
        assert len(set(seen)) <= elapsed / RENDER_REUSE_S + 1, (len(set(seen)), elapsed)
        time.sleep(RENDER_REUSE_S)
        assert uptime() != seen[-1]  # a later scrape renders again
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            head = b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 1000) for i in range(40))
            assert len(head) > MAX_REQUEST_BYTES
            try:
                s.sendall(head + b"\r\n")
                answer = s.recv(65536)
            except ConnectionResetError:
                answer = b""
            assert answer == b"", answer[:200]
        assert "Traceback" not in d.log()
    finally:
        d.stop()


def test_an_ipv6_metrics_host_is_shown_in_brackets(tmp_path):
    """``metrics on http://[::1]:PORT/metrics`` (and GetStats's
    ``metrics_address``): unbracketed, the URL in the log does not open."""
    import pytest

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    d = start_daemon(str(tmp_path), "kvd", "--metrics-port", str(port), "--metrics-host", "::1")
    try:
        assert d.stats().metrics_address == f"[::1]:{port}"
        assert f"metrics on http://[::1]:{port}/metrics" in d.log()
        with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=10) as r:
            assert b"kvd_uptime_seconds" in r.read()
    finally:
        d.stop()


def test_a_wildcard_metrics_host_is_not_shown_as_a_url_to_fetch():
    """``0.0.0.0`` and ``::`` are bind addresses, not something to fetch
    from (a new user's review): the log and ``kvd status`` say
    ``<this host>`` and what the port is bound to."""
    from kvd.addresses import metrics_url

    assert metrics_url("0.0.0.0:9400") == "http://<this host>:9400/metrics (every address, bound to 0.0.0.0:9400)"
    assert metrics_url("[::]:9400") == "http://<this host>:9400/metrics (every address, bound to [::]:9400)"
    assert metrics_url("127.0.0.1:9400") == "http://127.0.0.1:9400/metrics"
    assert metrics_url("[::1]:9400") == "http://[::1]:9400/metrics"
