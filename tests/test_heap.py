"""The daemon's heap while it serves (``kvd.daemon.heap``): what startup
made is frozen, the collector's thresholds set; a daemon exports its
collections (``python_gc_*``)."""

from __future__ import annotations

import gc
import urllib.request

import pytest

from kvd.daemon import heap
from kvd.testing.daemons import start_daemon
from kvd.testing.util import free_port


@pytest.fixture
def restored_gc():
    """This process's collector as it was, after the test."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_settle_freezes_what_exists_and_sets_the_thresholds(restored_gc):
    kept = [object() for _ in range(10)], {"a": [1]}  # tracked containers made before: frozen with the rest
    heap.settle()
    assert gc.get_freeze_count() >= len(gc.get_referents(kept)) > 0
    assert gc.get_threshold() == heap.THRESHOLDS
    # Made after: tracked as usual (a cycle dropped now is still collected).
    cycle = []
    cycle.append(cycle)
    assert gc.is_tracked(cycle)
    del cycle
    assert gc.collect() >= 1


def test_a_daemon_exports_its_garbage_collections(tmp_path):
    port = free_port()
    d = start_daemon(str(tmp_path), "gc", "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        assert d.stop() == 0
    for gen in "012":
        assert f'python_gc_collections_total{{generation="{gen}"}}' in text
