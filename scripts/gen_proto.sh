#!/usr/bin/env bash
# Regenerates the protobuf/gRPC Python code in kvd/v1/ from proto/kvd/v1/*.proto.
# Usage: scripts/gen_proto.sh [OUT_DIR]   (default: the repository root)
# tests/test_proto_drift.py runs this into a temp dir and fails on any difference.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root}
py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=python3
mkdir -p "$out/kvd/v1"
"$py" -m grpc_tools.protoc -I"$root/proto" \
  --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  "$root"/proto/kvd/v1/*.proto
