"""What an operator sees of two real daemons after a real transfer: Prometheus
metrics, ``kvd status`` (table and JSON), ``kvd health``, gRPC health per
service and reflection, JSON logs with one line per transfer failure."""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvd.core.transfer_mode import TransferModes
from kvd.v1 import kvd_pb2 as pb
from kvd.testing.daemons import launch_daemon, start_daemon, stop_daemons, wait_serving
from kvd.testing.sessions import KvShape, Session, one_group, register_request
from kvd.testing.shm import ShmSegment
from kvd.testing.util import free_port, peer_token_file

SHAPE = KvShape(num_layers=4, num_blocks=64, block_len=4096)
REMOTE_IDS = [60, 3, 11, 7, 0, 41, 42, 19]
LOCAL_IDS = [5, 2, 40, 17, 33, 63, 1, 20]
ENGINE, PEER = "kvd.v1.EngineService", "kvd.v1.PeerService"
ROOT = pathlib.Path(__file__).resolve().parent.parent


def scrape(port: int) -> dict:
    """``{(name, frozenset(labels)): value}`` of every sample at /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def kvd_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvd.cli", *args], capture_output=True, text=True, timeout=timeout)


def _until(pred, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    """Two daemons with metrics; one real transfer, one failed load, one
    expired lease. Both daemons must exit 0 at the end."""
    tmp = str(tmp_path_factory.mktemp("ops"))
    pm, dm = free_port(), free_port()
    prefill = start_daemon(tmp, "prefill", "--metrics-port", str(pm), "--metrics-host", "127.0.0.1")
    decode = start_daemon(tmp, "decode", "--metrics-port", str(dm), "--metrics-host", "127.0.0.1",
                          "--log-format", "json")
    pseg, dseg = ShmSegment(SHAPE.size), ShmSegment(SHAPE.size)
    sessions = []
    try:
        pseg.array[:] = np.random.default_rng(1).integers(0, 256, SHAPE.size, dtype=np.uint8)
        prefill.stub().RegisterEngine(register_request("prefill-e", SHAPE, pseg), timeout=30)
        decode.stub().RegisterEngine(register_request("decode-e", SHAPE, dseg), timeout=30)
        ps, ds = Session(prefill, "prefill-e"), Session(decode, "decode-e")
        sessions += [ps, ds]
        ps.send(hold=pb.HoldBlocks(request_id="req-p", groups=one_group(REMOTE_IDS), lease_s=600))
        ps.send(hold=pb.HoldBlocks(request_id="req-unread", groups=one_group([9]), lease_s=0.2))
        ds.send(load=pb.LoadBlocks(
            request_id="req-d", local_groups=one_group(LOCAL_IDS), remote_engine_id="prefill-e",
            remote_address=prefill.peer_address, remote_groups=one_group(REMOTE_IDS), remote_request_id="req-p",
            remote_tp_size=1))
        recv = ds.next(30)
        assert recv.WhichOneof("event") == "recv_done", recv
        ds.send(load=pb.LoadBlocks(
            request_id="req-bad", local_groups=one_group([4]), remote_engine_id="no-such-engine",
            remote_address=prefill.peer_address, remote_groups=one_group([4]), remote_request_id="req-none",
            remote_tp_size=1))
        failed = ds.next(30)
        assert failed.WhichOneof("event") == "load_failed", failed
        done = {}
        for _ in range(2):
            e = ps.next(30)
            assert e.WhichOneof("event") == "send_done", e
            done[e.send_done.request_id] = e.send_done.expired
        assert done == {"req-p": False, "req-unread": True}
        yield SimpleNamespace(prefill=prefill, decode=decode, pm=pm, dm=dm, recv=recv.recv_done,
                              failed=failed.load_failed)
    finally:
        for s in sessions:
            s.close()
        codes = [d.stop() for d in (prefill, decode)]
        pseg.close()
        dseg.close()
    assert codes == [0, 0], codes


def test_metrics_count_a_real_transfer(ops):
    d = scrape(ops.dm)
    r = ops.recv
    assert r.bytes == len(LOCAL_IDS) * SHAPE.num_regions * SHAPE.block_len
    assert value(d, "kvd_transferred_bytes_total") == r.bytes
    assert value(d, "kvd_transfers_total") == 1
    assert value(d, "kvd_transfer_duration_seconds_count") == 1
    assert value(d, "kvd_transfer_duration_seconds_sum") == pytest.approx(r.duration_s, abs=1e-6)
    assert 0 < r.post_duration_s <= r.duration_s  # time inside NIXL's post call (NixlConnector's post duration)
    assert value(d, "kvd_transfer_duration_seconds_bucket", le="+Inf") == 1
    assert value(d, "kvd_transfer_descriptors_count") == 1
    assert value(d, "kvd_transfer_descriptors_sum") == r.num_descriptors > 0
    assert value(d, "kvd_handshake_duration_seconds_count") == 1
    assert 0 < value(d, "kvd_handshake_duration_seconds_sum") < 10
    # The one load that ran claimed its source's hold; the one whose handshake failed never got to its claim.
    assert value(d, "kvd_claim_duration_seconds_count") == 1
    assert 0 < value(d, "kvd_claim_duration_seconds_sum") <= r.duration_s
    assert value(d, "kvd_transfer_failures_total", reason="handshake") == 1
    assert value(d, "kvd_engines") == 1
    assert value(d, "kvd_regions") == SHAPE.num_regions
    assert value(d, "kvd_registered_bytes") == SHAPE.size
    assert value(d, "kvd_peers") == 1
    assert value(d, "kvd_session_streams") == 1
    assert value(d, "kvd_inflight_transfers") == 0
    assert value(d, "kvd_active_leases") == 0
    assert value(d, "kvd_notifications_dropped_total") == 0  # a series from the start (none dropped)
    assert value(d, "kvd_uptime_seconds") > 0
    # The unreachable-peer gate's series, from the start (kvd.daemon.unreachable).
    assert value(d, "kvd_peer_probes_total") >= 0 and value(d, "kvd_peer_calls_not_sent_total") >= 0
    assert value(d, "kvd_peer_addresses_unanswered") >= 0
    # The stall watch ticks every second from the start.
    assert 0 <= value(d, "kvd_event_loop_tick_age_seconds") < 30
    _until(lambda: value(scrape(ops.dm), "kvd_event_loop_lag_seconds_count") >= 1)

    p = scrape(ops.pm)
    assert value(p, "kvd_leases_expired_total") == 1      # req-unread
    assert value(p, "kvd_active_leases") == 0             # req-p ended by the reader's notification
    assert value(p, "kvd_transfers_total") == 0           # pull mode: the decode side reads
    # Every failure reason is a series from the start (0 here), so a rate() alert sees it before the first failure.
    from kvd.core.events import FailureKind
    assert all(value(p, "kvd_transfer_failures_total", reason=k.value) == 0 for k in FailureKind)
    assert value(p, "kvd_engines") == 1 and value(p, "kvd_peers") == 0
    info = [k for k in p if k[0] == "kvd_build_info"]
    assert len(info) == 1 and dict(info[0][1])["version"] and dict(info[0][1])["nixl"]

    doc = (ROOT / "docs" / "OPERATIONS.md").read_text()
    for name, _ in d:  # Prometheus naming: kvd_ prefix (process_* and python_gc_* are the standard ones)
        assert name.startswith(("kvd_", "process_", "python_gc_")), name
        assert not name.endswith("_created"), name  # disable_created_metrics: no timestamp series
        family = re.sub(r"_(bucket|count|sum)$", "", name)
        if name.startswith("kvd_"):
            assert f"`{family}" in doc, f"{family} is not in docs/OPERATIONS.md"
    # The failure reasons the docs list are exactly the label's values (a doc once named one that never was).
    row = next(line for line in doc.splitlines() if line.startswith("| `kvd_transfer_failures_total{reason}`"))
    listed = set(re.findall(r"`([a-z_]+)`", row.split("one of", 1)[1].split("(", 1)[0]))
    assert listed == {k.value for k in FailureKind}, listed ^ {k.value for k in FailureKind}


def test_status_json_has_engines_peers_transfers_and_versions(ops):
    r = kvd_cli("status", "--socket", ops.decode.socket, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["engines"] == 1 and s["regions"] == SHAPE.num_regions and s["registered_bytes"] == SHAPE.size
    assert s["transfers_done"] == 1 and s["transfers_failed"] == 1 and s["bytes_read"] == ops.recv.bytes
    assert s["inflight_transfers"] == 0 and s["active_leases"] == 0 and s["sessions"] == 1 and s["peers"] == 1
    assert s["uptime_s"] > 0 and s["draining"] is False and s["notifications_dropped"] == 0
    assert s["data_path"] == "direct" and s["backends"] == ["UCX"]
    assert s["peer_address"] == ops.decode.peer_address
    # Started with no token and no TLS on 127.0.0.1:0: unauthenticated, on loopback.
    assert (s["peer_auth"], s["peer_listen"]) == ("PEER_AUTH_NONE_LOOPBACK", ops.decode.peer_address)
    assert s["metrics_address"] == f"127.0.0.1:{ops.dm}"
    assert s["daemon_version"] == s["versions"]["kvd"]
    assert s["command_socket"] == ops.decode.socket + ".cmd" and (s["lease_s"], s["max_lease_life_s"]) == (120, 600)
    assert s["warm_peers"] == []  # none configured
    # The decode daemon follows the prefill engine's holds once paired (the default).
    assert s["follow_holds"] is True and s["claims_sent"] + s["claims_followed"] >= 1
    assert {"kvd", "nixl", "grpcio", "protobuf", "python"} <= set(s["versions"])
    [w] = s["workers"]
    assert (w["engine_id"], w["tp_rank"], w["tp_size"], w["model"]) == ("decode-e", 0, 1, "test-model")
    assert (w["regions"], w["num_blocks"], w["block_size"]) == (SHAPE.num_regions, SHAPE.num_blocks, SHAPE.block_size)
    assert (w["registered_bytes"], w["sessions"], w["peers"]) == (SHAPE.size, 1, 1)
    assert (w["memory"], w["data_path"]) == ("DRAM", "direct") and w["agent_name"] and w["compat_hash"]
    [peer] = s["remote_workers"]
    assert (peer["address"], peer["engine_id"], peer["tp_rank"]) == (ops.prefill.peer_address, "prefill-e", 0)
    assert (peer["local_engine_id"], peer["daemon_version"]) == ("decode-e", s["daemon_version"])
    # What the source's handshake said of its READs (no RDMA device: TCP's
    # between hosts), and what a load from it is now (a source of this host).
    assert peer["read_transport"] in ("native", "tcp-between-hosts") and peer["loads"] == "pull"

    # The prefill side: the expired lease is counted, no remote workers.
    r = kvd_cli("status", "--socket", ops.prefill.socket, "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["leases_expired"] == 1 and p["workers"][0]["engine_id"] == "prefill-e" and p["remote_workers"] == []


def test_status_table_for_people(ops):
    r = kvd_cli("status", "--socket", ops.decode.socket)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "serving" in out and re.search(r"^data path +direct$", out, re.M)
    assert "1 done, 1 failed, 0 in flight, 256.0 KiB read" in out
    assert "dropped notifications" not in out  # shown only when some were
    assert re.search(rf"^peer auth +none: PeerService on loopback {re.escape(ops.decode.peer_address)}, no other "
                     r"host; only root and the daemon's user may call it", out, re.M), out
    header = next(line for line in out.splitlines() if line.startswith("ENGINE"))
    row = next(line for line in out.splitlines() if line.startswith("decode-e"))
    assert "REGISTERED" in header and "2.0 MiB" in row and "direct" in row
    [peer] = [line for line in out.splitlines() if line.startswith(ops.prefill.peer_address)]
    assert "prefill-e" in peer and peer.split()[-1] == "pull", peer  # its LOADS column
    assert re.search(r"^PEER .* ITS READS +LOADS$", out, re.M), out


def test_health_cli_exit_codes(ops, tmp_path):
    r = kvd_cli("health", "--socket", ops.decode.socket)
    assert (r.returncode, r.stdout.strip()) == (0, f"unix:{ops.decode.socket}: SERVING")
    assert kvd_cli("health", "-q", "--address", ops.prefill.peer_address, "--service", PEER).returncode == 0
    r = kvd_cli("health", "--socket", ops.decode.socket, "--service", "no.such.Service")
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr
    r = kvd_cli("health", "--socket", str(tmp_path / "absent.sock"))
    assert r.returncode == 2 and "no daemon at" in r.stderr and "Traceback" not in r.stderr
    open(tmp_path / "plain.sock", "w").close()  # a file that is no socket: said so
    r = kvd_cli("health", "--socket", str(tmp_path / "plain.sock"), "--timeout", "1")
    assert r.returncode == 2 and "is not a socket" in r.stderr, r.stderr
    # A port that accepts TCP but never answers: the --timeout bounds the wait.
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        t0 = time.monotonic()
        r = kvd_cli("health", "--address", f"127.0.0.1:{hole.getsockname()[1]}", "--timeout", "0.5")
        assert r.returncode == 2 and "DEADLINE_EXCEEDED" in r.stderr
        assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("side", ["unix", "tcp"])
def test_grpc_health_per_service_and_reflection(ops, side):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    target = f"unix:{ops.decode.socket}" if side == "unix" else ops.decode.peer_address
    with grpc.insecure_channel(target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", ENGINE, PEER):
            st = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert st == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as e:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    own = ENGINE if side == "unix" else PEER
    assert {own, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services


def test_each_transfer_failure_is_logged_once_with_request_peer_and_reason(ops):
    records = []
    for line in ops.decode.log().splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))  # every kvd line is JSON in --log-format json
    assert any(r["logger"] == "kvd.server" and "serving" in r["msg"] for r in records)
    mine = [r for r in records if r.get("request") == "req-bad" and r["level"] in ("warning", "error")]
    assert len(mine) == 1, mine
    [r] = mine
    assert r["peer"] == ops.prefill.peer_address and r["engine"] == "decode-e"
    assert "load failed" in r["msg"] and "handshake" in r["msg"] and "no-such-engine" in r["msg"]
    assert r["ts"].endswith("Z")
    # The transfer that succeeded logged no warning.
    assert not [r for r in records if r.get("request") == "req-d" and r["level"] != "debug"]
    # NIXL's own Python handler prints nothing (its records go through kvd's
    # formatter, and its INFO ones only at debug: test_nixl_records_...).
    assert not re.search(r"^\S+ \S+ NIXL ", ops.decode.log(), re.M)


def _worker(name, staging, model="m"):
    """What ``kvd.daemon.status.build_stats`` reads of a worker."""
    mem = SimpleNamespace(registered_bytes=1 << 20, staging=staging, staged=bool(staging), memory="DRAM")
    return SimpleNamespace(
        key=(name, 0), tp_size=1, model=model, agent=SimpleNamespace(name=f"kvd-{name}"), compat_hash="h",
        regions=[1, 2], layout=SimpleNamespace(num_blocks=8, block_size=16), mem=mem,
        leases=[], inflight={}, session=SimpleNamespace(streams=1), pairs=SimpleNamespace(remotes={}, warm=[]))


def _node(*workers, warm_peers=()):
    """What ``kvd.daemon.status.build_stats`` reads of a node."""
    return SimpleNamespace(stats=lambda: {"engines": len(workers), "not_in_the_proto": 7},
                           peer_address="h:1", peer_auth="", peer_listen="", workers={w.key: w for w in workers},
                           rt=SimpleNamespace(limits=SimpleNamespace(lease_s=120.0, max_lease_life_s=600.0,
                                                                     follow_holds=False, warm_peers=warm_peers)),
                           modes=TransferModes("pull", {}, lambda: []),
                           peers=SimpleNamespace(vet=None))


def test_status_reports_the_data_path_of_each_worker():
    from kvd.daemon.status import build_stats, render, to_dict

    worker, node = _worker, _node
    assert build_stats(node()).data_path == ""
    assert build_stats(node(worker("a", []))).data_path == "direct"
    s = build_stats(node(worker("a", ["/kvd-stage-1"])))
    assert s.data_path == "staged" and s.workers[0].data_path == "staged" and s.engines == 1
    s = build_stats(node(worker("a", []), worker("b", ["/kvd-stage-2"])))
    assert s.data_path == "mixed" and [w.data_path for w in s.workers] == ["direct", "staged"]
    text = render(to_dict(s), "unix:/x")
    assert re.search(r"^data path +mixed$", text, re.M) and "staged" in text
    assert re.search(r"^lease +120 s default, renewed up to 600 s after its hold$", text, re.M)
    assert re.search(r"^command socket +off \(sessions on gRPC\)$", text, re.M)
    assert re.search(r"^transfer mode +pull \(set\)$", text, re.M), text
    assert re.search(r"^claims +0 sent, 0 followed, 0 waited for the holds' next answer \(per source rank\); "
                     r"follow_holds off$", text, re.M)
    assert re.search(r"^holds answers +0 applied \(of sources followed here\), 0 sent \(to daemons following "
                     r"this one's engines\)$", text, re.M), text


def test_status_escapes_control_characters_an_engine_or_peer_names():
    """An engine id (what an admitted engine registers with), a model and a
    configured warm peer carrying a terminal's escape sequences, a bell, a
    carriage return, a newline and a right-to-left override: ``kvd status``
    prints each escaped as in a Python repr, no control character reaches
    the terminal but the lines' own newlines, and the table stays aligned."""
    from kvd.daemon.status import build_stats, render, to_dict

    evil = "e1\x1b[2J\x1b]0;owned\x07\x1b[31mFAKE: all engines healthy\x1b[0m\r\n\u202e"
    s = build_stats(_node(_worker(evil, [], model="m\x1b[8m"), _worker("plain", []),
                          warm_peers=(("10.0.0.1:7001", "p\rq"),)))
    text = render(to_dict(s), "unix:/x")
    assert not [c for c in text if not c.isprintable() and c != "\n"], repr(text)
    assert r"e1\x1b[2J\x1b]0;owned\x07\x1b[31mFAKE: all engines healthy\x1b[0m\r\n\u202e" in text
    assert r"m\x1b[8m" in text and r"10.0.0.1:7001/p\rq" in text
    header, *rows = [line for line in text.splitlines() if line.startswith(("ENGINE", "e1", "plain"))]
    assert len({line.index(" 0 ") for line in rows}) == 1, rows  # RANK in one column


def test_status_escapes_what_shows_blank_or_draws_over_other_text():
    """Characters a terminal prints but that mislead (a second attacker
    review): a Hangul filler that shows as blank (``honest-engine`` + U+3164
    looked like ``honest-engine``), a combining strike-through, a
    right-to-left letter, fullwidth lookalikes and a wide character that
    shifted the later columns: all escaped, the table aligned."""
    from kvd.daemon.status import build_stats, render, to_dict

    ids = ["honest-engineㅤ", "x̶y", "aאb", "ｐｒｏｄ", "中"]
    s = build_stats(_node(*[_worker(i, []) for i in ids], _worker("plain", [])))
    text = render(to_dict(s), "unix:/x")
    assert text.isascii(), [c for c in text if not c.isascii()]
    for want in (r"honest-engine\u3164", r"x\u0336y", r"a\u05d0b", r"\uff50\uff52\uff4f\uff44", r"\u4e2d"):
        assert want in text, want
    rows = [line for line in text.splitlines() if line.startswith(("honest", "x\\", "a\\", "\\u", "plain"))]
    assert len(rows) == 6 and len({line.index(" 0 ") for line in rows}) == 1, rows  # RANK in one column


def test_configured_warm_peers_are_shown_only_to_callers_who_see_every_worker():
    """The warm_peers setting names remote engines; a caller that sees only
    its own workers (another admitted uid) is not shown it, as it is not
    shown other workers' warm_peers rows."""
    from kvd.daemon.status import build_stats, render, to_dict

    node = _node(warm_peers=(("10.0.0.1:7001", "tenant-a-prefill"),))
    node.peer_auth, node.peer_listen = "token", "h:1"
    everyone = build_stats(node)
    assert list(everyone.warm_peers_configured) == ["10.0.0.1:7001/tenant-a-prefill"]
    assert re.search(r"^warm peers +10\.0\.0\.1:7001/tenant-a-prefill \(paired once an engine registers\)$",
                     render(to_dict(everyone)), re.M)
    own_only = build_stats(node, visible=lambda w: False)
    assert list(own_only.warm_peers_configured) == []
    assert "tenant-a" not in render(to_dict(own_only))
    # The peer authentication is no secret and names no engine: every caller is shown it.
    assert own_only.peer_auth == everyone.peer_auth == pb.PEER_AUTH_TOKEN and own_only.peer_listen == "h:1"


def _daemon_status(d) -> tuple[dict, str]:
    """``kvd status --json`` and ``kvd status`` of daemon ``d``."""
    j, t = kvd_cli("status", "--socket", d.socket, "--json"), kvd_cli("status", "--socket", d.socket)
    assert j.returncode == 0 and t.returncode == 0, (j.stderr, t.stderr)
    return json.loads(j.stdout), t.stdout


def test_status_says_which_peer_authentication_is_active(tmp_path):
    """A daemon with a token says so; one whose token variable is misspelt
    (KVD_PEER_TOKENFILE, only warned of at startup) serves unauthenticated,
    bound to loopback instead of its wildcard peer_listen, and kvd status
    says that long after the startup log has scrolled away."""
    token = peer_token_file(tmp_path)
    tok = launch_daemon(str(tmp_path), "tok", "--peer-token-file", token)
    typo = launch_daemon(str(tmp_path), "typo", "--peer-listen", "0.0.0.0:0", env={"KVD_PEER_TOKENFILE": str(token)})
    daemons = [tok, typo]
    try:
        deadline = time.monotonic() + 60
        for d in daemons:
            assert wait_serving(d, deadline), d.log_tail(60)
        s, text = _daemon_status(tok)
        assert (s["peer_auth"], s["peer_listen"]) == ("PEER_AUTH_TOKEN", tok.peer_address)
        assert re.search(rf"^peer auth +token \(peer_token_file\), PeerService on {re.escape(tok.peer_address)}$",
                         text, re.M), text
        # With a token, other hosts' daemons may send NIXL metadata: vetted first.
        assert s["vet_peer_metadata"] is True and s["transfer_mode"].startswith("auto")
        assert re.search(r"^peer metadata +each new one loaded in a throwaway process first$", text, re.M), text
        assert re.search(r"^transfer mode +auto", text, re.M), text
        assert "KVD_PEER_TOKENFILE" in typo.log()  # warned of once, at startup
        s, text = _daemon_status(typo)
        host, port = s["peer_listen"].rsplit(":", 1)
        assert (s["peer_auth"], host) == ("PEER_AUTH_NONE_LOOPBACK", "127.0.0.1") and int(port) > 0
        assert re.search(rf"^peer auth +none: PeerService on loopback {re.escape(s['peer_listen'])}, ", text, re.M)
        assert not s.get("vet_peer_metadata") and re.search(r"^peer metadata +loaded as received", text, re.M)
    finally:
        stop_daemons(daemons)


def test_status_renders_each_peer_authentication():
    from kvd.daemon.peer_auth import PeerAuth
    from kvd.daemon.status import peer_auth_line

    tls = dict(cert=b"c", key=b"k", ca=b"a")
    modes = [PeerAuth(token=b"t" * 16).mode(True), PeerAuth(**tls).mode(False),
             PeerAuth(**tls, token=b"t" * 16).mode(False), PeerAuth().mode(True), PeerAuth().mode(False)]
    assert modes == ["token", "mutual_tls", "mutual_tls_and_token", "none_loopback", "none_insecure"]
    # Each is a value of the proto's enum, as build_stats names it.
    assert [pb.PeerAuthMode.Value(f"PEER_AUTH_{m.upper()}") for m in modes] == [1, 2, 3, 4, 5]
    line = {m: peer_auth_line({"peer_auth": f"PEER_AUTH_{m.upper()}", "peer_listen": "10.0.0.5:7700"})
            for m in modes}
    assert line["mutual_tls"] == "mutual TLS (peer_tls_*), PeerService on 10.0.0.5:7700"
    assert line["mutual_tls_and_token"] == "mutual TLS + token, PeerService on 10.0.0.5:7700"
    assert line["none_insecure"].startswith("NONE (peer_insecure = true): any host that reaches 10.0.0.5:7700 ")
    # A daemon older than the field answers neither.
    assert peer_auth_line({"peer_auth": "PEER_AUTH_UNSPECIFIED", "peer_listen": ""}) == \
        "- (not reported by this daemon)"


@pytest.mark.parametrize("level,env,shown", [("info", "", ["warn"]), ("info", "INFO", ["warn"]),
                                             ("debug", "", ["info", "warn"])])
def test_nixl_records_come_through_kvds_formatter_its_info_at_debug_only(level, env, shown):
    """NIXL's Python layer configures its "nixl" logger with a stdout handler
    and INFO when first imported (its logging.py dictConfig), after the
    daemon configured logging: its records still come out once, as kvd's
    JSON lines, its INFO ones (an agent made, a backend loaded) only at
    debug, whatever NIXL_LOG_LEVEL says to the Python layer."""
    code = (f"import logging, sys; from kvd.daemon import logs; logs.configure({level!r}, 'json', sys.stdout); "
            "import nixl; from kvd.core import nixl_agent; "
            "lg = logging.getLogger('nixl.probe'); lg.info('info'); lg.warning('warn')")
    env_vars = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    if env:
        env_vars["NIXL_LOG_LEVEL"] = env
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env_vars)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # every line kvd's JSON: none from NIXL's own handler
    assert [x["msg"] for x in records if x["logger"] == "nixl.probe"] == shown, records


def _connector_keys() -> set[str]:
    """The ``kv_connector_extra_config`` keys ``KvdShimConfig.from_extra``
    reads: every ``kvd_*`` string it passes to ``extra.get`` or to its
    ``seconds`` helper, read from the source (importing it imports vLLM)."""
    import ast

    tree = ast.parse((ROOT / "kvd" / "shim" / "vllm" / "config.py").read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KvdShimConfig"]
    [from_extra] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "from_extra"]
    keys = set()
    for call in ast.walk(from_extra):
        if not (isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Constant)):
            continue
        f = call.func
        reads = ((isinstance(f, ast.Attribute) and f.attr == "get" and isinstance(f.value, ast.Name)
                  and f.value.id == "extra") or (isinstance(f, ast.Name) and f.id == "seconds"))
        if reads:
            keys.add(call.args[0].value)
    return keys


def test_the_operations_page_lists_exactly_the_connectors_settings():
    """docs/OPERATIONS.md is the reference for every setting: its table of
    the connector's kv_connector_extra_config keys names each key the shim
    reads, and no other (a key added or renamed there must be documented)."""
    keys = _connector_keys()
    assert "kvd_socket" in keys and "kvd_data_path" in keys and len(keys) >= 6, keys
    doc = (ROOT / "docs" / "OPERATIONS.md").read_text()
    start = doc.index("### The engine's connector (`kv_connector_extra_config`)")
    section = doc[start:doc.index("\n## ", start)]
    rows = re.findall(r"^\| `(kvd_\w+)` \|", section, re.M)
    assert len(rows) == len(set(rows)), rows
    assert set(rows) == keys, (sorted(set(rows) - keys), sorted(keys - set(rows)))
    # The module's own table (its docstring) names the same keys.
    from_module = set(re.findall(r"^(kvd_\w+) ", (ROOT / "kvd" / "shim" / "vllm" / "config.py").read_text(), re.M))
    assert from_module == keys, from_module


def test_a_peer_with_the_wrong_token_is_logged_once_a_minute_not_at_each_try():
    """A decode daemon with another token tries again every second
    (warm_peers, per local worker): the prefill daemon logs the refusal the
    first time, then once a minute with the count, not a line a second; a
    new caller or another reason is still logged at once, and all refusals
    together at most once a second."""
    import io
    import logging

    from kvd.daemon.peer_auth import PeerAuth, PeerAuthError

    stream = io.StringIO()
    logger = logging.getLogger("kvd.test-peer-refusals")
    logger.addHandler(logging.StreamHandler(stream))
    logger.propagate = False
    auth = PeerAuth(token=b"x" * 32)
    now = [1000.0]
    auth._refused.log, auth._refused.clock = logger, lambda: now[0]
    bad = PeerAuthError("bad peer token proof (is peer_token_file the same on both daemons? ...)")
    for second in range(130):  # two decode workers, one try each a second, new connections
        now[0] = 1000.0 + second
        auth.refused("Handshake", f"ipv4:10.0.0.7:{40000 + second}", bad)
        now[0] += 0.01
        auth.refused("Handshake", f"ipv4:10.0.0.7:{50000 + second}", bad)
    now[0] += 0.5  # another host: at once, within the minute
    auth.refused("Handshake", "ipv4:10.0.0.8:40000", bad)
    now[0] += 0.1  # a third within the same second: counted on the next line
    auth.refused("Handshake", "ipv6:[fd00::9]:40000", bad)
    now[0] += 1.0
    stale = PeerAuthError("peer token proof too old or from the future (clocks more than 60 s apart?)")
    auth.refused("Claim", "ipv4:10.0.0.7:40001", stale)  # another reason from the first host
    lines = stream.getvalue().splitlines()
    assert lines == [
        f"peer call Handshake from ipv4:10.0.0.7:40000 refused: {bad}",
        f"peer call Handshake from ipv4:10.0.0.7:40060 refused: {bad} (119 more like it from this caller in the "
        f"last 60 s)",
        f"peer call Handshake from ipv4:10.0.0.7:40120 refused: {bad} (119 more like it from this caller in the "
        f"last 60 s)",
        f"peer call Handshake from ipv4:10.0.0.8:40000 refused: {bad}",
        f"peer call Claim from ipv4:10.0.0.7:40001 refused: {stale} (1 other refused call(s) not logged)",
    ], lines
