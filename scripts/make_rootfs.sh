#!/usr/bin/env bash
# Makes a Debian bookworm root filesystem with Python 3.11 (python3, venv,
# `python`), without a container registry: the base of the kvd image
# (`tar -C DIR -c . | podman import - localhost/debian-python:bookworm`, then
# `--build-arg PYTHON_IMAGE=localhost/debian-python:bookworm`) and, with
# `systemd systemd-sysv` added, a tree `systemd-nspawn --boot` can boot.
# Usage: scripts/make_rootfs.sh DIR [EXTRA_PACKAGE...]
# DIR is made once (debootstrap --variant=minbase, ~1 min and ~280 MB here);
# an existing DIR is kept as it is. Needs root, debootstrap and Debian's
# mirror (DEBIAN_MIRROR, default http://deb.debian.org/debian).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 DIR [EXTRA_PACKAGE...]" >&2; exit 2; }
dir=$1; shift
if [ -d "$dir" ]; then
  echo "$dir exists, kept"
  exit 0
fi
packages=python3,python3-venv,python-is-python3
for p in "$@"; do packages=$packages,$p; done
tmp=$dir.tmp.$$
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$(dirname "$dir")"
debootstrap --variant=minbase --include="$packages" bookworm "$tmp" \
  "${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
rm -f "$tmp"/var/cache/apt/archives/*.deb
# A partial tree never takes DIR's name: a later run would keep it.
mv "$tmp" "$dir"
trap - EXIT
echo "made $dir"
