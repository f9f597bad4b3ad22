"""Startup refusals that protect the operator's files and name the setting."""

from __future__ import annotations

import socket
import subprocess
import sys


def _serve(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "kvd.cli", "serve", "--peer-listen", "127.0.0.1:0", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_a_regular_file_at_the_socket_path_is_never_replaced(tmp_path):
    precious = tmp_path / "kvd.toml"
    precious.write_text("precious\n")
    r = _serve("--engine-socket", str(precious))
    assert r.returncode != 0
    assert "not a socket" in r.stderr + r.stdout
    assert precious.read_text() == "precious\n"


def test_a_metrics_port_in_use_names_the_setting(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        r = _serve("--engine-socket", str(tmp_path / "k.sock"), "--metrics-port", str(port),
                   "--metrics-host", "127.0.0.1")
    finally:
        s.close()
    assert r.returncode != 0
    assert "metrics_port" in r.stderr + r.stdout


def test_a_lease_over_an_hour_is_a_config_error(tmp_path):
    r = _serve("--engine-socket", str(tmp_path / "k.sock"), "--lease-s", "7200", "--print-config")
    assert r.returncode == 64 and "lease_s" in r.stderr
