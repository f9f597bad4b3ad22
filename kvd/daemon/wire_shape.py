"""An engine's message is bounded in shape before it is parsed.

Parsing is what a large message costs most: protobuf (upb) makes an object
per submessage and an element per repeated scalar, so a message of many
tiny fields takes many times its bytes. Measured here: a ``SessionCommand``
holding 30M empty ``BlockIds`` (a 57 MiB frame, under the 64 MiB
``max_message_bytes``) took 1.0 s to parse and +943 MiB RSS, on the event
loop that serves every engine and peer, before any bound the daemon checks
on the parsed message could refuse it; then the conversion.

So a message longer than :data:`WALK_FROM_BYTES` is first walked on the
wire (the protobuf encoding, https://protobuf.dev/programming-guides/encoding/),
guided by its descriptor, counting the fields it holds at every depth and
the elements of its repeated scalars, and refused as soon as either count
passes what an honest engine can send (:func:`engine_shape`). The walk
costs ~0.2-0.45 us a field in Python here and stops at the bound, so a
refusal costs a bounded few to ~30 ms whatever the message's length (the
30M-group frame above: refused in 3 ms, not parsed). What passes costs as
much: a message at its shape's field bound walks in 13-60 ms (a 256 KiB
``RenewLeasesRequest`` of 256 x 510 empty groups: 29 ms, where parsing it
takes 3 ms), the price of counting before parsing. Packed
arrays (how protobuf encodes repeated numbers) are counted without a
Python loop (``bytes.translate``), so an honest load of a million block
ids is walked in a few field visits.

Both ways an engine's messages come are walked: the command socket's
frames (``kvd.daemon.command_socket``) and every EngineService request on
the engine socket (:class:`ShapeInterceptor`); so are a peer's: every
PeerService request once its caller is checked, and every answer a peer
gives (``kvd.daemon.peer_client``), whose server may be anything a load's
``kv_transfer_params`` name (:func:`peer_shape`).

What the walk cannot read (a truncated field, an unknown wire type, a group
not ended or ended by another field's tag, nesting past :data:`MAX_DEPTH`)
is refused too (:class:`ShapeError`), never handed to the parser uncounted:
the parser is laxer than the encoding's rules in places (upb skips an
unknown group without checking the field numbers inside it), and what the
walk has not counted is exactly what it cannot bound. An honest sender's
serializer writes none of these.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import Descriptor
from google.protobuf.descriptor import FieldDescriptor as F

from kvd.core import hold_feed
from kvd.core.hold_mirror import MAX_IDS
from kvd.core.holds import MAX_RENEWAL_GROUPS
from kvd.core.limits import BOUNDS
from kvd.daemon.call_refusal import Refused
from kvd.daemon.logs import Throttled
from kvd.daemon.peer_local import parse_request

log = logging.getLogger("kvd.wire_shape")

#: Messages up to this many bytes are parsed without a walk: at most ~32k
#: fields, ~1 ms to parse (measured above: 1.0 s for 30M), and every
#: command of the fast path is far shorter (a load of 16 blocks: ~150 bytes).
WALK_FROM_BYTES = 64 << 10

#: Nesting the walk follows, as protobuf's own default recursion limit.
MAX_DEPTH = 100

_VARINTS = frozenset({F.TYPE_INT32, F.TYPE_INT64, F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_SINT32, F.TYPE_SINT64,
                      F.TYPE_BOOL, F.TYPE_ENUM})
_FIXED = {F.TYPE_FIXED32: 4, F.TYPE_SFIXED32: 4, F.TYPE_FLOAT: 4,
          F.TYPE_FIXED64: 8, F.TYPE_SFIXED64: 8, F.TYPE_DOUBLE: 8}
_LAST_BYTES = bytes(range(0x80))  # a varint's last byte has its top bit clear


class ShapeError(ValueError):
    """A message holds more fields or repeated elements than its :class:`Shape` allows."""


@dataclass(frozen=True)
class Shape:
    """The most one message may hold, counted on the wire at every depth.

    Attributes:
        max_fields: fields (each element of a repeated message counts one,
            and so does each field inside it).
        max_scalars: numbers, strings and bytes (each element of a repeated
            scalar, packed or not, counts one).
        who: whose message it is, for the error ("an engine", "a peer").
    """

    max_fields: int
    max_scalars: int
    who: str = "an engine"


def engine_shape(descriptor: Descriptor, max_blocks_per_request: int) -> Shape:
    """The shape an honest engine's ``descriptor`` message stays within.

    - ``RegisterEngineRequest``: at most ``BOUNDS.max_regions`` regions and as
      many segments (the registration's own checks), each under 8 fields,
      and a layout's ``block_lens`` (one per region).
    - every other request, ``SessionCommand`` included: a load or hold names
      block ids for at most as many KV-cache groups as the worker's regions
      use (groups are numbered 0..G-1, each used by a region: at most
      ``BOUNDS.max_regions``), twice (local and remote), with at most
      ``max_blocks_per_request`` ids in each side (``Pull.load``). The
      elements' bound is twice that a side: a command a little past
      ``max_blocks_per_request`` is still parsed and refused by its own
      check (one ``LoadFailed`` or ``CommandRejected`` naming the limit,
      the session goes on); only one far past it ends the session. At
      that bound a parsed command's ids take ~150 MiB at most (upb's array
      and the daemon's list, 36 bytes an id), where a 64 MiB frame of
      one-byte ids took ~2 GiB.

    - ``RenewLeasesRequest``: :func:`renewals_shape`.

    Each bound has room for a few dozen more fields than that.
    """
    regions = BOUNDS.max_regions
    if descriptor.name == "RenewLeasesRequest":
        return renewals_shape(max_blocks_per_request, "an engine")
    if descriptor.name == "RegisterEngineRequest":
        return Shape(max_fields=16 * regions + 256, max_scalars=16 * regions + 256)
    return Shape(max_fields=4 * regions + 256, max_scalars=4 * max_blocks_per_request + 4 * regions + 256)


def peer_shape(descriptor: Descriptor, max_blocks_per_request: int) -> Shape:
    """The shape an honest daemon's PeerService request or answer stays within.

    - ``HoldsResponse``: a source cuts its answers at
      ``hold_feed.MAX_CHANGES_PER_ANSWER`` changes (4 fields each) and
      ``MAX_GROUPS_PER_ANSWER`` groups, and the reader refuses more than
      ``hold_mirror.MAX_IDS`` ids after parsing.
    - every other one: a worker's description (a handshake answer, or the
      reader's inside a ``PushRequest``: at most ``BOUNDS.max_regions``
      regions of 7 fields, as many base addresses and block lengths),
      block ids for at most ``max_regions`` groups a side, up to twice
      ``max_blocks_per_request`` ids a side (as :func:`engine_shape`);
    - ``HandshakeResponse``: no block ids, so no more numbers than fields
      (a region's base address and block length, its fields);
    - ``RenewRequest``: :func:`renewals_shape`.

    A daemon whose ``max_blocks_per_request`` is set far above its peers'
    may have a hold or load of its own refused by them this way; its peers
    refuse one past their own setting anyway.
    """
    if descriptor.name == "RenewRequest":
        return renewals_shape(max_blocks_per_request, "a peer")
    if descriptor.name == "HoldsResponse":
        changes, groups = hold_feed.MAX_CHANGES_PER_ANSWER, hold_feed.MAX_GROUPS_PER_ANSWER
        return Shape(max_fields=8 * changes + 2 * groups + 256, max_scalars=MAX_IDS + 8 * changes + 256, who="a peer")
    regions = BOUNDS.max_regions
    if descriptor.name == "HandshakeResponse":  # no block ids: a few numbers a region (base address, block_len)
        return Shape(max_fields=32 * regions + 4096, max_scalars=32 * regions + 4096, who="a peer")
    return Shape(max_fields=32 * regions + 4096, max_scalars=4 * max_blocks_per_request + 32 * regions + 4096,
                 who="a peer")


#: KV-cache groups a renewal may name, for the shape of a call of renewals
#: (the handlers refuse more, ``kvd.core.holds.check_renewal_counts``): a call
#: of ``BOUNDS.max_renewals_per_call`` renewals of this many groups walks in
#: ~60 ms, where a call of 28M empty groups took ~1 s and ~0.9 GiB to parse.
RENEWAL_GROUPS = MAX_RENEWAL_GROUPS


def renewals_shape(max_blocks_per_request: int, who: str) -> Shape:
    """The shape of a call of renewals (an engine's ``RenewLeasesRequest``,
    its daemon's ``RenewRequest`` to the source): up to
    ``BOUNDS.max_renewals_per_call`` renewals, each naming a request's blocks
    in up to :data:`RENEWAL_GROUPS` groups, and twice
    ``max_blocks_per_request`` ids in all.

    The handlers refuse a call of more than ``max_blocks_per_request`` ids
    in all (``kvd.core.holds.check_renewal_counts``), and an honest caller
    sends at most that: the vLLM shim's calls hold at most
    ``kvd.shim.vllm.renewals.MAX_BLOCKS_PER_CALL`` (2**18) ids, or one
    request's alone, which the source's own hold bounded to its
    ``max_blocks_per_request``; a daemon forwards to the source the call its
    engine made, checked against its own. Twice that, as in
    :func:`engine_shape`: a call a little past it is parsed and refused by
    its handler naming the limit; one far past it is refused unparsed (a
    32 MiB call of 16M ids, under the 16x bound this replaced, took 2.5 s
    and +1 GiB to parse and convert before the count refused it)."""
    n = BOUNDS.max_renewals_per_call
    return Shape(max_fields=n * (4 + 2 * RENEWAL_GROUPS) + 256, max_scalars=2 * max_blocks_per_request + n * 4 + 256,
                 who=who)


def check(data: bytes, descriptor: Descriptor, shape: Shape) -> None:
    """Walks ``data`` (an encoded ``descriptor`` message) when it is longer
    than :data:`WALK_FROM_BYTES`; returns when it stays within ``shape``.

    Raises:
        ShapeError: it holds more than ``shape`` allows (the message names
            the count and its bound), or the walk cannot read it (fails
            closed: the message names what and where).
    """
    if len(data) <= WALK_FROM_BYTES:
        return
    _walk(bytes(data), 0, len(data), descriptor, _Budget(shape, descriptor.name, len(data)), 0)


class _Budget:
    """What a walk may still count, and whose message it walks (for the error)."""

    def __init__(self, shape: Shape, name: str, length: int):
        self.shape = shape
        self.name = name
        self.length = length
        self.fields = shape.max_fields
        self.scalars = shape.max_scalars

    def too_many(self, what: str, bound: int) -> ShapeError:
        return ShapeError(f"more than {bound} {what} in one {self.name} ({self.shape.who}'s message holds at most "
                          f"that many; counted before parsing)")

    def unreadable(self, what: str, pos: int) -> ShapeError:
        return ShapeError(f"{what} at byte {pos} of a {self.length}-byte {self.name} ({self.shape.who}'s message "
                          f"over {WALK_FROM_BYTES} bytes is refused unparsed when its walk cannot read it)")


def _repeated(f: F) -> bool:
    # protobuf 7 has only ``is_repeated``; 6.31's descriptors have ``label``.
    rep = getattr(f, "is_repeated", None)
    return rep if rep is not None else f.label == F.LABEL_REPEATED


def _varint(buf: bytes, pos: int, end: int, budget: _Budget, limit: int = 10) -> tuple[int, int]:
    """``(value, next position)`` of the varint at ``pos``, of at most
    ``limit`` bytes: 10 for a number, 5 for a tag or a length (upb reads
    no longer ones; the walk would pay up to 20 Python steps a field for
    what upb then refuses).

    Raises:
        ShapeError: ``buf`` ends inside it, or it runs past ``limit`` bytes
            (upb refuses that too).
    """
    value = shift = 0
    start = pos
    while pos < end and shift < 7 * limit:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
    raise budget.unreadable("a truncated or over-long varint", start)


#: What the walk looks into, per message type (full name): field number ->
#: ``(code, message type)``, code :data:`_MESSAGE`, :data:`_PACKED_VARINTS`
#: or a fixed-width element's size in bytes; other fields count one element.
_tables: dict[str, dict[int, tuple[int, Descriptor | None]]] = {}
_MESSAGE, _PACKED_VARINTS = -1, 0


def _table(desc: Descriptor | None) -> dict[int, tuple[int, Descriptor | None]]:
    if desc is None:  # an unknown group's fields are all unknown
        return {}
    table = _tables.get(desc.full_name)
    if table is None:
        table = {}
        for f in desc.fields:
            if f.type == F.TYPE_MESSAGE:
                table[f.number] = (_MESSAGE, f.message_type)
            elif _repeated(f) and f.type in _VARINTS:
                table[f.number] = (_PACKED_VARINTS, None)
            elif _repeated(f) and f.type in _FIXED:
                table[f.number] = (_FIXED[f.type], None)
        _tables[desc.full_name] = table
    return table


def _walk(buf: bytes, pos: int, end: int, desc: Descriptor | None, budget: _Budget, depth: int,
          group: int | None = None) -> int:
    """Counts the fields of ``buf[pos:end]`` against ``budget``: a ``desc``
    message, or with ``group`` set (a field number, 0 included) the fields
    of an unknown group of that field (``desc`` None), up to its end-group
    tag. Returns the position after the message (``end``) or after the
    group's end tag.

    ~0.3 us a field here: one-byte tags and lengths (every field number
    under 16, every length under 128) are read inline, and an empty
    submessage is counted without a call.

    Raises:
        ShapeError: past the budget, or at the first thing it cannot read (a
            truncated field, a varint of over 10 bytes, wire type 6 or 7, an
            end-group tag that no group of its field opened, a group not
            ended, nesting past :data:`MAX_DEPTH`): fail closed, as what is
            not read is not counted.
    """
    if depth > MAX_DEPTH:
        raise budget.unreadable(f"nesting deeper than {MAX_DEPTH}", pos)
    table = _table(desc)
    while pos < end:
        at = pos
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _varint(buf, pos, end, budget, 5)
            if tag >> 32:
                raise budget.unreadable("a tag past 32 bits", at)
        budget.fields -= 1
        if budget.fields < 0:
            raise budget.too_many("fields", budget.shape.max_fields)
        kind = tag & 7
        n = 1
        if kind == 2:  # length-delimited: a message, a packed array, a string or bytes
            if pos < end and buf[pos] < 0x80:
                length = buf[pos]
                pos += 1
            else:
                length, pos = _varint(buf, pos, end, budget, 5)
            stop = pos + length
            if stop > end:
                raise budget.unreadable("a length past the end of its message", at)
            known = table.get(tag >> 3)
            if known is not None:
                code, sub = known
                if code == _MESSAGE:
                    if length:
                        _walk(buf, pos, stop, sub, budget, depth + 1)
                    n = 0
                elif code == _PACKED_VARINTS:
                    # One element per byte with the top bit clear (its last
                    # byte); a varint has at most 10 bytes, so an array longer
                    # than 10 bytes an element left is too long uncounted.
                    n = (length if length > 10 * budget.scalars else
                         length - len(buf[pos:stop].translate(None, _LAST_BYTES)))
                else:
                    n = length // code
            pos = stop
        elif kind == 0:  # varint
            if pos < end and buf[pos] < 0x80:
                pos += 1
            else:
                _, pos = _varint(buf, pos, end, budget)
        elif kind == 1 or kind == 5:  # 64-bit, 32-bit
            pos += 8 if kind == 1 else 4
            if pos > end:
                raise budget.unreadable("a truncated fixed-width field", at)
        elif kind == 3:  # a group (proto2; here always an unknown field, which the parser keeps)
            pos = _walk(buf, pos, end, None, budget, depth + 1, tag >> 3)
            n = 0
        elif kind == 4:  # a group's end: only of the group being walked (None: no group open)
            if group is not None and tag >> 3 == group:
                return pos
            raise budget.unreadable("an end-group tag that no group of its field opened", at)
        else:
            raise budget.unreadable(f"wire type {kind}, which does not exist", at)
        budget.scalars -= n
        if budget.scalars < 0:
            raise budget.too_many("repeated elements", budget.shape.max_scalars)
    if group is not None:
        raise budget.unreadable(f"a group of field {group} not ended", end)
    return pos


class _Refused:
    """What a Session stream's guarded parser hands on instead of a command."""

    def __init__(self, reason: str):
        self.reason = reason


class ShapeInterceptor(grpc.aio.ServerInterceptor):
    """Walks every request of a server (:func:`check`) before it is parsed.

    A unary request that passes its shape is parsed as gRPC would parse it
    (``kvd.daemon.peer_local.parse_request``); one that does not is
    answered INVALID_ARGUMENT with the count and its bound, unparsed. On a
    bidirectional stream (EngineService's Session) the first command past
    its shape ends the commands (as if the engine had closed its side), and
    the stream then ends INVALID_ARGUMENT. Either is logged (throttled).
    Listed after the interceptors that check the caller, so those run first.

    Args:
        shape_of: the shape of a request message (:func:`engine_shape`
            or :func:`peer_shape` with the daemon's ``max_blocks_per_request``).
    """

    def __init__(self, shape_of: Callable[[Descriptor], Shape]):
        self.shape_of = shape_of
        self._warn = Throttled(log)

    async def intercept_service(self, continuation, details):
        """Wraps each handler whose request is a protobuf message (see the class)."""
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/kvd.v1."):  # health, reflection: small, not ours
            return handler
        parse = getattr(handler, "request_deserializer", None)
        descriptor = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
        if descriptor is None or handler.response_streaming != handler.request_streaming:
            return handler
        shape = self.shape_of(descriptor)
        method = details.method.rsplit("/", 1)[-1]
        warn = self._warn

        if not handler.request_streaming:  # unary: parsed in the handler, after the walk
            behavior = handler.unary_unary

            async def unary(data, context):
                try:
                    check(data, descriptor, shape)
                except ShapeError as e:
                    warn.warning("%s from %s refused: %s", method, context.peer(), e)
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"kvd: {e}") from None
                result = behavior(await parse_request(parse, data, context), context)
                return await result if inspect.isawaitable(result) else result

            return handler._replace(request_deserializer=None, unary_unary=unary)

        def guarded(data):  # gRPC's parse of each command of the stream
            try:
                check(data, descriptor, shape)
            except ShapeError as e:
                return _Refused(str(e))
            return parse(data)

        stream = handler.stream_stream

        async def session(request_iterator, context):
            refused: list[str] = []

            async def commands():
                async for cmd in request_iterator:
                    if isinstance(cmd, _Refused):
                        refused.append(cmd.reason)
                        return
                    yield cmd

            async for event in stream(commands(), context):
                yield event
            if refused:
                warn.warning("%s from %s ended: %s", method, context.peer(), refused[0])
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"kvd: {refused[0]}")

        return handler._replace(request_deserializer=guarded, stream_stream=session)
