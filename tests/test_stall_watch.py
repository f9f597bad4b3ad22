"""The event-loop stall watch (kvd.daemon.stall_watch): a late wake is
logged with each thread's CPU seconds, and a stall past ``stall_dump_s``
writes every thread's Python stack to the log, in a real daemon too."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import urllib.request

import pytest

from kvd.daemon.metrics import Metrics
from kvd.daemon.stall_watch import StallWatch, describe_gap, describe_machine, machine_cpu, thread_cpu
from kvd.testing.daemons import start_daemon
from kvd.testing.util import wait_until


def test_thread_cpu_names_this_thread_and_counts_its_cpu():
    before = thread_cpu()
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:  # spin: CPU on this thread only
        pass
    after = thread_cpu()
    assert any(name == "MainThread" for name, _ in after.values()), after
    gap = describe_gap(before, after)
    assert gap.startswith("MainThread["), gap


def test_the_machine_cpu_breakdown_is_in_percent_of_all_cpus():
    before = (100, 0, 50, 850, 0, 0, 0, 0)
    after = (110, 600, 440, 850, 0, 0, 0, 0)   # 1,000 ticks: nice 600, system 390, user 10, idle 0
    assert describe_machine(before, after) == "user 1 %, nice 60 %, system 39 %, idle 0 %, iowait 0 %, steal 0 %"
    assert describe_machine((), after) == "not known"
    assert len(machine_cpu()) == 8 and sum(machine_cpu()) > 0


def test_a_blocked_loop_is_logged_and_its_stacks_written(caplog, capfd):
    async def main():
        w = StallWatch(stall_dump_s=0.5, tick_s=0.1, warn_s=0.3)
        w.start()
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.2:  # the loop runs nothing meanwhile; this thread spins
            pass
        await asyncio.sleep(0.3)
        await w.stop()
        return w

    with caplog.at_level(logging.WARNING, logger="kvd.stall"):
        w = asyncio.run(main())
    assert w.stalls == 1 and 0.8 < w.longest_s < 5, (w.stalls, w.longest_s)
    (rec,) = [r for r in caplog.records if "event loop stalled" in r.getMessage()]
    assert "MainThread" in rec.getMessage() and "Python stack is written" in rec.getMessage(), rec.getMessage()
    assert "the machine's CPUs: user" in rec.getMessage(), rec.getMessage()
    err = capfd.readouterr().err
    # The watchdog thread's dump, written while the loop was blocked.
    assert "most recent call first" in err and "test_stall_watch.py" in err, err[-2000:]


def test_a_stall_shows_in_the_metrics_while_it_lasts_and_in_the_lag_histogram_after():
    """The loop blocked for 1.5 s: a scrape from another thread meanwhile
    answers and reads the loop's tick age growing (the core's stats need
    the loop: left out, a warning); once the loop runs again the late tick
    is in ``kvd_event_loop_lag_seconds`` and counted a stall."""
    from prometheus_client.parser import text_string_to_metric_families

    def stats() -> dict:
        raise TimeoutError()  # as Server._stats_threadsafe while the loop is stalled

    metrics = Metrics(stats)
    port = metrics.serve(0, "127.0.0.1")
    during: dict[str, float] = {}

    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    async def main():
        w = StallWatch(stall_dump_s=0, tick_s=0.05, warn_s=0.5)
        w.on_tick = metrics.watch_loop(w.tick_age)
        w.start()
        await asyncio.sleep(0.3)
        before = scrape()
        reader = threading.Timer(1.0, lambda: during.update(scrape()))
        reader.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:  # the loop runs nothing meanwhile
            pass
        reader.join()
        await asyncio.sleep(0.2)
        await w.stop()
        return w, before

    try:
        w, before = asyncio.run(main())
        after = scrape()
    finally:
        metrics.stop()
    assert before["kvd_event_loop_tick_age_seconds"] < 0.5 and before["kvd_event_loop_stalls_total"] == 0
    assert 0.9 <= during["kvd_event_loop_tick_age_seconds"] < 5, during
    assert "kvd_engines" not in during  # the core's stats: not served without the loop
    assert w.stalls == 1 and after["kvd_event_loop_stalls_total"] == 1
    assert after["kvd_event_loop_lag_seconds_count"] > before["kvd_event_loop_lag_seconds_count"] + 2
    assert after["kvd_event_loop_lag_seconds_sum"] >= 1.0
    assert after["kvd_event_loop_tick_age_seconds"] < 0.5
    assert w.tick_age() == 0.0  # stopped: a loop no longer watched does not read as stalled


def test_no_dump_when_off_and_no_warning_when_on_time(caplog, capfd):
    async def main():
        w = StallWatch(stall_dump_s=0, tick_s=0.05, warn_s=0.5)
        w.start()
        await asyncio.sleep(0.4)
        await w.stop()
        return w

    with caplog.at_level(logging.WARNING, logger="kvd.stall"):
        w = asyncio.run(main())
    assert w.stalls == 0 and not [r for r in caplog.records if r.name == "kvd.stall"]
    assert "most recent call first" not in capfd.readouterr().err


def test_a_nixl_call_that_does_not_return_is_logged_once_with_the_stacks_and_its_end_said(caplog, capfd,
                                                                                        monkeypatch):
    """The daemon's NIXL thread (``kvd.core.runtime.NixlThread``) inside one
    call past ``stall_dump_s`` while the loop runs on: one WARNING naming
    the call, every thread's stack (the call's frame in it), and a WARNING
    when it returns; calls shorter than that say nothing. The metric
    ``kvd_nixl_call_age_seconds`` grows meanwhile and is 0 between calls."""
    from kvd.core.runtime import NixlThread

    release = threading.Event()

    def get_xfer_status_that_hangs():  # as a UCX call that never returns would
        release.wait(30)
        return "DONE"

    def quick():
        return 1

    def stats() -> dict:
        raise TimeoutError()  # the core's stats: not read here

    monkeypatch.setattr("kvd.daemon.metrics.RENDER_REUSE_S", 0.0)  # each scrape renders: the ages are read now
    metrics = Metrics(stats)
    port = metrics.serve(0, "127.0.0.1")

    def age() -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        (v,) = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "kvd_nixl_call_age_seconds"]
        return v

    async def main():
        nixl = NixlThread("kvd-nixl-test")
        metrics.watch_nixl(nixl.current)
        w = StallWatch(stall_dump_s=0.4, tick_s=0.05, warn_s=5, nixl_call=nixl.current)
        w.start()
        try:
            for _ in range(20):
                assert await nixl.call(quick) == 1
            await asyncio.sleep(0.5)
            assert w.nixl_stalls == 0 and nixl.current() is None
            ages = [await asyncio.to_thread(age)]
            hung = nixl.call(get_xfer_status_that_hangs)
            await asyncio.sleep(1.2)  # the loop runs on meanwhile: three times the bound
            ages.append(await asyncio.to_thread(age))
            stalls = w.nixl_stalls
            release.set()
            assert await hung == "DONE"
            await asyncio.sleep(0.3)
            ages.append(await asyncio.to_thread(age))
        finally:
            await w.stop()
            nixl.shutdown()
        return stalls, w, ages

    try:
        with caplog.at_level(logging.WARNING, logger="kvd.stall"):
            stalls, w, ages = asyncio.run(main())
    finally:
        metrics.stop()
    assert stalls == 1 and w.nixl_stalls == 1 and w.stalls == 0
    assert ages[0] == 0 and ages[1] >= 1.0 and ages[2] == 0, ages  # kvd_nixl_call_age_seconds
    msgs = [r.getMessage() for r in caplog.records if r.name == "kvd.stall"]
    (stuck,) = [m for m in msgs if "has been inside" in m]
    assert "get_xfer_status_that_hangs" in stuck and "stall_dump_s 0.4" in stuck, stuck
    (ended,) = [m for m in msgs if "returned after about" in m]
    assert "get_xfer_status_that_hangs" in ended, ended
    err = capfd.readouterr().err
    assert err.count("Stall: the NIXL thread has been inside") == 1, err[-2000:]
    assert "in get_xfer_status_that_hangs" in err, err[-2000:]  # the stuck call's frame in the dump


def test_a_stopped_daemon_says_so_when_it_runs_again(tmp_path):
    """SIGSTOP for 3 s (every thread stopped), then SIGCONT: the daemon's log
    has the late-wake WARNING, at most one stack dump (the watch re-arms it
    in time while the loop runs), and the daemon serves on and stops
    cleanly."""
    d = start_daemon(str(tmp_path), "stall", "--stall-dump-s", "1")
    try:
        time.sleep(1.5)
        d.pause(True)
        time.sleep(3.0)
        d.pause(False)
        wait_until(lambda: "event loop stalled" in d.log(), 20, "the stall logged")
        log = d.log()
        assert "threads that ran:" in log, d.log_tail(40)
        # The stack dump races SIGCONT: the loop may tick before the watchdog
        # thread looks (the dump is checked above, in-process). Once at most.
        assert log.count("Stall: the event loop has not run") <= 1, d.log_tail(60)
        assert d.stats().peer_address
    finally:
        code = d.stop()
    assert code == 0, (code, d.log_tail(40))


def test_an_engine_session_is_weighted_below_the_daemons_where_autogroups_are_on(tmp_path):
    """The vLLM stacks weigh each engine's session with ENGINE_NICE: with
    autogroups on, a thread's own nice does not weigh it against another
    session's threads (sched(7)), so ``nice -n`` alone left the engines at
    the daemons' weight. The autogroup's nice is what the kernel reads."""
    from kvd.testing.processes import ProcessSet, set_autogroup_nice
    from kvd.testing.vllm_engines import ENGINE_NICE

    try:
        enabled = open("/proc/sys/kernel/sched_autogroup_enabled").read().strip() == "1"
    except OSError:
        enabled = False
    if not enabled:
        pytest.skip("autogroups are off here (sched_autogroup_enabled)")
    with ProcessSet(tmp_path) as procs:
        child = procs.start("sleeper", ["sleep", "30"])
        before = open(f"/proc/{child.pid}/autogroup").read()
        assert before.endswith("nice 0\n"), before
        assert set_autogroup_nice(child.pid, ENGINE_NICE)
        assert open(f"/proc/{child.pid}/autogroup").read().endswith(f"nice {ENGINE_NICE}\n")
        # Our own session is another group, untouched.
        assert open("/proc/self/autogroup").read() != open(f"/proc/{child.pid}/autogroup").read()
    assert not set_autogroup_nice(child.pid, ENGINE_NICE)  # gone: False, no exception
