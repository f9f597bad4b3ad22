"""The one place kvd imports ``nixl``: a thin wrapper over one NIXL agent.

Each method is one NIXL step; the handle each returns and who releases it is
stated. All methods are blocking native calls: the daemon calls them on its
NIXL thread (``kvd.core.runtime``; the binding holds the GIL through most
native calls, so keep each call short; ``transfer()`` releases it while UCX
copies, ``benchmarks/gil_transfer.py``), a small READ's post also on the
event loop while that thread is idle (``Runtime.nixl_now``), and never from
two threads at once: agents are made with NIXL's default
``NIXL_THREAD_SYNC_NONE``, for which NIXL's UCX plugin makes its worker
``UCS_THREAD_MODE_SERIALIZED`` (nixl ``src/plugins/ucx/ucx_utils.cpp``,
1.5): any thread may call, one at a time, the caller serializing, which
``NixlThread`` does.

Descriptors are numpy ``int64`` arrays of shape ``(N, 3)``: rows of
``(address, length in bytes, device id)``, the form ``nixl_agent.get_xfer_descs``
accepts without a Python loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import difflib
import functools
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)

DRAM = "DRAM"
VRAM = "VRAM"

#: Bytes of an agent's warm-up scratch buffer (:meth:`NixlAgent.warm_read`):
#: one page, enough for UCX to take the path a block READ takes.
SCRATCH_BYTES = 4096
_ORPHANED_SCRATCH: list = []  # pages of agents dropped before their native agent was destroyed

#: Seconds an agent's native part outlives :meth:`NixlAgent.close` after its
#: warm-up (:meth:`NixlAgent.warm_up`): the probe agent's UCX answers the
#: warm-up's endpoint by connecting back to the agent's worker, and an agent
#: destroyed before that connect (an engine that registers and unregisters
#: or re-registers within ~50 ms, seen in 2 of 5 tries here) leaves UCX
#: ``ERROR connect(...) failed: Connection refused`` lines and a
#: ``net.core.somaxconn`` hint in the daemon's log. Harmless, but it reads
#: as a fault; 2 s is forty times the window it was seen in (a slow machine
#: under load stretches it).
WIRE_UP_GRACE_S = 2.0
_DEFERRED: list[tuple] = []  # (time.monotonic() to destroy at, its scratch page or None, native agent)
#: Agents waiting in ``_DEFERRED`` at most: past it the oldest is destroyed
#: at once. Each holds UCX workers, threads and sockets (an attacker review:
#: one uid registering and unregistering in a loop, ~20 a second here, kept
#: ~45 native agents, 739 fds and 57 threads alive against caps of 4 workers).
MAX_DEFERRED = 8


def destroy_deferred(now: float) -> int:
    """Destroys the native agents whose :data:`WIRE_UP_GRACE_S` has passed
    at ``now`` (``time.monotonic()``; ``math.inf``: all); returns how many
    wait still. Called on the NIXL thread only (the progress poll's)."""
    if _DEFERRED:
        _DEFERRED[:] = [d for d in _DEFERRED if d[0] > now]  # the last reference: NIXL's destructor runs here
    return len(_DEFERRED)


class NixlError(RuntimeError):
    """A NIXL call failed; the message names the step and the agent."""


class NixlBackendUnavailable(NixlError):
    """A backend name NIXL has no plugin for (a configuration error, not a failure to initialise)."""


_MD_HEAD = b"nixlSerDes|Agent"


def metadata_agent_name(metadata: bytes) -> str | None:
    """The agent name that NIXL (1.5) serializes first in agent metadata:
    ``nixlSerDes|Agent`` + 8-byte little-endian length + name + ``|``.
    None when the bytes do not start that way.

    Read before ``add_remote``: loading metadata of an agent that is loaded
    already merges it into that agent's entry (a replayed, mangled
    description once broke the real peer's memory sections).
    """
    start = len(_MD_HEAD) + 8
    if not metadata.startswith(_MD_HEAD) or len(metadata) <= start:
        return None
    n = int.from_bytes(metadata[len(_MD_HEAD):start], "little")
    if not 0 < n <= 4096 or metadata[start + n:start + n + 1] != b"|":
        return None
    try:
        return metadata[start:start + n].decode()
    except UnicodeDecodeError:
        return None


#: Backend entries a peer's metadata may list (NIXL writes one per backend
#: its agent made: kvd's agents make one or two).
MAX_METADATA_BACKENDS = 16

# UCX's packed worker address starts with a header byte whose low 4 bits are
# the address version (UCX ``src/ucp/wireup/address.c``,
# ``ucp_address_unpack_header``: ``UCP_ADDRESS_HEADER_VERSION_MASK``); UCX
# 1.x knows v1 (0) and v2 (1) and stops the whole process on an assertion
# for any other (``ucs_assertv_always``, kept in release builds).
_UCX_ADDRESS_VERSIONS = (0, 1)


def _serdes_field(metadata: bytes, pos: int, tag: bytes) -> tuple[bytes, int] | None:
    """One field of NIXL's ``nixlSerDes`` encoding at ``pos``: ``tag``, an
    8-byte little-endian length, that many bytes, ``|``. Returns ``(value,
    position after it)``, or None when the bytes there are not that field."""
    if metadata[pos:pos + len(tag)] != tag:
        return None
    p = pos + len(tag)
    if len(metadata) < p + 8:
        return None
    n = int.from_bytes(metadata[p:p + 8], "little")
    p += 8
    if n > len(metadata) - p - 1 or metadata[p + n:p + n + 1] != b"|":
        return None
    return metadata[p:p + n], p + n + 1


def metadata_problem(metadata: bytes) -> str | None:
    """What makes a peer's agent metadata unsafe to give NIXL, or None.

    NIXL 1.5 serializes an agent as ``Agent`` (its name), ``Conns`` (the
    number of backends), then per backend ``t`` (its name) and ``c`` (its
    connection info), then the memory section (NIXL
    ``nixlAgentData::getLocalMD``). Checked here: that layout up to the
    memory section, and that each UCX connection info, a UCX worker
    address, has a version UCX reads: NIXL hands the address to UCX, whose
    parser aborts the daemon on any other version (measured: one changed
    byte of real metadata, loaded by ``add_remote_agent``, killed the
    process with SIGABRT). The rest of a UCX address is parsed by UCX as it
    is, and some bytes crash it too (a second review's fuzz of every value
    of every byte of a 213-byte address: 6 segfaults in ~54,000 variants
    that pass this check); so metadata is taken only from a peer a
    credential or this host vouches for (``PeerClient.handshake``), and
    this check is the first, cheap refusal. The memory section is NIXL's
    to check (it refuses malformed ones)."""
    name = metadata_agent_name(metadata)
    if name is None:
        return "it does not start with an agent name as NIXL 1.5 writes it"
    pos = len(_MD_HEAD) + 8 + len(name.encode()) + 1
    conns = _serdes_field(metadata, pos, b"Conns")
    if conns is None or len(conns[0]) != 8:
        return "no backend list after the agent name, where NIXL 1.5 writes it"
    count, pos = int.from_bytes(conns[0], "little"), conns[1]
    if not 1 <= count <= MAX_METADATA_BACKENDS:
        return f"it lists {count} backends (1..{MAX_METADATA_BACKENDS} accepted)"
    for i in range(count):
        kind = _serdes_field(metadata, pos, b"t")
        info = _serdes_field(metadata, kind[1], b"c") if kind is not None else None
        if info is None:
            return f"its backend entry {i} is malformed"
        pos = info[1]
        if kind[0] == b"UCX":
            if not info[0]:
                return "its UCX connection info is empty"
            version = info[0][0] & 0x0F
            if version not in _UCX_ADDRESS_VERSIONS:
                return (f"its UCX worker address has version {version} (UCX reads "
                        f"{', '.join(map(str, _UCX_ADDRESS_VERSIONS))}, and aborts the process on any other)")
    return None


#: Default timeout (microseconds) of each agent's NIXL progress thread between
#: rounds when no UCX event arrives; 0 = no progress thread (the daemon's poll
#: loop alone progresses UCX). See :class:`NixlAgent`.
PROGRESS_US = 3000


def _import_nixl_without_torch() -> None:
    """Imports the ``nixl`` meta package without importing torch.

    ``nixl`` picks its wheel (``nixl_cu13``/``nixl_cu12``) by CUDA major
    version: it reads torch's ``version.py`` from disk, and when that says
    nothing (a CPU build of torch) it imports torch as a last resort (about
    100 MB of resident memory and a second of startup in every daemon,
    measured: idle daemon 264 -> 150 MiB RSS), only to fall back to the first
    wheel installed, as it does with no CUDA anyway. The daemon never uses
    torch: the last resort is skipped here, the rest of NIXL's choice is kept.
    """
    if "nixl" in sys.modules or "torch" in sys.modules:
        return
    try:
        import nixl_meta_utils as meta
    except ImportError:
        return
    real = meta.detect_cuda_major
    disk = getattr(meta, "_torch_cuda_version_from_disk", None)
    if disk is None:
        return

    def without_torch() -> int | None:
        if any(m in sys.modules for m in ("cuda.bindings", "cupy")):
            return real()
        version = disk()
        return int(version.split(".")[0]) if version else None

    meta.detect_cuda_major = without_torch
    try:
        import nixl  # noqa: F401
    finally:
        meta.detect_cuda_major = real


#: UCX settings kvd gives its agents unless the environment sets them.
#: ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY``: UCX's default ``auto`` turns the
#: ``cuda_ipc`` transport's READ (get) off where it finds no NVLink (UCX
#: ``uct_cuda_ipc_iface_get_max_get_zcopy``: "cuda-ipc get zcopy disabled as
#: no nvlinks detected"), and kvd's pull mode is READs: on one H200 (both
#: engines on the one GPU) every READ then fell to UCX's software emulation
#: over TCP, 0.4 GB/s for VRAM that a device copy moves at ~2,100 GB/s,
#: in-process NIXL agents alike (docs/GPU.md). ``y`` keeps the zero-copy lane.
UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


@functools.lru_cache(maxsize=1)
def _cuda_driver() -> bool:
    """Whether the CUDA driver library loads here (UCX's CUDA transports need
    it); asked once a process, not at every agent's creation."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def apply_ucx_defaults(environ=os.environ, cuda: bool | None = None) -> dict[str, str]:
    """Sets each of :data:`UCX_DEFAULTS` the environment leaves unset (UCX
    reads them when a backend is created); returns those it set. Only where
    the CUDA driver loads (``cuda``: None asks :func:`_cuda_driver`):
    elsewhere UCX has no ``cuda_ipc`` and warns of the variable as unused."""
    if not (_cuda_driver() if cuda is None else cuda):
        return {}
    applied = {k: v for k, v in UCX_DEFAULTS.items() if k not in environ}
    environ.update(applied)
    return applied


def _nixl():
    # Imported lazily so that ``import kvd`` (and the engine-side shim) never
    # loads NIXL or its torch dependency.
    for k, v in apply_ucx_defaults().items():  # once: later calls find them set
        log.info("%s=%s for NIXL's UCX (kvd's default; export it to choose another)", k, v)
    try:
        _import_nixl_without_torch()
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:  # pragma: no cover - depends on the install
        raise NixlError(f"cannot import nixl: {e}; install nixl==1.5.1") from e
    return nixl_agent, nixl_agent_config


@contextlib.contextmanager
def progress_delay(delay_us: int):
    """Within the block, NIXL agents get a progress thread that sleeps in
    ``poll()`` on the UCX workers' event fds for up to ``delay_us`` between
    rounds, instead of NIXL's Python default ``pthrDelay = 0`` (``poll`` with
    a zero timeout: a thread that spins a whole core even when idle).

    ``nixl_agent.__init__`` hard-codes ``pthrDelay = 0``; this wraps the native
    constructor it calls to set the delay first. Not thread-safe: the daemon
    makes agents on its one NIXL thread only.
    """
    _nixl()
    from nixl import _api

    bind = _api.nixlBind
    real = bind.nixlAgent

    def make(name, config):
        config.pthrDelay = int(delay_us)
        return real(name, config)

    bind.nixlAgent = make
    try:
        yield
    finally:
        bind.nixlAgent = real


_PROBES: dict[tuple[str, ...], "NixlAgent"] = {}


def _probe_metadata(backends: list[str]) -> bytes:
    """Metadata of this process's probe agent for ``backends`` (made on first
    use, kept for the process's life; nothing registered), what
    :meth:`NixlAgent.warm_up` loads. Called on the NIXL thread only."""
    key = tuple(backends)
    probe = _PROBES.get(key)
    if probe is None:
        # With its own progress thread, like any peer: the endpoints agents
        # open to it and close again at once see a peer that answers.
        probe = _PROBES[key] = NixlAgent(f"kvd-warm-up-probe-{os.getpid()}-{len(_PROBES)}", list(backends))
    return probe.metadata()


def available_plugins() -> list[str]:
    """NIXL backend plugins found on this machine (e.g. ``["UCX", "POSIX"]``)."""
    nixl_agent, nixl_agent_config = _nixl()
    probe = nixl_agent("kvd-plugin-probe", nixl_agent_config(backends=[]))
    return list(probe.get_plugin_list())


def _unbind(handle) -> None:
    """Drops a released NIXL handle wrapper's reference to its native agent
    (``nixl._api``'s wrappers keep it while they live, released or not), so
    that :meth:`NixlAgent.close` is not held up by a stale wrapper."""
    try:  # not contextlib.suppress: measured here ~3 us a call with it, ~0.1 us this way (once per transfer)
        handle._agent = None
    except (AttributeError, TypeError):
        pass


@dataclass(frozen=True)
class Unprepped:
    """A descriptor list NIXL has not prepared: each transfer makes the rows
    of just its own indices (``rows(idx)``: ``(n, 3)`` int64 rows) and hands
    them to NIXL's ``initialize_xfer``. Nothing to release.

    For lists too large to prepare on a request's path: preparing costs time
    per row of the whole cache (measured here: 131,072 rows in 4-110 ms,
    2M rows about 0.9 s), a transfer of ``n`` descriptors costs about the
    same either way (docs/PERFORMANCE.md, "First contact").
    """

    rows: Callable[[np.ndarray], np.ndarray]
    mem: str = DRAM
    agent: str = "NIXL_INIT_AGENT"  # the remote agent's name on the remote side


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
        progress_us: NIXL progress thread's poll timeout in microseconds
            (None: :data:`PROGRESS_US`; 0: no progress thread).

    Raises:
        NixlError: a backend is missing or fails to initialise; the message
            names it.
    """

    def __init__(self, name: str, backends: list[str] | None = None, progress_us: int | None = None):
        nixl_agent, nixl_agent_config = _nixl()
        backends = list(backends or ["UCX"])
        # NIXL's progress thread, sleeping in poll() on the UCX workers' event
        # fds (progress_us: its timeout) rather than spinning (NIXL's Python
        # default, pthrDelay 0: a whole core per agent, even idle). The source
        # side must progress as soon as a reader's READ arrives; with only the
        # daemon's 5 ms idle poll doing it, a 16 x 64 KiB load took ~6 ms
        # instead of ~2. Costs: ~0.5 % of a core per idle agent at 3 ms (1.4 %
        # at 1 ms), and ~10-15 % on 256 MiB reads (docs/PERFORMANCE.md,
        # "NIXL progress thread").
        progress_us = PROGRESS_US if progress_us is None else int(progress_us)
        try:
            if progress_us > 0:
                with progress_delay(progress_us):
                    self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=[]))
            else:
                self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        except RuntimeError as e:
            # NIXL 1.5 stats $HOME/.nixl.cfg when an agent is made, and a
            # HOME this user may not search fails it with only
            # "filesystem error: status: Permission denied [/root/.nixl.cfg]":
            # a HOME inherited from another user (sudo -E, setpriv).
            if ".nixl.cfg" in str(e) and "Permission denied" in str(e):
                raise NixlError(f"NIXL could not make an agent: {e}: NIXL reads its config file from $HOME "
                                f"({os.environ.get('HOME', '')}), which this user (uid {os.getuid()}) may not "
                                f"read; run the daemon with a HOME of its own (systemd's User=, runuser, su -), "
                                f"not one inherited from another user (sudo -E, setpriv)") from e
            raise
        plugins = self._agent.get_plugin_list()
        for b in backends:
            if b not in plugins:
                near = difflib.get_close_matches(b.upper(), [p.upper() for p in plugins], n=1)
                hint = next((f"; did you mean {p!r}?" for p in plugins if near and p.upper() == near[0]), "")
                raise NixlBackendUnavailable(f"NIXL backend {b!r} is not available (plugins here: "
                                             f"{sorted(plugins)}){hint}")
            try:
                self._agent.create_backend(b, {})
            except Exception as e:
                raise NixlError(f"NIXL backend {b!r} failed to initialise: {e}") from e
        self.name = name
        self.backends = backends
        self._scratch: np.ndarray | None = None  # warm-up READs' page, kept as long as the native agent
        self._scratch_reg = None
        self._warmed_at = -math.inf  # time.monotonic() at the end of warm_up()
        #: Set once this agent's metadata went to a peer (a handshake answered,
        #: a push order's reader): a peer may then READ from or WRITE into its
        #: memory through UCX, and only destroying the agent stops that.
        self.described = False
        self._metadata: bytes = self._agent.get_agent_metadata()

    # -- memory ----------------------------------------------------------------
    def register_memory(self, addr: int, length: int, mem: str = DRAM, dev: int = 0):
        """Registers ``length`` bytes at ``addr`` as ``mem`` (``DRAM`` or
        ``VRAM``; ``dev``: the GPU ordinal for VRAM) with every backend.

        Returns the registration descriptor list; release with
        :meth:`deregister`.
        """
        try:
            reg = self._agent.register_memory([(addr, length, dev, "")], mem)
        except Exception as e:
            raise NixlError(f"{self.name}: register_memory({length} bytes of {mem}) failed: {e}") from e
        self._metadata = self._agent.get_agent_metadata()
        return reg

    def register_dram(self, addr: int, length: int):
        """:meth:`register_memory` of DRAM."""
        return self.register_memory(addr, length, DRAM, 0)

    def deregister(self, reg) -> None:
        """Releases a registration from :meth:`register_dram`."""
        self._agent.deregister_memory(reg)
        self._metadata = self._agent.get_agent_metadata()

    def register_scratch(self) -> None:
        """Registers a daemon-owned DRAM page of :data:`SCRATCH_BYTES`, the
        source and the destination of new pairs' warm-up READs
        (:meth:`warm_read`); no engine's memory, nothing of value: every
        peer that loads this agent may READ and WRITE it. Call it with the
        engine's registrations, before the metadata goes to any peer: a peer
        that loaded this agent's metadata must not see it change.

        Raises:
            NixlError: NIXL refused the registration.
        """
        if self._scratch_reg is not None:
            return
        buf = np.zeros(SCRATCH_BYTES, dtype=np.uint8)
        self._scratch_reg = self.register_memory(buf.ctypes.data, SCRATCH_BYTES, DRAM, 0)
        self._scratch = buf

    @property
    def scratch_addr(self) -> int:
        """Address of the scratch page (:meth:`register_scratch`); 0: none."""
        return 0 if self._scratch is None else int(self._scratch.ctypes.data)

    def warm_read(self, remote_agent: str, addr: int):
        """Posts a READ of the scratch page of ``remote_agent`` at ``addr``
        (its :attr:`scratch_addr`, DRAM, :data:`SCRATCH_BYTES`) into this
        agent's own, with no notification: the pair's first transfer (UCX
        lane wire-up) happens here instead of in a request's READ. Both
        pages are daemon memory and the bytes are never used. Returns
        ``(handle, state)`` as :meth:`post` (release the handle once DONE or
        ERR; by force is safe too: the bytes can land nowhere but this
        agent's scratch page, which lives as long as the native agent).

        Raises:
            NixlError: no scratch page here (:meth:`register_scratch`), or
                NIXL refused the transfer (``addr`` is not registered memory
                of ``remote_agent``).
        """
        if self._scratch is None:
            raise NixlError(f"{self.name}: no scratch page registered")
        local = np.array([[self._scratch.ctypes.data, SCRATCH_BYTES, 0]], dtype=np.int64)
        remote = np.array([[addr, SCRATCH_BYTES, 0]], dtype=np.int64)
        one = np.zeros(1, dtype=np.int64)
        return self.post("READ", Unprepped(lambda idx: local[idx]), one,
                         Unprepped(lambda idx: remote[idx], DRAM, remote_agent), one, b"")

    # -- metadata --------------------------------------------------------------
    def metadata(self) -> bytes:
        """This agent's metadata, to send to peers at handshake: the bytes
        made at its last (de)registration, so any thread may read them and
        a handshake answer never queues behind the NIXL thread's work."""
        return self._metadata

    def add_remote(self, metadata: bytes) -> str:
        """Loads a peer's metadata; returns its agent name.

        Raises:
            NixlError: the metadata is malformed or truncated, or
                :func:`metadata_problem` finds it unsafe to give NIXL.
        """
        problem = metadata_problem(metadata)
        if problem:
            raise NixlError(f"{self.name}: peer agent metadata refused: {problem}")
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise NixlError(f"{self.name}: add_remote_agent failed: {e}") from e
        return name.decode() if isinstance(name, bytes) else str(name)

    def connect(self, name: str) -> None:
        """Starts UCX wire-up with a loaded peer now (NIXL ``make_connection``;
        it returns before the connection is up): the first transfer then
        finds it done or under way. Measured here on a busy machine: first
        READ 100-300 ms without, about 10 ms once the wire-up had 0.5 s.
        A failure is logged: the first transfer connects anyway."""
        try:
            self._agent.make_connection(name)
        except Exception as e:
            log.info("%s: make_connection(%s): %s", self.name, name, e)

    def warm_up(self) -> float:
        """Loads and forgets a probe agent (no memory registered, made once per
        process by :func:`_probe_metadata`): the first ``add_remote_agent`` of
        a new agent costs 20-120 ms here (UCX setting up the agent's worker
        for endpoints), the next ones 0.3-12 ms (measured with 1 MiB and
        1 GiB registrations alike, so not the memory): paid here, at
        registration, instead of on the first load to a new peer. Returns
        the seconds it took; a failure is logged, never raised."""
        t0 = time.monotonic()
        try:
            self.remove_remote(self.add_remote(_probe_metadata(self.backends)))
        except Exception as e:
            log.info("%s: warm-up with a probe agent failed (%s): the first peer pays it", self.name, e)
        self._warmed_at = time.monotonic()
        return self._warmed_at - t0

    def remove_remote(self, name: str) -> None:
        """Forgets a peer (and disconnects from it).

        Never while a transfer with it is in ``PROC``: NIXL 1.5 then reports
        that handle ``ERR`` at once ("remote agent was invalidated"), yet its
        UCX requests go on and their bytes still land (measured here with
        ``UCX_TLS=tcp`` and a SIGSTOPped source): the state would lie."""
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:  # the peer may already be gone
            log.debug("%s: remove_remote_agent(%s): %s", self.name, name, e)

    # -- descriptor lists ------------------------------------------------------
    def prep_local(self, descs: np.ndarray, mem: str = DRAM):
        """Prepares the local side: rows of (addr, len, device id) in ``mem``.

        Returns a prepped dlist handle; release with :meth:`release_dlist`.
        """
        return self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mem)

    def prep_remote(self, remote_agent: str, descs: np.ndarray, mem: str = DRAM):
        """Prepares the remote side for ``remote_agent`` (from :meth:`add_remote`):
        ``mem`` and the rows' device ids as the remote registered them."""
        try:
            return self._agent.prep_xfer_dlist(remote_agent, descs, mem)
        except Exception as e:
            raise NixlError(f"{self.name}: prep_xfer_dlist for {remote_agent} failed: {e}") from e

    def release_dlist(self, handle) -> None:
        """Releases a handle from :meth:`prep_local` / :meth:`prep_remote`
        (an :class:`Unprepped` list holds nothing)."""
        if not isinstance(handle, Unprepped):
            self._agent.release_dlist_handle(handle)
            _unbind(handle)

    # -- transfers -------------------------------------------------------------
    def post(self, op: str, local, local_idx: np.ndarray, remote, remote_idx: np.ndarray, notif: bytes):
        """Makes and posts one transfer (``op`` is ``"READ"`` or ``"WRITE"``).

        ``local_idx[i]`` (into the local list) and ``remote_idx[i]`` (into
        the remote one) name the i-th pair of descriptors. Both lists are
        prepped handles, or both :class:`Unprepped` (the rows of just these
        indices go to ``initialize_xfer``). The peer receives ``notif`` once
        every byte has moved.

        Returns ``(handle, state)``; release the handle with :meth:`release`
        once the state is DONE or ERR.
        """
        try:
            if isinstance(remote, Unprepped):
                h = self._agent.initialize_xfer(
                    op, self._agent.get_xfer_descs(local.rows(local_idx), local.mem),
                    self._agent.get_xfer_descs(remote.rows(remote_idx), remote.mem), remote.agent, notif)
            else:
                h = self._agent.make_prepped_xfer(op, local, local_idx, remote, remote_idx, notif)
        except Exception as e:
            raise NixlError(f"{self.name}: making the transfer failed: {e}") from e
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

    def release(self, handle, settled: bool = False) -> bool:
        """Releases a transfer handle once its transfer has ended; False (the
        handle kept) while it is still ``PROC`` or when NIXL refused.

        ``settled``: the caller saw the state DONE or ERR just now (the
        progress loop, a post), so it is not asked again.

        Why the state is checked first: NIXL 1.5's ``release_xfer_handle``
        accepts a handle in ``PROC`` (its UCX backend cancels the requests with
        ``ucp_request_cancel`` and frees them), but a READ that needs the
        peer's progress (``UCX_TLS=tcp``) is not stopped by that: measured
        here, the bytes landed when a SIGSTOPped source resumed, seconds after
        the release. A handle released only after DONE or ERR is one whose
        bytes can no longer arrive.
        """
        if not settled and self.state(handle) == "PROC":
            return False
        try:
            self._agent.release_xfer_handle(handle)
            _unbind(handle)
            return True
        except Exception as e:
            log.warning("%s: release_xfer_handle: %s", self.name, e)
            return False

    def __del__(self):
        # A native agent not destroyed (close() refused: a handle still bound
        # to it) may still move bytes into the scratch page: keep the page.
        page = getattr(self, "_scratch", None)
        if page is not None and getattr(getattr(self, "_agent", None), "agent", None) is not None:
            _ORPHANED_SCRATCH.append(page)

    def close(self, defer: bool = False) -> bool:
        """Destroys the native agent now; False (nothing destroyed) while a
        transfer or list handle of it is not released. Every later call on
        this object fails (a :class:`NixlError`, ``"ERR"``, or False).

        ``defer``: the caller has deregistered every registration and no
        transfer of the agent into an engine's memory is in ``PROC`` (a
        warm-up READ into the scratch page may be: the page is kept as long
        as the agent); then an agent warmed up less
        than :data:`WIRE_UP_GRACE_S` ago and never :attr:`described` to a
        peer is destroyed that long after its warm-up instead
        (:func:`destroy_deferred`), and True is returned. A described agent
        is destroyed at once: a peer's WRITE (push mode) or READ over
        ``UCX_TLS=tcp`` is served by this agent's UCX progress, which would
        touch the engine's memory after the caller unmaps it (measured: the
        daemon died with SIGSEGV when a SIGSTOPped source resumed its WRITE
        after the reader's worker unregistered within 2 s of registering).

        The one way to stop a READ that needs the peer's progress when the
        peer does not answer: NIXL 1.5 has no cancel for it (``release`` and
        ``remove_remote`` leave the UCX request running), while destroying
        the agent destroys its UCX workers, which closes each endpoint with
        force and purges its requests. Measured here with ``UCX_TLS=tcp`` and
        a SIGSTOPped source: with the agent destroyed (10-90 ms), nothing
        landed when the source resumed; with the handle only released, the
        bytes landed.
        """
        native = getattr(self._agent, "agent", None)
        if native is None:
            return True
        # References: the attribute, ``native`` and getrefcount's argument.
        # Any other (a handle NIXL's wrapper still binds) would keep it alive.
        if sys.getrefcount(native) > 3:
            return False
        if self._scratch_reg is not None:  # no transfer is left that could land in it
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(self._scratch_reg)
            self._scratch_reg = None
        self._agent.agent = None
        due = self._warmed_at + WIRE_UP_GRACE_S
        if defer and not self.described and time.monotonic() < due:
            # With the scratch page: a warm-up READ still in flight (released by
            # force at the unregister) may land in it until the destruction.
            if len(_DEFERRED) >= MAX_DEFERRED:
                del _DEFERRED[0]  # the oldest, destroyed now: at worst its UCX logs a refused connect
            _DEFERRED.append((due, self._scratch, native))  # a tuple drops its last item first: the agent
        del native  # the last reference unless deferred: NIXL's destructor runs here
        self._metadata = b""
        return True

    def notifs(self) -> dict[str, list[bytes]]:
        """New notifications since the last call: ``{remote agent: [msg, ...]}``."""
        return self._agent.get_new_notifs()

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        """Sends a bare notification (no transfer) to ``remote_agent``."""
        self._agent.send_notif(remote_agent, msg)
