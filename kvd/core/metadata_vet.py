"""A peer's NIXL agent metadata, loaded first in a throwaway process.

Loading a peer's metadata into a NIXL agent hands each backend's connection
info to the backend, and UCX 1.23's parser of a worker address takes no
length to bound it (``ucp_address_unpack``): some malformed addresses crash
the process that loads them. kvd refuses the one kind it can name (an
unknown address version, ``kvd.core.nixl_agent.metadata_problem``), but an
attacker review's fuzz of every byte of a real 213-byte address found
segfaults on others (~54,000 variants with a known version: 6 crashes),
which no check of kvd's can list. Who may send metadata is therefore the
defence (docs/SECURITY.md); this module narrows what a peer that may (one
holding the token, or a certificate) can do with it: each metadata not seen
before is loaded and removed again by a child process's own NIXL agent
(``python -m kvd.core.metadata_vet``), with the daemon's backends and
environment, before the daemon's agents load it. A metadata that crashes
the child is refused, and the child is started again for the next one.

Measured here: the child's agent loads and removes a real metadata in
0.6-1 ms (15 ms the first time); the child holds ~60 MiB resident. It is
started when the daemon starts, so the first handshake does not wait for
its ~0.5-1 s of imports.

What it cannot catch: a crash that depends on what the process loaded
before (two of the fuzz's six crashed only after earlier variants), and
anything past the load (UCX's wire-up, transfers). Metadata that passed is
remembered by its SHA-256 (at most :data:`PASSED_MAX`), so a peer's
handshakes after its first cost nothing.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict

from kvd.core.limits import BOUNDS
from kvd.logtext import clip

log = logging.getLogger("kvd.core")

#: Metadata digests remembered as passed (32 bytes each, plus the dict's own).
PASSED_MAX = 4096

#: A load in the child that takes longer than this (seconds) is a refusal,
#: and the child is killed: a real one takes milliseconds.
VET_TIMEOUT_S = 5.0

#: How long the child may take to import NIXL and make its agent, seconds
#: (~0.5-1 s here; a loaded 2-core machine takes several).
START_TIMEOUT_S = 60.0

_ANSWER_MAX = 4096  # bytes of one answer line from the child


class MetadataVet:
    """Loads peer metadata in a child process before the daemon does.

    Args:
        backends: the NIXL backends of the daemon's agents (``["UCX"]``).
        timeout_s: how long one load in the child may take, seconds.

    Thread-safe: :meth:`problem` is called off the event loop (it blocks
    while the child loads), one new metadata at a time; one that passed
    before is answered at once. A peer that keeps sending metadata that
    crashes the child (each restart ~0.5-1 s) delays other new peers'
    first handshakes, not known ones.
    """

    def __init__(self, backends: list[str], timeout_s: float = VET_TIMEOUT_S) -> None:
        self.backends = list(backends)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # the child: one load (or start) at a time
        self._child: subprocess.Popen | None = None
        # Metadata that passed, by SHA-256, under a lock of its own: a peer
        # known already is not held up behind another's load or a restart.
        self._passed_lock = threading.Lock()
        self._passed: OrderedDict[bytes, None] = OrderedDict()
        # Refused ones too (digest -> why): a peer sending the same crashing
        # metadata again costs nothing, and no other peer waits behind it.
        self._refused: OrderedDict[bytes, str] = OrderedDict()
        self._seq = 0  # each answer names the request it answers
        self._closed = False
        self._killed: subprocess.Popen | None = None  # a child this object killed (no crash of UCX's)
        self.crashes = 0  # children a metadata crashed
        # Where callers on an event loop run :meth:`problem`: its own thread,
        # so a busy child (restarts after crashes, ~1 s each) never holds
        # the loop's default executor, which unregistrations and name
        # lookups use.
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvd-vet")

    def start(self) -> None:
        """Starts the child now (blocking, ~0.5-1 s), so that the first
        metadata does not wait for it; a child that fails to start is
        started again by the next :meth:`problem`."""
        with self._lock:
            try:
                self._ensure_child()
            except OSError as e:
                # Fails closed: every new peer metadata is refused until a
                # child starts (each try starts one again).
                log.error("%s: new peers' NIXL metadata is refused until it starts (vet_peer_metadata = false "
                          "runs without it)", e)

    def close(self) -> None:
        """Ends the child (it also ends by itself when the daemon's end of
        its pipe closes); later calls of :meth:`problem` refuse."""
        self._closed = True
        self.executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._stop_child()

    def remembered(self, metadata: bytes) -> tuple[bool, str | None]:
        """``(True, problem)`` when ``metadata`` was vetted before (``problem``
        None: it passed), else ``(False, None)``. Cheap (a SHA-256 of a few
        KiB): callable on an event loop."""
        if len(metadata) > BOUNDS.max_agent_metadata:
            return True, f"{len(metadata)} bytes of agent metadata, past {BOUNDS.max_agent_metadata}"
        digest = hashlib.sha256(metadata).digest()
        with self._passed_lock:
            if digest in self._passed:
                self._passed.move_to_end(digest)
                return True, None
            if digest in self._refused:
                return True, self._refused[digest]
        return False, None

    def problem(self, metadata: bytes) -> str | None:
        """None when ``metadata`` passed (now, or before); else why it is
        refused: it crashed the child's NIXL agent (the signal named), the
        child's agent refused it (NIXL's message), or the child did not
        answer within ``timeout_s``. Never raises."""
        known, problem = self.remembered(metadata)
        if known:
            return problem
        digest = hashlib.sha256(metadata).digest()
        with self._lock:
            if self._closed:
                return "the daemon is shutting down"
            known, problem = self.remembered(metadata)  # vetted while this call waited
            if known:
                return problem
            problem, settled = self._load(metadata)
        if settled:  # not a child that could not start or answer in time: that may pass next time
            with self._passed_lock:
                table = self._passed if problem is None else self._refused
                table[digest] = problem
                if len(table) > PASSED_MAX:
                    table.popitem(last=False)
        return problem

    def _load(self, metadata: bytes) -> tuple[str | None, bool]:
        """``(problem, settled)``: ``settled`` when the answer is the
        metadata's own (passed, refused by NIXL, or a crash), not the
        child's failure to start or to answer in time."""
        try:
            child = self._ensure_child()
        except OSError as e:
            return str(e), False
        self._seq += 1
        try:
            child.stdin.write(struct.pack(">II", self._seq, len(metadata)) + metadata)
            child.stdin.flush()
        except OSError as e:
            return self._child_died(f"the vetting process could not be given it ({e})"), False
        answer = self._answer(child)
        if answer is None:
            problem = self._child_died("")
            return problem, problem.startswith("it crashed")
        seq, _, verdict = answer.partition(" ")
        if seq != str(self._seq):  # not this request's answer: nothing it says can be trusted
            self._killed = child
            child.kill()
            return self._child_died(f"the vetting process answered out of turn ({clip(answer, 200)!r})"), False
        if verdict == "ok":
            return None, True
        return f"a throwaway NIXL agent refused it: {verdict.removeprefix('refused ')}", True

    def _answer(self, child: subprocess.Popen, timeout_s: float | None = None) -> str | None:
        """The child's answer line, or None when it died or timed out (then
        it is killed)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        out = child.stdout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([out], [], [], left)[0]:
                log.warning("metadata vetting process: no answer within %.0f s; killing it", timeout_s)
                child.kill()
                self._killed = child
                return None
            chunk = os.read(out.fileno(), _ANSWER_MAX)
            if not chunk:
                return None
            line += chunk
            if len(line) > _ANSWER_MAX:
                self._killed = child
                child.kill()
                return None
        return line.decode("utf-8", "replace").strip()

    def _child_died(self, why: str) -> str:
        child, self._child = self._child, None
        code = None
        if child is not None:
            try:
                code = child.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                code = child.wait()
            _close_pipes(child)
        if child is not None and child is self._killed:
            return why or f"the vetting process did not answer within {self.timeout_s:.0f} s"
        if code is not None and code < 0:
            self.crashes += 1
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            return f"it crashed a throwaway NIXL agent loading it ({name})"
        return why or f"the vetting process ended (exit {code})"

    def _ensure_child(self) -> subprocess.Popen:
        if self._child is not None and self._child.poll() is None:
            return self._child
        if self._child is not None:
            _close_pipes(self._child)
        # -P and cwd "/": no module is taken from the daemon's working
        # directory (the child runs with the daemon's privileges).
        child = subprocess.Popen(
            [sys.executable, "-P", "-m", "kvd.core.metadata_vet", ",".join(self.backends)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True, cwd="/",
            start_new_session=True)  # a terminal's Ctrl-C goes to the daemon, which ends it
        ready = self._answer(child, START_TIMEOUT_S)
        if ready != "0 ready":
            child.kill()
            code = child.wait()
            _close_pipes(child)
            raise OSError(f"the metadata vetting process did not start (exit {code}: {ready or 'no answer'})")
        self._child = child
        return child

    def _stop_child(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        _close_pipes(child)  # EOF: the child exits
        try:
            child.wait(timeout=2)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _close_pipes(child: subprocess.Popen) -> None:
    for f in (child.stdin, child.stdout):
        try:
            f.close()
        except OSError:
            pass


def _read_exact(fd: int, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def main(argv: list[str]) -> int:
    """The child: one NIXL agent; for each metadata read from stdin (a
    4-byte big-endian sequence number and length, then the bytes), loads it
    into the agent with NIXL's own call (no check of kvd's before it: what
    crashes here is what would have crashed the daemon), removes it, and
    answers ``<seq> ok`` or ``<seq> refused <NIXL's message>`` on a line
    (``0 ready`` first). Answers go to what was stdout; stdout itself is
    /dev/null, because UCX logs there (``UCX_LOG_FILE``'s default) and a
    log line must never read as an answer. Ends at EOF."""
    import resource

    # A crash is the expected outcome of a malformed metadata: no core file.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    answers = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    logging.disable(logging.CRITICAL)
    from kvd.core.nixl_agent import NixlAgent

    agent = NixlAgent(f"kvd-metadata-vet-{os.getpid()}", [b for b in argv[0].split(",") if b])
    agent.warm_up()  # UCX's first endpoints of a worker cost 20-120 ms: paid here, not by the first peer
    raw = agent._agent  # NIXL's agent: load exactly as the daemon's agents would
    fd_in, out = sys.stdin.fileno(), answers
    out.write("0 ready\n")
    out.flush()
    while True:
        head = _read_exact(fd_in, 8)
        if head is None:
            return 0
        seq, n = struct.unpack(">II", head)
        if n > BOUNDS.max_agent_metadata:
            return 2
        metadata = _read_exact(fd_in, n)
        if metadata is None:
            return 0
        try:
            name = raw.add_remote_agent(metadata)
            raw.remove_remote_agent(name if isinstance(name, str) else name.decode())
            answer = "ok"
        except Exception as e:  # NIXL's refusal of a metadata it can parse
            answer = "refused " + " ".join(str(e).split())[:1000]
        out.write(f"{seq} {answer}\n")
        out.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
