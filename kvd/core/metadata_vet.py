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
        self.crashes = 0  # children a metadata crashed

    def start(self) -> None:
        """Starts the child now (blocking, ~0.5-1 s), so that the first
        metadata does not wait for it; a child that fails to start is
        started again by the next :meth:`problem`."""
        with self._lock:
            try:
                self._ensure_child()
            except OSError as e:
                log.warning("metadata vetting process did not start: %s", e)

    def close(self) -> None:
        """Ends the child (it also ends by itself when the daemon's end of
        its pipe closes)."""
        with self._lock:
            self._stop_child()

    def problem(self, metadata: bytes) -> str | None:
        """None when ``metadata`` passed (now, or before); else why it is
        refused: it crashed the child's NIXL agent (the signal named), the
        child's agent refused it (NIXL's message), or the child did not
        answer within ``timeout_s``. Never raises."""
        if len(metadata) > BOUNDS.max_agent_metadata:
            return f"{len(metadata)} bytes of agent metadata, past {BOUNDS.max_agent_metadata}"
        digest = hashlib.sha256(metadata).digest()
        with self._passed_lock:
            if digest in self._passed:
                self._passed.move_to_end(digest)
                return None
        with self._lock:
            problem = self._load(metadata)
        if problem is None:
            with self._passed_lock:
                self._passed[digest] = None
                if len(self._passed) > PASSED_MAX:
                    self._passed.popitem(last=False)
        return problem

    def _load(self, metadata: bytes) -> str | None:
        try:
            child = self._ensure_child()
        except OSError as e:
            return str(e)
        try:
            child.stdin.write(struct.pack(">I", len(metadata)) + metadata)
            child.stdin.flush()
        except OSError as e:
            return self._child_died(f"the vetting process could not be given it ({e})")
        answer = self._answer(child)
        if answer is None:
            return self._child_died("")
        if answer == "ok":
            return None
        return f"a throwaway NIXL agent refused it: {answer.removeprefix('refused ')}"

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
                return None
            chunk = os.read(out.fileno(), _ANSWER_MAX)
            if not chunk:
                return None
            line += chunk
            if len(line) > _ANSWER_MAX:
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
        child = subprocess.Popen(
            [sys.executable, "-m", "kvd.core.metadata_vet", ",".join(self.backends)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
            start_new_session=True)  # a terminal's Ctrl-C goes to the daemon, which ends it
        ready = self._answer(child, START_TIMEOUT_S)
        if ready != "ready":
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
    4-byte big-endian length, then the bytes), loads it into the agent with
    NIXL's own call (no check of kvd's before it: what crashes here is what
    would have crashed the daemon), removes it, and answers ``ok`` or
    ``refused <NIXL's message>`` on a line. Ends at EOF."""
    import resource

    # A crash is the expected outcome of a malformed metadata: no core file
    # in the daemon's working directory.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    logging.disable(logging.CRITICAL)
    from kvd.core.nixl_agent import NixlAgent

    agent = NixlAgent(f"kvd-metadata-vet-{os.getpid()}", [b for b in argv[0].split(",") if b])
    agent.warm_up()  # UCX's first endpoints of a worker cost 20-120 ms: paid here, not by the first peer
    raw = agent._agent  # NIXL's agent: load exactly as the daemon's agents would
    fd_in, out = sys.stdin.fileno(), sys.stdout
    out.write("ready\n")
    out.flush()
    while True:
        head = _read_exact(fd_in, 4)
        if head is None:
            return 0
        (n,) = struct.unpack(">I", head)
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
        out.write(answer + "\n")
        out.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
