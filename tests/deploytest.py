"""Helpers for the tests that run the deployment for real: the image under
podman (tests/test_container.py) and the systemd unit under a booted
``systemd-nspawn`` container (tests/test_systemd.py).

What is slow to make is made once and kept under ``~/.cache/kvd-test/``
(``$XDG_CACHE_HOME/kvd-test``): Debian root filesystems
(scripts/make_rootfs.sh, ~1 min each) and a wheel folder (torch CPU, NIXL,
gRPC... ~350 MB) that the image build and the nspawn tree install from
without any index. A test skips, with the reason, when the machine cannot
run it (not root, a tool not installed, Debian's mirror or the package
index unreachable); it never installs a tool itself
(scripts/install_container_tools.sh does, for CI).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "kvd-test"
INSTALL_HINT = "scripts/install_container_tools.sh installs podman, runc, debootstrap and systemd-container"


def need_root() -> None:
    """Skips unless root: debootstrap, rootful podman and nspawn need it."""
    if os.geteuid() != 0:
        pytest.skip("needs root (debootstrap, rootful podman, systemd-nspawn)")


def need_tool(name: str) -> str:
    """Path of ``name`` on PATH; skips the test when it is not installed."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed ({INSTALL_HINT})")
    return path


@contextlib.contextmanager
def cache_lock(name: str):
    """Holds ``CACHE/name.lock`` (flock): two test sessions never fill one cache entry at once."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def rootfs(name: str, *packages: str) -> pathlib.Path:
    """``CACHE/name``: a Debian bookworm tree with Python 3.11 and ``packages``
    (scripts/make_rootfs.sh), made on first use. Skips when it cannot be made
    (no debootstrap, Debian's mirror unreachable), with the script's output."""
    need_root()
    need_tool("debootstrap")
    path = CACHE / name
    with cache_lock(name):
        if not path.is_dir():
            r = subprocess.run([str(ROOT / "scripts" / "make_rootfs.sh"), str(path), *packages],
                               capture_output=True, text=True, timeout=1800)
            if r.returncode != 0:
                pytest.skip(f"cannot make the Debian root filesystem {path} (scripts/make_rootfs.sh exit "
                            f"{r.returncode}):\n{(r.stdout + r.stderr)[-2000:]}")
    return path


def torch_version() -> str:
    """The Dockerfile's ``TORCH_VERSION`` default: the one torch the image is built with."""
    m = re.search(r"^ARG TORCH_VERSION=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert m, "Dockerfile: no ARG TORCH_VERSION="
    return m.group(1)


def requirements() -> list[str]:
    """What the daemon's environment needs: torch (NIXL's Python package
    imports it) and pyproject.toml's dependencies."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [f"torch=={torch_version()}", *project["project"]["dependencies"]]


def build_requirements() -> list[str]:
    """pyproject.toml's build-system requirements (``pip install .`` needs them offline too)."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]


def wheelhouse() -> pathlib.Path:
    """``CACHE/wheels``: binary wheels for :func:`requirements` and the build
    backend, downloaded by this interpreter's pip (whose configuration here
    finds the torch CPU wheel in a local folder: docs/OPERATIONS.md,
    "Docker"). Downloaded again only when the requirements change. Skips when
    pip cannot get them (no package index reachable)."""
    path = CACHE / "wheels"
    wanted = sorted(requirements() + build_requirements())
    stamp = path / ".requirements"
    with cache_lock("wheels"):
        if stamp.exists() and stamp.read_text() == "\n".join(wanted):
            return path
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check",
                            "--only-binary=:all:", "--dest", str(path), *wanted],
                           capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            pytest.skip(f"pip cannot download the daemon's wheels:\n{(r.stdout + r.stderr)[-2000:]}")
        stamp.write_text("\n".join(wanted))
    return path

