"""Attack 9: claims that wait for a hold never made (an admitted peer:
a token holder, or root and the daemon's user on loopback).

``PeerService.Claim`` turns its block ids into Python ints before it waits
(up to ``BOUNDS.max_claim_wait_s``) for the engine's hold. Found by an
attacker review: nothing bounded how many claims waited at once, so 48
concurrent claims of 1M ids each for a request never held took the daemon
from 97 MB to 2.7 GB (16: 945 MB), ~53 MB a claim, for as long as the peer
kept sending them.

Promised now: at most ``BOUNDS.max_waiting_claims`` claims, carrying at
most ``BOUNDS.max_waiting_claim_ids`` block ids in all, wait at once; a
claim that would wait past either is ``RESOURCE_EXHAUSTED`` at once; a
claim whose hold is there is answered whatever waits; the budget comes back
as the waits end.
"""

from __future__ import annotations

import time

import grpc

from kvd.core.limits import BOUNDS
from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import Engine, KvShape
from kvd.v1 import kvd_pb2 as pb

SHAPE = KvShape(num_layers=2, num_blocks=16, block_len=4096)
IDS = 1_000_000  # a claim's most, about (Limits.max_blocks_per_request: 2**20)


def _claim(channel: grpc.Channel, engine_id: str, request_id: str, ids, wait_s: float):
    call = channel.unary_unary("/kvd.v1.PeerService/Claim", request_serializer=pb.ClaimRequest.SerializeToString,
                               response_deserializer=pb.ClaimResponse.FromString)
    return call.future(pb.ClaimRequest(engine_id=engine_id, tp_rank=0, request_id=request_id,
                                       groups=[pb.BlockIds(ids=ids)], wait_s=wait_s), timeout=60)


def _code(future) -> grpc.StatusCode:
    try:
        future.result()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def test_claims_waiting_for_holds_never_made_are_bounded_in_number_of_ids_and_the_budget_comes_back(tmp_path):
    fill = BOUNDS.max_waiting_claim_ids // IDS  # claims of IDS ids that fit the budget
    assert 1 <= fill < BOUNDS.max_waiting_claims
    d = start_daemon(str(tmp_path), "P", log_level="info")
    e = Engine(d, "claims-src", SHAPE)
    ch = grpc.insecure_channel(d.peer_address, options=[("grpc.max_send_message_length", 64 << 20)])
    try:
        ids = range(300, 300 + IDS)
        waiting = [_claim(ch, e.engine_id, f"never-{i}", ids, BOUNDS.max_claim_wait_s) for i in range(fill)]
        # Once all of them wait, one more that would wait is refused at once.
        # Probed with short waits: a probe admitted before the budget is full
        # only waits 10 ms.
        refused = None
        while refused is None and not all(f.done() for f in waiting):
            code = _code(_claim(ch, e.engine_id, "probe", ids, 0.01))
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                refused = code
            else:
                assert code == grpc.StatusCode.PERMISSION_DENIED, code
        assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED, "no claim was refused while the budget was full"
        # A claim whose hold is there needs no wait: answered meanwhile.
        e.hold("real", [5])
        e.held("real", [5])
        assert _code(_claim(ch, e.engine_id, "real", [5], 1.0)) == grpc.StatusCode.OK
        assert [_code(f) for f in waiting] == [grpc.StatusCode.PERMISSION_DENIED] * fill
        # The waits ended: a claim may wait again (refused for want of a hold,
        # not for want of room).
        t0 = time.monotonic()
        assert _code(_claim(ch, e.engine_id, "after", ids, 0.2)) == grpc.StatusCode.PERMISSION_DENIED
        assert time.monotonic() - t0 >= 0.2  # it waited
        assert d.proc.poll() is None
    finally:
        ch.close()
        e.close()
        assert d.stop() == 0
