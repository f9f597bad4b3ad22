"""CPU KV cache tensors -> sealed memfds handed to the daemon by fd
(:class:`MemfdSharing`, what ``kvd.shim.memory.auto`` picks for CPU tensors
where memfd sealing works; docs/SECURITY.md "Memory handover").

Why not a name in /dev/shm (``kvd.shim.memory.shm``): any process that can
guess a name and has the permissions can open it; an engine can
``ftruncate`` its own segment under the daemon's mapping, and the daemon's
next access past the new end raises SIGBUS (mmap(2)) and kills it for every
engine; and a name outlives both processes when neither unlinks it (a 1 GiB
``torch_*`` KV cache was left in /dev/shm after a P/D stack was stopped).
A memfd has no name anyone can open, is freed with its last fd or mapping,
and is sealed here before the daemon ever sees it:

- :func:`share_storage` makes a memfd (``memfd_create`` with
  ``MFD_ALLOW_SEALING``, memfd_create(2)) of the storage's size, seals it
  (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``, fcntl(2): its size can
  never change again, nor its seals), maps it through torch
  (``UntypedStorage.from_file('/proc/self/fd/N', shared=True)``), copies the
  bytes once and swaps the two storages' data pointers
  (``UntypedStorage._swap_data_ptr_``, torch 2.13): the KV cache's own
  StorageImpl then points at the memfd, so every view made before (vLLM's
  per-layer views, bound to the attention layers) follows, as with
  ``_share_filename_cpu_`` on the named path (checked in
  tests/test_fd_handover.py). The old heap bytes go with the temporary.
- :meth:`MemfdSharing.prepare` passes the fds over the daemon's fd side
  channel (``kvd.client.fd_handover``) before every ``RegisterEngine`` and
  puts the ids it answers into the segments (``MEMORY_KIND_MEMFD``,
  ``Segment.fd_id``); the daemon checks the seals and maps the fd.
- Nothing is named anywhere, so shutdown unlinks nothing: the pages go when
  the engine's mapping and the daemon's both have.

Offsets: a memfd holds the storage from its byte 0 (no header).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import logging
import mmap
import os

import torch

from kvd.client.fd_handover import hand_over
from kvd.shim.memory.shm import CpuShareError, SharedStorage, ShmSharing
from kvd.v1 import kvd_pb2 as pb

log = logging.getLogger("kvd.shim.memory.memfd")

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_CHUNK = 64 << 20  # bytes copied before the source's pages are given back

# Storages this process moved into memfds: data_ptr -> handle (idempotence;
# the memfd's fd stays open for re-registrations with a restarted daemon).
_MOVED: dict[int, SharedStorage] = {}


def available() -> bool:
    """True when this kernel makes sealable memfds (Linux 3.17+; some
    sandboxes forbid ``memfd_create``)."""
    if not hasattr(os, "memfd_create"):
        return False
    try:
        fd = os.memfd_create("kvd-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def sealed_memfd(nbytes: int, name: str = "kvd-kv-cache") -> int:
    """A new memfd of ``nbytes`` bytes sealed with :data:`SEALS`; the caller owns the fd.

    Raises:
        CpuShareError: memfd_create, ftruncate or the seals failed (the message says which).
    """
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as e:
        raise CpuShareError(f"memfd_create failed: {e.strerror or e}") from None
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError as e:
        os.close(fd)
        raise CpuShareError(f"memfd of {nbytes} bytes: cannot size or seal it: {e.strerror or e}") from None
    return fd


def share_storage(tensor: torch.Tensor) -> SharedStorage:
    """Moves ``tensor``'s storage into a sealed memfd; returns its handle
    (``fd`` set, ``name`` "", ``data_offset`` 0).

    Idempotent per storage. Every view of the storage stays valid (same
    StorageImpl, new data pointer).

    Raises:
        CpuShareError: not a CPU tensor, an empty storage, the memfd could not
            be made, or torch's private API behaved differently than expected.
    """
    if tensor.device.type != "cpu":
        raise CpuShareError(f"only CPU tensors can be shared as a memfd (got device {tensor.device})")
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0:
        raise CpuShareError("cannot share an empty storage")
    done = _MOVED.get(storage.data_ptr())
    if done is not None and done.nbytes == nbytes:
        return done
    fd = sealed_memfd(nbytes)
    try:
        mapped = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)
        _copy_releasing(mapped, storage)
        storage._swap_data_ptr_(mapped)  # the KV cache's StorageImpl now holds the memfd's pages
    except (AttributeError, RuntimeError, OSError) as e:
        os.close(fd)
        raise CpuShareError(f"torch {torch.__version__}: cannot move a storage into a memfd ({e})") from e
    del mapped  # now the old heap bytes: freed
    shared = SharedStorage(name="", data_offset=0, nbytes=nbytes, fd=fd)
    _MOVED[storage.data_ptr()] = shared
    return shared


def _copy_releasing(dst: torch.UntypedStorage, src: torch.UntypedStorage) -> None:
    """``dst.copy_(src)`` by chunks, giving each chunk's whole pages of
    ``src`` back to the kernel once copied (``MADV_DONTNEED``, madvise(2)):
    the move then needs the KV cache's size plus one chunk, not twice its size
    (a TP-2 engine with 1 GiB per worker was OOM-killed on a loaded 23 GiB
    host during a whole copy). ``src`` reads as zeros afterwards; it is
    swapped out of the KV cache right after."""
    n = src.nbytes()
    d = torch.empty(0, dtype=torch.uint8).set_(dst)
    s = torch.empty(0, dtype=torch.uint8).set_(src)
    page = mmap.PAGESIZE
    base = src.data_ptr()
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        d[lo:hi].copy_(s[lo:hi])
        first = -(-(base + lo) // page) * page
        last = (base + hi) // page * page
        if last > first:
            _libc.madvise(first, last - first, mmap.MADV_DONTNEED)  # a failure only keeps the pages


class MemfdSharing(ShmSharing):
    """CPU KV caches as sealed memfds handed over by fd (direct), or unnamed
    segments the daemon mirrors (staged); ``auto`` as :class:`ShmSharing`."""

    kind = "memfd"
    share_storage = staticmethod(share_storage)

    def prepare(self, request: pb.RegisterEngineRequest, engine_socket: str, deadline: float | None = None) -> None:
        """Hands the memfds over to the daemon of ``engine_socket`` and names
        them by their fresh ids in ``request``'s MEMFD segments (see
        :meth:`KvSharing.prepare`); until ``deadline``, waits for a daemon
        still starting (the same memfds, sent once it listens). Raises
        ``HandoverError``."""
        if self.data_path != "direct" or self.shared is None:
            return
        fds = [s.fd for s in self.shared.storages]
        ids = hand_over(engine_socket, fds, deadline=deadline)
        for seg, fd_id in zip(request.segments, ids):
            seg.fd_id = fd_id

    def close(self) -> list[str]:
        """Nothing is named: nothing to unlink (the memfds stay open until the
        process ends, as the storages mapping them live as long)."""
        return super().close()
