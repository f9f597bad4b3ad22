"""What ``GetStats`` answers and how ``kvd status`` shows it.

Daemon side: :func:`build_stats` turns ``Node.stats()`` (the source of every
count) and the registered workers into a ``StatsResponse``, with a row per
engine worker and per remote worker. It runs on the event loop, where the
core's state changes, so the rows are one consistent snapshot.

Client side: :func:`to_dict` (``kvd status --json``: every field, integers as
JSON numbers, field names as in proto/kvd/v1/kvd.proto) and
:func:`render` (the table for people).
"""

from __future__ import annotations

import platform
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Callable

from kvd import __version__
from kvd.addresses import metrics_url
from kvd.logtext import printable
from kvd.core.node import Node
from kvd.core.state import Worker
from kvd.v1 import kvd_pb2 as pb


def versions() -> dict[str, str]:
    """Versions of kvd and the stack it runs on (package -> version)."""
    out = {"kvd": __version__, "python": platform.python_version()}
    for pkg in ("nixl", "grpcio", "protobuf"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = ""
    return out


_VERSIONS: dict[str, str] | None = None

# TransferModes.known's answer -> PeerStats.loads
_LOADS = {True: "push", False: "pull", None: ""}


def build_stats(node: Node, draining: bool = False, backends: list[str] | None = None,
                metrics_address: str = "", visible: Callable[[Worker], bool] | None = None,
                command_socket: str = "") -> pb.StatsResponse:
    """A ``StatsResponse`` for ``node`` (call on the daemon's event loop).

    ``visible``: which workers get a row (and their remote workers and
    warm peers); None: every one. The daemon-wide counts cover every worker
    either way (they name no engine). ``command_socket``: its path, "" when
    off."""
    global _VERSIONS
    if _VERSIONS is None:
        _VERSIONS = versions()
    fields = pb.StatsResponse.DESCRIPTOR.fields_by_name
    # Only the counts the proto knows: a key the core adds first is not an error.
    counts = {k: v for k, v in node.stats().items() if k in fields}
    resp = pb.StatsResponse(
        daemon_version=__version__, peer_address=node.peer_address, draining=draining,
        backends=backends or [], metrics_address=metrics_address, command_socket=command_socket,
        lease_s=node.rt.limits.lease_s, max_lease_life_s=node.rt.limits.max_lease_life_s,
        follow_holds=node.rt.limits.follow_holds,
        # The setting names remote engines: shown to callers who see every worker (root, the daemon's uid),
        # as the per-worker warm_peers rows are to their workers' owners only.
        warm_peers_configured=[f"{a}/{e}" for a, e in node.rt.limits.warm_peers] if visible is None else [],
        versions=_VERSIONS, **counts,
        # Shown to every caller, as peer_address is (unlike warm_peers_configured): it names no engine
        # and holds no secret (not the token, nor a file's path), and any local user learns it from
        # the peer port itself anyway (it asks for a TLS handshake, or its UNAUTHENTICATED answer to a
        # call without the header says the token is required).
        peer_auth=pb.PeerAuthMode.Value(f"PEER_AUTH_{node.peer_auth.upper()}") if node.peer_auth else 0,
        peer_listen=node.peer_listen,
        transfer_mode=node.modes.describe().removeprefix("transfer mode "),
        vet_peer_metadata=node.peers.vet is not None,
        refuses_pushes=not node.modes.serves_pushes,
    )
    now = time.monotonic()
    paths = set()
    for w in list(node.workers.values()):
        if visible is not None and not visible(w):
            continue
        # Regions are POSIX shm registered as DRAM, or CUDA IPC memory as
        # VRAM: the engine's own segments ("direct") or daemon-owned staging
        # mirrors of them ("staged", WorkerMemory.staging).
        mem = w.mem
        path = "staged" if mem.staging or mem.staged else "direct"
        paths.add(path)
        resp.workers.add(
            engine_id=w.key[0], tp_rank=w.key[1], tp_size=w.tp_size, model=w.model,
            agent_name=w.agent.name, compat_hash=w.compat_hash, regions=len(w.regions),
            num_blocks=w.layout.num_blocks, block_size=w.layout.block_size,
            registered_bytes=mem.registered_bytes, active_leases=len(w.leases),
            inflight_transfers=len(w.inflight), sessions=w.session.streams, peers=len(w.pairs.remotes),
            memory=mem.memory, data_path=path, handover=handover_of(w),
        )
        for r in list(w.pairs.remotes.values()):
            resp.remote_workers.add(
                address=r.address, engine_id=r.engine_id, tp_rank=r.tp_rank,
                tp_size=r.tp_size, agent_name=r.agent_name, daemon_version=r.daemon_version,
                local_engine_id=w.key[0], local_tp_rank=w.key[1], read_transport=r.read_transport,
                loads=_LOADS[node.modes.known(r.address, r.read_transport)],
            )
        for p in list(w.pairs.warm):
            paired = sum(1 for r in w.pairs.remotes.values() if (r.address, r.engine_id) == (p.address, p.engine_id))
            resp.warm_peers.add(
                address=p.address, engine_id=p.engine_id, local_engine_id=w.key[0], local_tp_rank=w.key[1],
                state=p.state, state_for_s=max(0.0, now - p.since), tries=p.tries, last_error=p.last_error,
                paired_ranks=paired,
            )
    resp.data_path = paths.pop() if len(paths) == 1 else ("mixed" if paths else "")
    return resp


def handover_of(worker) -> str:
    """How ``worker``'s engine handed its memory over: ``"memfd"`` (a sealed
    fd, ``kvd.core.memory.FdMapping``), ``"shm"`` (a name in /dev/shm),
    ``"cuda_ipc"``; ``""`` on the staged path (the daemon's own mirrors)."""
    mem = worker.mem
    if mem.staged or mem.staging or not getattr(mem, "mappings", None):
        return ""
    return getattr(mem.mappings[0], "kind", "cuda_ipc")


# ----------------------------------------------------------------- client side
def to_dict(msg) -> dict:
    """Every field of ``msg`` (defaults included), recursively; 64-bit integers
    stay numbers (``MessageToDict`` would make them strings)."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[f.name] = dict(sorted(value.items()))
        elif f.is_repeated:
            out[f.name] = [to_dict(v) if f.message_type else v for v in value]
        elif f.message_type is not None:
            out[f.name] = to_dict(value)
        elif f.enum_type is not None:
            out[f.name] = f.enum_type.values_by_number[value].name if value in f.enum_type.values_by_number else value
        else:
            out[f.name] = value
    return out


def human_bytes(n: float) -> str:
    """``2097152`` -> ``2.0 MiB`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def human_duration(s: float) -> str:
    """``3725.2`` -> ``1h02m05s``."""
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h{m:02d}m"
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    return f"{m}m{s:02d}s" if m else f"{s}s"


def _table(header: list[str], rows: list[list]) -> list[str]:
    cells = [header] + [[printable(str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def peer_auth_line(d: dict) -> str:
    """The ``peer auth`` line of :func:`render`: who may call PeerService, and where it listens."""
    at = d.get("peer_listen") or "?"
    return {
        "PEER_AUTH_TOKEN": f"token (peer_token_file), PeerService on {at}",
        "PEER_AUTH_MUTUAL_TLS": f"mutual TLS (peer_tls_*), PeerService on {at}",
        "PEER_AUTH_MUTUAL_TLS_AND_TOKEN": f"mutual TLS + token, PeerService on {at}",
        "PEER_AUTH_NONE_LOOPBACK": f"none: PeerService on loopback {at}, no other host; only root and the "
                                   "daemon's user may call it (peer_token_file or peer_tls_* to serve remote "
                                   "daemons)",
        "PEER_AUTH_NONE_INSECURE": f"NONE (peer_insecure = true): any host that reaches {at} can read and "
                                   "overwrite the KV caches registered here",
    }.get(d.get("peer_auth"), "- (not reported by this daemon)")


def render(d: dict, target: str = "") -> str:
    """The status of one daemon (a :func:`to_dict` of ``StatsResponse``) as text."""
    state = "DRAINING" if d.get("draining") else "serving"
    lines = [printable(f"kvd {d['daemon_version']}  {target}  {state}  up {human_duration(d['uptime_s'])}")
             .replace("    ", "  ")]
    v = d.get("versions") or {}
    summary = [
        ("peer address", d["peer_address"]),
        ("peer auth", peer_auth_line(d)),
        ("transfer mode", d.get("transfer_mode") or "-"),
        ("peer metadata", "each new one loaded in a throwaway process first" if d.get("vet_peer_metadata")
                          else "loaded as received (no peer credential, or vet_peer_metadata = false)"),
        ("data path", d.get("data_path") or "- (no engines)"),
        ("NIXL backends", ",".join(d.get("backends") or []) or "-"),
        ("metrics", metrics_url(d["metrics_address"]) if d.get("metrics_address") else "off"),
        ("command socket", d.get("command_socket") or "off (sessions on gRPC)"),
        ("lease", f"{d.get('lease_s', 0):g} s default, renewed up to {d.get('max_lease_life_s', 0):g} s "
                  f"after its hold"),
        ("versions", ", ".join(f"{k} {v[k]}" for k in sorted(v)) or "-"),
        ("engines", f"{d['engines']} ({d['regions']} regions, {human_bytes(d['registered_bytes'])} registered, "
                    f"{d['sessions']} session stream{'' if d['sessions'] == 1 else 's'})"),
        ("peers", str(d["peers"])),
        ("transfers", f"{d['transfers_done']} done, {d['transfers_failed']} failed, "
                      f"{d['inflight_transfers']} in flight, {human_bytes(d['bytes_read'])} read"),
        ("leases", f"{d['active_leases']} active, {d['leases_expired']} expired, {d['leases_renewed']} renewed"),
        ("claims", f"{d.get('claims_sent', 0)} sent, {d.get('claims_followed', 0)} followed, "
                   f"{d.get('claims_waited', 0)} waited for the holds' next answer (per source rank); "
                   + (f"following the holds of {d.get('holds_followed', 0)} remote engine(s)" if d.get("follow_holds")
                      else "follow_holds off")),
        ("holds answers", f"{d.get('holds_answers_applied', 0)} applied (of sources followed here), "
                          f"{d.get('holds_answers_sent', 0)} sent (to daemons following this one's engines)"),
    ]
    if d.get("warm_peers_configured"):
        # Configured, whether or not an engine has registered yet (their pairs, below, need one).
        summary.append(("warm peers", ", ".join(d["warm_peers_configured"])
                        + ("" if d.get("workers") else " (paired once an engine registers)")))
    if d.get("leaked_handles"):
        summary.append(("leaked handles", str(d["leaked_handles"])))
    if d.get("notifications_dropped"):
        summary.append(("dropped notifications", f"{d['notifications_dropped']} past the backlog "
                                                  "(a peer flooding notifications; see the log)"))
    width = max(len(k) for k, _ in summary)
    lines += [f"{k:<{width}}  {printable(val)}" for k, val in summary]
    if d.get("workers"):
        lines.append("")
        lines += _table(
            ["ENGINE", "RANK", "TP", "MODEL", "REGIONS", "BLOCKS", "TOKENS/BLOCK", "REGISTERED", "MEMORY", "PATH",
             "HANDOVER", "SESSIONS", "LEASES", "IN FLIGHT", "PEERS"],
            [[w["engine_id"], w["tp_rank"], w["tp_size"], w["model"] or "-", w["regions"], w["num_blocks"],
              w["block_size"], human_bytes(w["registered_bytes"]), w["memory"], w["data_path"],
              w.get("handover") or "-", w["sessions"],
              w["active_leases"], w["inflight_transfers"], w["peers"]] for w in d["workers"]],
        )
    if d.get("remote_workers"):
        lines.append("")
        lines += _table(
            ["PEER", "ENGINE", "RANK", "TP", "KVD", "READ BY", "ITS READS", "LOADS"],
            [[r["address"], r["engine_id"], r["tp_rank"], r["tp_size"] or "-", r["daemon_version"] or "-",
              f"{r['local_engine_id']}/{r['local_tp_rank']}", r.get("read_transport") or "-",
              r.get("loads") or "-"] for r in d["remote_workers"]],
        )
    if d.get("warm_peers"):
        lines.append("")
        lines += _table(
            ["WARM PEER", "ENGINE", "FOR", "STATE", "SINCE", "TRIES", "PAIRED RANKS", "LAST ERROR"],
            [[p["address"], p["engine_id"], f"{p['local_engine_id']}/{p['local_tp_rank']}", p["state"],
              human_duration(p["state_for_s"]), p["tries"], p["paired_ranks"], p["last_error"] or "-"]
             for p in d["warm_peers"]],
        )
    return "\n".join(lines)
