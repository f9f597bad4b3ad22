"""Refusing a gRPC call: ``raise Refused(code, message)``, answered by
:class:`RefusalInterceptor`, not ``context.abort()``.

Why not ``context.abort()``: in grpc.aio (1.85) it raises an exception
that grpc's own handler code catches and keeps in a reference cycle with
the call's frames, so each refused call's request message lives until the
garbage collector's next collection of that generation: measured in a
throwaway server, 20 refused 1 MiB calls left 19 request messages (and
~600 objects) in cyclic garbage with ``context.abort()``, none when the
handler's exception was caught by an outer wrapper that set the status on
the context and returned. A daemon under a flood of refused large
requests held one per call until a collection (a peer's 150 refused
32 MiB Handshake calls, 8 at a time: 5.6 and 10.5 GB peak RSS in two
runs); with nothing left in cycles each is freed when its call ends (the
same flood: 0.90-0.99 GB). The caller sees the same status and
details either way (grpc.aio discards a unary handler's return value when
the status set on the context is not OK).

One way to refuse, everywhere on both servers: handlers and interceptors
raise :class:`Refused`; :class:`RefusalInterceptor`, installed first (the
outermost wrapper), turns it into the call's status."""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Callable

import grpc

from kvd.core import events as ev
from kvd.daemon.convert import status_of


# Details travel in the grpc-message trailer, percent-encoded (gRPC over
# HTTP/2, doc/PROTOCOL-HTTP2.md: each byte outside 0x20-0x7E, and '%', takes
# three), and a client drops trailers past 8 KiB at random and past 16 KiB
# always (``grpc.max_metadata_size`` and its soft limit), answering
# RESOURCE_EXHAUSTED "received metadata size exceeds soft/hard limit" in
# place of the daemon's status. Measured: a refused Handshake quoting a 32
# MiB engine id whole, and 1,024 four-byte characters (12,288 bytes
# encoded), both reached the caller so. An honest refusal's details are a
# few hundred characters.
MAX_DETAILS_BYTES = 4096  # encoded


def _encoded_len(ch: str) -> int:
    o = ord(ch)
    return 1 if 0x20 <= o <= 0x7E and o != 0x25 else 3 * len(ch.encode())


def fit_details(message: str) -> str:
    """``message`` as status details: whole when its percent-encoded form
    takes at most :data:`MAX_DETAILS_BYTES`, else cut there, ending with
    how many characters it had. Characters UTF-8 cannot encode (lone
    surrogates) are written as escapes."""
    if len(message) <= MAX_DETAILS_BYTES and message.isascii() and message.isprintable() and "%" not in message:
        return message
    whole = len(message)
    message = message[:MAX_DETAILS_BYTES].encode("utf-8", "backslashreplace").decode()
    if whole <= MAX_DETAILS_BYTES and sum(map(_encoded_len, message)) <= MAX_DETAILS_BYTES:
        return message
    suffix = f"...({whole} characters)"
    room = MAX_DETAILS_BYTES - len(suffix)
    spent = itertools.accumulate(map(_encoded_len, message))
    return message[:next((i for i, n in enumerate(spent) if n > room), len(message))] + suffix


class Refused(Exception):
    """A call refused, or a stream ended, by the daemon.

    Args:
        code: the gRPC status the call ends with (``grpc.StatusCode``).
        message: its details, as the caller sees them (:func:`fit_details`)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        message = fit_details(message)
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def of(cls, e: ev.CoreError) -> Refused:
        """The refusal of core error ``e``: its status (``convert.status_of``) and message."""
        return cls(status_of(e), str(e))


def _answer(context, r: Refused) -> None:
    context.set_code(r.code)
    context.set_details(r.message)


def behavior_of(handler: grpc.RpcMethodHandler) -> tuple[str, Callable]:
    """``(kind, behavior)`` of ``handler``: the field of grpc's handler that
    holds its behavior (``unary_unary``, ``unary_stream``, ``stream_unary``
    or ``stream_stream``) and that behavior."""
    kind = ("unary_unary" if not handler.request_streaming and not handler.response_streaming else
            "unary_stream" if handler.response_streaming and not handler.request_streaming else
            "stream_unary" if not handler.response_streaming else "stream_stream")
    return kind, getattr(handler, kind)


def catching(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` (any of the four kinds) with a :class:`Refused` its
    behavior raises answered as the call's status: a unary response
    handler returns None (discarded by grpc.aio for a status that is not
    OK), a streaming one ends its stream."""
    kind, behavior = behavior_of(handler)
    if inspect.isasyncgenfunction(behavior):
        async def wrapped(request, context):
            try:
                async with contextlib.aclosing(behavior(request, context)) as items:
                    async for item in items:
                        yield item
            except Refused as r:
                _answer(context, r)
    elif inspect.isgeneratorfunction(behavior):
        async def wrapped(request, context):
            try:
                for item in behavior(request, context):
                    yield item
            except Refused as r:
                _answer(context, r)
    else:
        async def wrapped(request, context):
            try:
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result
            except Refused as r:
                _answer(context, r)
                return None
    return handler._replace(**{kind: wrapped})


class RefusalInterceptor(grpc.aio.ServerInterceptor):
    """Answers the :class:`Refused` that a handler, or an interceptor
    inside this one, raises with its status and details. Must be the first
    interceptor of a server (the outermost), so that it sees every other's
    refusals."""

    async def intercept_service(self, continuation, details):
        """Wraps every handler with :func:`catching`."""
        handler = await continuation(details)
        return None if handler is None else catching(handler)
