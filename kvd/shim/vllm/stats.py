"""Transfer statistics of KvdConnector workers, in the shapes vLLM collects.

``KvdKVConnectorStats`` travels from each worker to vLLM's frontend and is
logged there ("KV Transfer metrics: ..."); ``KvdPromMetrics`` feeds the same
data into ``vllm:kvd_*`` metrics on vLLM's /metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvd.v1 import kvd_pb2 as pb


@dataclass
class KvdKVConnectorStats(KVConnectorStats):
    """Transfer statistics of KvdConnector workers, in the shape vLLM handles.

    vLLM collects ``get_kv_connector_stats()`` from every worker after each
    step (``kv_connector_model_runner_mixin.py:102``), merges the workers'
    with :meth:`aggregate` (``kv_connector/utils.py:132-142``), ships
    ``data`` to the frontend, rebuilds it there with
    :meth:`KvdConnector.build_kv_connector_stats`, aggregates the interval and
    logs :meth:`reduce` ("KV Transfer metrics: ...",
    ``kv_connector/v1/metrics.py:65-104``). ``data`` holds plain lists of
    numbers (serializable), one entry per event; the keys follow
    NixlKVConnectorStats where the meaning is the same:

    - ``transfer_duration`` (s), ``post_duration`` (s), ``bytes_transferred``,
      ``num_descriptors``, ``num_blocks``: one entry per finished load, from
      the daemon's ``RecvDone`` (duration = command arrival at the daemon ->
      NIXL done; post duration = time inside NIXL's post calls, NIXL
      telemetry's ``postDuration`` as NixlConnector records it);
    - ``num_failed_transfers``: a 1 per failed load (``LoadFailed``, a
      rejected load, a load the scheduler could not even send);
    - ``num_kv_expired_reqs``: a 1 per hold whose lease ran out with no
      reader (``SendDone.expired``; recorded on P).
    """

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self) -> None:
        """Empties ``data``: one empty list per key."""
        self.data: dict[str, list[float | int]] = {
            "transfer_duration": [],
            "post_duration": [],
            "bytes_transferred": [],
            "num_descriptors": [],
            "num_blocks": [],
            "num_failed_transfers": [],
            "num_kv_expired_reqs": [],
        }

    def record_transfer(self, done: pb.RecvDone) -> None:
        """Appends one finished load from the daemon's ``RecvDone`` (durations in
        seconds, bytes, descriptors, blocks)."""
        self.data["transfer_duration"].append(float(done.duration_s))
        self.data["post_duration"].append(float(done.post_duration_s))
        self.data["bytes_transferred"].append(int(done.bytes))
        self.data["num_descriptors"].append(int(done.num_descriptors))
        self.data["num_blocks"].append(int(done.num_blocks))

    def record_failed_transfer(self) -> None:
        """Counts one failed load (``LoadFailed``, a rejected or unsent load)."""
        self.data["num_failed_transfers"].append(1)

    def record_kv_expired_req(self) -> None:
        """Counts one hold whose lease expired with no reader (``SendDone.expired``)."""
        self.data["num_kv_expired_reqs"].append(1)

    @property
    def num_successful_transfers(self) -> int:
        """Number of finished loads recorded."""
        return len(self.data.get("transfer_duration", ()))

    def is_empty(self) -> bool:
        """True when no load, failure or expiry is recorded (vLLM asks after every step)."""
        d = self.data  # called after every step: no generator (engine-step cost)
        return not (d.get("transfer_duration") or d.get("num_failed_transfers") or d.get("num_kv_expired_reqs"))

    def clone_and_reset(self) -> KvdKVConnectorStats:
        """A copy holding the current ``data``; this instance starts empty (what
        ``get_kv_connector_stats`` hands vLLM)."""
        out = KvdKVConnectorStats(data=self.data)
        self.reset()
        return out

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Appends ``other``'s entries to this one's and returns self (vLLM merges
        the workers' stats with it, ``kv_connector/utils.py:132-142``)."""
        if not other.is_empty():
            for k, v in other.data.items():
                self.data.setdefault(k, []).extend(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary vLLM logs as "KV Transfer metrics": counts, mean
        and P90 transfer and post time (ms), MB per transfer, throughput (MB/s),
        mean descriptors, failures and expired leases
        (``kv_connector/v1/metrics.py:65-104``)."""
        import numpy as np

        failures = {
            "Num failed transfers": len(self.data.get("num_failed_transfers", ())),
            "Num KV expired reqs": len(self.data.get("num_kv_expired_reqs", ())),
        }
        n = self.num_successful_transfers
        if n == 0:
            return {"Num successful transfers": 0, "Avg xfer time (ms)": 0, "P90 xfer time (ms)": 0,
                    "Avg post time (ms)": 0, "P90 post time (ms)": 0, "Avg MB per transfer": 0, "Throughput (MB/s)": 0, "Avg number of descriptors": 0,
                    **failures}
        t = np.asarray(self.data["transfer_duration"], dtype=np.float64)
        post = np.asarray(self.data.get("post_duration") or [0.0], dtype=np.float64)
        mb = np.asarray(self.data["bytes_transferred"], dtype=np.float64) / 2**20
        descs = np.asarray(self.data["num_descriptors"], dtype=np.float64)
        seconds = float(t.sum())
        return {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(float(t.mean()) * 1e3, 3),
            "P90 xfer time (ms)": round(float(np.percentile(t, 90)) * 1e3, 3),
            "Avg post time (ms)": round(float(post.mean()) * 1e3, 3),
            "P90 post time (ms)": round(float(np.percentile(post, 90)) * 1e3, 3),
            "Avg MB per transfer": round(float(mb.sum()) / n, 3),
            "Throughput (MB/s)": round(float(mb.sum()) / seconds, 3) if seconds > 0 else 0,
            "Avg number of descriptors": round(float(descs.mean()), 1),
            **failures,
        }


class KvdPromMetrics(KVConnectorPromMetrics):
    """vLLM's /metrics for KvdConnector: ``vllm:kvd_*`` histograms and counters
    fed from :class:`KvdKVConnectorStats` data (``KVConnectorProm.observe``)."""

    def __init__(self, vllm_config: VllmConfig, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric):
            """``metric`` labelled per engine (vLLM's ``create_metric_per_engine``)."""
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        self.histograms = {
            "transfer_duration": per_engine(self._histogram_cls(
                name="vllm:kvd_xfer_time_seconds",
                documentation="KV cache loads through kvd: command arrival at the daemon to NIXL done.",
                buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0],
                labelnames=labelnames)),
            "post_duration": per_engine(self._histogram_cls(
                name="vllm:kvd_post_time_seconds",
                documentation="KV cache loads through kvd: time inside NIXL's post calls.",
                buckets=[1e-5, 1e-4, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0],
                labelnames=labelnames)),
            "bytes_transferred": per_engine(self._histogram_cls(
                name="vllm:kvd_bytes_transferred", documentation="Bytes per KV cache load through kvd.",
                buckets=[2 ** (10 + i) for i in range(1, 25, 2)], labelnames=labelnames)),
            "num_descriptors": per_engine(self._histogram_cls(
                name="vllm:kvd_num_descriptors", documentation="NIXL descriptors per KV cache load through kvd.",
                buckets=[10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000],
                labelnames=labelnames)),
        }
        self.counters = {
            "num_failed_transfers": per_engine(self._counter_cls(
                name="vllm:kvd_num_failed_transfers", documentation="KV cache loads through kvd that failed.",
                labelnames=labelnames)),
            "num_kv_expired_reqs": per_engine(self._counter_cls(
                name="vllm:kvd_num_kv_expired_reqs",
                documentation="Prefill requests whose KV lease expired with no reader (on the P instance).",
                labelnames=labelnames)),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        """Feeds one stats ``data`` dict (see :class:`KvdKVConnectorStats`) into the
        ``vllm:kvd_*`` histograms and counters of engine ``engine_idx``."""
        for key, metric in self.histograms.items():
            for value in transfer_stats_data.get(key, ()):
                metric[engine_idx].observe(value)
        for key, metric in self.counters.items():
            for value in transfer_stats_data.get(key, ()):
                metric[engine_idx].inc(value)
