"""The engine client's gRPC channel to its node's daemon: the daemon address as
a gRPC target, the channel's options, and how a failed call reads
(:class:`EngineClientError`).

Addresses: ``unix:///abs/path.sock``, ``unix:relative.sock``, a bare path
(``/run/kvd/engine.sock``, made ``unix://``), or ``host:port``.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import socket
import stat
import struct

import grpc

from kvd.addresses import socket_file, split_host_port
from kvd.config import client_socket_problem

#: Default bound on one gRPC message either way (bytes). A RegisterEngine of a
#: few thousand regions is tens of kB; stats and events are far smaller.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class EngineClientError(RuntimeError):
    """A blocking RPC failed; the message names the RPC and the gRPC status.

    ``code``: the call's ``grpc.StatusCode`` (None when it had none, e.g. a
    failure before the call, such as ``before_register`` raising).
    ``daemon_gone``: the call failed UNAVAILABLE and no daemon was at the
    engine socket after it (it reached none; ``kvd.client.engine_client``).
    """

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code
        self.daemon_gone = False


def normalize_address(address: str) -> str:
    """A gRPC target for a daemon address (see the module docstring).

    Raises:
        ValueError: empty address, or a Unix socket path gRPC would read as
            another (``?``, ``#``, ``%`` or control characters:
            :func:`kvd.config.client_socket_problem`; the look at the socket
            would check one file and gRPC dial another), or a ``host:port``
            whose port is not one (:func:`kvd.addresses.split_host_port`).
    """
    address = address.strip()
    if not address:
        raise ValueError("empty kvd daemon address")
    if address.startswith("unix:"):
        problem = client_socket_problem(socket_file(address))
        if problem:
            raise ValueError(f"kvd daemon address {address!r}: {problem}")
        return address
    if address.startswith(("unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith(("/", ".")) or address.endswith(".sock"):
        problem = client_socket_problem(address)
        if problem:
            raise ValueError(f"kvd daemon address {address!r}: {problem}")
        return "unix://" + os.path.abspath(address)
    split_host_port(address, "kvd daemon address", min_port=1)  # a typo'd port timed out as DEADLINE_EXCEEDED
    return address


def server_refusal(uid: int, path: str) -> str | None:
    """Why the Unix socket at ``path``, served by a process of ``uid`` (its
    ``SO_PEERCRED`` uid), must not be taken for the kvd daemon's; None to
    use it.

    Root and this process's own uid, which no other user can be, are
    trusted in any directory of theirs, but on the way no name another
    user could have put there: every directory and link theirs, and the
    name itself a socket of theirs, not a link (:func:`untrusted_step` with
    ``shared_dirs``). Another user's link at the path, to a socket root
    serves, passed the uid check while its owner could flip it to its own
    listener for gRPC's connect right after (attacker review: the session
    token reached it). Another uid (a daemon run as a user of its own, as
    the systemd unit does) only where no one else could have put the
    socket: :func:`untrusted_step` finds no directory on the way that
    others may write. A directory every user may
    write, sticky or not (``/tmp``), lets anyone make a directory or a link
    of their own there and bind the paths in it (attacker reviews: a
    squatter that bound the engine socket too passed a check of that
    socket's owner; one that made ``/tmp/kvd`` passed a check of the
    directory's owner; one that swapped ``/tmp/kvd`` and a link to ``/``
    passed a check of the resolved path made after the connect).
    """
    me = os.geteuid()
    if uid in (0, me):
        try:
            step = untrusted_step(_absolute(path), (0, me), shared_dirs=True)
        except OSError as e:
            return f"{path} is served by uid {uid}, and its path cannot be checked ({e.strerror or e})"
        if step is None:
            return None
        return (f"{path} is served by uid {uid}, but on its way {step}: another user may have put it there, "
                f"and may swap it between this look and gRPC's own connect. Not used")
    try:
        step = untrusted_step(_absolute(path), (0, uid))
    except OSError as e:
        return f"{path} is served by uid {uid}, and its path cannot be checked ({e.strerror or e})"
    if step is None:
        return None
    return (f"{path} is served by uid {uid} (neither root nor this process's uid {me}), and on its way {step}: "
            f"anyone could have bound it before the daemon. Not used; put the daemon's sockets in a directory only "
            f"its user may write (/run/kvd), or run the engine as the daemon's user")


def _absolute(path: str) -> str:
    """``path`` from ``/``, its ``..`` kept: ``os.path.abspath`` drops
    ``link/..`` as text, where the kernel's connect follows the link and takes
    ``..`` in its target (attacker review: another user's link before a
    ``..`` in a ``unix:`` address went unwalked, and was flipped after the
    look). :func:`untrusted_step` takes ``..`` as the kernel does."""
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


#: Symbolic links followed on one path at most (the kernel's own limit, path_resolution(7)).
MAX_LINKS = 40


def untrusted_step(path: str, trusted: tuple[int, ...], *, shared_dirs: bool = False) -> str | None:
    """What on the way to the absolute ``path`` lets a user other than
    ``trusted`` put or swap a name there, or None.

    ``shared_dirs``: a directory others may write passes if a ``trusted``
    uid owns it (``/tmp``), and the name reached must then be a socket of a
    ``trusted`` uid, not a link: in a sticky directory no other user can
    rename or remove it (in one without the sticky bit anyone can, which
    the daemon warns about at startup).

    The path is resolved here as the kernel does, from ``/``, one name at a
    time: every directory passed through must be a ``trusted`` uid's and
    writable by no group and no other user (sticky or not), and every
    symbolic link a ``trusted`` uid's (its target is walked the same way). Then no name
    the resolution read can be changed by anyone else, so it gave the same
    file when the socket was connected as it does now (a walk of the
    resolved path instead, ``os.path.realpath``, read the names again and
    was raced). ``..`` is taken in the directory reached, as the kernel does.
    Raises OSError (a name missing, too many links)."""
    def bad(where: str, st: os.stat_result) -> str:
        return f"{where} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}) lets others put files there"

    def untrusted_dir(st: os.stat_result) -> bool:
        return st.st_uid not in trusted or (not shared_dirs and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))

    st = os.stat("/")
    if untrusted_dir(st):
        return bad("/", st)
    names = [n for n in path.split("/") if n]
    here, links = "/", 0
    while names:
        name = names.pop(0)
        if name == ".":
            continue
        if name == "..":
            here = os.path.dirname(here)  # a directory reached without links: its parent is textual
            continue
        step = os.path.join(here, name)
        st = os.lstat(step)
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in trusted:
                return f"the symbolic link {step} is uid {st.st_uid}'s"
            links += 1
            if links > MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
            target = os.readlink(step)
            if target.startswith("/"):
                here = "/"
            names = [n for n in target.split("/") if n] + names
            continue
        if not names:
            if shared_dirs and not (stat.S_ISSOCK(st.st_mode) and st.st_uid in trusted):
                kind = "a socket" if stat.S_ISSOCK(st.st_mode) else "not a socket"
                return f"{step} is {kind} of uid {st.st_uid}"
            return None  # the socket itself, in a directory only the trusted may write (or, shared, theirs)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), step)
        if untrusted_dir(st):
            return bad(step, st)
        here = step
    return None


def peer_uid(s: socket.socket) -> int:
    """The uid of the process serving the connected Unix socket ``s``: its
    credentials at ``listen`` (unix(7), ``SO_PEERCRED``), which it cannot
    forge."""
    _, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def check_daemon_serves(s: socket.socket, path: str) -> None:
    """Raises PermissionError (no errno; the message says why) unless the
    process serving the connected Unix socket ``s`` at ``path`` (the
    engine socket or a side socket beside it) may be taken for the daemon
    (:func:`server_refusal`): the engine would hand it its session (the
    command socket) or its KV cache memory itself (the fd side channel)."""
    why = server_refusal(peer_uid(s), path)
    if why is not None:
        raise PermissionError(why)


#: ``connect()`` errors on a Unix socket that mean no daemon listens there
#: yet: no socket file (not started, or its directory not made yet), or a file
#: nobody accepts on (a daemon gone, or one still starting). Anything else
#: (``EACCES``: the socket's mode or directory shuts this user out) is not
#: cured by waiting.
NOT_LISTENING = frozenset({errno.ENOENT, errno.ECONNREFUSED})


def beside_engine_socket(address: str) -> str:
    """The engine socket's file, where the daemon's side sockets
    (``<file>.cmd``, ``<file>.fd``) are: ``address``'s path, its symbolic
    links resolved (a configured path that is a link to the daemon's socket
    has no side sockets beside the link). Each side socket is checked on the
    connection it is used over (:func:`check_daemon_serves`), on this
    link-free path."""
    path = unix_path(address) or address
    return os.path.realpath(path)


def unix_path(address: str) -> str | None:
    """The file of a ``unix:`` address (``unix:///abs``, ``unix:rel``), or of
    a bare path (:func:`normalize_address`); None for anything else
    (``host:port``, ``unix-abstract:``)."""
    address = normalize_address(address)
    return socket_file(address) if address.startswith("unix:") else None


#: ``connect()`` errors on a Unix socket that mean this user may not connect
#: there: the socket's mode (connect needs write permission on it, unix(7)),
#: or a directory on its path this user may not search. Waiting does not
#: change them.
DENIED = frozenset({errno.EACCES, errno.EPERM})


class EngineSocketDenied(EngineClientError):
    """This process's user may not connect to the daemon's engine socket
    (:data:`DENIED`); the message says who owns what (:func:`denied_message`)."""


def _ids(uid: int, gid: int) -> str:
    """``uid 0 (root) gid 0 (root)``: numbers, and names where known."""
    def name(get, n: int) -> str:
        try:
            return f" ({get(n)[0]})"
        except (KeyError, OverflowError):
            return ""
    return f"uid {uid}{name(pwd.getpwuid, uid)} gid {gid}{name(grp.getgrgid, gid)}"


def denied_message(path: str, error: OSError, what: str = "the kvd engine socket") -> str:
    """Why this process may not connect to the Unix socket ``path`` (its
    ``connect()`` failed with ``error``, one of :data:`DENIED`): the socket's
    owner and mode, or the directory on the way that this user may not
    search, this process's uid, gid and groups, and what to change. ``what``
    names the socket."""
    me = f"this engine runs as {_ids(os.geteuid(), os.getegid())}"
    groups = sorted(set(os.getgroups()) - {os.getegid()})
    if groups:
        me += f" (groups {', '.join(map(str, groups))})"
    head = f"permission denied connecting to {what} {path} ({error.strerror or error})"
    try:
        st = os.stat(path)
    except PermissionError:
        st = None
    except OSError:
        return f"{head}; {me}"
    if st is not None:
        return (f"{head}: the socket is owned by {_ids(st.st_uid, st.st_gid)}, mode {stat.S_IMODE(st.st_mode):04o}"
                f" (connecting needs write permission); {me}: run the engine as the socket's owner or in its "
                "group (kvd serve --engine-socket-group)")
    # A directory on the way shuts this user out: the last one stat() reaches.
    blocked = os.path.dirname(os.path.abspath(path))
    parent = os.path.dirname(blocked)
    while parent != blocked:
        try:
            os.stat(blocked)
            break
        except OSError:
            blocked, parent = parent, os.path.dirname(parent)
    try:
        st = os.stat(blocked)
        owner = f"owned by {_ids(st.st_uid, st.st_gid)}, mode {stat.S_IMODE(st.st_mode):04o}"
    except OSError:
        owner = "not readable here"
    return (f"{head}: a directory on its path this user may not enter, {blocked} ({owner}); {me}: "
            "let the engine's user search that directory (x) or move the socket")


def no_daemon_message(address: str, waited_s: float) -> str:
    """What an engine says when no daemon came up at ``address`` within
    ``waited_s`` seconds: the socket as configured (its path, not a side
    channel's) and what to do."""
    where = unix_path(address) or address
    return (f"no kvd daemon at {where} within {round(waited_s, 1):g} s "
            "(start `kvd serve` first, or check kvd_socket)")


def probe_unix_socket(address: str) -> OSError | None:
    """The error of one ``connect()`` to the Unix socket of ``address`` (None:
    it accepted, or ``address`` is not a Unix socket), or a ``PermissionError``
    with no errno when it accepted but its server may not be taken for the
    daemon (:func:`server_refusal`; gRPC's channel tells no peer
    credentials). Closed at once: before a blocking call (is a daemon there,
    may this user connect, is it the daemon) and to tell why a call found no
    daemon; never on an engine step's way."""
    path = unix_path(address)
    if path is None:
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError as e:
            return e
        why = server_refusal(peer_uid(s), path)
    return None if why is None else PermissionError(why)


def is_impostor(error: OSError | None) -> bool:
    """True for :func:`probe_unix_socket`'s "not the daemon" answer."""
    return isinstance(error, PermissionError) and error.errno is None


def open_channel(target: str, *, max_message_bytes: int, backoff_max_s: float) -> grpc.Channel:
    """An insecure channel to ``target`` (a :func:`normalize_address` result):
    messages capped at ``max_message_bytes`` either way, the channel's own
    reconnect backoff from 50 ms up to ``backoff_max_s`` (seconds), and a
    connection shared with no other channel."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # The channel's own reconnect; the session loop backs off on top of it.
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.min_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", int(backoff_max_s * 1000)),
        # A connection of this channel's own: by default every channel of a
        # process to one target shares gRPC's subchannels, so a channel opened
        # to replace one whose connect failed (or reached another user's
        # listener) took over its connection and its backoff, and closing the
        # old one ended neither while another channel held them.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    return grpc.insecure_channel(target, options=options)


def rpc_status(error: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    """``(code, "CODE: details")`` of a failed call (``"?"`` for a missing code:
    an ``RpcError`` that is not a ``grpc.Call``)."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    return code, f"{code.name if code else '?'}: {details}"


def call_unary(address: str, name: str, method, request, timeout_s: float, wait_for_ready: bool = True):
    """``method(request)`` (a stub's unary method named ``name``), with a
    deadline of ``timeout_s`` seconds.

    Raises:
        EngineClientError: the call failed; the message names ``name``,
            ``address`` and the status.
    """
    try:
        return method(request, timeout=timeout_s, wait_for_ready=wait_for_ready)
    except grpc.RpcError as e:
        code, text = rpc_status(e)
        raise EngineClientError(f"{name} to kvd at {address} failed: {text}", code) from None
