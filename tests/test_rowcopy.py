"""kvd's native row copy (``kvd.core._rowcopy``, kvd/core/_rowcopy.c): the
same-node copy's rows copied without the GIL, cut among threads by bytes.

- the extension is built by the project's install where a C compiler is found
  (setup.py), and ``kvd version`` says so;
- it copies exactly what one ``memmove`` a row copies, for every cut of the
  bytes among threads (ranges starting and ending inside rows), and touches
  nothing else;
- bad arguments are errors, before any byte moves;
- a daemon told ``--copy-threads 3`` copies a same-node load on three threads
  (its plan line says so) byte exact, rows of 40 KiB cut across threads.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kvd.core import local_copy
from kvd.testing.daemons import start_daemon
from kvd.testing.sessions import Engine, KvShape, event_kind


def test_the_native_row_copy_is_built_where_a_compiler_is_found():
    """setup.py's extension is optional (an install without a compiler goes
    on); here, with one, it must have been built, or every same-node copy
    would silently run one memmove a row on one thread."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the install skips the native row copy")
    assert local_copy._native is not None, "kvd.core._rowcopy missing: run scripts/setup.sh, or .venv/bin/pip install --no-deps --no-build-isolation -e ."
    # An install whose build failed keeps an older .so of a checkout in
    # place (the extension is optional): it must not be older than its source.
    import os

    source = os.path.join(os.path.dirname(local_copy.__file__), "_rowcopy.c")
    if os.path.exists(source):
        assert os.path.getmtime(local_copy._native.__file__) >= os.path.getmtime(source), \
            "kvd.core._rowcopy is older than kvd/core/_rowcopy.c: its last build failed or did not run (pip -v shows why)"
    out = subprocess.run([sys.executable, "-m", "kvd.cli", "version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "native row copy: yes" in out.stdout, out.stdout + out.stderr


def _rows(rng, nrows: int, max_len: int):
    """Random rows between two buffers: distinct, non-overlapping slots of
    each, shuffled, lengths 0..max_len bytes. Returns (src, dst, d, s, n)."""
    slot = max_len + 64
    src = np.frombuffer(rng.bytes(slot * nrows), np.uint8).copy()
    dst = np.zeros(slot * nrows + 4096, np.uint8)
    n = rng.integers(0, max_len + 1, nrows).astype(np.int64)
    s = src.ctypes.data + rng.permutation(nrows).astype(np.int64) * slot + rng.integers(0, 64, nrows)
    d = dst.ctypes.data + rng.permutation(nrows).astype(np.int64) * slot + rng.integers(0, 64, nrows)
    return src, dst, d.astype(np.int64), s.astype(np.int64), n


@pytest.mark.skipif(local_copy._native is None, reason="kvd was installed without a C compiler")
@pytest.mark.parametrize("threads, min_bytes", [(1, 1 << 20), (2, 1), (3, 1000), (7, 1), (64, 1), (200, 1)])
def test_every_cut_among_threads_copies_what_one_memmove_a_row_copies(threads, min_bytes):
    rng = np.random.default_rng(threads * 1000 + min_bytes)
    for nrows, max_len in ((1, 100_000), (5, 7), (37, 65536), (300, 3000)):
        src, dst, d, s, n = _rows(rng, nrows, max_len)
        want = dst.copy()
        base = dst.ctypes.data
        for di, si, ni in zip(d.tolist(), s.tolist(), n.tolist()):
            o = di - base
            want[o:o + ni] = src[si - src.ctypes.data:si - src.ctypes.data + ni]
        local_copy._native.copy_rows(d, s, n, threads, min_bytes)
        assert np.array_equal(dst, want), (nrows, max_len)


@pytest.mark.skipif(local_copy._native is None, reason="kvd was installed without a C compiler")
def test_copy_rows_takes_lists_and_arrays_alike_and_the_fallback_agrees(monkeypatch):
    rng = np.random.default_rng(7)
    src, dst, d, s, n = _rows(rng, 50, 5000)
    local_copy.copy_rows(d.tolist(), s.tolist(), n.tolist(), 4)
    got = dst.copy()
    dst[:] = 0
    monkeypatch.setattr(local_copy, "_native", None)
    local_copy.copy_rows(d, s, n, 4)
    assert np.array_equal(dst, got) and dst.any()
    assert local_copy.copy_threads(0) == 1 and local_copy.copy_threads(5) == 1, "no native piece: one thread"


@pytest.mark.skipif(local_copy._native is None, reason="kvd was installed without a C compiler")
def test_bad_arguments_are_errors_and_copy_nothing():
    dst, src = ctypes.create_string_buffer(64), ctypes.create_string_buffer(b"y" * 64)
    d = np.array([ctypes.addressof(dst)], np.int64)
    s = np.array([ctypes.addressof(src)], np.int64)
    copy = local_copy._native.copy_rows
    with pytest.raises(ValueError, match="one length"):
        copy(d, s, np.array([8, 8], np.int64), 1, 1)
    with pytest.raises(ValueError, match="negative"):
        copy(d, s, np.array([-1], np.int64), 1, 1)
    with pytest.raises(ValueError, match="overflows"):
        copy(np.repeat(d, 2), np.repeat(s, 2), np.array([2**62, 2**62], np.int64), 1, 1)
    with pytest.raises(TypeError, match="int64"):
        copy(d.astype(np.int32), s, np.array([8], np.int64), 1, 1)
    with pytest.raises(TypeError, match="int64"):
        copy(d.astype(np.uint64), s, np.array([8], np.int64), 1, 1)
    with pytest.raises(TypeError, match="int64"):
        copy(d.astype(">i8"), s, np.array([8], np.int64), 1, 1)
    with pytest.raises(TypeError):
        copy(d, s, np.array([8], np.int64), "2", 1)  # threads not an int
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        copy(d, s, np.arange(4, dtype=np.int64)[::2], 1, 1)
    assert dst.raw == bytes(64), "a refused call copied bytes"
    copy(d, s, np.array([0], np.int64), 0, 0)  # nothing to copy; threads and bytes clamped
    assert dst.raw == bytes(64)


@pytest.mark.skipif(local_copy._native is None, reason="kvd was installed without a C compiler")
def test_copy_threads_follows_the_setting_or_the_cpus():
    import os

    cpus = local_copy.usable_cpus()
    assert local_copy.copy_threads(1) == 1
    assert local_copy.copy_threads(64) == cpus, "more threads than CPUs only wait, and make longer pieces"
    assert local_copy.copy_threads(0) == max(1, min(local_copy.AUTO_COPY_THREADS, cpus))
    assert local_copy.usable_cpus() <= len(os.sched_getaffinity(0))


def test_a_cgroup_cpu_quota_caps_the_threads(tmp_path):
    """A sidecar with limits.cpu 1.5 (cgroup v2 cpu.max "150000 100000")
    copies on at most 2 threads whatever the node's CPUs; v1's CFS files
    the same; no quota ("max", -1, no files): the affinity mask."""
    import os

    cpus = len(os.sched_getaffinity(0))
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert local_copy.usable_cpus(str(v2)) == min(cpus, 2)
    (v2 / "cpu.max").write_text("50000 100000\n")
    assert local_copy.usable_cpus(str(v2)) == 1
    (v2 / "cpu.max").write_text("max 100000\n")
    assert local_copy.usable_cpus(str(v2)) == cpus
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert local_copy.usable_cpus(str(tmp_path / "v1")) == 1
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert local_copy.usable_cpus(str(tmp_path / "v1")) == cpus
    assert local_copy.usable_cpus(str(tmp_path / "none")) == cpus
    for odd in ("inf 100000", "1e400 100000", "1e300 1e-300", "100000 inf", "", "100000", "x y", "0 100000"):
        (v2 / "cpu.max").write_text(odd)  # no kernel writes these; none may stop the daemon
        assert local_copy.usable_cpus(str(v2)) == cpus, odd
    if local_copy._native is not None:
        (v2 / "cpu.max").write_text("100000 100000\n")
        assert local_copy.copy_threads(0, str(v2)) == 1 and local_copy.copy_threads(3, str(v2)) == 1


def test_copy_threads_out_of_range_is_a_config_error():
    from kvd.config import ConfigError, load_config

    assert load_config(environ={"KVD_COPY_THREADS": "8"}).copy_threads == 8
    for bad in ("-1", "65"):
        with pytest.raises(ConfigError, match="copy_threads .*out of range 0..64"):
            load_config(environ={"KVD_COPY_THREADS": bad})


@pytest.mark.skipif(local_copy._native is None, reason="kvd was installed without a C compiler")
def test_a_daemon_copies_a_load_on_its_threads_byte_exact_and_says_how_many(tmp_path):
    """``--copy-threads 3``: three threads where the daemon may use three
    CPUs, else as many as it may (and a WARNING says the setting was
    capped); the copy byte exact either way, rows cut among threads."""
    threads = min(3, local_copy.usable_cpus())
    shape = KvShape(num_layers=4, num_blocks=40, block_len=40 << 10)  # rows of 40 KiB: cuts fall inside rows
    ids_p, ids_d = list(range(39, 7, -1)), list(range(32))  # 32 blocks x 8 regions x 40 KiB = 10 MiB
    daemon = start_daemon(str(tmp_path), "kvd", "--copy-threads", "3")
    p = Engine(daemon, "p-threads", shape, seed=3, memfd=True)
    d = Engine(daemon, "d-threads", shape, memfd=True)
    try:
        p.hold("t-p", ids_p)
        d.load("t-d", ids_d, p, ids_p, "t-p")
        ev = d.wait("t-d")
        assert event_kind(ev) == "recv_done", ev
        assert ev.recv_done.bytes == len(ids_d) * shape.num_regions * shape.block_len
        assert d.same_blocks(ids_d, p, ids_p)
        untouched = sorted(set(range(shape.num_blocks)) - set(ids_d))
        assert not d.kv[:, untouched].any()
        log = daemon.log()
        assert (f"same-node copy plan with engine=p-threads rank=0: 1 chunk(s) x 1 slot(s), {threads} copy "
                f"thread(s)") in log
        capped = f"copy_threads = 3 capped to {threads}, the CPUs this daemon may use"
        assert (capped in log) == (threads < 3), log[-3000:]
        assert (f"same-node copies in host memory: {threads} copy thread(s) (native row copy)" in log) == (threads == 3)
    finally:
        p.close()
        d.close()
        assert daemon.stop() == 0


_NO_THREADS = """
#include <errno.h>
#include <pthread.h>
int pthread_create(pthread_t *t, const pthread_attr_t *a, void *(*f)(void *), void *arg) { return EAGAIN; }
"""

_COPY_WITHOUT_THREADS = """
import logging, sys
import numpy as np
from kvd.core import local_copy
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
src = np.random.default_rng(1).integers(0, 255, 16 << 20, dtype=np.uint8)
dst = np.zeros_like(src)
rows = 256
d = dst.ctypes.data + np.arange(rows, dtype=np.int64)[::-1] * (64 << 10)
s = src.ctypes.data + np.arange(rows, dtype=np.int64) * (64 << 10)
local_copy.copy_rows(d, s, np.full(rows, 64 << 10, np.int64), 4)
want = src.reshape(rows, -1)[::-1].reshape(-1)
print("EXACT" if np.array_equal(dst, want) else "WRONG")
"""


@pytest.mark.skipif(local_copy._native is None, reason="kvd was installed without a C compiler")
def test_copy_threads_that_cannot_start_leave_their_bytes_to_the_caller_and_a_warning(tmp_path):
    """A thread or memory limit makes ``pthread_create`` fail (here: a
    preloaded one that always does): every byte is still copied, by the
    calling thread, and a WARNING says so."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler for the failing pthread_create")
    (tmp_path / "nothreads.c").write_text(_NO_THREADS)
    lib = tmp_path / "nothreads.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "nothreads.c")], check=True, timeout=60)
    import os

    r = subprocess.run([sys.executable, "-c", _COPY_WITHOUT_THREADS], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "LD_PRELOAD": str(lib), "OPENBLAS_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "EXACT" in r.stdout, r.stdout + r.stderr
    assert "copy thread(s) could not start (pthread_create failed" in r.stdout, r.stdout
    r = subprocess.run([sys.executable, "-c", _COPY_WITHOUT_THREADS], capture_output=True, text=True, timeout=120)
    assert "EXACT" in r.stdout and "could not start" not in r.stdout, r.stdout + r.stderr
