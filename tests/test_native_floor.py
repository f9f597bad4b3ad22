"""The native floor benchmark (benchmarks/native_floor.py): NIXL's C API,
from the nixl wheel, moves real bytes between two processes with no Python,
and every READ's notification reaches the source."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from benchmarks import native_floor as nf


@pytest.fixture(scope="module")
def binary():
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    return nf.build()


@pytest.mark.parametrize("progress_us, threads", [(0, 4), (3000, 0)])
def test_native_reads_move_blocks_and_every_notification_arrives(binary, progress_us, threads):
    r = subprocess.run([binary, "0.5", "8", "4096", "32", str(progress_us), str(threads)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["loads"] > 0 and res["loads"] % 8 == 0
    # 3 untimed batches of 8 before the window; the reader also checked that every block a READ
    # filled holds the source's bytes and every other one is untouched (it exits 3 otherwise).
    assert res["notifs_seen"] == res["loads"] + 3 * 8
    assert res["reader_cpu_us_per_load"] > 0 and res["source_cpu_us_per_load"] > 0
    assert (res["progress_us"], res["num_threads"]) == (progress_us, threads)


@pytest.mark.parametrize("args", [[], ["1", "0", "4096", "8"], ["1", "8", "4096", "8", "0", "4", "x"],
                                  ["nan", "8", "4096", "8"], ["inf", "8", "4096", "8"], ["1e-9", "8", "4096", "8"],
                                  ["1", "8", "1099511627776", "1048576"]])
def test_native_reads_refuse_bad_arguments(binary, args):
    r = subprocess.run([binary, *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 64 and ("usage" in r.stderr or "BATCH" in r.stderr), (r.returncode, r.stderr)


def test_the_summary_table_adds_the_engine_for_kvd_only():
    res = {"summary": {"NIXL from C, x": dict(median_batch_loads_s=50000.0, loads_s=40000.0,
                                              reader_cpu_us_per_load=16.0, source_cpu_us_per_load=10.0),
                       "kvd": dict(median_batch_loads_s=3000.0, loads_s=2500.0, reader_cpu_us_per_load=270.0,
                                   source_cpu_us_per_load=160.0, engine_cpu_us_per_load=90.0)}}
    lines = nf.text(res).splitlines()
    assert lines[1].split()[-2:] == ["-", "26.0"] and lines[2].split()[-1] == "520.0", lines


@pytest.mark.parametrize("args, says", [(["--seconds", "nan"], "--seconds must be"),
                                        (["--seconds", "inf"], "--seconds must be"),
                                        (["--rounds", "0"], "--rounds >= 1"),
                                        (["--json", "/nonexistent-dir/x.json"], "--json /nonexistent-dir/x.json")])
def test_native_floor_refuses_bad_arguments_before_running(args, says, capsys):
    with pytest.raises(SystemExit) as e:
        nf.main(args)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_the_coalesced_case_moves_each_batch_as_one_transfer():
    """The case that sizes kvd.core.coalesce: each batch one READ of its
    blocks, with a notification of a piece per load (real NIXL processes)."""
    from kvd.core.nixl_agent import PROGRESS_US

    res = nf.plain(0.3, PROGRESS_US, 0, batch=8, coalesced=True)
    assert res["loads"] > 0 and res["loads"] % 8 == 0
    assert res["reader_cpu_us_per_load"] > 0 and res["source_cpu_us_per_load"] > 0
