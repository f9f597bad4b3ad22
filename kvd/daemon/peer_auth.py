"""Who may use PeerService, and whom the daemon believes: mutual TLS and a shared token.

Two controls, configured by file paths (kvd/config.py, docs/SECURITY.md):

- **Mutual TLS** (``peer_tls_cert``, ``peer_tls_key``, ``peer_tls_ca``): the
  peer port serves TLS and requires a client certificate signed by the CA;
  the daemon's PeerClient presents its own certificate and verifies the
  remote daemon's against the CA and the host it dialed (or
  ``peer_tls_server_name``). Encrypts and authenticates both ends.
- **Shared token** (``peer_token_file``): every PeerService call carries
  ``x-kvd-peer-auth: v2 <address> <unix time> <nonce> <mac>``, ``mac`` =
  HMAC-SHA256(token, method, the address the caller dialed, time, nonce,
  SHA-256 of the request's bytes). The callee checks the MAC, that the
  address is its own (``peer_address``, or its listen address), that the
  time is within ``WINDOW_S`` and that the nonce is new, then answers with
  ``x-kvd-peer-proof`` in its trailing metadata: its own MAC over the same
  fields and the SHA-256 of the response's bytes. The caller checks that proof
  before it parses the answer (agent metadata, layout). The token itself
  never goes on the wire, so a daemon that dials an address an engine named
  (from ``kv_transfer_params``) gives nothing away to whoever listens there;
  a captured header cannot be replayed; a relay to another daemon is refused;
  and a relay on the path cannot swap a request's body (a Notify, a Push)
  or an answer (a handshake's agent metadata) for another. Error statuses
  carry no proof: a relay can fail a call, which it could by dropping it.
  It does not encrypt: on an untrusted network use mutual TLS.

  Version ``v1`` (kvd 0.x before the body was covered) is refused with a
  message saying so; a ``v1`` daemon refuses ``v2`` as a malformed header.
  Daemons of a cluster that uses the token are upgraded together.

Health and reflection on the peer port need no token (probes), but do need
TLS when it is on. Anything else is refused with UNAUTHENTICATED.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import inspect
import logging
import os
import re
import secrets
import ssl
import stat
import time
from dataclasses import dataclass

import grpc

from kvd.config import Config
from kvd.daemon.call_refusal import Refused
from kvd.daemon.local_gate import wrap_handler
from kvd.daemon.peer_local import parse_request

log = logging.getLogger("kvd.peer")

HEADER = "x-kvd-peer-auth"
PROOF = "x-kvd-peer-proof"
VERSION = "v2"           # of the header: v1 had no hash of the message in its MAC
WINDOW_S = 60.0          # a call's time may differ from ours by this much (NTP-synchronised nodes)
# Nonces of the last 2 * WINDOW_S seconds, remembered for replay checks. A
# nonce is kept until its header could no longer pass the time check; when
# this many are live, new calls are refused (never a live nonce forgotten).
# Only calls with a valid MAC add one: 131,072 per 120 s is ~1,000 peer calls
# a second (one handshake per remote worker; Push and Notify per request in
# push mode).
MAX_NONCES = 1 << 17
PEER_SERVICE_PREFIX = "/kvd.v1.PeerService/"


# A refusal repeated by the same caller host for the same reason is logged
# at most this often (seconds): a daemon with the wrong token tries again
# every second (warm_peers, per local worker) for as long as it runs.
REPEAT_LOG_S = 60.0
# Caller hosts and reasons remembered for that (the oldest is forgotten past it).
MAX_LOGGED_CALLERS = 1024


class PeerAuthError(Exception):
    """A peer call or answer failed authentication; the message says why."""


class ReplayWindowFull(PeerAuthError):
    """``MAX_NONCES`` live nonces: the call is refused until some expire."""


def _mac(token: bytes, kind: str, *fields: str) -> str:
    msg = "\n".join((kind, *fields)).encode()
    return hmac.new(token, msg, hashlib.sha256).hexdigest()


def _digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _same(a: str, b: str) -> bool:
    """Constant-time equality of two header values (any characters)."""
    return hmac.compare_digest(a.encode("utf-8", "surrogateescape"), b.encode("utf-8", "surrogateescape"))


_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", re.S)


def check_tls_files(cfg: Config) -> None:
    """Checks, with Python's ``ssl`` (OpenSSL, as gRPC), that ``peer_tls_cert``
    holds a PEM certificate, ``peer_tls_key`` the private key of that
    certificate and ``peer_tls_ca`` a PEM CA certificate, before anything
    binds: gRPC would only fail the bind, with no word of which file is wrong.

    Raises:
        ConfigError: naming the setting, its file and what is wrong.
    """
    cert_path, key_path, ca_path = cfg.peer_tls_cert, cfg.peer_tls_key, cfg.peer_tls_ca
    pems = _PEM_CERT.findall(cfg.read_file_setting("peer_tls_cert") or b"")
    if not pems:
        raise cfg._error("peer_tls_cert", f"{cert_path} holds no PEM certificate "
                                          f"(-----BEGIN CERTIFICATE-----)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=b"\n".join(pems).decode("ascii"))
    except (ssl.SSLError, ValueError, UnicodeDecodeError) as e:
        raise cfg._error("peer_tls_cert", f"{cert_path}: unreadable PEM certificate: {e}") from None
    try:
        # The password callback makes an encrypted key fail instead of prompting on a terminal.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path, password=lambda: b"")
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e) or "key values mismatch" in str(e):
            raise cfg._error("peer_tls_key", f"{key_path} is not the private key of peer_tls_cert {cert_path} "
                                             f"(another node's key?)") from None
        raise cfg._error("peer_tls_key", f"{key_path} holds no usable PEM private key (unencrypted) "
                                         f"for peer_tls_cert: {e}") from None
    except OSError as e:
        raise cfg._error("peer_tls_key", f"cannot read {key_path}: {e.strerror or e}") from None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=ca_path)
    except ssl.SSLError as e:
        raise cfg._error("peer_tls_ca", f"{ca_path} holds no PEM CA certificate: {e}") from None
    except OSError as e:
        raise cfg._error("peer_tls_ca", f"cannot read {ca_path}: {e.strerror or e}") from None
    problem = _verify_against_ca(cert_path, key_path, ca_path)
    if problem:
        raise cfg._error("peer_tls_cert", f"{cert_path} does not verify against peer_tls_ca {ca_path} "
                                          f"({problem}): every peer would refuse it")


def _verify_against_ca(cert_path: str, key_path: str, ca_path: str) -> str:
    """"" when the certificate chain verifies against the CA bundle, else
    OpenSSL's reason (not signed by that CA, expired, not yet valid...).

    A TLS handshake between two in-memory endpoints (``ssl.MemoryBIO``): the
    server presents ``cert_path``/``key_path``, the client trusts only
    ``ca_path``; names are not checked (peers dial by address). No socket.
    """
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_path, key_path, password=lambda: b"")
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_REQUIRED
    client.load_verify_locations(cafile=ca_path)
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_side=False)
    srv = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):  # a TLS 1.3 handshake is 2-3 flights each way
        done = True
        for end, out, peer_in in ((c, c_out, s_in), (srv, s_out, c_in)):
            try:
                end.do_handshake()
            except ssl.SSLWantReadError:
                done = False
            except ssl.SSLCertVerificationError as e:
                return e.verify_message or str(e)
            except ssl.SSLError as e:
                if end is c:
                    return str(e)
                done = False  # the server learns of the client's alert; the client's error says why
            data = out.read()
            if data:
                peer_in.write(data)
        if done:
            return ""
    return ""


def _caller_host(peer: str) -> str:
    """gRPC's ``context.peer()`` without its port (``ipv4:10.0.0.5:51234``
    -> ``ipv4:10.0.0.5``): each call may come on a new connection."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rpartition(":")[0]
    return peer


class RefusalLog:
    """Refused peer calls for the log, at WARNING: the first from a caller
    host for a reason at once; the same again from that host at most once
    per ``repeat_s`` seconds, with the count left out since; all callers
    together at most one line per ``interval_s`` (a flood of new callers or
    reasons cannot fill the log either; those left out are counted on the
    next line). Reasons are compared with their numbers left out."""

    def __init__(self, logger: logging.Logger, repeat_s: float = REPEAT_LOG_S, interval_s: float = 1.0,
                 max_keys: int = MAX_LOGGED_CALLERS, clock=time.monotonic):
        self.log = logger
        self.repeat_s, self.interval_s, self.max_keys = repeat_s, interval_s, max_keys
        self.clock = clock
        self._last = -interval_s
        self._left_out = 0  # by the interval_s cap, since the last line
        self._keys: collections.OrderedDict[tuple[str, str], list] = collections.OrderedDict()

    def warning(self, caller: str, reason: str, msg: str, *args) -> None:
        """Logs ``msg % args`` for a call from ``caller`` refused for
        ``reason``, unless one like it was logged too recently."""
        now = self.clock()
        key = (caller, re.sub(r"\d+", "N", reason))
        entry = self._keys.get(key)  # [when last logged, repeats left out since]
        if entry is not None and now - entry[0] < self.repeat_s:
            entry[1] += 1
            return
        if now - self._last < self.interval_s:
            self._left_out += 1
            return
        notes = []
        if entry is not None and entry[1]:
            notes.append(f"{entry[1]} more like it from this caller in the last {now - entry[0]:.0f} s")
        if self._left_out:
            notes.append(f"{self._left_out} other refused call(s) not logged")
        self._last, self._left_out = now, 0
        self._keys[key] = [now, 0]
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        self.log.warning(msg + (f" ({'; '.join(notes)})" if notes else ""), *args)


@dataclass
class ClientProof:
    """One call's authenticated fields: what a caller keeps to check the
    callee's proof, and what a callee signs its answer with. ``body`` is the
    SHA-256 (hex) of the request's bytes."""

    method: str
    address: str
    ts: str
    nonce: str
    body: str

    def reply_mac(self, token: bytes, response: bytes) -> str:
        """The callee's proof for ``response`` (the answer's bytes)."""
        return _mac(token, "kvd-peer-reply", self.method, self.address, self.ts, self.nonce, self.body,
                    _digest(response))


class PeerAuth:
    """The peer port's TLS material and token (all optional).

    Args:
        cert, key, ca: PEM bytes (all three or none).
        server_name: name to verify in remote certificates ("" = the host dialed).
        token: the shared secret (None = no token).
    """

    def __init__(self, cert: bytes | None = None, key: bytes | None = None, ca: bytes | None = None,
                 server_name: str = "", token: bytes | None = None, max_nonces: int = MAX_NONCES):
        self.cert, self.key, self.ca = cert, key, ca
        self.server_name = server_name
        self.token = token
        self.max_nonces = max_nonces
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()  # nonce -> forget after
        self._refused = RefusalLog(log)

    @classmethod
    def from_config(cls, cfg: Config) -> "PeerAuth":
        """Reads the files the settings name. Raises ConfigError naming the key."""
        token = cfg.read_file_setting("peer_token_file")
        if token is not None:
            token = token.strip()
            if len(token) < 16:
                raise cfg._error("peer_token_file", f"{cfg.peer_token_file}: the token must have 16 or more "
                                                    f"characters (e.g. openssl rand -hex 32)")
        auth = cls(cfg.read_file_setting("peer_tls_cert"), cfg.read_file_setting("peer_tls_key"),
                   cfg.read_file_setting("peer_tls_ca"), cfg.peer_tls_server_name, token)
        if auth.tls:
            check_tls_files(cfg)
        return auth

    @property
    def tls(self) -> bool:
        """True when certificate, key and CA are all set (mutual TLS on the peer port)."""
        return bool(self.cert and self.key and self.ca)

    @property
    def secured(self) -> bool:
        """Callers must authenticate (TLS client certificate or token)."""
        return self.tls or bool(self.token)

    def describe(self) -> str:
        """``"mutual TLS"``, ``"token"``, both joined by ``+``, or ``"none"``, for logs."""
        parts = (["mutual TLS"] if self.tls else []) + (["token"] if self.token else [])
        return " + ".join(parts) or "none"

    def mode(self, loopback: bool) -> str:
        """For GetStats (``PeerAuthMode`` less its ``PEER_AUTH_`` prefix, in
        lower case): ``"token"``, ``"mutual_tls"``, ``"mutual_tls_and_token"``,
        or with neither ``"none_loopback"`` / ``"none_insecure"`` by whether
        PeerService is bound to ``loopback`` (the server binds loopback
        unless ``peer_insecure`` is set)."""
        if self.secured:
            return "_and_".join((["mutual_tls"] if self.tls else []) + (["token"] if self.token else []))
        return "none_loopback" if loopback else "none_insecure"

    # ------------------------------------------------------------- client side
    def server_credentials(self) -> grpc.ServerCredentials | None:
        """Server credentials for the peer port requiring a client certificate
        signed by the CA (mutual TLS); None without TLS."""
        if not self.tls:
            return None
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel(self, address: str, options: list) -> grpc.aio.Channel:
        """A channel to a remote daemon's peer port ``host:port`` (TLS when
        configured), always dialed by DNS name or IP address: gRPC reads a
        bare target's leading word as a scheme, and an address an engine or
        an API client named (``kv_transfer_params``) as ``unix-abstract:7777``
        had this daemon connect to a local abstract socket (attacker review)."""
        address = f"dns:///{address}"
        if not self.tls:
            return grpc.aio.insecure_channel(address, options=options)
        creds = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                             certificate_chain=self.cert)
        if self.server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return grpc.aio.secure_channel(address, creds, options=options)

    def call_metadata(self, method: str, address: str, body: bytes) -> tuple[tuple, ClientProof | None]:
        """Metadata for one call of ``method`` (``/kvd.v1.PeerService/X``) to
        ``address`` whose request serializes to ``body`` (the bytes sent)."""
        if not self.token:
            return (), None
        p = ClientProof(method, address, str(int(time.time())), secrets.token_hex(16), _digest(body))
        mac = _mac(self.token, "kvd-peer-call", method, address, p.ts, p.nonce, p.body)
        return ((HEADER, f"{VERSION} {address} {p.ts} {p.nonce} {mac}"),), p

    def check_proof(self, trailing_metadata, p: ClientProof | None, response: bytes) -> None:
        """Raises PeerAuthError unless the callee proved it knows the token and
        sent ``response`` (the answer's bytes) for this very call."""
        if p is None:
            return
        got = dict(trailing_metadata or ()).get(PROOF, "")
        if not _same(str(got), p.reply_mac(self.token, response)):
            raise PeerAuthError("the remote daemon did not prove the shared peer token for this answer "
                                "(is its peer_token_file the same as ours? a relay that changed the answer?)")

    # ------------------------------------------------------------- server side
    def check_call(self, method: str, metadata, addresses: set[str], body: bytes) -> ClientProof:
        """The call's authenticated fields (to sign the answer with), for a
        call of ``method`` whose request arrived as ``body``. Raises
        PeerAuthError (ReplayWindowFull when too many nonces are live)."""
        value = dict(metadata or ()).get(HEADER)
        if value is None:
            raise PeerAuthError(f"missing {HEADER}: this daemon requires the shared peer token")
        parts = str(value).split(" ")
        if parts[0] == "v1":
            raise PeerAuthError(f"{HEADER} v1 (a kvd older than this daemon, whose MAC does not cover the "
                                f"message) is refused: this daemon requires {VERSION}; upgrade every daemon")
        if len(parts) != 5 or parts[0] != VERSION:
            raise PeerAuthError(f"malformed {HEADER}")
        _, address, ts, nonce, mac = parts
        p = ClientProof(method, address, ts, nonce, _digest(body))
        if not _same(mac, _mac(self.token, "kvd-peer-call", method, address, ts, nonce, p.body)):
            raise PeerAuthError("bad peer token proof (is peer_token_file the same on both daemons? "
                                "or the message was changed on the way)")
        now = time.time()
        if not ts.isdigit() or abs(now - int(ts)) > WINDOW_S:
            raise PeerAuthError(f"peer token proof too old or from the future (clocks more than "
                                f"{WINDOW_S:.0f} s apart?)")
        if address.lower() not in addresses:
            raise PeerAuthError(f"the call was addressed to {address}, not to this daemon "
                                f"({', '.join(sorted(addresses))}): relayed?")
        self._remember(nonce, now)
        return p

    def _remember(self, nonce: str, now: float) -> None:
        """Records a nonce until its header can no longer pass the time check
        (``ts`` within WINDOW_S of ``now``: 2 * WINDOW_S from now). Raises
        PeerAuthError for a nonce seen before, ReplayWindowFull when
        ``max_nonces`` are live (forgetting one would let its header be replayed)."""
        while self._seen and next(iter(self._seen.values())) < now:
            self._seen.popitem(last=False)  # kept in arrival order: forget-after times only grow
        if nonce in self._seen:
            raise PeerAuthError("replayed peer token proof")
        if len(self._seen) >= self.max_nonces:
            raise ReplayWindowFull(f"{len(self._seen)} peer calls in the last {2 * WINDOW_S:.0f} s, the most "
                                   f"this daemon remembers for replay checks: refused until some expire")
        self._seen[nonce] = max(now + 2 * WINDOW_S, next(reversed(self._seen.values()), 0.0))

    def refused(self, method: str, peer: str, error: Exception) -> None:
        """Logs a refused peer call of ``method`` from ``peer`` (gRPC's
        ``context.peer()``): the same refusal from the same host once a
        minute at most, all together once a second (:class:`RefusalLog`)."""
        self._refused.warning(_caller_host(peer), f"{type(error).__name__}: {error}",
                              "peer call %s from %s refused: %s", method, peer, error)


class PeerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the token on every PeerService call; refuses with UNAUTHENTICATED.

    Args:
        auth: the daemon's PeerAuth (with a token).
        addresses: returns the ``host:port`` names this daemon answers to.
    """

    def __init__(self, auth: PeerAuth, addresses):
        self.auth = auth
        self.addresses = addresses

    async def intercept_service(self, continuation, details):
        """Wraps PeerService handlers so that each first checks the call's
        token and MAC over the request's bytes (aborting with UNAUTHENTICATED,
        or RESOURCE_EXHAUSTED when the replay window is full), then sends the
        answer with this daemon's proof over it in the trailing metadata;
        health and reflection pass without a token."""
        handler = await continuation(details)
        if handler is None or not details.method.startswith(PEER_SERVICE_PREFIX):
            return handler  # health, reflection: no token (probes)
        auth, method = self.auth, details.method
        metadata = details.invocation_metadata
        if handler.request_streaming or handler.response_streaming:
            async def refuse(context) -> None:  # the MAC covers one request and one answer
                raise Refused(grpc.StatusCode.UNIMPLEMENTED, "kvd: no token proof for streaming peer calls")
            return wrap_handler(handler, refuse)
        parse, behavior, serialize = handler.request_deserializer, handler.unary_unary, handler.response_serializer

        async def answer(data, context):
            try:
                call = auth.check_call(method, metadata, {a.lower() for a in self.addresses()}, data)
            except PeerAuthError as e:
                auth.refused(method.rsplit("/", 1)[-1], context.peer(), e)
                code = (grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(e, ReplayWindowFull)
                        else grpc.StatusCode.UNAUTHENTICATED)
                raise Refused(code, f"kvd: {e}") from None
            result = behavior(await parse_request(parse, data, context), context)
            response = await result if inspect.isawaitable(result) else result
            body = serialize(response) if serialize else response
            context.set_trailing_metadata(((PROOF, call.reply_mac(auth.token, body)),))
            return body

        # The MAC covers the bytes as they came and as they go: the request is
        # parsed here once they passed, the answer serialized here.
        return handler._replace(request_deserializer=None, unary_unary=answer, response_serializer=None)


def secret_file_warnings(cfg: Config) -> list[str]:
    """A warning for ``peer_token_file`` and ``peer_tls_key`` when others may
    read or write them: the token, or this node's private key, lets any
    host act as a daemon of the cluster.

    Warned: a mode with other bits (``0o007``), or with group bits (``0o070``)
    for a group that is not the daemon's own (effective gid). A file of the
    daemon's own group is not: the shipped DaemonSet mounts the token Secret
    mode 0440 with ``fsGroup`` the daemon's gid (Kubernetes makes Secret files
    root-owned, so the group bit is how the daemon reads it). A warning, not a
    refusal: the operator may have chosen the mode.
    """
    warnings = []
    for key in ("peer_token_file", "peer_tls_key"):
        path = getattr(cfg, key)
        if not path:
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue  # unreadable: PeerAuth.from_config has already refused it
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o007 or (mode & 0o070 and st.st_gid != os.getegid()):
            warnings.append(f"{key}: {path} is mode {mode:04o} (gid {st.st_gid}), readable or writable beyond "
                            f"the daemon's user and group; make it 0600 (chmod 0600 {path})")
    return warnings
