"""Startup refusals that protect the operator's files and name the setting."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest


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


# ------------------------------------------------- bad TLS files (exit 64)
def _tls_case(tmp_path, which):
    from kvd.testing.security import Pki

    pki = Pki(str(tmp_path / "pki"))
    cert, key = pki.issue("node-a")
    _, other_key = pki.issue("node-b")
    bad = tmp_path / "bad.pem"
    bad.write_text("not a PEM file\n")
    files = {"cert": cert, "key": key, "ca": pki.ca}
    if which == "all-bad":
        files = {"cert": str(bad), "key": str(bad), "ca": str(bad)}
    elif which == "other-key":
        files["key"] = other_key
    elif which == "key-as-ca":
        files["ca"] = key
    elif which == "cert-as-key":
        files["key"] = cert
    elif which == "other-ca":
        other = Pki(str(tmp_path / "pki-other"))  # a valid CA, but not the one that signed node-a
        files["ca"] = other.ca
    return ("--peer-tls-cert", files["cert"], "--peer-tls-key", files["key"], "--peer-tls-ca", files["ca"])


@pytest.mark.parametrize("which, setting, words", [
    ("all-bad", "peer_tls_cert", "no PEM certificate"),
    ("other-key", "peer_tls_key", "not the private key of peer_tls_cert"),
    ("key-as-ca", "peer_tls_ca", "no PEM CA certificate"),
    ("cert-as-key", "peer_tls_key", "no usable PEM private key"),
    ("other-ca", "peer_tls_cert", "does not verify against peer_tls_ca"),
])
def test_unusable_tls_files_are_a_config_error_naming_the_setting(tmp_path, which, setting, words):
    r = _serve("--engine-socket", str(tmp_path / "k.sock"), *_tls_case(tmp_path, which))
    out = r.stderr + r.stdout
    assert r.returncode == 64, out
    assert f"invalid setting: {setting}" in out and words in out, out
    assert "Failed to bind" not in out and "startup failed" not in out, out
    assert not (tmp_path / "k.sock").exists()


# ------------------------------- a failed startup releases what it made
def _leftovers(d):
    return sorted(n for n in os.listdir(d) if n.startswith(".k.sock.") or n == "k.sock")


@pytest.mark.parametrize("host_flag", ["127.0.0.1", "198.51.100.254"])
def test_a_failed_metrics_bind_leaves_nothing_behind_and_no_tracebacks(tmp_path, host_flag):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    made = tmp_path / "new"  # the daemon makes the socket's directories: a failed startup removes them
    try:
        r = _serve("--engine-socket", str(made / "run" / "k.sock"), "--metrics-port", str(port),
                   "--metrics-host", host_flag)
    finally:
        s.close()
    out = r.stderr + r.stdout
    # Busy port or foreign address: the host's state, not a bad setting (exit 1, systemd retries).
    assert r.returncode == 1, out
    key = "metrics_port" if host_flag == "127.0.0.1" else "metrics_host"
    assert f"startup failed: {key}: cannot serve metrics" in out, out
    assert ("give each daemon its own --metrics-port" in out) == (key == "metrics_port"), out  # the hint: in use only
    assert "Traceback" not in out and "Exception ignored" not in out, out
    assert "engine_socket: created directory" in out, out
    assert f"engine_socket: removed directory {made}" in out, out  # said, as its making was
    # The cause first, then what followed from it (the log of a new user's
    # trial read "removed directory" before the error that caused it).
    assert out.index("startup failed") < out.index("removed directory"), out
    assert out.count("startup failed") == 1, out
    assert not made.exists(), list(made.rglob("*"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_daemon_leaves_no_empty_directory_it_made(tmp_path, sig):
    """As a failed startup: the socket directories the daemon made go at a
    clean stop (an operator found them left behind); exit 0."""
    import time

    made = tmp_path / "new"
    sock = made / "run" / "k.sock"
    proc = subprocess.Popen([sys.executable, "-m", "kvd.cli", "serve", "--peer-listen", "127.0.0.1:0",
                             "--engine-socket", str(sock)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sock.exists(), proc.communicate(timeout=10)[0] if proc.poll() is not None else "no socket"
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "engine_socket: created directory" in out and "kvd stopped" in out, out
    # "stopped" is the last line: after the directories it made are gone.
    assert out.index("engine_socket: removed directory") < out.index("kvd stopped"), out
    assert not made.exists(), list(made.rglob("*"))


STOP_WHILE_STARTING = """
import os, signal, sys
from kvd.daemon import local_gate

made = local_gate.Gate.open

async def open_then_stop(self):
    await made(self)
    os.kill(os.getpid(), int(sys.argv[2]))  # a stop asked the moment the engine socket exists

local_gate.Gate.open = open_then_stop
from kvd.cli import main
sys.exit(main(["serve", "--peer-listen", "127.0.0.1:0", "--engine-socket", sys.argv[1]]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_asked_while_the_daemon_starts_stops_it_once_started(tmp_path, sig):
    """SIGTERM or SIGINT between the engine socket's creation and the end of
    startup: the daemon finishes starting, then stops as at any other time
    (exit 0, its sockets and directories gone). Before, its handlers came
    last: SIGTERM killed it with everything left, and a SIGINT, ignored in a
    process a shell without job control starts in the background, was lost
    (a fresh clone's ``test_a_stopped_daemon_leaves_no_empty_directory_it_made``
    waited 60 s on a daemon serving on)."""
    sock = tmp_path / "new" / "run" / "k.sock"
    r = subprocess.run([sys.executable, "-c", STOP_WHILE_STARTING, str(sock), str(int(sig))], capture_output=True,
                       text=True, timeout=60, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    out = r.stdout + r.stderr
    assert r.returncode == 0, (r.returncode, out)
    _said_stopped_during_startup(out, sig)
    assert not (tmp_path / "new").exists(), list((tmp_path / "new").rglob("*"))


def _said_stopped_during_startup(out: str, sig) -> None:
    """The log of a daemon stopped by ``sig`` during its startup says, in
    order: the stop was noted during startup, the daemon started and stops
    now (not that it is serving), it stopped. Before, "shutting down" came
    first and "kvd ... serving" after it, as if it served on."""
    noted = f"received {sig.name} during startup: stopping once started (grace "
    started = f"started, and stops now ({sig.name} received during startup): engines on unix:"
    assert noted in out and started in out and "kvd stopped" in out, out
    assert out.index(noted) < out.index(started) < out.index("kvd stopped"), out
    assert " serving: " not in out and "shutting down" not in out, out

STOP_WHILE_LOADING = """
import os, signal, sys, weakref
from kvd import config

read = config.load_config

def read_then_stop(*a, **k):
    # The stop lands inside a weakref callback, as the import system's own
    # (importlib's module-lock callback) where Python drops an exception:
    # what lost a KeyboardInterrupt while kvd serve imported its modules.
    class Box:
        pass

    box = Box()
    ref = weakref.ref(box, lambda _: os.kill(os.getpid(), int(sys.argv[2])))
    del box
    return read(*a, **k)

config.load_config = read_then_stop
from kvd.cli import main
sys.exit(main(["serve", "--peer-listen", "127.0.0.1:0", "--engine-socket", sys.argv[1]]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_asked_while_the_daemon_loads_its_modules_stops_it_once_started(tmp_path, sig):
    """SIGTERM or SIGINT before the event loop runs (``kvd serve`` reads its
    settings and imports gRPC, NIXL, numpy): noted, then acted on once
    started (exit 0, nothing left). Before, SIGTERM killed the process
    (-15), and a SIGINT whose KeyboardInterrupt was raised inside a weakref
    callback was dropped ("Exception ignored"): that daemon served on."""
    sock = tmp_path / "new" / "run" / "k.sock"
    r = subprocess.run([sys.executable, "-c", STOP_WHILE_LOADING, str(sock), str(int(sig))], capture_output=True,
                       text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 0, (r.returncode, out)
    _said_stopped_during_startup(out, sig)
    assert "Exception ignored" not in out, out
    assert not (tmp_path / "new").exists(), list((tmp_path / "new").rglob("*"))


def test_a_stopped_daemon_keeps_a_directory_it_made_where_others_may_write(tmp_path):
    """A socket directory the daemon made in a directory every user may
    write (``/tmp/kvd``) stays at its stop: removed, another user could make
    it in the gap and the restarted daemon would refuse it as theirs. The
    restart serves there."""
    import time

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    sock = shared / "kvd" / "k.sock"
    outs = []
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, "-m", "kvd.cli", "serve", "--peer-listen", "127.0.0.1:0",
                                 "--engine-socket", str(sock)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        try:
            deadline = time.monotonic() + 60
            while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sock.exists(), proc.communicate(timeout=10)[0] if proc.poll() is not None else "no socket"
            proc.send_signal(signal.SIGTERM)
            outs.append(proc.communicate(timeout=60)[0])
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, outs[-1]
    assert f"engine_socket: kept directory {shared / 'kvd'}" in outs[0], outs[0]
    assert "removed directory" not in outs[0] and "created directory" not in outs[1], outs
    assert (shared / "kvd").is_dir() and not sock.exists(), list(shared.rglob("*"))


def test_a_failed_startup_keeps_a_directory_it_made_once_something_else_is_in_it(tmp_path):
    from kvd.daemon.server import make_socket_dir, remove_made_dirs

    sock = tmp_path / "a" / "b" / "k.sock"
    top = make_socket_dir(str(sock))
    assert top == str(tmp_path / "a") and make_socket_dir(str(sock)) is None
    (tmp_path / "a" / "other").write_text("x")  # put there meanwhile: a and its file stay, b goes
    remove_made_dirs(top, str(sock.parent))
    assert not sock.parent.exists() and (tmp_path / "a" / "other").exists()


def test_a_live_daemons_socket_survives_a_second_daemons_failed_startup(tmp_path):
    from kvd.testing.daemons import start_daemon

    d = start_daemon(str(tmp_path), "k")
    try:
        r = _serve("--engine-socket", d.socket)
        out = r.stderr + r.stdout
        assert r.returncode == 1 and "another daemon is serving" in out, out
        assert "Traceback" not in out and "Exception ignored" not in out, out
        assert os.path.exists(d.socket) and d.stats()
        assert len([n for n in os.listdir(tmp_path) if n.startswith(".k.sock.")]) == 1  # the live one's
    finally:
        assert d.stop() == 0


def test_a_socket_nothing_listens_on_is_replaced_and_said(tmp_path):
    """A daemon killed without its cleanup (SIGKILL) leaves its engine socket:
    the next one takes the path over, and says so."""
    import socket

    from kvd.testing.daemons import start_daemon

    left = socket.socket(socket.AF_UNIX)
    left.bind(str(tmp_path / "k.sock"))
    left.close()  # a socket file nothing listens on
    d = start_daemon(str(tmp_path), "k")
    try:
        assert d.socket == str(tmp_path / "k.sock") and d.stats()
        assert f"engine_socket: replaced {d.socket}, left by a daemon that stopped without removing it" in d.log()
    finally:
        assert d.stop() == 0


# ------------------------------- wildcard peer_listen: a routable advertisement
def test_a_wildcard_peer_listen_advertises_a_routable_address_with_a_warning(tmp_path):
    from kvd.testing.daemons import start_daemon
    from kvd.daemon.server import routable_address

    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
    d = start_daemon(str(tmp_path), "k", "--peer-listen", "0.0.0.0:0", "--peer-token-file", str(token))
    try:
        adv = d.stats().peer_address
        host, port = adv.rsplit(":", 1)
        assert adv == routable_address(int(port))
        if any(not a.startswith("127.") for a in _host_addresses()):
            assert not host.startswith("127."), adv
        log = d.log()
        assert "WARNING" in log and f"advertising {adv}" in log and "peer_advertise" in log, log[-3000:]
    finally:
        assert d.stop() == 0


def _host_addresses():
    try:
        return [i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        return []


def test_routable_address_falls_back_to_the_host_name_then_loopback(monkeypatch):
    from kvd.daemon import server

    class NoRoute:
        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def connect(self, addr):
            raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(server.socket, "socket", NoRoute)
    monkeypatch.setattr(server.socket, "getaddrinfo",
                        lambda *a, **k: [(socket.AF_INET, 1, 6, "", ("127.0.1.1", 0)),
                                         (socket.AF_INET, 1, 6, "", ("10.1.2.3", 0))])
    assert server.routable_address(7700) == "10.1.2.3:7700"
    monkeypatch.setattr(server.socket, "getaddrinfo", lambda *a, **k: [(socket.AF_INET, 1, 6, "", ("127.0.1.1", 0))])
    assert server.routable_address(7700) == "127.0.0.1:7700"


def test_an_explicit_peer_advertise_is_used_without_a_warning(tmp_path):
    from kvd.testing.daemons import start_daemon

    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
    d = start_daemon(str(tmp_path), "k", "--peer-listen", "0.0.0.0:0", "--peer-token-file", str(token),
                     "--peer-advertise", "node-a.example:7700")
    try:
        assert d.stats().peer_address == "node-a.example:7700"
        assert "advertising" not in d.log()
        # A name with a token and no TLS: said once (the token proves the daemon, not the connection).
        assert "peer_advertise node-a.example:7700 is a host name" in d.log()
    finally:
        assert d.stop() == 0
    d = start_daemon(str(tmp_path), "k2", "--peer-listen", "127.0.0.1:0", "--peer-token-file", str(token))
    try:
        assert "is a host name" not in d.log()  # an IP: nothing to say
    finally:
        assert d.stop() == 0


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_an_ipv6_peer_listen_is_advertised_in_brackets_and_dialable(tmp_path):
    """"[::1]:port", not "::1:port": the address kv_transfer_params carry and
    `kvd health --address` takes (an operator found the brackets dropped)."""
    from kvd.testing.daemons import start_daemon

    d = start_daemon(str(tmp_path), "k", "--peer-listen", "[::1]:0")
    try:
        adv = d.stats().peer_address
        assert adv.startswith("[::1]:") and int(adv.rsplit(":", 1)[1]) > 0, adv
        assert f"peers on {adv}" in d.log(), d.log()[-2000:]
        r = subprocess.run([sys.executable, "-m", "kvd.cli", "health", "--address", adv, "--timeout", "10"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    finally:
        assert d.stop() == 0


# ------------------------------------------------------------- SIGHUP
def test_sighup_is_logged_and_the_daemon_keeps_serving_also_after_a_registration(tmp_path):
    from kvd.testing.daemons import start_daemon
    from kvd.testing.sessions import KvShape, register_request
    from kvd.testing.shm import ShmSegment
    from kvd.testing.util import wait_until

    d = start_daemon(str(tmp_path), "k")
    shape = KvShape(num_layers=1, num_blocks=8, block_len=1024)
    seg = ShmSegment(shape.size)
    try:
        msg = "SIGHUP: kvd has no reload; settings change on restart"
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: d.log().count(msg) == 1, 10, "the SIGHUP warning")
        # A registration makes a NIXL agent (UCX may install signal handlers then).
        d.stub().RegisterEngine(register_request("e", shape, seg), timeout=30)
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: d.log().count(msg) == 2, 10, "the SIGHUP warning after a registration")
        assert d.proc.poll() is None and d.stats()
        assert "WARNING" in [l for l in d.log().splitlines() if msg in l][-1]
    finally:
        rc = d.stop()
        seg.close()
    assert rc == 0


def test_a_peer_port_in_use_names_peer_listen_and_the_reason(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "kvd.cli", "serve", "--peer-listen", f"127.0.0.1:{port}",
                            "--engine-socket", str(tmp_path / "k.sock")], capture_output=True, text=True, timeout=60)
    finally:
        s.close()
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert f"peer_listen: cannot bind PeerService to 127.0.0.1:{port}: Address already in use" in r.stderr
    assert "give this one its own port: --peer-listen HOST:PORT, port 0 picks one" in r.stderr
    assert "Traceback" not in r.stderr
    assert "Failed to add port" not in r.stderr, r.stderr  # gRPC's own line, before kvd's


def test_a_name_of_several_addresses_is_in_use_when_any_of_them_is(monkeypatch):
    """``localhost`` resolves to ::1 and 127.0.0.1 on many hosts (one here):
    gRPC binds each it can, so a listener on one of them shared the port
    with the daemon (attacker review); the check refuses that, and skips an
    address this host lacks while another binds."""
    from kvd.daemon.server import bind_failure

    squatter = socket.socket(socket.AF_INET6)
    squatter.bind(("::1", 0))
    squatter.listen(1)
    port = squatter.getsockname()[1]
    real = socket.getaddrinfo

    def both(host, p, *a, **k):  # as /etc/hosts with "::1 localhost" and "127.0.0.1 localhost"
        return real("127.0.0.1", p, *a, **k) + real("::1", p, *a, **k)

    def lacking(host, p, *a, **k):  # 192.0.2.1 (TEST-NET-1) is on no interface here
        return real("192.0.2.1", p, *a, **k) + real("127.0.0.1", p, *a, **k)

    try:
        monkeypatch.setattr(socket, "getaddrinfo", both)
        assert bind_failure("localhost", port) == "Address already in use"
        monkeypatch.setattr(socket, "getaddrinfo", lacking)
        assert bind_failure("localhost", port) is None
        monkeypatch.setattr(socket, "getaddrinfo", lambda h, p, *a, **k: real("192.0.2.1", p, *a, **k))
        assert bind_failure("localhost", port) == "Cannot assign requested address"
    finally:
        squatter.close()


def test_an_engine_socket_directory_this_user_may_not_make_says_what_to_give_instead():
    """A user's `kvd serve` with the default /run/kvd/engine.sock cannot make
    /run/kvd: the error says which setting to give instead. As root, /sys
    refuses the directory the same way (EPERM; EACCES for other users)."""
    r = _serve("--engine-socket", "/sys/kvdtest/engine.sock")
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "engine_socket: cannot create directory /sys/kvdtest: " in r.stderr, r.stderr[-2000:]
    assert (" (give this daemon --engine-socket in a directory this user may write, e.g. "
            "$XDG_RUNTIME_DIR/kvd/engine.sock, or create /sys/kvdtest for it as root)") in r.stderr, r.stderr[-2000:]
    assert not os.path.exists("/sys/kvdtest")


def test_an_engine_socket_under_a_file_names_the_setting_and_the_parent(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    r = _serve("--engine-socket", str(afile / "engine.sock"))
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert f"engine_socket: {afile} is not a directory (on the way to {afile}/engine.sock)" in r.stderr
    assert afile.read_text() == "x\n"
    # Deeper: the file in the way is named, not the directory that was to be made under it.
    r = _serve("--engine-socket", str(afile / "sub" / "engine.sock"))
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert f"engine_socket: {afile} is not a directory (on the way to {afile}/sub/engine.sock)" in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_an_engine_socket_directory_of_another_user_is_refused(tmp_path):
    """A directory that belongs to another user (not root, not the daemon's
    uid): that user could remove or replace the daemon's sockets in it, and
    an attacker review had a root daemon bind in a squatter's ``/tmp/kvd``.
    Refused at startup, exit 1, nothing bound there."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    r = _serve("--engine-socket", str(theirs / "engine.sock"))
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert f"engine_socket: {theirs} belongs to uid 65534, neither root nor this daemon's uid" in r.stderr, r.stderr
    assert list(theirs.iterdir()) == []


def test_an_engine_socket_directory_where_nothing_can_be_created_names_the_setting():
    # /proc refuses new entries even to root (a read-only directory would not stop root);
    # the error names the setting and the directory, not the gate's private temp directory.
    r = _serve("--engine-socket", "/proc/kvd-engine.sock")
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "engine_socket: cannot create the socket in /proc: " in r.stderr, r.stderr[-2000:]
    assert ".kvd-engine.sock." not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("mode, foreign_group, warned", [
    (0o644, False, True), (0o604, False, True), (0o640, True, True),
    (0o640, False, False),  # the daemon's own group: the DaemonSet's Secret (0440, fsGroup)
    (0o600, False, False), (0o400, False, False)])
def test_a_peer_token_file_readable_by_group_or_other_is_warned_about(tmp_path, mode, foreign_group, warned):
    from kvd.config import load_config
    from kvd.daemon.peer_auth import secret_file_warnings

    token = tmp_path / "peer.token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
    if foreign_group:
        if os.geteuid() != 0:
            pytest.skip("giving a file another group needs root")
        os.chown(token, -1, os.getegid() + 1 if os.getegid() < 65534 else 0)
    token.chmod(mode)
    w = secret_file_warnings(load_config({"peer_token_file": str(token)}, environ={}))
    assert bool(w) is warned, w
    if warned:
        assert str(token) in w[0] and f"mode {mode:04o}" in w[0] and "peer_token_file" in w[0]


def test_the_daemon_logs_the_token_file_warning_at_startup_and_serves(tmp_path):
    from kvd.testing.daemons import start_daemon

    token = tmp_path / "peer.token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
    token.chmod(0o644)
    d = start_daemon(str(tmp_path), "k", "--peer-token-file", str(token))
    try:
        assert d.stats().engines == 0  # serving: a warning, not a refusal
        log = d.log()
        warning = log.index(f"WARNING kvd.server: peer_token_file: {token} is mode 0644")
        assert warning < log.index(" serving: engines on"), "warned after the serving line"
    finally:
        assert d.stop() == 0


def test_an_engine_socket_directory_the_daemon_makes_is_logged_with_its_mode(tmp_path, caplog):
    import logging

    from kvd.daemon.server import make_socket_dir

    sock = tmp_path / "run" / "kvd" / "engine.sock"
    with caplog.at_level(logging.INFO, logger="kvd.server"):
        make_socket_dir(str(sock))
        make_socket_dir(str(sock))  # there already: nothing to say
    made = [r.getMessage() for r in caplog.records if "created directory" in r.getMessage()]
    mode = os.stat(tmp_path / "run").st_mode & 0o777
    assert made == [f"engine_socket: created directory {sock.parent} (from {tmp_path / 'run'} down) (mode "
                    f"{mode:04o}, uid {os.getuid()}, gid {os.getgid()})"], made


def test_a_stop_during_startup_still_tells_systemd_ready_then_stopping_with_a_status_that_says_so(tmp_path):
    """systemd fails a Type=notify unit whose main process exits before
    READY=1 (result 'protocol'; Restart=on-failure would then start it
    again): READY=1 is sent, its STATUS saying the daemon stops, then
    STOPPING=1; exit 0."""
    path = str(tmp_path / "notify.sock")
    sock = tmp_path / "new" / "run" / "k.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(path)
        systemd.settimeout(30)
        r = subprocess.run([sys.executable, "-c", STOP_WHILE_STARTING, str(sock), str(int(signal.SIGTERM))],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "NOTIFY_SOCKET": path})
        got = [dict(line.split("=", 1) for line in systemd.recv(4096).decode().splitlines()) for _ in range(2)]
    assert r.returncode == 0, (r.returncode, r.stdout + r.stderr)
    assert got[0]["READY"] == "1" and got[0]["STATUS"] == "started; stopping (SIGTERM received during startup)", got
    assert got[1]["STOPPING"] == "1", got


@pytest.mark.parametrize("listen, flags, said", [
    ("0.0.0.0:0", ("--peer-insecure", "true"), "authentication: none, peer_insecure = true)"),
    ("0.0.0.0:0", (), "authentication: none, loopback only)"),  # no authentication: bound to loopback instead
])
def test_the_serving_line_tells_insecure_peers_from_loopback_only(tmp_path, listen, flags, said):
    """Both had "authentication: none": the line now says whether any host
    that reaches the peer port may call (peer_insecure) or loopback only."""
    from kvd.testing.daemons import start_daemon

    d = start_daemon(str(tmp_path), "k", "--peer-listen", listen, *flags)
    try:
        assert said in d.log(), d.log()[-3000:]
    finally:
        assert d.stop() == 0
