"""The UCX settings kvd gives its NIXL agents unless the environment sets
them (``kvd.core.nixl_agent.UCX_DEFAULTS``). Without
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``, UCX turns ``cuda_ipc`` READs off where it
sees no NVLink and every VRAM READ on one H200 ran at 0.4 GB/s through its
TCP emulation instead of hundreds of GB/s (docs/GPU.md). Where no CUDA
driver loads, nothing is set: UCX would only warn of an unused variable."""

from __future__ import annotations

import os
import subprocess
import sys

from kvd.core import nixl_agent


def test_unset_settings_are_given_where_cuda_is_and_a_users_value_is_kept():
    env = {"UCX_TLS": "tcp"}
    assert nixl_agent.apply_ucx_defaults(env, cuda=True) == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    assert env == {"UCX_TLS": "tcp", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    mine = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}
    assert nixl_agent.apply_ucx_defaults(mine, cuda=True) == {}
    assert mine == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}
    none = {}
    assert nixl_agent.apply_ucx_defaults(none, cuda=False) == {} and none == {}


def test_an_agent_gets_the_setting_before_ucx_reads_it_and_a_cpu_host_no_warning():
    """A real agent (UCX backend) in a fresh process, the driver check forced
    on: the variable is in the C environment UCX's config parser reads
    (``getenv``; CPython writes ``os.environ`` through) once the backend is up.
    With the real check on this CPU-only host: nothing set, and UCX prints no
    "unused environment variable" warning."""
    code = ("import sys, ctypes; from kvd.core import nixl_agent as n; "
            "n._cuda_driver = (lambda: True) if sys.argv[1] == 'gpu' else n._cuda_driver; "
            "a = n.NixlAgent('ucx-defaults-probe'); libc = ctypes.CDLL(None); "
            "libc.getenv.restype = ctypes.c_char_p; v = libc.getenv(b'UCX_CUDA_IPC_ENABLE_GET_ZCOPY'); "
            "print('VALUE', v.decode() if v else '-'); a.close()")
    env = {k: v for k, v in os.environ.items() if k != "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"}

    def run(mode, extra=None):
        out = subprocess.run([sys.executable, "-c", code, mode], env={**env, **(extra or {})}, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split("VALUE ")[-1].split()[0], out.stdout + out.stderr

    assert run("gpu")[0] == "y"
    assert run("gpu", {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"})[0] == "n"
    if not nixl_agent._cuda_driver():
        value, output = run("cpu")
        assert value == "-" and "unused environment variable" not in output
