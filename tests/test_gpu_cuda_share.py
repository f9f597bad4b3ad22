"""kvd.shim.memory.cuda_ipc on the CPU: handle parsing, region maths on tensors
shaped like vLLM's GPU KV caches (FlashAttention NHD/HND, FlashInfer, MLA),
segment dedup by allocation, and the staged path's block copies.

Nothing here needs a GPU: the export is faked with the same shapes of data
torch's ``_share_cuda_`` returns, and the copies run on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from kvd.shim.memory import cuda_ipc as cuda_share
from kvd.shim.memory.cuda_ipc import (
    CudaShareError,
    ExportedStorage,
    infer_kv_layout,
    parse_torch_handle,
    plan_regions,
    share_kv_caches,
)
from kvd.shim.memory.regions import dense_as_set
from kvd.shim.memory.staged import StagingMirror
from kvd.v1 import kvd_pb2 as pb
from kvd.testing.shm import ShmSegment

NB, T, H, D = 6, 16, 4, 32  # blocks, tokens per block, KV heads, head_dim
BF16 = 2
HANDLE = bytes(range(64))


def flash_attn(layers=2, order=(0, 1, 2, 3, 4), dtype=torch.bfloat16, device="cpu"):
    """vLLM's FlashAttention caches: one int8 buffer per layer viewed as
    [2, NB, T, H, D] through kv_cache_stride_order (gpu_model_runner
    _reshape_kv_cache_tensors: allocate the permuted shape, then permute back)."""
    logical = (2, NB, T, H, D)
    physical = tuple(logical[i] for i in order)
    inv = [order.index(i) for i in range(len(order))]
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(physical, dtype=dtype, device=device).permute(*inv)
            for i in range(layers)}


def fake_exporter(offsets=None, handles=None, device=0):
    """Stands in for torch's _share_cuda_: each storage gets a handle (per
    allocation) and an offset into it."""
    seen = {}

    def export(t):
        key = t.untyped_storage().data_ptr()
        i = seen.setdefault(key, len(seen))
        h = (handles or {}).get(i, bytes([i]) * 64)
        return ExportedStorage(device, h, (offsets or {}).get(i, 0), t.untyped_storage().nbytes())

    return export


# ----------------------------------------------------------------- handles
def test_torch_handle_forms():
    assert parse_torch_handle(HANDLE) == HANDLE                      # torch < 2.2: bare
    assert parse_torch_handle(b"\x02c" + HANDLE) == HANDLE           # torch 2.2 .. 2.12
    assert parse_torch_handle(b"\x03c" + HANDLE) == HANDLE           # torch 2.13
    with pytest.raises(CudaShareError, match="expandable_segments"):
        parse_torch_handle(b"\x03e" + b"\x00" * 90)
    with pytest.raises(CudaShareError, match="unknown torch CUDA IPC handle format: 10 bytes"):
        parse_torch_handle(b"\x03x" + b"\x00" * 8)


def test_export_storage_refuses_cpu_tensors():
    with pytest.raises(CudaShareError, match="only CUDA tensors"):
        cuda_share.export_storage(torch.zeros(4))


def test_export_storage_reads_torch_share_cuda_tuple(monkeypatch):
    """The private API's 8-tuple, as torch.multiprocessing.reductions unpacks it."""
    t = torch.zeros(NB, 128, dtype=torch.uint8)

    class FakeStorage:
        def nbytes(self):
            return NB * 128

        def _share_cuda_(self):
            return (3, b"\x03c" + HANDLE, NB * 128, 4096, b"/torch_ref", 0, b"ev", True)

    class FakeTensor:
        device = torch.device("cuda", 3)

        def untyped_storage(self):
            return FakeStorage()

    e = cuda_share.export_storage(FakeTensor())
    assert e == ExportedStorage(3, HANDLE, 4096, NB * 128) and e.size == 4096 + NB * 128
    del t


# -------------------------------------------------------------------- maths
def test_dense_as_set_accepts_permuted_blocks_only_when_dense():
    assert dense_as_set((T, H, D), (H * D, D, 1))          # NHD
    assert dense_as_set((T, H, D), (D, T * D, 1))          # HND seen through an NHD-shaped view
    assert not dense_as_set((T, H, D), (H * D * 2, D, 1))  # a gap: not one run
    assert dense_as_set((1, T), (999, 1))                  # size-1 dims do not matter


@pytest.mark.parametrize("order,layout", [((0, 1, 2, 3, 4), "NHD"), ((0, 1, 3, 2, 4), "HND")])
def test_flash_attention_nhd_and_hnd_give_k_and_v_regions(order, layout):
    caches = flash_attn(2, order)
    plan = plan_regions(caches, NB)
    blen = T * H * D * BF16
    assert len(plan.storages) == 2
    assert [(r.name.rsplit("/", 1)[1], r.offset, r.block_len, r.block_stride) for r in plan.regions] == [
        ("k", 0, blen, blen), ("v", NB * blen, blen, blen)] * 2
    first = next(iter(caches))
    assert infer_kv_layout(caches[first], plan.block_dims[first], T, H) == layout


def test_flashinfer_layout_keeps_k_and_v_inside_the_block():
    t = torch.zeros(NB, 2, H, T, D, dtype=torch.float16).permute(0, 1, 3, 2, 4)  # [NB, 2, T, H, D], HND inside
    plan = plan_regions({"l0": t}, NB)
    (r,) = plan.regions
    assert (r.offset, r.block_len, r.block_stride) == (0, 2 * T * H * D * 2, 2 * T * H * D * 2)
    assert infer_kv_layout(t, 0, T, H) == "HND"


def test_mla_is_one_region_per_layer():
    caches = {f"l{i}": torch.zeros(NB, T, 576, dtype=torch.bfloat16) for i in range(3)}
    plan = plan_regions(caches, NB)
    assert [(r.storage, r.offset, r.block_len) for r in plan.regions] == [(i, 0, T * 576 * 2) for i in range(3)]


def test_meta_tensors_plan_like_real_ones():
    """The maths need no memory: vLLM's GPU shapes on the meta device."""
    caches = flash_attn(3, device="meta")
    plan = plan_regions(caches, NB)
    assert len(plan.storages) == 3 and len(plan.regions) == 6


def test_vllm_one_buffer_for_all_layers_is_one_storage():
    """vLLM 0.32 allocate_kv_cache: one raw int8 buffer; per-layer views of it."""
    page = 2 * T * H * D * BF16
    buf = torch.zeros(3 * NB * page, dtype=torch.int8)
    caches = {f"l{i}": buf[i * NB * page:(i + 1) * NB * page].view(torch.bfloat16).view(2, NB, T, H, D)
              for i in range(3)}
    plan = plan_regions(caches, NB)
    blen = page // 2
    assert len(plan.storages) == 1
    assert [r.offset for r in plan.regions] == [i * NB * page + kv * NB * blen for i in range(3) for kv in (0, 1)]


def test_bad_caches_are_refused_with_the_layer_named():
    with pytest.raises(CudaShareError, match="num_blocks=7"):
        plan_regions({"l0": torch.zeros(NB, 4)}, 7)
    with pytest.raises(CudaShareError, match="dtype"):
        plan_regions({"a": torch.zeros(NB, 4), "b": torch.zeros(NB, 4, dtype=torch.float16)}, NB)
    gap = torch.zeros(NB, T, 2 * H, D)[:, :, :H]  # every other head: holes inside a block
    with pytest.raises(CudaShareError, match="layer g: the bytes of one block are not one contiguous run"):
        plan_regions({"g": gap}, NB)


# -------------------------------------------------------------------- proto
def test_segments_are_allocations_and_offsets_are_from_the_allocation_base():
    """Two storages carved from one cudaMalloc allocation (same handle) are one
    segment; region offsets add each storage's offset in the allocation."""
    caches = flash_attn(2)
    shared = share_kv_caches(caches, num_blocks=NB, block_size=T, kv_layout="NHD", num_kv_heads=H, head_dim=D,
                             exporter=fake_exporter(offsets={0: 0, 1: 1 << 20}, handles={0: HANDLE, 1: HANDLE},
                                                    device=2))
    blen = T * H * D * BF16
    storage = 2 * NB * blen
    (seg,) = shared.segments
    assert (seg.kind, seg.handle, seg.device, seg.size) == (pb.MEMORY_KIND_CUDA_IPC, HANDLE, 2, (1 << 20) + storage)
    assert [(r.segment_index, r.offset) for r in shared.regions] == [
        (0, 0), (0, NB * blen), (0, 1 << 20), (0, (1 << 20) + NB * blen)]
    lay = shared.layout
    assert (lay.num_blocks, lay.block_size, lay.kv_layout, lay.dtype, lay.num_layers) == (
        NB, T, pb.KV_LAYOUT_NHD, "bfloat16", 2)
    assert list(lay.block_lens) == [blen] * 4


def test_separate_allocations_are_separate_segments_and_serialize():
    shared = share_kv_caches(flash_attn(2), num_blocks=NB, block_size=T, kv_layout="NHD", num_kv_heads=H,
                             head_dim=D, exporter=fake_exporter())
    assert [s.handle[:1] for s in shared.segments] == [b"\x00", b"\x01"]
    req = pb.RegisterEngineRequest(segments=shared.segments, regions=shared.regions, layout=shared.layout,
                                   data_path=pb.DATA_PATH_AUTO)
    back = pb.RegisterEngineRequest.FromString(req.SerializeToString())
    assert [(s.handle, s.size, s.device) for s in back.segments] == [
        (s.handle, s.size, s.device) for s in shared.segments]
    assert all(len(s.handle) == 64 for s in back.segments)


def test_declared_layout_must_match_the_strides():
    with pytest.raises(CudaShareError, match="declared kv_layout NHD, but its strides put the blocks in HND"):
        share_kv_caches(flash_attn(1, (0, 1, 3, 2, 4)), num_blocks=NB, block_size=T, kv_layout="NHD",
                        num_kv_heads=H, head_dim=D, exporter=fake_exporter())


def test_worker_on_two_devices_and_region_past_storage_are_refused():
    caches = flash_attn(2)
    devs = iter([0, 1])

    def two_devices(t):
        return ExportedStorage(next(devs), bytes(64), 0, t.untyped_storage().nbytes())

    with pytest.raises(CudaShareError, match="one device"):
        share_kv_caches(caches, num_blocks=NB, block_size=T, kv_layout="NHD", num_kv_heads=H, head_dim=D,
                        exporter=two_devices)

    def short(t):
        return ExportedStorage(0, bytes(64), 0, 1024)

    with pytest.raises(CudaShareError, match="past its storage of 1024 bytes"):
        share_kv_caches(caches, num_blocks=NB, block_size=T, kv_layout="NHD", num_kv_heads=H, head_dim=D,
                        exporter=short)


# ------------------------------------------------------------- staged copies
def test_staging_mirror_copies_exactly_the_blocks_asked_with_the_segment_offsets():
    """The staged path's copies on the CPU: cache -> mirror (prefill) puts
    each block at the bytes the daemon's region names; mirror -> cache
    (decode) brings them back. Two storages in one allocation, at offsets."""
    caches = flash_attn(2, (0, 1, 3, 2, 4))
    for i, t in enumerate(caches.values()):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) + 1000 * i)
    offsets = {0: 256, 1: 256 + 2 * NB * T * H * D * BF16 + 512}
    shared = share_kv_caches(caches, num_blocks=NB, block_size=T, kv_layout="HND", num_kv_heads=H, head_dim=D,
                             exporter=fake_exporter(offsets=offsets, handles={0: HANDLE, 1: HANDLE}))
    (seg,) = shared.segments
    shm = ShmSegment(seg.size)
    try:
        st = StagingMirror(shared.cache_blocks(), shared.regions, [seg.size], NB,
                           [pb.Segment(kind=pb.MEMORY_KIND_SHM, name=shm.name, size=shm.size)])
        ids = [4, 1]
        st.copy_in([ids])
        for r in shared.regions:
            for b in range(NB):
                got = bytes(shm.mm[r.offset + b * r.block_stride: r.offset + b * r.block_stride + r.block_len])
                layer = caches[r.name.rsplit("/", 1)[0]]
                want = layer[0 if r.name.endswith("/k") else 1, b].permute(1, 0, 2).contiguous().view(torch.uint8)
                assert (got == want.numpy().tobytes()) == (b in ids), (r.name, b)
        # decode side: clear the cache, bring blocks back from the mirror
        snapshot = {k: v.clone() for k, v in caches.items()}
        for t in caches.values():
            t.zero_()
        st.copy_out([[1]])
        for k, t in caches.items():
            assert torch.equal(t[:, 1], snapshot[k][:, 1]) and not t[:, 4].any()
        st.close()
        st.close()
    finally:
        shm.close()


@pytest.mark.parametrize("code, fatal", [(2, False), (700, True)])
def test_a_failed_row_copy_kernel_falls_back_to_torch_or_fails_as_a_staging_error(monkeypatch, code, fatal):
    """StagingMirror copies through kvd's kernel on a GPU; a CudaError there
    must not escape the connector (it catches StagingError only): an
    ordinary one (out of memory for the kernel's table) leaves torch's
    copies, one that loses the CUDA context is a StagingError."""
    from kvd import cudart
    from kvd.shim.memory import staged

    caches = flash_attn(1, (0, 1, 2, 3, 4))
    for t in caches.values():
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape))
    shared = share_kv_caches(caches, num_blocks=NB, block_size=T, kv_layout="NHD", num_kv_heads=H, head_dim=D,
                             exporter=fake_exporter(offsets={0: 0}, handles={0: HANDLE}))
    (seg,) = shared.segments
    shm = ShmSegment(seg.size)
    calls = []

    def failing(self, device, ids, to_mirror):
        calls.append(device)
        raise cudart.CudaError("cuLaunchKernel", code, "stand-in", "stand-in")

    monkeypatch.setattr(staged.StagingMirror, "_kernel_device", lambda self: 0)
    monkeypatch.setattr(staged.StagingMirror, "_copy_rows", failing)
    try:
        st = staged.StagingMirror(shared.cache_blocks(), shared.regions, [seg.size], NB,
                                  [pb.Segment(kind=pb.MEMORY_KIND_SHM, name=shm.name, size=shm.size)])
        if fatal:
            with pytest.raises(staged.StagingError, match="CUDA context is lost"):
                st.copy_in([[2]])
        else:
            assert st.copy_in([[2]]) > 0 and st.copy_in([[3]]) > 0
            assert calls == [0], "after one failure the kernel is not tried again"
            r = shared.regions[0]
            want = caches[r.name.rsplit("/", 1)[0]][0, 2].contiguous().view(torch.uint8).numpy().tobytes()
            assert bytes(shm.mm[r.offset + 2 * r.block_stride: r.offset + 2 * r.block_stride + r.block_len]) == want
        st.close()
    finally:
        shm.close()
