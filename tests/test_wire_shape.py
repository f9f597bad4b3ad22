"""An engine's message is walked on the wire before it is parsed
(kvd.daemon.wire_shape): what an honest engine sends at the daemon's bounds
passes, a message of many tiny fields is refused before protobuf makes an
object of each, on both transports (the command socket's frames, the engine
socket's gRPC), and the daemon serves on."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.limits import BOUNDS, Limits
from kvd.daemon import wire_shape as ws
from kvd.testing.daemons import start_daemon
from kvd.testing.fuzz import SHAPE
from kvd.testing.sessions import Engine
from kvd.v1 import kvd_pb2 as pb

SESSION = ws.engine_shape(pb.SessionCommand.DESCRIPTOR, Limits.max_blocks_per_request)
REGISTER = ws.engine_shape(pb.RegisterEngineRequest.DESCRIPTOR, Limits.max_blocks_per_request)


def _varint(x: int) -> bytes:
    out = bytearray()
    while True:
        if x < 0x80:
            return bytes(out + bytes([x]))
        out.append((x & 0x7F) | 0x80)
        x >>= 7


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _hold(body: bytes) -> bytes:
    """A SessionCommand whose hold (field 3) is ``request_id`` "r" plus ``body``."""
    return _field(3, b"\x0a\x01r" + body)


def test_what_an_honest_engine_sends_at_the_bounds_passes():
    """A load naming as many KV-cache groups as a worker may have
    (``BOUNDS.max_regions``) on both sides, one naming
    ``max_blocks_per_request`` ids on each side, and a registration of
    ``max_regions`` regions and segments: each is walked (over
    ``WALK_FROM_BYTES``) and passes, and parses."""
    n = BOUNDS.max_regions
    ids = Limits.max_blocks_per_request
    for msg in (
        pb.SessionCommand(load=pb.LoadBlocks(request_id="r" * 1024, remote_engine_id="e" * 1024,
                                             remote_address="a" * 1024, remote_request_id="p" * 1024,
                                             local_groups=[pb.BlockIds(ids=range(8))] * n,
                                             remote_groups=[pb.BlockIds(ids=range(8, 16))] * n, timeout_s=5)),
        pb.SessionCommand(load=pb.LoadBlocks(request_id="r", local_groups=[pb.BlockIds(ids=range(ids))],
                                             remote_groups=[pb.BlockIds(ids=range(2**31, 2**31 + ids))])),
        pb.SessionCommand(hold=pb.HoldBlocks(request_id="r", groups=[pb.BlockIds(ids=range(ids // n))] * n)),
    ):
        data = msg.SerializeToString()
        assert len(data) > ws.WALK_FROM_BYTES
        ws.check(data, pb.SessionCommand.DESCRIPTOR, SESSION)
    reg = pb.RegisterEngineRequest(
        worker=pb.EngineWorker(engine_id="e" * 256, tp_rank=3, tp_size=8),
        segments=[pb.Segment(kind=1, name="/" + "s" * 250, size=2**40, handle=b"h" * 64, device=7, fd_id="f" * 32)] * n,
        regions=[pb.Region(segment_index=n - 1, offset=2**40, block_len=2**20, block_stride=2**21,
                           name="model.layers.79.self_attn.attn/k" * 4, group=n - 1)] * n,
        layout=pb.Layout(num_blocks=2**24, block_size=16, dtype="bfloat16", num_kv_heads=8, head_dim=128,
                         num_layers=n, block_lens=[2**20] * n, total_kv_heads=64),
        model="m" * 512, compat_extra="x" * 512, owner_pid=2**31)
    ws.check(reg.SerializeToString(), pb.RegisterEngineRequest.DESCRIPTOR, REGISTER)


@pytest.mark.parametrize("body, what", [
    (b"\x22\x00" * (1 << 20), "fields"),                        # a million empty groups
    (_field(4, _field(1, b"\x01" * (5 << 20))), "repeated elements"),  # 5M packed ids of one byte
    (_field(4, b"\x08\x01" * (1 << 20)), "fields"),              # 1M ids, not packed
    (_field(4, _field(1, b"\x81\x01" * (5 << 20))), "repeated elements"),  # 5M ids of two bytes each
])
def test_a_message_of_many_tiny_fields_is_refused_before_it_is_parsed(body, what):
    with pytest.raises(ws.ShapeError, match=f"more than [0-9]+ {what} in one SessionCommand"):
        ws.check(_hold(body), pb.SessionCommand.DESCRIPTOR, SESSION)


def test_a_short_message_is_not_walked_and_what_the_walk_cannot_read_is_left_to_the_parser():
    short = _hold(b"\x22\x00" * (ws.WALK_FROM_BYTES // 2 - 8))
    assert len(short) <= ws.WALK_FROM_BYTES
    ws.check(short, pb.SessionCommand.DESCRIPTOR, ws.Shape(max_fields=1, max_scalars=1))  # under the length: no walk
    truncated = _hold(b"\x22\x02\x08\x01" * 20_000)[:-1]  # its last group ends early
    ws.check(truncated, pb.SessionCommand.DESCRIPTOR, SESSION)
    with pytest.raises(DecodeError):
        pb.SessionCommand.FromString(truncated)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096))
def test_the_walk_of_any_bytes_returns_or_refuses_and_never_accepts_more_than_its_counts(data):
    """Any bytes, walked (the length threshold set to 0): the walk returns or
    raises ShapeError, nothing else; what it passes with a bound of N fields
    and N elements, protobuf parses into at most N messages and N elements."""
    old = ws.WALK_FROM_BYTES
    ws.WALK_FROM_BYTES = 0
    try:
        shape = ws.Shape(max_fields=64, max_scalars=64)
        try:
            ws.check(data, pb.SessionCommand.DESCRIPTOR, shape)
        except ws.ShapeError:
            return
        try:
            msg = pb.SessionCommand.FromString(data)
        except DecodeError:
            return
        kind = msg.WhichOneof("command")
        sub = getattr(msg, kind) if kind else None
        groups = [*getattr(sub, "groups", []), *getattr(sub, "local_groups", []), *getattr(sub, "remote_groups", [])]
        assert len(groups) <= 64 and sum(len(g.ids) for g in groups) <= 64
    finally:
        ws.WALK_FROM_BYTES = old


def _peak_mib(d) -> int:
    for line in open(f"/proc/{d.proc.pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) >> 10
    raise AssertionError("VmHWM")


FLOOD = 28 << 20  # empty submessages (2 bytes each): a 56 MiB message, under the 64 MiB max_message_bytes


def test_an_engine_socket_request_of_many_empty_submessages_is_refused_unparsed(tmp_path):
    """On the engine socket's gRPC, from an admitted engine: a 56 MiB
    RegisterEngine of 28M empty regions and a Session command of 28M empty
    KV-cache groups. Before, each was parsed first (~1 s of the event loop
    and ~0.9 GiB of RSS each, measured with protobuf 7). Expected:
    INVALID_ARGUMENT naming the bound, the daemon's peak RSS up by a few
    copies of the bytes at most, and an engine served after."""
    d = start_daemon(str(tmp_path), "kvd", log_level="info")
    ch = grpc.insecure_channel(f"unix:{d.socket}", options=[("grpc.max_send_message_length", 128 << 20)])
    e = Engine(d, "shape-ok", SHAPE, open_session=False)
    try:
        base = _peak_mib(d)
        register = ch.unary_unary("/kvd.v1.EngineService/RegisterEngine")
        with pytest.raises(grpc.RpcError) as err:
            register(b"\x22\x00" * FLOOD, timeout=120)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "fields in one RegisterEngineRequest" in err.value.details(), err.value.details()
        opened = pb.SessionCommand(open=pb.OpenSession(worker=pb.EngineWorker(engine_id="shape-ok"))).SerializeToString()
        session = ch.stream_stream("/kvd.v1.EngineService/Session")
        call = session(iter([opened, _hold(b"\x22\x00" * FLOOD)]), timeout=120)
        events = []
        with pytest.raises(grpc.RpcError) as err:
            for ev in call:
                events.append(ev)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "fields in one SessionCommand" in err.value.details(), err.value.details()
        grown = _peak_mib(d) - base
        print(f"peak RSS +{grown} MiB for two refused {2 * FLOOD >> 20} MiB messages")
        assert grown < 400, f"peak RSS grew {grown} MiB for refused {2 * FLOOD >> 20} MiB messages"
        e.session = None
        ok = Engine(d, "shape-after", SHAPE)  # served after
        ok.hold("h", [1])
        ok.release("h")
        assert ok.wait("h").send_done.released
        ok.close()
    finally:
        ch.close()
        e.close()
        assert d.stop() == 0


def test_what_an_honest_daemon_answers_at_the_bounds_passes():
    """A handshake answer describing ``BOUNDS.max_regions`` regions, and a
    holds answer of as many changes, groups and ids as a source puts in one
    (``kvd.core.hold_feed``), pass :func:`peer_shape`."""
    n = BOUNDS.max_regions
    hs = pb.HandshakeResponse(
        agent_metadata=b"m" * (1 << 20), agent_name="a" * 200, compat_hash="c" * 64,
        layout=pb.Layout(num_blocks=2**24, block_size=16, dtype="bfloat16", num_kv_heads=8, head_dim=128,
                         num_layers=n, block_lens=[2**20] * n, total_kv_heads=64),
        regions=[pb.Region(segment_index=n - 1, offset=2**40, block_len=2**20, block_stride=2**21,
                           name="model.layers.79.self_attn.attn/k", group=n - 1)] * n,
        region_base_addrs=[2**47] * n, daemon_version="v", protocol_version=1, tp_size=8, memory="VRAM",
        device=7, warm_up_addr=2**47, holds_epoch="e" * 32)
    for msg in (hs, pb.PushRequest(engine_id="e", request_id="r", reader=hs,
                                   source_groups=[pb.BlockIds(ids=range(8))] * n,
                                   reader_groups=[pb.BlockIds(ids=range(8))] * n)):
        ws.check(msg.SerializeToString(), msg.DESCRIPTOR, ws.peer_shape(msg.DESCRIPTOR, Limits.max_blocks_per_request))
    from kvd.core import hold_feed
    from kvd.core.hold_mirror import MAX_IDS

    changes, groups = hold_feed.MAX_CHANGES_PER_ANSWER, hold_feed.MAX_GROUPS_PER_ANSWER
    ids = MAX_IDS // groups
    holds = pb.HoldsResponse(epoch="e", seq=2**40, changes=[
        pb.HoldChange(tp_rank=7, request_id="r" * 64, ended=False,
                      groups=[pb.BlockIds(ids=range(2**20, 2**20 + ids))] * (groups // changes))] * changes)
    ws.check(holds.SerializeToString(), holds.DESCRIPTOR, ws.peer_shape(holds.DESCRIPTOR, Limits.max_blocks_per_request))


def test_a_peer_answer_of_many_empty_submessages_fails_the_load_unparsed(tmp_path):
    """A load names a hostile server (what ``kv_transfer_params`` say; with
    no peer credential, the default, its answer is taken unauthenticated)
    that answers the handshake with 28M empty regions, 56 MiB. Before, the
    reader parsed it first (~1 s of its event loop and ~0.9 GiB, again at
    every load). Expected: the load fails naming the bound, the decode
    daemon's peak RSS up by a few copies of the bytes at most, and it
    serves on."""
    from concurrent.futures import ThreadPoolExecutor

    answer = b"\x22\x00" * FLOOD
    server = grpc.server(ThreadPoolExecutor(max_workers=2), options=[("grpc.max_send_message_length", 128 << 20)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("kvd.v1.PeerService", {
        "Handshake": grpc.unary_unary_rpc_method_handler(lambda request, context: answer)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    d = start_daemon(str(tmp_path), "kvd", log_level="info")
    e = Engine(d, "shape-reader", SHAPE)
    try:
        base = _peak_mib(d)
        e.load("r1", [1], None, [1], "p1", remote_engine_id="hostile", remote_address=f"127.0.0.1:{port}",
               timeout_s=60)
        ev = e.wait("r1", 90)
        assert ev.WhichOneof("event") == "load_failed", ev
        assert "answer refused: more than" in ev.load_failed.reason and "HandshakeResponse" in ev.load_failed.reason, ev
        grown = _peak_mib(d) - base
        print(f"peak RSS +{grown} MiB for a refused {FLOOD >> 19} MiB handshake answer")
        assert grown < 300, f"peak RSS grew {grown} MiB for a refused {FLOOD >> 19} MiB answer"
        e.hold("h", [1])
        e.release("h")
        assert e.wait("h").send_done.released
    finally:
        e.close()
        server.stop(0.5)
        assert d.stop() == 0


def test_a_peer_request_of_many_empty_submessages_is_refused_unparsed(tmp_path):
    """A caller the daemon admits on PeerService (here: its own uid on
    loopback, with no credential configured) sends a Claim of 28M empty
    KV-cache groups, 56 MiB. Before, gRPC parsed it once the caller was
    admitted. Expected: INVALID_ARGUMENT naming the bound, the peak RSS up
    by a few copies of the bytes at most."""
    d = start_daemon(str(tmp_path), "kvd", log_level="info")
    ch = grpc.insecure_channel(d.peer_address, options=[("grpc.max_send_message_length", 128 << 20)])
    try:
        base = _peak_mib(d)
        with pytest.raises(grpc.RpcError) as err:
            ch.unary_unary("/kvd.v1.PeerService/Claim")(b"\x0a\x01e" + b"\x22\x00" * FLOOD, timeout=120)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "fields in one ClaimRequest (a peer's message" in err.value.details(), err.value.details()
        grown = _peak_mib(d) - base
        print(f"peak RSS +{grown} MiB for a refused {FLOOD >> 19} MiB Claim")
        assert grown < 300, f"peak RSS grew {grown} MiB for a refused {FLOOD >> 19} MiB request"
        with pytest.raises(grpc.RpcError) as err:  # and serves on
            ch.unary_unary("/kvd.v1.PeerService/Handshake", request_serializer=pb.HandshakeRequest.SerializeToString)(
                pb.HandshakeRequest(engine_id="nobody"), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value
    finally:
        ch.close()
        assert d.stop() == 0


def test_a_call_of_renewals_at_its_bounds_passes():
    """``max_renewals_per_call`` renewals of ``RENEWAL_GROUPS`` groups each,
    or of 64k block ids each (16M in all), pass as an engine's
    ``RenewLeasesRequest`` and as a daemon's ``RenewRequest``; 28M empty
    groups do not."""
    n = BOUNDS.max_renewals_per_call
    wide = [pb.LeaseRenewal(request_id="r" * 64, groups=[pb.BlockIds(ids=[7])] * ws.RENEWAL_GROUPS)] * n
    long = [pb.LeaseRenewal(request_id="r" * 64, groups=[pb.BlockIds(ids=range(1, 1 + (1 << 16)))])] * n
    for renewals in (wide, long):
        for msg, shape_of in ((pb.RenewLeasesRequest(remote_engine_id="e", remote_address="a", renewals=renewals),
                               ws.engine_shape),
                              (pb.RenewRequest(engine_id="e", renewals=renewals), ws.peer_shape)):
            ws.check(msg.SerializeToString(), msg.DESCRIPTOR, shape_of(msg.DESCRIPTOR, Limits.max_blocks_per_request))
    flood = _field(3, b"\x0a\x01r" + b"\x12\x00" * FLOOD)
    with pytest.raises(ws.ShapeError, match="fields in one RenewLeasesRequest"):
        ws.check(flood, pb.RenewLeasesRequest.DESCRIPTOR,
                 ws.engine_shape(pb.RenewLeasesRequest.DESCRIPTOR, Limits.max_blocks_per_request))
