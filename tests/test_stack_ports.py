"""The harness that starts the demo's and the end-to-end tests' daemons
(``kvd.testing.vllm_engines.PDStack``) when a port it picked is taken
before the daemon binds it."""

from __future__ import annotations

import socket


def test_daemons_start_again_on_other_ports_when_one_they_were_given_is_taken(tmp_path, monkeypatch):
    """A port from ``free_port`` is only free a moment: a fresh-clone run of
    ``kvd demo`` beside a busy test run failed once, daemon D exiting
    "Address already in use" before it was healthy. Here the first port
    handed out is one another socket listens on: daemon P fails to bind it,
    and both daemons start again on other ports and serve, the failed start
    not counted as a dead child."""
    from kvd.testing import vllm_engines as ve

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    first = [port]
    real = ve.free_port
    monkeypatch.setattr(ve, "free_port", lambda host="127.0.0.1": first.pop() if first else real(host))
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
        st.procs.close()
        taken.close()
