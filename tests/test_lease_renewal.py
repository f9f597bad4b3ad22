"""Lease renewal: a decode request still waiting keeps the prefill blocks held.

Two real daemons (gRPC and NIXL real, ``kvd.testing.sessions.Engine`` as the
engines): the decode side renews through its daemon
(``EngineClient.renew_leases`` -> ``EngineService.RenewLeases`` ->
``PeerService.Renew``), as the shim's scheduler does
(``kvd.shim.vllm.renewals``). The prefill daemon caps a renewed lease's
life at ``--max-lease-life-s`` (here LIFE_S). Both daemons prove a shared
peer token: a PeerService call without it is refused.

Time bounds prove behaviour, not speed: a lease never ends before the
deadline a renewal granted (a lower bound the daemon must keep), and ends
at most SLACK_S after it (the expiry poll, on a loaded 2-core machine).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import grpc
import pytest

from kvd.client import EngineClient, EngineClientError
from kvd.core.leases import LeaseTable
from kvd.daemon.call_refusal import Refused
from kvd.requests import MAX_RENEWALS_PER_CALL, LeaseRenewal
from kvd.testing.daemons import start_daemons, stop_daemons
from kvd.testing.sessions import Engine, KvShape, event_kind
from kvd.testing.util import peer_token_file, wait_until
from kvd.v1 import kvd_pb2 as pb

SHAPE = KvShape(num_layers=2, num_blocks=64, block_len=1024)
LIFE_S = 8.0    # the prefill daemon's max_lease_life_s
SLACK_S = 3.0   # expiry poll and scheduling on a busy machine
TOKEN = "kvd-renewal-test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("renew")
    tok = ("--peer-token-file", peer_token_file(tmp, TOKEN))
    p, d = start_daemons((str(tmp), "prefill", *tok, "--max-lease-life-s", str(LIFE_S)), (str(tmp), "decode", *tok))
    src = Engine(p, "renew-p", SHAPE, seed=5)
    other = Engine(p, "renew-other", SHAPE, seed=6)
    dst = Engine(d, "renew-d", SHAPE)
    client = EngineClient(d.socket)  # the decode scheduler's client: no registration
    yield src, other, dst, client
    client.close()
    for e in (dst, other, src):
        e.close()
    stop_daemons([p, d])


def end_of(src: Engine, rid: str, timeout: float) -> tuple[pb.SessionEvent, list[float]]:
    """The event that ends ``rid``'s lease, and the ``left_s`` of each
    ``renewed`` event the prefill engine got before it."""
    deadline = time.monotonic() + timeout
    renewed = []
    while True:
        ev = src.wait(rid, max(0.0, deadline - time.monotonic()))
        if event_kind(ev) != "renewed":
            return ev, renewed
        renewed.append(ev.renewed.left_s)


def wait_held(src: Engine, n: int) -> None:
    """Until the prefill daemon holds ``n`` leases (a hold travels on the
    session stream; a renewal that beats it finds nothing: not_held)."""
    wait_until(lambda: src.daemon.stats().active_leases == n, 10, f"{n} leases held")


def renew(client: EngineClient, src: Engine, *renewals: tuple[str, list[int]], engine_id: str | None = None):
    """One RenewLeases call through the decode daemon; the results."""
    return client.renew_leases(engine_id or src.engine_id, src.peer_address,
                               [LeaseRenewal(rid, [ids]) for rid, ids in renewals]).result(30)


def test_a_renewed_lease_outlives_its_deadline_and_expires_once_renewals_stop(env):
    """A 2 s lease renewed every 0.5 s for 4 s stays held past its first
    deadline; once renewals stop it expires, not before a full lease after
    the last renewal, then a renewal says not_held."""
    src, _, _, client = env
    before = src.daemon.stats().leases_renewed
    t0 = time.monotonic()
    src.hold("wait", [1, 2, 3], lease_s=2.0)
    wait_held(src, 1)
    last, n = t0, 0
    while time.monotonic() - t0 < 4.0:
        sent = time.monotonic()
        (r,) = renew(client, src, ("wait", [1, 2, 3]))
        assert r.renewed, r  # still held: each renewal came within the lease
        assert 0 < r.left_s <= 2.0, r
        last, n = sent, n + 1
        time.sleep(0.5)
    assert time.monotonic() - t0 > 2.0 + 1.0  # well past the first deadline
    ev, renewed = end_of(src, "wait", 2.0 + SLACK_S + 1)
    assert event_kind(ev) == "send_done" and ev.send_done.expired, ev
    assert last + 2.0 - 0.05 <= src.arrived
    # The engine learnt its new ends: the first renewal's, then one a second
    # at most (kvd.core.holds.TELL_STEP_S; its own end of a hold has 5 s of grace).
    assert 1 < len(renewed) < n and all(0 < x <= 2.0 for x in renewed), (renewed, n)
    assert src.daemon.stats().leases_renewed == before + n
    print(f"\nlease of 2 s renewed for {last - t0:.1f} s: expired {src.arrived - last:.2f} s after the last renewal")
    (r,) = renew(client, src, ("wait", [1, 2, 3]))
    assert not r.renewed and r.reason == "not_held" and r.left_s == 0


def test_renewals_never_extend_a_lease_past_its_life_cap(env):
    """Renewed every 0.5 s without end, a 2 s lease still expires LIFE_S
    after its hold (max_lease_life_s); near the cap left_s shrinks."""
    src, _, _, client = env
    t0 = time.monotonic()
    src.hold("forever", [4, 5], lease_s=2.0)
    wait_held(src, 1)
    lefts = []
    while True:
        (r,) = renew(client, src, ("forever", [4, 5]))
        if not r.renewed:
            break
        lefts.append((time.monotonic() - t0, r.left_s))
        assert time.monotonic() - t0 + r.left_s <= LIFE_S + 0.5, (r, lefts)
        assert time.monotonic() - t0 < LIFE_S + SLACK_S + 2, "lease still held past its cap"
        time.sleep(0.5)
    ev, _ = end_of(src, "forever", SLACK_S + 2)
    assert event_kind(ev) == "send_done" and ev.send_done.expired, ev
    assert LIFE_S - 0.05 <= src.arrived - t0 <= LIFE_S + SLACK_S
    print(f"\nlease of 2 s renewed without end: expired {src.arrived - t0:.2f} s after its hold (cap {LIFE_S} s)")
    assert min(left for _, left in lefts[-3:]) < 2.0 - 0.4, lefts  # the cap, not the lease, ended it


def test_a_renewal_that_does_not_name_the_held_blocks_or_engine_renews_nothing(env):
    """The claim rule: other blocks of the request, the request under
    another engine of the same daemon, or an engine not there, renew
    nothing (per request: not_held; the unknown engine: NOT_FOUND with a
    message), and the lease expires at its own deadline."""
    src, other, _, client = env
    t0 = time.monotonic()
    src.hold("mine", [10, 11], lease_s=2.0)
    wait_held(src, 1)
    r1, r2, r3 = renew(client, src, ("mine", [10, 12]), ("mine", [10, 11, 13]), ("nobody", [10]))
    assert [r.reason for r in (r1, r2, r3)] == ["not_held"] * 3
    (r,) = renew(client, src, ("mine", [10, 11]), engine_id=other.engine_id)
    assert r.reason == "not_held", r
    with pytest.raises(EngineClientError) as e:
        renew(client, src, ("mine", [10, 11]), engine_id="no-such-engine")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "no-such-engine" in str(e.value)
    ev = src.wait("mine", 2.0 + SLACK_S)  # the first event: no renewed one came
    assert event_kind(ev) == "send_done" and ev.send_done.expired, ev
    assert 2.0 - 0.05 <= src.arrived - t0 <= 2.0 + SLACK_S


def test_one_batch_renews_what_is_held_and_reports_the_rest(env):
    """A batch mixing held and unknown requests is answered per request, in
    order; a subset of the held blocks renews (a reader may read fewer)."""
    src, _, _, client = env
    src.hold("a", [20, 21], lease_s=30)
    src.hold("b", [22], lease_s=30)
    wait_held(src, 2)
    res = renew(client, src, ("a", [21]), ("gone", [1]), ("b", [22]))
    assert [(r.request_id, r.renewed) for r in res] == [("a", True), ("gone", False), ("b", True)]
    assert all(25 < r.left_s <= 30 for r in (res[0], res[2]))
    for rid in ("a", "b"):
        src.release(rid)
        assert end_of(src, rid, 30)[0].send_done.released


def test_batches_past_the_bounds_are_refused_with_a_message(env):
    """More than MAX_RENEWALS_PER_CALL renewals, an over-long request id or
    no address: INVALID_ARGUMENT naming the bound; the daemon keeps serving."""
    src, _, _, client = env
    cases = [
        ([LeaseRenewal(f"r{i}", [[1]]) for i in range(MAX_RENEWALS_PER_CALL + 1)], src.peer_address,
         "leases in one call"),
        ([LeaseRenewal("x" * 2000, [[1]])], src.peer_address, "request_id"),
        ([LeaseRenewal("r", [[1]])], "", "remote_address"),
    ]
    for renewals, address, words in cases:
        with pytest.raises(EngineClientError) as e:
            client.renew_leases(src.engine_id, address, renewals).result(30)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in str(e.value), e.value
    assert renew(client, src, ("none", [1]))[0].reason == "not_held"  # still serving


def test_a_renewal_on_the_prefill_daemon_itself_needs_no_peer_call(env):
    """Decode and prefill engines on one daemon: the renewal is answered by
    the daemon's own holds."""
    src, _, _, _ = env
    local = EngineClient(src.daemon.socket)
    try:
        src.hold("same-node", [30], lease_s=30)
        wait_held(src, 1)
        (r,) = local.renew_leases(src.engine_id, src.peer_address, [LeaseRenewal("same-node", [[30]])]).result(30)
        assert r.renewed and r.left_s > 25
    finally:
        local.close()
    src.release("same-node")
    assert end_of(src, "same-node", 30)[0].send_done.released


def test_a_peer_without_the_token_cannot_renew(env):
    """PeerService.Renew is authenticated like every peer call: without the
    token's proof it is UNAUTHENTICATED and the lease is not renewed."""
    src, _, _, _ = env
    src.hold("guarded", [40], lease_s=30)
    wait_held(src, 1)
    body = pb.RenewRequest(engine_id=src.engine_id, renewals=[
        pb.LeaseRenewal(request_id="guarded", groups=[pb.BlockIds(ids=[40])])]).SerializeToString()
    with grpc.insecure_channel(src.peer_address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/kvd.v1.PeerService/Renew")(body, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
    src.release("guarded")
    assert src.wait("guarded").send_done.released


def test_lease_table_renewal_keeps_the_longer_deadline_and_the_cap():
    """Unit rules of ``LeaseTable.renew``: a full lease from now, never
    shorter than the current deadline, never past start + the cap (a lease
    asked longer than the cap keeps its own length)."""
    t = LeaseTable()
    assert t.hold("r", [[1, 2]], deadline=110.0, now=100.0) == "held"
    assert t.renew("r", [[2]], now=105.0, max_life_s=30.0) == pytest.approx(10.0)  # deadline 115
    assert t.renew("r", [[1, 2]], now=101.0, max_life_s=30.0) == pytest.approx(14.0)  # not shortened
    assert t.renew("r", [[1, 2]], now=125.0, max_life_s=30.0) == pytest.approx(5.0)  # capped at 130
    assert t.renew("r", [[3]], now=125.0, max_life_s=30.0) is None
    assert t.renew("other", [[1]], now=125.0, max_life_s=30.0) is None
    assert t.renew("r", [[]], now=125.0, max_life_s=30.0) is None  # a renewal must name blocks
    assert t.renew("r", [], now=125.0, max_life_s=30.0) is None
    assert t.expire(129.9) == [] and t.expire(130.0) == ["r"]
    assert t.hold("long", [[1]], deadline=200.0, now=100.0) == "held"
    assert t.renew("long", [[1]], now=150.0, max_life_s=30.0) == pytest.approx(50.0)  # own length > cap


def test_the_prefill_engine_client_keeps_a_renewed_hold_past_its_own_deadline(env):
    """The engine client ends a hold itself at lease + hold_grace_s (its last
    resort); the daemon's ``renewed`` events move that end: a 1.5 s hold
    (grace 0.5 s) renewed for 4 s ends by the daemon's expiry, after the
    last renewal's lease, not at 2 s."""
    from kvd.shim.memory.shm import share_kv_caches
    from kvd.testing.cpu_caches import NB, D, H, N, vllm032_cpu_caches
    from kvd.testing.fakes import wait_events

    src, _, _, client = env
    _, caches = vllm032_cpu_caches(2)
    shared = share_kv_caches(caches, num_blocks=NB, block_size=N, kv_layout="HND", num_kv_heads=H, head_dim=D)
    pc = EngineClient(src.daemon.socket, hold_grace_s=0.5)
    try:
        pc.register(pb.RegisterEngineRequest(worker=pb.EngineWorker(engine_id="renew-client-p", tp_rank=0, tp_size=1),
                                             layout=shared.layout, segments=shared.segments,
                                             regions=shared.regions, model="tiny"), timeout_s=10)
        pc.start_session()
        assert pc.wait_opened(10)
        t0 = time.monotonic()
        pc.hold("client-hold", [[1, 2]], lease_s=1.5)
        wait_held(src, 1)
        last = t0
        while time.monotonic() - t0 < 4.0:
            sent = time.monotonic()
            (r,) = client.renew_leases("renew-client-p", src.peer_address,
                                       [LeaseRenewal("client-hold", [[1, 2]])]).result(30)
            assert r.renewed, r
            last = sent
            assert pc.drain_events() == [], "the hold ended while renewed"
            time.sleep(0.4)
        (ev,) = wait_events(pc, lambda evs: len(evs) == 1, timeout_s=1.5 + SLACK_S + 1)
        assert ev.send_done.request_id == "client-hold" and ev.send_done.expired, ev
        assert time.monotonic() >= last + 1.5 - 0.05
    finally:
        pc.close()


def test_a_renewal_reaches_every_tp_rank_of_the_engine(env):
    """P's engine has two TP ranks on its daemon, each holding the request's
    blocks: one renewal renews both (each rank's engine gets ``renewed``:
    the lease is shorter than the life cap, so the renewal moves its end);
    a rank whose lease ended is skipped; none left: not_held."""
    src, _, _, client = env
    ranks = [Engine(src.daemon, "renew-tp", SHAPE, rank=r, tp_size=2) for r in (0, 1)]
    try:
        for e in ranks:
            e.hold("tp-req", [7, 8], lease_s=LIFE_S / 2)
        wait_held(src, 2)
        (r,) = renew(client, ranks[0], ("tp-req", [7, 8]))
        assert r.renewed and LIFE_S / 2 - 1 < r.left_s <= LIFE_S / 2
        for e in ranks:
            ev = e.wait("tp-req", 10)
            assert event_kind(ev) == "renewed" and LIFE_S / 2 - 1 < ev.renewed.left_s <= LIFE_S / 2, ev
        ranks[1].release("tp-req")
        assert ranks[1].wait("tp-req").send_done.released
        assert renew(client, ranks[0], ("tp-req", [7, 8]))[0].renewed
        ranks[0].release("tp-req")
        assert end_of(ranks[0], "tp-req", 10)[0].send_done.released
        assert renew(client, ranks[0], ("tp-req", [7, 8]))[0].reason == "not_held"
    finally:
        for e in ranks:
            e.close()


class _Context:
    """What the renewal handlers use of a gRPC servicer context (a refusal
    is raised, ``kvd.daemon.call_refusal.Refused``, not sent through it)."""

    def time_remaining(self):
        return 5.0

    def peer(self):
        return "unix:test"


@pytest.mark.parametrize("too_many_groups", [False, True], ids=["ids", "groups"])
@pytest.mark.parametrize("service", ["EngineService", "PeerService"])
def test_a_call_of_too_many_block_ids_is_refused_before_they_become_lists(service, too_many_groups, monkeypatch):
    """``RenewLeases`` and ``PeerService.Renew`` of one id more than
    ``max_blocks_per_request`` in all: INVALID_ARGUMENT naming the limit,
    counted on the parsed message before any id becomes a Python list
    (before, 16M ids took 2.5 s and +1 GiB to convert, then were refused)
    and before the core is asked."""
    import asyncio

    from kvd.core.events import InvalidArgument
    from kvd.core.limits import Limits
    from kvd.daemon import convert
    from kvd.daemon.engine_service import EngineService
    from kvd.daemon.peer_service import PeerService

    converted = []
    monkeypatch.setattr(convert, "groups_from_pb", lambda groups: converted.append(groups) or [])
    asked = []

    class Node:  # refuses as the core would, noting that it was asked
        limits = Limits(max_blocks_per_request=1000)

        def renew(self, *args):
            asked.append(args)
            raise InvalidArgument("renew: 1201 block ids in one call, more than 1000")

        async def renew_at(self, *args):
            self.renew(*args)

    node = Node()
    groups = [pb.BlockIds(ids=range(600)), pb.BlockIds(ids=range(1))]
    renewals = [pb.LeaseRenewal(request_id="r1", groups=groups), pb.LeaseRenewal(request_id="r2", groups=groups[:1])]
    expect = "1201 block ids in one call, more than 1000"
    if too_many_groups:  # one renewal of empty groups: each group became a list before (132k: 147 ms)
        renewals = [pb.LeaseRenewal(request_id="r1", groups=[pb.BlockIds()] * 257)]
        expect = "a lease renewed in 257 groups, more than 256"
    if service == "EngineService":
        from types import SimpleNamespace

        call = EngineService(node, callers=lambda context: SimpleNamespace(uid=0)).RenewLeases(  # an admitted caller
            pb.RenewLeasesRequest(remote_engine_id="p", remote_address="127.0.0.1:1", renewals=renewals), _Context())
    else:
        call = PeerService(node).Renew(pb.RenewRequest(engine_id="p", renewals=renewals), _Context())
    with pytest.raises(Refused) as err:
        asyncio.run(call)
    code, details = err.value.code, err.value.message
    assert code == grpc.StatusCode.INVALID_ARGUMENT and expect in details, details
    assert not converted and not asked


def test_a_peers_refused_call_logs_a_clipped_engine_id(caplog):
    """A peer chooses the engine id it names (and the refusal may quote it):
    an admitted peer's refused Renew of a 1 MiB engine id wrote a 1 MiB log
    line; now the line shows the first 256 characters and the length."""
    import asyncio
    import logging

    from kvd.core.events import NotFound
    from kvd.daemon.peer_service import PeerService

    long_id = "e" * (1 << 20)

    class Node:
        limits = SimpleNamespace(max_blocks_per_request=1000)

        def renew(self, *args):
            raise NotFound(f"engine {long_id!r} is not registered with this daemon")

    call = PeerService(Node()).Renew(pb.RenewRequest(engine_id=long_id, renewals=[pb.LeaseRenewal(
        request_id="r", groups=[pb.BlockIds(ids=[1])])]), _Context())
    with caplog.at_level(logging.WARNING, logger="kvd.peer"), pytest.raises(Refused):
        asyncio.run(call)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvd.peer"]
    assert len(line) < 2000 and f"({len(long_id)} characters)" in line, len(line)
