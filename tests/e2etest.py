"""Helpers shared by the real-engine tests (tests/test_vllm_e2e*.py)."""

from __future__ import annotations

import time


def swapped_prompt_outputs(st, model_dir, length: int, seed: int, tag: str):
    """The "D decodes from the transferred KV" check's three completions.

    Prompt A is prefilled on P; prompt B (``length`` tokens like A, A's last
    token, other tokens elsewhere) goes to D with A's ``kv_transfer_params``.
    D recomputes only the last token, so if it used the transferred KV its
    output is greedy(A), not greedy(B). Returns ``(decode, ref_a, ref_b)``:
    D's completion and P's non-disaggregated completions of A and B (prefix
    cache bypassed by a cache_salt), ``kvd.demo.proxy`` results.
    """
    from kvd.demo import proxy, run

    a, other = run.make_prompts(model_dir, [length, length], seed=seed)
    b = other[:-1] + a[-1:]
    rid = f"kvd-e2e-{tag}-swap-{time.time_ns()}"
    pre = proxy.complete(st.p.url, proxy.prefill_request(run.request_body(a)), rid)
    assert pre.kv_transfer_params, pre.raw
    dec = proxy.complete(st.d.url, dict(run.request_body(b), kv_transfer_params=pre.kv_transfer_params), rid)
    ref_a = proxy.complete(st.p.url, dict(run.request_body(a), cache_salt=rid + "a"))
    ref_b = proxy.complete(st.p.url, dict(run.request_body(b), cache_salt=rid + "b"))
    return dec, ref_a, ref_b
