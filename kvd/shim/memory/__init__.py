"""How a worker hands its KV cache to the daemon: one module per kind of memory.

- ``auto``     :func:`~kvd.shim.memory.auto.choose` picks the implementation
  by the tensors' device (the only place that decides).
- ``base``     the :class:`~kvd.shim.memory.base.KvSharing` interface, in the
  order the worker calls it.
- ``shm``      CPU tensors as POSIX shared memory (``ShmSharing``).
- ``cuda_ipc`` CUDA tensors as CUDA IPC handles (``CudaIpcSharing``).
- ``staged``   the staged data path's block copies to and from the daemon's
  mirrors (shm or VRAM).
- ``regions``  the region maths all of them share.

torch only: nothing here imports vLLM, NIXL or the daemon.
"""
