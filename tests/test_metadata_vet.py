"""A peer's NIXL agent metadata is loaded in a throwaway process first
(``kvd.core.metadata_vet``): what crashes UCX there is refused, and the
daemon, which never loads it, keeps serving.

The crash here is a real one: a UCX worker address of an unknown version,
which UCX 1.23's parser stops the process on (SIGABRT, an assertion kept in
release builds). The daemon's own agents refuse that one kind by name
(``metadata_problem``) before NIXL sees it; the throwaway process loads
with NIXL's own call and no such check, so it stands for the malformed
addresses no check can list (tests/test_security_attack8.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import time

import pytest

from kvd.core.limits import Limits
from kvd.core.metadata_vet import MetadataVet
from kvd.core.nixl_agent import NixlError
from kvd.core.node import Node
from kvd.core.state import Segment
from kvd.testing.daemons import start_daemon
from kvd.testing.shm import ShmSegment
from kvd.testing.util import peer_token_file
from kvd.testing.nixl_peer import LAYOUT, REGIONS, SIZE, with_ucx_version


@pytest.fixture
def vet(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a core file of the child would land
    v = MetadataVet(["UCX"])
    v.start()
    yield v
    v.close()


def test_real_metadata_passes_and_is_remembered(vet, real_md):
    child = vet._child.pid
    assert vet.problem(real_md) is None
    assert vet.problem(real_md) is None and vet._child.pid == child
    assert len(vet._passed) == 1


def test_metadata_that_crashes_ucx_is_refused_and_the_next_one_gets_a_new_process(vet, real_md, tmp_path):
    first = vet._child.pid
    problem = vet.problem(with_ucx_version(real_md, 5))
    assert problem == "it crashed a throwaway NIXL agent loading it (SIGABRT)", problem
    assert vet.crashes == 1 and not vet._passed
    assert vet.problem(real_md) is None and vet._child.pid != first
    second = vet._child.pid
    # The same crashing metadata again: refused from memory, no crash.
    assert vet.problem(with_ucx_version(real_md, 5)) == problem
    assert vet.crashes == 1 and vet._child.pid == second
    assert not [p for p in os.listdir(tmp_path) if p.startswith("core")], "the crash left a core file"


def test_metadata_nixl_refuses_or_past_the_bound_is_refused_without_a_crash(vet, real_md):
    child = vet._child.pid
    assert vet.problem(b"not nixl metadata").startswith("a throwaway NIXL agent refused it: ")
    assert vet.problem(real_md[:40]).startswith("a throwaway NIXL agent refused it: ")
    assert "past" in vet.problem(b"x" * ((1 << 20) + 1))
    assert vet._child.pid == child and vet.crashes == 0


def test_a_child_that_does_not_answer_is_killed_and_the_metadata_refused(real_md):
    v = MetadataVet(["UCX"], timeout_s=1.0)
    try:
        v.start()
        stuck = v._child
        os.kill(stuck.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        problem = v.problem(real_md)
        assert problem == "the vetting process did not answer within 1 s", problem
        assert time.monotonic() - t0 < 10 and v.crashes == 0  # no crash of UCX's
        assert stuck.poll() is not None  # killed
        assert v.problem(real_md) is None  # a new child: not remembered as refused
    finally:
        v.close()
    assert v.problem(b"another") == "the daemon is shutting down" and v._child is None


def test_ucx_log_lines_never_read_as_answers(monkeypatch, real_md):
    """UCX logs to stdout (``UCX_LOG_FILE``'s default): at info level at
    once, and an ERROR line in the middle of a load whose peer is gone.
    Before, such a line was read as the answer, and the next metadata got
    the one before's: a crashing metadata passed, and was remembered."""
    from kvd.core.nixl_agent import NixlAgent

    monkeypatch.setenv("UCX_LOG_LEVEL", "info")  # the child inherits it
    gone = NixlAgent("vet-test-gone")
    gone_md = gone.metadata()
    gone.close()
    v = MetadataVet(["UCX"])
    try:
        v.start()
        v.problem(gone_md)  # whatever NIXL says of an agent that is gone, it is this one's answer
        assert v.problem(real_md) is None
        assert v.problem(with_ucx_version(real_md, 5)).startswith("it crashed")
        assert v.crashes == 1
    finally:
        v.close()


def test_the_child_takes_no_module_from_the_daemons_working_directory(tmp_path, monkeypatch, real_md):
    planted = tmp_path / "cwd"
    planted.mkdir()
    marker = tmp_path / "planted-ran"
    (planted / "struct.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                       "from _struct import *\n")
    monkeypatch.chdir(planted)
    v = MetadataVet(["UCX"])
    try:
        v.start()
        assert v.problem(real_md) is None
    finally:
        v.close()
    assert not marker.exists(), "the vetting process ran a module planted in the daemon's working directory"


def test_the_child_ends_with_the_daemons_end_of_its_pipe(real_md):
    v = MetadataVet(["UCX"])
    v.start()
    child = v._child
    v.close()
    assert child.wait(10) == 0


def test_a_node_refuses_a_peer_whose_metadata_crashes_the_throwaway_agent_and_pairs_with_honest_ones():
    """The path a handshake answer and a push reader take (``Peers.pair``):
    the metadata that crashes the throwaway agent is refused before the
    node's own agent loads it; an honest peer pairs after it."""
    src, dst = ShmSegment(SIZE), ShmSegment(SIZE)

    async def main():
        p, d = Node(), Node(Limits(vet_peer_metadata=True))
        p.start()
        d.start()
        try:
            await p.register("P", 0, 1, LAYOUT, [Segment(src.name, src.size)], REGIONS, model="m")
            wd = await d.register("D", 0, 1, LAYOUT, [Segment(dst.name, dst.size)], REGIONS, model="m")
            hs = await p.handshake_info("P", 0, wd.compat_hash)
            bad = dataclasses.replace(hs, agent_metadata=with_ucx_version(hs.agent_metadata, 5))
            with pytest.raises(NixlError, match=r"crashed a throwaway NIXL agent loading it \(SIGABRT\)"):
                await d.peers.pair(wd, bad, 0, we_read=True, address="127.0.0.1:2", engine_id="P")
            assert hs.agent_name not in wd.pairs.agents
            phases = {}
            r = await d.peers.pair(wd, hs, 0, we_read=True, address="127.0.0.1:2", engine_id="P", phases=phases)
            assert r.agent_name == hs.agent_name and "vet" in phases
            return d.peers.vet.crashes
        finally:
            await d.close()
            await p.close()

    try:
        assert asyncio.run(main()) == 1
    finally:
        src.close()
        dst.close()


def _children(pid: int) -> list[str]:
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [ln.strip() for ln in out.splitlines() if "kvd.core.metadata_vet" in ln]


def test_a_daemon_with_a_peer_token_vets_and_its_vetting_process_ends_with_it(tmp_path):
    d = start_daemon(str(tmp_path), "vetting", "--peer-token-file", peer_token_file(tmp_path))
    try:
        assert "loaded in a throwaway process first" in d.log()
        deadline = time.monotonic() + 30
        while not _children(d.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        kids = _children(d.proc.pid)
        assert len(kids) == 1, kids
        child = int(kids[0].split()[0])
    finally:
        assert d.stop() == 0
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}"), "the vetting process outlived its daemon"


def test_a_daemon_with_no_peer_credential_or_set_not_to_vets_nothing(tmp_path):
    token = peer_token_file(tmp_path)
    for name, args in (("plain", ()), ("off", ("--peer-token-file", token, "--vet-peer-metadata", "false"))):
        d = start_daemon(str(tmp_path), name, *args)
        try:
            time.sleep(1)
            assert "throwaway process" not in d.log() and not _children(d.proc.pid)
        finally:
            assert d.stop() == 0
