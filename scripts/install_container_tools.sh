#!/usr/bin/env bash
# Installs, from Debian 12's packages, what tests/test_container.py (podman,
# runc, debootstrap) and tests/test_systemd.py (systemd-nspawn from
# systemd-container, debootstrap) need; ~20 s here. The tests skip, saying
# so, where these are missing. Installs only what is missing; needs root.
# Usage: scripts/install_container_tools.sh
set -euo pipefail
missing=()
for tool_package in podman:podman runc:runc debootstrap:debootstrap systemd-nspawn:systemd-container; do
  command -v "${tool_package%%:*}" >/dev/null || missing+=("${tool_package##*:}")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "podman, runc, debootstrap and systemd-nspawn are installed"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq "${missing[@]}" >/dev/null || { apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null; }
echo "installed: ${missing[*]}"
