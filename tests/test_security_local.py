"""Local access: who may use the engine socket, which memory a caller
may hand the daemon, and which engine worker a caller may drive.

One daemon for the module; its socket's group is nogroup and it admits one
extra uid (ADMITTED). Callers as other users run in child processes.
"""

from __future__ import annotations

import os
import stat
import types

import grpc
import pytest

from kvd.core import events as ev
from kvd.core.state import Owner
from kvd.daemon.engine_service import EngineService
from kvd.daemon.local_gate import Caller
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc
from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import Engine, KvShape
from kvd.testing.shm import ShmSegment
from kvd.testing.security import NOBODY, OUTSIDER, OtherEngine, call_as, reachable_dir

ADMITTED = 65533  # admitted by allowed_uids; reaches the socket through group nogroup
SHAPE = KvShape(num_layers=1, num_blocks=8, block_len=1024)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run callers as other users")


@pytest.fixture(scope="module")
def daemon():
    d = start_daemon(reachable_dir(), "kvd", "--engine-socket-group", str(NOBODY), "--allowed-uids", str(ADMITTED))
    yield d
    assert d.stop() == 0


def _still_serving(d) -> None:
    assert d.proc.poll() is None and d.stats().daemon_version


def _open(d, engine_id: str, token: str = "") -> tuple[str, str]:
    """Opens a raw session; ``("opened", "")`` or ``(status name, details)``."""
    ch = grpc.insecure_channel(f"unix:{d.socket}")
    try:
        call = pb_grpc.EngineServiceStub(ch).Session(iter([pb.SessionCommand(open=pb.OpenSession(
            worker=pb.EngineWorker(engine_id=engine_id), session_token=token))]), timeout=10)
        first = next(call)
        call.cancel()
        return first.WhichOneof("event"), ""
    except grpc.RpcError as e:
        return e.code().name, e.details()
    finally:
        ch.close()


def _unregister(d, engine_id: str, token: str = "") -> tuple[str, str]:
    try:
        d.stub().UnregisterEngine(pb.UnregisterEngineRequest(worker=pb.EngineWorker(engine_id=engine_id),
                                                             session_token=token), timeout=10)
        return "OK", ""
    except grpc.RpcError as e:
        return e.code().name, e.details()


def test_engine_socket_is_mode_0660_with_the_configured_group(daemon):
    st = os.stat(daemon.socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == NOBODY
    # gRPC itself listens in a private directory no other user can enter.
    parent = os.path.dirname(daemon.socket)
    [private] = [n for n in os.listdir(parent) if n.startswith(f".{os.path.basename(daemon.socket)}.")]
    assert stat.S_IMODE(os.stat(os.path.join(parent, private)).st_mode) == 0o700


def test_a_uid_not_admitted_is_refused_with_a_status_and_the_daemon_keeps_serving(daemon):
    # nobody:nogroup may open the socket (group nogroup) but is not admitted.
    for action in ("stats", "register-own"):
        r = call_as(daemon.socket, NOBODY, NOBODY, action)
        assert r["code"] == "PERMISSION_DENIED", r
        assert f"uid {NOBODY}" in r["details"] and "allowed_uids" in r["details"], r
    assert f"uid {NOBODY} gid {NOBODY} is not admitted" in daemon.log()
    assert daemon.stats().engines == 0
    _still_serving(daemon)


def test_a_user_outside_the_socket_group_cannot_even_connect(daemon):
    r = call_as(daemon.socket, OUTSIDER, OUTSIDER)
    assert r["code"] == "UNAVAILABLE" and "Permission denied" in r["details"], r
    _still_serving(daemon)


def test_an_admitted_uid_registers_its_own_memory_but_never_memory_it_could_not_open(daemon):
    assert call_as(daemon.socket, ADMITTED, NOBODY, "register-own")["ok"]
    # A segment of root's, mode 0600: the daemon (root) could map it, the caller could not.
    seg = ShmSegment(SHAPE.size)
    try:
        r = call_as(daemon.socket, ADMITTED, NOBODY, "register-seg", seg.name)
        assert r["code"] == "PERMISSION_DENIED", r
        assert "permission denied" in r["details"] and f"uid {ADMITTED}" in r["details"], r
    finally:
        seg.close()
    assert daemon.stats().engines == 0
    _still_serving(daemon)


def test_a_staging_mirror_is_mode_0600_and_owned_by_the_engine_that_registered(daemon):
    """Staged data path: the daemon's mirror of an engine's cache is that
    engine's alone (0600, its uid), not open to the daemon's group."""
    r = call_as(daemon.socket, ADMITTED, NOBODY, "register-staged")
    assert r["ok"], r  # and the engine could open it read-write
    assert r["mirror"] == {"uid": ADMITTED, "mode": 0o600}, r
    assert daemon.stats().engines == 0
    _still_serving(daemon)


def test_a_symbolic_link_in_dev_shm_is_never_followed(daemon):
    seg = ShmSegment(SHAPE.size)
    link = f"/dev/shm/kvdtest_{os.getpid()}_link"
    os.symlink(seg.path, link)
    try:
        from kvd.testing.sessions import register_request

        req = register_request("linked", SHAPE, seg)
        req.segments[0].name = "/" + os.path.basename(link)
        with pytest.raises(grpc.RpcError) as e:
            daemon.stub().RegisterEngine(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "symbolic link" in e.value.details()
    finally:
        os.unlink(link)
        seg.close()
    _still_serving(daemon)


def test_engine_a_can_never_drive_or_drop_engine_b(daemon):
    b = OtherEngine(daemon.socket, "B")   # another engine process (same uid, another pid)
    a = Engine(daemon, "A", SHAPE)        # this process
    try:
        code, msg = _open(daemon, "B")
        assert code == "PERMISSION_DENIED" and "registered by another process" in msg, (code, msg)
        assert "session_token" in msg
        code, msg = _open(daemon, "B", token="0" * 32)
        assert code == "PERMISSION_DENIED" and "does not match" in msg, (code, msg)
        code, msg = _unregister(daemon, "B")
        assert code == "PERMISSION_DENIED", (code, msg)
        code, msg = _unregister(daemon, "B", token=a.registered.session_token)  # A's own token
        assert code == "PERMISSION_DENIED" and "does not match" in msg, (code, msg)
        assert {w.engine_id for w in daemon.stats().workers} == {"A", "B"}
        # A's own session goes on as before.
        a.hold("r1", [1, 2])
        a.release("r1")
        assert a.wait("r1").send_done.released
        # The token is the capability: whoever B handed it to may use it.
        assert _open(daemon, "B", token=b.token) == ("opened", "")
    finally:
        b.exit()
        a.close()
    # B's process is gone: a process of the same user may drop the stale registration.
    assert _unregister(daemon, "B") == ("OK", "")
    assert daemon.stats().engines == 0
    _still_serving(daemon)


def test_the_registering_process_needs_no_token_and_unknown_workers_stay_not_found(daemon):
    e = Engine(daemon, "self", SHAPE, open_session=False)
    try:
        assert len(e.registered.session_token) == 32
        assert _open(daemon, "self") == ("opened", "")
        assert _open(daemon, "self", token=e.registered.session_token) == ("opened", "")
        assert _open(daemon, "ghost")[0] == "NOT_FOUND"
        assert _unregister(daemon, "ghost")[0] == "NOT_FOUND"
    finally:
        e.close()


# ------------------------------------------------------ the binding rules, one by one
ME = Caller(os.getpid(), 1000, 1000, frozenset({1000}))  # a live pid: the owner's process still runs


def _service(require: bool = False, sessions: int = 1, owner=ME):
    w = types.SimpleNamespace(session=types.SimpleNamespace(streams=sessions), label="engine=e rank=0",
                              owner=Owner(owner.uid, owner.gid, owner.gids, owner.pid, "t" * 32))
    node = types.SimpleNamespace(workers={("e", 0): w})
    return EngineService(node, require_session_token=require)


def _allowed(s: EngineService, caller: Caller, token: str = "", takeover: bool = False) -> bool:
    try:
        s._authorize(("e", 0), caller, token, "test", takeover=takeover)
        return True
    except ev.PermissionDenied:
        return False


def test_binding_rules():
    me = ME
    sibling = Caller(200, 1000, 1000, frozenset({1000}))       # same user, another process
    stranger = Caller(300, 2000, 2000, frozenset({2000}))      # another user
    root = Caller(400, 0, 0, frozenset({0}))
    s = _service()
    assert _allowed(s, me) and _allowed(s, me, "t" * 32)
    assert not _allowed(s, me, "x" * 32)                       # a wrong token is never ignored
    assert not _allowed(s, sibling) and _allowed(s, sibling, "t" * 32)
    assert not _allowed(s, stranger, "t" * 32)                 # a leaked token is no use to another user
    assert _allowed(s, root, "t" * 32) and not _allowed(s, root)
    # require_session_token: even the registering process must send it.
    s = _service(require=True)
    assert not _allowed(s, me) and _allowed(s, me, "t" * 32)
    # Replacing a stale registration (UnregisterEngine): same user, owner gone or no session.
    assert not _allowed(_service(), sibling, takeover=True)
    assert _allowed(_service(sessions=0), sibling, takeover=True)
    assert not _allowed(_service(sessions=0), stranger, takeover=True)
    dead = Caller(2 ** 22 + 1, 1000, 1000, frozenset({1000}))  # above pid_max: no such process
    assert _allowed(_service(owner=dead), sibling, takeover=True)
    assert not _allowed(_service(owner=dead), sibling)         # but never a session without the token
    # Neither pid visible (another container): the same user stands for the process.
    hidden = Caller(0, 1000, 1000, frozenset({1000}))
    assert _allowed(_service(owner=hidden), hidden)
    assert not _allowed(_service(owner=hidden, require=True), hidden)
    assert not _allowed(_service(owner=hidden), Caller(0, 2000, 2000, frozenset({2000})))
