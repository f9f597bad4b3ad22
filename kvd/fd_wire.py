"""The fd side channel's wire format: memory handed over by file descriptor.

gRPC carries no file descriptors, so next to the engine socket the daemon
listens on a second Unix socket (:func:`fd_socket_path`, ``SOCK_SEQPACKET``:
one message is one request, its boundaries kept by the kernel) where an
engine passes the fds of its KV cache memory (sealed memfds) with
``SCM_RIGHTS`` (unix(7)). One connection carries one exchange:

- request (engine -> daemon), one message: :data:`REQUEST` header
  (``b"KVDF"``, version 1, number of fds, 2 reserved zero bytes) with exactly
  that many fds as ``SCM_RIGHTS`` ancillary data, at most :data:`MAX_FDS`;
- answer (daemon -> engine), one message: :data:`ANSWER` header (``b"KVDA"``,
  version, status, number of ids, payload length in bytes) then the payload:
  status :data:`OK`: one :data:`ID_CHARS`-character ASCII id per fd, in the
  order sent; status :data:`REFUSED`: a UTF-8 message saying why.

The engine then names each fd by its id in ``RegisterEngineRequest``
(``Segment.kind = MEMORY_KIND_MEMFD``, ``Segment.fd_id``). An id is good for
one registration, by the same uid, before its deadline; the daemon closes
unclaimed fds at that deadline.

A neutral leaf module (as ``kvd.requests``): imports nothing of kvd's, so the
engine side (``kvd.client.fd_handover``) and the daemon
(``kvd.daemon.fd_channel``) share one definition.
"""

from __future__ import annotations

import struct

MAGIC_REQUEST = b"KVDF"
MAGIC_ANSWER = b"KVDA"
VERSION = 1
REQUEST = struct.Struct("<4sBBH")     # magic, version, fd count, reserved (0)
ANSWER = struct.Struct("<4sBBHI")     # magic, version, status, id count, payload bytes
OK, REFUSED = 0, 1
ID_CHARS = 32                         # 128 random bits, hex
MAX_FDS = 64                          # fds in one request (one per KV cache segment; BOUNDS.max_regions)
MAX_MESSAGE_BYTES = 4096              # an answer's payload (ids or message), and what a request may be
SUFFIX = ".fd"


class WireError(ValueError):
    """A request or answer that is not what this format says; the message says how."""


def fd_socket_path(engine_socket: str) -> str:
    """The fd side channel's socket for the engine socket ``engine_socket``
    (a path, ``unix:PATH`` or ``unix://PATH``): the same path plus ``.fd``,
    in the same directory, so it has the same reach as the engine socket."""
    for prefix in ("unix://", "unix:"):
        if engine_socket.startswith(prefix):
            engine_socket = engine_socket[len(prefix):]
            break
    return engine_socket + SUFFIX


def encode_request(nfds: int) -> bytes:
    """The request header for ``nfds`` fds (1..:data:`MAX_FDS`). Raises WireError."""
    if not 1 <= nfds <= MAX_FDS:
        raise WireError(f"a request passes 1..{MAX_FDS} fds (got {nfds})")
    return REQUEST.pack(MAGIC_REQUEST, VERSION, nfds, 0)


def parse_request(data: bytes) -> int:
    """The fd count a request header announces. Raises WireError: wrong size,
    magic, version, reserved bytes, or a count outside 1..:data:`MAX_FDS`."""
    if len(data) != REQUEST.size:
        raise WireError(f"request header must be {REQUEST.size} bytes (got {len(data)})")
    magic, version, nfds, reserved = REQUEST.unpack(data)
    if magic != MAGIC_REQUEST:
        raise WireError(f"request header starts with {magic!r}, not {MAGIC_REQUEST!r}")
    if version != VERSION:
        raise WireError(f"request version {version} is not supported (this daemon speaks {VERSION})")
    if reserved:
        raise WireError("request header's reserved bytes must be 0")
    if not 1 <= nfds <= MAX_FDS:
        raise WireError(f"a request passes 1..{MAX_FDS} fds (header says {nfds})")
    return nfds


def encode_answer(ids: list[str] | None = None, refused: str = "") -> bytes:
    """An answer: the ``ids`` accepted, or the ``refused`` message (UTF-8,
    cut to :data:`MAX_MESSAGE_BYTES`)."""
    if refused or ids is None:
        payload = refused.encode("utf-8", "replace")[:MAX_MESSAGE_BYTES]
        return ANSWER.pack(MAGIC_ANSWER, VERSION, REFUSED, 0, len(payload)) + payload
    payload = "".join(ids).encode("ascii")
    return ANSWER.pack(MAGIC_ANSWER, VERSION, OK, len(ids), len(payload)) + payload


def parse_answer(data: bytes) -> tuple[list[str], str]:
    """``(ids, "")`` of an accepted request or ``([], message)`` of a refused
    one. Raises WireError for anything else."""
    if len(data) < ANSWER.size:
        raise WireError(f"answer shorter than its {ANSWER.size}-byte header ({len(data)} bytes)")
    magic, version, status, count, length = ANSWER.unpack_from(data)
    payload = data[ANSWER.size:]
    if magic != MAGIC_ANSWER or version != VERSION or len(payload) != length:
        raise WireError(f"not a version-{VERSION} fd channel answer")
    if status == REFUSED:
        return [], payload.decode("utf-8", "replace")
    if status != OK or length != count * ID_CHARS:
        raise WireError(f"answer status {status} with {count} ids in {length} bytes")
    text = payload.decode("ascii")
    return [text[i:i + ID_CHARS] for i in range(0, length, ID_CHARS)], ""
