"""Peers for tests: a NIXL agent in a process of its own (a peer agent
that can be frozen with SIGSTOP or killed apart from any daemon), NIXL
metadata with one byte of its UCX address changed, and a tiny KV layout for
in-process nodes.

Run ``[sys.executable, "-c", PEER_AGENT, name, nbytes]``: the agent
``name`` registers ``nbytes`` bytes filled with 0xAB, prints one line
``MD <metadata hex> <base address>`` and waits for a line on stdin.
"""

from kvd.core.layout import Layout, Region

# A tiny cache for in-process nodes (kvd.core.node.Node): 16 blocks of 16
# tokens, two regions (K and V) of 1 KiB blocks, one segment of SIZE bytes.
BLEN = 1024
LAYOUT = Layout(16, 16, "NHD", "float16", 2, 16, 1, (BLEN, BLEN))
REGIONS = [Region(0, 0, BLEN, BLEN), Region(0, 16 * BLEN, BLEN, BLEN)]
SIZE = 2 * 16 * BLEN


def ucx_info_offset(md: bytes) -> int:
    """Where the UCX connection info (a UCX worker address) starts in NIXL
    1.5 metadata: after ``t`` ``UCX`` ``|`` ``c`` and its 8-byte length."""
    return md.index(b"UCX|c") + len(b"UCX|c") + 8


def with_ucx_version(md: bytes, version: int) -> bytes:
    """``md`` with the version bits (the low 4) of its UCX address's header
    byte set to ``version``: one byte changed. UCX 1.23 stops a process that
    loads an address of a version but 0 or 1 (SIGABRT)."""
    b = bytearray(md)
    i = ucx_info_offset(md)
    b[i] = (b[i] & 0xF0) | version
    return bytes(b)

PEER_AGENT = r"""
import ctypes, mmap, sys
from kvd.core.nixl_agent import NixlAgent
agent = NixlAgent(sys.argv[1])
m = mmap.mmap(-1, int(sys.argv[2]))
m[:] = b"\xab" * len(m)
base = ctypes.addressof(ctypes.c_char.from_buffer(m))
agent.register_dram(base, len(m))
print("MD", agent.metadata().hex(), base, flush=True)
sys.stdin.readline()
"""
