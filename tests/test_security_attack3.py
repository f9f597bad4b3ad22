"""Attacker scenarios against real daemons, third review: lease renewal
(EngineService.RenewLeases, PeerService.Renew, kvd.core.holds ``renew``)
and the command socket (kvd.daemon.command_socket).

Each test runs the hostile sequence and asserts what docs/SECURITY.md
promises: regression guards of defences that held, and scenarios still open
marked xfail(strict), their reason saying what happens instead.
"""

from __future__ import annotations

import socket

import grpc
import pytest

from kvd.client.command_socket import CommandConnection
from kvd.command_wire import frame
from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import Engine, KvShape, one_group
from kvd.testing.util import wait_until
from kvd.v1 import kvd_pb2 as pb

SHAPE = KvShape(num_layers=2, num_blocks=16, block_len=4096)
# As long as a vLLM request id ("cmpl-<uuid4 hex>-0"): what a renewal event carries.
RID = "cmpl-" + "7" * 32 + "-0"


def _renew(d, engine_id: str, rid: str, block: int, times: int = 1) -> list[pb.LeaseRenewed]:
    """One RenewLeases call on ``d``'s engine socket naming ``d`` itself: ``times``
    renewals of ``rid`` on ``[block]``; the results."""
    req = pb.RenewLeasesRequest(remote_engine_id=engine_id, remote_address=d.peer_address,
                                renewals=[pb.LeaseRenewal(request_id=rid, groups=one_group([block]))] * times)
    return list(d.stub().RenewLeases(req, timeout=30).results)


def _flood(d, engine_id: str, rid: str, block: int, renewals: int) -> None:
    """``renewals`` renewals of ``rid``, 256 a call (the most one call may
    carry), 16 calls at a time; each one renews (the lease holds ``block``)."""
    calls = []
    stub = d.stub()
    req = pb.RenewLeasesRequest(remote_engine_id=engine_id, remote_address=d.peer_address,
                                renewals=[pb.LeaseRenewal(request_id=rid, groups=one_group([block]))] * 256)
    for _ in range(renewals // 256):
        calls.append(stub.RenewLeases.future(req, timeout=60))
        if len(calls) == 16:
            for c in calls:
                assert all(not r.reason for r in c.result().results)
            calls.clear()
    for c in calls:
        assert all(not r.reason for r in c.result().results)


@pytest.mark.xfail(strict=True, reason=(
    "open: each renewal queues a LeaseRenewed event for the prefill engine, even one that moves nothing "
    "(the same request 256 times in a call, or past max_lease_life_s); a reader renewing faster than the "
    "engine reads fills its session's queue and the daemon drops its oldest events "
    "(BOUNDS.max_pending_events): here the engine's send_done for another request never arrives"))
def test_renewals_of_one_lease_do_not_push_the_engines_other_events_out(tmp_path):
    """A reader (any admitted engine through RenewLeases, or a peer daemon
    through PeerService.Renew) that may renew one lease of a prefill
    engine's (it knows the request id and one held block, as any reader
    does) renews it 256 times a call while that engine's session is not
    reading for a while (a step of the engine, a slow link). Every renewal is
    a LeaseRenewed event queued for the engine; past
    ``BOUNDS.max_pending_events`` queued the daemon drops the oldest ones:
    the engine's real events (a SendDone, a LoadFailed) are lost. Expected:
    renewals that move nothing add no event (or renewals never push out
    another kind), so the engine's SendDone of "m" arrives."""
    d = start_daemon(str(tmp_path), "kvd", log_level="warning")  # not a log line per renewal call
    victim = Engine(d, "victim-p", SHAPE, open_session=False)
    conn = CommandConnection.connect(d.socket, max_message_bytes=64 << 20, timeout_s=10)
    try:
        worker = pb.EngineWorker(engine_id="victim-p", tp_rank=0)
        conn.send([pb.SessionCommand(open=pb.OpenSession(worker=worker,
                                                         session_token=victim.registered.session_token)),
                   pb.SessionCommand(hold=pb.HoldBlocks(request_id=RID, groups=one_group([5]), lease_s=600))])
        events = conn.events()
        assert next(events).WhichOneof("event") == "opened"  # then this engine reads nothing for a while
        wait_until(lambda: not _renew(d, "victim-p", RID, 5)[0].reason, 30, "the victim's hold landed")
        _flood(d, "victim-p", RID, 5, 40_000)  # fills the session's socket and write buffer (~19,000 events here)
        # A request of the victim's that ends while it is not reading: its SendDone is queued.
        conn.send([pb.SessionCommand(hold=pb.HoldBlocks(request_id="m", groups=one_group([7]), lease_s=600))])
        wait_until(lambda: not _renew(d, "victim-p", "m", 7)[0].reason, 30, "the hold of m landed")
        conn.send([pb.SessionCommand(release=pb.ReleaseBlocks(request_id="m"))])
        wait_until(lambda: _renew(d, "victim-p", "m", 7)[0].reason == "not_held", 30, "m released")
        _flood(d, "victim-p", RID, 5, 100_352)  # BOUNDS.max_pending_events after it, and more
        # The last event queued (never the oldest): a rejection of "end" (block out of range).
        conn.send([pb.SessionCommand(hold=pb.HoldBlocks(request_id="end", groups=one_group([10 ** 6])))])
        seen: dict[str, int] = {}
        for ev in events:  # the engine reads again
            kind = ev.WhichOneof("event")
            rid = getattr(ev, kind).request_id
            seen[f"{kind}:{rid}"] = seen.get(f"{kind}:{rid}", 0) + 1
            if rid == "end":
                break
        assert d.proc.poll() is None
        assert "rejected:end" in seen, seen
        assert "send_done:m" in seen, (f"{seen}; daemon log: "
                                       f"{[ln for ln in d.log().splitlines() if 'dropped' in ln][:2]}")
    finally:
        conn.shutdown()
        conn.close()
        victim.close(unregister=True)
        assert d.stop() == 0
