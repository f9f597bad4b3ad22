"""Small helpers every harness needs: a free port, polling with a deadline,
a process's resident memory, a log's last lines."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Callable


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bind to port 0, close).

    Another process may take it before the caller binds it: use for children
    that must listen on an address known in advance (a daemon restarted on
    the same peer address, an engine's HTTP port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str | None = None,
               interval: float = 0.02) -> float | None:
    """Polls ``predicate()`` every ``interval`` seconds until it is true;
    returns the seconds that took.

    After ``timeout`` seconds: raises AssertionError naming ``what`` when
    ``what`` is given (a test's expectation), else returns None (a harness
    that reports the miss itself). An exception from ``predicate`` counts as
    false when ``what`` is None (a daemon not answering yet), and propagates
    otherwise."""
    t0 = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - t0
        except Exception:
            if what is not None:
                raise
        if time.monotonic() - t0 > timeout:
            if what is not None:
                raise AssertionError(f"not true after {timeout} s: {what}")
            return None
        time.sleep(interval)


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (``VmRSS`` of /proc/<pid>/status).
    Raises RuntimeError when the process has none (a zombie), OSError when gone."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def tail(path: str | os.PathLike, lines: int = 40, max_bytes: int = 64 * 1024,
         keep: Callable[[str], bool] | None = None) -> str:
    """The last ``lines`` lines of the log at ``path`` (reading at most its last
    ``max_bytes`` bytes), only those ``keep`` is true of when given;
    ``"(no log: ...)"`` when it cannot be read."""
    try:
        with open(Path(path), "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    kept = data.splitlines() if keep is None else [ln for ln in data.splitlines() if keep(ln)]
    return "\n".join(kept[-lines:])


def peer_token_file(directory: str | os.PathLike, text: str = "kvd-test-peer-token-0123456789",
                    name: str = "peer.token") -> str:
    """Writes a peer token file (``peer_token_file``: 16+ characters, mode
    0600, as the daemon wants it) in ``directory``; returns its path."""
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)
    return path
