"""An engine's message is walked on the wire before it is parsed
(kvd.daemon.wire_shape): what an honest engine sends at the daemon's bounds
passes, a message of many tiny fields is refused before protobuf makes an
object of each, on both transports (the command socket's frames, the engine
socket's gRPC), and the daemon serves on."""

from __future__ import annotations

import random
import socket
import struct

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.state import PROTOCOL_VERSION
from kvd.command_wire import command_socket_path, frame
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


def test_a_short_message_is_not_walked():
    short = _hold(b"\x22\x00" * (ws.WALK_FROM_BYTES // 2 - 8))
    assert len(short) <= ws.WALK_FROM_BYTES
    ws.check(short, pb.SessionCommand.DESCRIPTOR, ws.Shape(max_fields=1, max_scalars=1))  # under the length: no walk


#: An unknown group of field 15 holding an empty unknown group of field 0.
#: upb skips an unknown group without checking the field numbers inside it,
#: so it parses whatever follows; a walk that took field number 0 for "no
#: group open" gave up on it, and the rest was parsed uncounted.
PREFIX = b"\x7b\x03\x04\x7c"

_TAIL = _field(3, _field(1, b"r" * 80_000))  # a hold of an 80 KB request id: walked, 2 fields


@pytest.mark.parametrize("data, what", [
    (_TAIL[:-1], "a length past the end of its message"),                # ends early
    (_TAIL + b"\x08", "a truncated or over-long varint"),                # a tag with no value
    (_TAIL + b"\x08" + b"\xff" * 10 + b"\x01", "a truncated or over-long varint"),  # an 11-byte varint
    (_TAIL + b"\x09\x00", "a truncated fixed-width field"),
    (_TAIL + b"\x0e", "wire type 6"),
    (_TAIL + b"\x7c", "an end-group tag that no group of its field opened"),
    (_TAIL + b"\x7b\x0c\x7c", "an end-group tag that no group of its field opened"),  # ended by another field's tag
    (_TAIL + b"\x7b\x03", "a group of field 0 not ended"),
    (PREFIX + b"\x03" + _TAIL, "a group of field 0 not ended"),
    (_TAIL + b"\x0b" * 101 + b"\x0c" * 101, "nesting deeper than 100"),
    # upb reads a tag or a length of at most 5 bytes (and a tag of 32 bits): a
    # longer one is refused unwalked-into, not walked at 20 Python steps a field.
    (_TAIL + b"\xf8\x80\x80\x80\x80\x00\x01", "a truncated or over-long varint"),  # a 6-byte tag
    (_TAIL + b"\xf8\x80\x80\x80\x10\x01", "a tag past 32 bits"),
    (_TAIL + b"\x7a\x80\x80\x80\x80\x80\x00", "a truncated or over-long varint"),  # a 6-byte length
])
def test_what_the_walk_cannot_read_is_refused_not_left_to_the_parser(data, what):
    """Fail closed: a message the walk cannot read is refused, naming what
    and where, never handed to the parser uncounted."""
    assert len(data) > ws.WALK_FROM_BYTES
    with pytest.raises(ws.ShapeError, match=f"{what}.* at byte [0-9]+ of a [0-9]+-byte SessionCommand"):
        ws.check(data, pb.SessionCommand.DESCRIPTOR, SESSION)


def test_groups_of_field_0_nested_in_an_unknown_group_are_walked_and_counted():
    """The prefix is a message the walk reads (4 fields); upb parses it too,
    and what follows it is counted as any message's fields."""
    ws.check(PREFIX + _TAIL, pb.SessionCommand.DESCRIPTOR, SESSION)
    pb.SessionCommand.FromString(PREFIX + _TAIL)
    with pytest.raises(ws.ShapeError, match="more than 5 fields"):
        ws.check(PREFIX + _TAIL, pb.SessionCommand.DESCRIPTOR, ws.Shape(max_fields=5, max_scalars=1 << 20))


def _walked(service: str) -> list:
    """``(message, shape of it)`` of every message of ``service`` the daemon
    walks: EngineService's requests (engine socket and command socket,
    :func:`engine_shape`); PeerService's requests and a peer's answers
    (:func:`peer_shape`)."""
    methods = pb.DESCRIPTOR.services_by_name[service].methods
    if service == "EngineService":
        return [(m.input_type, ws.engine_shape) for m in methods]
    return [(t, ws.peer_shape) for m in methods for t in (m.input_type, m.output_type)]


@pytest.mark.parametrize("desc, shape_of", [pytest.param(d, f, id=d.name)
                                            for s in ("EngineService", "PeerService") for d, f in _walked(s)])
def test_the_prefix_before_a_flood_is_refused_for_every_message_walked(desc, shape_of):
    """Each message the daemon walks, of the prefix and then one field more
    than its shape allows: refused for its fields, where the walk that took
    field number 0 for "no group open" passed it to the parser (28M empty
    regions behind it: +2.1 GiB to parse a RegisterEngine; a command of
    28M empty groups blocked the event loop 38 s). The parser takes it."""
    shape = shape_of(desc, Limits.max_blocks_per_request)
    # Unknown fields of number 1000: one of 64 KiB (so that it is walked), then empty ones.
    data = PREFIX + _field(1000, bytes(ws.WALK_FROM_BYTES)) + b"\xc2\x3e\x00" * shape.max_fields
    with pytest.raises(ws.ShapeError, match=f"more than {shape.max_fields} fields in one {desc.name}"):
        ws.check(data, desc, shape)
    getattr(pb, desc.name).FromString(data)


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


def _counts(msg) -> tuple[int, int]:
    """``(submessages, scalars)`` a parsed message holds, at every depth
    (each needs a field of its own on the wire; repeated scalars count per
    element)."""
    msgs = scalars = 0
    for f, value in msg.ListFields():
        many = ws._repeated(f)
        if f.type == f.TYPE_MESSAGE:
            for m in value if many else [value]:
                a, b = _counts(m)
                msgs, scalars = msgs + 1 + a, scalars + b
        else:
            scalars += len(value) if many else 1
    return msgs, scalars


def _honest(rnd, desc, depth: int = 0):
    """A random message of ``desc`` as a serializer writes it: every field
    set or not, repeated ones of 0-3 elements, submessages 3 deep at most."""
    msg = getattr(pb, desc.name)() if depth == 0 else None
    return _fill(rnd, msg, depth)


def _fill(rnd, msg, depth):
    for f in msg.DESCRIPTOR.fields:
        if rnd.random() < 0.4:
            continue
        n = rnd.randint(0, 3) if ws._repeated(f) else 1
        for _ in range(n):
            if f.type == f.TYPE_MESSAGE:
                if depth >= 3:
                    break
                sub = getattr(msg, f.name).add() if ws._repeated(f) else getattr(msg, f.name)
                sub.SetInParent()
                _fill(rnd, sub, depth + 1)
                continue
            if f.type in (f.TYPE_STRING, f.TYPE_BYTES):
                v = "s" * rnd.randint(0, 3) if f.type == f.TYPE_STRING else bytes(rnd.randint(0, 3))
            elif f.type == f.TYPE_BOOL:
                v = True
            elif f.type in (f.TYPE_DOUBLE, f.TYPE_FLOAT):
                v = 1.5
            else:
                v = rnd.choice([1, 127, 128, 300, 2 ** 31 - 1])
            if ws._repeated(f):
                getattr(msg, f.name).append(v)
            else:
                setattr(msg, f.name, v)
    return msg


#: Bytes the mutations insert: group starts and ends (field numbers 0, 1, 3,
#: 15 and 1000), alone and paired, the prefix, tags of wire types 6 and 7,
#: empty fields.
_TOKENS = [bytes([n << 3 | w]) for n in (0, 1, 3, 15) for w in (3, 4)] + [
    b"\xc3\x3e", b"\xc4\x3e", b"\xc3\x3e\x03\x04\xc4\x3e", PREFIX, b"\x03\x04", b"\x0b\x03\x04\x0c",
    b"\x0b\x7b\x7c\x0c", b"\x0e", b"\x0f", b"\x12\x00", b"\x22\x00", b"\x80"]


def _mutant(rnd, data: bytes) -> bytes:
    for _ in range(rnd.randint(1, 3)):
        i = rnd.randint(0, len(data))
        op = rnd.randrange(4)
        if op == 0:
            data = data[:i] + rnd.choice(_TOKENS) + data[i:]
        elif op == 1:
            data = data[:i] + data[i + rnd.randint(1, 3):]
        elif op == 2 and data:
            i = min(i, len(data) - 1)
            data = data[:i] + bytes([rnd.randrange(256)]) + data[i + 1:]
        else:  # at a field's start or after the last one
            data = rnd.choice([rnd.choice(_TOKENS) + data, data + rnd.choice(_TOKENS)])
    return data


def test_the_walk_passes_only_what_it_has_counted_differential(monkeypatch):
    """Seeded mutations of valid messages of every type the daemon walks
    (group tags of field 0 and others inserted, bytes dropped or changed),
    each walked (the length threshold set to 0) and parsed by protobuf:

    - an unmutated message passes the walk (no honest message is refused);
    - the walk refuses, or passes: then protobuf parses it or raises
      DecodeError, and what it parses the walk has counted: with the bound
      set one under the parsed message's submessages (or scalars), the walk
      refuses it. A walk that gives up on bytes it cannot read and lets
      them through fails here (the field-0 group prefix did)."""
    monkeypatch.setattr(ws, "WALK_FROM_BYTES", 0)
    rnd = random.Random(12)
    descs = [d for s in ("EngineService", "PeerService") for d, _ in _walked(s)]
    wide = ws.Shape(max_fields=10 ** 9, max_scalars=10 ** 9)
    passed = parsed = 0
    for i in range(20_000):
        desc = descs[i % len(descs)]
        honest = _honest(rnd, desc).SerializeToString()
        ws.check(honest, desc, wide)
        data = _mutant(rnd, honest)
        try:
            msg = getattr(pb, desc.name).FromString(data)
        except DecodeError:
            msg = None
        try:
            ws.check(data, desc, wide)
        except ws.ShapeError:
            continue
        passed += 1
        if msg is None:
            continue
        parsed += 1
        msgs, scalars = _counts(msg)
        for shape in (ws.Shape(max_fields=msgs - 1, max_scalars=10 ** 9),
                      ws.Shape(max_fields=10 ** 9, max_scalars=scalars - 1)):
            if min(shape.max_fields, shape.max_scalars) >= 0:
                with pytest.raises(ws.ShapeError, match="more than"):
                    ws.check(data, desc, shape)
    assert parsed > 3000, (passed, parsed)  # the mutations still reach the parser's successes


def _peak_mib(d) -> int:
    for line in open(f"/proc/{d.proc.pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) >> 10
    raise AssertionError("VmHWM")


def _serves_an_engine(d, engine_id: str) -> None:
    """A new engine of ``d`` holds and releases a block."""
    ok = Engine(d, engine_id, SHAPE)
    ok.hold("h", [1])
    ok.release("h")
    assert ok.wait("h").send_done.released
    ok.close()


FLOOD = 28 << 20  # empty submessages (2 bytes each): a 56 MiB message, under the 64 MiB max_message_bytes


WITH_PREFIX = pytest.mark.parametrize("prefix", [b"", PREFIX], ids=["plain", "prefix"])


@WITH_PREFIX
def test_an_engine_socket_request_of_many_empty_submessages_is_refused_unparsed(tmp_path, prefix):
    """On the engine socket's gRPC, from an admitted engine: a 56 MiB
    RegisterEngine of 28M empty regions and a Session command of 28M empty
    KV-cache groups, each alone or after :data:`PREFIX`. Before, each was
    parsed first (~1 s of the event loop and ~0.9 GiB of RSS each, measured
    with protobuf 7); with the prefix, until the walk failed closed, too
    (a RegisterEngine +2.1 GiB). Expected:
    INVALID_ARGUMENT naming the bound, the daemon's peak RSS up by a few
    copies of the bytes at most, and an engine served after."""
    d = start_daemon(str(tmp_path), "kvd", log_level="info")
    ch = grpc.insecure_channel(f"unix:{d.socket}", options=[("grpc.max_send_message_length", 128 << 20)])
    e = Engine(d, "shape-ok", SHAPE, open_session=False)
    try:
        base = _peak_mib(d)
        register = ch.unary_unary("/kvd.v1.EngineService/RegisterEngine")
        with pytest.raises(grpc.RpcError) as err:
            register(prefix + b"\x22\x00" * FLOOD, timeout=120)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "fields in one RegisterEngineRequest" in err.value.details(), err.value.details()
        opened = pb.SessionCommand(open=pb.OpenSession(worker=pb.EngineWorker(engine_id="shape-ok"))).SerializeToString()
        session = ch.stream_stream("/kvd.v1.EngineService/Session")
        call = session(iter([opened, prefix + _hold(b"\x22\x00" * FLOOD)]), timeout=120)
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
        _serves_an_engine(d, "shape-after")
    finally:
        ch.close()
        e.close()
        assert d.stop() == 0


@WITH_PREFIX
def test_a_command_socket_frame_of_many_empty_submessages_ends_the_session_unparsed(tmp_path, prefix):
    """On the command socket, from an admitted engine: a frame of a hold of
    28M empty KV-cache groups (56 MiB), alone or after :data:`PREFIX` (with
    it, until the walk failed closed, the frame was parsed: the event loop
    blocked 38 s, +3 GiB). Expected: the connection ends with a rejection
    naming the bound, the peak RSS up by a few copies of the bytes at most,
    and an engine served after."""
    d = start_daemon(str(tmp_path), "kvd", log_level="info")
    e = Engine(d, "shape-cs", SHAPE, open_session=False)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(60)
        s.connect(command_socket_path(d.socket))
        base = _peak_mib(d)
        opened = pb.SessionCommand(open=pb.OpenSession(worker=pb.EngineWorker(engine_id="shape-cs")))
        s.sendall(frame(opened.SerializeToString()) + frame(prefix + _hold(b"\x22\x00" * FLOOD)))
        got = b""
        while chunk := s.recv(1 << 16):
            got += chunk
        events = []
        while got:
            (n,) = struct.unpack_from("<I", got)
            events.append(pb.SessionEvent.FromString(got[4:4 + n]))
            got = got[4 + n:]
        assert events and "fields in one SessionCommand" in events[-1].rejected.reason, events
        grown = _peak_mib(d) - base
        print(f"peak RSS +{grown} MiB for a refused {FLOOD >> 19} MiB frame")
        assert grown < 400, f"peak RSS grew {grown} MiB for a refused {FLOOD >> 19} MiB frame"
        _serves_an_engine(d, "shape-cs-after")
    finally:
        s.close()
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
        region_base_addrs=[2**47] * n, daemon_version="v", protocol_version=PROTOCOL_VERSION, tp_size=8, memory="VRAM",
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


@WITH_PREFIX
def test_a_peer_answer_of_many_empty_submessages_fails_the_load_unparsed(tmp_path, prefix):
    """A load names a hostile server (what ``kv_transfer_params`` say; with
    no peer credential, the default, its answer is taken unauthenticated)
    that answers the handshake with 28M empty regions, 56 MiB, alone or
    after :data:`PREFIX`. Before, the reader parsed it first (~1 s of its
    event loop and ~0.9 GiB, again at every load; with the prefix, until the
    walk failed closed, +2.1 GiB). Expected: the load fails naming the bound, the decode
    daemon's peak RSS up by a few copies of the bytes at most, and it
    serves on."""
    from concurrent.futures import ThreadPoolExecutor

    answer = prefix + b"\x22\x00" * FLOOD
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


@WITH_PREFIX
def test_a_peer_request_of_many_empty_submessages_is_refused_unparsed(tmp_path, prefix):
    """A caller the daemon admits on PeerService (here: its own uid on
    loopback, with no credential configured) sends a Claim of 28M empty
    KV-cache groups, 56 MiB, alone or after :data:`PREFIX`. Before, gRPC
    parsed it once the caller was admitted (with the prefix, until the walk
    failed closed: +3 GiB). Expected: INVALID_ARGUMENT naming the bound, the peak RSS up
    by a few copies of the bytes at most."""
    d = start_daemon(str(tmp_path), "kvd", log_level="info")
    ch = grpc.insecure_channel(d.peer_address, options=[("grpc.max_send_message_length", 128 << 20)])
    try:
        base = _peak_mib(d)
        with pytest.raises(grpc.RpcError) as err:
            ch.unary_unary("/kvd.v1.PeerService/Claim")(prefix + b"\x0a\x01e" + b"\x22\x00" * FLOOD, timeout=120)
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
    of ``max_blocks_per_request`` block ids in all, or one renewal of them
    all (what an honest caller sends at most: the handlers refuse more),
    pass as an engine's ``RenewLeasesRequest`` and as a daemon's
    ``RenewRequest``; 28M empty groups do not."""
    n = BOUNDS.max_renewals_per_call
    ids = Limits.max_blocks_per_request
    wide = [pb.LeaseRenewal(request_id="r" * 64, groups=[pb.BlockIds(ids=[7])] * ws.RENEWAL_GROUPS)] * n
    long = [pb.LeaseRenewal(request_id="r" * 64, groups=[pb.BlockIds(ids=range(1, 1 + ids // n))])] * n
    one = [pb.LeaseRenewal(request_id="r", groups=[pb.BlockIds(ids=range(2**31, 2**31 + ids))])]
    for renewals in (wide, long, one):
        for msg, shape_of in ((pb.RenewLeasesRequest(remote_engine_id="e", remote_address="a", renewals=renewals),
                               ws.engine_shape),
                              (pb.RenewRequest(engine_id="e", renewals=renewals), ws.peer_shape)):
            ws.check(msg.SerializeToString(), msg.DESCRIPTOR, shape_of(msg.DESCRIPTOR, Limits.max_blocks_per_request))
    flood = _field(3, b"\x0a\x01r" + b"\x12\x00" * FLOOD)
    with pytest.raises(ws.ShapeError, match="fields in one RenewLeasesRequest"):
        ws.check(flood, pb.RenewLeasesRequest.DESCRIPTOR,
                 ws.engine_shape(pb.RenewLeasesRequest.DESCRIPTOR, Limits.max_blocks_per_request))


@pytest.mark.parametrize("desc, shape_of, head", [
    (pb.RenewLeasesRequest.DESCRIPTOR, ws.engine_shape, _field(1, b"e") + _field(2, b"a")),
    (pb.RenewRequest.DESCRIPTOR, ws.peer_shape, _field(1, b"e")),
], ids=["RenewLeasesRequest", "RenewRequest"])
def test_a_call_of_renewals_of_more_than_twice_max_blocks_per_request_ids_is_refused_unparsed(desc, shape_of, head):
    """A call naming more than twice ``max_blocks_per_request`` block ids
    (here one renewal of them, one byte each): refused before it is parsed.
    Before, the bound was 16 times that: a 32 MiB call of 16M ids was
    parsed and converted (2.5 s, +1 GiB) before its handler refused it."""
    ids = 2 * Limits.max_blocks_per_request + 4 * BOUNDS.max_renewals_per_call + 257
    renewal = _field(1, b"r") + _field(2, _field(1, b"\x01" * ids))
    with pytest.raises(ws.ShapeError, match=f"repeated elements in one {desc.name}"):
        ws.check(head + _field(3 if desc.name == "RenewLeasesRequest" else 2, renewal), desc,
                 shape_of(desc, Limits.max_blocks_per_request))


def test_a_handshake_answer_holds_no_more_numbers_than_its_regions_need():
    """A handshake answer names no block ids: its numbers (``region_base_addrs``,
    ``layout.block_lens``, the regions' fields) are a few per region. One of
    4.3M 10-byte base addresses (41 MiB, no credential needed: any address a
    load names answers) passed the ids' bound and took +329 MiB and 0.33 s
    parsed and listed (``handshake_from_pb``) before the regions' count refused it."""
    n = ws.peer_shape(pb.HandshakeResponse.DESCRIPTOR, Limits.max_blocks_per_request).max_fields
    desc = pb.HandshakeResponse.DESCRIPTOR
    data = _field(5, b"\x01" * (2 * n))  # region_base_addrs, packed: 2x the fields' bound in numbers
    with pytest.raises(ws.ShapeError, match="repeated elements"):
        ws.check(data, desc, ws.peer_shape(desc, Limits.max_blocks_per_request))


def test_a_peers_daemon_version_and_read_transport_are_kept_to_what_kvd_shows():
    """A hostile peer's handshake answer sent a 1 MB ``daemon_version``,
    which ``kvd status`` printed in full (an attacker review): it is cut
    to ``MAX_VERSION_CHARS``; a ``read_transport`` kvd does not know is
    unknown ("")."""
    from kvd.daemon.convert import MAX_VERSION_CHARS, handshake_from_pb

    layout = pb.Layout(kv_layout=pb.KV_LAYOUT_NHD)
    hs = handshake_from_pb(pb.HandshakeResponse(layout=layout, daemon_version="9" * 1_000_000,
                                                read_transport="\x1b[2Jtcp"))
    assert hs.daemon_version == "9" * MAX_VERSION_CHARS and hs.read_transport == ""
    hs = handshake_from_pb(pb.HandshakeResponse(layout=layout, daemon_version="0.1.0", read_transport="tcp"))
    assert (hs.daemon_version, hs.read_transport) == ("0.1.0", "tcp")
