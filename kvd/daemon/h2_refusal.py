"""A gRPC refusal without gRPC: the gate's answer to a caller it does not admit.

The engine socket's gate (kvd/daemon/local_gate.py) must not hand a refused
caller's connection to the gRPC server (three daemon fds per connection,
held as long as the caller likes), yet the caller should learn why, as a
gRPC status with a message rather than a bare hang-up. ``Refusal`` speaks
just enough HTTP/2 (RFC 9113) and HPACK (RFC 7541) for that, in gRPC's
trailers-only response form (grpc/grpc doc/PROTOCOL-HTTP2.md).
"""

from __future__ import annotations

import grpc

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # RFC 9113 3.4: every client connection starts with it
_MAX_FRAME = 16384       # SETTINGS_MAX_FRAME_SIZE's initial value (RFC 9113 6.5.2): a peer sends no larger
_SETTINGS, _HEADERS, _GOAWAY = 0x4, 0x1, 0x7
_ACK, _END_STREAM_HEADERS = 0x1, 0x1 | 0x4
# After its answer the gate half-closes and reads on (discarding) until the
# caller hangs up, at most this long (seconds). Closing at once loses the
# answer: a caller's frame already in flight (its SETTINGS ACK, the request's
# DATA) meets a closed socket, its next sendmsg fails with EPIPE, and
# grpc-core fails the call UNAVAILABLE ("Stream removed (sendmsg: Broken
# pipe)") before it reads the trailers; 2 to 5 in 360 refused calls on this
# 2-core machine with both cores busy. A gRPC client closes the connection
# itself once it has read GOAWAY and has no stream left, in milliseconds.
# The lingering close of HTTP servers (nginx ``lingering_close``) for the
# same reason.
LINGER_S = 2.0
# What a caller may send before its first HEADERS frame (bytes), and how
# many SETTINGS frames of it are answered: a gRPC client sends its preface,
# one SETTINGS and a WINDOW_UPDATE (under 100 bytes), then the call's
# HEADERS (a frame is at most _MAX_FRAME). More is not a gRPC client's first
# call: the connection is closed at once, so that a caller that floods
# frames and never reads makes the gate neither parse nor answer without
# bound.
MAX_PREAMBLE_BYTES = 4 * _MAX_FRAME
MAX_SETTINGS = 4


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def _hpack_string(b: bytes) -> bytes:
    """An HPACK string literal, not Huffman-coded (RFC 7541 5.1, 5.2)."""
    n, out = len(b), bytearray()
    if n < 127:
        out.append(n)
    else:
        out.append(127)
        n -= 127
        while n >= 128:
            out.append(n & 127 | 128)
            n >>= 7
        out.append(n)
    return bytes(out) + b


def refusal_headers(code: grpc.StatusCode, message: str) -> bytes:
    """The HPACK block of a gRPC trailers-only response (``:status 200``,
    ``content-type``, ``grpc-status``, ``grpc-message`` percent-encoded as
    gRPC's PROTOCOL-HTTP2.md says), with no dynamic table entries."""
    pct = "".join(chr(b) if 0x20 <= b <= 0x7E and b != 0x25 else f"%{b:02X}" for b in message.encode())
    block = b"\x88"  # :status 200, static table entry 8 (RFC 7541 appendix A)
    for name, value in ((b"content-type", b"application/grpc"), (b"grpc-status", str(code.value[0]).encode()),
                        (b"grpc-message", pct.encode())):
        block += b"\x00" + _hpack_string(name) + _hpack_string(value)  # literal, never indexed
    return block


class Refusal:
    """Answers the first call on a refused caller's connection, then closes it.

    The gate speaks just enough HTTP/2 for that: its SETTINGS (the server's
    preface) at once, an ACK of the client's SETTINGS, then on the first
    HEADERS frame a trailers-only response with ``code`` and ``message``
    and GOAWAY; then it half-closes (EOF to the caller) and discards what
    still comes until the caller closes (:meth:`eof`) or ``linger_s``
    seconds pass (``LINGER_S`` says why). Anything else (not HTTP/2, a frame
    over 16 KiB, more than ``MAX_PREAMBLE_BYTES`` or ``MAX_SETTINGS``
    SETTINGS frames before the first HEADERS) closes the connection at once.
    The client's header block is never decoded.

    Args:
        transport: an asyncio stream transport (``write``, ``close``,
            ``can_write_eof``, ``write_eof``).
        code, message: the gRPC status the first call gets.
        call_later: the event loop's ``call_later`` for the linger bound
            (None: close at once after the answer, for a unit test).
    """

    def __init__(self, transport, code: grpc.StatusCode, message: str, call_later=None,
                 linger_s: float = LINGER_S):
        self.transport = transport
        self.code, self.message = code, message
        self.call_later, self.linger_s = call_later, linger_s
        self.linger = None  # the timer that ends the lingering close
        self.buf = bytearray()
        self.taken = 0      # bytes fed before the answer (MAX_PREAMBLE_BYTES)
        self.settings = 0   # SETTINGS frames answered (MAX_SETTINGS)
        self.started = False
        self.done = False
        transport.write(_frame(_SETTINGS, 0, 0))

    def feed(self, data: bytes) -> None:
        if self.done:
            return  # answered: the caller's late frames are read and dropped
        self.taken += len(data)
        if self.taken > MAX_PREAMBLE_BYTES:
            return self.close()
        buf = self.buf
        buf += data
        if not self.started:
            if not PREFACE.startswith(buf[:len(PREFACE)]):
                return self.close()
            if len(buf) < len(PREFACE):
                return
            del buf[:len(PREFACE)]
            self.started = True
        # Frames are read at an offset and the buffer cut once per call: a
        # slice per frame copied the rest each time (quadratic in the frames
        # of one read).
        pos = 0
        while len(buf) - pos >= 9:
            length, kind, flags = int.from_bytes(buf[pos:pos + 3], "big"), buf[pos + 3], buf[pos + 4]
            stream = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            if length > _MAX_FRAME:
                return self.close()
            if len(buf) - pos - 9 < length:
                break
            pos += 9 + length
            if kind == _SETTINGS and not flags & _ACK:
                self.settings += 1
                if self.settings > MAX_SETTINGS:
                    return self.close()
                self.transport.write(_frame(_SETTINGS, _ACK, 0))
            elif kind == _HEADERS and stream:
                self.transport.write(_frame(_HEADERS, _END_STREAM_HEADERS, stream,
                                            refusal_headers(self.code, self.message)))
                self.transport.write(_frame(_GOAWAY, 0, 0, stream.to_bytes(4, "big") + bytes(4)))
                return self._linger()
        del buf[:pos]

    def feed_keeping(self, data: bytes, idle):
        """:meth:`feed`, for a connection whose silence is bounded by ``idle``
        (a timer handle, or None): returns the timer to keep, None once the
        call is answered (cancelled: the linger bound applies from then)."""
        self.feed(data)
        if self.done and idle is not None:
            idle.cancel()
            return None
        return idle

    def _linger(self) -> None:
        self.done, self.buf = True, bytearray()
        if self.call_later is None or not self.transport.can_write_eof():
            return self.close()
        self.transport.write_eof()  # after what was written
        self.linger = self.call_later(self.linger_s, self.close)

    def eof(self) -> None:
        """The caller closed its side: the connection is closed."""
        self.close()

    def close(self) -> None:
        """Closes the connection now. What was written and the caller has
        not taken by then is dropped (``abort``): a ``close`` waits for the
        caller to read it, and one that never reads would keep the
        connection (a daemon fd, a slot of the connection caps) for ever."""
        self.done = True
        if self.linger is not None:
            self.linger.cancel()
            self.linger = None
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()
