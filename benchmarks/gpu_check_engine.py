"""The engine processes of the device check (``benchmarks/gpu_check.py``).

Each engine process owns one KV cache buffer (CUDA, or CPU for the dry run)
viewed as a vLLM FlashAttention cache ``[2, num_blocks, block_tokens, 8
heads, 128] bf16``, registers it with its daemon through the connector's
own sharing code (``kvd.shim.memory.auto``), and runs the commands the
orchestrator sends it over a pipe (:class:`EngineProc`): hold, transfer,
verify, reference copies, teardown.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HEADS, HEAD_DIM, ELEM = 8, 128, 2          # bf16 KV heads x head_dim
TOKEN_BYTES = HEADS * HEAD_DIM * ELEM      # bytes of one token in one region (K or V)
LAYER = "model.layers.0.self_attn.attn"


# =========================================================== engine process
class _Session:
    """A raw EngineService session stream: send commands, take events."""

    def __init__(self, stub, engine_id: str, token: str):
        import queue
        import threading

        from kvd.v1 import kvd_pb2 as pb

        self.pb = pb
        self._out: queue.Queue = queue.Queue()
        self.events: queue.Queue = queue.Queue()
        open_kw = {"worker": pb.EngineWorker(engine_id=engine_id, tp_rank=0, tp_size=1)}
        if token and "session_token" in pb.OpenSession.DESCRIPTOR.fields_by_name:
            open_kw["session_token"] = token
        self._out.put(pb.SessionCommand(open=pb.OpenSession(**open_kw)))

        def gen():
            while True:
                c = self._out.get()
                if c is None:
                    return
                yield c

        self._call = stub.Session(gen())

        def read():
            try:
                for e in self._call:
                    self.events.put(e)
            except Exception as e:  # stream ended (cancelled at close, or the daemon went away)
                self.events.put(e)

        threading.Thread(target=read, daemon=True).start()
        first = self.events.get(timeout=30)
        if isinstance(first, Exception) or first.WhichOneof("event") != "opened":
            raise RuntimeError(f"session did not open: {first}")

    def send(self, **kw) -> None:
        self._out.put(self.pb.SessionCommand(**kw))

    def next(self, timeout: float):
        return self.events.get(timeout=timeout)

    def close(self) -> None:
        self._out.put(None)
        self._call.cancel()


class Engine:
    """One engine process: a KV cache buffer, its daemon, its session."""

    def __init__(self, mode: str, socket: str, device: int, buffer_bytes: int, role: str):
        import torch

        self.torch = torch
        self._variants = {}  # kernel shapes of the row-copy sweep, loaded once
        self.mode, self.role = mode, role
        self.dev = torch.device("cuda", device) if mode == "gpu" else torch.device("cpu")
        if mode == "gpu":
            torch.cuda.set_device(self.dev)
        self.buf = torch.zeros(buffer_bytes, dtype=torch.uint8, device=self.dev)
        if mode == "cpu":
            from kvd.shim.memory import shm

            shm.share_storage(self.buf)  # into POSIX shm once; every view follows
        self._connect(socket)
        self.session = None
        self.sharing = None
        self.mirror = None
        self.engine_id = ""
        self.token = ""

    def _connect(self, socket: str) -> None:
        """Talks to the daemon at ``socket`` from now on (a same-node case
        registers the decode engine with the prefill engine's daemon)."""
        import grpc

        from kvd.v1 import kvd_pb2_grpc as pb_grpc

        self.engine_socket = socket
        self.stub = pb_grpc.EngineServiceStub(grpc.insecure_channel(
            f"unix:{socket}", options=[("grpc.max_send_message_length", 64 << 20),
                                       ("grpc.max_receive_message_length", 64 << 20)]))

    # -- pattern: int32 word i of the cache holds f(i, seed) --------------------------
    def _words(self, start_words, count: int, seed: int):
        """Pattern words for rows of ``count`` words starting at ``start_words`` (a 1-D long tensor)."""
        torch = self.torch
        idx = start_words[:, None] + torch.arange(count, dtype=torch.int64, device=self.dev)[None, :]
        return ((idx * 2654435761 + seed * 40503 + 12345) & 0x7FFFFFFF).to(torch.int32)

    def _fill(self, view, seed: int) -> None:
        torch = self.torch
        words = view.view(torch.int32).view(-1)
        chunk = 1 << 26
        for s in range(0, words.numel(), chunk):
            n = min(chunk, words.numel() - s)
            words[s:s + n] = self._words(torch.tensor([s], dtype=torch.int64, device=self.dev), n, seed)[0]

    # -- commands ----------------------------------------------------------------------
    def info(self) -> dict:
        torch = self.torch
        out = {"torch": torch.__version__, "device": str(self.dev), "pid": os.getpid()}
        if self.mode == "gpu":
            out["gpu"] = torch.cuda.get_device_name(self.dev)
            out["torch_cuda"] = torch.version.cuda
        return out

    def ipc_export(self, nbytes: int = 1 << 20) -> dict:
        """Self-test, exporter side: a pattern buffer exported as the shim exports a KV cache."""
        from kvd.shim.memory import cuda_ipc

        torch = self.torch
        self._probe = torch.arange(nbytes, dtype=torch.int64, device=self.dev).remainder(251).to(torch.uint8)
        e = cuda_ipc.export_storage(self._probe)
        return {"handle": e.handle.hex(), "offset": e.offset, "device": e.device,
                "head": bytes(self._probe[:4096].cpu().numpy()).hex()}

    def ipc_import(self, handle: str, offset: int, device: int, head: str) -> dict:
        """Self-test, importer side: open another process's handle, read, compare, close."""
        from kvd import cudart

        rt = cudart.load()
        ptr = rt.ipc_open(device, bytes.fromhex(handle))
        try:
            got = rt.read(device, ptr + offset, len(head) // 2)
            legacy = rt.legacy_ipc_capable(device, ptr)
            try:
                rt.ipc_get_handle(device, ptr)
                reexport = "cudaIpcGetMemHandle on the imported mapping works"
            except cudart.CudaError as e:
                reexport = f"cudaIpcGetMemHandle on the imported mapping fails: {e.name}"
        finally:
            rt.ipc_close(device, ptr)
        return {"bytes_equal": got.hex() == head, "reexport": reexport, "legacy_ipc_capable": legacy,
                "cudart": rt.path, "versions": rt.versions()}

    def _view(self, block_tokens: int, num_blocks: int, seed: int | None) -> int:
        """Views the buffer as the case's cache (``self.kv``), filled with the
        pattern of ``seed`` (None: zeros); returns its bytes."""
        torch = self.torch
        nbytes = 2 * num_blocks * block_tokens * TOKEN_BYTES
        if nbytes > self.buf.numel():
            raise ValueError(f"case needs {nbytes} bytes, the buffer has {self.buf.numel()}")
        self.shape = (2, num_blocks, block_tokens, HEADS, HEAD_DIM)
        self.kv = self.buf[:nbytes].view(torch.bfloat16).view(self.shape)
        self.block_words = block_tokens * TOKEN_BYTES // 4
        self.num_blocks = num_blocks
        if seed is None:
            self.buf[:nbytes].zero_()
        else:
            self._fill(self.kv, seed)
        if self.mode == "gpu":
            torch.cuda.synchronize(self.dev)
        return nbytes

    def setup(self, engine_id: str, block_tokens: int, num_blocks: int, data_path: str, seed: int | None,
              socket: str | None = None) -> dict:
        from kvd.v1 import kvd_pb2 as pb

        if socket and socket != self.engine_socket:
            self._connect(socket)

        self._view(block_tokens, num_blocks, seed)
        caches = {LAYER: self.kv}
        # The connector's own registration path: the chooser picks shm or
        # CUDA IPC by the tensors' device (kvd.shim.memory.auto), the same
        # KvSharing shares, and maps the mirrors after RegisterEngine.
        from kvd.shim.memory import auto

        self.sharing = auto.choose(caches, data_path)
        shared = self.sharing.share(caches, num_blocks=num_blocks, block_size=block_tokens, kv_layout="NHD",
                                    num_kv_heads=HEADS, head_dim=HEAD_DIM, total_kv_heads=0, groups=None)
        segments = shared.segments
        req = pb.RegisterEngineRequest(worker=pb.EngineWorker(engine_id=engine_id, tp_rank=0, tp_size=1),
                                       layout=shared.layout, segments=segments, regions=shared.regions,
                                       model="kvd-gpu-check", data_path=self.sharing.wire_data_path,
                                       owner_pid=os.getpid())
        t0 = time.perf_counter()
        self.sharing.prepare(req, self.engine_socket)  # memfds: handed over first, as the connector does
        resp = self.stub.RegisterEngine(req, timeout=300)
        register_s = time.perf_counter() - t0
        self.engine_id = engine_id
        self.token = getattr(resp, "session_token", "")
        self.staged = resp.data_path == pb.DATA_PATH_STAGED
        self.sharing.attach(resp)
        self.mirror = self.sharing.staging
        self.session = _Session(self.stub, engine_id, self.token)
        return {"data_path": "staged" if self.staged else "direct", "registered_bytes": resp.registered_bytes,
                "register_s": register_s, "peer_address": resp.peer_address,
                "staging_kinds": [pb.MemoryKind.Name(s.kind) for s in resp.staging_segments],
                "segment_bytes": [s.size for s in segments]}

    # -- the in-process baseline: one NIXL agent per engine, no daemon ------------------
    def nixl_setup(self, engine_id: str, block_tokens: int, num_blocks: int, seed: int | None) -> dict:
        """What an in-process connector (vLLM's NixlConnector) does: this
        process's own NIXL agent registers its own cache (``VRAM`` on the GPU,
        no IPC handle in between) and prepares a descriptor list of every
        block (rows: K regions then V regions, one block each). Returns the
        agent's metadata and the cache's base address for the peer."""
        from kvd.core.nixl_agent import NixlAgent

        nbytes = self._view(block_tokens, num_blocks, seed)
        self.nx_mem = "VRAM" if self.mode == "gpu" else "DRAM"
        self.nx_dev = (self.dev.index or 0) if self.mode == "gpu" else 0
        self.nx = NixlAgent(f"inproc-{engine_id}-{os.getpid()}")
        self.nx_reg = self.nx.register_memory(self.kv.data_ptr(), nbytes, self.nx_mem, self.nx_dev)
        self.nx_local = self.nx.prep_local(self._rows(self.kv.data_ptr(), num_blocks, block_tokens), self.nx_mem)
        self.nx_remote, self.nx_peer = None, None
        return {"data_path": "nixl", "metadata": self.nx.metadata(), "base": self.kv.data_ptr(),
                "registered_bytes": nbytes}

    def _rows(self, base: int, num_blocks: int, block_tokens: int):
        import numpy as np

        blen = block_tokens * TOKEN_BYTES
        addrs = base + np.arange(2 * num_blocks, dtype=np.int64) * blen
        return np.stack([addrs, np.full_like(addrs, blen), np.full_like(addrs, self.nx_dev)], axis=1)

    def nixl_transfer(self, loads: list[dict], metadata: bytes, base: int, remote_num_blocks: int,
                      timeout_s: float) -> dict:
        """Decode, in-process baseline: one READ per load (its blocks' K and V
        rows) from the peer's agent, all posted at once, polled to the end."""
        import numpy as np

        if self.nx_remote is None:
            self.nx_peer = self.nx.add_remote(metadata)
            block_tokens = self.block_words * 4 // TOKEN_BYTES
            self.nx_remote = self.nx.prep_remote(self.nx_peer, self._rows(base, remote_num_blocks, block_tokens),
                                                 self.nx_mem)

        def idx(ids, nb):
            ids = np.asarray(ids, dtype=np.int64)
            return np.concatenate([ids, ids + nb])

        t0 = time.perf_counter()
        handles = [self.nx.post("READ", self.nx_local, idx(ld["local"], self.num_blocks), self.nx_remote,
                                idx(ld["remote"], remote_num_blocks), b"")[0] for ld in loads]
        pending, failed = list(handles), []
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            still = []
            for h in pending:
                st = self.nx.state(h)
                if st == "PROC":
                    still.append(h)
                elif st != "DONE":
                    failed.append(st)
            pending = still
        wall = time.perf_counter() - t0
        failed += ["no end before the deadline"] * len(pending)
        for h in handles:
            self.nx.release(h)
        nbytes = sum(2 * len(ld["local"]) for ld in loads) * self.block_words * 4
        return {"wall_s": wall, "copy_out_s": 0.0, "daemon_s": [], "bytes": nbytes, "failed": failed}

    def nixl_teardown(self) -> dict:
        if getattr(self, "nx", None) is None:
            return {}
        for h in (self.nx_local, self.nx_remote):
            if h is not None:
                self.nx.release_dlist(h)
        if self.nx_peer:
            self.nx.remove_remote(self.nx_peer)
        self.nx.deregister(self.nx_reg)
        self.nx.close()
        self.nx = None
        return {}

    def hold(self, holds: list[dict], lease_s: float = 600.0) -> dict:
        """Prefill: (staged: copy the blocks into the mirror, then) hold every request."""
        from kvd.v1 import kvd_pb2 as pb

        copy_s = 0.0
        if self.mirror is not None:
            t0 = time.perf_counter()
            self.mirror.copy_in([[b for h in holds for b in h["ids"]]])
            copy_s = time.perf_counter() - t0
        self.sharing.sync()  # the blocks are written before the daemon may read them (the worker's rule)
        for h in holds:
            self.session.send(hold=pb.HoldBlocks(request_id=h["req"], groups=[pb.BlockIds(ids=h["ids"])],
                                                 lease_s=lease_s))
        return {"copy_in_s": copy_s}

    def wait_sent(self, reqs: list[str], timeout_s: float) -> dict:
        """Prefill: wait for ``send_done`` of ``reqs`` (every reader notified)."""
        pending, done, expired, other = set(reqs), 0, 0, []
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            try:
                ev = self.session.next(max(0.01, deadline - time.monotonic()))
            except Exception:
                break
            if isinstance(ev, Exception):
                other.append(str(ev))
                break
            kind = ev.WhichOneof("event")
            if kind == "send_done" and ev.send_done.request_id in pending:
                pending.discard(ev.send_done.request_id)
                done += 1
                expired += ev.send_done.expired
            else:
                other.append(f"{kind}: {getattr(ev, kind)}".replace("\n", " "))
        return {"send_done": done, "expired": expired, "missing": sorted(pending), "other": other[:5]}

    def transfer(self, loads: list[dict], remote_engine: str, remote_address: str, timeout_s: float) -> dict:
        """Decode: send every load at once, wait for all, (staged: copy out)."""
        from kvd.v1 import kvd_pb2 as pb

        t0 = time.perf_counter()
        for ld in loads:
            self.session.send(load=pb.LoadBlocks(
                request_id=ld["req"], local_groups=[pb.BlockIds(ids=ld["local"])], remote_engine_id=remote_engine,
                remote_address=remote_address, remote_groups=[pb.BlockIds(ids=ld["remote"])],
                remote_request_id=ld["remote_req"],
                remote_tp_size=1, timeout_s=timeout_s))
        pending = {ld["req"] for ld in loads}
        daemon_s, nbytes, failed = [], 0, []
        deadline = time.monotonic() + timeout_s + 10
        while pending and time.monotonic() < deadline:
            try:
                ev = self.session.next(max(0.01, deadline - time.monotonic()))
            except Exception:
                break
            if isinstance(ev, Exception):
                failed.append(f"session: {ev}")
                break
            kind = ev.WhichOneof("event")
            body = getattr(ev, kind)
            if body.request_id not in pending:
                continue
            pending.discard(body.request_id)
            if kind == "recv_done":
                daemon_s.append(body.duration_s)
                nbytes += body.bytes
            else:
                failed.append(f"{kind}: {getattr(body, 'reason', '')}")
        wall = time.perf_counter() - t0
        failed += [f"{r}: no answer" for r in sorted(pending)]
        copy_s = 0.0
        if self.mirror is not None and not failed:
            t1 = time.perf_counter()
            self.mirror.copy_out([[b for ld in loads for b in ld["local"]]])
            copy_s = time.perf_counter() - t1
        return {"wall_s": wall, "copy_out_s": copy_s, "daemon_s": daemon_s, "bytes": nbytes, "failed": failed}

    def verify(self, loads: list[dict], remote_num_blocks: int, seed: int) -> dict:
        """Decode: every received block equals the prefill pattern of its source block."""
        torch = self.torch
        words = self.kv.view(torch.int32).view(2, self.num_blocks, self.block_words)
        checked, bad = 0, 0
        for ld in loads:
            local = torch.as_tensor(ld["local"], dtype=torch.int64, device=self.dev)
            remote = torch.as_tensor(ld["remote"], dtype=torch.int64, device=self.dev)
            for r in range(2):
                want = self._words((r * remote_num_blocks + remote) * self.block_words, self.block_words, seed)
                got = words[r].index_select(0, local)
                bad += int((got != want).any(dim=1).sum())
                checked += got.numel() * 4
        words = local = remote = want = got = None
        if self.mode == "gpu":
            torch.cuda.empty_cache()  # the comparison's temporaries (GiBs at 4 GiB loads): not held for the next case
        return {"bytes_checked": checked, "bad_blocks": bad, "ok": bad == 0 and checked > 0}

    def zero(self) -> None:
        self.kv.zero_()
        if self.mode == "gpu":
            self.torch.cuda.synchronize(self.dev)

    def d2d(self, nbytes: int, block_len: int, reps: int) -> dict:
        """Reference copies of ``nbytes`` on this device: contiguous (cudaMemcpy
        D2D through torch ``copy_``) and block-wise (index_select/index_copy_,
        as the staged path's copies); medians of ``reps``."""
        torch = self.torch
        nbytes -= nbytes % block_len
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.dev).fill_(7)
        dst = torch.empty_like(src)
        nblk = nbytes // block_len
        ids = torch.randperm(nblk, device=self.dev)
        from kvd.shim.memory.staged import _wide

        sv, dv = _wide(src.view(nblk, block_len)), _wide(dst.view(nblk, block_len))  # as the staged copies

        def timed(fn) -> float:
            fn()  # warm-up
            out = []
            for _ in range(reps):
                if self.mode == "gpu":
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    fn()
                    b.record()
                    b.synchronize()
                    out.append(a.elapsed_time(b) / 1e3)
                else:
                    t0 = time.perf_counter()
                    fn()
                    out.append(time.perf_counter() - t0)
            return statistics.median(out)

        contig = timed(lambda: dst.copy_(src))
        gather = timed(lambda: dv.index_copy_(0, ids, sv.index_select(0, ids)))
        out = {"bytes": nbytes, "contig_s": contig, "gather_s": gather,
               "contig_gbps": nbytes / contig / 1e9, "gather_gbps": nbytes / gather / 1e9}
        if self.mode == "gpu":
            out.update(self._row_copies(src, dst, ids, nblk, block_len, reps))
        src = dst = sv = dv = None  # free before empty_cache (the lambdas above hold these cells)
        if self.mode == "gpu":
            torch.cuda.empty_cache()
        return out

    def _row_copies(self, src, dst, ids, nblk: int, block_len: int, reps: int) -> dict:
        """What the daemon's same-node VRAM copy does with the same blocks
        (``kvd.cuda_copy``): its kernel and ``cudaMemcpyBatchAsync``, each
        timed on the host around the call (the segment table's upload and
        the synchronize included, as the daemon pays them), bytes compared."""
        from kvd import cuda_copy, cudart

        torch = self.torch
        src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8, device=self.dev))
        order = ids.cpu().numpy().astype("int64")
        import numpy as np

        d = dst.data_ptr() + np.arange(nblk, dtype=np.int64) * block_len
        s_ = src.data_ptr() + order * block_len
        n = np.full(nblk, block_len, dtype=np.int64)
        eng, rt = cuda_copy.engine(), cudart.load()
        dev = self.dev.index or 0
        torch.cuda.synchronize(self.dev)
        out = {"sweep": {}}

        def run(name: str, fn) -> None:
            dst.zero_()
            torch.cuda.synchronize(self.dev)
            try:
                fn()
                ok = bool(torch.equal(dst.view(nblk, block_len), src.view(nblk, block_len)[ids]))
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                gbps = dst.numel() / statistics.median(times) / 1e9
                out["sweep"][name] = {"gbps": gbps, "ok": ok}
            except Exception as e:  # reported, not fatal: the rest of the check goes on
                out["sweep"][name] = {"error": str(e)[:300]}

        run("kernel", lambda: eng.copy_rows(dev, d, s_, n))
        run("batch", lambda: rt.copy_rows(dev, d, s_, n))
        # Kernel shapes other than the default (kvd.cuda_copy's constants), for choosing them.
        for name, kw in (("t256u4", dict(threads=256, blocks_per_sm=8)), ("t512u4", dict(threads=512, blocks_per_sm=4)),
                         ("t512u8", dict(threads=512, unroll=8, blocks_per_sm=4)), ("t1024u8", dict(unroll=8)),
                         ("w1", dict(waves=1)), ("w16", dict(waves=16)), ("seg32k", dict(max_segment=32 << 10))):
            variant = self._variants.get(name)
            if variant is None:
                variant = self._variants[name] = cuda_copy.RowCopier(rt, **kw)
            run(name, lambda v=variant: v.copy_rows(dev, d, s_, n))
        k, b = out["sweep"]["kernel"], out["sweep"]["batch"]
        out.update({"kernel_gbps": k.get("gbps"), "kernel_ok": k.get("ok"), "batch_gbps": b.get("gbps"),
                    "batch_ok": b.get("ok"), "kernel_error": k.get("error", ""), "batch_error": b.get("error", "")})
        out["kernel_in_use"] = eng.kernel
        out["kernel_why_not"] = eng.why
        return out

    def teardown(self) -> dict:
        from kvd.v1 import kvd_pb2 as pb

        if self.mirror is not None:
            self.mirror.close()  # before the daemon frees the mirrors
            self.mirror = None
        if self.session is not None:
            self.session.close()
            self.session = None
        if self.engine_id:
            kw = {"worker": pb.EngineWorker(engine_id=self.engine_id, tp_rank=0, tp_size=1)}
            if self.token and "session_token" in pb.UnregisterEngineRequest.DESCRIPTOR.fields_by_name:
                kw["session_token"] = self.token
            self.stub.UnregisterEngine(pb.UnregisterEngineRequest(**kw), timeout=60)
            self.engine_id = ""
        return {}


def engine_main(conn, cfg: dict) -> None:
    """Engine process: executes ``{"cmd", "args"}`` messages until ``exit``.
    ``cfg["log"]``: a file that takes the process's stdout and stderr (UCX
    prints its protocol tables there)."""
    cfg = dict(cfg)
    log = cfg.pop("log", None)
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        eng = Engine(**cfg)
    except Exception as e:
        conn.send({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
        return
    conn.send({"ok": True, "result": "ready"})
    while True:
        msg = conn.recv()
        if msg["cmd"] == "exit":
            try:
                eng.teardown()
            except Exception:
                pass
            conn.send({"ok": True, "result": None})
            return
        try:
            conn.send({"ok": True, "result": getattr(eng, msg["cmd"])(**msg.get("args", {}))})
        except Exception as e:
            conn.send({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})


class EngineProc:
    """The orchestrator's handle on one engine process."""

    def __init__(self, ctx, cfg: dict, name: str, timeout_s: float = 180):
        self.name = name
        self.log_path = cfg.get("log")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, args=(child, cfg), name=f"engine-{name}", daemon=True)
        self.proc.start()
        self._answer(timeout_s, "start")

    def _answer(self, timeout_s: float, cmd: str):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"engine {self.name}: no answer to {cmd} within {timeout_s:.0f} s")
        msg = self.conn.recv()
        if not msg["ok"]:
            raise RuntimeError(f"engine {self.name}: {cmd}: {msg['error']}\n{msg.get('trace', '')}")
        return msg["result"]

    def call(self, cmd: str, wait_s: float = 300, **args):
        """Runs ``cmd(**args)`` in the engine; waits up to ``wait_s`` for the answer."""
        self.conn.send({"cmd": cmd, "args": args})
        return self._answer(wait_s, cmd)

    def log_size(self) -> int:
        return os.path.getsize(self.log_path) if self.log_path and os.path.exists(self.log_path) else 0

    def log_text(self, start: int = 0) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(start)
            return f.read().decode("utf-8", "replace")

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send({"cmd": "exit"})
                self.conn.poll(30)
            except (OSError, EOFError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
