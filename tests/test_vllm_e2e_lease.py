"""End to end with real engines: a decode request queued longer than P's
lease still loads P's blocks, because D's scheduler renews the lease while
the request waits (``kvd.shim.vllm.renewals``; vLLM's NixlConnector does
the same with heartbeats).

P holds finished prefills for LEASE_S (``kvd_lease_s``). D runs one
sequence at a time (``--max-num-seqs 1``) and is kept busy by a local
request sized to outlast the lease several times; the P/D request's decode
leg waits in D's queue meanwhile. Slow (a real P/D stack); marked ``vllm``.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvd.testing import proxy
from kvd.testing.util import wait_until
from kvd.testing.vllm_engines import EXTERNAL, PDStack, prompt_tokens_by_source

# Renewals go out from D's engine steps (as NixlConnector's heartbeats), a
# third of the lease apart: a step stalled for more than two thirds of the
# lease lets it lapse. One run with a 3 s lease on this 2-core machine at
# load 8 renewed for 50 s, then lapsed in a stall (D at 2 tokens/s).
LEASE_S = 10.0
BUSY_S = 3 * LEASE_S  # how long D's local request should keep D's one sequence slot

vllm = pytest.mark.vllm


@vllm
def test_a_decode_request_queued_past_the_lease_still_loads_p_blocks(tiny_model_dir, tmp_path):
    lines: list[str] = []
    st = PDStack(model_dir=tiny_model_dir, run_dir=tmp_path / "pd", log=lines.append,
                 p_extra_config={"kvd_lease_s": LEASE_S}, d_extra_config={"kvd_load_timeout_s": 60},
                 side_args={"D": ["--max-num-seqs", "1"]})
    st.start()
    try:
        # D's decode speed here, to size the request that keeps it busy.
        t0 = time.monotonic()
        proxy.complete(st.d.url, {"model": "tiny", "prompt": [5] * 16, "max_tokens": 64, "ignore_eos": True})
        per_token = (time.monotonic() - t0) / 64
        # At most 1,000: decode slows as the context grows (1,900 tokens took 200 s here, not the 30 s
        # measured at 64); 1,000 keeps D busy well past twice the lease in a shorter test.
        busy_tokens = min(1000, max(64, int(BUSY_S / per_token)))
        busy = threading.Thread(target=proxy.complete, daemon=True, args=(st.d.url, {
            "model": "tiny", "prompt": [7] * 16, "max_tokens": busy_tokens, "ignore_eos": True}),
            kwargs={"timeout_s": 600})
        before_p = st.p_daemon.stats()
        before_d = prompt_tokens_by_source(st.d.metrics())
        prompt = list(range(100, 228))  # 4 blocks of 32 tokens
        request = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
        pre = proxy.complete(st.p.url, proxy.prefill_request(request), "lease-e2e", 120)
        assert pre.kv_transfer_params and pre.kv_transfer_params["remote_blocks_expiry_time"]
        busy.start()
        time.sleep(0.5)  # the busy request holds D's one slot first
        t_d = time.monotonic()
        try:
            dec = proxy.complete(st.d.url, dict(request, kv_transfer_params=pre.kv_transfer_params), "lease-e2e",
                                 600)
        except proxy.HttpError as e:  # the load failed: report what P saw first
            dec = e
        waited = time.monotonic() - t_d
        busy.join(600)
        after_p = st.p_daemon.stats()
        after_d = prompt_tokens_by_source(st.d.metrics())
        print(f"\nD's request waited {waited:.1f} s behind {busy_tokens} tokens (P lease {LEASE_S} s); "
              f"P: {after_p['leases_renewed'] - before_p['leases_renewed']} renewals, "
              f"{after_p['leases_expired'] - before_p['leases_expired']} expired; "
              f"D external prompt tokens +{after_d[EXTERNAL] - before_d[EXTERNAL]:.0f}")
        if waited < 2 * LEASE_S:
            pytest.skip(f"D's queue wait ({waited:.1f} s) did not outlast the lease twice: nothing proven")
        assert not isinstance(dec, proxy.HttpError), dec
        assert dec.completion_tokens == 4
        assert after_p["leases_expired"] == before_p["leases_expired"], "P's lease expired while D's request waited"
        assert after_p["leases_renewed"] > before_p["leases_renewed"]
        assert after_d[EXTERNAL] - before_d[EXTERNAL] >= len(prompt) - 1, "D recomputed instead of loading"
        wait_until(lambda: st.p_daemon.stats()["active_leases"] == 0, 10, "P's lease ended on D's read")
    finally:
        st.close()
