"""Which path a transfer really takes, and ``data_path = auto`` (docs/GPU.md).

Pure functions over what can be observed; no NIXL, no CUDA, no I/O, so every
rule is unit-tested on the CPU with recorded strings (tests/test_gpu_path_select.py).

The trap (docs/DESIGN.md, NIXL issues 154 and 1754): NIXL registers GPU memory and
the transfer *works*, but UCX picked a slow lane: bytes bounce through host
memory, or UCX emulates the RMA in software over TCP (about 0.3 GB/s where
``cuda_ipc`` does about 200 GB/s), and nothing fails. Evidence that tells the
paths apart, strongest first:

- ``reexport``: can the daemon export the memory it registered through legacy
  CUDA IPC (what UCX's ``cuda_ipc`` needs)? Memory the daemon imported from
  the engine cannot; checked when the handle is opened (``kvd.core.cuda_ipc``).
- ``ucx_proto_info``: UCX's own protocol tables, printed with
  ``UCX_PROTO_INFO=y`` (one table per operation, memory types and endpoint
  configuration, one row per message-size range: protocol and lane), e.g.::

      | ucp_context_0 intra-node cfg#2 | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0] |
      |                         0..inf | zero-copy                  | cuda_ipc/cuda                          |

- ``bandwidth``: a measured transfer against the device-to-device copy figure
  for the same pair of devices.
- ``nixl_backend``: ``nixl_agent.query_xfer_backend`` names the NIXL backend
  (``"UCX"``), not UCX's lane: by itself it cannot tell the paths apart.

:func:`choose_data_path` turns evidence into ``direct`` or ``staged``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum


class Path(str, Enum):
    """How bytes move, as far as the evidence tells."""

    CUDA_IPC = "cuda_ipc"             # GPU peer mapping (NVLink / PCIe P2P / same GPU): zero-copy, the fast path
    GPU_RDMA = "gpudirect_rdma"       # zero-copy through a NIC (rc/dc/ud ...) from and to GPU memory
    ZERO_COPY = "zero_copy"           # zero-copy by bandwidth, lane not known
    HOST = "host"                     # host memory on both sides (the DRAM path: cma, shm, rc ...)
    HOST_STAGED = "host_staged"       # GPU bytes bounce through host buffers (copy-in/out, cuda_copy pipelines)
    EMULATED = "emulated"             # UCX software emulation (e.g. RMA over TCP): the 600x trap
    UNKNOWN = "unknown"

    @property
    def slow(self) -> bool:
        """A GPU fallback that the staged VRAM path beats."""
        return self in (Path.HOST_STAGED, Path.EMULATED)

    @property
    def zero_copy(self) -> bool:
        return self in (Path.CUDA_IPC, Path.GPU_RDMA, Path.ZERO_COPY)


# Worst first: what a summary of several observations reports.
_BADNESS = [Path.EMULATED, Path.HOST_STAGED, Path.UNKNOWN, Path.GPU_RDMA, Path.ZERO_COPY, Path.HOST, Path.CUDA_IPC]


@dataclass(frozen=True)
class Evidence:
    """One observation: ``source`` (see the module doc), the path it points
    to, and a line for logs and reports."""

    source: str
    path: Path
    detail: str


@dataclass(frozen=True)
class Choice:
    """The data path for a worker: ``"direct"`` or ``"staged"``, and why."""

    path: str
    reason: str
    evidence: tuple[Evidence, ...] = ()
    warning: str = ""  # set when an explicit ``direct`` goes against the evidence


def worst(evidence) -> Path:
    """The worst path among observations (``UNKNOWN`` for none)."""
    paths = [e.path if isinstance(e, Evidence) else Path(e) for e in evidence]
    for p in _BADNESS:
        if p in paths:
            return p
    return Path.UNKNOWN


def choose_data_path(requested: str, evidence=()) -> Choice:
    """``direct`` or ``staged`` for a worker.

    ``requested`` ``"direct"`` / ``"staged"`` is kept (a ``direct`` against
    slow-path evidence gets a ``warning``). ``"auto"``: ``staged`` when any
    evidence shows a slow GPU path (:attr:`Path.slow`), else ``direct``.

    Raises:
        ValueError: ``requested`` is not one of the three.
    """
    evidence = tuple(evidence)
    slow = [e for e in evidence if e.path.slow]
    if requested == "staged":
        return Choice("staged", "requested", evidence)
    if requested == "direct":
        warning = ("direct path requested, but " + "; ".join(e.detail for e in slow)) if slow else ""
        return Choice("direct", "requested", evidence, warning)
    if requested != "auto":
        raise ValueError(f"data path must be direct, staged or auto (got {requested!r})")
    if slow:
        return Choice("staged", "auto: zero-copy unavailable: " + "; ".join(f"{e.source}: {e.detail}" for e in slow),
                      evidence)
    fast = [e for e in evidence if e.path.zero_copy]
    if fast:
        return Choice("direct", "auto: zero-copy: " + "; ".join(f"{e.source}: {e.detail}" for e in fast), evidence)
    return Choice("direct", "auto: no evidence of a slow path", evidence)


# ------------------------------------------------------------------ reexport
def reexport_evidence(ok: bool, detail: str) -> Evidence:
    """The daemon can (``cuda_ipc``) or cannot (``host_staged``: the NIXL 154
    hazard) export the registered memory to a peer through CUDA IPC."""
    return Evidence("reexport", Path.CUDA_IPC if ok else Path.HOST_STAGED, detail)


# ------------------------------------------------------------ UCX proto info
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> float:
    """A UCX size: ``"0"``, ``"2049"``, ``"8K"``, ``"1M"``, ``"inf"`` (-> ``math.inf``).

    Raises:
        ValueError: anything else.
    """
    t = text.strip().lower()
    if t in ("inf", "(inf)"):
        return math.inf
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)b?", t)
    if not m:
        raise ValueError(f"not a UCX size: {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def parse_range(text: str) -> tuple[float, float]:
    """``"0..2K"`` -> ``(0, 2048)``; ``"65..inf"``; a single ``"0"`` -> ``(0, 0)``."""
    if ".." in text:
        lo, hi = text.split("..", 1)
        return parse_size(lo), parse_size(hi)
    v = parse_size(text)
    return v, v


@dataclass(frozen=True)
class ProtoRow:
    """One message-size range of a UCX protocol table (sizes in bytes)."""

    lo: float
    hi: float
    protocol: str   # e.g. "zero-copy", "copy-in", "software emulation", "multi-frag copy-in"
    transport: str  # e.g. "cuda_ipc/cuda", "rc_mlx5/mlx5_0:1 50% on path0 and 50% on path1"

    @property
    def lane(self) -> str:
        """The first transport named, without device: ``"cuda_ipc"``, ``"rc_mlx5"``, ``"tcp"``."""
        first = self.transport.split()[0] if self.transport.split() else ""
        return first.split("/")[0].lower()


@dataclass
class ProtoTable:
    """One table of ``UCX_PROTO_INFO=y`` output.

    Attributes:
        context: e.g. ``"ucp_context_0"``; scope ``"intra-node"`` / ``"inter-node"``
            (or ``""``); cfg the endpoint configuration number.
        operation: the description, e.g. ``"remote memory read by ucp_get*(multi)"``.
        op: ``"get"``, ``"put"``, ``"tag"``, ``"am"``, ``"amo"``, ``"rndv"`` or ``""``.
        local_mem, remote_mem: memory kinds, ``"host"``, ``"cuda"``, ``"rocm"``,
            ``"cuda-managed"`` (``""`` when the header does not say). For a
            GET: local = ``into``, remote = ``from``; for a PUT: local =
            ``from``, remote = ``to``.
    """

    context: str
    scope: str
    cfg: int
    operation: str
    op: str
    local_mem: str
    remote_mem: str
    header: str
    rows: list[ProtoRow] = field(default_factory=list)

    @property
    def gpu(self) -> bool:
        return any(m.startswith(("cuda", "rocm")) for m in (self.local_mem, self.remote_mem))

    def row_for(self, size: int) -> ProtoRow | None:
        """The row whose size range holds ``size`` bytes."""
        for r in self.rows:
            if r.lo <= size <= r.hi:
                return r
        return None


_PREFIX = re.compile(r"^[^|+]*?(?=[|+])")  # "[1767930429.284906] [host:13245:0]   " before the table
_HEADER_CFG = re.compile(r"^(?:(?P<ctx>\S+)\s+)?(?:(?P<scope>intra-node|inter-node|self)\s+)?cfg#(?P<cfg>\d+)$")
_MEM = r"(host memory|host|[a-z\-]+/[A-Za-z0-9_\[\]]+|cuda-managed|cuda|rocm)"


def _mem_kind(token: str) -> str:
    t = token.strip().lower()
    if t.startswith("host"):
        return "host"
    return t.split("/")[0]


def _op_kind(operation: str) -> str:
    o = operation.lower()
    for needle, kind in (("ucp_get", "get"), ("ucp_put", "put"), ("ucp_tag", "tag"), ("ucp_am", "am"),
                         ("atomic", "amo"), ("rendezvous", "rndv")):
        if needle in o:
            return kind
    return ""


def _split_operation(text: str) -> tuple[str, str, str, str]:
    """``(operation, op, local_mem, remote_mem)`` of a table header's second cell."""
    m = re.search(r"\s(?:from|into|to)\s", " " + text)
    operation = text[:m.start() - 1].strip() if m else text.strip()
    mems = {k: _mem_kind(v) for k, v in re.findall(r"\b(from|into|to)\s+" + _MEM, text)}
    op = _op_kind(operation)
    if op == "get":
        local, remote = mems.get("into", ""), mems.get("from", "")
    else:
        local, remote = mems.get("from", ""), mems.get("to", "")
    return operation, op, local, remote


def _cells(line: str) -> list[str] | None:
    """The cells of a ``| a | b | c |`` line (prefix stripped), else None."""
    s = _PREFIX.sub("", line.rstrip(), count=1).strip()
    if not s.startswith("|") or not s.endswith("|"):
        return None
    return [c.strip() for c in s[1:-1].split("|")]


def parse_proto_info(text: str) -> list[ProtoTable]:
    """Every UCX protocol table in ``text`` (a log with any other lines mixed in).

    A table starts at its header: context, scope and ``cfg#N`` then the
    operation, either in one two-cell row (``| ctx intra-node cfg#2 | remote
    memory read by ... |``) or, as the UCX bundled with NIXL 1.5 prints it,
    in two one-cell rows. Each following row of three or more cells with a
    size range in its first cell is one :class:`ProtoRow` (the ``Range |
    Description | Config`` title row is not). Lines that match nothing are
    skipped, so a daemon's whole log can be passed.
    """
    tables: list[ProtoTable] = []
    cur: ProtoTable | None = None
    pending = None  # a one-cell "ctx scope cfg#N" row waiting for its operation row

    def start(m, operation_text: str) -> ProtoTable:
        operation, op, local, remote = _split_operation(operation_text)
        t = ProtoTable(m.group("ctx") or "", m.group("scope") or "", int(m.group("cfg")), operation, op,
                       local, remote, operation_text)
        tables.append(t)
        return t

    for line in text.splitlines():
        cells = _cells(line)
        if cells is None:
            continue
        if len(cells) == 1:
            m = _HEADER_CFG.match(cells[0])
            if m:
                pending = m
            elif pending is not None:
                cur, pending = start(pending, cells[0]), None
            continue
        pending = None
        if len(cells) == 2:
            m = _HEADER_CFG.match(cells[0])
            if m:
                cur = start(m, cells[1])
                continue
        if cur is not None and len(cells) >= 3:
            try:
                lo, hi = parse_range(cells[0])
            except ValueError:
                continue
            cur.rows.append(ProtoRow(lo, hi, cells[1], " ".join(cells[2:]).strip()))
    return tables


_RDMA = ("rc", "dc", "ud", "gga", "srd", "ib", "roce")
_IPC = ("cuda_ipc", "rocm_ipc", "ze_ipc")
_DEVICE_COPY = ("cuda_copy", "rocm_copy", "gdr_copy", "ze_copy")
_HOST_TL = ("cma", "xpmem", "knem", "posix", "sysv", "self", "tcp", "mm")


def classify_row(protocol: str, lane: str, gpu: bool) -> Path:
    """The path of one protocol row: ``protocol`` and ``lane`` as in
    :class:`ProtoRow`; ``gpu`` = either side is GPU memory."""
    p, tl = protocol.lower(), lane.lower()
    if "emulation" in p:
        return Path.EMULATED
    if not gpu:
        return Path.HOST
    if any(w in p for w in ("pipeline", "ppln", "staged", "bounce")) or tl.startswith(_DEVICE_COPY):
        return Path.HOST_STAGED
    if "zero-copy" in p or "zcopy" in p:
        if tl.startswith(_IPC):
            return Path.CUDA_IPC
        if tl.startswith(_RDMA):
            return Path.GPU_RDMA
        if tl.startswith(_HOST_TL):
            return Path.HOST_STAGED
        return Path.UNKNOWN
    if any(w in p for w in ("copy", "short", "bcopy", "frag")):
        return Path.HOST_STAGED
    return Path.UNKNOWN


def classify_table(table: ProtoTable, size: int) -> Evidence | None:
    """Evidence for a message of ``size`` bytes under ``table`` (None: no row holds it)."""
    row = table.row_for(size)
    if row is None:
        return None
    path = classify_row(row.protocol, row.lane, table.gpu)
    scope = f" {table.scope}" if table.scope else ""
    return Evidence("ucx_proto_info", path,
                    f"{table.operation}{scope} cfg#{table.cfg} {table.local_mem or '?'}<-{table.remote_mem or '?'} "
                    f"@{size} B: {row.protocol} | {row.transport}")


def proto_evidence(text: str, size: int, op: str = "get", gpu_only: bool = True,
                   both_gpu: bool = False) -> list[Evidence]:
    """Evidence from every table in ``text`` for ``op`` (``"get"``: pull
    mode's READ; ``"put"``: push mode's WRITE) at ``size`` bytes (a
    descriptor's length: the block length). ``gpu_only`` skips host-memory tables;
    an endpoint to the agent itself (scope ``self``) is always skipped.
    ``both_gpu`` keeps only tables with GPU memory on both sides: a daemon's
    warm-up WRITEs between DRAM scratch pages and a VRAM worker's tables
    (``host<-cuda``: software emulation on an H200) say nothing of its
    VRAM-to-VRAM lane."""
    out = []
    for t in parse_proto_info(text):
        # "self": an agent's endpoint to itself (seen on an H200: a prefill daemon's push tables
        # "self cfg#1 ... host<-cuda: software emulation | tcp/lo" beside 455 GB/s of cuda_ipc
        # WRITEs to its peer): it says nothing about the lane to a peer.
        if t.op != op or (gpu_only and not t.gpu) or t.scope == "self":
            continue
        if both_gpu and not all(m.startswith(("cuda", "rocm")) for m in (t.local_mem, t.remote_mem)):
            continue
        e = classify_table(t, size)
        if e is not None:
            out.append(e)
    return out


def parse_lanes(line: str) -> dict[str, list[str]]:
    """UCX's endpoint summary (``ucp_worker.c ... intra-node cfg#2 rma_bw(cuda_ipc/cuda rc_mlx5/mlx5_0:1)
    am(tcp/eth1) ka(tcp/eth1)``) as ``{"rma_bw": ["cuda_ipc/cuda", "rc_mlx5/mlx5_0:1"], ...}``."""
    return {k: v.split() for k, v in re.findall(r"\b([a-z_]+)\(([^()]*)\)", line)}


# ----------------------------------------------------------------- bandwidth
#: A transfer at or above this fraction of the reference copy is zero-copy.
ZERO_COPY_MIN_RATIO = 0.25
#: Below this fraction it is software emulation (TCP: ~0.3 GB/s against ~200+ GB/s).
EMULATED_MAX_RATIO = 0.01


def bandwidth_evidence(gbps: float, reference_gbps: float, memory: str = "VRAM") -> Evidence:
    """A measured transfer rate against the device-to-device copy rate of the
    same pair of devices (both in GB/s of payload).

    Thresholds: >= :data:`ZERO_COPY_MIN_RATIO` zero-copy; below
    :data:`EMULATED_MAX_RATIO` emulated; in between host-staged (PCIe bounce:
    ~50 GB/s against ~2000 GB/s HBM is ~0.025). Heuristics: the proto info and
    reexport evidence outrank this one.
    """
    if reference_gbps <= 0 or gbps < 0:
        return Evidence("bandwidth", Path.UNKNOWN, f"{gbps:.1f} GB/s, no reference")
    ratio = gbps / reference_gbps
    detail = f"{gbps:.1f} GB/s = {ratio:.3f} of {reference_gbps:.1f} GB/s reference"
    if memory != "VRAM":
        return Evidence("bandwidth", Path.HOST, detail)
    if ratio >= ZERO_COPY_MIN_RATIO:
        return Evidence("bandwidth", Path.ZERO_COPY, detail)
    if ratio < EMULATED_MAX_RATIO:
        return Evidence("bandwidth", Path.EMULATED, detail)
    return Evidence("bandwidth", Path.HOST_STAGED, detail)


# -------------------------------------------------------------- NIXL backend
def backend_evidence(backend: str) -> Evidence:
    """``nixl_agent.query_xfer_backend(handle)``: the NIXL backend of a transfer.

    ``UCX`` hides its lane (cuda_ipc, rc, tcp ...), so this alone is
    ``unknown``: pair it with proto info or bandwidth.
    """
    b = (backend or "").strip()
    if not b:
        return Evidence("nixl_backend", Path.UNKNOWN, "no backend reported")
    return Evidence("nixl_backend", Path.UNKNOWN,
                    f"NIXL backend {b}: lane not visible through NIXL (use UCX_PROTO_INFO=y or a probe)")
