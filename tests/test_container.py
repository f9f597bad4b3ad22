"""The kvd image, built and run for real with podman.

The image is built once per test session from the repository's Dockerfile,
offline: the base image is a Debian bookworm tree made here
(scripts/make_rootfs.sh, imported as ``localhost/debian-python:bookworm``,
both kept between runs) and every wheel comes from a local folder
(deploy/wheels/README.md; tests/deploytest.py keeps it under
``~/.cache/kvd-test/wheels``). An image built from the same context is
used as it is (see :func:`image`).

Containers run as the docs say (docs/OPERATIONS.md, "Docker"): host network
and IPC, the engine socket directory and ``/dev/shm`` shared with the host.
The engines are the test process, on the host: they share their KV cache
segments with the daemons in the containers through ``/dev/shm``, owned by
the image's user as the Dockerfile asks of engines.

Skipped, with the reason, where podman cannot run a container (not
installed, not root, no cgroup or runtime support); scripts/
install_container_tools.sh installs what CI needs.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import resource
import shutil
import subprocess
import time
import uuid

import pytest

from deploytest import ROOT, need_root, need_tool, rootfs, wheelhouse
from kvd.testing.daemons import Daemon, wait_serving
from kvd.testing.sessions import Engine, KvShape, event_kind
from kvd.testing.shm import ShmSegment
from kvd.testing.util import free_port

BASE_IMAGE = "localhost/debian-python:bookworm"
# The build stage's base: the same tree with a C compiler and Python's
# headers, so that the image has kvd's native row copy (setup.py).
BUILD_BASE_IMAGE = "localhost/debian-python-cc:bookworm"
BUILD_PACKAGES = ("gcc", "libc6-dev", "python3-dev")
IMAGE = "localhost/kvd:test"
CONTEXT_LABEL = "org.kvd.test.context"  # the digest of the context IMAGE was built from
# What the build context needs (the rest is .dockerignore'd anyway).
CONTEXT_FILES = ("Dockerfile", ".dockerignore", "pyproject.toml", "setup.py", "README.md", "deploy/kvd.toml",
                 "deploy/wheels/README.md")
SHAPE = KvShape(num_layers=2, num_blocks=32, block_len=64 * 1024)  # 8 MiB per engine


def _limits() -> list[str]:
    """``--ulimit`` flags podman can apply here.

    podman's defaults are above this machine's hard limits, which root
    without CAP_SYS_RESOURCE may not raise ("error setting rlimit ...
    operation not permitted"): open files get this process's limits, and
    processes 4096 (plenty for the daemon's threads), below the 32768 that
    podman leaves its conmon here (a higher value is refused the same way).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fmt = lambda v: "-1" if v == resource.RLIM_INFINITY else str(v)  # noqa: E731
    return ["--ulimit", f"nofile={fmt(soft)}:{fmt(hard)}", "--ulimit", "nproc=4096:4096"]


def _podman() -> list[str]:
    # crun refuses hybrid cgroup hierarchies like this machine's; runc runs them.
    return [need_tool("podman"), *(["--runtime", "runc"] if shutil.which("runc") else [])]


LIMITS = _limits()


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([*_podman(), *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
    return r


def _base_image() -> None:
    """Imports the cached Debian trees as BASE_IMAGE and BUILD_BASE_IMAGE
    once; skips if podman cannot run them."""
    for image, name, packages in ((BASE_IMAGE, "rootfs-python", ()),
                                  (BUILD_BASE_IMAGE, "rootfs-python-cc", BUILD_PACKAGES)):
        if podman("image", "exists", image, check=False).returncode == 0:
            continue
        tree = rootfs(name, *packages)
        tar = subprocess.Popen(["tar", "-C", str(tree), "-c", "."], stdout=subprocess.PIPE)
        r = subprocess.run([*_podman(), "import", "-", image], stdin=tar.stdout, capture_output=True,
                           text=True, timeout=600)
        tar.wait()
        assert r.returncode == 0, r.stdout + r.stderr
    r = podman("run", "--rm", *LIMITS, BASE_IMAGE, "python", "-c", "print('ok')", check=False)
    if r.returncode != 0 or r.stdout.strip() != "ok":
        pytest.skip(f"podman cannot run a container here: exit {r.returncode}\n{r.stderr[-2000:]}")


def _context(tmp: pathlib.Path) -> pathlib.Path:
    """A build context: the files the Dockerfile copies, and the wheels (hard links)."""
    ctx = tmp / "context"
    for name in CONTEXT_FILES:
        (ctx / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, ctx / name)
    shutil.copytree(ROOT / "kvd", ctx / "kvd", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for whl in wheelhouse().glob("*.whl"):
        try:
            os.link(whl, ctx / "deploy" / "wheels" / whl.name)
        except OSError:  # another filesystem
            shutil.copy2(whl, ctx / "deploy" / "wheels" / whl.name)
    return ctx


def _context_digest(ctx: pathlib.Path) -> str:
    """sha256 of every file in the build context (wheels by name and size:
    they are immutable releases), the image's cache key."""
    h = hashlib.sha256()
    for path in sorted(p for p in ctx.rglob("*") if p.is_file()):
        rel = str(path.relative_to(ctx))
        h.update(rel.encode() + b"\0")
        h.update(str(path.stat().st_size).encode() if path.suffix == ".whl" else path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="session")
def image(tmp_path_factory) -> str:
    """IMAGE, built from this tree: ~2-4.5 min the first time here, ~1.5 min
    after a change to kvd/ (podman's layer cache keeps the dependencies'
    layers), not at all when the context is the one IMAGE was built from
    (its label CONTEXT_LABEL; podman's own cache check of an unchanged
    context still takes ~50 s, digesting the 1 GB venv)."""
    need_root()
    _base_image()
    ctx = _context(tmp_path_factory.mktemp("image"))
    key = _context_digest(ctx)
    built_from = podman("image", "inspect", "--format", f'{{{{index .Labels "{CONTEXT_LABEL}"}}}}', IMAGE,
                        check=False).stdout.strip()
    if built_from == key:
        return IMAGE
    t0 = time.monotonic()
    r = podman("build", "--format", "docker",  # the OCI format drops HEALTHCHECK
               "--network", "none", "--build-arg", "PIP_NO_INDEX=1", "--build-arg", f"PYTHON_IMAGE={BASE_IMAGE}",
               "--build-arg", f"BUILD_IMAGE={BUILD_BASE_IMAGE}",
               "--label", f"{CONTEXT_LABEL}={key}", *LIMITS, "-t", IMAGE, str(ctx), timeout=1800, check=False)
    assert r.returncode == 0, f"podman build failed:\n{(r.stdout + r.stderr)[-4000:]}"
    print(f"podman build: {time.monotonic() - t0:.1f} s")
    # What earlier builds here left and nothing now uses: the image this one
    # replaced, and its layers (~1 GB a kvd/ change). podman labels every
    # image of a build with --label, and prunes until no dangling one is
    # left, so the layers this build reused from them (torch) stay.
    podman("image", "prune", "--force", "--filter", f"label={CONTEXT_LABEL}", check=False)
    return IMAGE


def _image_uid(image: str) -> int:
    user = podman("image", "inspect", "--format", "{{.Config.User}}", image).stdout.strip()
    return int(user.split(":")[0])


class Containers:
    """kvd daemons in containers of ``image``, sharing one socket directory
    (the host's ``run``, mounted at /run/kvd) and the host's /dev/shm."""

    def __init__(self, image: str, tmp: pathlib.Path):
        self.image = image
        self.tmp = tmp
        self.uid = _image_uid(image)
        self.run_dir = tmp / "run"
        self.run_dir.mkdir()
        os.chown(self.run_dir, self.uid, self.uid)
        self.names: list[str] = []

    def start(self, name: str, timeout: float = 120.0) -> Daemon:
        """``kvd serve`` (the image's CMD) in container ``name``, in the
        foreground of a ``podman run`` subprocess (its signals reach the
        daemon); returns once the daemon answers GetStats on its socket."""
        cname = f"kvd-test-{name}-{uuid.uuid4().hex[:8]}"
        self.names.append(cname)
        port = free_port()
        log_path = self.tmp / f"{name}.log"
        cmd = [*_podman(), "run", "--rm", "--name", cname, "--network", "host", "--ipc", "host", *LIMITS,
               "-v", f"{self.run_dir}:/run/kvd", "-v", "/dev/shm:/dev/shm",
               "-e", f"KVD_ENGINE_SOCKET=/run/kvd/{name}.sock", "-e", f"KVD_PEER_LISTEN=127.0.0.1:{port}",
               "-e", "KVD_METRICS_PORT=0", "-e", "KVD_LOG_LEVEL=debug", self.image]
        with open(log_path, "w") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        d = Daemon(proc, str(self.run_dir / f"{name}.sock"), str(log_path), name=cname)
        if not wait_serving(d, time.monotonic() + timeout):
            raise AssertionError(f"container {cname} not serving within {timeout} s (podman run: "
                                 f"{proc.poll()}):\n{d.log()}")
        return d

    def segment(self, shape: KvShape) -> ShmSegment:
        """An engine's KV cache segment, owned by the image's user (torch makes
        them mode 0600: the engine and the daemon share a uid)."""
        seg = ShmSegment(shape.size)
        os.chown(seg.path, self.uid, self.uid)
        return seg

    def close(self) -> None:
        for cname in self.names:
            podman("rm", "-f", "-t", "0", cname, check=False)


@pytest.fixture
def containers(image, tmp_path):
    c = Containers(image, tmp_path)
    yield c
    c.close()


def test_the_image_serves_as_its_own_user_and_its_healthcheck_goes_healthy(containers):
    d = containers.start("kvd")
    assert containers.uid != 0
    pid = podman("inspect", "--format", "{{.State.Pid}}", d.name).stdout.strip()
    with open(f"/proc/{pid}/status") as f:
        uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
    assert uids == [str(containers.uid)] * 4, uids  # real, effective, saved, filesystem
    # The image's HEALTHCHECK (kvd health on the engine socket), run now
    # rather than at its 30 s interval; like the engine's own schedule, up to
    # its 3 retries (one check, a Python start on a loaded machine, can pass
    # its 5 s timeout).
    for _ in range(3):
        r = podman("healthcheck", "run", d.name, check=False)
        if r.returncode == 0:
            break
    assert r.returncode == 0, r.stdout + r.stderr
    health = podman("inspect", "--format", "{{.State.Health.Status}}", d.name).stdout.strip()
    assert health == "healthy"


def test_the_image_has_kvd_s_native_row_copy_and_no_compiler(image):
    """The build stage compiled kvd/core/_rowcopy.c (BUILD_IMAGE has gcc);
    the runtime stage is PYTHON_IMAGE, with no compiler."""
    r = podman("run", "--rm", *LIMITS, image, "version")
    assert "native row copy: yes" in r.stdout, r.stdout + r.stderr
    r = podman("run", "--rm", *LIMITS, "--entrypoint", "sh", image, "-c", "command -v cc gcc || echo none")
    assert r.stdout.strip() == "none", r.stdout


def test_podman_stop_drains_the_daemon_and_it_exits_0(containers):
    d = containers.start("kvd")
    podman("stop", "-t", "30", d.name)  # the image's STOPSIGNAL, SIGTERM; SIGKILL after 30 s
    assert d.proc.wait(30) == 0, d.log()
    log = d.log()
    assert "received SIGTERM, shutting down" in log and "kvd stopped" in log, log


def test_two_containers_move_kv_blocks_over_nixl_ucx_through_the_shared_dev_shm(containers):
    p = containers.start("prefill")
    d = containers.start("decode")
    src = Engine(p, "container-p", SHAPE, seed=11, seg=containers.segment(SHAPE))
    dst = Engine(d, "container-d", SHAPE, seg=containers.segment(SHAPE))
    try:
        remote, local = list(range(4, 20)), list(range(10, 26))
        assert not dst.same_blocks(local, src, remote)
        src.hold("req-1", remote)
        dst.load("req-1", local, src, remote, "req-1", timeout_s=60)
        ev = dst.wait("req-1", 65)
        assert event_kind(ev) == "recv_done", ev
        assert ev.recv_done.bytes == len(local) * SHAPE.num_regions * SHAPE.block_len
        assert dst.same_blocks(local, src, remote)
        assert event_kind(src.wait("req-1", 10)) == "send_done"
    finally:
        for e in (dst, src):
            e.close()
            e.seg.close()
    for daemon in (p, d):
        assert daemon.stop() == 0, daemon.log()
