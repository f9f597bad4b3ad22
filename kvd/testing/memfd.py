"""A sealed memfd standing in for an engine's KV cache (the fd handover
path, ``kvd.fd_wire``), for harnesses that play engines over raw gRPC."""

from __future__ import annotations

import fcntl
import mmap
import os

import numpy as np

from kvd.client.fd_handover import hand_over
from kvd.testing.shm import ShmSegment
from kvd.v1 import kvd_pb2 as pb

ALL_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class MemfdSegment(ShmSegment):
    """A memfd of ``size`` bytes, sealed with ``seals`` (0: none; the
    default: shrink, grow and seal), mapped (``mm``, ``array`` as
    :class:`ShmSegment`). :meth:`segment` hands it over to the daemon of
    ``engine_socket`` and returns the ``MEMORY_KIND_MEMFD`` segment naming
    it, so ``kvd.testing.sessions.register_request`` can use it. Nothing is
    named in /dev/shm. Raises OSError (memfd_create, ftruncate, seals)."""

    def __init__(self, size: int, engine_socket: str, seals: int = ALL_SEALS, sealable: bool = True):
        self.name = ""
        self.path = ""
        self.engine_socket = engine_socket
        self.fd = os.memfd_create("kvdtest-kv", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealable else 0))
        try:
            os.ftruncate(self.fd, size)
            if seals:
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
            self.mm = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        self.array = np.frombuffer(self.mm, dtype=np.uint8)

    def segment(self) -> pb.Segment:
        """Hands the fd over (a fresh id each call) and returns its segment."""
        (fd_id,) = hand_over(self.engine_socket, [self.fd])
        return pb.Segment(kind=pb.MEMORY_KIND_MEMFD, fd_id=fd_id, size=self.size)

    def close(self) -> None:
        """Unmaps (unless a view is still exported) and closes the fd."""
        self.array = None
        try:
            self.mm.close()
        except BufferError:
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
