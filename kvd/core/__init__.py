"""The daemon's core: engine registry, regions, leases, transfers (no gRPC, no vLLM)."""
