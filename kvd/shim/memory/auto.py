"""Picks the memory-sharing implementation for a worker's KV cache, by device.

As uvicorn's ``loops/auto.py`` picks an event loop: one function,
:func:`choose`, the only place that decides between

- ``kvd.shim.memory.memfd.MemfdSharing``: CPU tensors where sealable memfds
  work (sealed memfds handed over by fd; docs/SECURITY.md "Memory handover");
- ``kvd.shim.memory.shm.ShmSharing``: CPU tensors elsewhere (POSIX shm by
  name); both use unnamed segments the daemon mirrors for ``kvd_data_path``
  staged/auto;
- ``kvd.shim.memory.cuda_ipc.CudaIpcSharing``: CUDA tensors on one device
  (CUDA IPC handles; staged/auto decided with the daemon).

Everything else is refused with a :class:`KvShareError` naming what was
found: no tensors, tensors on several CUDA devices (one worker registers one
device, as one vLLM worker owns one GPU), CPU and CUDA tensors together, or
another device type.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvd.shim.memory.base import KvSharing
from kvd.shim.memory.cuda_ipc import CudaIpcSharing, CudaShareError
from kvd.shim.memory.regions import KvShareError
from kvd.shim.memory import memfd
from kvd.shim.memory.shm import ShmSharing


def kv_device(kv_caches: Mapping[str, torch.Tensor]) -> torch.device:
    """The one device every KV cache tensor is on.

    Raises:
        KvShareError: no tensors, or CPU and CUDA tensors together.
        CudaShareError: CUDA tensors on more than one device.
    """
    devices = {t.device for t in kv_caches.values()}
    if not devices:
        raise KvShareError("no KV cache tensors to register")
    types = {d.type for d in devices}
    if len(types) > 1:
        raise KvShareError(f"the KV cache is on {', '.join(sorted(map(str, devices)))}: one worker's KV cache "
                           "must be all CPU or all on one CUDA device")
    if len(devices) > 1:
        raise CudaShareError(f"the KV cache is on {', '.join(sorted(map(str, devices)))}: one worker's KV cache "
                             "must be on one CUDA device (one registration per device)")
    return next(iter(devices))


def choose(kv_caches: Mapping[str, torch.Tensor], data_path: str = "direct") -> KvSharing:
    """The sharing implementation for ``kv_caches`` (``layer -> tensor``, as
    vLLM passes ``register_kv_caches``) under ``kvd_data_path``.

    Raises:
        KvShareError: see :func:`kv_device`; a device type other than CPU and
            CUDA (the message names it).
        ValueError: an unknown ``data_path``.
    """
    device = kv_device(kv_caches)
    if device.type == "cpu":
        return memfd.MemfdSharing(data_path) if memfd.available() else ShmSharing(data_path)
    if device.type == "cuda":
        return CudaIpcSharing(data_path, device)
    raise KvShareError(f"the KV cache is on {device}: kvd shares CPU (POSIX shm) and CUDA (CUDA IPC) memory only")
