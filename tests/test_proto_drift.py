"""The committed generated code in kvd/v1/ equals what scripts/gen_proto.sh makes from proto/."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_matches_proto(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True,
                   env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    made = sorted(p.name for p in (tmp_path / "kvd" / "v1").iterdir())
    assert made == ["kvd_pb2.py", "kvd_pb2.pyi", "kvd_pb2_grpc.py"]
    for name in made:
        fresh = (tmp_path / "kvd" / "v1" / name).read_text()
        committed = (ROOT / "kvd" / "v1" / name).read_text()
        assert fresh == committed, f"kvd/v1/{name} drifted from proto/: run scripts/gen_proto.sh"


def test_proto_package_is_versioned():
    text = (ROOT / "proto" / "kvd" / "v1" / "kvd.proto").read_text()
    assert "package kvd.v1;" in text
