#!/usr/bin/env python3
"""Device check: VRAM -> VRAM through two kvd daemons on one GPU.

Two engine processes (prefill P, decode D) on the same GPU, each with its own
kvd daemon (``python -m kvd.cli serve``), as on a P/D node. For each block
size (default 4 MiB, 1 MiB, 256 KiB, 64 KiB) and each data path (``nixl``: the
in-process baseline, ``direct``, ``staged``, ``auto``, ``local``: both engines
on P's daemon, which copies the blocks itself):

1. both engines view one big ``cudaMalloc`` buffer as a vLLM FlashAttention
   KV cache ``[2, num_blocks, block_tokens, 8 heads, 128] bf16`` (block =
   ``block_tokens x 2 KiB`` per K or V region), export it through
   the connector's registration path (``kvd.shim.memory.auto`` picks
   ``kvd.shim.memory.cuda_ipc``: torch ``_share_cuda_`` -> CUDA IPC handle)
   and register it with their daemon under that ``data_path``;
2. P fills its blocks with a pattern; D holds zeros. P holds ``inflight``
   requests of ``bytes_per_load`` each, D loads them all at once (NIXL READs
   between the daemons), the staged path adding P's copy-in and D's copy-out
   (``kvd.shim.memory.staged.StagingMirror``, the connector's own);
3. D compares every byte it received with the pattern (first repetition),
   then ``reps`` timed repetitions follow;
4. D times a ``cudaMemcpy`` device-to-device copy of the same number of bytes
   (``torch`` ``copy_`` of contiguous same-device tensors) in the same run;
5. the decode daemon's log (``UCX_PROTO_INFO=y``) is classified per case by
   ``kvd.core.path_select``: which UCX lane moved the bytes.

GB/s are payload bytes / seconds, 1 GB = 1e9 B (a D2D copy reads and writes
each byte: the copy engine moves twice this figure). "transfer" is from the
first LoadBlocks sent to the last RecvDone seen by D; "end to end" adds the
staged path's copies. Ratio = end-to-end / D2D. The goal: >= 0.8 for
the best path at blocks >= 1 MiB.

``--cpu`` (alias ``--dry-run``) runs the same flow on DRAM (POSIX shm
through ``kvd.shim.memory.shm``, mirrors in shm, a CPU memcpy as the
reference) so the script is proven without device time; CI runs it
(tests/test_gpu_check.py).

Results: ``gpu_check.json`` and ``gpu_check.md`` in ``--out`` (default
``$OUT`` when set, else ``./gpu_check_out``), written after every case (a
timeout still leaves what was measured), plus the tails of both daemons'
logs. Budget: cases that would start after ``--budget-s`` are skipped
(default 330 s: the whole run stays under 8 minutes on one H200).

The engine processes' side is ``benchmarks/gpu_check_engine.py``.

Run on the device (see docs/GPU.md for the environment)::

    python3 benchmarks/gpu_check.py --out "$OUT"
    python3 benchmarks/gpu_check.py --cpu --out /tmp/gpu-check   # anywhere
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpu_check_engine import TOKEN_BYTES, EngineProc  # noqa: E402  (benchmarks/ is sys.path[0])


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# =================================================================== daemons
class Daemon:
    def __init__(self, workdir: Path, name: str, env: dict, python: str):
        self.name = name
        self.socket = str(workdir / f"{name}.sock")
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        cmd = [python, "-m", "kvd.cli", "serve", "--engine-socket", self.socket, "--peer-listen", "127.0.0.1:0",
               "--transfer-timeout-s", "300", "--lease-s", "600", "--log-level", "info"]
        self.proc = subprocess.Popen(cmd, cwd=str(ROOT), stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **env}, start_new_session=True)
        self.peer_address = ""

    def wait_ready(self, timeout_s: float = 60) -> None:
        import grpc

        from kvd.v1 import kvd_pb2 as pb
        from kvd.v1 import kvd_pb2_grpc as pb_grpc

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon {self.name} exited {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            if os.path.exists(self.socket):
                try:
                    ch = grpc.insecure_channel(f"unix:{self.socket}")
                    st = pb_grpc.EngineServiceStub(ch).GetStats(pb.StatsRequest(), timeout=5)
                    ch.close()
                    self.peer_address = st.peer_address
                    self.versions = dict(st.versions)
                    return
                except grpc.RpcError:
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"daemon {self.name} not serving after {timeout_s} s:\n{self.log_text()[-4000:]}")

    def log_size(self) -> int:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.stat().st_size

    def log_text(self, start: int = 0) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            f.seek(start)
            return f.read().decode("utf-8", "replace")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


# ============================================================== orchestration
def gpu_missing() -> str:
    """Why this environment cannot run the GPU check (before any daemon or
    engine starts), or "": a torch without CUDA (scripts/setup.sh builds the
    CPU test environment), no visible device."""
    import torch

    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU build; install a CUDA build of torch and nixl's CUDA plugin "
                "(nixl-cu12 or nixl-cu13, as torch's CUDA) into this environment, with kvd (pip install -e .)")
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (driver, CUDA_VISIBLE_DEVICES)"
    return ""


def preflight(args) -> dict:
    """What runs where: versions, the GPU, the CUDA runtime as the daemon sees it."""
    out = {"python": platform.python_version(), "platform": platform.platform(), "mode": args.mode}
    try:
        from importlib.metadata import version

        for pkg in ("nixl", "grpcio", "protobuf", "torch"):
            try:
                out[pkg] = version(pkg)
            except Exception:
                out[pkg] = ""
    except Exception:
        pass
    if args.mode == "gpu":
        from kvd import cudart

        ok, why = cudart.available()
        out["cudart"] = why
        if ok:
            rt = cudart.load()
            out["cuda_runtime_driver"] = rt.versions()
            out["pci_bus_id"] = rt.pci_bus_id(args.device)
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = r.stdout.strip() or r.stderr.strip()
    except (OSError, subprocess.SubprocessError) as e:
        out["nvidia_smi"] = f"unavailable: {e}"
    return out


def case_plan(size: int, args) -> dict:
    """Blocks per load, loads in flight, blocks per engine for one block size."""
    if size % TOKEN_BYTES:
        raise ValueError(f"block size {size} is not a multiple of {TOKEN_BYTES} B (one token of one region)")
    n = max(1, args.bytes_per_load // (2 * size))  # 2 regions (K and V) per block id
    k = args.inflight
    return {"block_tokens": size // TOKEN_BYTES, "blocks_per_load": n, "inflight": k,
            "num_blocks": k * n + 1, "bytes_per_load": 2 * n * size}


def run_case(size: int, path: str, P: EngineProc, D: EngineProc, dp: Daemon, dd: Daemon, args, d2d: dict) -> dict:
    from kvd.core import path_select

    plan = case_plan(size, args)
    tag = f"{size // 1024}k-{path}"
    case = {"block_bytes": size, "path": path, **plan}
    marks = (dp.log_size(), dd.log_size(), D.log_size())
    seed = 1000 + size // 1024
    inproc = path == "nixl"  # the baseline: each engine's own NIXL agent, no daemon, no IPC handle
    # "local": both engines registered with P's daemon (auto), which copies
    # the blocks itself (kvd.core.local_copy), no NIXL between them.
    local = path == "local"
    setup = "nixl_setup" if inproc else "setup"
    extra = {} if inproc else {"data_path": "auto" if local else path}
    rp = P.call(setup, engine_id=f"P-{tag}", block_tokens=plan["block_tokens"], num_blocks=plan["num_blocks"],
                seed=seed, **extra, **({} if inproc else {"socket": dp.socket}))
    rd = D.call(setup, engine_id=f"D-{tag}", block_tokens=plan["block_tokens"], num_blocks=plan["num_blocks"],
                seed=None, **extra, **({} if inproc else {"socket": dp.socket if local else dd.socket}))
    peer = {"metadata": rp.pop("metadata"), "base": rp["base"]} if inproc else None
    rd.pop("metadata", None)
    case["registered"] = {"prefill": rp, "decode": rd}
    try:
        rng = random.Random(size * 7 + len(path))
        nb, n, k = plan["num_blocks"], plan["blocks_per_load"], plan["inflight"]
        src, dst = rng.sample(range(nb), k * n), rng.sample(range(nb), k * n)

        def one_rep(r: int, loads_k: int) -> dict:
            loads = [{"req": f"{tag}-r{r}-{i}", "remote_req": f"p-{tag}-r{r}-{i}", "local": dst[i * n:(i + 1) * n],
                      "remote": src[i * n:(i + 1) * n]} for i in range(loads_k)]
            if inproc:
                h, sent = {"copy_in_s": 0.0}, {"send_done": loads_k, "note": "no leases: in-process NIXL"}
                t = D.call("nixl_transfer", wait_s=args.transfer_timeout_s + 60, timeout_s=args.transfer_timeout_s,
                           loads=loads, remote_num_blocks=nb, **peer)
            else:
                h = P.call("hold", holds=[{"req": ld["remote_req"], "ids": ld["remote"]} for ld in loads])
                t = D.call("transfer", wait_s=args.transfer_timeout_s + 60, timeout_s=args.transfer_timeout_s,
                           loads=loads, remote_engine=f"P-{tag}", remote_address=dp.peer_address)
                sent = P.call("wait_sent", wait_s=90, reqs=[ld["remote_req"] for ld in loads], timeout_s=30)
            moved = loads_k * plan["bytes_per_load"]
            total = h["copy_in_s"] + t["wall_s"] + t["copy_out_s"]
            return {"loads": loads_k, "bytes": moved, "daemon_bytes": t["bytes"], "failed": t["failed"],
                    "copy_in_s": h["copy_in_s"], "transfer_s": t["wall_s"], "copy_out_s": t["copy_out_s"],
                    "daemon_s_max": max(t["daemon_s"], default=0.0), "total_s": total,
                    "transfer_gbps": moved / t["wall_s"] / 1e9 if t["wall_s"] > 0 else 0.0,
                    "e2e_gbps": moved / total / 1e9 if total > 0 else 0.0, "send_done": sent, "_loads": loads}

        # Repetition 0: one load, every byte compared. It also sizes the rest: a
        # slow path (UCX emulation runs at ~0.3 GB/s) gets 1 timed load, not
        # inflight x reps, so that the whole run stays inside its budget.
        D.call("zero")
        first = one_rep(0, 1)
        loads = first.pop("_loads")
        v = D.call("verify", loads=loads, remote_num_blocks=nb, seed=seed, wait_s=600) if not first["failed"] \
            else {"ok": False, "bytes_checked": 0, "bad_blocks": -1}
        case["verify"] = v
        case["reps"] = [first]
        reps, loads_k = args.reps, k
        if first["total_s"] * k > args.slow_rep_s:
            reps, loads_k = 1, 1
            case["note"] = (f"one load took {first['total_s']:.2f} s: 1 timed repetition of 1 load "
                            f"instead of {args.reps} of {k}")
        for r in range(1, reps + 1):
            rep = one_rep(r, loads_k)
            rep.pop("_loads")
            case["reps"].append(rep)
        timed = [x for x in case["reps"][1:] if not x["failed"]] or [x for x in case["reps"] if not x["failed"]]
        if timed:
            case["transfer_gbps"] = statistics.median(x["transfer_gbps"] for x in timed)
            case["e2e_gbps"] = statistics.median(x["e2e_gbps"] for x in timed)
            ref = d2d.get("contig_gbps", 0.0)
            case["ratio_to_d2d"] = case["e2e_gbps"] / ref if ref else None
            case["bandwidth_path"] = path_select.bandwidth_evidence(
                case["transfer_gbps"], ref, "VRAM" if args.mode == "gpu" else "DRAM").path.value
        case["ok"] = bool(v.get("ok")) and all(not x["failed"] for x in case["reps"])
    finally:
        for e in (D, P):  # the reader first: it holds the peer's agent loaded
            try:
                e.call("nixl_teardown" if inproc else "teardown", wait_s=120)
            except Exception as ex:
                case.setdefault("errors", []).append(f"teardown {e.name}: {ex}")
    # The reader's UCX prints the table: the decode daemon, or the decode engine itself in-process.
    dlog, plog = (D.log_text(marks[2]), "") if inproc else (dd.log_text(marks[1]), dp.log_text(marks[0]))
    # Push mode (KVD_TRANSFER_MODE=push): the prefill daemon WRITEs, and its UCX prints the table.
    push = not inproc and os.environ.get("KVD_TRANSFER_MODE", "").strip().lower() == "push"
    ev = [] if local else path_select.proto_evidence(plog if push else dlog, size, op="put" if push else "get",
                                                     gpu_only=args.mode == "gpu", both_gpu=args.mode == "gpu")
    case["ucx_proto_info"] = [{"path": e.path.value, "detail": e.detail} for e in ev]
    case["ucx_path"] = path_select.worst(ev).value if ev else "not printed"
    if local:
        # The prefill daemon logs the pair's plan when it copies itself.
        case["same_node_copy"] = f"engine=P-{tag}" in plog and "same-node copy plan" in plog
        case["ucx_path"] = "none: same-node copy" if case["same_node_copy"] else "NOT a same-node copy"
        case["ok"] = case.get("ok", False) and case["same_node_copy"]
    case["daemon_choice"] = [line.split(" data path ", 1)[-1].strip() for line in (plog + dlog).splitlines()
                             if "data path (" in line][:2]
    return case


def short_error(e: Exception) -> str:
    """One line for a failed case: the gRPC status and details when an
    engine's call to its daemon failed (the engine process sends back the
    whole repr), else the first line."""
    text = str(e)
    code = re.search(r"status = StatusCode\.(\w+)", text)
    details = re.search(r'details = "(.*?)"\n', text)
    if code and details:
        return f"{code.group(1)}: {details.group(1)}"
    return text.split("\n")[0]


def fmt(x, digits=1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def goals(results: dict) -> list[str]:
    """The device goals, judged per block size >= 1 MiB on verified cases:
    the best kvd path >= 0.8 of the D2D copy and >= 0.95 of in-process NIXL
    on the same blocks; the staged path >= 0.4 of D2D."""
    if results["meta"]["mode"] != "gpu":
        return ["CPU dry run: DRAM through POSIX shm, a CPU memcpy as the reference; the goals "
                "(best kvd path >= 0.8 of D2D and >= 0.95 of in-process NIXL, staged >= 0.4 of D2D, at blocks "
                ">= 1 MiB) apply to the GPU run."]
    out = []
    big = [c for c in results["cases"] if c["block_bytes"] >= 1 << 20 and c.get("ok") and c.get("ratio_to_d2d")]
    for size in sorted({c["block_bytes"] for c in big}, reverse=True):
        kvd = [c for c in big if c["block_bytes"] == size and c["path"] != "nixl"]
        if not kvd:
            continue
        top = max(kvd, key=lambda c: c["ratio_to_d2d"])
        ok1 = top["ratio_to_d2d"] >= 0.8
        ok2 = top.get("of_nixl") is not None and top["of_nixl"] >= 0.95
        st = [c for c in kvd if c["path"] == "staged"]
        ok3 = bool(st) and st[0]["ratio_to_d2d"] >= 0.4
        out.append(f"- {human(size)}: best kvd path {top['path']} {top['ratio_to_d2d']:.2f} of D2D "
                   f"({'met' if ok1 else 'NOT met'}, goal 0.8), {fmt(top.get('of_nixl'), 2)} of in-process NIXL "
                   f"({'met' if ok2 else 'NOT met'}, goal 0.95); staged "
                   f"{fmt(st[0]['ratio_to_d2d'] if st else None, 2)} of D2D ({'met' if ok3 else 'NOT met'}, goal 0.4)")
    return ["Goals at blocks >= 1 MiB:", ""] + (out or ["- no verified case >= 1 MiB"])


def write_reports(out: Path, results: dict) -> None:
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    pre = results.get("preflight", {})
    lines = [
        f"# kvd GPU check ({results['meta']['mode']} mode)", "",
        f"- date: {results['meta']['date']}, elapsed {results['meta'].get('elapsed_s', 0):.0f} s",
        f"- machine: {pre.get('nvidia_smi', '-')}",
        f"- python {pre.get('python')}, torch {pre.get('torch')}, nixl {pre.get('nixl')}, "
        f"CUDA runtime/driver {pre.get('cuda_runtime_driver', '-')}",
        f"- settings: {results['meta']['settings']}",
    ]
    st = results.get("ipc_selftest")
    if st:
        lines.append(f"- CUDA IPC between two processes: bytes equal {st.get('bytes_equal')}; {st.get('reexport')}; "
                     f"IS_LEGACY_CUDA_IPC_CAPABLE of the imported mapping {st.get('legacy_ipc_capable')}")
    lines += ["", "| block | path | registered P / D | bytes verified | loads x bytes | transfer GB/s | "
                  "end-to-end GB/s | D2D GB/s | ratio | of in-process NIXL | UCX lane (proto info) | by bandwidth |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {c["block_bytes"]: c.get("e2e_gbps") for c in results["cases"] if c["path"] == "nixl" and c.get("ok")}
    for c in results["cases"]:
        c["of_nixl"] = c["e2e_gbps"] / base[c["block_bytes"]] if base.get(c["block_bytes"]) and c.get("e2e_gbps") \
            else None
        d2d = results["d2d"].get(str(c["block_bytes"]), {})
        reg = c.get("registered", {})
        path_pd = "/".join(reg.get(r, {}).get("data_path", "?") for r in ("prefill", "decode")) if reg else \
            ("refused" if "INVALID_ARGUMENT" in c.get("error", "") else "failed")
        ver = c.get("verify", {})
        verified = f"{human(ver['bytes_checked'])} {'ok' if ver.get('ok') else 'MISMATCH'}" if ver else "-"
        lines.append(
            f"| {human(c['block_bytes'])} | {c['path']} | {path_pd} | {verified} | "
            f"{c.get('inflight')} x {human(c.get('bytes_per_load', 0))} | {fmt(c.get('transfer_gbps'))} | "
            f"{fmt(c.get('e2e_gbps'))} | {fmt(d2d.get('contig_gbps'))} | {fmt(c.get('ratio_to_d2d'), 2)} | "
            f"{fmt(c.get('of_nixl'), 2)} | "
            f"{c.get('ucx_path', '-')} | {c.get('bandwidth_path', '-')} |")
    for c in results["cases"]:
        for key in ("error", "note"):
            if c.get(key):
                lines.append(f"\n{human(c['block_bytes'])} {c['path']}: {key}: {c[key]}")
    lines += [""] + goals(results)
    ref = "cudaMemcpy D2D (torch copy_)" if results["meta"]["mode"] == "gpu" else "memcpy (torch copy_ on the CPU)"
    lines += ["", f"Reference per block size (the bytes of one repetition, up to 2 GiB; medians of 10): contiguous "
                  f"{ref}, and block-wise index_select/index_copy_ (what the staged path's copies do):", ""]
    for k, d in results["d2d"].items():
        rows = ""
        if "kernel_gbps" in d or "kernel_error" in d or "batch_gbps" in d:
            rows = (f"; as the daemon's same-node copy (kvd.cuda_copy): kernel {fmt(d.get('kernel_gbps'))} GB/s "
                    f"(bytes {'equal' if d.get('kernel_ok') else 'NOT equal'}), cudaMemcpyBatchAsync "
                    f"{fmt(d.get('batch_gbps'))} GB/s (bytes {'equal' if d.get('batch_ok') else 'NOT equal'})")
            for key in ("kernel_error", "batch_error", "kernel_why_not"):
                if d.get(key):
                    rows += f"; {key}: {d[key]}"
        lines.append(f"- {human(int(k))}: contiguous {fmt(d.get('contig_gbps'))} GB/s, block-wise "
                     f"{fmt(d.get('gather_gbps'))} GB/s over {human(d.get('bytes', 0))}{rows}")
    sweeps = {k: d["sweep"] for k, d in results["d2d"].items() if d.get("sweep")}
    if sweeps:
        names = list(next(iter(sweeps.values())))
        lines += ["", "Row copies of the same blocks in one process (GB/s; `kernel`: kvd.cuda_copy's default shape, "
                      "`batch`: cudaMemcpyBatchAsync, the rest: other kernel shapes; `!` bytes not equal, `x` failed):",
                  "", "| block | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for k, sw in sweeps.items():
            cells = [("x" if "error" in sw.get(nm, {}) else fmt(sw.get(nm, {}).get("gbps"), 0) +
                      ("" if sw.get(nm, {}).get("ok", True) else "!")) for nm in names]
            lines.append(f"| {human(int(k))} | " + " | ".join(cells) + " |")
    for c in results["cases"]:
        for e in c.get("ucx_proto_info", [])[:3]:
            lines.append(f"- UCX {human(c['block_bytes'])} {c['path']}: {e['path']}: {e['detail']}")
        for ch in c.get("daemon_choice", []):
            lines.append(f"- daemon {human(c['block_bytes'])} {c['path']}: {ch}")
    if results.get("errors"):
        lines += ["", "Errors:", ""] + [f"- {e}" for e in results["errors"]]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cpu", "--dry-run", dest="cpu", action="store_true",
                    help="run the same flow on DRAM (no GPU needed)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="results folder")
    ap.add_argument("--sizes", default=None, help="block sizes, run in this order (default GPU 4M,1M,256K,64K; "
                                                   "CPU 1M,64K)")
    ap.add_argument("--paths", default="nixl,direct,staged,auto,local",
                    help="data paths to run (default all five; nixl: the in-process baseline, each engine's own "
                         "NIXL agent, no daemon; local: both engines on one daemon (auto), which copies the "
                         "blocks itself)")
    ap.add_argument("--bytes-per-load", default=None, help="bytes of one load (default GPU 4G, CPU 4M): at HBM speed a "
                    "1 GiB load moves in ~0.5 ms, less than a load's control-plane cost")
    ap.add_argument("--inflight", type=int, default=None, help="loads in flight per repetition (GPU 4, CPU 2)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions after the verified one (GPU 3, CPU 1)")
    ap.add_argument("--device", type=int, default=0, help="CUDA device of both engines and daemons")
    ap.add_argument("--budget-s", type=float, default=330.0, help="start no case after this many seconds")
    ap.add_argument("--slow-rep-s", type=float, default=3.0, help="a first repetition slower than this shrinks the case")
    ap.add_argument("--transfer-timeout-s", type=float, default=120.0)
    ap.add_argument("--no-proto-info", action="store_true", help="do not set UCX_PROTO_INFO=y for the daemons")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the daemons")
    args = ap.parse_args(argv)
    args.mode = "cpu" if args.cpu else "gpu"
    gpu = args.mode == "gpu"
    # Largest first: the goal is judged at >= 1 MiB, and a slow path costs most at small blocks.
    args.sizes = [parse_size(s) for s in (args.sizes or ("4M,1M,256K,64K" if gpu else "1M,64K")).split(",")]
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    args.bytes_per_load = parse_size(args.bytes_per_load or ("4G" if gpu else "4M"))
    args.inflight = args.inflight or (4 if gpu else 2)
    args.reps = args.reps if args.reps is not None else (3 if gpu else 1)
    bad = [p for p in args.paths if p not in ("nixl", "direct", "staged", "auto", "local")]
    if bad:
        ap.error(f"unknown data path(s) {bad}")
    if gpu:
        missing = gpu_missing()
        if missing:
            print(f"gpu_check: {missing}; --cpu runs the same flow on DRAM", file=sys.stderr)
            return 2

    t_start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"meta": {"mode": args.mode, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                        "settings": {k: v for k, v in vars(args).items() if k not in ("python", "out")}},
               "preflight": {}, "cases": [], "d2d": {}, "errors": []}
    daemons: list[Daemon] = []
    engines: list[EngineProc] = []
    workdir = Path(tempfile.mkdtemp(prefix="kvd-gpu-check-"))
    try:
        results["preflight"] = preflight(args)
        print(json.dumps(results["preflight"], indent=1), flush=True)
        env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        if not args.no_proto_info:
            env["UCX_PROTO_INFO"] = "y"
            os.environ["UCX_PROTO_INFO"] = "y"  # the engines' own agents too (the in-process baseline)
        daemons = [Daemon(workdir, "prefill", env, args.python), Daemon(workdir, "decode", env, args.python)]
        for d in daemons:
            d.wait_ready()
        dp, dd = daemons
        results["preflight"]["kvd_versions"] = dd.versions
        need = max(case_plan(s, args)["num_blocks"] * 2 * s for s in args.sizes)
        ctx = mp.get_context("spawn")
        P = EngineProc(ctx, {"mode": args.mode, "socket": dp.socket, "device": args.device, "buffer_bytes": need,
                             "role": "prefill", "log": str(workdir / "prefill_engine.log")}, "prefill")
        engines.append(P)
        D = EngineProc(ctx, {"mode": args.mode, "socket": dd.socket, "device": args.device, "buffer_bytes": need,
                             "role": "decode", "log": str(workdir / "decode_engine.log")}, "decode")
        engines.append(D)
        results["preflight"]["engine"] = D.call("info")
        if gpu:
            try:
                exp = P.call("ipc_export")
                results["ipc_selftest"] = D.call("ipc_import", **exp)
            except Exception as e:
                results["ipc_selftest"] = {"error": str(e).split("\n")[0]}
                results["errors"].append(f"CUDA IPC self-test: {str(e).splitlines()[0]}")
        write_reports(out, results)
        for size in args.sizes:
            if time.monotonic() - t_start > args.budget_s:
                results["errors"].append(f"{human(size)}: skipped, past the {args.budget_s:.0f} s budget")
                continue
            plan = case_plan(size, args)
            try:
                results["d2d"][str(size)] = D.call("d2d", nbytes=min(plan["inflight"] * plan["bytes_per_load"],
                                                                    2 << 30), block_len=size, reps=10)
            except Exception as e:
                results["errors"].append(f"D2D {human(size)}: {str(e).splitlines()[0]}")
            for path in args.paths:
                if time.monotonic() - t_start > args.budget_s:
                    results["errors"].append(f"{human(size)} {path}: skipped, past the {args.budget_s:.0f} s budget")
                    continue
                t0 = time.monotonic()
                try:
                    case = run_case(size, path, P, D, dp, dd, args, results["d2d"].get(str(size), {}))
                except Exception as e:
                    case = {"block_bytes": size, "path": path, "ok": False, "error": short_error(e),
                            "trace": str(e)}
                    results["errors"].append(f"{human(size)} {path}: {short_error(e)}")
                    if isinstance(e, TimeoutError):
                        raise
                case["elapsed_s"] = time.monotonic() - t0
                results["cases"].append(case)
                print(f"{human(size):>8} {path:>6}: ok={case.get('ok')} transfer={fmt(case.get('transfer_gbps'))} "
                      f"e2e={fmt(case.get('e2e_gbps'))} GB/s ucx={case.get('ucx_path')} ({case['elapsed_s']:.1f} s)",
                      flush=True)
                results["meta"]["elapsed_s"] = time.monotonic() - t_start
                write_reports(out, results)
    except Exception as e:
        results["errors"].append(f"{type(e).__name__}: {e}")
        traceback.print_exc()
    finally:
        for e in engines:
            e.stop()
            (out / f"{e.name}_engine.log").write_text(e.log_text()[-(1 << 20):])
        for d in daemons:
            rc = d.stop()
            if rc not in (0, None):
                results["errors"].append(f"daemon {d.name} exited {rc}")
            tail = d.log_text()[-(1 << 20):]
            (out / f"{d.name}_daemon.log").write_text(tail)
        shutil.rmtree(workdir, ignore_errors=True)  # its logs are copied to --out above
        results["meta"]["elapsed_s"] = time.monotonic() - t_start
        write_reports(out, results)
    ok = bool(results["cases"]) and all(c.get("ok") for c in results["cases"]) and not results["errors"]
    print(f"results: {out / 'gpu_check.md'} ({'all cases ok' if ok else 'see errors'})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
