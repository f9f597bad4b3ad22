"""Attacker scenarios against real daemons that the current code does not stop.

Each test runs the hostile sequence and asserts what docs/SECURITY.md
promises; the ones marked xfail(strict) fail today (the reason says what
happens instead), so a fix turns them into errors until the mark is removed.

- A same-node load reads another engine's blocks only while that engine holds
  them for the request (kvd.core.local_copy). Naming this daemon by another
  spelling of its peer address (``localhost:PORT`` for ``127.0.0.1:PORT``)
  misses ``LocalCopy.addresses`` and takes the NIXL path, which reads any
  registered block of the engine named, held or not.
- With neither TLS nor a token the PeerService listens on loopback only, but
  every local user can reach loopback: a uid refused on the engine socket
  gets an engine's NIXL agent metadata and region addresses from Handshake
  (what a host needs to READ or WRITE that memory, SECURITY.md "Not
  covered"), and ends its leases with Notify; a daemon run by that user reads
  the engine's blocks, held or not.
- An engine that shrinks its own segment (ftruncate) after registering it
  kills the daemon (SIGBUS) at the next same-node copy from or into it.
- Memory one engine makes the daemon keep, far beyond its bytes on the wire:
  same-node loads waiting for a hold keep every row's addresses; holds keep
  every block id (repeats accepted) as Python lists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvd.testing.daemons import start_daemon
from kvd.testing.processes import child_env
from kvd.testing.security import NOBODY, reachable_dir
from kvd.testing.sessions import Engine, KvShape, event_kind

SHAPE = KvShape(num_layers=2, num_blocks=16, block_len=4096)


@pytest.fixture(scope="module")
def daemon():
    """One daemon in its default configuration (no peer TLS, no token: loopback)."""
    d = start_daemon(reachable_dir(), "kvd")
    yield d
    assert d.stop() == 0


@pytest.fixture
def victim(daemon, request):
    v = Engine(daemon, f"victim-{request.node.name[-30:]}", SHAPE, seed=7)
    yield v
    v.close()


def test_a_load_naming_this_daemon_by_another_spelling_reads_no_block_nobody_held(daemon, victim):
    thief = Engine(daemon, "thief-alias", SHAPE)
    try:
        port = daemon.peer_address.rsplit(":", 1)[1]
        # The daemon's own spelling: the hold rule applies (nothing held: fails at the deadline).
        thief.load("own", [1, 2], None, [3, 4], "never-held", timeout_s=1, remote_engine_id=victim.engine_id,
                   remote_address=daemon.peer_address)
        ev = thief.wait("own", 20)
        assert event_kind(ev) == "load_failed" and "not_held" in ev.load_failed.reason, ev
        assert not thief.kv.any()
        # The same daemon as localhost: the same rule must apply.
        thief.load("alias", [1, 2], None, [3, 4], "never-held", timeout_s=1, remote_engine_id=victim.engine_id,
                   remote_address=f"localhost:{port}")
        ev = thief.wait("alias", 20)
        assert not thief.same_blocks([1, 2], victim, [3, 4]), "the victim's unheld blocks 3, 4 were read"
        assert event_kind(ev) == "load_failed", ev
    finally:
        thief.close()


# As NOBODY (admitted nowhere), after the imports: PeerService Handshake and Notify.
_PEER_AS_NOBODY = r"""
import json, os, sys, grpc
from kvd.core.state import PROTOCOL_VERSION
from kvd.v1 import kvd_pb2 as pb, kvd_pb2_grpc as pb_grpc
addr, engine_id, request_id, uid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
stub = pb_grpc.PeerServiceStub(grpc.insecure_channel(addr))
os.setgroups([]); os.setgid(uid); os.setuid(uid)
out = {}
for name, call in (
        ("handshake", lambda: stub.Handshake(pb.HandshakeRequest(engine_id=engine_id, protocol_version=PROTOCOL_VERSION), timeout=10)),
        ("notify", lambda: stub.Notify(pb.NotifyRequest(engine_id=engine_id, request_id=request_id,
                                                        expected_notifications=1), timeout=10))):
    try:
        r = call()
        out[name] = {"ok": True, "metadata_bytes": len(getattr(r, "agent_metadata", b""))}
    except grpc.RpcError as e:
        out[name] = {"ok": False, "code": e.code().name, "details": e.details()}
print(json.dumps(out), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a caller as another user")
def test_a_local_user_refused_on_the_engine_socket_gets_nothing_from_the_loopback_peer_port(daemon, victim):
    victim.hold("secret", [1, 2])
    r = subprocess.run([sys.executable, "-c", _PEER_AS_NOBODY, daemon.peer_address, victim.engine_id, "secret",
                        str(NOBODY)], capture_output=True, text=True, timeout=60, env=child_env())
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert lines, r.stderr[-3000:]
    out = json.loads(lines[-1])
    try:
        assert not out["handshake"]["ok"], f"uid {NOBODY} got {out['handshake']['metadata_bytes']} B of agent metadata"
        assert not out["notify"]["ok"], f"uid {NOBODY} ended another user's lease"
        assert victim.quiet("secret", 0.5)  # the lease is untouched
    finally:
        victim.release("secret")
        victim.wait("secret", 10)
    assert daemon.stats().engines >= 1  # still serving


@pytest.mark.parametrize("liar", ["source", "reader"])
def test_a_segment_truncated_after_registration_fails_the_copy_not_the_daemon(tmp_path, liar):
    """An engine shrinks its own shm object (ftruncate 0) after registering
    it, then a same-node copy reads from (or writes into) its blocks."""
    d0 = start_daemon(str(tmp_path), "kvd")
    p = Engine(d0, "p-liar", SHAPE, seed=7)
    d = Engine(d0, "d-liar", SHAPE)
    try:
        p.hold("r", [3, 4])
        os.truncate((p if liar == "source" else d).seg.path, 0)
        d.load("x", [1, 2], p, [3, 4], "r", timeout_s=5)
        try:
            ev = d.wait("x", 20)
        except AssertionError:  # the session broke: let the daemon finish exiting, if it does
            try:
                d0.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            raise
        finally:
            assert d0.proc.poll() is None, f"daemon exited {d0.proc.poll()} (-7: SIGBUS)"
        assert event_kind(ev) == "load_failed", ev
        assert d0.stats().engines == 2  # still serving
    finally:
        p.close()
        d.close()
        d0.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a daemon as another user")
def test_a_daemon_run_by_a_local_user_admitted_nowhere_reads_no_block_of_this_daemon(daemon, victim):
    """User NOBODY runs its own ``kvd serve`` (allowed: it is a program) and
    its own engine, and loads the victim's blocks through this daemon's
    loopback peer port, knowing only the engine id."""
    import subprocess
    import sys

    from kvd.testing.shm import ShmSegment
    # uid NOBODY must be able to run this checkout's kvd at all (a clone
    # under a 0700 directory, e.g. mktemp's, is not readable to it).
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                            sys.executable, "-c", "import kvd.cli"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"uid {NOBODY} cannot import this checkout's kvd: {probe.stderr.strip().splitlines()[-1:]}")
    wd = reachable_dir()
    os.chown(wd, NOBODY, NOBODY)
    thief_d = start_daemon(wd, "thief", env={"HOME": wd},  # NIXL reads $HOME/.nixl.cfg
                           wrap=("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"))
    seg = ShmSegment(SHAPE.size)
    os.chown(seg.path, NOBODY, NOBODY)  # the thief's own segment (this helper runs as root)
    thief = Engine(thief_d, "thief", SHAPE, seg=seg)
    try:
        assert os.stat(f"/proc/{thief_d.proc.pid}").st_uid == NOBODY
        thief.load("steal", [1, 2, 3], None, [3, 4, 5], "never-held", timeout_s=5,
                   remote_engine_id=victim.engine_id, remote_address=daemon.peer_address)
        ev = thief.wait("steal", 30)
        assert victim.kv[:, [3, 4, 5]].any()
        assert not thief.same_blocks([1, 2, 3], victim, [3, 4, 5]), f"uid {NOBODY} read the victim's blocks: {ev}"
        assert event_kind(ev) == "load_failed", ev
    finally:
        thief.close()
        seg.close()
        thief_d.stop()


def _rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) // 1024


@pytest.mark.parametrize("memfd", [False, True], ids=["nixl-path", "same-node-copy"])
def test_loads_waiting_for_a_hold_cost_the_daemon_about_their_block_ids_not_their_rows(tmp_path, memfd):
    """One engine sends loads of every block (shuffled: no rows merge) from
    a source that never holds them: 64 regions x 32768 blocks is 2M rows a
    load, 192 KiB of block ids on the wire. Each waits for its claim (up to
    ``max_claim_wait_s``), 4096 of them per worker. Named segments take the
    NIXL path to this same daemon, sealed memfds the same-node copy."""
    shape = KvShape(num_layers=32, num_blocks=32768, block_len=64)  # 128 MiB per engine
    d0 = start_daemon(str(tmp_path), "kvd")
    p = Engine(d0, "p-noisy", shape, memfd=memfd)
    d = Engine(d0, "d-noisy", shape, memfd=memfd)
    try:
        before = _rss_mib(d0.proc.pid)
        rng = np.random.default_rng(0)
        for i in range(4):
            ids = rng.permutation(shape.num_blocks).tolist()
            d.load(f"w{i}", ids, p, ids, f"never-held-{i}", timeout_s=600)
        assert d.quiet("w3", 3.0)  # all four wait for their holds
        grown = _rss_mib(d0.proc.pid) - before
        assert grown < 64, f"daemon RSS grew {grown} MiB for 4 waiting loads (0.8 MiB of block ids)"
    finally:
        d.close()
        p.close()
        assert d0.stop() == 0


def test_holds_of_one_block_repeated_cost_the_daemon_nothing_like_their_count(tmp_path):
    """An engine of 64 blocks holds them 16384 times over (1M ids, ~1 MiB on
    the wire) under 20 request ids. Past 20 there are 65516 more leases
    allowed per worker (``max_leases_per_worker``). Either the hold is
    refused (a request's blocks are distinct: vLLM allocates each once) or
    what the daemon keeps stays small."""
    shape = KvShape(num_layers=1, num_blocks=64, block_len=1024)
    d0 = start_daemon(str(tmp_path), "kvd")
    p = Engine(d0, "hoarder", shape)
    try:
        before = _rss_mib(d0.proc.pid)
        ids = [i % shape.num_blocks for i in range(1 << 20)]
        for i in range(20):
            p.hold(f"h{i}", ids, lease_s=3600)
        p.hold("probe", [1])
        p.release("probe")
        assert event_kind(p.wait("probe")) == "send_done"  # every hold before it was handled
        refused = [e for e in p.drain() if event_kind(e) == "rejected"]
        grown = _rss_mib(d0.proc.pid) - before
        assert len(refused) == 20 or grown < 32, f"daemon RSS grew {grown} MiB for 20 MiB of block ids on the wire"
    finally:
        p.close()
        assert d0.stop() == 0
