"""Reliability over UCX's TCP transport (``UCX_TLS=tcp``, what an operator
sets between hosts with no RDMA): a daemon dies while a transfer with it is
under way, and the other daemon keeps serving.

TCP has no native GET in UCX: a pull-mode READ is UCX's software GET, which
the source's UCX answers with sends of its own, and UCX 1.23 (nixl 1.5.1)
crashes the source with SIGSEGV when the reader vanishes while those sends
wait (measured: a reader SIGKILLed 20 ms into a 128 MiB READ killed the
source in 3 of 4 runs here, 4 of 4 across a veth; ``uct_tcp_ep_pending_purge``
-> ``ucp_request_send_state_ff``). Push mode's WRITEs are UCT's TCP PUT,
which crashed the source far more rarely: once in one whole-suite run of
the thirty-fourth session, none in every other run (``_source_lives``).
docs/OPERATIONS.md ("Known problems") tells operators on TCP to run push
mode, and this file holds kvd to that advice. The source daemon also says
so at startup.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np
import pytest

from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import Engine, KvShape, event_kind
from kvd.testing.util import wait_until

# 128 MiB: a WRITE over loopback TCP of ~0.1-0.3 s, long enough to kill the
# reader in its middle.
SHAPE = KvShape(num_layers=4, num_blocks=128, block_len=128 * 1024)
TCP = {"UCX_TLS": "tcp"}


def _source_lives(src_d) -> None:
    """The source daemon still runs. One death is UCX's, not kvd's, and
    marks the test xfail rather than failing it: SIGSEGV in a thread with no
    Python frame (faulthandler names no "Current thread"), which is UCX's
    progress thread failing the WRITE's pending sends once the reader's
    connection is gone. Push mode was thought free of it (0 of 8 runs); a
    whole-suite run of the thirty-fourth session saw it once, in the frozen
    source's test below (a source resumed after the reader's agent was
    replaced; 16 runs of that test alone, 10 of them beside two busy
    processes, passed). docs/SECURITY.md, "Open"."""
    rc = src_d.proc.poll()
    if rc is None:
        return
    crash = src_d.log().rpartition("Fatal Python error: Segmentation fault")[2]
    if rc == -signal.SIGSEGV and crash and "Current thread" not in crash:
        pytest.xfail("the source daemon died of SIGSEGV in a thread with no Python frame: UCX's TCP error path "
                     "after the reader's connection went (docs/SECURITY.md, Open)")
    raise AssertionError(f"source daemon died: {rc}")


def _serves(src, dst, rid: str, local: list[int]) -> None:
    """``dst`` loads blocks 1-3 of ``src`` into ``local`` under ``rid``,
    and they arrive: both daemons still serve."""
    src.hold(rid, [1, 2, 3])
    dst.load(rid, local, src, [1, 2, 3], rid, timeout_s=30)
    assert event_kind(dst.wait(rid, 35)) == "recv_done"
    assert dst.same_blocks(local, src, [1, 2, 3])


ROUNDS = 3


def test_in_push_mode_a_source_survives_readers_killed_in_the_middle_of_its_writes(tmp_path):
    """The readers run the default transfer mode (auto), which pushes over
    a TCP-only ``UCX_TLS``; a source set to pull says at startup what that
    risks. Each reader is killed once the WRITE's first bytes have landed
    in its engine's memory (a fixed delay after the load was sent killed
    no reader mid-WRITE on a slow CI machine: the first contact took
    longer); the memory then shows whether the kill came mid-WRITE."""
    src_d = start_daemon(str(tmp_path), "p", "--transfer-mode", "pull", env=TCP)
    ids = list(range(SHAPE.num_blocks))
    try:
        said = [ln for ln in src_d.log().splitlines() if "leaves UCX only TCP between hosts" in ln]
        assert said and "transfer_mode = auto (the default) or push" in said[0], said
        src = Engine(src_d, "p", SHAPE, seed=3)
        errs = cut = 0
        for n in range(ROUNDS):
            dst_d = start_daemon(str(tmp_path), f"d{n}", env=TCP)
            try:
                assert "transfer mode auto: push for every load (UCX_TLS=tcp" in dst_d.log()
                dst = Engine(dst_d, f"d{n}", SHAPE)
                src.hold(f"r{n}", ids)
                dst.load(f"r{n}", ids, src, ids, f"r{n}", timeout_s=30)
                # The first bytes of any block-region landed (whatever order
                # the WRITE goes in; the reader's cache starts zeroed).
                wait_until(lambda: dst.kv[:, :, :64].any(), 30, "the push is under way", 0.001)
                dst_d.proc.kill()
                dst_d.proc.wait()
                cut_now = not np.array_equal(dst.kv, src.kv)  # the reader died before all had landed
                cut += cut_now
                dst.close(unregister=False)
                # A WRITE under way fails as UCX sees the connection go (one
                # already done leaves no line: the round still checks that
                # the source lives).
                wait_until(lambda: src_d.log().count("WRITE ERR") > errs or src_d.proc.poll() is not None, 5,
                           None)  # no line is a round too: see above
                time.sleep(1.0)  # the UCX progress thread's purge of what was left comes right after
                _source_lives(src_d)
                errs = src_d.log().count("WRITE ERR")
                src.release(f"r{n}")
                # A WRITE that ended before the kill (the machine slow to see
                # its first bytes) and was answered ended the lease itself.
                done = src.wait(f"r{n}").send_done
                assert done.released or (not cut_now and not done.expired), done
            finally:
                if dst_d.proc.poll() is None:
                    dst_d.stop()
        assert cut >= 1, "no round killed a reader in the middle of a WRITE: the test proved nothing"
        assert "a pull-mode READ is then" not in dst_d.log(), "a daemon in auto mode has nothing to change"
        # It still serves: a reader started after the kills reads.
        dst_d = start_daemon(str(tmp_path), "d-last", "--transfer-mode", "push", env=TCP)
        try:
            dst = Engine(dst_d, "d-last", SHAPE)
            _serves(src, dst, "last", [4, 5, 6])
            dst.close()
        finally:
            dst_d.stop()
        src.close()
        _source_lives(src_d)
    finally:
        src_d.stop()


@contextlib.contextmanager
def _push_from_a_frozen_source(tmp_path, rid: str, seed: int, timeout_s: float):
    """Starts a pull-mode source and a push-mode decode daemon over TCP,
    a push of every block of ``SHAPE``, and stops (SIGSTOP: a stalled host
    looks the same) the source once the WRITE's first bytes have landed.
    Yields ``(src_d, dst_d, src, dst)`` with the source still stopped; it is
    resumed (``_changed_once_resumed``, or at the end) and both daemons
    stopped on the way out."""
    src_d = start_daemon(str(tmp_path), "p", env=TCP)
    dst_d = start_daemon(str(tmp_path), "d", "--transfer-mode", "push", env=TCP)
    ids = list(range(SHAPE.num_blocks))
    try:
        src = Engine(src_d, "p", SHAPE, seed=seed)
        dst = Engine(dst_d, "d", SHAPE)
        src.hold(rid, ids)
        dst.load(rid, ids, src, ids, rid, timeout_s=timeout_s)
        probe = src.kv[0, 0, :4096].copy()
        wait_until(lambda: (dst.kv[0, 0, :4096] == probe).all(), 10, "the push is under way", 0.001)
        os.kill(src_d.proc.pid, signal.SIGSTOP)
        try:
            yield src_d, dst_d, src, dst
        finally:
            os.kill(src_d.proc.pid, signal.SIGCONT)  # a second SIGCONT does nothing
    finally:
        dst_d.stop()
        src_d.stop()


def _changed_once_resumed(src_d, dst) -> int:
    """Resumes the stopped source and returns how many of ``dst``'s
    block-regions (layer x block) change in the next 3 s: a WRITE still
    going would land then."""
    before = dst.kv.copy()
    os.kill(src_d.proc.pid, signal.SIGCONT)
    time.sleep(3)
    return int((dst.kv != before).any(axis=2).sum())


#: Tries at catching a push in its first half (:func:`_push_to_a_frozen_reader`).
PUSH_TRIES = 3


@contextlib.contextmanager
def _push_to_a_frozen_reader(tmp_path, seed: int, *src_args: str):
    """Starts a source daemon (``src_args``) and a push-mode decode daemon
    over TCP, a push of every block of ``SHAPE``, and stops (SIGSTOP) the
    reader's daemon once the WRITE's first bytes have landed. Yields
    ``(src_d, dst_d, src, dst, rid)`` with the reader stopped and at most
    half of the WRITE landed, so that tens of MiB are still to go, more
    than the sockets' buffers hold: the source's WRITE cannot end before
    the reader resumes. A push that got further before the stop (the test
    process descheduled on a busy machine: seen once in a whole-suite run,
    where the WRITE had ended and nothing was quarantined) is let finish and
    tried again with a new request, up to ``PUSH_TRIES`` times. Both daemons
    are resumed and stopped on the way out."""
    src_d = start_daemon(str(tmp_path), "p", *src_args, env=TCP)
    dst_d = start_daemon(str(tmp_path), "d", "--transfer-mode", "push", env=TCP)
    ids = list(range(SHAPE.num_blocks))
    try:
        src = Engine(src_d, "p", SHAPE, seed=seed)
        dst = Engine(dst_d, "d", SHAPE)
        probe = src.kv[0, 0, :4096].copy()
        for attempt in range(PUSH_TRIES):
            rid = f"r{attempt}"
            dst.kv[:] = 0
            src.hold(rid, ids)
            dst.load(rid, ids, src, ids, rid, timeout_s=60)
            wait_until(lambda: (dst.kv[0, 0, :4096] == probe).all(), 10, "the push is under way", 0.0005)
            os.kill(dst_d.proc.pid, signal.SIGSTOP)
            landed = int((dst.kv == src.kv).all(axis=2).sum())
            if landed <= SHAPE.num_regions * SHAPE.num_blocks // 2:
                break
            os.kill(dst_d.proc.pid, signal.SIGCONT)
            assert event_kind(dst.wait(rid, 60)) == "recv_done"
        else:
            raise AssertionError(f"the push was more than half landed at the stop in {PUSH_TRIES} tries")
        yield src_d, dst_d, src, dst, rid
    finally:
        for d in (dst_d, src_d):
            with contextlib.suppress(ProcessLookupError):
                os.kill(d.proc.pid, signal.SIGCONT)
        dst_d.stop()
        src_d.stop()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_source_whose_write_stalls_polls_it_less_and_less(tmp_path):
    """Push mode, the reader's daemon SIGSTOPped (a hung host) in the
    middle of the source's WRITE: the source's progress loop polled every
    ``poll_busy_s`` (0.5 ms) until the WRITE's deadline, ~80 % of a core
    measured here (the loop and the NIXL thread). A busy poll now waits a
    fraction of the time since anything last moved (``kvd.core.progress``),
    so over 3 s of the stall the source uses a small part of a core; once
    the reader resumes, the push ends and both daemons serve on."""
    with _push_to_a_frozen_reader(tmp_path, 3) as (src_d, dst_d, src, dst, rid):
        try:
            time.sleep(0.5)  # the first half second may poll at full rate
            cpu0, t0 = _cpu_s(src_d.proc.pid), time.monotonic()
            time.sleep(3)
            share = (_cpu_s(src_d.proc.pid) - cpu0) / (time.monotonic() - t0)
        finally:
            os.kill(dst_d.proc.pid, signal.SIGCONT)
        assert share < 0.3, f"the source daemon used {share:.0%} of a core on a stalled WRITE"
        assert event_kind(dst.wait(rid, 60)) == "recv_done"
        ids = list(range(SHAPE.num_blocks))
        assert dst.same_blocks(ids, src, ids)
        _source_lives(src_d)
        _serves(src, dst, "next", [7, 8, 9])
        dst.close()
        src.close()


def test_in_push_mode_a_write_from_a_frozen_source_lands_nothing_after_the_load_failed(tmp_path):
    """The source daemon stops in the middle of its WRITE; the decode
    daemon's load fails at its deadline, and vLLM then reuses those blocks.
    Before, the WRITE went on when the source resumed: 942-1,002 of the
    1,024 block-regions changed after the failure. Now the decode daemon
    replaces its NIXL agent before it reports the failure
    (``settle.stop_writes_into``): the source's WRITE finds its connection
    closed, nothing lands, and both daemons serve on."""
    with _push_from_a_frozen_source(tmp_path, "frozen", seed=5, timeout_s=3) as (src_d, dst_d, src, dst):
        ev = dst.wait("frozen", 20)
        assert event_kind(ev) == "load_failed" and "timeout" in ev.load_failed.reason, ev
        changed = _changed_once_resumed(src_d, dst)
        assert changed == 0, f"{changed} block-regions changed after the load had failed"
        assert dst_d.proc.poll() is None
        _source_lives(src_d)
        src.release("frozen")
        _serves(src, dst, "next", [7, 8, 9])
        dst.close()
        src.close()


def test_in_push_mode_a_write_from_a_frozen_source_lands_nothing_after_the_session_ended(tmp_path):
    """As above, but the decode engine's session ends (its stream breaks:
    the shim then reports every load of it failed) while the frozen source's
    WRITE is under way. The decode daemon replaces the worker's agent before
    the stream ends; nothing lands when the source resumes."""
    with _push_from_a_frozen_source(tmp_path, "cut-off", seed=6, timeout_s=30) as (src_d, dst_d, src, dst):
        dst.session.close()  # the engine's stream breaks; the worker stays registered (detach grace)
        wait_until(lambda: "session closed: engine=d " in dst_d.log(), 20, "the daemon saw the session end")
        # Its agent replaced (a few hundred ms); the line never comes where the push goes on.
        wait_until(lambda: "its session ended during a push" in dst_d.log(), 5, None)
        changed = _changed_once_resumed(src_d, dst)
        assert changed == 0, f"{changed} block-regions changed after the session had ended"
        assert dst_d.proc.poll() is None
        _source_lives(src_d)
        dst.session = None
        dst.close()
        src.close()


def test_in_push_mode_a_write_from_a_frozen_source_lands_nothing_after_the_worker_unregistered(tmp_path):
    """As above, but the decode engine unregisters its worker (an engine
    shutting down) while the frozen source's WRITE is under way: the
    unregistration destroys the worker's NIXL agent, which closes the
    WRITE's connection, so nothing lands in that memory when the source
    resumes (the engine may hand it to anything by then)."""
    from kvd.v1 import kvd_pb2 as pb

    with _push_from_a_frozen_source(tmp_path, "gone", seed=7, timeout_s=30) as (src_d, dst_d, src, dst):
        dst.session.close()
        dst.session = None
        dst_d.stub().UnregisterEngine(pb.UnregisterEngineRequest(worker=pb.EngineWorker(engine_id="d", tp_rank=0)),
                                      timeout=20)
        assert dst_d.stats().engines == 0
        changed = _changed_once_resumed(src_d, dst)
        assert changed == 0, f"{changed} block-regions changed after the worker had unregistered"
        assert dst_d.proc.poll() is None
        _source_lives(src_d)
        # Both serve on: a new decode engine loads from the same source.
        again = Engine(dst_d, "d2", SHAPE)
        _serves(src, again, "next", [7, 8, 9])
        again.close()
        dst.close(unregister=False)
        src.close()


def test_a_source_engine_unregistering_during_its_push_sends_no_other_engines_bytes_and_lives(tmp_path):
    """Push mode, the source's side: its engine unregisters while its WRITE
    to a stalled reader (SIGSTOP) is under way, and another engine
    registers on the source daemon at once. Before, the unregistration
    unmapped the memory under the running WRITE (NIXL's handle still bound
    its agent): 950-961 of the reader's 1,024 block-regions then held the
    new engine's KV, mapped at the same address (5 of 5 runs), and without
    the second engine the source daemon died (SIGSEGV or a UCX assertion, 3
    of 5). Now the worker is quarantined until its WRITE has ended: the
    reader gets only the first engine's bytes, none after its load's end,
    and the source daemon frees the memory and serves on. Meanwhile the
    quarantined worker counts against its uid's caps (a uid unregistering
    under stalled WRITEs kept 1 GiB mapped against a 256 MiB cap): a third
    registration past ``max_workers_per_uid`` 2 is refused, saying why."""
    import grpc

    from kvd.v1 import kvd_pb2 as pb

    with _push_to_a_frozen_reader(tmp_path, 7, "--max-workers-per-uid", "2") as (src_d, dst_d, src, dst, rid):
        try:
            src.session.close()
            src.session = None
            src_d.stub().UnregisterEngine(
                pb.UnregisterEngineRequest(worker=pb.EngineWorker(engine_id="p", tp_rank=0)), timeout=20)
            other = Engine(src_d, "p2", SHAPE, seed=99)  # another engine's KV, perhaps where p's was mapped
            with pytest.raises(grpc.RpcError) as refused:
                Engine(src_d, "p3", SHAPE)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "quarantined_workers" in refused.value.details(), refused.value.details()
        finally:
            os.kill(dst_d.proc.pid, signal.SIGCONT)
        ev = dst.wait(rid, 60)
        at_end = dst.kv.copy()
        time.sleep(3)  # a WRITE still going would land now
        assert int((dst.kv != at_end).any(axis=2).sum()) == 0, f"bytes landed after the load's end: {event_kind(ev)}"
        pages = dst.kv.reshape(SHAPE.num_regions, SHAPE.num_blocks, -1, 4096)
        theirs = other.kv.reshape(SHAPE.num_regions, SHAPE.num_blocks, -1, 4096)
        assert int((pages == theirs).all(axis=3).sum()) == 0, "the reader got the other engine's KV"
        _source_lives(src_d)
        wait_until(lambda: src_d.stats().quarantined_workers == 0, 30, "the first engine's memory freed")
        # Both serve on: the other engine is a source like any.
        again = Engine(dst_d, "d2", SHAPE)
        _serves(other, again, "next", [7, 8, 9])
        again.close()
        other.close()
        dst.close()


def test_auto_pushes_from_a_source_of_this_host_whose_ucx_tls_leaves_only_tcp(tmp_path):
    """A decode daemon at UCX's default transports reads from daemons of
    its own host (CMA); a source whose ``UCX_TLS`` leaves only TCP makes
    every READ from it TCP's software GET (the crash above), even from its
    own host. Its handshake says so (``read_transport``), and the load is
    made a push before any READ; the next load is a push at once."""
    src_d = start_daemon(str(tmp_path), "p", env=TCP)
    dst_d = start_daemon(str(tmp_path), "d")
    try:
        assert "transfer mode auto: pull from daemons of this host" in dst_d.log()
        src = Engine(src_d, "p", SHAPE, seed=5)
        dst = Engine(dst_d, "d", SHAPE)
        _serves(src, dst, "first", [4, 5, 6])
        said = f"loads from {src_d.peer_address} are pushes (its handshake says a READ from it is TCP's"
        assert said in dst_d.log() and "read_transport tcp" in dst_d.log(), dst_d.log()[-3000:]
        assert dst_d.stats().transfers_failed == 0
        _serves(src, dst, "second", [7, 8, 9])
        assert dst_d.log().count(said) == 1
        [peer] = dst_d.stats().remote_workers  # what kvd status shows of it
        assert (peer.read_transport, peer.loads) == ("tcp", "push")
        dst.close()
        src.close()
    finally:
        dst_d.stop()
        src_d.stop()


def test_a_decode_daemon_set_to_pull_warns_when_a_sources_handshake_says_its_reads_are_tcp(tmp_path):
    """``pull`` set: the load READs as asked, but a source whose
    ``UCX_TLS`` leaves only TCP (which the decode daemon's startup check
    cannot see) gets a WARNING naming it and the fix."""
    src_d = start_daemon(str(tmp_path), "p", env=TCP)
    dst_d = start_daemon(str(tmp_path), "d", "--transfer-mode", "pull")
    try:
        src = Engine(src_d, "p", SHAPE, seed=6)
        dst = Engine(dst_d, "d", SHAPE)
        _serves(src, dst, "first", [4, 5, 6])
        log = dst_d.log()
        assert f"transfer mode pull: loads from {src_d.peer_address} READ over TCP" in log, log[-3000:]
        assert "are pushes (its handshake says" not in log
        [peer] = dst_d.stats().remote_workers
        assert (peer.read_transport, peer.loads) == ("tcp", "pull")
        dst.close()
        src.close()
    finally:
        dst_d.stop()
        src_d.stop()
