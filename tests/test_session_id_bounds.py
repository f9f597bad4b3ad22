"""A session command's ids are bounded in bytes (``BOUNDS.max_id_bytes``,
UTF-8), whatever the command and however many bytes a character takes:
``EngineService._run_command`` checks only the id fields each command has,
and encodes only a str that could pass the bound."""

from types import SimpleNamespace

import pytest

from kvd.core.limits import BOUNDS
from kvd.daemon.engine_service import _ID_FIELDS, EngineService
from kvd.v1 import kvd_pb2 as pb


class _Node:
    def __init__(self, w):
        self.workers = {w.key: w}
        self.rejected, self.released, self.held = [], [], []

    def reject(self, w, request_id, reason):
        self.rejected.append(reason)

    def release(self, w, request_id):
        self.released.append(request_id)

    def hold(self, w, request_id, groups, lease_s):
        self.held.append(request_id)


def _run(cmd):
    w = SimpleNamespace(key=("e", 0), session=SimpleNamespace(overflowed=0))
    node = _Node(w)
    assert EngineService(node)._run_command(w, cmd, 0) is True
    return node


@pytest.mark.parametrize("char", ["r", "\u00e9", "\u20ac", "\U0001f642"])  # 1, 2, 3 and 4 bytes in UTF-8
def test_an_id_past_the_bound_in_bytes_is_refused_at_every_width(char):
    limit = BOUNDS.max_id_bytes
    width = len(char.encode())
    fits = char * (limit // width)
    over = fits + char
    assert len(fits.encode()) <= limit < len(over.encode())
    node = _run(pb.SessionCommand(release=pb.ReleaseBlocks(request_id=fits)))
    assert node.released == [fits] and not node.rejected
    node = _run(pb.SessionCommand(release=pb.ReleaseBlocks(request_id=over)))
    assert not node.released and node.rejected == [f"release: request_id longer than {limit} bytes"]
    node = _run(pb.SessionCommand(hold=pb.HoldBlocks(request_id=over, groups=[pb.BlockIds(ids=[1])])))
    assert not node.held and node.rejected == [f"hold: request_id longer than {limit} bytes"]


def test_each_command_checks_every_id_field_it_has():
    limit = BOUNDS.max_id_bytes
    over = "\u20ac" * (limit // 3 + 1)
    for field in ("remote_request_id", "remote_engine_id", "remote_address"):
        node = _run(pb.SessionCommand(abort_load=pb.AbortLoad(request_id="a", **{field: over})))
        assert node.rejected == [f"abort_load: {field} longer than {limit} bytes"]
    assert _ID_FIELDS["load"] == ("request_id", "remote_request_id", "remote_engine_id", "remote_address")
    assert _ID_FIELDS["hold"] == _ID_FIELDS["release"] == ("request_id",)
    assert _ID_FIELDS["open"] == ()
