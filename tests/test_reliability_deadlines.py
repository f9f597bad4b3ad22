"""Reliability: no request stays in flight past its deadline.

Every wait has a deadline: a load's handshake and READ end by the request's
``LoadBlocks.timeout_s`` (daemon default ``--transfer-timeout-s``); the
engine-side client fails a load locally at ``timeout_s + load_grace_s`` and
ends a hold at ``lease_s + hold_grace_s`` when its daemon does not answer.

The peers that never answer are real: a TCP listener that accepts and stays
silent (a hung daemon), a prefill daemon frozen with SIGSTOP while its UCX
endpoint (TCP) is connected (a READ that never completes), and a frozen local
daemon under the engine-side client.
"""

from __future__ import annotations

import random
import signal
import time

import pytest

from kvd.client.engine_client import EngineClient
from kvd.requests import LoadRequest
from kvd.v1 import kvd_pb2 as pb
from kvd.testing.daemons import start_daemon
from kvd.testing.fakes import blackhole, closed_address
from kvd.testing.sessions import Engine, KvShape, event_kind, register_request
from kvd.testing.shm import ShmSegment
from kvd.testing.util import wait_until

SHAPE = KvShape(num_layers=2, num_blocks=128, block_len=16384)
SLACK_S = 1.0  # past the deadline: the daemon polls every 0.5-5 ms; the rest is a busy 2-core machine


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("deadlines"))
    # TCP only on the prefill side: a frozen process then really stalls a READ
    # (UCX's CMA path would read a stopped process's memory regardless).
    p = start_daemon(tmp, "prefill", env={"UCX_TLS": "tcp"})
    # Pull set: auto would push from that source (its handshake says a READ
    # from it is TCP's software GET), and these are deadlines of READs.
    d = start_daemon(tmp, "decode", "--transfer-mode", "pull")
    src = Engine(p, "deadline-p", SHAPE, seed=4)
    dst = Engine(d, "deadline-d", SHAPE)
    yield src, dst
    for sig in (signal.SIGCONT,):
        p.proc.send_signal(sig)
        d.proc.send_signal(sig)
    dst.close()
    src.close()
    assert p.stop() == 0 and d.stop() == 0


def test_no_load_outlives_its_deadline(pair):
    """60 loads with deadlines from 0.5 to 3 s, none of which can complete:
    to a hung peer (handshake never answered), to a frozen prefill daemon
    whose agent is known (READ never completes), to a port nobody listens
    on. Each ends with LoadFailed naming its blocks, never later than its
    deadline plus SLACK_S; nothing stays in flight; once the prefill daemon
    runs again a request succeeds and no NIXL handle is left behind."""
    src, dst = pair
    src.hold("warm", [0])
    dst.load("warm", [0], src, [0], "warm", timeout_s=20)
    assert event_kind(dst.wait("warm", 25)) == "recv_done"
    assert event_kind(src.wait("warm")) == "send_done"

    rng = random.Random(4)
    sent: dict[str, tuple[float, float, str, list[int]]] = {}
    with blackhole() as hung:
        src.daemon.proc.send_signal(signal.SIGSTOP)
        try:
            for i in range(60):
                kind = ("hung-handshake", "frozen-read", "refused")[i % 3]
                timeout_s = rng.uniform(0.5, 3.0)
                local = [1 + (2 * i) % 126, 2 + (2 * i) % 126]
                rid = f"{kind}-{i}"
                if kind == "frozen-read":
                    dst.load(rid, local, src, [1 + i, 2 + i], rid, timeout_s=timeout_s)
                else:
                    addr = hung if kind == "hung-handshake" else closed_address()
                    dst.load(rid, local, None, [1, 2], rid, remote_engine_id="p", remote_address=addr,
                             timeout_s=timeout_s)
                sent[rid] = (time.monotonic(), timeout_s, kind, local)
            late = {}
            for rid, (t0, timeout_s, kind, local) in sent.items():
                ev = dst.wait(rid, t0 + timeout_s + 5 - time.monotonic())
                over = dst.arrived - t0 - timeout_s
                assert event_kind(ev) == "load_failed", ev
                assert list(ev.load_failed.failed_block_ids) == local
                late[rid] = over
            assert dst.daemon.stats().inflight_transfers == 0
        finally:
            src.daemon.proc.send_signal(signal.SIGCONT)
    worst = max(late, key=late.get)
    by_kind = {k: max(v for r, v in late.items() if r.startswith(k)) for k in ("hung", "frozen", "refused")}
    print("\nlatest LoadFailed past the deadline, by kind: "
          + ", ".join(f"{k} {v * 1e3:+.0f} ms" for k, v in by_kind.items()))
    assert late[worst] <= SLACK_S, f"{worst} ended {late[worst]:.3f} s past its deadline"

    # The prefill daemon runs again: the next request succeeds (new handshake,
    # the timed-out agent was dropped) and no handle or agent is left over.
    src.drain()
    src.hold("thawed", [100, 101])
    dst.load("thawed", [100, 101], src, [100, 101], "thawed", timeout_s=20)
    ev = dst.wait("thawed", 25)
    assert event_kind(ev) == "recv_done", ev
    assert dst.same_blocks([100, 101], src, [100, 101])
    wait_until(lambda: dst.daemon.stats().leaked_handles == 0, 10, "timed-out READ handles released")
    wait_until(lambda: dst.daemon.stats().remote_agents == 1, 10, "one remote agent (the live one)")
    assert dst.daemon.proc.poll() is None and src.daemon.proc.poll() is None


def _ended_locally(client: EngineClient, t0: float, n: int, within_s: float):
    """Drains ``client`` until ``n`` requests ended (``within_s`` seconds at
    most): ``({request id: (event, seconds since t0)}, the slowest drain in
    seconds)``: no engine-facing call may block on a frozen daemon."""
    got: dict[str, tuple[pb.SessionEvent, float]] = {}
    worst = 0.0

    def done():
        nonlocal worst
        c0 = time.perf_counter()
        evs = client.drain_events()
        worst = max(worst, time.perf_counter() - c0)
        for ev in evs:
            got[Engine.request_of(ev)] = (ev, time.monotonic() - t0)
        return len(got) == n

    wait_until(done, within_s, f"{n} requests ended locally", 0.01)
    return got, worst


def test_engine_client_fails_loads_and_ends_holds_locally_when_its_daemon_is_frozen(pair):
    """The engine-side client's own deadlines: its daemon frozen (SIGSTOP), a
    load fails locally at timeout + load_grace and a hold ends as expired at
    lease + hold_grace; no engine-facing call blocks."""
    src, _ = pair
    daemon = src.daemon
    seg = ShmSegment(SHAPE.size)
    client = EngineClient(daemon.socket, load_grace_s=0.5, hold_grace_s=0.5)
    try:
        client.register(register_request("client-frozen", SHAPE, seg), timeout_s=30)
        client.start_session()
        assert client.wait_opened(10)
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            client.load(LoadRequest("frozen-load", [[1, 2]], "x", "127.0.0.1:1", [[3, 4]], "x", timeout_s=1.0))
            client.hold("frozen-hold", [[5]], lease_s=1.0)
            got, worst = _ended_locally(client, t0, 2, 5)
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        ev, at = got["frozen-load"]
        assert event_kind(ev) == "load_failed" and "timeout" in ev.load_failed.reason
        assert 1.5 <= at <= 1.5 + SLACK_S
        ev, at = got["frozen-hold"]
        assert event_kind(ev) == "send_done" and ev.send_done.expired
        assert 1.5 <= at <= 1.5 + SLACK_S
        assert worst < 0.010
    finally:
        client.close()
        seg.close()
        daemon.stub().UnregisterEngine(pb.UnregisterEngineRequest(worker=pb.EngineWorker(engine_id="client-frozen")),
                                       timeout=10)


def test_a_load_with_the_daemons_default_timeout_fails_locally_at_that_default(tmp_path):
    """A load of timeout 0 (the daemon's default: the vLLM shim's when
    ``kvd_load_timeout_s`` is unset) whose daemon does not answer fails
    locally at the default the daemon said when the session opened plus
    ``load_grace_s``. Before, the client could not know the default and
    waited 120 s: a new user's decode request hung 125 s while its node's
    daemon was stopped."""
    daemon = start_daemon(str(tmp_path), "default-timeout", "--transfer-timeout-s", "1.5")
    seg = ShmSegment(SHAPE.size)
    client = EngineClient(daemon.socket, load_grace_s=0.5)
    try:
        client.register(register_request("client-default", SHAPE, seg), timeout_s=30)
        client.start_session()
        assert client.wait_opened(10)
        info = client.session_info
        assert (info.transfer_timeout_s, info.max_transfer_timeout_s) == (1.5, 3600.0)  # the cap: a Limits constant
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            client.load(LoadRequest("default-load", [[1, 2]], "x", "127.0.0.1:1", [[3, 4]], "x"))
            got, _ = _ended_locally(client, t0, 1, 30)
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        ev, at = got["default-load"]
        assert event_kind(ev) == "load_failed" and "timeout" in ev.load_failed.reason, ev
        assert 2.0 <= at <= 2.0 + SLACK_S, at
    finally:
        client.close()
        seg.close()
        daemon.stop()

