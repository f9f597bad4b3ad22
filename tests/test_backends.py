"""NIXL backends come from config; one that cannot load is a startup error naming it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _serve_with_backends(tmp_path, backends: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvd.cli", "serve", "--engine-socket", str(tmp_path / "s.sock"),
         "--peer-listen", "127.0.0.1:0", "--backends", backends],
        capture_output=True, text=True, timeout=60,
    )


def test_unknown_backend_is_a_startup_error_naming_it(tmp_path):
    r = _serve_with_backends(tmp_path, "UCX,NOSUCHBACKEND")
    # A name NIXL has no plugin for is a configuration error: exit 64
    # (EX_USAGE; systemd's RestartPreventExitStatus), naming the setting.
    assert r.returncode == 64, r.stdout + r.stderr
    assert "invalid setting: backends" in r.stderr and "NOSUCHBACKEND" in r.stderr
    assert not (tmp_path / "s.sock").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".s.sock.")]  # nor the private directory
    assert "did you mean" not in r.stderr, r.stderr  # nothing near NOSUCHBACKEND


def test_a_misspelt_backend_gets_the_plugin_it_is_closest_to(tmp_path):
    r = _serve_with_backends(tmp_path, "UXC")
    assert r.returncode == 64, r.stdout + r.stderr
    assert "NIXL backend 'UXC' is not available" in r.stderr and "; did you mean 'UCX'?" in r.stderr, r.stderr


def test_backend_list_from_config_is_used(tmp_path):
    from kvd.testing.daemons import start_daemon

    d = start_daemon(str(tmp_path), "posix", "--backends", "UCX,POSIX")
    try:
        assert "UCX,POSIX" in d.log()
    finally:
        assert d.stop() == 0


_AGENT_AS_NOBODY = r"""
import os
from kvd.core import nixl_agent as na
na._nixl()  # imported while this process may read the checkout and the venv
os.setgroups([]); os.setgid(65534); os.setuid(65534)
try:
    na.NixlAgent("home-check")
    print("made")
except na.NixlError as e:
    print("NixlError", e)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="becomes uid 65534 (needs root)")
def test_a_home_this_user_may_not_read_is_named_when_nixl_cannot_start(tmp_path):
    """NIXL stats $HOME/.nixl.cfg when it makes an agent: a HOME inherited
    from another user (here a 0700 directory of root's, as with sudo -E)
    fails it with only "filesystem error: status: Permission denied"; kvd's
    error names HOME and what to do."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    r = subprocess.run([sys.executable, "-c", _AGENT_AS_NOBODY], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "HOME": str(home)})
    assert r.stdout.startswith("NixlError NIXL could not make an agent: "), (r.stdout, r.stderr[-2000:])
    assert f"from $HOME ({home}), which this user (uid 65534) may not read" in r.stdout, r.stdout
