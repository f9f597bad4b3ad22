"""The checks the real-engine scenarios share (tests/test_vllm_e2e*.py):
a kvd P/D stack with per-side engine arguments, prompts through P -> D with
their non-disaggregated references, the "D decodes from the transferred KV"
check, and the engines' KV segments (``/dev/shm/torch_<pid>_*``)."""

from __future__ import annotations

import os
import time

from kvd.testing import proxy
from kvd.testing.shm import pids_in_groups, shm_in_use_by
from kvd.testing.vllm_engines import EXTERNAL, PDStack, prompt_tokens_by_source
from kvd.testing.util import wait_until

P_LEASE_S = 600.0        # long: P must free blocks on D's notifications, not on expiry
FREE_DEADLINE_S = 5.0    # P's leases (one per rank) must end this soon after D finished
# A TP stack's D daemon pairs with P's engine within this (seconds) of both
# engines serving (PDStack.wait_paired): generous, since a first contact
# during a TP 2 engine's start-up took 55 s once on a 2-core machine.
STACK_PAIRED_S = 240.0


def start_sides(model_dir, run_dir, side_args: dict, p_extra: dict | None = None,
                d_extra: dict | None = None, warm_peers: bool = False) -> PDStack:
    """Starts two daemons and two kvd-connected engines with per-side engine
    arguments (``{"P": [...], "D": [...]}``), P's lease :data:`P_LEASE_S`, D's
    load timeout 60 s, plus ``p_extra``/``d_extra`` connector settings;
    ``warm_peers``: D's daemon pairs with P's engine ahead of need and the
    stack waits for it (``PDStack.wait_paired``, up to :data:`STACK_PAIRED_S`)."""
    st = PDStack(model_dir=model_dir, run_dir=run_dir, connector="kvd", log=lambda _line: None,
                 p_extra_config={"kvd_lease_s": P_LEASE_S, **(p_extra or {})},
                 d_extra_config={"kvd_load_timeout_s": 60, **(d_extra or {})}, side_args=side_args,
                 warm_peers=warm_peers, wait_paired_s=STACK_PAIRED_S if warm_peers else 0.0)
    st.start()
    return st


def run_prompts(st: PDStack, prompts: list[list[int]], tag: str) -> list[dict]:
    """Each prompt through P -> D (the toy-proxy flow), then each engine alone
    on it (the non-disaggregated references; prefix cache bypassed by a
    cache_salt). Rows: prompt, P/D and reference token ids, D's params, whether
    P's leases ended within FREE_DEADLINE_S, D's external prompt tokens."""
    from kvd.demo import run

    rows = []
    for i, prompt in enumerate(prompts):
        src0 = prompt_tokens_by_source(st.d.metrics())
        rid = f"kvd-e2e-{tag}-{i}-{time.time_ns()}"
        res = proxy.pd_complete(st.p.url, st.d.url, run.request_body(prompt), request_id=rid)
        freed = wait_until(lambda: st.p_daemon.stats()["active_leases"] == 0, FREE_DEADLINE_S,
                           interval=0.05) is not None
        src1 = prompt_tokens_by_source(st.d.metrics())
        ref_p = proxy.complete(st.p.url, dict(run.request_body(prompt), cache_salt=rid + "p"))
        ref_d = proxy.complete(st.d.url, dict(run.request_body(prompt), cache_salt=rid + "d"))
        rows.append({"prompt": prompt, "pd": list(res.decode.token_ids or []),
                     "ref_p": list(ref_p.token_ids or []), "ref_d": list(ref_d.token_ids or []),
                     "params": res.kv_transfer_params, "freed": freed,
                     "external": src1[EXTERNAL] - src0[EXTERNAL]})
    return rows


def swapped_prompt_outputs(st: PDStack, model_dir, length: int, seed: int, tag: str):
    """The "D decodes from the transferred KV" check's three completions.

    Prompt A is prefilled on P; prompt B (``length`` tokens like A, A's last
    token, other tokens elsewhere) goes to D with A's ``kv_transfer_params``.
    D recomputes only the last token, so if it used the transferred KV its
    output is greedy(A), not greedy(B). Returns ``(decode, ref_a, ref_b)``:
    D's completion and P's non-disaggregated completions of A and B (prefix
    cache bypassed by a cache_salt), :mod:`kvd.testing.proxy` results.
    """
    from kvd.demo import run

    a, other = run.make_prompts(model_dir, [length, length], seed=seed)
    b = other[:-1] + a[-1:]
    rid = f"kvd-e2e-{tag}-swap-{time.time_ns()}"
    pre = proxy.complete(st.p.url, proxy.prefill_request(run.request_body(a)), rid)
    assert pre.kv_transfer_params, pre.raw
    dec = proxy.complete(st.d.url, dict(run.request_body(b), kv_transfer_params=pre.kv_transfer_params), rid)
    ref_a = proxy.complete(st.p.url, dict(run.request_body(a), cache_salt=rid + "a"))
    ref_b = proxy.complete(st.p.url, dict(run.request_body(b), cache_salt=rid + "b"))
    return dec, ref_a, ref_b


def kv_segments(st: PDStack) -> set[str]:
    """The engines' /dev/shm/torch_<pid>_* KV segments (any process of their groups)."""
    pids = pids_in_groups([e.child.pid for e in st.engines.values()])
    return {n for pid in pids for n in shm_in_use_by(pid) if n.startswith(f"torch_{pid}_")}


def check_named_kv_segments(kv: set[str], named: int) -> None:
    """AssertionError unless ``kv`` (:func:`kv_segments`) is what the shim
    names: nothing where it hands the KV cache over as sealed memfds
    (``kvd.shim.memory.memfd``, the CPU default where memfds can be sealed),
    else at least ``named`` segments."""
    from kvd.shim.memory import memfd

    if memfd.available():
        assert kv == set(), f"KV cache named in /dev/shm on the memfd path: {sorted(kv)}"
    else:
        assert len(kv) >= named, kv


def stop_engines_and_wait_segments_gone(st: PDStack, kv: set[str], timeout_s: float = 30.0) -> None:
    """Stops both engines (the daemons keep running, as in production) and
    waits until none of ``kv`` exists; AssertionError naming the ones left."""
    for e in st.engines.values():
        st.procs.stop(e.child)
    left = lambda: {n for n in kv if os.path.exists(f"/dev/shm/{n}")}  # noqa: E731
    wait_until(lambda: not left(), timeout_s, f"the stopped engines' KV segments {sorted(kv)} gone", interval=0.5)
