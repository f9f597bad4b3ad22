"""NIXL backends come from config; one that cannot load is a startup error naming it."""

from __future__ import annotations

import os
import subprocess
import sys


def test_unknown_backend_is_a_startup_error_naming_it(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "kvd.cli", "serve", "--engine-socket", str(tmp_path / "s.sock"),
         "--peer-listen", "127.0.0.1:0", "--backends", "UCX,NOSUCHBACKEND"],
        capture_output=True, text=True, timeout=60,
    )
    # A name NIXL has no plugin for is a configuration error: exit 64
    # (EX_USAGE; systemd's RestartPreventExitStatus), naming the setting.
    assert r.returncode == 64, r.stdout + r.stderr
    assert "invalid setting: backends" in r.stderr and "NOSUCHBACKEND" in r.stderr
    assert not (tmp_path / "s.sock").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".s.sock.")]  # nor the private directory


def test_backend_list_from_config_is_used(tmp_path):
    from kvd.testing.daemons import start_daemon

    d = start_daemon(str(tmp_path), "posix", "--backends", "UCX,POSIX")
    try:
        assert "UCX,POSIX" in d.log()
    finally:
        assert d.stop() == 0
