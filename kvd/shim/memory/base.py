"""The interface every memory-sharing implementation gives the worker.

One :class:`KvSharing` per registration, chosen by ``kvd.shim.memory.auto``
from the KV cache tensors' device. The vLLM worker
(``kvd.shim.vllm.worker``) calls, in this order:

1. :meth:`KvSharing.share` once, at ``register_kv_caches``: makes the KV
   cache reachable by the daemon (or only describes it, staged) and returns
   the segments, regions and layout of ``RegisterEngineRequest``;
   :attr:`KvSharing.wire_data_path` is the ``data_path`` to ask for.
2. :meth:`KvSharing.attach` with the ``RegisterEngineResponse`` (again after
   each re-registration): maps the daemon's staging mirrors when the daemon
   answered ``DATA_PATH_STAGED`` (:attr:`KvSharing.staging`).
3. Per step: :meth:`KvSharing.sync` before a hold goes out (the daemon reads
   the held blocks as soon as it has the hold); ``staging.copy_in`` /
   ``copy_out`` on the staged path.
4. :meth:`KvSharing.close` at shutdown, before ``UnregisterEngine``: drops
   what this process holds open (shm names, mirror mappings).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import torch

from kvd.shim.memory.staged import StagingMirror
from kvd.v1 import kvd_pb2 as pb

log = logging.getLogger("kvd.shim.memory")

#: ``kvd_data_path`` values (``kv_connector_extra_config``).
DATA_PATHS = ("direct", "staged", "auto")


class SharedKv(Protocol):
    """What :meth:`KvSharing.share` returns (``shm.SharedKvCaches``,
    ``cuda_ipc.SharedCudaKvCaches``).

    ``kv_in_block``: one region's block holds K and V together in a way the
    daemon cannot re-slice by tokens unless ``layout.kv_in_block`` says how.
    """

    segments: list[pb.Segment]
    regions: list[pb.Region]
    layout: pb.Layout
    kv_in_block: bool

    def cache_blocks(self) -> list[torch.Tensor]:
        """Per region, the ``[num_blocks, block_len]`` ``uint8`` view of the KV cache."""


class KvSharing(ABC):
    """One way of handing a worker's KV cache to the daemon (see the module).

    Args:
        data_path: ``"direct"``, ``"staged"`` or ``"auto"`` (``kvd_data_path``).

    Raises:
        ValueError: an unknown ``data_path``.
    """

    kind: ClassVar[str]
    """``"shm"`` or ``"cuda_ipc"``: the segments' memory kind."""

    def __init__(self, data_path: str = "direct"):
        if data_path not in DATA_PATHS:
            raise ValueError(f"data_path must be one of {', '.join(DATA_PATHS)} (got {data_path!r})")
        self.data_path = data_path
        self.shared: SharedKv | None = None
        self.staging: StagingMirror | None = None

    @abstractmethod
    def share(self, kv_caches: Mapping[str, torch.Tensor], **describe: Any) -> SharedKv:
        """Shares (or, staged, only describes) ``kv_caches`` (``layer -> tensor``).

        ``describe``: the fields of ``kvd.shim.memory.regions.KvDescription``
        (``num_blocks``, ``block_size`` in tokens, ``kv_layout``,
        ``num_kv_heads``, ``head_dim``, ``total_kv_heads``, ``groups``: layer
        -> KV-cache group).

        Raises:
            KvShareError (a kind of it): the KV cache cannot be shared here.
        """

    @property
    def wire_data_path(self) -> int:
        """``RegisterEngineRequest.data_path`` for :attr:`data_path`."""
        return {"direct": pb.DATA_PATH_DIRECT, "staged": pb.DATA_PATH_STAGED,
                "auto": pb.DATA_PATH_AUTO}[self.data_path]

    def attach(self, response: pb.RegisterEngineResponse) -> None:
        """After ``RegisterEngine``: maps the staging mirrors when the daemon
        chose the staged path (a re-registration maps its new mirrors).

        Raises:
            StagingError: the mirrors cannot be mapped.
        """
        if response.data_path != pb.DATA_PATH_STAGED:
            return
        if self.staging is not None:
            self.staging.remap(response.staging_segments)
            return
        shared = self.shared
        if shared is None:
            raise RuntimeError("KvSharing.attach before share")
        self.staging = StagingMirror(shared.cache_blocks(), shared.regions, [s.size for s in shared.segments],
                                     shared.layout.num_blocks, response.staging_segments)

    def prepare(self, request: pb.RegisterEngineRequest, engine_socket: str, deadline: float | None = None) -> None:
        """Before every ``RegisterEngine`` of ``request`` to the daemon of
        ``engine_socket`` (``EngineClient.before_register``): makes what the
        request names reachable for that daemon (the memfd path hands its fds
        over and fills in their ids), waiting until ``deadline``
        (``time.monotonic()``; None: not at all) for a daemon not up yet.
        Default: nothing to do (RegisterEngine itself waits for the daemon)."""

    def sync(self) -> None:
        """Makes the forward pass's KV writes visible to the daemon (before a
        hold). Host memory: nothing to do, the writes are done when the step's
        Python returns."""

    def close(self) -> list[str]:
        """Drops this process's hold on the shared memory (idempotent); returns
        the shm names unlinked, for the log. Call before ``UnregisterEngine``."""
        if self.staging is not None:
            self.staging.close()
        return []
