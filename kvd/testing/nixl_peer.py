"""A NIXL agent in a process of its own, for tests that need a peer agent
that can be frozen (SIGSTOP) or killed apart from any daemon.

Run ``[sys.executable, "-c", PEER_AGENT, name, nbytes]``: the agent
``name`` registers ``nbytes`` bytes filled with 0xAB, prints one line
``MD <metadata hex> <base address>`` and waits for a line on stdin.
"""

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
