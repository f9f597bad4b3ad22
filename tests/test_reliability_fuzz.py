"""Reliability, scenario 9 (docs/RELIABILITY.md): hostile input, property-based.

Hypothesis generates every message of EngineService and PeerService (and raw,
malformed bytes for each method) against ONE running daemon, and forged
HandshakeResponses (truncated or mangled NIXL agent metadata, bogus layouts,
regions and base addresses) from a fake PeerService to that daemon's decode
side. Properties, for every message:

- a unary call ends with OK or a deliberate status with a message (never
  UNKNOWN or INTERNAL, which mean an exception the daemon did not handle;
  bytes that do not parse as the message are refused by gRPC itself, UNKNOWN
  "Error parsing message", before any daemon code runs, or on PeerService,
  whose requests are parsed only once the caller passed its check,
  INVALID_ARGUMENT naming the parse error);
- a session command gets its answer: a load exactly one RecvDone, LoadFailed
  or CommandRejected; a hold a CommandRejected or a lease that a release
  ends; a release of nothing a CommandRejected; an AbortLoad nothing (it is
  fire-and-forget by contract), unless refused as it is read (a remote TP
  size past the bound: a CommandRejected);
- the daemon keeps serving; afterwards its stats show no leaked lease,
  transfer, handle, prepped list or pending event, and its RSS is reported.

Message count: ``KVD_FUZZ_EXAMPLES`` (default 2,000 for CI; the full
run is ``KVD_FUZZ_EXAMPLES=10000``), split across the tests below by SHARE.
The ``ci`` profile is derandomized (same examples every run); set
``KVD_FUZZ_PROFILE=random`` to explore new ones.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.core.state import PROTOCOL_VERSION
from kvd.command_wire import Deframer, command_socket_path, frame
from kvd.testing.daemons import start_daemon
from kvd.testing.fakes import FakePeer, closed_address
from kvd.testing.fuzz import (
    SHAPE,
    aborts,
    any_u32,
    command_block_ids,
    command_groups,
    doubles,
    forged,
    holds,
    loads,
    register_requests,
    text,
    workers,
)
from kvd.testing.sessions import Engine, event_kind, register_request
from kvd.testing.shm import ShmSegment
from kvd.testing.util import rss_kib, wait_until
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

TOTAL = int(os.environ.get("KVD_FUZZ_EXAMPLES", "2000"))
SHARE = {  # fraction of TOTAL each test sends
    "register": 0.12, "unregister_stats": 0.04, "session_open": 0.04, "session_commands": 0.32,
    "raw_bytes": 0.06, "peer_handshake": 0.08, "push": 0.10, "notify": 0.04, "claim": 0.04,
    "renew": 0.04, "forged_handshake": 0.16, "framed": 0.04,
}
SENT: dict[str, int] = {k: 0 for k in SHARE}

settings.register_profile("ci", derandomize=True, deadline=None, database=None, print_blob=True,
                          suppress_health_check=list(HealthCheck))
settings.register_profile("random", deadline=None, database=None, print_blob=True,
                          suppress_health_check=list(HealthCheck))
PROFILE = settings.get_profile(os.environ.get("KVD_FUZZ_PROFILE", "ci"))


def examples(name: str):
    return settings(PROFILE, max_examples=max(1, round(TOTAL * SHARE[name])))


REFUSED = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)  # "the daemon did not handle it"
EVENT_WAIT_S = 20.0

# -------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The daemon under fuzz, with a real prefill and a real decode worker.
    Loads between them go through NIXL (``--same-node-copy false``): the
    fuzz drives handshakes, READs and notifications, and its loads name
    request ids no lease holds (a same-node copy waits for the hold until
    the load's deadline; tests/test_same_node.py covers that path)."""
    # The gate's connection caps are tested in tests/test_security_gate.py;
    # here they stay out of the way (a busy run saw connections refused past
    # the per-uid cap of 128 when Daemon.stub() opened a channel per call).
    d = start_daemon(str(tmp_path_factory.mktemp("fuzz")), "kvd", "--handshake-timeout-s", "5",
                     "--same-node-copy", "false", "--max-engine-connections", "8192",
                     "--max-engine-connections-per-uid", "8192")
    prefill = Engine(d, "fz-prefill", SHAPE, seed=2)
    decode = Engine(d, "fz-decode", SHAPE)
    spare = ShmSegment(SHAPE.size)
    state = dict(daemon=d, prefill=prefill, decode=decode, spare=spare, rss0=rss_kib(d.proc.pid),
                 base=d.stats(), closed=closed_address())
    yield state
    decode.close()
    prefill.close()
    spare.close()
    assert d.stop() == 0, "the daemon did not exit cleanly after the fuzz"


RSS_AFTER: dict[str, int] = {}  # daemon RSS (KiB) after each test, reported at the end


@pytest.fixture(autouse=True)
def _rss_after_each_test(request, target):
    yield
    if target["daemon"].proc.poll() is None:
        RSS_AFTER[request.node.name.removeprefix("test_fuzz_")] = rss_kib(target["daemon"].proc.pid)


def _status(fn):
    """Runs a unary call; returns its status code (OK when it returned)."""
    try:
        fn()
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def _assert_deliberate(code, details, what):
    assert code not in REFUSED, f"{what}: {code.name}: {details}"
    if code != grpc.StatusCode.OK:
        assert details, f"{what}: {code.name} without a message"


# ----------------------------------------------------------------- EngineService
def test_fuzz_register_engine(target):
    d, spare = target["daemon"], target["spare"]
    stub = d.stub()

    @examples("register")
    @given(req=register_requests(spare.name))
    def prop(req):
        SENT["register"] += 1
        code, details = _status(lambda: stub.RegisterEngine(req, timeout=30))
        _assert_deliberate(code, details, "RegisterEngine")
        if code == grpc.StatusCode.OK:  # a valid registration: undo it
            stub.UnregisterEngine(pb.UnregisterEngineRequest(worker=req.worker), timeout=30)

    prop()
    assert d.proc.poll() is None
    assert d.stats().engines == target["base"].engines


def test_fuzz_unregister_and_stats(target):
    stub = target["daemon"].stub()

    @examples("unregister_stats")
    @given(worker=workers, stats=st.booleans())
    def prop(worker, stats):
        SENT["unregister_stats"] += 1
        if worker.engine_id.startswith("fz-"):
            worker.engine_id = "x" + worker.engine_id  # never the module's own workers
        code, details = _status(lambda: stub.UnregisterEngine(pb.UnregisterEngineRequest(worker=worker), timeout=10))
        assert code == grpc.StatusCode.NOT_FOUND, (code, details)
        if stats:
            assert stub.GetStats(pb.StatsRequest(), timeout=10).daemon_version

    prop()


def test_fuzz_session_opening(target):
    """A stream whose first command is not a valid OpenSession is refused with a status."""
    d = target["daemon"]
    channel = grpc.insecure_channel(f"unix:{d.socket}")
    stub = pb_grpc.EngineServiceStub(channel)
    first = st.one_of(
        st.builds(lambda w: pb.SessionCommand(open=pb.OpenSession(worker=w)), workers),
        st.builds(lambda r: pb.SessionCommand(hold=pb.HoldBlocks(request_id=r)), text),
        st.builds(lambda r: pb.SessionCommand(release=pb.ReleaseBlocks(request_id=r)), text),
        st.just(pb.SessionCommand()),
    )

    @examples("session_open")
    @given(cmd=first)
    def prop(cmd):
        SENT["session_open"] += 1
        if cmd.WhichOneof("command") == "open" and cmd.open.worker.engine_id.startswith("fz-"):
            cmd.open.worker.engine_id = "x" + cmd.open.worker.engine_id
        call = stub.Session(iter([cmd]), timeout=10)
        try:
            list(call)  # drained: the stream's status is what counts
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
        assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), (cmd, code, details)
        assert details

    prop()
    channel.close()


def test_fuzz_session_commands(target):
    """Every command on an open session gets its answer; none breaks the stream."""
    eng, p = target["decode"], target["prefill"]
    ids = itertools.count()
    cmds = st.one_of(loads(p.engine_id, p.peer_address, target["closed"]), holds(), aborts(),
                     st.builds(lambda r: pb.SessionCommand(release=pb.ReleaseBlocks(request_id=r)), text),
                     st.just(pb.SessionCommand()),
                     st.builds(lambda w: pb.SessionCommand(open=pb.OpenSession(worker=w)), workers))
    rid_style = st.sampled_from(["unique", "unique", "unique", "empty", "long"])

    @examples("session_commands")
    @given(cmd=cmds, style=rid_style)
    def prop(cmd, style):
        SENT["session_commands"] += 1
        kind = cmd.WhichOneof("command")
        rid = {"unique": f"fz-{next(ids)}", "empty": "", "long": f"fz-{next(ids)}-" + "r" * 5000}[style]
        if kind in ("load", "hold", "release", "abort_load"):
            getattr(cmd, kind).request_id = rid
        else:
            rid = ""
        if kind == "release":
            rid = cmd.release.request_id = f"fz-nothing-{next(ids)}" if style != "empty" else ""
        eng.session.send(**{kind: getattr(cmd, kind)} if kind else {})
        if kind == "load":
            ev = eng.wait(rid, EVENT_WAIT_S)
            assert event_kind(ev) in ("recv_done", "load_failed", "rejected"), ev
            if event_kind(ev) == "load_failed":
                local = [b for g in cmd.load.local_groups for b in g.ids]
                assert ev.load_failed.reason and list(ev.load_failed.failed_block_ids) == local, ev
        elif kind == "hold":
            # Accepted holds end exactly once: released by us, or expired first
            # (a tiny lease); refused holds get a rejection. Either way a
            # release of a lease that is gone is rejected.
            eng.release(rid)
            ev = eng.wait(rid, EVENT_WAIT_S)
            if event_kind(ev) == "rejected" or (event_kind(ev) == "send_done" and ev.send_done.expired):
                assert event_kind(ev) == "send_done" or ev.rejected.reason
                assert event_kind(eng.wait(rid, EVENT_WAIT_S)) == "rejected"
            else:
                assert event_kind(ev) == "send_done" and ev.send_done.released, ev
        elif kind in ("release", None, "open"):
            ev = eng.wait(rid, EVENT_WAIT_S)
            assert event_kind(ev) == "rejected" and ev.rejected.reason, ev
        elif kind == "abort_load" and cmd.abort_load.remote_tp_size > 256:
            ev = eng.wait(rid, EVENT_WAIT_S)  # refused as read (BOUNDS.max_tp_size, or a request id too long)
            assert event_kind(ev) == "rejected" and ev.rejected.reason.startswith("abort_load: "), ev
        # any other abort_load: no event by contract

    prop()
    # Nothing was left unanswered, and the stream still works.
    eng.hold("fz-final", [1], lease_s=60)
    eng.release("fz-final")
    assert eng.wait("fz-final").send_done.released


RAW_METHODS = [("/kvd.v1.EngineService/RegisterEngine", "engine"), ("/kvd.v1.EngineService/UnregisterEngine", "engine"),
               ("/kvd.v1.EngineService/GetStats", "engine"), ("/kvd.v1.PeerService/Handshake", "peer"),
               ("/kvd.v1.PeerService/Push", "peer"), ("/kvd.v1.PeerService/Notify", "peer"),
               ("/kvd.v1.PeerService/Claim", "peer"), ("/kvd.v1.PeerService/Renew", "peer"),
               ("/kvd.v1.PeerService/Holds", "peer"),
               ("/kvd.v1.EngineService/RenewLeases", "engine")]


def test_fuzz_raw_bytes_every_method(target):
    """Undecodable or truncated bytes for every unary method and for the
    session stream: a status (gRPC's own INTERNAL for bytes that do not
    parse), never a dead daemon."""
    d = target["daemon"]
    channels = {"engine": grpc.insecure_channel(f"unix:{d.socket}"), "peer": grpc.insecure_channel(d.peer_address)}
    valid = [register_request("fz-raw", SHAPE, target["spare"]).SerializeToString(),
             pb.SessionCommand(load=pb.LoadBlocks(request_id="r", local_groups=[pb.BlockIds(ids=[1, 2])])
                               ).SerializeToString(),
             pb.HandshakeRequest(engine_id="fz-prefill", protocol_version=PROTOCOL_VERSION).SerializeToString(),
             pb.PushRequest(engine_id="fz-prefill", request_id="r", source_groups=[pb.BlockIds(ids=[1])],
                            reader=pb.HandshakeResponse(agent_metadata=b"m", region_base_addrs=[1]),
                            reader_groups=[pb.BlockIds(ids=[1])], expected_notifications=1).SerializeToString(),
             pb.NotifyRequest(engine_id="fz-prefill", request_id="r", expected_notifications=1).SerializeToString(),
             pb.HoldsRequest(engine_id="fz-prefill", epoch="e", after=3, wait_s=0.5).SerializeToString()]
    payloads = st.one_of(st.binary(max_size=256),
                         st.tuples(st.sampled_from(valid), st.integers(0, 200)).map(lambda t: t[0][:t[1]]),
                         st.tuples(st.sampled_from(valid), st.integers(0, 200), st.integers(0, 255)).map(
                             lambda t: t[0][:t[1]] + bytes([t[2]]) + t[0][t[1] + 1:]))

    @examples("raw_bytes")
    @given(method=st.sampled_from(RAW_METHODS + [("/kvd.v1.EngineService/Session", "engine")]), payload=payloads)
    def prop(method, payload):
        SENT["raw_bytes"] += 1
        path, which = method
        ch = channels[which]
        ident = lambda b: b  # noqa: E731
        if path.endswith("/Session"):
            call = ch.stream_stream(path, request_serializer=ident, response_deserializer=ident)(
                iter([payload]), timeout=10)
            try:
                for _ in call:
                    pass
                code, details = grpc.StatusCode.OK, ""
            except grpc.RpcError as e:
                code, details = e.code(), e.details()
        else:
            code, details = _status(lambda: ch.unary_unary(path, request_serializer=ident,
                                                           response_deserializer=ident)(payload, timeout=10))
        if code in REFUSED:
            # Only gRPC's own refusal of bytes that do not parse, before any daemon code runs.
            assert "Error parsing message" in details or "deserializ" in details.lower(), (path, payload, details)
        if code == grpc.StatusCode.OK and path.endswith("/RegisterEngine"):
            req = pb.RegisterEngineRequest.FromString(payload)
            d.stub().UnregisterEngine(pb.UnregisterEngineRequest(worker=req.worker), timeout=10)

    prop()
    for ch in channels.values():
        ch.close()
    assert d.proc.poll() is None


def test_fuzz_command_socket_frames(target):
    """The command socket (kvd.command_wire frames): bad lengths, truncated
    frames, garbage protobuf, oversize frames and commands before an
    OpenSession. The daemon answers with events that parse (a refusal with
    its reason) and closes the connection once the engine's side ends; it
    keeps serving."""
    d = target["daemon"]
    path = command_socket_path(d.socket)
    if not os.path.exists(path):
        pytest.skip("the daemon offers no command socket (KVD_COMMAND_SOCKET=false)")
    cmd_bytes = st.one_of(
        st.builds(lambda w: pb.SessionCommand(open=pb.OpenSession(worker=w)).SerializeToString(), workers),
        st.builds(lambda r: pb.SessionCommand(release=pb.ReleaseBlocks(request_id=r)).SerializeToString(), text),
        st.just(b""), st.binary(max_size=64))
    piece = st.one_of(
        cmd_bytes.map(frame),                                                   # a whole frame
        st.tuples(cmd_bytes, st.integers(0, 8)).map(lambda t: frame(t[0])[:t[1]]),  # a truncated one
        st.integers(0, 0xFFFFFFFF).map(lambda n: struct.pack("<I", n)),        # a bare length, any size
        st.binary(max_size=32))                                                 # noise

    @examples("framed")
    @given(pieces=st.lists(piece, min_size=1, max_size=4))
    def prop(pieces):
        SENT["framed"] += 1
        for p in pieces:  # no valid OpenSession of a fuzz target's worker: those sessions are the fixture's
            if p[4:] and b"fz-" in p:
                return
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(EVENT_WAIT_S)
            s.connect(path)
            try:
                s.sendall(b"".join(pieces))
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the daemon closed first (an oversize length): what it answered is read below
            data = b""
            while True:
                try:
                    chunk = s.recv(65536)
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                data += chunk
        deframer = Deframer(1 << 20)
        events = [pb.SessionEvent.FromString(b) for b in deframer.feed(data)]
        assert deframer.buffered == 0, (pieces, data)
        assert all(e.WhichOneof("event") == "rejected" and e.rejected.reason for e in events), (pieces, events)

    prop()
    assert d.proc.poll() is None


# ------------------------------------------------------------------- PeerService
def test_fuzz_peer_handshake_requests(target):
    d, p = target["daemon"], target["prefill"]
    stub = pb_grpc.PeerServiceStub(grpc.insecure_channel(d.peer_address))
    reqs = st.builds(pb.HandshakeRequest,
                     engine_id=st.one_of(st.just(p.engine_id), text), tp_rank=st.one_of(st.just(0), any_u32),
                     daemon_version=text, compat_hash=st.one_of(st.just(p.registered.compat_hash), st.just(""), text),
                     protocol_version=st.one_of(st.just(PROTOCOL_VERSION), any_u32))

    @examples("peer_handshake")
    @given(req=reqs)
    def prop(req):
        SENT["peer_handshake"] += 1
        code, details = _status(lambda: stub.Handshake(req, timeout=10))
        _assert_deliberate(code, details, "Handshake")
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION), \
            (code, details)

    prop()


def _describe(daemon, eng) -> pb.HandshakeResponse:
    """``eng`` as its daemon's PeerService describes it (real agent metadata)."""
    return pb_grpc.PeerServiceStub(grpc.insecure_channel(daemon.peer_address)).Handshake(
        pb.HandshakeRequest(engine_id=eng.engine_id, tp_rank=0, compat_hash=eng.registered.compat_hash,
                            protocol_version=PROTOCOL_VERSION), timeout=10)



def test_fuzz_forged_handshake_responses(target):
    """A peer that answers handshakes with forged or mangled descriptions of
    its worker: the decode daemon fails the load (or, when the forgery happens
    to describe real registered memory, completes it), never crashes, never
    hangs, and keeps no agent it could not use."""
    d, p, eng = target["daemon"], target["prefill"], target["decode"]
    real = _describe(d, p)
    current: dict = {}
    fake = FakePeer(lambda request, context: current["response"])
    ids = itertools.count()

    @examples("forged_handshake")
    @given(resp=forged(real, eng.registered.compat_hash),
           local=st.lists(st.integers(0, SHAPE.num_blocks - 1), min_size=1, max_size=4),
           remote=st.lists(st.integers(0, SHAPE.num_blocks - 1), min_size=4, max_size=4))
    def prop(resp, local, remote):
        SENT["forged_handshake"] += 1
        current["response"] = resp
        rid = f"fz-forged-{next(ids)}"
        eng.load(rid, local, None, remote[:len(local)], rid, remote_engine_id=f"forged-{rid}",
                 remote_address=fake.address, timeout_s=10)
        ev = eng.wait(rid, EVENT_WAIT_S)
        assert event_kind(ev) in ("load_failed", "recv_done"), ev
        if event_kind(ev) == "load_failed":
            assert not ev.load_failed.reason.startswith("internal"), ev  # a check caught it, not the catch-all

    try:
        prop()
    finally:
        fake.stop()
    assert d.proc.poll() is None


PEER_OK = (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_fuzz_push_requests(target):
    """Push (the decode daemon asks the prefill daemon to WRITE): held and
    unknown requests, forged reader descriptions (the prefill daemon loads the
    reader's agent metadata), bad block ids and counts. A deliberate status
    each time; a held lease ends exactly once."""
    d, p, eng = target["daemon"], target["prefill"], target["decode"]
    reader = _describe(d, eng)
    stub = pb_grpc.PeerServiceStub(grpc.insecure_channel(d.peer_address))
    ids = itertools.count()
    pushes = st.builds(
        lambda held, rid, e, rank, sg, rd, rrank, dg, n, t: (held, pb.PushRequest(
            engine_id=e, tp_rank=rank, request_id=rid, source_groups=sg, reader=rd, reader_tp_rank=rrank,
            reader_groups=dg, expected_notifications=n, timeout_s=t)),
        st.booleans(), text, st.one_of(st.just(p.engine_id), text), st.one_of(st.just(0), any_u32),
        command_groups, forged(reader, p.registered.compat_hash), st.one_of(st.just(0), any_u32), command_groups,
        st.one_of(st.just(1), any_u32), doubles)

    @examples("push")
    @given(push=pushes)
    def prop(push):
        SENT["push"] += 1
        held, req = push
        if held:
            req.request_id = f"fz-push-{next(ids)}"
            p.hold(req.request_id, [0, 1, 2, 3], lease_s=600)
            # the hold travels on the session stream: let it land before the push
            wait_until(lambda: d.stats().active_leases >= 1, 10, "push lease held", 0.002)
        code, details = _status(lambda: stub.Push(req, timeout=15))
        _assert_deliberate(code, details, "Push")
        assert code in PEER_OK, (code, details)
        if held:  # the lease ends exactly once: by the push's notification, or by our release
            p.release(req.request_id)
            ev = p.wait(req.request_id, EVENT_WAIT_S)
            if event_kind(ev) == "send_done" and not ev.send_done.released:
                assert event_kind(p.wait(req.request_id, EVENT_WAIT_S)) == "rejected"
            else:
                assert event_kind(ev) == "send_done" and ev.send_done.released, ev

    prop()
    assert d.proc.poll() is None


def test_fuzz_notify_requests(target):
    d, p = target["daemon"], target["prefill"]
    stub = pb_grpc.PeerServiceStub(grpc.insecure_channel(d.peer_address))
    reqs = st.builds(pb.NotifyRequest, engine_id=st.one_of(st.just(p.engine_id), text),
                     tp_rank=st.one_of(st.just(0), any_u32), request_id=text,
                     expected_notifications=st.one_of(st.just(1), any_u32))

    @examples("notify")
    @given(req=reqs)
    def prop(req):
        SENT["notify"] += 1
        req.request_id = "fz-notify-" + req.request_id  # never a lease of another test
        code, details = _status(lambda: stub.Notify(req, timeout=10))
        _assert_deliberate(code, details, "Notify")
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), \
            (code, details)

    prop()


def test_fuzz_claim_requests(target):
    """A claim is answered OK only for blocks a lease holds; anything else is
    a deliberate refusal, and no claim changes a lease."""
    d, p = target["daemon"], target["prefill"]
    stub = pb_grpc.PeerServiceStub(grpc.insecure_channel(d.peer_address))
    p.hold("fz-claim-held", [2, 3, 4])
    # Waits stay short (a claim of nothing held waits them out; 5 s at most).
    waits = st.one_of(st.sampled_from([0.0, -1.0, math.nan, -math.inf, 1e-9, 0.01]), st.floats(-10, 0.02))
    reqs = st.builds(pb.ClaimRequest, engine_id=st.one_of(st.just(p.engine_id), text),
                     tp_rank=st.one_of(st.just(0), any_u32),
                     request_id=st.one_of(st.just("held"), text),
                     groups=st.lists(st.builds(pb.BlockIds, ids=command_block_ids), max_size=3),
                     wait_s=waits)

    @examples("claim")
    @given(req=reqs)
    def prop(req):
        SENT["claim"] += 1
        req.request_id = "fz-claim-" + req.request_id
        code, details = _status(lambda: stub.Claim(req, timeout=10))
        _assert_deliberate(code, details, "Claim")
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.PERMISSION_DENIED), (code, details)
        held = (req.engine_id == p.engine_id and req.tp_rank == 0 and req.request_id == "fz-claim-held"
                and len(req.groups) <= 1 and all(set(g.ids) <= {2, 3, 4} for g in req.groups))
        assert (code == grpc.StatusCode.OK) == held, (code, details, req)

    prop()
    p.release("fz-claim-held")
    assert p.wait("fz-claim-held").send_done.released


def test_fuzz_renew_requests(target):
    """A renewal (PeerService.Renew, and EngineService.RenewLeases naming
    this daemon or a closed port) is answered per request: renewed only for
    blocks a lease of the named engine holds, ``not_held`` otherwise; a
    batch past the bounds or an unknown engine is a deliberate status."""
    d, p = target["daemon"], target["prefill"]
    peer = pb_grpc.PeerServiceStub(grpc.insecure_channel(d.peer_address))
    local = pb_grpc.EngineServiceStub(grpc.insecure_channel(f"unix:{d.socket}"))
    p.hold("fz-renew-held", [2, 3, 4])
    wait_until(lambda: d.stats().active_leases >= 1, 10, "the hold landed")
    renewals = st.lists(st.builds(pb.LeaseRenewal, request_id=st.one_of(st.just("held"), text),
                                  groups=st.lists(st.builds(pb.BlockIds, ids=command_block_ids), max_size=3)),
                        max_size=4)
    engines = st.one_of(st.just(p.engine_id), text)

    @examples("renew")
    @given(engine_id=engines, rs=renewals, via=st.sampled_from(["peer", "engine", "closed"]))
    def prop(engine_id, rs, via):
        SENT["renew"] += 1
        for r in rs:
            r.request_id = "fz-renew-" + r.request_id
        out = []
        if via == "peer":
            call = lambda: out.append(peer.Renew(pb.RenewRequest(engine_id=engine_id, renewals=rs), timeout=10))
        else:
            address = d.peer_address if via == "engine" else target["closed"]
            call = lambda: out.append(local.RenewLeases(pb.RenewLeasesRequest(
                remote_engine_id=engine_id, remote_address=address, renewals=rs), timeout=10))
        code, details = _status(call)
        _assert_deliberate(code, details, "Renew")
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.UNAVAILABLE), (code, details)
        if code == grpc.StatusCode.OK:
            assert [x.request_id for x in out[0].results] == [r.request_id for r in rs]
            for r, x in zip(rs, out[0].results):
                held = (engine_id == p.engine_id and r.request_id == "fz-renew-held" and len(r.groups) <= 1
                        and all(set(g.ids) <= {2, 3, 4} for g in r.groups) and any(g.ids for g in r.groups))
                assert (x.reason == "") == held and (x.left_s > 0) == held, (x, r)

    prop()
    p.release("fz-renew-held")
    ev = p.wait("fz-renew-held")
    while event_kind(ev) == "renewed":
        ev = p.wait("fz-renew-held")
    assert ev.send_done.released


# ------------------------------------------------------------------ afterwards
def test_after_the_fuzz_the_daemon_serves_and_leaks_nothing(target):
    """Runs last in this module: counts, a real transfer, stats at baseline, RSS."""
    d, p, eng = target["daemon"], target["prefill"], target["decode"]
    p.hold("fz-after", [3, 4])
    eng.load("fz-after", [5, 6], p, [3, 4], "fz-after", timeout_s=10)
    assert event_kind(eng.wait("fz-after", 15)) == "recv_done"
    assert eng.same_blocks([5, 6], p, [3, 4])
    p.wait("fz-after")
    base = target["base"]
    # Forged handshakes that described the real worker exactly are legitimate
    # remotes (one per forged engine id); nothing else may remain.
    wait_until(lambda: d.stats().active_leases == 0 and d.stats().inflight_transfers == 0
               and d.stats().leaked_handles == 0 and d.stats().pending_events == 0, 30, "no lease/transfer left")
    st_ = d.stats()
    assert st_.engines == base.engines
    st_ = d.settled_stats()
    assert st_.prepped_dlists == st_.engines + st_.remote_agents
    rss = rss_kib(d.proc.pid)
    total = sum(SENT.values())
    print(f"\nfuzz: {total} messages ({', '.join(f'{k} {v}' for k, v in SENT.items())}); "
          f"remote agents kept {st_.remote_agents}, early notifications {st_.early_notifications}; "
          f"daemon RSS {target['rss0'] / 1024:.0f} -> {rss / 1024:.0f} MiB "
          f"({', '.join(f'{k} {v / 1024:.0f}' for k, v in RSS_AFTER.items())})")
    if all(SENT.values()):  # the whole module ran
        assert total >= TOTAL * 0.99, f"only {total} of {TOTAL} messages generated"