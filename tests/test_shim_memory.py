"""kvd.shim.memory: the chooser picks the sharing by the KV cache's device,
and every case it cannot serve is refused with a KvShareError kind.

No GPU here: CUDA tensors are torch fake tensors (FakeTensorMode: a device,
shapes and strides, no memory) for the device decision, and the CUDA IPC
export is faked at torch's ``_share_cuda_`` boundary
(``kvd.shim.memory.cuda_ipc.export_storage``) over CPU tensors laid out as
vLLM's GPU caches: FlashAttention ``[2, num_blocks, block_size, heads,
head_dim]``, FlashInfer ``[num_blocks, 2, block_size, heads, head_dim]``,
MLA ``[num_blocks, block_size, latent]``.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kvd.shim.memory import auto, cuda_ipc
from kvd.shim.memory.cuda_ipc import CudaIpcSharing, CudaShareError, ExportedStorage, parse_torch_handle
from kvd.shim.memory.regions import KvShareError
from kvd.shim.memory.shm import CpuShareError, ShmSharing
from kvd.v1 import kvd_pb2 as pb

NB, T, H, D = 6, 16, 4, 32  # blocks, tokens per block, KV heads, head_dim
DESCRIBE = dict(num_blocks=NB, block_size=T, num_kv_heads=H, head_dim=D, total_kv_heads=H, groups=None)


def fake_cuda(*devices: str) -> dict[str, torch.Tensor]:
    """One FlashAttention-shaped layer per device, as fake CUDA tensors."""
    with FakeTensorMode():
        return {f"layer.{i}": torch.empty(2, NB, T, H, D, dtype=torch.bfloat16, device=d)
                for i, d in enumerate(devices)}


@pytest.fixture
def exported(monkeypatch):
    """torch's ``_share_cuda_`` faked: one 64-byte handle per storage; the
    calls to ``synchronize`` recorded."""
    calls = {"export": 0, "sync": []}

    def export(t: torch.Tensor) -> ExportedStorage:
        calls["export"] += 1
        ptr = t.untyped_storage().data_ptr()
        return ExportedStorage(0, ptr.to_bytes(8, "little") * 8, 128, t.untyped_storage().nbytes())

    monkeypatch.setattr(cuda_ipc, "export_storage", export)
    monkeypatch.setattr(cuda_ipc, "synchronize", lambda device: calls["sync"].append(device))
    return calls


# ------------------------------------------------------------------ chooser
def test_cpu_tensors_get_shm_and_cuda_tensors_get_cuda_ipc_on_their_device():
    cpu = {"l0": torch.zeros(2, NB, T, H, D)}
    assert isinstance(auto.choose(cpu, "direct"), ShmSharing)
    chosen = auto.choose(fake_cuda("cuda:1", "cuda:1"), "staged")
    assert isinstance(chosen, CudaIpcSharing) and chosen.device == torch.device("cuda", 1)
    assert chosen.kind == "cuda_ipc" and chosen.data_path == "staged"


def test_what_cannot_be_shared_is_refused_with_the_devices_named():
    with pytest.raises(CudaShareError, match="one CUDA device") as e:
        auto.choose(fake_cuda("cuda:0", "cuda:1"))
    assert "cuda:0" in str(e.value) and "cuda:1" in str(e.value)
    mixed = {**fake_cuda("cuda:0"), "cpu.layer": torch.zeros(2, NB, T, H, D)}
    with pytest.raises(KvShareError, match="all CPU or all on one CUDA device"):
        auto.choose(mixed)
    with pytest.raises(KvShareError, match="meta"):
        auto.choose({"l0": torch.empty(2, NB, T, H, D, device="meta")})
    with pytest.raises(KvShareError, match="no KV cache tensors"):
        auto.choose({})
    with pytest.raises(ValueError, match="data_path must be one of"):
        auto.choose({"l0": torch.zeros(4)}, "fastest")
    assert issubclass(CudaShareError, KvShareError) and issubclass(CpuShareError, KvShareError)


# --------------------------------------------------------------- CUDA IPC
@pytest.mark.parametrize("data_path,wire", [("direct", pb.DATA_PATH_DIRECT), ("staged", pb.DATA_PATH_STAGED),
                                            ("auto", pb.DATA_PATH_AUTO)])
def test_cuda_sharing_registers_ipc_segments_and_lets_the_daemon_pick_the_path(exported, data_path, wire):
    """Every data path registers the same CUDA IPC segments (one per
    allocation); staged and auto are the daemon's to resolve."""
    buf = torch.zeros(2 * 2 * NB * T * H * D, dtype=torch.bfloat16)  # vLLM: one allocation for all layers
    caches = {f"l{i}": buf[i * 2 * NB * T * H * D:(i + 1) * 2 * NB * T * H * D].view(2, NB, T, H, D)
              for i in range(2)}
    sharing = CudaIpcSharing(data_path, torch.device("cuda", 0))
    shared = sharing.share(caches, kv_layout="NHD", **DESCRIBE)
    assert sharing.wire_data_path == wire and exported["export"] == 1
    (seg,) = shared.segments
    assert seg.kind == pb.MEMORY_KIND_CUDA_IPC and len(seg.handle) == 64 and seg.size == 128 + buf.nbytes
    assert [r.name for r in shared.regions] == ["l0/k", "l0/v", "l1/k", "l1/v"]
    assert shared.regions[0].offset == 128, "offsets count from the allocation base"
    assert not shared.kv_in_block
    assert [tuple(b.shape) for b in shared.cache_blocks()] == [(NB, T * H * D * 2)] * 4


def test_flashinfer_blocks_hold_k_and_v_so_only_equal_block_sizes_pair(exported):
    flashinfer = {"l0": torch.zeros(NB, 2, T, H, D, dtype=torch.bfloat16)}
    shared = CudaIpcSharing("direct").share(flashinfer, kv_layout="NHD", **DESCRIBE)
    (r,) = shared.regions
    assert r.block_len == 2 * T * H * D * 2 and shared.kv_in_block and not shared.layout.kv_in_block


def test_mla_latent_cache_is_one_region_per_layer(exported):
    mla = {"l0": torch.zeros(NB, T, 576, dtype=torch.bfloat16)}
    shared = CudaIpcSharing("direct").share(mla, **{**DESCRIBE, "kv_layout": "MLA", "num_kv_heads": 1,
                                                    "head_dim": 576})
    (r,) = shared.regions
    assert r.block_len == T * 576 * 2 and not shared.kv_in_block


def test_expandable_segments_are_refused_with_the_setting_named(monkeypatch):
    def expandable(t):  # what torch's _share_cuda_ hands out for PYTORCH_CUDA_ALLOC_CONF=expandable_segments
        return ExportedStorage(0, parse_torch_handle(b"\x03e" + bytes(64)), 0, t.untyped_storage().nbytes())

    monkeypatch.setattr(cuda_ipc, "export_storage", expandable)
    with pytest.raises(CudaShareError, match="expandable_segments:False"):
        CudaIpcSharing("direct").share({"l0": torch.zeros(2, NB, T, H, D)}, kv_layout="NHD", **DESCRIBE)


def test_cuda_sync_waits_for_the_kv_caches_device_and_shm_needs_none(exported):
    sharing = CudaIpcSharing("direct", torch.device("cuda", 3))
    sharing.sync()
    assert exported["sync"] == [torch.device("cuda", 3)]
    ShmSharing("direct").sync()  # host memory: nothing to wait for
    assert sharing.close() == [] and sharing.close() == []
