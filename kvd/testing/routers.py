"""The P/D routers users run, in front of a :class:`~kvd.testing.vllm_engines.PDStack`:
vllm-router (package ``vllm-router``) and smg, the SGLang model gateway
(package ``smg``), both Rust binaries installed by ``scripts/setup.sh``
(pyproject's ``dev`` extra) that run offline. Also the engine-side
configuration Dynamo accepts (:func:`multi_connector_config`).

What each router does with a P/D pair (read from their sources; the tests
in ``tests/test_routers*.py`` check it against real engines):

- vllm-router (``src/routers/http/vllm_pd_router.rs``): sends P the request
  with ``max_tokens=1``, ``stream=false`` and NixlConnector's six
  ``do_remote_decode`` keys, then D the original request plus P's
  ``kv_transfer_params`` verbatim. ``--kv-connector nixl`` only picks that
  parameter shape; it never reads the engine's connector.
- smg (``model_gateway/src/routers/common/kv_transfer.rs``,
  ``kv_connector_mode``): tags the prefill leg only when the prefill
  worker's ``kv_connector`` is exactly ``"NixlConnector"`` (or
  ``"MooncakeConnector"``); anything else, or none, is *passthrough*: P gets
  the plain request, returns no ``kv_transfer_params``, and D recomputes the
  prompt. Over HTTP smg does not learn the engine's connector (it reads
  ``/v1/models`` and ``/version``: ``workflow/steps/local/discover_metadata.rs``),
  so a worker given by ``--prefill URL`` is passthrough. The supported way
  to mark one is the worker label ``kv_connector`` on ``POST /workers``
  (``workflow/steps/local/create_worker.rs`` moves it into the worker's
  ``kv_connector``) or, under Kubernetes discovery, the pod annotation
  ``smg.ai/kv-connector`` (``--kv-connector-annotation``). kvd speaks
  NixlConnector's parameters, so the label is ``NixlConnector``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvd.testing import proxy
from kvd.testing.processes import Child, ProcessSet
from kvd.testing.util import free_port, wait_until
from kvd.testing.vllm_engines import PDStack, http_ok, prompt_tokens_by_source

VLLM_ROUTER = "vllm-router"
SMG = "smg"
#: The connector name smg (and Dynamo) give NixlConnector's P/D protocol.
NIXL_CONNECTOR = "NixlConnector"
ROUTER_READY_S = 60.0


def router_binary(name: str) -> str | None:
    """Path of the ``name`` console script: next to this Python (the venv's
    ``bin``), else on PATH; None when neither has it."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    return shutil.which(name)


def router_missing(name: str, timeout_s: float = 60.0) -> str | None:
    """Why ``name`` cannot run here (a reason for ``pytest.skip``), or None
    when ``name --help`` exits 0 within ``timeout_s`` seconds."""
    path = router_binary(name)
    if path is None:
        return f"{name} is not installed (scripts/setup.sh installs it with pyproject's dev extra)"
    try:
        r = subprocess.run([path, "--help"], capture_output=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{name} cannot run here: {e}"
    if r.returncode != 0:
        return f"{name} --help exited {r.returncode}: {r.stderr.decode(errors='replace')[-500:]}"
    return None


def vllm_router_argv(prefill_url: str, decode_url: str, port: int) -> list[str]:
    """vllm-router in vLLM P/D mode on ``127.0.0.1:port`` with one prefill and
    one decode worker, NixlConnector's parameter shape (``--kv-connector nixl``)."""
    return [router_binary(VLLM_ROUTER) or VLLM_ROUTER, "--vllm-pd-disaggregation",
            "--prefill", prefill_url, "--decode", decode_url,
            "--host", "127.0.0.1", "--port", str(port), "--kv-connector", "nixl"]


def smg_argv(decode_url: str, port: int, metrics_port: int,
             prefill_urls: tuple[str, ...] = ()) -> list[str]:
    """smg (``smg launch``) in P/D mode on ``127.0.0.1:port``, Prometheus on
    ``127.0.0.1:metrics_port``, vLLM workers; ``prefill_urls`` registered from
    the command line (they carry no ``kv_connector``: passthrough)."""
    argv = [router_binary(SMG) or SMG, "launch", "--pd-disaggregation", "--backend", "vllm",
            "--decode", decode_url, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    for url in prefill_urls:
        argv += ["--prefill", url]
    return argv


@dataclass
class Router:
    """A running router: its name, base URL, child process, the ProcessSet
    that owns it and (smg) its Prometheus URL. A context manager: leaving it
    stops the router (:meth:`close`)."""
    name: str
    url: str
    child: Child
    procs: ProcessSet
    metrics_url: str | None = None

    def complete(self, body: dict, timeout_s: float = 120.0) -> proxy.Completion:
        """POST ``body`` to the router's ``/v1/completions`` (the router runs both legs)."""
        return proxy.complete(self.url, body, timeout_s=timeout_s)

    def metrics(self) -> dict:
        """The router's Prometheus metrics as ``{(name, sorted labels): value}`` (smg)."""
        if self.metrics_url is None:
            raise ValueError(f"{self.name} has no metrics endpoint here")
        return proxy.parse_prometheus(proxy.get_text(self.metrics_url))

    def close(self) -> None:
        """Stops the router (SIGTERM, then SIGKILL)."""
        self.procs.close()

    def __enter__(self) -> "Router":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_router(st: PDStack, name: str, argv: list[str], port: int,
                 metrics_port: int | None = None, ready_s: float = ROUTER_READY_S) -> Router:
    """Starts ``argv`` (log: ``<stack run dir>/<name>/<name>.log``) and waits
    until ``GET /health`` answers 2xx. Its own ProcessSet, not the stack's:
    a stopped router is no failed stack (``st.check_alive()``). Raises
    ChildFailed when it exits or is not ready within ``ready_s`` seconds
    (the router is stopped)."""
    procs = ProcessSet(st.run_dir / name, st.log)
    url = f"http://127.0.0.1:{port}"
    try:
        child = procs.start(name, argv, env={"HF_HUB_OFFLINE": "1"})
        procs.wait_ready(child, lambda: http_ok(url + "/health"), ready_s, what="healthy")
    except BaseException:
        procs.close()
        raise
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None
    return Router(name, url, child, procs, metrics_url)


def start_vllm_router(st: PDStack) -> Router:
    """vllm-router in front of the stack's P and D (:func:`vllm_router_argv`)."""
    port = free_port()
    return start_router(st, VLLM_ROUTER, vllm_router_argv(st.p.url, st.d.url, port), port)


def start_smg(st: PDStack, prefill_from_cli: bool) -> Router:
    """smg in front of the stack (:func:`smg_argv`). ``prefill_from_cli``:
    P is given by ``--prefill`` (no ``kv_connector``: passthrough); else
    only D is, and P is to be added with :func:`smg_add_worker`."""
    port, mport = free_port(), free_port()
    argv = smg_argv(st.d.url, port, mport, (st.p.url,) if prefill_from_cli else ())
    return start_router(st, SMG, argv, port, metrics_port=mport)


def smg_workers(router: Router) -> list[dict]:
    """smg's ``GET /workers`` list (each: url, worker_type, status, kv_connector, labels ...)."""
    return json.loads(proxy.get_text(router.url + "/workers"))["workers"]


def wait_workers_ready(router: Router, count: int, timeout_s: float = 30.0) -> list[dict]:
    """smg's workers once ``count`` of them are ready (it adds and checks
    them in the background); raises TimeoutError after ``timeout_s`` seconds."""
    if wait_until(lambda: sum(w.get("status") == "ready" for w in smg_workers(router)) >= count,
                  timeout_s, interval=0.2) is None:
        raise TimeoutError(f"smg has not {count} ready workers within {timeout_s:.0f} s: {smg_workers(router)}")
    return smg_workers(router)


def smg_add_worker(router: Router, url: str, worker_type: str, kv_connector: str | None,
                   timeout_s: float = 30.0) -> dict:
    """Registers worker ``url`` (``worker_type`` prefill | decode, runtime vLLM)
    with smg's ``POST /workers``, with the label ``kv_connector`` when given,
    and waits until smg lists it ready; returns its ``/workers`` entry.
    Raises HttpError when smg refuses it, TimeoutError when it is not ready
    within ``timeout_s`` seconds."""
    body: dict = {"url": url, "worker_type": worker_type, "runtime_type": "vllm"}
    if kv_connector is not None:
        body["labels"] = {"kv_connector": kv_connector}
    proxy.post_json(router.url + "/workers", body)

    def ready() -> dict | None:
        for w in smg_workers(router):
            if w["url"] == url and w.get("status") == "ready":
                return w
        return None

    if wait_until(lambda: ready() is not None, timeout_s, interval=0.2) is None:
        raise TimeoutError(f"smg did not list {url} ready within {timeout_s:.0f} s: {smg_workers(router)}")
    return ready()


def smg_connector_modes(router: Router) -> dict[str, float]:
    """smg's ``smg_pd_kv_connector_mode_total`` by mode (nixl, passthrough, ...)."""
    out: dict[str, float] = {}
    for (name, labels), v in router.metrics().items():
        if name == "smg_pd_kv_connector_mode_total":
            out[dict(labels).get("mode", "")] = v
    return out


@dataclass
class RoutedResult:
    """One completion through a router: the decode output's token ids and
    D's prompt tokens by source for it (``vllm:prompt_tokens_by_source_total``
    deltas: ``external_kv_transfer``, ``local_compute``, ``local_cache_hit``)."""
    prompt_tokens: int
    token_ids: list[int]
    external: int
    local_compute: int
    local_hit: int
    kv_transfer_params: dict | None


def route_one(send: Callable[[dict], proxy.Completion], st: PDStack, body: dict,
              settle_s: float = 10.0) -> RoutedResult:
    """Sends ``body`` with ``send`` (a router's :meth:`Router.complete`, or
    :func:`toy_proxy` for the stack) and measures D's prompt-token counters
    before and after (waiting up to ``settle_s`` seconds for D to publish
    them: vLLM logs stats a step after the response)."""
    before = prompt_tokens_by_source(st.d.metrics())
    c = send(body)
    n = c.prompt_tokens
    if n <= 0:
        raise ValueError(f"the completion reports no prompt tokens (usage): {c.raw}")
    after = dict(before)

    def counted() -> bool:
        after.update(prompt_tokens_by_source(st.d.metrics()))
        return after["total"] - before["total"] >= n

    wait_until(counted, settle_s, interval=0.05)
    d = {k: int(after[k] - before[k]) for k in after}
    return RoutedResult(n, list(c.token_ids or []), d["external_kv_transfer"], d["local_compute"],
                        d["local_cache_hit"], c.kv_transfer_params)


def toy_proxy(st: PDStack) -> Callable[[dict], proxy.Completion]:
    """A ``send`` for :func:`route_one`: vLLM's toy proxy flow
    (:func:`kvd.testing.proxy.pd_complete`) over the stack's P and D; returns D's completion."""
    return lambda body: proxy.pd_complete(st.p.url, st.d.url, body).decode


def reference_token_ids(st: PDStack, body: dict, salt: str) -> list[int]:
    """The non-disaggregated output of ``body``: P alone, its prefix cache
    bypassed by ``cache_salt`` (``salt``)."""
    c = proxy.complete(st.p.url, dict(body, cache_salt=salt))
    return list(c.token_ids or [])


def multi_connector_config(child: dict, child_name: str | None = None,
                           child_module: str | None = None) -> dict:
    """vLLM's ``MultiConnector`` with ``child`` (a ``--kv-transfer-config``)
    as its only connector, optionally under another class name and module
    (``child_name``, ``child_module``: vLLM's factory loads
    ``getattr(import_module(kv_connector_module_path), kv_connector)`` before
    its registry, ``kv_connector/factory.py``). Dynamo accepts a MultiConnector
    only when exactly one child's *name* is a protocol it knows
    (``dynamo/vllm/kv_connector_protocols.py``, ``KV_CONNECTOR_PROTOCOLS``)."""
    inner = dict(child)
    if child_name is not None:
        inner["kv_connector"] = child_name
    if child_module is not None:
        inner["kv_connector_module_path"] = child_module
    return {"kv_connector": "MultiConnector", "kv_role": child.get("kv_role", "kv_both"),
            "kv_connector_extra_config": {"connectors": [inner]}}


def wait_leases_zero(st: PDStack, timeout_s: float = 5.0) -> bool:
    """True when P's daemon holds no lease within ``timeout_s`` seconds (D
    read the blocks and notified)."""
    return wait_until(lambda: st.p_daemon.stats()["active_leases"] == 0, timeout_s,
                      interval=0.05) is not None


__all__ = ["VLLM_ROUTER", "SMG", "NIXL_CONNECTOR", "Router", "RoutedResult", "router_binary",
           "router_missing", "vllm_router_argv", "smg_argv", "start_router", "start_vllm_router",
           "start_smg", "smg_workers", "wait_workers_ready", "smg_add_worker", "smg_connector_modes", "route_one", "toy_proxy",
           "reference_token_ids", "multi_connector_config", "wait_leases_zero"]
