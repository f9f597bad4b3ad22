"""The daemon's heap while it serves (``kvd.daemon.heap``): what startup
made is frozen, CPython's thresholds kept; a daemon exports how many
objects it froze and its collections (``python_gc_*``)."""

from __future__ import annotations

import gc
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

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


def test_settle_freezes_what_exists_keeps_the_thresholds_and_still_collects_new_cycles(restored_gc):
    before = gc.get_threshold()
    kept = [object() for _ in range(10)], {"a": [1]}  # tracked containers made before: frozen with the rest
    heap.settle()
    assert gc.get_freeze_count() >= len(gc.get_referents(kept)) > 0
    assert gc.get_threshold() == before
    # Made after: tracked as usual (a cycle dropped now is still collected).
    cycle = []
    cycle.append(cycle)
    assert gc.is_tracked(cycle)
    del cycle
    assert gc.collect() >= 1


def test_a_serving_daemon_has_frozen_its_startup_heap_and_exports_its_collections(tmp_path):
    port = free_port()
    d = start_daemon(str(tmp_path), "gc", "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        assert d.stop() == 0
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    # The daemon's modules alone leave ~40,000 tracked objects (grpc, numpy, NIXL's bindings, protobuf).
    assert samples[("kvd_gc_frozen_objects", ())] > 10_000
    for gen in "012":
        assert samples[("python_gc_collections_total", (("generation", gen),))] >= 0
