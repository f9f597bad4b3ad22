"""The P/D proxy step, as vLLM's toy proxy (``toy_proxy_server.py``) does it.

1. Send the client's completion request to the prefill (P) engine with
   ``max_tokens=1`` (and ``max_completion_tokens=1``), ``stream=false`` and
   ``kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false,
   remote_engine_id: null, remote_block_ids: null, remote_host: null,
   remote_port: null}``, under an ``X-Request-Id`` header.
2. Take the ``kv_transfer_params`` of P's response unchanged into the original
   request and send it to the decode (D) engine under the same
   ``X-Request-Id``.

Plain ``urllib`` (stdlib): no dependency beyond Python.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class HttpError(RuntimeError):
    """A non-2xx HTTP answer to a POST: ``status`` and the response ``body``
    (the message keeps the first 2,000 characters)."""
    def __init__(self, url: str, status: int, body: str):
        super().__init__(f"POST {url} -> HTTP {status}: {body[:2000]}")
        self.status = status
        self.body = body


def post_json(url: str, body: dict, headers: dict | None = None,
              timeout_s: float = 120.0) -> dict:
    """POSTs ``body`` as JSON to ``url`` and returns the decoded JSON answer.
    Raises HttpError on a non-2xx status, URLError/OSError when unreachable or
    past ``timeout_s`` seconds."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST")
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        raise HttpError(url, e.code, e.read().decode("utf-8", errors="replace")) from None


def get_text(url: str, timeout_s: float = 10.0) -> str:
    """GET ``url`` as text. Raises URLError/HTTPError/OSError (``timeout_s`` seconds)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode()


@dataclass
class Completion:
    """One completion's result. Times in seconds."""
    text: str
    token_ids: list[int] | None
    prompt_tokens: int
    completion_tokens: int
    kv_transfer_params: dict | None
    elapsed_s: float
    raw: dict = field(repr=False, default_factory=dict)


def _parse(resp: dict, elapsed: float) -> Completion:
    choice = resp["choices"][0]
    usage = resp.get("usage") or {}
    return Completion(
        text=choice.get("text", ""),
        token_ids=choice.get("token_ids"),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        kv_transfer_params=resp.get("kv_transfer_params"),
        elapsed_s=elapsed,
        raw=resp,
    )


def complete(base_url: str, body: dict, request_id: str | None = None,
             timeout_s: float = 120.0) -> Completion:
    """POST ``body`` to ``{base_url}/v1/completions``."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    t0 = time.perf_counter()
    resp = post_json(base_url.rstrip("/") + "/v1/completions", body, headers, timeout_s)
    return _parse(resp, time.perf_counter() - t0)


def first_token_s(base_url: str, body: dict, request_id: str | None = None,
                  timeout_s: float = 120.0) -> tuple[float, float]:
    """Stream a completion; returns (seconds to the first text chunk, seconds
    to the end of the stream)."""
    body = dict(body, stream=True)
    data = json.dumps(body).encode()
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/completions", data=data,
                                 method="POST")
    req.add_header("Content-Type", "application/json")
    if request_id:
        req.add_header("X-Request-Id", request_id)
    t0 = time.perf_counter()
    first = None
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                if first is None:
                    chunk = json.loads(payload)
                    if chunk.get("choices") and (chunk["choices"][0].get("text")
                                                 or chunk["choices"][0].get("token_ids")):
                        first = time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        raise HttpError(req.full_url, e.code, e.read().decode("utf-8", errors="replace")) from None
    end = time.perf_counter() - t0
    return (first if first is not None else end), end


def pd_first_token_s(prefill_url: str, decode_url: str, request: dict,
                     request_id: str | None = None, timeout_s: float = 120.0
                     ) -> tuple[float, float, float]:
    """TTFT through the P/D flow: (P latency, D time to first token, total to
    first token), seconds. D streams; P does not (max_tokens=1)."""
    rid = request_id or f"kvd-demo-{uuid.uuid4().hex}"
    pre = complete(prefill_url, prefill_request(request), rid, timeout_s)
    body = dict(request)
    if pre.kv_transfer_params is not None:
        body["kv_transfer_params"] = pre.kv_transfer_params
    d_first, _ = first_token_s(decode_url, body, rid, timeout_s)
    return pre.elapsed_s, d_first, pre.elapsed_s + d_first


@dataclass
class PDResult:
    """One disaggregated request: the prefill on P, the decode on D, and the
    ``kv_transfer_params`` handed from P to D."""
    request_id: str
    prefill: Completion
    decode: Completion
    kv_transfer_params: dict | None  # what P returned and D received

    @property
    def total_s(self) -> float:
        """Prefill plus decode latency, seconds."""
        return self.prefill.elapsed_s + self.decode.elapsed_s


def prefill_request(request: dict) -> dict:
    """The request P gets: one token, no streaming, remote decode asked."""
    body = dict(request)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body.pop("stream_options", None)
    body["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return body


def pd_complete(prefill_url: str, decode_url: str, request: dict,
                request_id: str | None = None, timeout_s: float = 120.0,
                kv_transfer_params_override: dict | None = None) -> PDResult:
    """Run one completion through the P/D flow (non-streaming).

    ``kv_transfer_params_override`` replaces what P returned (tests use it to
    send prompt B with prompt A's KV).
    """
    rid = request_id or f"kvd-demo-{uuid.uuid4().hex}"
    pre = complete(prefill_url, prefill_request(request), rid, timeout_s)
    params = pre.kv_transfer_params
    if kv_transfer_params_override is not None:
        params = kv_transfer_params_override
    body = dict(request)
    if params is not None:
        body["kv_transfer_params"] = params
    dec = complete(decode_url, body, rid, timeout_s)
    return PDResult(rid, pre, dec, params)


# ----------------------------------------------------------------- /metrics

def parse_prometheus(text: str) -> dict[tuple[str, tuple], float]:
    """Parse Prometheus text exposition into {(name, sorted labels): value}."""
    out: dict[tuple[str, tuple], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            if "{" in line:
                name, rest = line.split("{", 1)
                labels_s, value_s = rest.rsplit("}", 1)
                labels = []
                for part in _split_labels(labels_s):
                    k, v = part.split("=", 1)
                    labels.append((k.strip(), v.strip().strip('"')))
                key = (name.strip(), tuple(sorted(labels)))
            else:
                name, value_s = line.split(None, 1)
                key = (name.strip(), ())
            out[key] = float(value_s.split()[0])
        except ValueError:
            continue
    return out


def _split_labels(s: str) -> list[str]:
    parts, cur, in_q, esc = [], [], False, False
    for ch in s:
        if esc:
            cur.append(ch)
            esc = False
        elif ch == "\\":
            esc = True
            cur.append(ch)
        elif ch == '"':
            in_q = not in_q
            cur.append(ch)
        elif ch == "," and not in_q:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


def metric_sum(metrics: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """Sum of every sample named ``name`` whose labels include ``labels``."""
    total = 0.0
    for (n, lbls), v in metrics.items():
        if n != name:
            continue
        d = dict(lbls)
        if all(d.get(k) == val for k, val in labels.items()):
            total += v
    return total


def engine_metrics(base_url: str) -> dict[tuple[str, tuple], float]:
    """An engine's Prometheus ``/metrics`` (at ``base_url``) as
    ``{(name, sorted labels): value}``."""
    return parse_prometheus(get_text(base_url.rstrip("/") + "/metrics"))
