"""``kvd bench``: the short data-plane benchmark (kvd vs plain NIXL vs memcpy)
and the shim's step cost (:mod:`kvd.bench.cli`). The full-size benchmarks,
the trace and the variants are the ``benchmarks`` package of the checkout."""
