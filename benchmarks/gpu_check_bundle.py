#!/usr/bin/env python3
"""Builds the Python packages the device check needs on the H200 image, small
enough to carry (docs/GPU.md "Run it").

The device image has python3 3.12, torch (cu130), numpy and uvloop, but no
NIXL, and its grpcio/protobuf may be older than kvd's generated code needs
(grpcio >= 1.85.1, protobuf >= 7.35.1). Nothing can be downloaded there, and
a carried tree is limited to 64 MiB: the ``nixl-cu13`` wheel alone is 56 MiB,
91 MiB of it unpacked being ``nixl_ep`` (expert-parallel kernels for three
torch versions) and object-storage plugins kvd never loads. So this script,
run here (with network), installs the wheels for CPython 3.12 into a
folder, drops what the UCX and POSIX backends cannot reach (the closure of
``NEEDED`` entries from NIXL's bindings, those two plugins and UCX's transport
modules), and packs the rest as ``.gpu_check/site.tar.xz`` (about 25 MiB).

On the device::

    mkdir -p /tmp/kvdsite && tar -xJf .gpu_check/site.tar.xz -C /tmp/kvdsite
    PYTHONPATH=/tmp/kvdsite:$PWD python3 benchmarks/gpu_check.py --out "$OUT"

(``run`` with ``carry=[".gpu_check"]``; ``.gpu_check/`` is git-ignored.)
Needs ``pip`` and ``readelf`` here.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["nixl==1.5.1", "nixl-cu13==1.5.1", "grpcio==1.85.3", "grpcio-health-checking==1.85.1",
            "grpcio-reflection==1.85.1", "protobuf==7.36.2"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
KEEP_PLUGINS = ("libplugin_UCX.so", "libplugin_POSIX.so")


def needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\).*\[(.+?)\]", out)


def prune(site: Path) -> list[Path]:
    """Removes what NIXL's UCX/POSIX backends cannot reach; returns what went."""
    removed: list[Path] = []
    for pkg in site.glob("nixl_ep*"):
        shutil.rmtree(pkg)
        removed.append(pkg)
    for extra in list(site.glob("nixl_cu*.scripts")) + list(site.glob("nixl_cu*-*.data")):
        shutil.rmtree(extra, ignore_errors=True)
        removed.append(extra)
    libs = {}
    for p in site.rglob("*.so*"):
        if p.is_file() and "nixl_cu" in str(p.relative_to(site)).split(os.sep)[0]:
            libs.setdefault(p.name, []).append(p)
    roots = [n for n in libs if n.startswith(("_bindings.", "_utils.")) or n in KEEP_PLUGINS or
             (n.startswith(("libuct_", "libucm_")) and "perftest" not in n)]
    seen, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name in seen or name not in libs:
            continue
        seen.add(name)
        for p in libs[name]:
            stack += needed(p)
    for name, paths in libs.items():
        if name not in seen:
            for p in paths:
                p.unlink()
                removed.append(p)
    for la in site.rglob("*.la"):
        if not (la.parent / (la.stem + ".so.0.0.0")).exists():
            la.unlink()
    return removed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / ".gpu_check" / "site.tar.xz"))
    ap.add_argument("--python-version", default="3.12")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", args.python_version, "--target", str(site)]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        subprocess.run(cmd + PACKAGES, check=True)
        removed = prune(site)
        size = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:xz", preset=6) as tar:
            for p in sorted(site.iterdir()):
                tar.add(p, arcname=p.name)
        print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB packed ({size / 2**20:.1f} MiB unpacked, "
              f"{len(removed)} files/folders pruned)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
