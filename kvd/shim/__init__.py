"""Engine-side shims: the code that runs inside an inference engine.

- ``kvd.shim.memory``  how a worker hands its KV cache to the daemon: POSIX
  shm (CPU), CUDA IPC (GPU), the staged path's copies; chosen by the
  tensors' device in ``kvd.shim.memory.auto``. torch, never vLLM.
- ``kvd.shim.vllm``    ``KvdConnector``, the vLLM KV connector (the only
  package here that imports vLLM).

None imports ``nixl`` or the daemon: an engine process needs neither.
"""
