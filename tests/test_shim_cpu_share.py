"""kvd.shim.memory.shm: region maths on real torch tensors shaped like vLLM's,
and the private torch sharing path checked end to end through /dev/shm."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from kvd.shim.memory import regions
from kvd.shim.memory import shm as cpu_share
from kvd.shim.memory.shm import CpuShareError, plan_regions, share_kv_caches, share_storage
from kvd.testing.cpu_caches import F32, NB, D, H, N, vllm032_cpu_caches
from kvd.v1 import kvd_pb2 as pb

def test_vllm_032_cpu_layout_is_one_region_per_layer_in_one_segment():
    _, caches = vllm032_cpu_caches(3)
    plan = plan_regions(caches, NB)
    page = H * N * 2 * D * F32
    assert len(plan.storages) == 1
    assert [(r.offset, r.block_len, r.block_stride) for r in plan.regions] == [
        (i * NB * page, page, page) for i in range(3)
    ]
    assert [r.name for r in plan.regions] == [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    assert plan.layers == list(caches) and plan.dtype == torch.float32


def test_block_outermost_layout_has_a_stride_of_all_layers():
    _, caches = vllm032_cpu_caches(2, layout="BLHNC")
    plan = plan_regions(caches, NB)
    page = H * N * 2 * D * F32
    assert [(r.offset, r.block_len, r.block_stride) for r in plan.regions] == [(0, page, 2 * page), (page, page, 2 * page)]


def test_legacy_kv_dim_before_the_blocks_gives_k_and_v_regions():
    t = torch.zeros(2, NB, N, H, D, dtype=torch.bfloat16)  # [2, num_blocks, block_size, heads, head_dim]
    plan = plan_regions({"l0": t}, NB)
    blen = N * H * D * 2
    assert [(r.name, r.offset, r.block_len, r.block_stride) for r in plan.regions] == [
        ("l0/k", 0, blen, blen), ("l0/v", NB * blen, blen, blen),
    ]


def test_layers_sharing_one_cache_are_registered_once():
    _, caches = vllm032_cpu_caches(2)
    first = next(iter(caches.values()))
    caches["model.layers.2.self_attn.attn"] = first  # cross-layer KV sharing
    plan = plan_regions(caches, NB)
    assert len(plan.regions) == 2 and len(plan.layers) == 2


def test_separate_tensors_become_separate_segments():
    a, b = torch.zeros(NB, 4, 8), torch.zeros(NB, 4, 8)
    plan = plan_regions({"a": a, "b": b}, NB)
    assert len(plan.storages) == 2 and [r.storage for r in plan.regions] == [0, 1]


def test_kernel_blocks_are_merged_back_into_manager_blocks():
    # vLLM split each 64-token block into two 32-token kernel blocks: dim 0 = 2 * NB.
    t = torch.zeros(2 * NB, H, N, 2 * D)
    plan = plan_regions({"l0": t}, NB)
    kernel = H * N * 2 * D * F32
    assert (plan.regions[0].block_len, plan.regions[0].block_stride) == (2 * kernel, 2 * kernel)


def test_a_block_that_is_not_contiguous_is_refused_with_a_clear_error():
    t = torch.zeros(NB, N, H, D).transpose(1, 2)  # heads/tokens swapped by a view
    with pytest.raises(CpuShareError, match="not one contiguous run"):
        plan_regions({"l0": t}, NB)


def test_missing_block_dim_mixed_dtypes_and_devices_are_refused():
    with pytest.raises(CpuShareError, match="num_blocks=7"):
        plan_regions({"l0": torch.zeros(NB, 4)}, 7)
    with pytest.raises(CpuShareError, match="dtype"):
        plan_regions({"a": torch.zeros(NB, 4), "b": torch.zeros(NB, 4, dtype=torch.float16)}, NB)
    with pytest.raises(CpuShareError, match="meta"):
        plan_regions({"a": torch.zeros(NB, 4, device="meta")}, NB)
    with pytest.raises(CpuShareError, match="meta"):
        share_storage(torch.zeros(4, device="meta"))


def test_sharing_keeps_existing_views_valid_and_is_idempotent():
    buf, caches = vllm032_cpu_caches(2)
    view = next(iter(caches.values()))
    view.fill_(1.25)
    before = view.data_ptr()
    s1 = share_storage(buf)
    assert view.data_ptr() != before, "storage was expected to move into shm"
    assert buf.is_shared() and float(view[0, 0, 0, 0]) == 1.25
    view[1].fill_(2.5)  # writes through the old view land in the shared pages
    s2 = share_storage(view)
    assert s2 == s1
    assert s1.name.startswith("/torch_") and os.path.exists("/dev/shm" + s1.name)
    assert s1.data_offset >= 0 and s1.size == s1.data_offset + buf.untyped_storage().nbytes()


def test_shared_regions_address_the_tensor_bytes_through_dev_shm():
    """What the daemon will map: segment offset + block * stride is the block."""
    _, caches = vllm032_cpu_caches(2)
    shared = share_kv_caches(caches, num_blocks=NB, block_size=N, kv_layout="HND", num_kv_heads=H, head_dim=D)
    assert [s.kind for s in shared.segments] == [pb.MEMORY_KIND_SHM]
    seg = shared.segments[0]
    with open("/dev/shm" + seg.name, "r+b") as f:
        assert os.fstat(f.fileno()).st_size >= seg.size
        m = mmap.mmap(f.fileno(), seg.size)
        try:
            for r, (layer, t) in zip(shared.regions, caches.items()):
                for b in range(NB):
                    t[b].fill_(float(100 * r.block_len % 7 + b))
                    start = r.offset + b * r.block_stride
                    assert m[start:start + r.block_len] == t[b].contiguous().numpy().tobytes()
            # and the other way: a write into the segment (a NIXL READ's effect)
            r, t = shared.regions[1], caches["model.layers.1.self_attn.attn"]
            m[r.offset + 3 * r.block_stride:r.offset + 3 * r.block_stride + 4] = torch.tensor([9.0]).numpy().tobytes()
            assert float(t[3].flatten()[0]) == 9.0
        finally:
            m.close()
    lay = shared.layout
    assert (lay.num_blocks, lay.block_size, lay.kv_layout, lay.dtype) == (NB, N, pb.KV_LAYOUT_HND, "float32")
    assert (lay.num_kv_heads, lay.head_dim, lay.num_layers) == (H, 2 * D, 2)  # K and V per head: 2 x D
    assert list(lay.block_lens) == [r.block_len for r in shared.regions]


def test_share_kv_caches_validates_its_arguments():
    _, caches = vllm032_cpu_caches(1)
    with pytest.raises(CpuShareError, match="kv_layout"):
        share_kv_caches(caches, num_blocks=NB, block_size=N, kv_layout="XYZ", num_kv_heads=H, head_dim=D)
    with pytest.raises(CpuShareError, match="block_size"):
        share_kv_caches(caches, num_blocks=NB, block_size=0, kv_layout="HND", num_kv_heads=H, head_dim=D)


def test_dtype_names_match_the_proto_convention():
    assert regions.dtype_name(torch.bfloat16) == "bfloat16"
    assert regions.dtype_name(torch.float32) == "float32"


# ------------------------------------------------------------- HMA groups
def test_groups_overlaid_on_the_same_bytes_are_one_region_per_group():
    """vLLM's HMA overlays KV-cache groups: layer 0 (group 0) and layer 1
    (group 1) are views of the same bytes; each group's block ids address
    them, so the region is kept once per group (still once within a group)."""
    _, caches = vllm032_cpu_caches(1)
    (view,) = caches.values()
    hma = {"full.0": view, "window.0": view, "full.1": view}
    plan = plan_regions(hma, NB, groups={"full.0": 0, "window.0": 1, "full.1": 0})
    assert [(r.layer, r.group, r.offset) for r in plan.regions] == [("full.0", 0, 0), ("window.0", 1, 0)]
    shared = cpu_share.describe_kv_caches(hma, num_blocks=NB, block_size=N, kv_layout="HND", num_kv_heads=H,
                                          head_dim=D, groups={"full.0": 0, "window.0": 1, "full.1": 0})
    assert [r.group for r in shared.regions] == [0, 1]


# ------------------------------------------------------ layout description
def test_cpu_blocks_holding_k_and_v_report_the_per_head_vector():
    """vLLM-CPU: [heads, 2 x tokens, head_dim] per block: slicing by heads is
    byte-exact with a per-head vector of 2 x head_dim, so that is what the
    layout says, with Layout.kv_in_block (HND: the daemon moves K and V runs
    apart). The same bytes described as NHD keep the flag off the layout
    (only SharedKvCaches.kv_in_block: the shim then pins the block size)."""
    _, caches = vllm032_cpu_caches(2)
    shared = cpu_share.describe_kv_caches(caches, num_blocks=NB, block_size=N, kv_layout="HND", num_kv_heads=H,
                                          head_dim=D, total_kv_heads=2 * H)
    assert shared.layout.head_dim == 2 * D and shared.kv_in_block and shared.layout.kv_in_block
    nhd = cpu_share.describe_kv_caches(caches, num_blocks=NB, block_size=N, kv_layout="NHD", num_kv_heads=H,
                                       head_dim=D, total_kv_heads=2 * H)
    assert nhd.kv_in_block and not nhd.layout.kv_in_block
    assert shared.layout.total_kv_heads == 2 * H
    # per-layer K and V regions (a GPU-style layout): the head vector is head_dim
    t = torch.zeros(2, NB, N, H, D, dtype=torch.bfloat16)
    kv = cpu_share.describe_kv_caches({"l0": t}, num_blocks=NB, block_size=N, kv_layout="NHD", num_kv_heads=H,
                                      head_dim=D)
    assert kv.layout.head_dim == D and not kv.kv_in_block and not kv.layout.kv_in_block
    assert cpu_share.head_vector(1000, N, H, D, F32) == D  # not a whole number of heads: unchanged


def test_describe_shares_nothing_and_counts_offsets_from_the_storage():
    buf, caches = vllm032_cpu_caches(2)
    shared = cpu_share.describe_kv_caches(caches, num_blocks=NB, block_size=N, kv_layout="HND", num_kv_heads=H,
                                          head_dim=D)
    page = H * N * 2 * D * F32
    assert [(s.name, s.size) for s in shared.segments] == [("", buf.numel())]
    assert [r.offset for r in shared.regions] == [0, NB * page]
    assert shared.tensors[0].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    found = cpu_share._mapping_file_offset(buf.untyped_storage().data_ptr())
    assert found is None or not found[1].startswith("/dev/shm"), "the staged path must not share the cache"


# ---------------------------------------------------------------- shutdown
_RELEASE_SCRIPT = r"""
import gc, os, sys, torch
from kvd.shim.memory import shm as cpu_share
t = torch.zeros(64, 1024)
view = t[3]
(st,) = [cpu_share.share_storage(t)]
path = "/dev/shm" + st.name
assert os.path.exists(path) and st.header_addr, st
assert cpu_share.release_names([st], [t]) == [st.name]
assert cpu_share.release_names([st], [t]) == []       # idempotent
assert not os.path.exists(path)
view.fill_(3.0)
assert float(t.sum()) == 3.0 * 1024                   # still mapped, still the same memory
del t, view
gc.collect()                                          # torch's close: must not abort
keep = torch.ones(8)                                  # a storage alive at interpreter exit
s2 = cpu_share.share_storage(keep)
cpu_share.release_names([s2], [keep])
print("ok", flush=True)
"""


def test_release_names_unlinks_and_torch_frees_the_storage_later_without_aborting(tmp_path):
    """In a child process, since torch aborts the process (not raises) when
    its own unlink at free time fails: share, release, write, free, exit."""
    import subprocess
    import sys

    script = tmp_path / "release.py"
    script.write_text(_RELEASE_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


# ---------------------------------------------------------------- staging
def test_staging_mirror_copies_blocks_per_group_both_ways(tmp_path):
    from kvd.shim.memory.staged import StagingError, StagingMirror
    from kvd.testing.shm import ShmSegment

    buf, caches = vllm032_cpu_caches(2)
    shared = cpu_share.describe_kv_caches(caches, num_blocks=NB, block_size=N, kv_layout="HND", num_kv_heads=H,
                                          head_dim=D, groups={n: i for i, n in enumerate(caches)})
    seg = ShmSegment(buf.numel())
    seg2 = ShmSegment(buf.numel())
    try:
        mirror = StagingMirror(shared.cache_blocks(), shared.regions, [s.size for s in shared.segments], NB,
                               [pb.Segment(kind=pb.MEMORY_KIND_SHM, name=seg.name, size=seg.size)])
        layers = list(caches.values())
        for i, v in enumerate(layers):
            for b in range(NB):
                v[b].fill_(float(10 * i + b))
        page = H * N * 2 * D * F32
        assert mirror.copy_in([[1, 4], [2]]) == 3 * page
        for i, r in enumerate(shared.regions):
            for b in range(NB):
                got = bytes(seg.mm[r.offset + b * r.block_stride:][:r.block_len])
                copied = b in ([1, 4], [2])[i]
                assert got == (layers[i][b].numpy().tobytes() if copied else bytes(page)), (i, b)
        buf.zero_()
        assert mirror.copy_out([[4], []]) == page
        assert float(layers[0][4].mean()) == 4.0 and float(layers[0][1].abs().sum()) == 0.0
        assert float(layers[1][2].abs().sum()) == 0.0, "group 1 got no ids: untouched"
        with pytest.raises(StagingError, match="out of range"):
            mirror.copy_in([[NB], []])
        mirror.remap([pb.Segment(kind=pb.MEMORY_KIND_SHM, name=seg2.name, size=seg2.size)])
        layers[1][3].fill_(7.0)
        mirror.copy_in([[], [3]])
        r = shared.regions[1]
        assert bytes(seg2.mm[r.offset + 3 * r.block_stride:][:r.block_len]) == layers[1][3].numpy().tobytes()
        layers[0][5].fill_(5.0)
        assert mirror.copy_all() == 2 * NB * page
        assert bytes(seg2.mm[:buf.numel()]) == buf.numpy().tobytes(), "after a remap: the whole cache"
        with pytest.raises(StagingError, match="cannot open"):
            mirror.remap([pb.Segment(kind=pb.MEMORY_KIND_SHM, name="/kvdtest_missing_x", size=seg.size)])
        mirror.close()
        with pytest.raises(StagingError, match="closed"):
            mirror.copy_in([[1], []])
    finally:
        seg.close()
        seg2.close()


def test_staging_mirror_copies_in_bounded_pieces(tmp_path, monkeypatch):
    """The gathered rows are a temporary in the engine's memory: with pieces of
    one block, copying 5 blocks gathers 5 times, one block each, and the bytes
    land as with one gather."""
    from kvd.shim.memory import staged
    from kvd.testing.shm import ShmSegment

    buf, caches = vllm032_cpu_caches(1)
    shared = cpu_share.describe_kv_caches(caches, num_blocks=NB, block_size=N, kv_layout="HND", num_kv_heads=H,
                                          head_dim=D, groups=None)
    seg = ShmSegment(buf.numel())
    try:
        mirror = staged.StagingMirror(shared.cache_blocks(), shared.regions, [s.size for s in shared.segments], NB,
                                      [pb.Segment(kind=pb.MEMORY_KIND_SHM, name=seg.name, size=seg.size)])
        layer = list(caches.values())[0]
        for b in range(NB):
            layer[b].fill_(float(b + 1))
        r = shared.regions[0]
        monkeypatch.setattr(staged, "COPY_PIECE_BYTES", r.block_len)
        gathered = []
        real = torch.Tensor.index_select
        monkeypatch.setattr(torch.Tensor, "index_select",
                            lambda self, dim, idx: gathered.append(idx.numel()) or real(self, dim, idx))
        ids = [0, 2, 3, 4, 5]
        assert mirror.copy_in([ids]) == len(ids) * len(shared.regions) * r.block_len
        assert gathered and max(gathered) == 1 and sum(gathered) == len(ids) * len(shared.regions)
        for reg in shared.regions:
            for b in range(NB):
                got = bytes(seg.mm[reg.offset + b * reg.block_stride:][:reg.block_len])
                assert (got == bytes(reg.block_len)) == (b not in ids), (reg.offset, b)
        mirror.close()
    finally:
        seg.close()


def test_staged_copies_move_rows_as_wide_elements_where_the_view_allows():
    from kvd.shim.memory.staged import _wide

    base = torch.arange(4 * 96, dtype=torch.uint8).view(4, 96)
    assert _wide(base).dtype == torch.int64 and _wide(base).shape == (4, 12)
    assert _wide(base[:, :36]).dtype == torch.int32          # 36-byte rows: int32 at most
    assert _wide(base.view(-1)[1:1 + 3 * 64].view(3, 64)).dtype == torch.uint8  # offset 1: bytes only
    assert _wide(base[:, :7]).dtype == torch.uint8
    w = _wide(base)
    assert bytes(w.view(torch.uint8).numpy()) == bytes(base.numpy())  # the same bytes
