"""Hypothesis strategies for hostile ``kvd.v1`` messages (the property-based
fuzz of ``tests/test_reliability_fuzz.py``, docs/RELIABILITY.md scenario 9).

Each strategy makes messages a hostile or broken client could send: wholly
random fields, edge values (``2**31`` and up read as negative int32, NaN and
infinite seconds, empty and overlong text), block-id lists in range, out of
range and past the daemon's limit, and registrations or handshake answers that
are real ones with a few fields broken (real ones cost the daemon a NIXL
agent, so random ones are the majority). Nothing here sends anything.
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

from kvd.testing.sessions import KvShape
from kvd.v1 import kvd_pb2 as pb

#: The workers' KV shape: block ids ``0..15`` are in range.
SHAPE = KvShape(num_layers=2, num_blocks=16, block_len=1024)

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
edge_u32 = st.sampled_from([0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1])  # 2**31.. are negative as int32
edge_u64 = st.sampled_from([0, 1, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1])
any_u32 = st.one_of(u32, edge_u32)
any_u64 = st.one_of(u64, edge_u64)
text = st.one_of(st.text(max_size=40), st.sampled_from(["", "x" * 300, "ü/../\x00", "a:b", "\n"]))
doubles = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0.0, -1.0, 1e-9, 0.05, 0.5, 2.0, 1e300, math.inf, -math.inf, math.nan]))
MAX_BLOCKS = 1 << 20  # Limits.max_blocks_per_request
block_ids = st.one_of(
    st.lists(st.integers(0, SHAPE.num_blocks - 1), max_size=8),      # in range
    st.lists(any_u32, max_size=8),                                  # out of range, "negative"
    # Long lists in range (repeats). Kept to a few thousand: a valid request of
    # a million descriptors is legitimate and may take its whole deadline.
    st.integers(0, 4096).map(lambda n: [n % SHAPE.num_blocks] * n),
)
# Past the daemon's limit (a few MB on the wire): one list in twenty, as each
# costs seconds of protobuf work on both sides.
past_limit = st.sampled_from([MAX_BLOCKS + 1, 2 * MAX_BLOCKS]).map(lambda n: [1] * n)
command_block_ids = st.integers(0, 19).flatmap(lambda i: past_limit if i == 0 else block_ids)


def segment_names(real: str):
    """Segment names: ``real`` (a live shm segment), random text, path tricks."""
    return st.one_of(st.just(real), text, st.sampled_from(
        [".", "/.", "..", "/../etc/passwd", "/dev/shm/x", "a" * 201, real + "x", real.upper()]))


def layouts():
    """``pb.Layout`` with every field random (edge values included)."""
    return st.builds(pb.Layout, num_blocks=any_u32, block_size=any_u32, kv_layout=st.integers(0, 5),
                     dtype=text, num_kv_heads=any_u32, head_dim=any_u32, num_layers=any_u32,
                     block_lens=st.lists(any_u64, max_size=6), total_kv_heads=any_u32)


regions = st.builds(pb.Region, segment_index=any_u32, offset=any_u64, block_len=any_u64,
                    block_stride=any_u64, name=text, group=st.one_of(st.just(0), any_u32))
workers = st.builds(pb.EngineWorker, engine_id=text, tp_rank=any_u32, tp_size=any_u32)


@st.composite
def register_requests(draw, real_seg: str):
    """Either wholly random, or (one in three) a valid request with one to
    three fields broken: valid registrations make a NIXL agent (tens of ms)."""
    if draw(st.integers(0, 2)):
        return pb.RegisterEngineRequest(
            worker=draw(workers), layout=draw(layouts()),
            segments=draw(st.lists(st.builds(pb.Segment, kind=st.integers(0, 4), name=segment_names(real_seg),
                                             size=any_u64), max_size=3)),
            regions=draw(st.one_of(st.lists(regions, max_size=6),
                                   st.integers(4090, 4200).map(
                                       lambda n: [pb.Region(block_len=1, block_stride=1)] * n))),
            model=draw(text), compat_extra=draw(text), data_path=draw(st.integers(0, 4)))
    req = pb.RegisterEngineRequest(
        worker=pb.EngineWorker(engine_id=f"fz-reg-{draw(st.integers(0, 3))}", tp_rank=0, tp_size=1),
        layout=SHAPE.layout(), segments=[pb.Segment(kind=pb.MEMORY_KIND_SHM, name=real_seg, size=SHAPE.size)],
        regions=SHAPE.regions(), model="fuzz")
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(["num_blocks", "block_size", "kv_layout", "block_lens", "seg_size", "seg_name",
                                      "seg_kind", "seg_extra", "region_offset", "region_len", "region_stride",
                                      "region_segment", "region_group", "regions_drop", "regions_dup", "tp",
                                      "no_segments", "staged", "total_kv_heads"]))
        r = draw(st.integers(0, len(req.regions) - 1)) if len(req.regions) else 0
        if field == "num_blocks":
            req.layout.num_blocks = draw(any_u32)
        elif field == "block_size":
            req.layout.block_size = draw(any_u32)
        elif field == "kv_layout":
            req.layout.kv_layout = draw(st.integers(0, 9))
        elif field == "block_lens":
            req.layout.block_lens[:] = draw(st.lists(any_u64, max_size=6))
        elif field == "seg_size" and req.segments:
            req.segments[0].size = draw(any_u64)
        elif field == "seg_name" and req.segments:
            req.segments[0].name = draw(segment_names(real_seg))
        elif field == "seg_kind" and req.segments:
            req.segments[0].kind = draw(st.integers(0, 7))
        elif field == "seg_extra":
            req.segments.add(kind=pb.MEMORY_KIND_SHM, name=draw(segment_names(real_seg)), size=draw(any_u64))
        elif field == "region_offset" and req.regions:
            req.regions[r].offset = draw(any_u64)
        elif field == "region_len" and req.regions:
            req.regions[r].block_len = draw(any_u64)
        elif field == "region_stride" and req.regions:
            req.regions[r].block_stride = draw(any_u64)
        elif field == "region_segment" and req.regions:
            req.regions[r].segment_index = draw(any_u32)
        elif field == "region_group" and req.regions:
            req.regions[r].group = draw(any_u32)
        elif field == "staged":  # the daemon makes its own mirror segments, sized as asked
            req.data_path = pb.DATA_PATH_STAGED
            for seg in req.segments:
                seg.name = draw(st.sampled_from(["", seg.name]))
        elif field == "total_kv_heads":
            req.layout.total_kv_heads = draw(any_u32)
        elif field == "regions_drop" and req.regions:
            del req.regions[r]
        elif field == "regions_dup" and req.regions:
            req.regions.append(req.regions[r])
        elif field == "tp":
            req.worker.tp_rank, req.worker.tp_size = draw(any_u32), draw(any_u32)
        elif field == "no_segments":
            del req.segments[:]
    return req


#: Peer addresses a command may name: empty, malformed, unreachable, out of range.
ADDRESSES = ["", "nocolon", "127.0.0.1:0", "127.0.0.1:1", "[::1]:1", "256.256.256.256:80", "127.0.0.1:99999",
             ":", "127.0.0.1:-5", "unix:/tmp/x.sock"]

#: Block ids per KV-cache group: up to three groups.
groups = st.lists(st.builds(pb.BlockIds, ids=block_ids), max_size=3)
# What a command carries: no group, one group (the common case: a model
# without HMA; sometimes past the daemon's limit) or several.
command_groups = st.one_of(st.just([]), st.builds(lambda ids: [pb.BlockIds(ids=ids)], command_block_ids), groups)


def loads(prefill_engine_id: str, prefill_address: str, closed: str):
    """``SessionCommand(load=...)`` with random groups, timeouts and ids, from
    the real prefill worker (``prefill_engine_id`` at ``prefill_address``) or
    from random engines at bad addresses (``closed``: one nothing listens on).
    ``request_id`` is left for the test to set."""
    remote = st.one_of(
        st.tuples(st.just(prefill_engine_id), st.just(prefill_address)),        # the real prefill worker
        st.tuples(text, st.sampled_from(ADDRESSES + [closed, prefill_address])),
    )
    return st.builds(
        lambda rid, lg, rem, rg, rr, tp, t: pb.SessionCommand(load=pb.LoadBlocks(
            request_id=rid, local_groups=lg, remote_engine_id=rem[0], remote_address=rem[1],
            remote_groups=rg, remote_request_id=rr, remote_tp_size=tp, timeout_s=t)),
        st.none(), command_groups, remote, command_groups, text, st.one_of(st.just(1), st.just(0), any_u32),
        doubles)


def holds():
    """``SessionCommand(hold=...)`` with random leases and groups (``request_id`` left to set)."""
    return st.builds(lambda rid, lease, g: pb.SessionCommand(hold=pb.HoldBlocks(
        request_id=rid, lease_s=lease, groups=g)),
        st.none(), doubles, command_groups)


def aborts():
    """``SessionCommand(abort_load=...)`` with random fields (``request_id`` left to set)."""
    return st.builds(lambda rid, e, a, rr, tp: pb.SessionCommand(abort_load=pb.AbortLoad(
        request_id=rid, remote_engine_id=e, remote_address=a, remote_request_id=rr, remote_tp_size=tp)),
        st.none(), text, st.sampled_from(ADDRESSES), text, any_u32)


def forged(real: pb.HandshakeResponse, compat_hash: str):
    """HandshakeResponses made from a real one: truncated, mangled or random
    agent metadata, foreign names, bogus layouts, regions and base addresses
    (huge, off by a few blocks, too few), other versions and TP sizes."""
    meta = real.agent_metadata
    agent_meta = st.one_of(
        st.binary(max_size=512),
        st.integers(0, len(meta)).map(lambda n: meta[:n]),                                  # truncated
        st.tuples(st.integers(0, len(meta) - 1), st.integers(0, 255)).map(
            lambda t: meta[:t[0]] + bytes([t[1]]) + meta[t[0] + 1:]),                        # one byte changed
        st.just(meta),                                                                     # the real one
    )
    return st.builds(
        lambda m, name, lay, regs, bases, h, pv, v, tp: pb.HandshakeResponse(
            agent_metadata=m, agent_name=name, layout=lay, regions=regs, region_base_addrs=bases,
            compat_hash=h, daemon_version=v, protocol_version=pv, tp_size=tp),
        agent_meta,
        st.one_of(st.just(real.agent_name), text),
        st.one_of(st.just(real.layout), layouts()),
        st.one_of(st.just(list(real.regions)), st.lists(regions, max_size=6)),
        st.one_of(st.just(list(real.region_base_addrs)),
                  st.lists(any_u64, min_size=SHAPE.num_regions, max_size=SHAPE.num_regions),
                  st.lists(any_u64, max_size=6),
                  st.integers(-8, 8).map(lambda k: [b + k * 1024 for b in real.region_base_addrs])),
        st.one_of(st.just(compat_hash), text),
        st.one_of(st.just(1), any_u32),
        text,
        st.one_of(st.just(1), st.just(1), any_u32),
    )

