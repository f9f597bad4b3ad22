"""Attacker scenarios against real daemons, third review: lease renewal
(EngineService.RenewLeases, PeerService.Renew, kvd.core.holds ``renew``)
and the command socket (kvd.daemon.command_socket).

Each test runs the hostile sequence and asserts what docs/SECURITY.md
promises: regression guards of defences that held, and scenarios still open
marked xfail(strict), their reason saying what happens instead (none now).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from kvd.client.command_socket import CommandConnection
from kvd.command_wire import frame
from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import Engine, KvShape, one_group
from kvd.testing.util import wait_until
from kvd.v1 import kvd_pb2 as pb

SHAPE = KvShape(num_layers=2, num_blocks=16, block_len=4096)
# As long as a vLLM request id ("cmpl-<uuid4 hex>-0"): what a renewal event carries.
RID = "cmpl-" + "7" * 32 + "-0"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a caller as another user")


def _renew(d, engine_id: str, rid: str, block: int, times: int = 1) -> list[pb.LeaseRenewed]:
    """One RenewLeases call on ``d``'s engine socket naming ``d`` itself: ``times``
    renewals of ``rid`` on ``[block]``; the results."""
    req = pb.RenewLeasesRequest(remote_engine_id=engine_id, remote_address=d.peer_address,
                                renewals=[pb.LeaseRenewal(request_id=rid, groups=one_group([block]))] * times)
    return list(d.stub().RenewLeases(req, timeout=30).results)


def _flood(d, engine_id: str, rid: str, block: int, renewals: int) -> None:
    """``renewals`` renewals of ``rid``, 256 a call (the most one call may
    carry), 16 calls at a time; each one renews (the lease holds ``block``)."""
    calls = []
    stub = d.stub()
    req = pb.RenewLeasesRequest(remote_engine_id=engine_id, remote_address=d.peer_address,
                                renewals=[pb.LeaseRenewal(request_id=rid, groups=one_group([block]))] * 256)
    for _ in range(renewals // 256):
        calls.append(stub.RenewLeases.future(req, timeout=60))
        if len(calls) == 16:
            for c in calls:
                assert all(not r.reason for r in c.result().results)
            calls.clear()
    for c in calls:
        assert all(not r.reason for r in c.result().results)


def test_renewals_of_one_lease_do_not_push_the_engines_other_events_out(tmp_path):
    """A reader (any admitted engine through RenewLeases, or a peer daemon
    through PeerService.Renew) that may renew one lease of a prefill
    engine's (it knows the request id and one held block, as any reader
    does) renews it 256 times a call while that engine's session is not
    reading for a while (a step of the engine, a slow link). Every renewal is
    a LeaseRenewed event queued for the engine; past
    ``BOUNDS.max_pending_events`` queued the daemon drops the oldest ones:
    the engine's real events (a SendDone, a LoadFailed) are lost. Expected:
    renewals that move nothing add no event (or renewals never push out
    another kind), so the engine's SendDone of "m" arrives."""
    d = start_daemon(str(tmp_path), "kvd", "--command-socket", "true", log_level="warning")  # no line per call
    victim = Engine(d, "victim-p", SHAPE, open_session=False)
    conn = CommandConnection.connect(d.socket, max_message_bytes=64 << 20, timeout_s=10)
    try:
        worker = pb.EngineWorker(engine_id="victim-p", tp_rank=0)
        conn.send([pb.SessionCommand(open=pb.OpenSession(worker=worker,
                                                         session_token=victim.registered.session_token)),
                   pb.SessionCommand(hold=pb.HoldBlocks(request_id=RID, groups=one_group([5]), lease_s=600))])
        events = conn.events()
        assert next(events).WhichOneof("event") == "opened"  # then this engine reads nothing for a while
        wait_until(lambda: not _renew(d, "victim-p", RID, 5)[0].reason, 30, "the victim's hold landed")
        _flood(d, "victim-p", RID, 5, 40_000)  # fills the session's socket and write buffer (~19,000 events here)
        # A request of the victim's that ends while it is not reading: its SendDone is queued.
        conn.send([pb.SessionCommand(hold=pb.HoldBlocks(request_id="m", groups=one_group([7]), lease_s=600))])
        wait_until(lambda: not _renew(d, "victim-p", "m", 7)[0].reason, 30, "the hold of m landed")
        conn.send([pb.SessionCommand(release=pb.ReleaseBlocks(request_id="m"))])
        wait_until(lambda: _renew(d, "victim-p", "m", 7)[0].reason == "not_held", 30, "m released")
        _flood(d, "victim-p", RID, 5, 100_352)  # BOUNDS.max_pending_events after it, and more
        # The last event queued (never the oldest): a rejection of "end" (block out of range).
        conn.send([pb.SessionCommand(hold=pb.HoldBlocks(request_id="end", groups=one_group([10 ** 6])))])
        seen: dict[str, int] = {}
        for ev in events:  # the engine reads again
            kind = ev.WhichOneof("event")
            rid = getattr(ev, kind).request_id
            seen[f"{kind}:{rid}"] = seen.get(f"{kind}:{rid}", 0) + 1
            if rid == "end":
                break
        assert d.proc.poll() is None
        assert "rejected:end" in seen, seen
        assert "send_done:m" in seen, (f"{seen}; daemon log: "
                                       f"{[ln for ln in d.log().splitlines() if 'dropped' in ln][:2]}")
    finally:
        conn.shutdown()
        conn.close()
        victim.close(unregister=True)
        assert d.stop() == 0


# As another local user: binds the command socket path beside an engine
# socket (argv[1]) in a directory it may write, answers the first frame with
# argv[2] (hex: an "opened" event) and every later one with argv[3] (hex: a
# "recv_done"), and prints each frame received as a JSON line (hex). Stdlib only.
_IMPOSTOR = r"""
import json, os, socket, struct, sys
path, opened, done = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
os.chmod(path, 0o777)
s.listen(4)
print(json.dumps({"ready": os.getuid()}), flush=True)
c, _ = s.accept()
c.settimeout(30)
buf, n = b"", 0
while True:
    try:
        data = c.recv(65536)
    except OSError:
        break
    if not data:
        break
    buf += data
    while len(buf) >= 4 and len(buf) - 4 >= struct.unpack_from("<I", buf)[0]:
        size = struct.unpack_from("<I", buf)[0]
        print(json.dumps({"frame": buf[4:4 + size].hex()}), flush=True)
        buf = buf[4 + size:]
        c.sendall(opened if n == 0 else done)
        n += 1
"""


@needs_root
def test_an_engine_client_does_not_take_another_users_socket_for_the_daemons_command_socket():
    """A daemon runs with ``command_socket = false`` (or has not bound it
    yet) and its engine socket sits in a shared sticky directory (``/tmp``
    style). Another local user (nobody) binds ``<engine_socket>.cmd`` there.
    An engine's client takes it for the daemon's command socket: the
    impostor gets its session token, engine id and every hold and load
    (request ids, block ids, peers), and answers with events of its own: the
    engine reports a load done whose bytes never came (vLLM would decode
    from stale blocks). Expected: the client checks the socket's server
    (its ``SO_PEERCRED`` uid, the engine socket's owner or root) and keeps
    to the gRPC stream when it is another user's."""
    import json
    import shutil
    import subprocess
    import sys

    from kvd.client.engine_client import EngineClient
    from kvd.command_wire import command_socket_path
    from kvd.requests import LoadRequest
    from kvd.testing.fakes import wait_events
    from kvd.testing.security import NOBODY, reachable_dir
    from kvd.testing.sessions import register_request

    workdir = reachable_dir()
    os.chmod(workdir, 0o1777)  # a shared sticky directory, as /tmp
    d = start_daemon(workdir, "kvd", "--command-socket", "false")
    src = Engine(d, "src-c", SHAPE, seed=3)  # its session on the stream, before the impostor binds
    path = command_socket_path(d.socket)
    opened = frame(pb.SessionEvent(opened=pb.SessionOpened(agent_name="kvd-x", daemon_version="0")).SerializeToString())
    done = frame(pb.SessionEvent(recv_done=pb.RecvDone(request_id="c-1", num_blocks=1)).SerializeToString())
    impostor = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-I", "-c",
         _IMPOSTOR, path, opened.hex(), done.hex()], stdout=subprocess.PIPE, text=True)
    dec = Engine(d, "victim-c", SHAPE, open_session=False)
    client = None
    try:
        assert json.loads(impostor.stdout.readline()) == {"ready": NOBODY}
        assert os.stat(path).st_uid == NOBODY
        client = EngineClient(d.socket)
        client.register(register_request("victim-c", SHAPE, dec.seg), timeout_s=10)
        client.start_session()
        assert client.wait_opened(10)
        src.hold("c-1", [3])
        client.load(LoadRequest("c-1", [[5]], "src-c", d.peer_address, [[3]], "c-1", timeout_s=10))
        (ev,) = wait_events(client, lambda evs: len(evs) == 1, timeout_s=20)
        landed = dec.same_blocks([5], src, [3])
        client.close()
        client = None
        impostor.wait(30)
        frames = [pb.SessionCommand.FromString(bytes.fromhex(json.loads(ln)["frame"]))
                  for ln in impostor.stdout.read().splitlines()]
        stolen = [f.open.session_token for f in frames if f.HasField("open")]
        assert d.proc.poll() is None
        assert not stolen, (f"the impostor (uid {NOBODY}) got the session token {stolen[0][:6]}... and "
                            f"{len(frames) - 1} commands; the client reported {ev.WhichOneof('event')} for c-1, "
                            f"its bytes landed: {landed}")
        assert ev.WhichOneof("event") == "recv_done" and landed
    finally:
        if client is not None:
            client.close()
        if impostor.poll() is None:
            impostor.kill()
            impostor.wait()
        dec.close()
        src.close()
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# As another local user: binds the fd side channel's path (argv[1]) in a
# directory it may write, accepts one connection and prints how many fds and
# bytes it received (a JSON line). Stdlib only.
_FD_SQUATTER = r"""
import array, json, os, socket, sys
path, how = sys.argv[1], sys.argv[2]
if how == "own-dir":  # a directory of its own in the shared one: owned by it, writable by no other
    os.mkdir(os.path.dirname(path), 0o755)
if how == "symlink":  # the path a link to a socket in a directory of its own elsewhere
    own = os.path.join(os.path.dirname(path), "own")
    os.mkdir(own, 0o755)
    os.symlink(os.path.join(own, "fd.sock"), path)
    path = os.path.join(own, "fd.sock")
if how in ("engine-socket", "own-dir"):  # the engine socket beside it too: its owner is then the squatter
    e = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    e.bind(path[:-len(".fd")])
    e.listen(4)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.bind(path)
os.chmod(path, 0o777)
s.listen(4)
print(json.dumps({"ready": os.getuid()}), flush=True)
s.settimeout(20)  # no connection at all (a connect denied through its link) ends the wait
fds = array.array("i")
try:
    c, _ = s.accept()
    c.settimeout(30)
    data, anc, _, _ = c.recvmsg(4096, socket.CMSG_SPACE(64 * fds.itemsize))
except OSError:
    data, anc = b"", []
for level, kind, raw in anc:
    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
        fds.frombytes(raw[:len(raw) - len(raw) % fds.itemsize])
print(json.dumps({"fds": len(fds), "bytes": len(data)}), flush=True)
"""


@needs_root
@pytest.mark.parametrize("how", ["fd-channel", "engine-socket", "own-dir", "symlink"])
def test_an_engine_hands_its_kv_cache_fds_to_no_side_channel_another_user_serves(how):
    """The engine starts before its daemon (a supported order: it waits for
    the daemon) or re-registers after a restart, and its engine socket's
    directory is a shared sticky one (``/tmp`` style). Another local user
    (nobody) binds ``<engine_socket>.fd`` first. Before: the engine's client
    connected and sent its sealed KV-cache memfds there with ``SCM_RIGHTS``
    (attacker review: the impostor read and overwrote the cache). Expected:
    the client checks the side channel's server (``SO_PEERCRED``: root, the
    engine socket's owner or its own uid) before anything is sent, and the
    registration fails naming the uid. The fixes' reviews got past two
    weaker checks: with the engine socket bound by the squatter too, its
    owner is the squatter (``engine-socket``); in a directory the squatter
    made for itself in the shared one, the directory's owner is too
    (``own-dir``), and a link to one elsewhere resolves there (``symlink``).
    A server of another uid is trusted only where nobody else could have put
    the socket (:func:`kvd.client.channel.server_refusal`)."""
    import json
    import shutil
    import subprocess
    import sys
    import time

    from kvd.client.fd_handover import HandoverError, hand_over
    from kvd.fd_wire import fd_socket_path
    from kvd.testing.security import NOBODY, reachable_dir

    workdir = reachable_dir()
    os.chmod(workdir, 0o1777)
    # No daemon yet; in "own-dir" the socket's directory is the squatter's to make.
    engine_socket = os.path.join(workdir, "kvd", "kvd.sock") if how == "own-dir" else os.path.join(workdir, "kvd.sock")
    path = fd_socket_path(engine_socket)
    squatter = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-I", "-c",
         _FD_SQUATTER, path, how], stdout=subprocess.PIPE, text=True)
    fd = os.memfd_create("kv-cache", os.MFD_ALLOW_SEALING)
    try:
        assert json.loads(squatter.stdout.readline()) == {"ready": NOBODY}
        os.write(fd, b"SECRET-PROMPT-KV")
        # Where the kernel protects links in sticky directories (fs.protected_symlinks = 1), the
        # connect itself is denied through another user's link: refused either way.
        said = f"served by uid {NOBODY}|Permission denied" if how == "symlink" else f"served by uid {NOBODY}"
        with pytest.raises(HandoverError, match=said):
            hand_over(engine_socket, [fd], timeout_s=5, deadline=time.monotonic() + 5)
        got = json.loads(squatter.stdout.readline())
        assert got["fds"] == 0, f"the squatter (uid {NOBODY}) received {got['fds']} fds of the KV cache"
        assert got["bytes"] == 0
    finally:
        os.close(fd)
        if squatter.poll() is None:
            squatter.kill()
        squatter.wait()
        shutil.rmtree(workdir, ignore_errors=True)


@needs_root
@pytest.mark.parametrize("backlog_full_s", [0, 2], ids=["accepting", "backlog-full"])
def test_an_engine_registers_with_no_engine_socket_another_user_bound_first(backlog_full_s):
    """Another local user binds the engine socket's path in a shared sticky
    directory before the daemon starts: the engine's RegisterEngine (and
    then its session) would go to it. Expected: the client checks who
    serves the engine socket (one ``connect()``, ``SO_PEERCRED``) and
    refuses, PERMISSION_DENIED, before the call; the squatter gets no byte
    of it. A squatter whose backlog is full makes that check's ``connect()``
    time out; the fixes' review then had gRPC's own connect reach it once it
    accepted: a check that could not be made now fails the call
    (UNAVAILABLE)."""
    import json
    import shutil
    import subprocess
    import sys
    import types

    import grpc

    from kvd.client.channel import EngineClientError
    from kvd.client.engine_client import EngineClient
    from kvd.testing.security import COUNTING_LISTENER, NOBODY, reachable_dir
    from kvd.testing.sessions import register_request

    workdir = reachable_dir()
    os.chmod(workdir, 0o1777)
    engine_socket = os.path.join(workdir, "kvd.sock")
    squatter = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-I", "-c",
         COUNTING_LISTENER, "unix", engine_socket, *([str(backlog_full_s)] if backlog_full_s else [])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    client = None
    try:
        assert json.loads(squatter.stdout.readline())["ready"] == NOBODY
        client = EngineClient(engine_socket)
        seg = types.SimpleNamespace(name="/kvd-victim-e", size=SHAPE.num_layers * SHAPE.num_blocks * SHAPE.block_len)
        with pytest.raises(EngineClientError) as err:
            client.register(register_request("victim-e", SHAPE, seg), timeout_s=5)
        # With its backlog full the checks' connects time out until it accepts (after 2 s), and
        # the next one finds its uid; a check still timing out at the deadline fails the call too.
        said, code = str(err.value), err.value.code
        refused = code == grpc.StatusCode.PERMISSION_DENIED and f"served by uid {NOBODY}" in said
        unchecked = backlog_full_s and code == grpc.StatusCode.UNAVAILABLE and "was not checked" in said
        assert refused or unchecked, err.value
        squatter.stdin.write("\n")
        squatter.stdin.flush()
        assert json.loads(squatter.stdout.readline())["bytes"] == 0
    finally:
        if client is not None:
            client.close()
        if squatter.poll() is None:
            squatter.kill()
        squatter.wait()
        shutil.rmtree(workdir, ignore_errors=True)


@needs_root
def test_an_engine_uses_a_daemon_of_another_uid_whose_directory_only_that_uid_may_write(caplog):
    """The honest side of the checks above: a daemon run as a user of its
    own (nobody here; the systemd unit's ``kvd``) in a directory only that
    user may write, under directories only root may write (``/run/kvd``): a
    root engine hands over its memfd, registers and opens its session on the
    command socket."""
    import logging
    import shutil
    import subprocess
    import sys

    import stat
    import tempfile

    from kvd.client.engine_client import EngineClient
    from kvd.testing.memfd import MemfdSegment
    from kvd.testing.security import NOBODY
    from kvd.testing.sessions import register_request

    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                            sys.executable, "-c", "import kvd.cli"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"uid {NOBODY} cannot import this checkout's kvd: {probe.stderr.strip().splitlines()[-1:]}")
    if os.stat("/run").st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        pytest.skip("/run is writable by others here")
    # /run: root's, mode 0755, as under the unit's RuntimeDirectory
    workdir = tempfile.mkdtemp(prefix="kvd-test-", dir="/run")
    os.chmod(workdir, 0o755)
    os.chown(workdir, NOBODY, NOBODY)  # only nobody (and root) may write it
    d = start_daemon(workdir, "kvd", env={"HOME": workdir},
                     wrap=("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"))
    seg = client = None
    try:
        assert os.stat(f"/proc/{d.proc.pid}").st_uid == NOBODY
        seg = MemfdSegment(SHAPE.size, d.socket)
        client = EngineClient(d.socket)
        with caplog.at_level(logging.INFO, logger="kvd.client"):
            client.register(register_request("other-uid", SHAPE, seg), timeout_s=20)
            client.start_session()
            assert client.wait_opened(10)
        assert "gRPC stream" not in caplog.text, caplog.text
        assert d.stats().engines == 1
    finally:
        if client is not None:
            client.close()
        if seg is not None:
            seg.close()
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@needs_root
def test_the_socket_path_rule_walks_every_name_as_the_kernel_resolves_it():
    """Unit, on real files: :func:`kvd.client.channel.untrusted_step`. The
    third review's rule walked the resolved path (``os.path.realpath``)
    after the connect, and a squatter swapping its ``/tmp/kvd`` with a link
    to ``/`` (``renameat2(RENAME_EXCHANGE)`` in a loop) passed it in ~20 %
    of the checks; now the first directory others may write ends the walk,
    so no name it read could have been swapped."""
    import shutil
    import tempfile

    from kvd.client.channel import server_refusal, untrusted_step
    from kvd.testing.security import NOBODY

    import stat

    if os.stat("/run").st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        pytest.skip("/run is writable by others here")
    shared = tempfile.mkdtemp(prefix="kvdsec-")
    os.chmod(shared, 0o1777)
    trusted = tempfile.mkdtemp(prefix="kvd-test-", dir="/run")
    try:
        own = os.path.join(shared, "kvd")
        os.mkdir(own, 0o755)
        os.chown(own, NOBODY, NOBODY)
        open(os.path.join(own, "engine.sock.fd"), "w").close()
        assert "lets others put files there" in untrusted_step(os.path.join(own, "engine.sock.fd"), (0, NOBODY))
        why = server_refusal(NOBODY, os.path.join(own, "engine.sock.fd"))
        assert why and "(owner uid 0, mode 1777) lets others put files there" in why, why  # /tmp, or shared
        # The squatter's link to a directory only root may write: refused at the link, whoever's it is.
        os.symlink(trusted, os.path.join(shared, "lnk"))
        os.lchown(os.path.join(shared, "lnk"), NOBODY, NOBODY)
        open(os.path.join(trusted, "engine.sock.fd"), "w").close()
        assert "lets others put files there" in untrusted_step(os.path.join(shared, "lnk", "engine.sock.fd"), (0,))
        # Root's own links and ".." are followed as the kernel does: /run/x/../x/name is fine.
        name = os.path.basename(trusted)
        assert untrusted_step(f"/run/{name}/../{name}/engine.sock.fd", (0,)) is None
        root_link = os.path.join(trusted, "again")
        os.symlink(trusted, root_link)  # root's
        assert untrusted_step(os.path.join(root_link, "engine.sock.fd"), (0,)) is None
        nobodys = os.path.join(trusted, "theirs")
        os.symlink(trusted, nobodys)
        os.lchown(nobodys, NOBODY, NOBODY)
        assert untrusted_step(os.path.join(nobodys, "engine.sock.fd"), (0,)) == \
            f"the symbolic link {nobodys} is uid {NOBODY}'s"
        # A server of root (trusted in a sticky directory of root's) behind another user's link and a
        # "..": the kernel follows the link and takes ".." in its target, so the link is walked too
        # (a textual abspath dropped "L/..", and the link's owner flipped it after the look).
        rd = os.path.join(shared, "rd")
        os.mkdir(rd, 0o755)
        with socket.socket(socket.AF_UNIX) as srv:
            srv.bind(os.path.join(rd, "kvd.sock"))
            assert server_refusal(0, os.path.join(rd, "kvd.sock")) is None
            os.symlink(rd, os.path.join(shared, "L"))
            os.lchown(os.path.join(shared, "L"), NOBODY, NOBODY)
            why = server_refusal(0, f"{shared}/L/../rd/kvd.sock")
            assert why and f"the symbolic link {shared}/L is uid {NOBODY}'s" in why, why
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(trusted, ignore_errors=True)


# As another local user: one connection to the command socket argv[1] per
# frame given (hex, argv[2:]), each sent first; prints the events each got
# back until the daemon closed it (hex, one JSON list per connection). Stdlib only.
_SESSION_AS_OTHER = r"""
import json, socket, struct, sys
for raw in sys.argv[2:]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(sys.argv[1])
    s.sendall(bytes.fromhex(raw))
    buf, got = b"", []
    while True:
        data = s.recv(65536)
        if not data:
            break
        buf += data
    while len(buf) >= 4:
        (n,) = struct.unpack_from("<I", buf)
        got.append(buf[4:4 + n].hex())
        buf = buf[4 + n:]
    print(json.dumps(got), flush=True)
"""


@needs_root
def test_another_user_cannot_open_an_engines_session_on_the_command_socket_even_with_its_token():
    """Another admitted local user (nobody: in ``allowed_uids`` and the
    socket's group) learned an engine's session token (a log, a core dump,
    an impostor socket) and opens that engine's session on the command
    socket, with the token and without: both are ``PERMISSION_DENIED`` (the
    token counts only for the registering uid), the connection is closed,
    and the engine's own session serves on (a hold and release answered)."""
    import json
    import shutil
    import subprocess
    import sys

    from kvd.command_wire import command_socket_path, refusal
    from kvd.testing.security import NOBODY, reachable_dir
    from kvd.testing.sessions import event_kind

    workdir = reachable_dir()
    d = start_daemon(workdir, "kvd", "--command-socket", "true", "--engine-socket-group", str(NOBODY),
                     "--allowed-uids", str(NOBODY))
    victim = Engine(d, "victim-t", SHAPE)
    try:
        worker = pb.EngineWorker(engine_id="victim-t", tp_rank=0)
        tries = [frame(pb.SessionCommand(open=pb.OpenSession(worker=worker, session_token=t)).SerializeToString())
                 for t in (victim.registered.session_token, "")]
        r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
                            "-I", "-c", _SESSION_AS_OTHER, command_socket_path(d.socket), *(t.hex() for t in tries)],
                           capture_output=True, text=True, timeout=120)
        answers = [[pb.SessionEvent.FromString(bytes.fromhex(h)) for h in json.loads(ln)]
                   for ln in r.stdout.splitlines()]
        assert len(answers) == 2, r.stderr[-2000:]
        for got in answers:
            assert [e.WhichOneof("event") for e in got] == ["rejected"], got
            code, details = refusal(got[0].rejected.request_id, got[0].rejected.reason)
            assert code == "PERMISSION_DENIED" and f"uid {NOBODY} gid" in details, details
        victim.hold("t-1", [2])
        victim.release("t-1")
        ev = victim.wait("t-1", 30)
        assert event_kind(ev) == "send_done" and ev.send_done.released, ev
        assert d.proc.poll() is None and d.stats().engines == 1
    finally:
        victim.close()
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_session_flooding_rejections_it_never_reads_does_not_flood_the_daemons_log(tmp_path):
    """An admitted engine opens its own session on the command socket and
    sends 200,000 empty frames (4 bytes each: a SessionCommand with no
    command) without reading. Each is rejected ("unexpected command"); once
    its socket is full the events queue, and past ``BOUNDS.max_pending_events``
    the session is ended (its connection with it) rather than the oldest
    events dropped one by one with a line each. Expected: the daemon's log
    stays small (the drop logged once), and the daemon serves on."""
    d = start_daemon(str(tmp_path), "kvd", "--command-socket", "true", log_level="warning")
    eng = Engine(d, "flood-e", SHAPE, open_session=False)
    conn = CommandConnection.connect(d.socket, max_message_bytes=64 << 20, timeout_s=10)
    sent = 200_000 * 4
    try:
        worker = pb.EngineWorker(engine_id="flood-e", tp_rank=0)
        conn.send([pb.SessionCommand(open=pb.OpenSession(worker=worker, session_token=eng.registered.session_token))])
        events = conn.events()
        assert next(events).WhichOneof("event") == "opened"  # then nothing is read
        try:
            conn.send([pb.SessionCommand()] * 200_000)  # 4 bytes each: an empty frame
        except OSError:
            pass  # the daemon ended the connection while the flood was still being written
        wait_until(lambda: "does not read them" in d.log(), 60, "the session dropped past the event bound")
        assert d.proc.poll() is None
        assert d.stats().engines == 1  # the worker stays registered; its engine may open a new session
    finally:
        conn.shutdown()
        conn.close()
        eng.close()
        assert d.stop() == 0  # the log is complete
    lines = d.log().splitlines()
    logged = sum(len(ln) + 1 for ln in lines)
    assert sum("does not read them" in ln for ln in lines) == 1
    assert len(lines) < 100, f"{len(lines)} lines ({logged} bytes) of log for {sent} bytes sent"


def _sticky_dir() -> str:
    """A fresh directory every user may write, sticky (mode 1777, as
    ``/tmp``), removed when this process exits."""
    from kvd.testing.security import reachable_dir

    workdir = reachable_dir()
    os.chmod(workdir, 0o1777)
    return workdir


@contextlib.contextmanager
def _victim_in_a_sticky_dir():
    """A daemon whose sockets are in a shared sticky directory (mode 1777,
    which another user may bind names in) and an engine client registered
    with it: yields ``(daemon, client)``; stops and removes all after."""
    from kvd.client.engine_client import EngineClient
    from kvd.testing.sessions import register_request
    from kvd.testing.shm import ShmSegment

    workdir = _sticky_dir()
    d = start_daemon(workdir, "kvd")
    seg = ShmSegment(SHAPE.size)
    client = EngineClient(d.socket)
    try:
        client.register(register_request("victim-r", SHAPE, seg), timeout_s=10)
        yield d, client
    finally:
        client.close()
        seg.close()
        if d.proc.poll() is None:
            d.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def _squatter(path: str):
    """Another local user (uid 65534) listening at ``path``: yields a
    function that returns ``{"connections": n, "bytes": n}`` it got so far
    (once: the listener ends)."""
    from kvd.testing.security import COUNTING_LISTENER, NOBODY

    proc = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-I", "-c",
         COUNTING_LISTENER, "unix", path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(proc.stdout.readline())["ready"] == NOBODY

        def got() -> dict:
            proc.stdin.write("\n")
            proc.stdin.flush()
            return json.loads(proc.stdout.readline())
        yield got
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@needs_root
def test_calls_that_do_not_wait_check_the_engine_socket_server_after_a_daemon_restart():
    """The daemon stops and, in the gap, another local user binds the engine
    socket's path in the shared sticky directory. gRPC reconnects to
    whatever serves the path, and the calls that do not wait for the daemon
    (``UnregisterEngine`` with the session token, ``RenewLeases`` with
    request ids, ``GetStats``) were not preceded by the check the waiting
    calls make (fourth review's residual). Expected: each is refused,
    PERMISSION_DENIED naming the squatter's uid, and the squatter reads no
    byte."""
    from kvd.client.channel import EngineClientError
    from kvd.requests import LeaseRenewal
    from kvd.testing.security import NOBODY

    with _victim_in_a_sticky_dir() as (d, client):
        assert client.get_stats(wait_for_ready=False).engines == 1
        assert d.stop() == 0
        with _squatter(d.socket) as squatter_got:
            calls = {
                "UnregisterEngine": lambda: client.unregister(timeout_s=3),
                "GetStats": lambda: client.get_stats(timeout_s=3, wait_for_ready=False),
                "RenewLeases": lambda: client.renew_leases("victim-p", "127.0.0.1:1",
                                                           [LeaseRenewal(RID, [[1]])], timeout_s=3).result(10),
            }
            for name, call in calls.items():
                with pytest.raises(EngineClientError) as err:
                    call()
                assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and \
                    f"served by uid {NOBODY}" in str(err.value), (name, err.value)
            assert squatter_got()["bytes"] == 0


@needs_root
def test_a_call_in_a_daemon_restart_gap_is_not_made_so_grpc_does_not_reconnect_to_a_squatter():
    """The daemon stops and a call comes in the gap. Made, it fails and
    leaves gRPC reconnecting in the background; another local user that
    binds the engine socket's path then gets a connection no look checked,
    which later calls use even after the real daemon is back (attacker
    review: the session token and renewals reached it). Expected: the gap
    call is refused before gRPC, UNAVAILABLE saying no daemon listens, and
    the squatter bound after it gets no connection at all."""
    from kvd.client.channel import EngineClientError

    with _victim_in_a_sticky_dir() as (d, client):
        assert d.stop() == 0
        with pytest.raises(EngineClientError) as err:
            client.get_stats(timeout_s=1, wait_for_ready=False)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and "no kvd daemon" in str(err.value), err.value
        with _squatter(d.socket) as squatter_got:
            time.sleep(3)  # gRPC's reconnect backoff starts at 1 s: a reconnecting channel would have come by now
            assert squatter_got() == {"connections": 0, "bytes": 0}


@needs_root
@pytest.mark.parametrize("wait", [False, True], ids=["no-wait", "wait"])
def test_a_daemon_gone_between_the_look_and_the_call_leaves_no_grpc_connection_for_a_squatter(monkeypatch, wait):
    """The race the look before each call leaves: it sees the daemon, which
    then goes away before gRPC connects (a restart). gRPC's connect fails,
    and its channel reconnects in the background on its own backoff; a call
    that waits for the daemon (``wait_for_ready``) stays queued on it. Another
    local user that binds the path in the shared sticky directory then gets a
    connection no look checked: the queued call, and any later call whose
    look sees nobody there or the real daemon back (the review's restart
    scenario). Simulated by a look that answers "the daemon" once while
    nobody listens. Expected: the call fails (the waiting one goes on
    looking until its deadline and finds the squatter: PERMISSION_DENIED),
    the channel is replaced, and the squatter gets no byte, and with no
    call in flight no connection either: every connection it got was one of
    the client's looks (one ``connect()``, no byte)."""
    import kvd.client.engine_client as engine_client
    from kvd.client.channel import EngineClientError
    from kvd.testing.security import NOBODY

    with _victim_in_a_sticky_dir() as (d, client):
        assert d.stop() == 0
        looks = []
        real_probe = engine_client.probe_unix_socket

        def stale_look(address):
            looks.append(address)
            return None if len(looks) == 1 else real_probe(address)

        monkeypatch.setattr(engine_client, "probe_unix_socket", stale_look)
        outcome: dict = {}

        def call():
            try:
                outcome["ok"] = client.get_stats(timeout_s=6 if wait else 1, wait_for_ready=wait)
            except EngineClientError as e:
                outcome["error"] = e

        caller = threading.Thread(target=call)
        caller.start()
        if not wait:
            caller.join(10)
        time.sleep(0.5)
        with _squatter(d.socket) as squatter_got:
            caller.join(15)
            assert not caller.is_alive()
            error = outcome.get("error")
            assert error is not None, outcome
            if wait:
                assert error.code == grpc.StatusCode.PERMISSION_DENIED and \
                    f"served by uid {NOBODY}" in str(error), error
            else:
                assert error.code == grpc.StatusCode.UNAVAILABLE, error
            looked = len(looks)
            time.sleep(3)  # gRPC's reconnect backoff starts at 1 s: a reconnecting channel would have come by now
            got = squatter_got()
        assert got["bytes"] == 0, got
        assert got["connections"] <= looked - 1 and len(looks) == looked, (got, looks)


@needs_root
def test_another_users_link_at_the_engine_socket_path_is_not_the_daemon_whatever_it_points_to(tmp_path):
    """In a restart's gap another local user puts a symbolic link of its own
    at the engine socket's path in the shared sticky directory, pointing at
    a socket root serves (containerd's, systemd's: a root listener stands
    in). The look's ``SO_PEERCRED`` said root, trusted anywhere, and the
    link's owner could flip it to its own listener for gRPC's connect right
    after the look (attacker review: the session token, request ids and the
    RegisterEngine reached it). Expected: the link is refused, whoever
    serves what it points to: PERMISSION_DENIED naming it, and the root
    listener gets no byte."""
    from kvd.client.channel import EngineClientError
    from kvd.requests import LeaseRenewal
    from kvd.testing.security import NOBODY

    root_socket = str(tmp_path / "root.sock")
    with _victim_in_a_sticky_dir() as (d, client), contextlib.closing(socket.socket(socket.AF_UNIX)) as root_srv:
        root_srv.bind(root_socket)
        root_srv.listen(8)
        root_srv.settimeout(0.1)
        assert d.stop() == 0
        subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "ln", "-s",
                        root_socket, d.socket], check=True)
        assert os.lstat(d.socket).st_uid == NOBODY
        calls = {
            "GetStats": lambda: client.get_stats(timeout_s=2, wait_for_ready=False),
            "GetStats(wait)": lambda: client.get_stats(timeout_s=2),
            "UnregisterEngine": lambda: client.unregister(timeout_s=2),
            "RenewLeases": lambda: client.renew_leases("victim-p", "127.0.0.1:1",
                                                       [LeaseRenewal(RID, [[1]])], timeout_s=2).result(10),
        }
        for name, call in calls.items():
            with pytest.raises(EngineClientError) as err:
                call()
            assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and \
                f"the symbolic link {d.socket} is uid {NOBODY}'s" in str(err.value), (name, err.value)
        got = 0
        while True:  # the looks' connects, each closed at once with no byte
            try:
                conn, _ = root_srv.accept()
            except TimeoutError:
                break
            with conn:
                conn.settimeout(1)
                got += len(conn.recv(65536))
        assert got == 0


# An engine client as another user (argv[2], after the imports and the
# channel are made as root): one GetStats that does not wait on engine socket
# argv[1], printed as one JSON line; then, after a line on stdin, 3 s more
# alive (its channel with it) before it prints {"done": true} and closes.
_ENGINE_AS_USER = r"""
import json, os, sys, time
from kvd.client.engine_client import EngineClient, EngineClientError
path, uid = sys.argv[1], int(sys.argv[2])
client = EngineClient(path)
os.setgroups([]); os.setgid(uid); os.setuid(uid)
out = {}
try:
    client.get_stats(timeout_s=2, wait_for_ready=False)
    out["call"] = "made"
except EngineClientError as e:
    out = {"call": type(e).__name__, "code": e.code.name if e.code else "", "message": str(e)}
print(json.dumps(out), flush=True)
sys.stdin.readline()
time.sleep(3)
print(json.dumps({"done": True}), flush=True)
client.close()
"""

@needs_root
def test_an_engine_refuses_a_call_where_its_look_is_denied_so_a_socket_opened_after_gets_nothing():
    """An engine of an ordinary user, its engine socket in a shared sticky
    directory: in a restart's gap another user binds the path with mode 000,
    so the engine's look gets EACCES. The call went on to gRPC (the denial
    was "left to the call to say"), failed, and gRPC's channel reconnected
    on its backoff; the other user then opened its socket (0777) and got
    that connection, over which the next calls went (attacker review: the
    session token and request ids reached it). Expected: the call is
    refused before gRPC (EngineSocketDenied, naming the socket's owner),
    and the socket opened after gets no connection."""
    from kvd.testing.processes import child_env
    from kvd.testing.security import NOBODY, OUTSIDER

    workdir = _sticky_dir()
    path = os.path.join(workdir, "kvd.sock")
    with _squatter(path) as squatter_got:
        os.chmod(path, 0)  # the squatter's socket shut (root's chmod stands in for its own)
        engine = subprocess.Popen([sys.executable, "-c", _ENGINE_AS_USER, path, str(OUTSIDER)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env())
        try:
            out = json.loads(engine.stdout.readline())
            assert out.get("call") == "EngineSocketDenied" and "permission denied connecting" in out["message"] \
                and f"owned by uid {NOBODY}" in out["message"], out
            os.chmod(path, 0o777)  # opened: a channel left reconnecting would come now
            engine.stdin.write("\n")
            engine.stdin.flush()
            assert json.loads(engine.stdout.readline()) == {"done": True}
            assert squatter_got() == {"connections": 0, "bytes": 0}
        finally:
            if engine.poll() is None:
                engine.kill()
            engine.wait()
