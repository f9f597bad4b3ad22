"""Engine-side shims: the code that runs inside an inference engine.

- ``kvd.shim.cpu_share``  makes CPU KV cache tensors shareable by name (POSIX
  shared memory) and describes them as ``kvd.v1`` segments and regions. It
  imports torch, never vLLM.
- ``kvd.shim.cuda_share`` makes CUDA KV cache tensors shareable by CUDA IPC
  handle (torch's ``_share_cuda_``) and describes them the same way; its
  ``VramStaging`` copies blocks to and from the daemon's VRAM mirrors
  (issue 7, docs/GPU.md). torch, no vLLM.
- ``kvd.shim.staging``    the staged data path's copies between the KV cache
  and the daemon's staging mirrors (torch, no vLLM).
- ``kvd.shim.vllm``       ``KvdConnector``, the vLLM KV connector (the only
  module here that imports vLLM).

None imports ``nixl`` or the daemon: an engine process needs neither.
"""
