"""The one place kvd imports ``nixl``: a thin wrapper over one NIXL agent.

Each method is one NIXL step; the handle each returns and who releases it is
stated. All methods are blocking native calls: the daemon calls them from its
single NIXL thread (``kvd.core.node.Node``), never from the event loop, and
never from two threads at once (agents are made with NIXL's default
``NIXL_THREAD_SYNC_NONE``).

Descriptors are numpy ``int64`` arrays of shape ``(N, 3)``: rows of
``(address, length in bytes, device id)``, the form ``nixl_agent.get_xfer_descs``
accepts without a Python loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

DRAM = "DRAM"
VRAM = "VRAM"


class NixlError(RuntimeError):
    """A NIXL call failed; the message names the step and the agent."""


def _nixl():
    # Imported lazily so that ``import kvd`` (and the engine-side shim) never
    # loads NIXL or its torch dependency.
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:  # pragma: no cover - depends on the install
        raise NixlError(f"cannot import nixl: {e}; install nixl==1.5.1") from e
    return nixl_agent, nixl_agent_config


def available_plugins() -> list[str]:
    """NIXL backend plugins found on this machine (e.g. ``["UCX", "POSIX"]``)."""
    nixl_agent, nixl_agent_config = _nixl()
    probe = nixl_agent("kvd-plugin-probe", nixl_agent_config(backends=[]))
    return list(probe.get_plugin_list())


@dataclass
class XferState:
    """State of one posted transfer: ``"PROC"``, ``"DONE"`` or ``"ERR"``."""

    state: str


class NixlAgent:
    """One NIXL agent, owned by the daemon for one engine worker.

    Args:
        name: agent name, unique across every peer it will ever talk to
            (the daemon uses ``kvd-<engine_id>-r<rank>-<random>``).
        backends: backend plugin names, e.g. ``["UCX"]`` (the seed's default).

    Raises:
        NixlError: a backend is missing or fails to initialise; the message
            names it (issue 3, capability 6).
    """

    def __init__(self, name: str, backends: list[str] | None = None):
        nixl_agent, nixl_agent_config = _nixl()
        backends = list(backends or ["UCX"])
        # No NIXL progress thread: the daemon's own poll (check_xfer_state,
        # get_new_notifs on the NIXL thread) progresses UCX. Measured here
        # (/tmp two-daemon loop, 16 x 64 KiB): same or lower latency, and an
        # idle daemon at ~3 % of a core instead of ~35 % (the UCX thread
        # spins in ucp_worker_arm with memory registered).
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        plugins = self._agent.get_plugin_list()
        for b in backends:
            if b not in plugins:
                raise NixlError(f"NIXL backend {b!r} is not available (plugins here: {sorted(plugins)})")
            try:
                self._agent.create_backend(b, {})
            except Exception as e:
                raise NixlError(f"NIXL backend {b!r} failed to initialise: {e}") from e
        self.name = name
        self.backends = backends

    # -- memory ----------------------------------------------------------------
    def register_dram(self, addr: int, length: int):
        """Registers ``length`` bytes at ``addr`` as DRAM with every backend.

        Returns the registration descriptor list; release with
        :meth:`deregister`.
        """
        try:
            return self._agent.register_memory([(addr, length, 0, "")], DRAM)
        except Exception as e:
            raise NixlError(f"{self.name}: register_memory({length} bytes) failed: {e}") from e

    def deregister(self, reg) -> None:
        """Releases a registration from :meth:`register_dram`."""
        self._agent.deregister_memory(reg)

    # -- metadata --------------------------------------------------------------
    def metadata(self) -> bytes:
        """This agent's metadata, to send to peers at handshake."""
        return self._agent.get_agent_metadata()

    def add_remote(self, metadata: bytes) -> str:
        """Loads a peer's metadata; returns its agent name.

        Raises:
            NixlError: the metadata is malformed or truncated.
        """
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise NixlError(f"{self.name}: add_remote_agent failed: {e}") from e
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        """Forgets a peer (and disconnects from it)."""
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:  # the peer may already be gone
            log.debug("%s: remove_remote_agent(%s): %s", self.name, name, e)

    # -- descriptor lists ------------------------------------------------------
    def prep_local(self, descs: np.ndarray):
        """Prepares the local side: rows of (addr, len, 0) in DRAM.

        Returns a prepped dlist handle; release with :meth:`release_dlist`.
        """
        return self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, DRAM)

    def prep_remote(self, remote_agent: str, descs: np.ndarray):
        """Prepares the remote side for ``remote_agent`` (from :meth:`add_remote`)."""
        try:
            return self._agent.prep_xfer_dlist(remote_agent, descs, DRAM)
        except Exception as e:
            raise NixlError(f"{self.name}: prep_xfer_dlist for {remote_agent} failed: {e}") from e

    def release_dlist(self, handle) -> None:
        """Releases a handle from :meth:`prep_local` / :meth:`prep_remote`."""
        self._agent.release_dlist_handle(handle)

    # -- transfers -------------------------------------------------------------
    def post(self, op: str, local, local_idx: np.ndarray, remote, remote_idx: np.ndarray, notif: bytes):
        """Makes and posts one transfer (``op`` is ``"READ"`` or ``"WRITE"``).

        ``local_idx[i]`` (into the local prepped list) and ``remote_idx[i]``
        (into the remote one) name the i-th pair of blocks. The peer receives
        ``notif`` once every byte has moved.

        Returns ``(handle, state)``; release the handle with :meth:`release`
        once the state is DONE or ERR.
        """
        try:
            h = self._agent.make_prepped_xfer(op, local, local_idx, remote, remote_idx, notif)
        except Exception as e:
            raise NixlError(f"{self.name}: make_prepped_xfer failed: {e}") from e
        try:
            state = self._agent.transfer(h)
        except Exception as e:
            self.release(h)
            raise NixlError(f"{self.name}: transfer post failed: {e}") from e
        return h, state

    def state(self, handle) -> str:
        """``"PROC"``, ``"DONE"`` or ``"ERR"`` for a posted transfer."""
        try:
            return self._agent.check_xfer_state(handle)
        except Exception:
            return "ERR"

    def release(self, handle) -> bool:
        """Releases a transfer handle; False when NIXL refused (still in flight)."""
        try:
            self._agent.release_xfer_handle(handle)
            return True
        except Exception as e:
            log.warning("%s: release_xfer_handle: %s", self.name, e)
            return False

    def notifs(self) -> dict[str, list[bytes]]:
        """New notifications since the last call: ``{remote agent: [msg, ...]}``."""
        return self._agent.get_new_notifs()

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        """Sends a bare notification (no transfer) to ``remote_agent``."""
        self._agent.send_notif(remote_agent, msg)
