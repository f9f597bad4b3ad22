"""kvd.core.path_select: which path a transfer takes, from recorded UCX
protocol tables (``UCX_PROTO_INFO=y``), the re-export check, a measured
bandwidth or NIXL's backend name; and ``data_path = auto`` (docs/GPU.md).

The fixtures reproduce the format UCX 1.19-1.22 prints (two-cell header
row naming context, scope, endpoint configuration, operation and memory
types; three-cell rows of size range, protocol and lane), as seen in the
reports of NIXL issues 1195/1754 and openucx/ucx#11548."""

from __future__ import annotations

import math

import pytest

from kvd.core import path_select as ps
from kvd.core.path_select import Path

P = "[1760000000.10000{n}] [gpu-node:4242:0]   "

# A healthy same-node READ of GPU memory (cudaMalloc memory registered by its owner).
CUDA_IPC = "\n".join(P.format(n=i) + line for i, line in enumerate([
    "+--------------------------------+-----------------------------------------------------------------------+",
    "| ucp_context_0 intra-node cfg#2 | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0] |",
    "+--------------------------------+------------------------------------+----------------------------------+",
    "|                         0..inf | zero-copy                          | cuda_ipc/cuda                    |",
    "+--------------------------------+------------------------------------+----------------------------------+",
]))

# NIXL issue 1754's trap: the same READ, memory UCX cannot export, no NIC: emulated over TCP.
EMULATED = "\n".join(P.format(n=i) + line for i, line in enumerate([
    "+--------------------------------+-----------------------------------------------------------------------+",
    "| ucp_context_0 intra-node cfg#3 | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0] |",
    "+--------------------------------+------------------------------------+----------------------------------+",
    "|                         0..inf | software emulation                 | tcp/eth0                         |",
    "+--------------------------------+------------------------------------+----------------------------------+",
]))

# Same node, a NIC present: GPUDirect RDMA loopback for large messages, emulation for tiny ones.
RDMA = "\n".join(P.format(n=i) + line for i, line in enumerate([
    "| ucp_context_0 intra-node cfg#2 | remote memory read by ucp_get*(multi) into cuda/GPU3 from cuda/dev[0] |",
    "|                              0 | copy-out           | rc_mlx5/ibp3:1/path0                             |",
    "|                          1..64 | software emulation | rc_mlx5/ibp3:1/path0                             |",
    "|                        65..inf | zero-copy          | rc_mlx5/ibp3:1 50% on path0 and 50% on path1     |",
]))

# A PUT from host memory into GPU memory (the push direction, host-staged engine).
PUT_HOST_TO_CUDA = "\n".join(P.format(n=i) + line for i, line in enumerate([
    "| ucp_context_0 intra-node cfg#1 | remote memory write by ucp_put*(fast-completion) from host memory to cuda/dev[0] |",
    "|                          0..2K | short                              | rc_mlx5/mlx5_0:1/path0                 |",
    "|                     2049..9383 | copy-in                            | rc_mlx5/mlx5_0:1/path0                 |",
    "|                      9384..inf | zero-copy                          | rc_mlx5/mlx5_0:1 50% on path0 and 50% on path1 |",
]))

# The CPU path here: host memory both sides, UCX over shared memory.
HOST = "\n".join([
    "| ucp_context_0 intra-node cfg#0 | remote memory read by ucp_get*(multi) into host memory from host |",
    "|                          0..8K | copy-out             | sysv/memory                                  |",
    "|                        8K..inf | zero-copy            | cma/memory                                   |",
])

# Host-staged GPU pipeline (cuda_copy bounce buffers).
PIPELINE = "\n".join([
    "| ucp_context_0 intra-node cfg#4 | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0] |",
    "|                         0..inf | rendezvous pipeline cuda_copy, fragment 4M | cuda_copy/cuda              |",
])

# Recorded here (2026-11-30, the UCX bundled with NIXL 1.5.1, UCX_PROTO_INFO=y, two
# kvd daemons moving DRAM blocks: benchmarks/gpu_check.py --cpu): this UCX prints
# the header as two one-cell rows and a "Range | Description | Config" title row.
RECORDED_NIXL15 = """\
[1796008157.032672] [vm:3206 :1]   +--------+-------------+-------------------------------------------+
[1796008157.032672] [vm:3206 :1]   | kvd-D-64k-direct-r0-6dcaa4ab intra-node cfg#1                    |
[1796008157.032672] [vm:3206 :1]   | remote memory read by ucp_get*(multi) into host memory from host |
[1796008157.032672] [vm:3206 :1]   +--------+-------------+-------------------------------------------+
[1796008157.032672] [vm:3206 :1]   | Range  | Description |                  Config                   |
[1796008157.032672] [vm:3206 :1]   +--------+-------------+-------------------------------------------+
[1796008157.032672] [vm:3206 :1]   | 0..inf | zero-copy   | cma/memory                                |
[1796008157.032672] [vm:3206 :1]   +--------+-------------+-------------------------------------------+
"""

# The same layout for GPU memory (constructed: what the H200 run is expected to print
# when the daemons' UCX can use cuda_ipc, and when it cannot).
NIXL15_GPU = """\
[1796008157.1] [h200:77 :1]   | kvd-D-1024k-direct-r0-0a1b2c3d intra-node cfg#1                        |
[1796008157.1] [h200:77 :1]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0]  |
[1796008157.1] [h200:77 :1]   +--------+---------------------+-----------------------------------------+
[1796008157.1] [h200:77 :1]   | Range  | Description         | Config                                  |
[1796008157.1] [h200:77 :1]   +--------+---------------------+-----------------------------------------+
[1796008157.1] [h200:77 :1]   | 0..inf | {proto:<19} | {lane:<39} |
"""

WORKER_LINE = ("[1765333150.098983] [g340:1570878:2]      ucp_worker.c:1912 UCX  INFO    ucp_context_0 intra-node "
               "cfg#2 rma_am(tcp/eth1)  amo_am(tcp/eth1)  am(tcp/eth1 tcp/eth6 cuda_ipc/cuda)  ka(tcp/eth1)")


# ------------------------------------------------------------------ parsing
def test_sizes_and_ranges():
    assert ps.parse_size("0") == 0 and ps.parse_size("2049") == 2049
    assert ps.parse_size("2K") == 2048 and ps.parse_size("4M") == 4 << 20 and ps.parse_size("1G") == 1 << 30
    assert ps.parse_size("inf") == math.inf
    assert ps.parse_range("65..inf") == (65, math.inf) and ps.parse_range("0") == (0, 0)
    with pytest.raises(ValueError):
        ps.parse_size("lots")


def test_a_table_is_parsed_with_its_header_fields_and_rows():
    (t,) = ps.parse_proto_info(RDMA)
    assert (t.context, t.scope, t.cfg, t.op) == ("ucp_context_0", "intra-node", 2, "get")
    assert t.operation == "remote memory read by ucp_get*(multi)"
    assert (t.local_mem, t.remote_mem) == ("cuda", "cuda") and t.gpu
    assert [(r.lo, r.hi, r.protocol, r.lane) for r in t.rows] == [
        (0, 0, "copy-out", "rc_mlx5"), (1, 64, "software emulation", "rc_mlx5"),
        (65, math.inf, "zero-copy", "rc_mlx5")]


def test_put_header_names_local_from_and_remote_to():
    (t,) = ps.parse_proto_info(PUT_HOST_TO_CUDA)
    assert (t.op, t.local_mem, t.remote_mem) == ("put", "host", "cuda")


def test_a_whole_log_with_other_lines_and_several_tables():
    log = "\n".join(["kvd daemon starting", WORKER_LINE, CUDA_IPC, "INFO registered engine", EMULATED, HOST])
    tables = ps.parse_proto_info(log)
    assert [(t.cfg, t.gpu) for t in tables] == [(2, True), (3, True), (0, False)]
    assert ps.parse_lanes(WORKER_LINE)["am"] == ["tcp/eth1", "tcp/eth6", "cuda_ipc/cuda"]


def test_recorded_nixl_15_format_with_a_two_row_header():
    (t,) = ps.parse_proto_info(RECORDED_NIXL15)
    assert (t.context, t.scope, t.cfg, t.op) == ("kvd-D-64k-direct-r0-6dcaa4ab", "intra-node", 1, "get")
    assert (t.local_mem, t.remote_mem) == ("host", "host") and not t.gpu
    assert [(r.lo, r.hi, r.protocol, r.transport) for r in t.rows] == [(0, math.inf, "zero-copy", "cma/memory")]
    assert ps.proto_evidence(RECORDED_NIXL15, 65536) == []  # a DRAM table says nothing about the GPU path
    (e,) = ps.proto_evidence(RECORDED_NIXL15, 65536, gpu_only=False)
    assert e.path is Path.HOST


@pytest.mark.parametrize("proto,lane,path", [("zero-copy", "cuda_ipc/cuda", Path.CUDA_IPC),
                                             ("software emulation", "tcp/lo", Path.EMULATED),
                                             ("zero-copy", "rc_mlx5/mlx5_0:1", Path.GPU_RDMA)])
def test_nixl_15_format_for_gpu_memory(proto, lane, path):
    (e,) = ps.proto_evidence(NIXL15_GPU.format(proto=proto, lane=lane), 1 << 20)
    assert e.path is path and "cuda<-cuda" in e.detail


# ---------------------------------------------------------- classification
@pytest.mark.parametrize("text,size,path", [
    (CUDA_IPC, 64 << 10, Path.CUDA_IPC),
    (CUDA_IPC, 4 << 20, Path.CUDA_IPC),
    (EMULATED, 1 << 20, Path.EMULATED),
    (RDMA, 64 << 10, Path.GPU_RDMA),
    (RDMA, 64, Path.EMULATED),
    (RDMA, 0, Path.HOST_STAGED),
    (PIPELINE, 1 << 20, Path.HOST_STAGED),
])
def test_proto_info_classifies_the_row_for_the_block_size(text, size, path):
    (e,) = ps.proto_evidence(text, size)
    assert e.source == "ucx_proto_info" and e.path is path
    assert f"@{size} B" in e.detail


def test_proto_evidence_filters_by_operation_and_memory():
    assert ps.proto_evidence(PUT_HOST_TO_CUDA, 1 << 20, op="get") == []
    (e,) = ps.proto_evidence(PUT_HOST_TO_CUDA, 1 << 20, op="put")
    assert e.path is Path.GPU_RDMA
    assert ps.proto_evidence(HOST, 1 << 20) == []                       # gpu_only skips the DRAM table
    (h,) = ps.proto_evidence(HOST, 1 << 20, gpu_only=False)
    assert h.path is Path.HOST and not h.path.slow


def test_worst_of_several_observations():
    ev = ps.proto_evidence(CUDA_IPC + "\n" + EMULATED, 1 << 20)
    assert [e.path for e in ev] == [Path.CUDA_IPC, Path.EMULATED]
    assert ps.worst(ev) is Path.EMULATED and ps.worst([]) is Path.UNKNOWN


def test_row_rules():
    assert ps.classify_row("zero-copy", "rocm_ipc", gpu=True) is Path.CUDA_IPC
    assert ps.classify_row("zero-copy", "tcp", gpu=True) is Path.HOST_STAGED
    assert ps.classify_row("multi-frag copy-in", "sysv", gpu=True) is Path.HOST_STAGED
    assert ps.classify_row("zero-copy", "cuda_copy", gpu=True) is Path.HOST_STAGED
    assert ps.classify_row("zero-copy", "mystery", gpu=True) is Path.UNKNOWN
    assert ps.classify_row("copy-in", "posix", gpu=False) is Path.HOST


# -------------------------------------------------------- other evidence
def test_bandwidth_thresholds_against_the_d2d_reference():
    d2d = 2000.0  # GB/s of payload, a device-to-device copy on one H200 (order of magnitude)
    assert ps.bandwidth_evidence(1900, d2d).path is Path.ZERO_COPY
    assert ps.bandwidth_evidence(45, d2d).path is Path.HOST_STAGED    # a PCIe bounce
    assert ps.bandwidth_evidence(0.3, d2d).path is Path.EMULATED      # NIXL 1754's TCP emulation
    assert ps.bandwidth_evidence(3, 5.6, memory="DRAM").path is Path.HOST
    assert ps.bandwidth_evidence(10, 0).path is Path.UNKNOWN
    assert "0.950 of 2000.0" in ps.bandwidth_evidence(1900, d2d).detail


def test_nixl_backend_name_alone_cannot_tell():
    e = ps.backend_evidence("UCX")
    assert e.path is Path.UNKNOWN and "UCX_PROTO_INFO" in e.detail
    assert ps.backend_evidence("").path is Path.UNKNOWN


# ------------------------------------------------------------------ choice
def test_auto_stages_when_the_daemon_cannot_reexport():
    c = ps.choose_data_path("auto", [ps.reexport_evidence(False, "cudaIpcGetMemHandle fails (cudaErrorInvalidValue)")])
    assert c.path == "staged" and "reexport: cudaIpcGetMemHandle fails" in c.reason


def test_auto_stays_direct_on_zero_copy_or_no_evidence():
    c = ps.choose_data_path("auto", [ps.reexport_evidence(True, "ok")] + ps.proto_evidence(CUDA_IPC, 1 << 20))
    assert c.path == "direct" and c.reason.startswith("auto: zero-copy")
    assert ps.choose_data_path("auto", []).path == "direct"
    assert ps.choose_data_path("auto", ps.proto_evidence(RDMA, 1 << 20)).path == "direct"  # GPUDirect is zero-copy


def test_auto_stages_on_emulation_seen_in_proto_info_or_bandwidth():
    assert ps.choose_data_path("auto", ps.proto_evidence(EMULATED, 1 << 20)).path == "staged"
    assert ps.choose_data_path("auto", [ps.bandwidth_evidence(0.3, 2000)]).path == "staged"


def test_explicit_choices_are_kept_and_a_risky_direct_is_flagged():
    slow = [ps.reexport_evidence(False, "cannot export")]
    d = ps.choose_data_path("direct", slow)
    assert d.path == "direct" and "cannot export" in d.warning
    assert ps.choose_data_path("direct", []).warning == ""
    assert ps.choose_data_path("staged", []).path == "staged"
    with pytest.raises(ValueError, match="direct, staged or auto"):
        ps.choose_data_path("fast", [])


# Recorded on an H200 (2026-12-04, UCX in nixl-cu13 1.5.1, benchmarks/gpu_check.py): the
# prefill daemon's own endpoint to itself, and the decode daemon's READ from its peer.
H200_SELF_PUT = """\
[1796384654.596972] [vm:565  :1]   +--------+--------------------+-----------------------------------+
[1796384654.596972] [vm:565  :1]   | kvd-P-4096k-staged-r0-66b9a027 self cfg#1                       |
[1796384654.596972] [vm:565  :1]   | remote memory write by ucp_put* from host memory to cuda/dev[1] |
[1796384654.596972] [vm:565  :1]   +--------+--------------------+-----------------------------------+
[1796384654.596972] [vm:565  :1]   | Range  |    Description     |              Config               |
[1796384654.596972] [vm:565  :1]   +--------+--------------------+-----------------------------------+
[1796384654.596972] [vm:565  :1]   | 0..inf | software emulation | tcp/lo                            |
[1796384654.596972] [vm:565  :1]   +--------+--------------------+-----------------------------------+
"""
H200_PEER_GET = """\
[1796384654.975088] [vm:566  :1]   +--------+-------------+------------------------------------------------+
[1796384654.975088] [vm:566  :1]   | kvd-D-4096k-staged-r0-48871b86 intra-node cfg#3                        |
[1796384654.975088] [vm:566  :1]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1] |
[1796384654.975088] [vm:566  :1]   +--------+-------------+------------------------------------------------+
[1796384654.975088] [vm:566  :1]   | Range  | Description |                     Config                     |
[1796384654.975088] [vm:566  :1]   +--------+-------------+------------------------------------------------+
[1796384654.975088] [vm:566  :1]   | 0..inf | zero-copy   | cuda_ipc/cuda                                  |
[1796384654.975088] [vm:566  :1]   +--------+-------------+------------------------------------------------+
"""


def test_an_agents_endpoint_to_itself_is_not_evidence_of_a_peers_lane():
    """On the H200 the push run's prefill daemon printed this emulated self
    table while its WRITEs to the peer ran at 455 GB/s through cuda_ipc."""
    (t,) = ps.parse_proto_info(H200_SELF_PUT)
    assert t.scope == "self" and t.op == "put" and t.gpu
    assert ps.proto_evidence(H200_SELF_PUT, 4 << 20, op="put") == []
    (e,) = ps.proto_evidence(H200_SELF_PUT + H200_PEER_GET, 4 << 20, op="get")
    assert e.path is Path.CUDA_IPC


def test_both_gpu_keeps_only_vram_to_vram_tables():
    """A push run on the H200 printed host<-cuda put tables (software
    emulation: WRITEs between a DRAM scratch page and VRAM) beside the
    cuda<-cuda one its 485 GB/s WRITEs took (cuda_ipc)."""
    assert ps.proto_evidence(PUT_HOST_TO_CUDA, 1 << 20, op="put", both_gpu=True) == []
    (e,) = ps.proto_evidence(PUT_HOST_TO_CUDA + "\n" + CUDA_IPC, 1 << 20, op="get", both_gpu=True)
    assert e.path is Path.CUDA_IPC
