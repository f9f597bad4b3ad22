"""Reliability: engines die, the local daemon restarts under them.

Scenario 5: the engine-side client (``kvd.client.EngineClient``, what the
vLLM shim uses) survives a restart of its daemon: in-flight loads fail at
once, it reconnects with backoff, registers its regions again, and later
requests succeed; the engine-facing calls never block meanwhile.

Scenario 6: an engine process is SIGKILLed; after ``--detach-grace-s`` the
daemon unregisters it: its leases and NIXL state are released and its shared
memory is no longer mapped by the daemon (/proc/<daemon>/maps).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvd.client.engine_client import EngineClient
from kvd.requests import LoadRequest
from kvd.v1 import kvd_pb2 as pb
from kvd.testing.processes import KVD_ROOT
from kvd.testing.daemons import start_daemon
from kvd.testing.fakes import blackhole
from kvd.testing.sessions import Engine, KvShape, event_kind, register_request
from kvd.testing.shm import ShmSegment, maps_of
from kvd.testing.util import wait_until

SHAPE = KvShape(num_layers=2, num_blocks=32, block_len=4096)
DETACH_GRACE_S = 1.0
FAST_S = 0.010  # an engine-facing client call must return faster than this

# A dying engine: registers, holds two blocks, reads two blocks from the test's
# engine (so it owns a remote agent and a prepped list), then waits to be killed.
CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])  # this tree's kvd, not an installed one
from kvd.testing.daemons import Daemon
from kvd.testing.sessions import Engine, KvShape, event_kind
shape = KvShape(num_layers=2, num_blocks=32, block_len=4096)
d = Daemon(proc=None, socket=sys.argv[2], log_path="", peer_address=sys.argv[3])
e = Engine(d, "doomed", shape, open_session=sys.argv[4] == "session")
print(e.seg.name, flush=True)
if e.session is not None:
    e.hold("held-by-doomed", [1, 2], lease_s=600)
    e.load("read-by-doomed", [3, 4], None, [5, 6], "read-by-doomed", remote_engine_id="survivor",
           remote_address=sys.argv[3], timeout_s=20)
    assert event_kind(e.wait("read-by-doomed", 30)) == "recv_done"
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    # NIXL between the engines of this one daemon (--same-node-copy false):
    # the doomed engine's read must leave a remote agent and a prepped list.
    d = start_daemon(str(tmp_path_factory.mktemp("engines")), "kvd", "--detach-grace-s", str(DETACH_GRACE_S),
                     "--same-node-copy", "false")
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def survivor(daemon):
    """An engine of the test itself on the same daemon; it must be unaffected."""
    e = Engine(daemon, "survivor", SHAPE, seed=5)
    yield e
    e.close()


# ------------------------------------------------------------------ scenario 6
@pytest.mark.parametrize("phase", ["with-session", "before-session"])
def test_dead_engine_is_unregistered_after_the_grace_and_its_memory_unmapped(daemon, survivor, phase):
    """SIGKILL of an engine process: once its session has been gone for the
    detach grace, the daemon drops it: engines, leases, remote agents and
    prepped lists return to what the survivor alone holds, and the dead
    engine's shm segment is no longer mapped in the daemon."""
    session = phase == "with-session"
    base = daemon.stats()
    if session:
        survivor.hold("read-by-doomed", [5, 6], lease_s=600)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(KVD_ROOT), daemon.socket, daemon.peer_address,
         "session" if session else "none"],
        stdout=subprocess.PIPE, text=True)
    seg_name = child.stdout.readline().strip()
    try:
        assert seg_name.startswith("/"), f"child engine failed (said {seg_name!r})"
        assert child.stdout.readline().strip() == "ready"
        if session:
            assert event_kind(survivor.wait("read-by-doomed", 10)) == "send_done"
        st = daemon.stats()
        assert st.engines == base.engines + 1
        if session:
            assert st.active_leases == base.active_leases + 1  # the doomed engine's hold
            assert st.remote_agents == base.remote_agents + 1
            assert daemon.settled_stats().prepped_dlists == base.prepped_dlists + 2
            assert st.sessions == base.sessions + 1
        assert f"/dev/shm{seg_name}" in maps_of(daemon.proc.pid)

        child.send_signal(signal.SIGKILL)
        child.wait(10)
        killed = time.monotonic()
        gone = wait_until(lambda: daemon.stats().engines == base.engines, DETACH_GRACE_S + 10,
                          "dead engine unregistered")
        print(f"\n[{phase}] dead engine unregistered {gone:.2f} s after SIGKILL (grace {DETACH_GRACE_S} s)")
        if session:
            assert gone >= DETACH_GRACE_S - 0.05, "unregistered before the grace ran out"
        assert gone <= DETACH_GRACE_S + 2.0
        st = daemon.stats()
        for k in ("active_leases", "inflight_transfers", "remote_agents", "prepped_dlists", "regions",
                  "registered_bytes", "sessions", "leaked_handles", "pending_events"):
            assert getattr(st, k) == getattr(base, k), (k, getattr(st, k), getattr(base, k))
        # Unmapping follows NIXL deregistration, just after the worker leaves the registry.
        wait_until(lambda: seg_name not in maps_of(daemon.proc.pid), 5, "the dead engine's memory unmapped")
        # The survivor is untouched.
        survivor.hold("after-death", [7], lease_s=600)
        survivor.release("after-death")
        assert survivor.wait("after-death").send_done.released
        assert time.monotonic() - killed < 30
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if seg_name.startswith("/"):
            try:
                os.unlink(f"/dev/shm{seg_name}")
            except FileNotFoundError:
                pass


# ------------------------------------------------------------------ scenario 5
def test_engine_client_survives_a_restart_of_its_daemon(tmp_path, survivor):
    """The decode engine's client is connected and loading; its daemon is
    killed and started again on the same socket. The load in flight fails at
    once (load error, not a hang); engine-facing calls stay non-blocking; the
    client reconnects, registers its regions again, sends what was queued,
    and later loads succeed byte-exact."""
    tmp = str(tmp_path)
    src = survivor  # the prefill engine, on the module's daemon
    decode = start_daemon(tmp, "decode")
    seg = ShmSegment(SHAPE.size)
    client = EngineClient(decode.socket, load_grace_s=1.0, backoff_initial_s=0.05, backoff_max_s=0.5)
    worst = 0.0

    def call(fn, *args, **kw):
        nonlocal worst
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        worst = max(worst, time.perf_counter() - t0)
        return out

    events: dict[str, pb.SessionEvent] = {}

    def wait_event(rid: str, timeout: float) -> pb.SessionEvent:
        def got():
            for ev in call(client.drain_events):
                events[Engine.request_of(ev)] = ev
            return rid in events
        wait_until(got, timeout, f"client event for {rid}", 0.005)
        return events.pop(rid)

    def load(rid, local, remote, **kw):
        call(client.load, LoadRequest(rid, [list(local)], kw.pop("remote_engine_id", src.engine_id),
                                      kw.pop("remote_address", src.peer_address), [list(remote)], rid, **kw))

    try:
        client.register(register_request("client-d", SHAPE, seg), timeout_s=30)
        client.start_session()
        assert client.wait_opened(10)
        src.hold("before", [20, 21])
        load("before", [3, 4], [20, 21], timeout_s=20)
        assert event_kind(wait_event("before", 25)) == "recv_done"

        with blackhole() as hung:
            load("inflight", [5, 6], [7, 8], remote_engine_id="p", remote_address=hung, timeout_s=60)
            time.sleep(0.3)  # the daemon is waiting on the hung handshake
            assert call(client.pending) == (1, 0)
            decode.stop(signal.SIGKILL)
            t0 = time.monotonic()
            ev = wait_event("inflight", 10)
            lost_after = time.monotonic() - t0
        assert event_kind(ev) == "load_failed" and list(ev.load_failed.failed_block_ids) == [5, 6]
        assert "session lost" in ev.load_failed.reason

        # While the daemon is down: commands queue, nothing blocks.
        src.hold("queued", [22, 23])
        load("queued", [11, 12], [22, 23], timeout_s=60)
        for _ in range(50):
            call(client.drain_events)
            time.sleep(0.01)
        assert not client.connected

        t_restart = time.monotonic()
        decode = start_daemon(tmp, "decode")
        assert client.wait_opened(30), "client did not reconnect"
        reconnected = time.monotonic() - t_restart
        assert decode.stats().engines == 1, "client did not register its regions again"
        assert event_kind(wait_event("queued", 60)) == "recv_done"
        assert event_kind(src.wait("queued")) == "send_done"

        src.hold("after", [24, 25])
        load("after", [15, 16], [24, 25], timeout_s=20)
        assert event_kind(wait_event("after", 25)) == "recv_done"
        kv = seg.array.reshape(SHAPE.num_regions, SHAPE.num_blocks, SHAPE.block_len)
        assert (kv[:, [11, 12, 15, 16]] == src.kv[:, [22, 23, 24, 25]]).all()
        print(f"\nin-flight load failed {lost_after * 1e3:.0f} ms after the daemon died; session back "
              f"{reconnected:.2f} s after the restart began; slowest engine-facing call {worst * 1e3:.2f} ms")
        assert lost_after < 2.0
        assert worst < FAST_S, f"an engine-facing call took {worst * 1e3:.2f} ms"
        assert client.sessions_opened == 2
    finally:
        client.close()
        seg.close()
        decode.stop()
