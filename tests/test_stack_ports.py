"""The harness that starts the demo's and the end-to-end tests' daemons
and engines (``kvd.testing.vllm_engines.PDStack``): when a port it picked
is taken before the child binds it, and what a stopped process group
leaves in ``/dev/shm`` (``kvd.testing.processes.stop_groups``)."""

from __future__ import annotations

import contextlib
import os
import socket


def _first_port_taken(monkeypatch) -> tuple[socket.socket, int]:
    """A listening socket and its port, which the harness's ``free_port``
    hands out first (then free ports as usual)."""
    from kvd.testing import vllm_engines as ve

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    first = [port]
    real = ve.free_port
    monkeypatch.setattr(ve, "free_port", lambda host="127.0.0.1": first.pop() if first else real(host))
    return taken, port


def test_daemons_start_again_on_other_ports_when_one_they_were_given_is_taken(tmp_path, monkeypatch):
    """A port from ``free_port`` is only free a moment: a fresh-clone run of
    ``kvd demo`` beside a busy test run failed once, daemon D exiting
    "Address already in use" before it was healthy. Here the first port
    handed out is one another socket listens on: daemon P fails to bind it,
    and both daemons start again on other ports and serve, the failed start
    not counted as a dead child."""
    from kvd.testing import vllm_engines as ve

    taken, port = _first_port_taken(monkeypatch)
    lines: list[str] = []
    st = ve.PDStack(model_dir=tmp_path, run_dir=tmp_path / "run", log=lines.append)
    try:
        st._start_daemons()
        assert st.daemons["P"].peer_port != port
        assert any("taken before it bound it" in line for line in lines), lines
        assert sum("healthy after" in line for line in lines) == 2, lines
        assert len(st.procs.children) == 2 and all(c.alive() for c in st.procs.children)
        st.procs.check_alive()  # the failed start is forgotten
    finally:
        st.close()  # its children, and the directories it made
        taken.close()


# A stand-in for ``vllm serve``: binds its HTTP port and answers 200 to
# every GET; a taken port ends it as vLLM's bind does ("Address already in use").
_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_an_engine_starts_again_on_other_ports_when_its_port_is_taken(tmp_path, monkeypatch):
    """The engines' HTTP ports come from ``free_port`` too, and vLLM binds
    its port only after seconds of imports, a wider window than a
    daemon's. An engine that exits "Address already in use" is started
    again on another port; the other engine is left as it is. (A stand-in
    process serves HTTP in vLLM's place: the harness's retry is under test.)"""
    import sys
    from types import SimpleNamespace

    from kvd.testing import vllm_engines as ve

    taken, port = _first_port_taken(monkeypatch)
    monkeypatch.setattr(ve, "engine_argv", lambda model, p, cfg, extra=(): [sys.executable, "-c", _SERVER, str(p)])
    lines: list[str] = []
    st = ve.PDStack(model_dir=tmp_path, run_dir=tmp_path / "run", log=lines.append)
    st.daemons = {n: SimpleNamespace(socket=str(tmp_path / f"{n}.sock")) for n in ("P", "D")}
    try:
        st._start_engines()
        assert st.engines["P"].port != port and ve.http_ok(st.engines["P"].url + "/health")
        assert any("engine-P: a port it was given was taken" in line for line in lines), lines
        assert sum("serving" in line and "after the engines started" in line for line in lines) == 2, lines
        assert len(st.procs.children) == 2 and all(c.alive() for c in st.procs.children)
        st.procs.check_alive()  # the failed start is forgotten
    finally:
        st.close()  # its children, and the directories it made
        taken.close()


# A child deaf to SIGTERM (as an engine still starting) holding a semaphore
# of multiprocessing's spawn context: named in /dev/shm, registered with the
# resource tracker that unlinks it, which the child starts in its group.
_SEMAPHORE = """
import multiprocessing, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
lock = multiprocessing.get_context("spawn").Lock()
print(lock._semlock.name, flush=True)
time.sleep(60)
"""


def test_a_stopped_group_leaves_no_multiprocessing_semaphore_in_dev_shm():
    """A demo interrupted while its engines started left two
    ``/dev/shm/sem.mp-*`` files a run (a new user's trial): vLLM's named
    semaphores, which its resource tracker unlinks once its processes are
    gone, but the tracker ignores SIGTERM and was killed with the group.
    It goes last now, after the rest of the group."""
    import subprocess
    import sys

    from kvd.testing.processes import stop_groups

    p = subprocess.Popen([sys.executable, "-c", _SEMAPHORE], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    name = p.stdout.readline().strip()
    path = f"/dev/shm/sem.{name.lstrip('/')}"
    try:
        assert name.startswith("/mp-") and os.path.exists(path), name
        stop_groups([p.pid], [p], grace_s=0.5)
        assert p.poll() is not None
        assert not os.path.exists(path), f"{path} left behind"
    finally:
        p.stdout.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, 9)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
