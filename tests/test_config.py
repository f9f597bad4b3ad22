"""Settings: flags > KVD_* environment > TOML file > defaults; a bad value is
a startup error naming the key (exit 64); --print-config shows the result."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

from kvd.config import Config, ConfigError, load_config, setting_names

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _file(tmp_path, text: str) -> str:
    p = tmp_path / "kvd.toml"
    p.write_text(text)
    return str(p)


def test_each_source_overrides_the_ones_below_it(tmp_path):
    path = _file(tmp_path, 'lease_s = 50\nlog_level = "warning"\nbackends = ["UCX", "POSIX"]\n')
    env = {"KVD_LEASE_S": "60", "KVD_LOG_LEVEL": "error"}

    assert load_config(environ={}).lease_s == Config().lease_s == 120.0
    assert load_config(environ={}, file=path).lease_s == 50.0
    cfg = load_config(environ=env, file=path)
    assert (cfg.lease_s, cfg.log_level, cfg.backends) == (60.0, "error", ["UCX", "POSIX"])
    cfg = load_config({"lease_s": "70"}, environ=env, file=path)
    assert (cfg.lease_s, cfg.log_level) == (70.0, "error")
    assert cfg.sources["lease_s"] == "flag --lease-s"
    assert cfg.sources["log_level"] == "env KVD_LOG_LEVEL"
    assert cfg.sources["backends"] == f"file {path}"
    assert cfg.sources["grace_s"] == "default"


def test_env_names_the_file_and_lists_are_comma_separated(tmp_path):
    path = _file(tmp_path, "metrics_port = 9400\n")
    cfg = load_config(environ={"KVD_CONFIG": path, "KVD_BACKENDS": "UCX, GDS"})
    assert cfg.metrics_port == 9400 and cfg.backends == ["UCX", "GDS"]
    # --config wins over KVD_CONFIG.
    other = tmp_path / "other.toml"
    other.write_text("metrics_port = 9500\n")
    assert load_config(environ={"KVD_CONFIG": path}, file=str(other)).metrics_port == 9500


def test_notify_socket_comes_from_systemd_not_from_settings():
    cfg = load_config(environ={"NOTIFY_SOCKET": "@sd"})
    assert cfg.notify_socket == "@sd"
    assert "notify_socket" not in setting_names()


@pytest.mark.parametrize("text, words", [
    ("lease = 5\n", ["lease (from file", "unknown setting", "did you mean lease_s?"]),
    ("leese_s = 5\n", ["leese_s (from file", "unknown setting; did you mean lease_s?"]),
    ('[kvd]\nlease_s = 5\n', ["kvd (from file", "no tables"]),
    ('metrics_port = "9400"\n', ["metrics_port (from file", "expected an integer"]),
    ("lease_s = true\n", ["lease_s (from file", "expected a number"]),
    ('follow_holds = "true"\n', ["follow_holds (from file", "expected true or false", "without quotes"]),
    ('backends = "UCX"\n', ["backends (from file", "array of strings"]),
    ("lease_s = -1\n", ["lease_s (from file", "> 0"]),
    ("lease_s = inf\n", ["lease_s (from file", "finite"]),
    ('log_level = "loud"\n', ["log_level (from file", "debug | info"]),
    ('peer_listen = "nohost"\n', ["peer_listen (from file", "host:port"]),
    ("metrics_port = 70000\n", ["metrics_port (from file", "out of range"]),
    ("lease_s = \n", ["config file", "line 1"]),
])
def test_bad_file_values_name_the_key(tmp_path, text, words):
    with pytest.raises(ConfigError) as e:
        load_config(environ={}, file=_file(tmp_path, text))
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("env, words", [
    ({"KVD_GRACE_S": "soon"}, ["grace_s (from env KVD_GRACE_S)", "expected a number", "'soon'"]),
    ({"KVD_METRICS_PORT": "9.5"}, ["metrics_port (from env KVD_METRICS_PORT)", "integer"]),
    ({"KVD_LOG_FORMAT": "xml"}, ["log_format (from env KVD_LOG_FORMAT)", "human | json"]),
    ({"KVD_BACKENDS": " , "}, ["backends (from env KVD_BACKENDS)"]),
    ({"KVD_TRANSFER_TIMEOUT_S": "nan"}, ["transfer_timeout_s (from env", "finite"]),
    ({"KVD_POLL_BUSY_S": "0"}, ["poll_busy_s (from env KVD_POLL_BUSY_S)", "(0, 1]"]),
    ({"KVD_POLL_IDLE_S": "5"}, ["poll_idle_s (from env KVD_POLL_IDLE_S)", "(0, 1]"]),
    ({"KVD_STALL_DUMP_S": "-1"}, ["stall_dump_s (from env KVD_STALL_DUMP_S)", ">= 0"]),
    ({"KVD_WARM_PEERS": "10.0.0.5:0/prefill-a"}, ["warm_peers (from env KVD_WARM_PEERS)", "port 0 names no daemon"]),
    ({"KVD_WARM_PEERS": "10.0.0.5:7700/"}, ["warm_peers (from env KVD_WARM_PEERS)", "host:port/engine_id"]),
    ({"KVD_WARM_PEERS": "foo"}, ["warm_peers (from env KVD_WARM_PEERS)", "'foo' is not host:port/engine_id"]),
    ({"KVD_WARM_PEERS": "h:x/p"}, ["warm_peers (from env KVD_WARM_PEERS)", "'h:x/p': port 'x' is not a number"]),
])
def test_bad_env_values_name_the_variable(env, words):
    with pytest.raises(ConfigError) as e:
        load_config(environ=env)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="config file .*missing.toml"):
        load_config(environ={}, file=str(tmp_path / "missing.toml"))


def test_a_file_setting_that_is_no_regular_file_is_refused_at_once_not_waited_on(tmp_path):
    from kvd.config import read_regular

    fifo = str(tmp_path / "token.fifo")
    os.mkfifo(fifo)
    # A FIFO nobody writes: refused after the wait, not blocking for ever.
    with pytest.raises(OSError, match="FIFO that did not end within 0.2 s"):
        read_regular(fifo, fifo_wait_s=0.2)
    for path, words in ((str(tmp_path), "a directory"), ("/dev/null", "a device")):
        with pytest.raises(OSError, match=words):
            read_regular(path)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 101)
    with pytest.raises(OSError, match="larger than 100 bytes"):
        read_regular(str(big), limit=100)
    assert read_regular(str(big), limit=101) == b"x" * 101
    # A FIFO whose writer ends in time (a shell's --config <(...)) is read.
    w = subprocess.Popen(["sh", "-c", f"sleep 0.2; printf 'lease_s = 9' > {fifo}"])
    assert load_config(environ={}, file=fifo).lease_s == 9.0
    w.wait(10)
    r = _kvd("serve", "--print-config", "--peer-token-file", str(tmp_path))
    assert r.returncode == 64 and "peer_token_file" in r.stderr and "a directory, not a regular file" in r.stderr


@pytest.mark.parametrize("text, words", [
    ('lease_s = 5\nengine_socket = /run/kvd/engine.sock\n',
     "Invalid value (at line 2, column 17): engine_socket = /run/kvd/engine.sock (TOML strings need quotes)"),
    ('log_level = debug\n', "Invalid value (at line 1, column 13): log_level = debug (TOML strings need quotes)"),
    ('lease_s = 5\n  grace_s = 3 3\n',
     "Expected newline or end of document after a statement (at line 2, column 15): grace_s = 3 3"),
])
def test_invalid_toml_names_the_line_and_an_unquoted_string(tmp_path, text, words):
    """tomllib says where (line, column), not what: the message quotes the
    line, and for its "Invalid value" names the usual cause (an unquoted
    string)."""
    path = _file(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(environ={}, file=path)
    assert str(e.value) == f"config file {path}: {words}", str(e.value)
    r = _kvd("serve", "--config", path, "--print-config")
    assert r.returncode == 64 and r.stderr == f"kvd serve: invalid setting: {e.value}\n", r.stderr


def test_a_socket_given_as_the_config_file_is_named_a_socket(tmp_path):
    """open(2) of a Unix socket fails ENXIO ("No such device or address"):
    the message says what the path is."""
    import socket

    path = str(tmp_path / "kvd.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        with pytest.raises(ConfigError) as e:
            load_config(environ={}, file=path)
        assert str(e.value) == f"config file {path}: a socket, not a config file", str(e.value)
        from kvd.config import read_regular

        with pytest.raises(OSError) as oe:
            read_regular(path)
        assert oe.value.strerror == "a socket, not a regular file", oe.value


def _kvd(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvd.cli", *args], capture_output=True, text=True, timeout=60,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("KVD_")}, **(env or {})})


def test_print_config_shows_the_effective_settings_and_their_sources(tmp_path):
    path = _file(tmp_path, 'lease_s = 50\ngrace_s = 3\npeer_listen = "0.0.0.0:7700"\n')
    r = _kvd("serve", "--config", path, "--print-config", "--grace-s", "4", env={"KVD_LEASE_S": "60"})
    assert r.returncode == 0, r.stderr
    doc = tomllib.loads(r.stdout)
    assert set(doc) == set(setting_names())
    assert (doc["lease_s"], doc["grace_s"], doc["peer_listen"]) == (60.0, 4.0, "0.0.0.0:7700")
    assert doc["engine_socket"] == "/run/kvd/engine.sock"
    assert "lease_s = 60.0  # env KVD_LEASE_S" in r.stdout
    assert "grace_s = 4.0  # flag --grace-s" in r.stdout
    assert f'peer_listen = "0.0.0.0:7700"  # file {path}' in r.stdout
    # What it prints is a valid config file that gives the same settings.
    again = _file(tmp_path, r.stdout)
    assert load_config(environ={}, file=again) == load_config({"grace_s": "4"}, {"KVD_LEASE_S": "60"}, path)


@pytest.mark.parametrize("args, env, key", [
    (["--lease-s", "abc"], {}, "lease_s (from flag --lease-s)"),
    (["--log-level", "loud"], {}, "log_level (from flag --log-level)"),
    ([], {"KVD_METRICS_PORT": "x"}, "metrics_port (from env KVD_METRICS_PORT)"),
    (["--engine-socket", "/tmp/" + "s" * 120], {}, "engine_socket (from flag --engine-socket)"),
])
def test_serve_with_a_bad_value_exits_64_naming_the_key(args, env, key):
    r = _kvd("serve", *args, env=env)
    assert r.returncode == 64, (r.returncode, r.stderr)
    assert key in r.stderr and "invalid setting" in r.stderr


def test_serve_with_a_bad_file_exits_64(tmp_path):
    r = _kvd("serve", "--config", _file(tmp_path, "leese_s = 1\n"), "--print-config")
    assert r.returncode == 64 and "leese_s" in r.stderr


def test_a_value_nested_too_deep_is_an_error_not_a_traceback(tmp_path):
    """A file's array nested 400 levels ended in a RecursionError traceback
    (exit 1) while its error quoted it, and 600 levels inside tomllib
    (attacker review): the first error quotes it cut, the second says what
    is wrong; both exit 64."""
    with pytest.raises(ConfigError) as e:
        load_config(environ={}, file=_file(tmp_path, "max_workers = " + "[" * 400 + "]" * 400 + "\n"))
    assert "max_workers (from file" in str(e.value) and "[[[[[[[[[...]]]]]]]]]" in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(environ={}, file=_file(tmp_path, "allowed_uids = [" + '"u", ' * 100_000 + "[1]]\n"))
    assert len(str(e.value)) < 600 and "...(" in str(e.value), str(e.value)[:300]
    deep = _file(tmp_path, "a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(environ={}, file=deep)
    assert "nested too deeply" in str(e.value)
    r = _kvd("serve", "--config", deep, "--print-config")
    assert r.returncode == 64 and "nested too deeply" in r.stderr and "Traceback" not in r.stderr, r.stderr[-500:]


def test_a_key_of_thousands_of_dotted_parts_is_refused_before_tomllib_reads_it(tmp_path):
    """tomllib's memory grows with the square of a dotted key's parts: 20,000
    parts (a 40 KB file) took 1.6 GB and 6 s, 40,000 a MemoryError traceback
    (attacker review). Such a line is refused first, naming it."""
    text = "lease_s = 5\nengine_socket." + ".".join(["a"] * 40_000) + " = 1\n"
    # The message is the check's own: tomllib never saw the text.
    with pytest.raises(ConfigError, match="line 2: a key of 40001 dotted parts"):
        load_config(environ={}, file=_file(tmp_path, text))
    with pytest.raises(ConfigError, match="line 1: a key of 3000 dotted parts"):
        load_config(environ={}, file=_file(tmp_path, "[" + ".".join(["t"] * 3000) + "]\n"))
    # A value's dots (a warm peer's host name) are no key's.
    cfg = load_config(environ={}, file=_file(tmp_path, 'warm_peers = ["' + "h." * 100 + 'x:7700/p"]\n'))
    assert cfg.warm_peers == ["h." * 100 + "x:7700/p"]


def test_a_settings_error_is_one_line_of_bounded_length_whatever_the_value():
    """An environment value is any length: a 100,000-character
    ``KVD_PEER_LISTEN`` was quoted whole in its error (attacker review).
    Every ``ConfigError`` message is cut at ``MAX_MESSAGE_CHARS``."""
    for env in ({"KVD_PEER_LISTEN": "[" * 100_000}, {"KVD_LOG_LEVEL": "x" * 100_000},
                {"KVD_WARM_PEERS": "y" * 100_000}, {"KVD_LEASE_S": "9" * 100_000 + "z"}):
        with pytest.raises(ConfigError) as e:
            load_config(environ=env)
        key = next(iter(env))
        assert key in str(e.value) and len(str(e.value)) <= ConfigError.MAX_MESSAGE_CHARS + 40, str(e.value)[:200]
        assert "...(" in str(e.value)


def test_a_setting_that_is_not_utf8_is_refused_with_exit_64(tmp_path):
    """An environment or argv value of bytes that are not UTF-8 reached the
    daemon's startup (exit 1, which systemd restarts) or ``--print-config``'s
    output raw, TOML that is not UTF-8 (attacker review): refused as the
    settings are read."""
    with pytest.raises(ConfigError, match="engine_socket .from env KVD_ENGINE_SOCKET.: not UTF-8"):
        load_config(environ={"KVD_ENGINE_SOCKET": "/tmp/\udcff.sock"})
    with pytest.raises(ConfigError, match="backends .from env KVD_BACKENDS.: not UTF-8"):
        load_config(environ={"KVD_BACKENDS": "UCX,\udcff"})
    env = dict(os.environ, KVD_ENGINE_SOCKET=os.fsdecode(str(tmp_path).encode() + b"/\xff.sock"))
    r = subprocess.run([sys.executable, "-m", "kvd.cli", "serve", "--print-config"], capture_output=True,
                       text=True, env=env, timeout=60, errors="replace")
    assert r.returncode == 64 and "not UTF-8" in r.stderr and "Traceback" not in r.stderr, r.stderr[-400:]


FILE_KEYS = ("peer_tls_cert", "peer_tls_key", "peer_tls_ca", "peer_token_file")


def test_every_setting_that_names_a_file_is_checked_for_an_absolute_path():
    """The settings the daemon opens as files are the ones validate() checks;
    a new one (doc saying PEM or file, a name ending in _file) must be marked
    too, else its relative path would be read from / under systemd."""
    from kvd.config import file_settings, settings

    assert tuple(f.name for f in file_settings()) == FILE_KEYS
    for f in settings():
        text = f.metadata["doc"]
        if f.name.endswith(("_file", "_cert", "_key", "_ca")) or text.startswith(("PEM", "file ")):
            assert f in file_settings(), f.name
            assert "an absolute path" in text and f.metadata["file_example"].startswith("/"), f.name


@pytest.mark.parametrize("key", FILE_KEYS)
@pytest.mark.parametrize("how", ["flag", "env", "file"])
def test_a_relative_file_setting_is_refused_naming_its_source(tmp_path, key, how):
    """Under systemd the daemon's working directory is / (systemd.exec,
    WorkingDirectory=): a relative token or PEM path would be opened there,
    not beside the config file or in the shell's directory. Refused (64, not
    retried by the unit's RestartPreventExitStatus) by serve and
    --print-config alike, naming the key, its source and an absolute example."""
    (tmp_path / "secret").write_text("s" * 32 + "\n")  # found from the cwd: still refused
    argv, env = ["serve", "--engine-socket", str(tmp_path / "k.sock")], {}
    if how == "flag":
        argv += [f"--{key.replace('_', '-')}", "secret"]
        where = f"flag --{key.replace('_', '-')}"
    elif how == "env":
        env[f"KVD_{key.upper()}"] = "./secret"
        where = f"env KVD_{key.upper()}"
    else:
        argv += ["--config", _file(tmp_path, f'{key} = "secret"\n')]
        where = f"file {tmp_path / 'kvd.toml'}"
    for extra in (["--print-config"], []):
        r = subprocess.run([sys.executable, "-m", "kvd.cli", *argv, *extra], capture_output=True, text=True,
                           timeout=60, cwd=tmp_path,
                           env={**{k: v for k, v in os.environ.items() if not k.startswith("KVD_")}, **env})
        assert r.returncode == 64, (extra, r.returncode, r.stderr)
        assert f"invalid setting: {key} (from {where}): " in r.stderr, r.stderr
        assert "is a relative path; give an absolute path (such as /etc/kvd/" in r.stderr, r.stderr
        assert "(/ under systemd)" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert r.stdout == "", r.stdout  # --print-config prints no settings it would not run with
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["secret"] + (["kvd.toml"] if how == "file"
                                                                                  else []))


def test_absolute_and_empty_file_settings_pass_validation(tmp_path):
    paths = {k: str(tmp_path / k) for k in FILE_KEYS}
    cfg = load_config(paths, environ={})
    assert {k: getattr(cfg, k) for k in FILE_KEYS} == paths
    assert load_config({"peer_token_file": ""}, environ={}).peer_token_file == ""
    with pytest.raises(ConfigError, match=r"^peer_tls_key \(from flag --peer-tls-key\): 'tls/k.pem' is a relative"):
        load_config({**paths, "peer_tls_key": "tls/k.pem"}, environ={})


def test_the_shipped_example_config_is_valid():
    cfg = load_config(environ={}, file=str(ROOT / "deploy" / "kvd.toml"))
    assert cfg.engine_socket == "/run/kvd/engine.sock"
    assert cfg.metrics_port > 0


def test_the_shipped_example_config_names_every_setting_and_its_commented_defaults_are_true():
    """deploy/kvd.toml lists every setting, set or commented out; a
    commented-out one (other than the examples of an address, a path, a
    group or a peer) shows the built-in default, so uncommenting it changes
    nothing."""
    import re

    text = (ROOT / "deploy" / "kvd.toml").read_text()
    defaults = load_config(environ={})
    examples = {"peer_advertise", "peer_tls_cert", "peer_tls_key", "peer_tls_ca", "peer_token_file", "warm_peers",
                "engine_socket_group", "allowed_gids"}
    for name in setting_names():
        m = re.search(rf"^(# )?{name} = (.*)$", text, re.M)
        assert m, f"deploy/kvd.toml does not name {name}"
        if m.group(1) and name not in examples:
            value = tomllib.loads(f"{name} = {m.group(2)}")[name]
            assert value == getattr(defaults, name), (name, value, getattr(defaults, name))


def test_every_setting_is_documented_with_its_env_variable():
    doc = (ROOT / "docs" / "OPERATIONS.md").read_text()
    for name in setting_names():
        assert f"| `{name}` | `KVD_{name.upper()}` |" in doc, name


def test_a_misspelt_environment_variable_is_reported_not_silently_ignored():
    cfg = load_config(environ={"KVD_LEESE_S": "5", "KVD_TINY_MODEL_DIR": "/x", "KVD_FOO": "1"})
    assert cfg.lease_s == 120.0  # not applied: it is no setting
    assert any("KVD_LEESE_S" in w and "did you mean KVD_LEASE_S" in w for w in cfg.warnings), cfg.warnings
    assert not any("KVD_TINY_MODEL_DIR" in w for w in cfg.warnings)  # a known non-setting variable
    assert any("KVD_FOO" in w and "did you mean" not in w for w in cfg.warnings)
    r = _kvd("serve", "--print-config", env={"KVD_LEESE_S": "5"})
    assert r.returncode == 0 and "did you mean KVD_LEASE_S" in r.stderr


def test_a_per_uid_cap_that_lets_one_uid_take_a_whole_shared_cap_is_warned_about():
    assert load_config(environ={}).warnings == []  # the defaults share
    cfg = load_config(environ={"KVD_MAX_WORKERS_PER_UID": "100", "KVD_MAX_HANDSHAKES_PER_UID": "3000"})
    assert cfg.max_workers_per_uid == 100  # applied: a single-tenant node may want it
    assert any(w.startswith("max_workers_per_uid 100 is more than max_workers 64") for w in cfg.warnings), \
        cfg.warnings
    assert any("max_handshakes_per_uid 3000 is more than half of max_handshakes 4096: one uid's handshakes made "
               "in advance" in w and "at most 2048" in w
               for w in cfg.warnings), cfg.warnings
    assert len(cfg.warnings) == 2
    cfg.validate()  # the daemon validates its config again: still warned once
    assert len(cfg.warnings) == 2
    r = _kvd("serve", "--print-config", env={"KVD_MAX_ABORTS_PER_UID": "2000"})
    assert r.returncode == 0 and "warning: max_aborts_per_uid 2000 is more than max_aborts 1024" in r.stderr, \
        r.stderr

def test_a_daemon_runs_with_the_poll_intervals_given(tmp_path):
    """--poll-busy-s / --poll-idle-s become the core's Limits (a daemon that
    could not build them would not serve) and --print-config shows them."""
    from kvd.testing.daemons import start_daemon

    d = start_daemon(str(tmp_path), "kvd", "--poll-busy-s", "0.0002", "--poll-idle-s", "0.05")
    try:
        assert d.stats().daemon_version
    finally:
        assert d.stop() == 0
    r = subprocess.run([sys.executable, "-m", "kvd.cli", "serve", "--poll-idle-s", "0.05", "--print-config"],
                       capture_output=True, text=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                                         if not k.startswith("KVD_")})
    assert r.returncode == 0 and "poll_idle_s = 0.05" in r.stdout, r.stdout + r.stderr


def test_log_level_and_format_are_case_insensitive():
    cfg = load_config(environ={"KVD_LOG_LEVEL": "WARNING", "KVD_LOG_FORMAT": "Json"})
    assert (cfg.log_level, cfg.log_format) == ("warning", "json")


@pytest.mark.parametrize("argv", [["health", "--bogus"], ["nosuch"], ["status", "--timeout", "x"]])
def test_usage_errors_exit_64_not_2_which_health_uses_for_unreachable(argv):
    r = _kvd(*argv)
    assert r.returncode == 64, (r.returncode, r.stderr)
    assert "usage:" in r.stderr


def test_an_unknown_file_key_like_no_setting_gets_no_guess(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(environ={}, file=_file(tmp_path, "zzzzzz = 5\n"))
    assert "zzzzzz (from file" in str(e.value) and "did you mean" not in str(e.value), str(e.value)
    assert "known: engine_socket, " in str(e.value)  # no guess: the list instead
    with pytest.raises(ConfigError) as e:
        load_config(environ={}, file=_file(tmp_path, "leese_s = 5\n"))
    assert "did you mean lease_s?" in str(e.value) and "known:" not in str(e.value), str(e.value)


def test_a_warm_peer_listed_twice_is_warmed_once():
    """One warm-up per engine: a repeated entry would start a second one
    that no drop of its pairs wakes (kvd.core.peers.Peers._keep_warm)."""
    cfg = load_config(environ={"KVD_WARM_PEERS": "10.0.0.5:7700/p,10.0.0.6:7700/p,10.0.0.5:7700/p"})
    assert cfg.warm_peers == ["10.0.0.5:7700/p", "10.0.0.6:7700/p"]


def test_an_empty_environment_variable_is_unset_for_every_setting(tmp_path):
    """``KVD_LEASE_S=`` (an EnvironmentFile such as /etc/default/kvd, a
    ``docker --env-file`` or a pod spec listing a variable with no value)
    means unset: the file's value or the default applies, never an error or
    an empty setting."""
    defaults = load_config(environ={})
    for value in ("", "  "):
        env = {f"KVD_{name.upper()}": value for name in setting_names()}
        cfg = load_config(environ=env)
        assert cfg == defaults
        assert set(cfg.sources.values()) == {"default"}, cfg.sources
        assert cfg.warnings == []  # set, known and empty: nothing to report
    # Over a file: the file's value stays, also for a path, a list, a boolean.
    path = _file(tmp_path, 'lease_s = 50\npeer_tls_server_name = "kvd.example"\nallowed_uids = ["0"]\n'
                           'follow_holds = false\n')
    env = {"KVD_LEASE_S": "", "KVD_PEER_TLS_SERVER_NAME": "", "KVD_ALLOWED_UIDS": "", "KVD_FOLLOW_HOLDS": ""}
    cfg = load_config(environ=env, file=path)
    assert (cfg.lease_s, cfg.peer_tls_server_name, cfg.allowed_uids, cfg.follow_holds) == \
        (50.0, "kvd.example", ["0"], False)
    assert {cfg.sources[k] for k in ("lease_s", "peer_tls_server_name", "allowed_uids", "follow_holds")} == \
        {f"file {path}"}
    # KVD_CONFIG= names no file; the clients' KVD_ENGINE_SOCKET= is the default socket.
    from kvd.config import DEFAULT_SOCKET, client_socket

    assert load_config(environ={"KVD_CONFIG": ""}) == defaults
    assert client_socket({"KVD_ENGINE_SOCKET": ""}) == DEFAULT_SOCKET


def test_serve_takes_empty_environment_variables_as_unset_and_still_reports_misspelt_ones(tmp_path):
    r = _kvd("serve", "--print-config", env={"KVD_LEASE_S": "", "KVD_SAME_NODE_COPY": "", "KVD_BACKENDS": "",
                                             "KVD_ENGINE_SOCKET": "", "KVD_LEESE_S": ""})
    assert r.returncode == 0, r.stderr
    assert "lease_s = 120.0  # default" in r.stdout and "same_node_copy = true  # default" in r.stdout
    assert 'engine_socket = "/run/kvd/engine.sock"  # default' in r.stdout
    # A misspelt name is still a mistake worth a line, empty or not.
    assert r.stderr.count("warning:") == 1 and "KVD_LEESE_S" in r.stderr and "did you mean KVD_LEASE_S" in r.stderr, \
        r.stderr


def test_toml_allowed_uids_and_gids_take_numbers_as_well_as_names(tmp_path):
    """The docs say "names or numbers": ``allowed_uids = [65534]`` in the
    file is a uid, not a type error; names and numbers mix; anything else
    (a boolean, a float, a table, an id the kernel cannot hold) is refused
    naming the key."""
    cfg = load_config(environ={}, file=_file(tmp_path, 'allowed_uids = [65534, "root", "7"]\nallowed_gids = [0]\n'))
    assert (cfg.allowed_uids, cfg.allowed_gids) == ([65534, "root", "7"], [0])
    from kvd.config import resolve_gid, resolve_uid

    assert [resolve_uid(u) for u in cfg.allowed_uids] == [65534, 0, 7]
    assert [resolve_gid(g) for g in cfg.allowed_gids] == [0]
    # --print-config writes them back as given, and that reads back the same.
    again = load_config(environ={}, file=_file(tmp_path, cfg.to_toml()))
    assert (again.allowed_uids, again.allowed_gids) == ([65534, "root", "7"], [0])
    # Environment and flags stay comma-separated text.
    assert load_config(environ={"KVD_ALLOWED_GIDS": "0,root"}).allowed_gids == ["0", "root"]
    for text, words in (("allowed_uids = [true]", "expected an array of names or numbers, got true in [true]"),
                        ("allowed_gids = [1.5]", "expected an array of names or numbers, got 1.5"),
                        ("allowed_uids = 65534", "expected an array of names or numbers, got 65534"),
                        ("allowed_uids = [{a = 1}]", "expected an array of names or numbers"),
                        ("allowed_gids = [-1]", "id -1 out of range"),
                        ("allowed_uids = [4294967295]", "id 4294967295 out of range"),
                        ('allowed_uids = ["no-such-user-kvd"]', "no such user 'no-such-user-kvd'")):
        with pytest.raises(ConfigError) as e:
            load_config(environ={}, file=_file(tmp_path, text + "\n"))
        key = text.split(" ")[0]
        assert str(e.value).startswith(f"{key} (from file ") and words in str(e.value), str(e.value)


@pytest.mark.parametrize("peer, host, clash", [
    ("127.0.0.1:7711", "127.0.0.1", True),
    ("127.0.0.1:7711", "0.0.0.0", True),     # the wildcard takes 127.0.0.1 too
    ("0.0.0.0:7711", "10.0.0.5", True),
    ("[::]:7711", "127.0.0.1", True),        # dual-stack: :: takes IPv4 too
    ("[::1]:7711", "::1", True),
    ("LOCALHOST:7711", "localhost", True),
    ("127.0.0.1:7711", "127.0.0.2", False),  # two addresses: both binds work
    ("0.0.0.0:7711", "::1", False),          # 0.0.0.0 is IPv4 only
    ("127.0.0.1:7712", "127.0.0.1", False),  # another port
])
def test_metrics_on_the_peer_port_of_an_overlapping_address_is_a_config_error(peer, host, clash):
    """Same port for PeerService and metrics on overlapping addresses failed
    at bind (exit 1, which systemd restarts for ever); it is refused when
    the settings are read, naming both."""
    env = {"KVD_PEER_LISTEN": peer, "KVD_METRICS_HOST": host, "KVD_METRICS_PORT": "7711"}
    if not clash:
        load_config(environ=env)
        return
    with pytest.raises(ConfigError) as e:
        load_config(environ=env)
    msg = str(e.value)
    assert msg.startswith("metrics_port (from env KVD_METRICS_PORT): 7711 is also the port of peer_listen"), msg
    assert f"({peer}, from env KVD_PEER_LISTEN)" in msg and "metrics_host" in msg, msg


def test_metrics_and_peer_port_clash_exits_64_and_port_0_never_clashes():
    r = _kvd("serve", "--peer-listen", "127.0.0.1:7711", "--metrics-port", "7711", "--metrics-host", "127.0.0.1")
    assert r.returncode == 64, (r.returncode, r.stderr)
    assert "metrics_port (from flag --metrics-port)" in r.stderr and "from flag --peer-listen" in r.stderr
    # 0 is "a free port" for peer_listen and "off" for metrics: never the same port.
    load_config(environ={"KVD_PEER_LISTEN": "127.0.0.1:0", "KVD_METRICS_HOST": "127.0.0.1"})


# ``kvd serve --print-config ARGV`` as uid argv[1] (-1: as is), imported as
# root first: this checkout and interpreter may be closed to that uid.
_SERVE_AS = r"""
import os, sys
import grp, pwd
import kvd.cli, kvd.config, kvd.daemon.early_stop, kvd.daemon.peer_auth, kvd.addresses
uid = int(sys.argv[1])
if uid >= 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
sys.exit(kvd.cli.main(["serve", "--print-config", *sys.argv[2:]]))
"""


def _serve_print_config_as_another_user(*args) -> tuple[subprocess.CompletedProcess, int]:
    """``kvd serve --print-config ARGS``, as uid 65534 when the tests run as
    root (root reads every file), else as this user; returns the result and
    the uid it ran as."""
    uid = 65534 if os.geteuid() == 0 else os.geteuid()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    r = subprocess.run([sys.executable, "-c", _SERVE_AS, str(uid if uid != os.geteuid() else -1), *args],
                       capture_output=True, text=True, timeout=60, env=env, cwd="/")
    if "ImportError" in r.stderr or "ModuleNotFoundError" in r.stderr:
        pytest.skip(f"uid {uid} cannot import what kvd serve imports late: {r.stderr.strip().splitlines()[-1:]}")
    return r, uid


def test_an_unreadable_token_file_names_the_daemons_uid_and_the_files_owner_and_mode():
    """``cannot read ...: Permission denied`` alone did not say that the
    daemon runs as another user than the one who wrote the token (a root
    0400 file, the unit's User=kvd): the message names both, the mode, and
    the fix."""
    import shutil
    import stat
    import tempfile

    d = tempfile.mkdtemp(prefix="kvd-token-")  # in /tmp: pytest's tmp_path is 0700, closed to uid 65534
    try:
        os.chmod(d, 0o755)
        token = os.path.join(d, "peer-token")
        with open(token, "w") as f:
            f.write("x" * 32)
        os.chmod(token, 0o400 if os.geteuid() == 0 else 0)  # the owner itself reads 0400
        st = os.stat(token)
        r, uid = _serve_print_config_as_another_user("--peer-token-file", token)
        assert r.returncode == 64, (r.returncode, r.stderr)
        assert f"peer_token_file (from flag --peer-token-file): cannot read {token}: Permission denied" in r.stderr
        assert f"this daemon runs as uid {uid}" in r.stderr, r.stderr
        assert f"owner uid {st.st_uid}" in r.stderr and f"mode {stat.S_IMODE(st.st_mode):04o}" in r.stderr, r.stderr
        assert f": {token}; mode 0600 or 0400)" in r.stderr and "(chown " in r.stderr, r.stderr
    finally:
        shutil.rmtree(d)


def test_a_directory_closed_to_the_daemon_is_named_when_a_file_in_it_cannot_be_read():
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="kvd-closed-")  # mode 0700
    try:
        token = os.path.join(d, "peer-token")
        with open(token, "w") as f:
            f.write("x" * 32)
        if os.geteuid() != 0:
            os.chmod(d, 0)  # closed to its owner too
        mode = "0700" if os.geteuid() == 0 else "0000"
        r, uid = _serve_print_config_as_another_user("--config", token)
        assert r.returncode == 64, (r.returncode, r.stderr)
        assert f"config file {token}: Permission denied; directory {d} (owner uid " in r.stderr, r.stderr
        assert f"mode {mode}) does not let this daemon (uid {uid}" in r.stderr, r.stderr
    finally:
        os.chmod(d, 0o700)
        shutil.rmtree(d)
    from kvd.config import access_hint

    assert access_hint(token, FileNotFoundError(2, "No such file")) == ""


# --------------------------------------------- new-user review: what each message says
def test_a_key_set_twice_names_both_lines(tmp_path):
    """tomllib says "Cannot overwrite a value" at the second line only; the
    message names the key and both lines (the shipped example, with a line
    appended, as an operator would)."""
    shipped = (ROOT / "deploy" / "kvd.toml").read_text()
    first = next(i for i, line in enumerate(shipped.splitlines(), 1) if line.startswith("lease_s ="))
    text = shipped + ("" if shipped.endswith("\n") else "\n") + "lease_s = 5\n"
    last = len(text.splitlines())
    path = _file(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(environ={}, file=path)
    assert str(e.value) == f"config file {path}: lease_s is set twice (lines {first} and {last}): keep one", e.value
    # Not the same table: tomllib's own message, with the line (kvd takes no tables anyway).
    path = _file(tmp_path, "a = 1\na.b = 2\n")
    with pytest.raises(ConfigError, match=r"Cannot overwrite a value \(at line 2, column 8\): a.b = 2$"):
        load_config(environ={}, file=path)


@pytest.mark.parametrize("text, words", [
    ("lease_s = \n", "Invalid value (at line 1, column 11): lease_s = (the value is missing: give lease_s one, or "
                     "remove the line)"),
    ("grace_s = 3\nlease_s =   # seconds\n", "Invalid value (at line 2, column 13): lease_s =   # seconds (the "
                                             "value is missing: give lease_s one, or remove the line)"),
])
def test_a_key_with_no_value_is_said_to_miss_it_not_to_need_quotes(tmp_path, text, words):
    path = _file(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(environ={}, file=path)
    assert str(e.value) == f"config file {path}: {words}", e.value


@pytest.mark.parametrize("text, words", [
    ("max_workers = true", "max_workers (from file {path}): expected an integer, got true"),
    ("lease_s = false", "lease_s (from file {path}): expected a number, got false"),
    ('max_workers = "12"', 'max_workers (from file {path}): expected an integer, got "12" (a string: write it '
                           'without quotes)'),
    ("engine_socket = 1979-05-27", "engine_socket (from file {path}): expected a string, got 1979-05-27"),
    ('backends = ["UCX", 2]', 'backends (from file {path}): expected an array of strings, got ["UCX", 2]'),
    ("engine_socket = {a = 1}", "engine_socket (from file {path}): expected a string, got {a = 1}"),
])
def test_a_wrong_value_in_the_file_is_shown_as_toml_writes_it(tmp_path, text, words):
    """The file's value as the file spells it (``true``), not Python's repr (``True``)."""
    path = _file(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(environ={}, file=path)
    assert str(e.value) == words.replace("{path}", path), e.value


@pytest.mark.parametrize("key, value", [
    ("peer_listen", "not a host:0"),
    ("peer_listen", "kvd.example.com/x:7700"),
    ("peer_listen", "[kvd-0]:7700"),  # brackets are for IPv6 only
    ("peer_listen", "-kvd:7700"),
    ("peer_listen", "[]:7700"),
    ("peer_advertise", "node a:7700"),
    ("warm_peers", "10.0.0.5 :7700/prefill-a"),
    ("metrics_host", "not a host"),
    ("metrics_host", "[::1]"),  # a host alone: getaddrinfo takes it without brackets
    ("metrics_host", "0.0.0.0:9400"),
])
def test_a_host_that_is_neither_an_address_nor_a_name_is_a_config_error(key, value):
    """A host that can never be one (spaces, characters no host name has)
    is refused with the settings, so that --print-config finds it too;
    before, the daemon bound loopback instead (no authentication), or gRPC
    failed at startup with its own E-line (exit 1, which systemd retries
    for ever)."""
    env = {f"KVD_{key.upper()}": value}
    with pytest.raises(ConfigError) as e:
        load_config(environ=env)
    assert str(e.value).startswith(f"{key} (from env KVD_{key.upper()}): "), e.value
    assert "neither an IP address nor a host name" in str(e.value) or "brackets" in str(e.value), e.value


@pytest.mark.parametrize("key, value", [
    ("peer_listen", "no-such-host.invalid:0"),  # well-formed: whether it resolves is the boot's question (exit 1)
    ("peer_listen", "[::1]:0"),
    ("peer_listen", "[fe80::1%eth0]:7700"),
    ("peer_listen", "0.0.0.0:7700"),
    ("peer_listen", "kvd-0.kvd.default.svc.cluster.local.:7700"),
    ("peer_advertise", "proj_kvd_1:7700"),  # '_': Docker Compose v1 names, which resolvers take
    ("warm_peers", "prefill-0:7700/prefill-a,[2001:db8::5]:7700/prefill-b"),
    ("metrics_host", "::"),
    ("metrics_host", "localhost"),
])
def test_hosts_that_are_addresses_or_names_pass_resolving_or_not(key, value):
    load_config(environ={f"KVD_{key.upper()}": value})


def test_serve_print_config_refuses_a_peer_listen_host_that_is_no_host():
    r = _kvd("serve", "--peer-listen", "not a host:0", "--print-config")
    assert r.returncode == 64, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.startswith("kvd serve: invalid setting: peer_listen (from flag --peer-listen): host 'not a "
                               "host' is neither"), r.stderr


def test_a_config_file_named_by_kvd_config_is_named_so_in_its_errors(tmp_path):
    """Every other setting's error names its source ("(from env
    KVD_LEASE_S)"); a file $KVD_CONFIG names that cannot be read or parsed
    is said to come from there too, which a variable set in a profile or
    unit and forgotten needs. A --config file's errors are unchanged."""
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError) as e:
        load_config(environ={"KVD_CONFIG": missing})
    assert str(e.value) == f"config file {missing} (from env KVD_CONFIG): No such file or directory", e.value
    bad = _file(tmp_path, "lease_s = 1\nlease_s = 2\n")
    with pytest.raises(ConfigError, match=r"\(from env KVD_CONFIG\): lease_s is set twice"):
        load_config(environ={"KVD_CONFIG": bad})
    with pytest.raises(ConfigError) as e:
        load_config(environ={}, file=missing)
    assert str(e.value) == f"config file {missing}: No such file or directory", e.value
    r = _kvd("serve", "--print-config", env={"KVD_CONFIG": missing})
    assert r.returncode == 64, (r.returncode, r.stderr)
    assert r.stderr == (f"kvd serve: invalid setting: config file {missing} (from env KVD_CONFIG): No such file or "
                        f"directory\n"), r.stderr
