"""The UCX settings kvd gives its NIXL agents unless the environment sets
them (``kvd.core.nixl_agent.UCX_DEFAULTS``). Without
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``, UCX turns ``cuda_ipc`` READs off where it
sees no NVLink and every VRAM READ on one H200 ran at 0.4 GB/s through its
TCP emulation instead of 385-665 GB/s (docs/GPU.md): on the CPU the check is
that the setting reaches the process that creates agents, and that a user's
own value wins."""

from __future__ import annotations

import os
import subprocess
import sys

from kvd.core import nixl_agent


def test_unset_settings_are_given_and_a_users_value_is_kept():
    env = {"UCX_TLS": "tcp"}
    assert nixl_agent.apply_ucx_defaults(env) == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    assert env == {"UCX_TLS": "tcp", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    mine = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}
    assert nixl_agent.apply_ucx_defaults(mine) == {}
    assert mine == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}


def test_a_process_that_makes_an_agent_has_the_setting_before_ucx_reads_it():
    """A real agent (UCX backend) in a fresh process: the variable is in the
    environment UCX's config parser reads (``getenv``, hence ``os.environ``:
    CPython writes through to the C environment) by the time the backend is
    up; a value the user exported is left as it was."""
    code = ("import os; from kvd.core.nixl_agent import NixlAgent; a = NixlAgent('ucx-defaults-probe'); "
            "import ctypes; libc = ctypes.CDLL(None); libc.getenv.restype = ctypes.c_char_p; "
            "print(libc.getenv(b'UCX_CUDA_IPC_ENABLE_GET_ZCOPY').decode()); a.close()")
    env = {k: v for k, v in os.environ.items() if k != "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "y"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-1] == "n", out.stderr[-2000:]
