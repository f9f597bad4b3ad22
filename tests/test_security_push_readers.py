"""Push readers against a hostile peer (eleventh review): the readers a
source worker WRITEs to (``WorkerPairs.readers``, ``kvd.core.push``) are
bounded and released.

``PeerService.Push`` is served in pull mode too (the default). Each reader
is a NIXL agent loaded into the source worker's agent (a UCX endpoint, ~1 fd,
the pair's descriptor lists). Before, nothing capped them, liveness skipped
them, and they went only when a WRITE to them failed or the worker
unregistered: a peer naming a new reader agent in each Push (one NIXL agent
process, its metadata renamed) loaded 2,000 agents in 18 s (fds 67 -> 2,066),
none released 20 s later, ``remote_agents`` still 2,000 after the reader
process exited; at ``RLIMIT_NOFILE`` 1024 new registrations failed "Too
many open files" and every other peer's call was refused.

Promised now: at most ``BOUNDS.max_push_readers`` readers per worker (the
least recently used one no push is using is released; while every one has
a WRITE in flight, a push to a new one is refused RESOURCE_EXHAUSTED); a
reader no push used for ``peer_idle_s`` is released; a released reader pairs
again on its next push; no reader is released while a push uses it. What
stays open (the UCX sockets of released pairs while the hostile peer keeps
its side): docs/SECURITY.md, "Open".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
import time

import grpc
import pytest

from kvd.core.state import PROTOCOL_VERSION
from kvd.core import push as push_mod
from kvd.core.events import PeerUnavailable, ResourceExhausted
from kvd.core.limits import BOUNDS
from kvd.core.node import Node
from kvd.core.state import PushOrder, Segment
from kvd.testing.daemons import start_daemon
from kvd.testing.nixl_peer import BLEN, LAYOUT, PEER_AGENT, REGIONS, SIZE
from kvd.testing.processes import child_env
from kvd.testing.sessions import Engine, KvShape
from kvd.testing.shm import ShmSegment
from kvd.testing.util import wait_until
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

SHAPE = KvShape(num_layers=2, num_blocks=16, block_len=1024)
BLOCK_BYTES = SHAPE.num_regions * SHAPE.block_len  # one block, every region
NAME = "push-rd-000000"  # renamed per push: same length, so the metadata stays well formed


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Reader:
    """One NIXL agent in a process of its own (``kvd.testing.nixl_peer``)
    and :meth:`push`: a Push to a source daemon naming it under any name of
    ``NAME``'s length (its metadata renamed: the agent is the same)."""

    def __init__(self, nbytes: int):
        self.proc = subprocess.Popen([sys.executable, "-c", PEER_AGENT, NAME, str(nbytes)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=child_env())
        line = next(x for x in self.proc.stdout if x.startswith("MD "))
        _, md, base = line.split()
        self.md, self.base = bytes.fromhex(md), int(base)

    def metadata(self, name: str) -> bytes:
        assert len(name) == len(NAME)
        return self.md.replace(NAME.encode(), name.encode())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@contextlib.contextmanager
def source(tmp_path, *flags: str):
    """``(daemon, engine, stub, describe, reader)``: a source daemon (its
    ``flags`` added) whose engine holds request ``req`` (blocks 1, 2), its
    PeerService stub, its engine's handshake answer, and a reader agent
    process."""
    d = start_daemon(str(tmp_path), "P", "--same-node-copy", "false", *flags, log_level="info")
    e = Engine(d, "push-src", SHAPE, seed=2)
    reader = Reader(SHAPE.size)
    ch = grpc.insecure_channel(d.peer_address)
    stub = pb_grpc.PeerServiceStub(ch)
    try:
        e.hold("req", [1, 2], lease_s=600)
        e.held("req", [1, 2])  # a Push waits for no hold: the first push met NOT_FOUND once on a busy machine
        real = stub.Handshake(pb.HandshakeRequest(engine_id=e.engine_id, tp_rank=0,
                                                  compat_hash=e.registered.compat_hash, protocol_version=PROTOCOL_VERSION),
                              timeout=10)
        yield d, e, stub, real, reader
    finally:
        reader.close()
        ch.close()
        e.close()
        assert d.stop() == 0


def push(stub, real: pb.HandshakeResponse, reader: Reader, e: Engine, i: int) -> pb.PushResponse:
    """A Push of block 1 of ``req`` into block 5 of reader ``push-rd-<i>``
    (one notification of 65,536: the lease stays)."""
    name = f"push-rd-{i:06d}"
    desc = pb.HandshakeResponse()
    desc.CopyFrom(real)
    desc.agent_metadata, desc.agent_name, desc.warm_up_addr = reader.metadata(name), name, 0
    del desc.region_base_addrs[:]
    desc.region_base_addrs.extend(reader.base + r.offset for r in real.regions)
    return stub.Push(pb.PushRequest(engine_id=e.engine_id, tp_rank=0, request_id="req",
                                    source_groups=[pb.BlockIds(ids=[1])], reader=desc, reader_tp_rank=0,
                                    reader_groups=[pb.BlockIds(ids=[5])], expected_notifications=65536,
                                    timeout_s=10), timeout=30)


def test_pushes_naming_a_new_reader_each_leave_at_most_the_cap_loaded(tmp_path):
    """A hostile peer names a new reader in each of ``max_push_readers`` +
    40 pushes (about 8 s here). Before: every reader stayed loaded
    (``remote_agents`` 552). Promised: at most the cap stays loaded, every
    push is answered, the first reader (released as the least recently
    used) pairs again on its next push, the releases are logged once, not a
    line each; once the reader's process is gone the daemon's fds are back
    where they were."""
    with source(tmp_path) as (d, e, stub, real, reader):
        _cap(d, e, stub, real, reader)


def _cap(d, e, stub, real, reader) -> None:
    cap = BOUNDS.max_push_readers
    fds0 = fd_count(d.pid)
    assert push(stub, real, reader, e, 0).bytes == BLOCK_BYTES
    for i in range(1, cap + 40):
        push(stub, real, reader, e, i)
    wait_until(lambda: d.stats().remote_agents <= cap, 5, f"at most {cap} readers loaded")
    assert push(stub, real, reader, e, 0).bytes == BLOCK_BYTES  # released, pairs again
    wait_until(lambda: d.stats().remote_agents <= cap, 5, f"at most {cap} readers loaded")
    log = d.log()
    assert "released to stay within BOUNDS.max_push_readers" in log
    assert log.count("released to stay within BOUNDS.max_push_readers") <= 2
    reader.close()
    # The UCX connections go with the reader's process (UCX keeps a released
    # endpoint's socket while its peer does, docs/SECURITY.md "Open").
    wait_until(lambda: fd_count(d.pid) <= fds0 + 2, 15, "the daemon's fds back once the reader is gone")
    assert d.proc.poll() is None and d.stats().daemon_version


def test_an_idle_push_reader_is_released_after_peer_idle_s_and_pairs_again(tmp_path):
    """A reader no push has used for ``peer_idle_s`` (3 s here). Before:
    kept for the worker's life (liveness skipped push readers). Promised:
    released at the next liveness check, and paired again by its next
    push."""
    with source(tmp_path, "--peer-check-s", "0.5", "--peer-idle-s", "3") as (d, e, stub, real, reader):
        _idle(d, e, stub, real, reader)


def _idle(d, e, stub, real, reader) -> None:
    assert push(stub, real, reader, e, 7).bytes == BLOCK_BYTES
    assert d.stats().remote_agents == 1
    t0 = time.monotonic()
    wait_until(lambda: d.stats().remote_agents == 0, 15, "the idle reader released")
    assert time.monotonic() - t0 >= 2.0  # not before peer_idle_s (3 s from the push; polled from just after)
    assert "released push reader push-rd-000007 (no push used it for 3 s (peer_idle_s))" in d.log()
    assert push(stub, real, reader, e, 7).bytes == BLOCK_BYTES
    assert d.stats().remote_agents == 1


# ------------------------------------------------------- WRITEs in flight (in-process)


def run_held_writes(body, cap: int):
    """Runs ``async body(node, worker, order, gate)`` on an in-process source
    ``Node`` (engine ``P`` holding ``req``, blocks 1-2) with
    ``max_push_readers`` = ``cap``, a reader agent process, ``order(i)`` a
    PushOrder to reader ``push-rd-<i>``, and ``gate``: while ``gate.hold``
    is set, the progress loop does not see any WRITE end (each push keeps
    its reader in use, as a WRITE a frozen peer stalls would); ``gate.fail``
    (keys of ``Push.writes``) ends those WRITEs ``ERR``, held or not."""
    reader, src = Reader(SIZE), ShmSegment(SIZE)
    gate = type("Gate", (), {"hold": False, "fail": set()})()

    async def main():
        p = Node()
        real_poll = p.push_mode.poll_writes

        def poll_writes(now):  # NIXL thread
            done = []
            for key in [k for k in gate.fail if k in p.push_mode.writes]:
                gate.fail.discard(key)
                w, h, fut, _ = p.push_mode.writes.pop(key)
                while w.agent.state(h) == "PROC":  # a real WRITE of a few KiB: ends within ms
                    time.sleep(0.001)
                p.rt.release_handle(w.agent, h)
                done.append((fut, "ERR"))
            return done if gate.hold else done + real_poll(now)

        p.push_mode.poll_writes = poll_writes
        p.start()
        try:
            w = await p.register("P", 0, 1, LAYOUT, [Segment(src.name, src.size)], REGIONS, model="m")
            p.hold(w, "req", [[1, 2]], lease_s=600)
            hs = await p.handshake_info("P", 0, w.compat_hash)

            def order(i: int) -> PushOrder:
                name = f"push-rd-{i:06d}"
                desc = dataclasses.replace(hs, agent_metadata=reader.metadata(name), agent_name=name,
                                           region_bases=[reader.base + r.offset for r in REGIONS], warm_up_addr=0)
                return PushOrder("P", 0, "req", [[1]], desc, 0, [[5]], 65536, 20.0)

            return await body(p, w, order, gate)
        finally:
            gate.hold = False
            await p.close()

    old = push_mod.BOUNDS
    push_mod.BOUNDS = dataclasses.replace(BOUNDS, max_push_readers=cap)
    try:
        return asyncio.run(main())
    finally:
        push_mod.BOUNDS = old
        reader.close()
        src.close()


def pushed(p: Node, order: PushOrder):
    """``p.push(order)``, given 15 s (a push that never ends fails the test)."""
    return asyncio.wait_for(p.push(order), 15)


async def _until(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, what
        await asyncio.sleep(0.01)


def test_a_new_reader_is_refused_when_every_reader_has_a_write_in_flight_and_none_is_released():
    """Two readers (the cap, 2 here), each with a WRITE in flight: a push to
    a third is refused RESOURCE_EXHAUSTED naming the bound; neither busy
    reader is released (a reader released under a WRITE would have its
    lists and agent freed while NIXL writes through them). Once the WRITEs
    end, the third push releases the least recently used reader and
    succeeds. Before: no bound, the third reader was loaded as well."""

    async def body(p, w, order, gate):
        gate.hold = True
        busy = [asyncio.ensure_future(pushed(p, order(i))) for i in (1, 2)]
        await _until(lambda: len(p.push_mode.writes) == 2, 10, "both WRITEs posted")
        with pytest.raises(ResourceExhausted, match="max_push_readers"):
            await pushed(p, order(3))
        assert sorted(w.pairs.readers) == ["push-rd-000001", "push-rd-000002"]
        assert not w.pairs.retired and not any(r.freed for r in w.pairs.readers.values())
        gate.hold = False
        assert [r.bytes for r in await asyncio.gather(*busy)] == [2 * BLEN, 2 * BLEN]
        assert (await pushed(p, order(3))).bytes == 2 * BLEN
        assert sorted(w.pairs.readers) == ["push-rd-000002", "push-rd-000003"]
        await _until(lambda: p.stats()["remote_agents"] == 2, 5, "the released reader freed")

    run_held_writes(body, cap=2)


def test_a_reader_whose_write_failed_is_freed_only_after_its_other_writes_end():
    """Two pushes to one reader at once; the first WRITE fails. The next
    push pairs the reader again at once, but the failed pair's lists and
    agent stay until the other WRITE through them has ended. Before: the
    failed pair was retired at once, and the progress loop (which knew of
    READs only) freed it under the WRITE still in flight."""

    async def body(p, w, order, gate):
        gate.hold = True
        a, b = (asyncio.ensure_future(pushed(p, order(1))) for _ in range(2))
        await _until(lambda: len(p.push_mode.writes) == 2, 10, "both WRITEs posted")
        r = w.pairs.readers["push-rd-000001"]
        gate.fail.add(next(iter(p.push_mode.writes)))  # ended ERR; the other stays held
        done, _ = await asyncio.wait([a, b], return_when=asyncio.FIRST_COMPLETED)
        failed = done.pop()
        assert isinstance(failed.exception(), PeerUnavailable)
        assert "push-rd-000001" not in w.pairs.readers  # the next push pairs it again
        await asyncio.sleep(0.1)  # progress rounds: nothing frees it while the other WRITE is in flight
        assert not r.freed and r not in w.pairs.retired
        gate.hold = False
        other = b if failed is a else a
        assert (await other).bytes == 2 * BLEN
        await _until(lambda: r.freed, 5, "the failed pair freed once its last WRITE ended")
        assert (await pushed(p, order(1))).bytes == 2 * BLEN  # paired again
        assert w.pairs.readers["push-rd-000001"] is not r

    run_held_writes(body, cap=4)
