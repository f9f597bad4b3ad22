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
        self.engine_socket = socket
        import grpc
        import torch

        from kvd.v1 import kvd_pb2_grpc as pb_grpc

        self.torch = torch
        self.mode, self.role = mode, role
        self.dev = torch.device("cuda", device) if mode == "gpu" else torch.device("cpu")
        if mode == "gpu":
            torch.cuda.set_device(self.dev)
        self.buf = torch.zeros(buffer_bytes, dtype=torch.uint8, device=self.dev)
        if mode == "cpu":
            from kvd.shim.memory import shm

            shm.share_storage(self.buf)  # into POSIX shm once; every view follows
        self.stub = pb_grpc.EngineServiceStub(grpc.insecure_channel(
            f"unix:{socket}", options=[("grpc.max_send_message_length", 64 << 20),
                                       ("grpc.max_receive_message_length", 64 << 20)]))
        self.session = None
        self.sharing = None
        self.mirror = None
        self.engine_id = ""
        self.token = ""

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

    def setup(self, engine_id: str, block_tokens: int, num_blocks: int, data_path: str, seed: int | None) -> dict:
        torch = self.torch
        from kvd.v1 import kvd_pb2 as pb

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
        sv, dv = src.view(nblk, block_len), dst.view(nblk, block_len)

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
        src = dst = sv = dv = None  # free before empty_cache (the lambdas above hold these cells)
        if self.mode == "gpu":
            torch.cuda.empty_cache()
        return {"bytes": nbytes, "contig_s": contig, "gather_s": gather,
                "contig_gbps": nbytes / contig / 1e9, "gather_gbps": nbytes / gather / 1e9}

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
    """Engine process: executes ``{"cmd", "args"}`` messages until ``exit``."""
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
