"""The engine-side gRPC client of the local kvd daemon (no NIXL, no vLLM).

``EngineClient`` keeps every network round trip off the engine's step: commands
go out on one long-lived session stream from a background thread, and events
come back into a local queue that the engine drains.
"""

from kvd.client.engine_client import EngineClient, EngineClientError, EngineSocketDenied, normalize_address

__all__ = ["EngineClient", "EngineClientError", "EngineSocketDenied", "normalize_address"]
