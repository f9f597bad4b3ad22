"""Engine-side shims: the code that runs inside an inference engine.

- ``kvd.shim.cpu_share``  makes CPU KV cache tensors shareable by name (POSIX
  shared memory) and describes them as ``kvd.v1`` segments and regions. It
  imports torch, never vLLM.
- ``kvd.shim.vllm``       ``KvdConnector``, the vLLM KV connector (the only
  module here that imports vLLM).

Neither imports ``nixl`` or the daemon: an engine process needs neither.
"""
