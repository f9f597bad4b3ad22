"""KvdConnector inside vLLM 0.32's real scheduler, against a fake daemon:
what the worker sets up. Its configuration keys, the registration of vLLM's
KV cache (segments, regions, layout; the regions address vLLM's own views),
the direct, staged and auto data paths (a staged prefill copies computed
blocks into the daemon's mirror, again after a daemon restart), and the KV
cache's memory at shutdown (no segment left, mirrors closed first).

The in-process engine loop (``tests/vllm_inproc.py``: vLLM's own
``Scheduler`` and a worker-side ``KvdConnector``, no model) is the one
``test_shim_vllm_transfers.py`` drives; that module tests the transfers
(prefill hand-off, decode loads, hybrid allocator groups, stats).
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import re

import pytest
import torch

if os.environ.get("KVD_SKIP_VLLM") == "1":
    pytest.skip("KVD_SKIP_VLLM=1", allow_module_level=True)
pytest.importorskip("vllm")

from kvd.addresses import join_host_port, split_host_port  # noqa: E402
from kvd.shim.vllm import KvdConnector, KvdShimConfig, as_groups, first_group  # noqa: E402
from kvd.shim.vllm import config as shim_config  # noqa: E402
from kvd.shim.vllm.metadata import KvdWorkerPath  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from kvd.testing.util import wait_until  # noqa: E402
from kvd.v1 import kvd_pb2 as pb  # noqa: E402
from vllm_inproc import (  # noqa: E402
    BS, HEAD, KV_HEADS, LAYERS, NB, Engine, kv_cache_config, make_request, prefill_request, vllm_config,
)


# ------------------------------------------------------------------ helpers
def test_config_keys_and_addresses():
    cfg = KvdShimConfig.from_extra({"kvd_socket": "/s.sock", "kvd_lease_s": "12", "kvd_peer_address": "[::1]:5"})
    assert (cfg.socket, cfg.lease_s, cfg.load_timeout_s, cfg.peer_address) == ("/s.sock", 12.0, 0.0, "[::1]:5")
    with pytest.raises(ValueError, match="kvd_socket"):
        KvdShimConfig.from_extra({})
    with pytest.raises(ValueError, match="kvd_load_timeout_s"):
        KvdShimConfig.from_extra({"kvd_socket": "/s", "kvd_load_timeout_s": -1})
    with pytest.raises(ValueError, match="host:port"):
        KvdShimConfig.from_extra({"kvd_socket": "/s", "kvd_peer_address": "nope"})
    assert split_host_port("[::1]:5") == ("::1", 5) and join_host_port("::1", 5) == "[::1]:5"
    assert join_host_port("10.0.0.1", "80") == "10.0.0.1:80"
    assert first_group([[1, 2], [3]]) == [1, 2] and first_group([4, 5]) == [4, 5] and first_group([]) == []
    assert as_groups([[1, 2], [3]]) == [[1, 2], [3]] and as_groups((4, 5)) == [[4, 5]] and as_groups(None) == []
    assert KvdShimConfig.from_extra({"kvd_socket": "/s"}).data_path == "auto"  # direct is refused on GPUs
    assert KvdShimConfig.from_extra({"kvd_socket": "/s", "kvd_data_path": "STAGED"}).data_path == "staged"
    with pytest.raises(ValueError, match="kvd_data_path"):
        KvdShimConfig.from_extra({"kvd_socket": "/s", "kvd_data_path": "gpu"})


class _Watched(list):
    """A group of block ids that records being read id by id."""
    reads = 0

    def __iter__(self):
        _Watched.reads += 1
        return super().__iter__()


@pytest.mark.parametrize("block_ids,match", [
    ([_Watched(range(10))], "10 block ids in a group, more than 9"),
    ([[1], _Watched(range(10))], "10 block ids in a group"),
    ([[1]] * 3, "3 KV-cache groups, more than 2"),
    (_Watched(range(10)), "10 block ids, more than 9"),
])
def test_block_ids_past_the_bounds_are_refused_before_any_is_converted(block_ids, match):
    """``remote_block_ids`` come from an API client: past the bounds (ids per
    group, groups) ``as_groups`` refuses them by length alone, never reading
    an id (the decode scheduler's step pays for what it converts)."""
    _Watched.reads = 0
    with pytest.raises(ValueError, match=match):
        as_groups(block_ids, max_ids=9, max_groups=2)
    assert _Watched.reads == 0
    assert as_groups([list(range(9))] * 2, max_ids=9, max_groups=2) == [list(range(9))] * 2  # at the bounds


@pytest.mark.parametrize("block_id", ["40", "4_0", "\u0664\u0660", 40.9, 40.0, None, b"40"], ids=repr)
def test_a_block_id_that_is_not_an_integer_already_is_refused(block_id):
    """``remote_block_ids`` come from an API client; JSON gives P's ids as
    integers. ``int()`` would have turned strings ("4_0", Arabic-Indic digits)
    and floats into ids; they are refused, in either form, as a TypeError
    (which fails that load, ``test_shim_vllm_transfers``)."""
    with pytest.raises(TypeError):
        as_groups([[1, block_id]])
    with pytest.raises(TypeError):
        as_groups([1, block_id])


def test_integer_block_ids_of_any_integer_type_are_taken_as_ints():
    np = pytest.importorskip("numpy")
    assert as_groups([[np.int64(7), 8]]) == [[7, 8]] and type(as_groups([np.int32(3)])[0][0]) is int


def test_an_unknown_kvd_key_is_warned_about_naming_the_closest_setting(caplog, monkeypatch):
    """A misspelt ``kvd_`` key would otherwise be ignored silently (its
    default used): one WARNING names it and the setting it is closest to, or
    every setting when none is close; keys without the prefix are other
    connectors' (a MultiConnector's dict) and pass unremarked; the same key
    read again in this process (vLLM's scheduler and worker connectors)
    is not logged twice."""
    monkeypatch.setattr(shim_config, "_WARNED", set())
    caplog.set_level(logging.WARNING, logger="kvd.shim.vllm")
    extra = {"kvd_socket": "/s", "kvd_conect_timeout_s": 5, "kvd_lease_s": 3, "nixl_backends": ["UCX"],
             "kv_buffer_size": 1, "KVD_DATA_PATH": "staged", "kvd_zzz": 1}
    cfg = KvdShimConfig.from_extra(extra)
    KvdShimConfig.from_extra(extra)
    assert cfg.connect_timeout_s == 60.0 and cfg.lease_s == 3.0 and cfg.data_path == "auto"  # ignored
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("kvd")]
    assert warned[:2] == [
        "kvd: kv_connector_extra_config.kvd_conect_timeout_s is not a KvdConnector setting and is ignored; "
        "did you mean kvd_connect_timeout_s?",
        "kvd: kv_connector_extra_config.KVD_DATA_PATH is not a KvdConnector setting and is ignored; "
        "did you mean kvd_data_path?",
    ], warned
    assert len(warned) == 3 and "kvd_zzz" in warned[2] and "known: kvd_socket, kvd_peer_address" in warned[2]
    caplog.clear()
    KvdShimConfig.from_extra({"kvd_socket": "/s", "kvd_lease_s": 3, "kvd_connect_timeout_s": 5,
                              "kvd_load_timeout_s": 1, "kvd_data_path": "auto", "kvd_peer_address": "h:1"})
    assert not caplog.records
    # Every setting the module's table documents is known (tests/test_ops.py ties the table to what is read).
    assert set(shim_config.SETTINGS) == set(re.findall(r"^(kvd_\w+) ", shim_config.__doc__, re.M))


def test_the_connector_warns_once_at_startup_about_a_misspelt_key(model_dir, fake, caplog, monkeypatch):
    """Through vLLM's config: the worker connector, made with a misspelt
    ``kvd_conect_timeout_s`` beside another connector's key, says so once."""
    monkeypatch.setattr(shim_config, "_WARNED", set())
    caplog.set_level(logging.WARNING, logger="kvd.shim.vllm")
    config = vllm_config(model_dir, fake.socket, kvd_conect_timeout_s=5, nixl_backends=["UCX"])
    w = KvdConnector(config, KVConnectorRole.WORKER, kv_cache_config())
    try:
        warned = [r.getMessage() for r in caplog.records
                  if r.levelno >= logging.WARNING and r.name.startswith("kvd")]
        assert warned == ["kvd: kv_connector_extra_config.kvd_conect_timeout_s is not a KvdConnector setting "
                          "and is ignored; did you mean kvd_connect_timeout_s?"], warned
        assert w.cfg.connect_timeout_s == 60.0
    finally:
        w.shutdown()


# ------------------------------------------------------------- registration
def test_register_kv_caches_shares_vllm_allocation_and_describes_it(model_dir, fake):
    eng = Engine(model_dir, fake.socket, kvd_peer_address="127.0.0.1:7000")
    try:
        (reg,) = fake.service.registers
        spec = kv_cache_config().kv_cache_groups[0].kv_cache_spec
        assert reg.worker == pb.EngineWorker(engine_id=eng.config.kv_transfer_config.engine_id, tp_rank=0, tp_size=1)
        assert (reg.layout.num_blocks, reg.layout.block_size, reg.layout.kv_layout) == (NB, BS, pb.KV_LAYOUT_HND)
        # vLLM-CPU keeps K and V of a head in one block ([heads, 2 x tokens, head_size]):
        # the per-head vector is K and V together, and the layout says K and V share
        # the block, so the daemon can move them apart (block-size remap).
        assert (reg.layout.dtype, reg.layout.num_kv_heads, reg.layout.head_dim, reg.layout.num_layers) == (
            "float32", KV_HEADS, 2 * HEAD, 2)
        # What the kernel keeps inside K decides the remap (x86 vec kernels: K [head_size, tokens]).
        from kvd.shim.vllm.cpu_kv_probe import kv_block_layout
        k_layout = kv_block_layout(torch.float32, BS, HEAD)
        assert reg.layout.kv_in_block == (k_layout is not None)
        assert reg.layout.k_dim_major == (k_layout == "dim_major")
        assert f"kv_in_block={1 if k_layout else BS}" in reg.compat_extra
        assert reg.layout.total_kv_heads == KV_HEADS
        assert reg.owner_pid == os.getpid() and reg.data_path == pb.DATA_PATH_DIRECT
        assert [r.group for r in reg.regions] == [0, 0]
        assert len(reg.segments) == 1 and len(reg.regions) == 2  # one backing buffer, one region per layer
        assert all(r.block_len == spec.page_size_bytes == r.block_stride for r in reg.regions)
        assert reg.model == model_dir and "vllm=0.32" in reg.compat_extra
        assert fake.service.sessions == 1
        # The regions address vLLM's own per-layer views, block by block.
        seg = reg.segments[0]
        # The segment as the daemon maps it: the handed-over memfd (the fake
        # keeps every fd it received), or the POSIX shm name where memfds are unavailable.
        if seg.kind == pb.MEMORY_KIND_MEMFD:
            m = mmap.mmap(fake.fds[seg.fd_id], seg.size, prot=mmap.PROT_READ)
        else:
            m = mmap.mmap(os.open("/dev/shm" + seg.name, os.O_RDONLY), seg.size, prot=mmap.PROT_READ)
        for i, (layer, r) in enumerate(zip(LAYERS, reg.regions)):
            view = eng.caches[layer]
            assert tuple(view.shape) == (NB, KV_HEADS, BS, 2 * HEAD)  # [B, H, N, K+V]
            view[5].fill_(float(i + 1))
            start = r.offset + 5 * r.block_stride
            assert m[start:start + r.block_len] == view[5].numpy().tobytes()
        m.close()
    finally:
        eng.close()
    assert len(fake.service.unregisters) == 1




# ----------------------------------------------------------- memory hygiene
def test_a_stopped_engine_leaves_no_kv_segment_and_its_cache_stays_usable(model_dir, fake):
    """shutdown() unlinks the KV cache's /dev/shm name (vLLM kills torch's
    shm manager, which would otherwise leak it); the tensors stay valid, and
    freeing them later does not trip torch's own unlink."""
    eng = Engine(model_dir, fake.socket, kvd_peer_address="127.0.0.1:7000")
    (seg,) = fake.service.registers[0].segments
    if seg.kind == pb.MEMORY_KIND_MEMFD:  # handed over by fd: nothing is ever named in /dev/shm
        assert seg.name == "" and not any(n.startswith(f"torch_{os.getpid()}_") for n in os.listdir("/dev/shm"))
        eng.close()
    else:
        path = "/dev/shm" + seg.name
        assert seg.name.startswith("/torch_") and os.path.exists(path)
        eng.close()
        assert not os.path.exists(path), "the KV cache segment outlived the engine"
    eng.close()  # idempotent
    view = eng.caches[LAYERS[0]]
    view[3].fill_(5.0)
    assert float(view[3].sum()) == 5.0 * view[3].numel()
    del eng, view
    gc.collect()  # torch frees the storage: must not abort ("could not unlink the shared memory file")


# ----------------------------------------------------------- staged data path
def mirror_bytes(name: str, size: int) -> bytes:
    with open("/dev/shm" + name, "rb") as f:
        return f.read(size)


def test_staged_engine_registers_unnamed_segments_and_copies_computed_blocks_into_the_mirror(model_dir, fake):
    """Staged prefill: the blocks a step computes for a do_remote_decode
    request are in the mirror when that step ends, i.e. before its
    kv_transfer_params leave the engine (a reader may READ at once; the hold
    only goes out with the next step); other blocks are not copied."""
    eng = Engine(model_dir, fake.socket, write_kv=True, kvd_peer_address="10.1.2.3:7400",
                 kvd_data_path="staged", max_num_batched_tokens=64)
    try:
        (reg,) = fake.service.registers
        assert reg.data_path == pb.DATA_PATH_STAGED and reg.owner_pid == os.getpid()
        assert [s.name for s in reg.segments] == [""], "the staged path shares nothing"
        (r0, r1) = reg.regions
        assert r0.offset == 0, "offsets count from the storage's byte 0 (no shm header)"
        plain = make_request(list(range(2000, 2040)), None, max_tokens=1)  # not handed off: not copied
        eng.sched.add_request(plain)
        eng.run_until(lambda: eng.finished(plain.request_id) is not None)
        req = prefill_request(list(range(100, 200)))  # 100 tokens in 2 chunks of 64 (chunked prefill)
        eng.sched.add_request(req)
        eng.run_until(lambda: eng.finished(req.request_id) is not None)
        (blocks,) = eng.finished(req.request_id).kv_transfer_params["remote_block_ids"]
        assert fake.service.received("hold") == [], "the hold goes out with the next step"
        (mirror,) = fake.service.staging
        data = mirror_bytes(mirror, reg.segments[0].size)
        for i, (layer, r) in enumerate(zip(LAYERS, reg.regions)):
            for b in range(NB):
                got = data[r.offset + b * r.block_stride:][:r.block_len]
                want = eng.caches[layer][b].numpy().tobytes() if b in blocks else bytes(r.block_len)
                assert got == want, (layer, b)

        eng.step()
        wait_until(lambda: fake.service.count("hold") == 1, 5, "hold command #1 at the daemon")

        # The daemon restarts: new mirrors; the shim maps them and copies the
        # KV cache in again before the hold goes out again.
        fake.stop()
        fake.start()
        wait_until(lambda: fake.service.count("hold") == 2, 10, "hold command #2 at the daemon")
        assert len(fake.service.staging) == 2
        data = mirror_bytes(fake.service.staging[1], reg.segments[0].size)
        for layer, r in zip(LAYERS, reg.regions):
            for b in blocks:
                assert data[r.offset + b * r.block_stride:][:r.block_len] == eng.caches[layer][b].numpy().tobytes()
    finally:
        eng.close()


def test_auto_data_path_is_direct_on_cpu_and_staged_when_the_cache_cannot_be_shared(model_dir, fake, monkeypatch):
    from kvd.shim.memory import shm as cpu_share

    """``auto`` (the default) on the CPU: direct, and the worker tells the
    scheduler (vLLM's handshake metadata) so that it stops tracking blocks
    to save; staged when the KV cache cannot be shared, and then the
    scheduler keeps tracking them (without the saves the mirrors would be
    stale)."""
    eng = Engine(model_dir, fake.socket, kvd_peer_address="127.0.0.1:7000")
    try:
        assert eng.config.kv_transfer_config.kv_connector_extra_config.get("kvd_data_path") is None
        assert fake.service.registers[-1].data_path == pb.DATA_PATH_DIRECT
        assert eng.worker.get_handshake_metadata() == KvdWorkerPath(may_stage=False)
        assert eng.connector.scheduler._stage is False
        req = prefill_request(list(range(100, 140)))
        eng.sched.add_request(req)
        eng.run_until(lambda: eng.finished(req.request_id) is not None)
        assert eng.finished(req.request_id).kv_transfer_params["remote_block_ids"], "handed off as before"
        assert not eng.connector.scheduler._saving
    finally:
        eng.close()

    def cannot(*a, **kw):
        raise cpu_share.CpuShareError("no /dev/shm here")

    monkeypatch.setattr(cpu_share, "share_kv_caches", cannot)
    eng = Engine(model_dir, fake.socket, kvd_peer_address="127.0.0.1:7000", kvd_data_path="auto")
    try:
        reg = fake.service.registers[-1]
        assert reg.data_path == pb.DATA_PATH_STAGED and [s.name for s in reg.segments] == [""]
        assert eng.worker.worker.staging is not None
        assert eng.worker.get_handshake_metadata() == KvdWorkerPath(may_stage=True)
        assert eng.connector.scheduler._stage is True
    finally:
        eng.close()
    with pytest.raises(cpu_share.CpuShareError):  # direct asked for: no silent fallback
        Engine(model_dir, fake.socket, kvd_peer_address="127.0.0.1:7000", kvd_data_path="direct")


def test_staged_worker_closes_its_mirrors_before_unregistering(model_dir, fake, monkeypatch):
    """Shutdown closes the worker's mirror mappings before UnregisterEngine:
    the daemon frees the mirrors then, and a VRAM mirror must not be freed
    while another process still maps it (kvd.core.cuda_ipc.VramMirror.close)."""
    eng = Engine(model_dir, fake.socket, kvd_peer_address="127.0.0.1:7000", kvd_data_path="staged")
    staging = eng.worker.worker.staging
    unregisters_at_close = []
    close = staging.close
    monkeypatch.setattr(staging, "close", lambda: (unregisters_at_close.append(len(fake.service.unregisters)),
                                                   close()))
    eng.close()
    assert unregisters_at_close == [0] and len(fake.service.unregisters) == 1


def test_the_scheduler_stops_staging_only_when_every_rank_shares_directly(model_dir, fake):
    """``set_worker_paths``: with ``auto``, one TP rank missing or one that
    may be staged keeps the saves tracked; an explicit ``staged`` is never
    turned off, whatever the workers say."""
    from kvd.shim.vllm.scheduler import KvdScheduler

    for data_path, paths, stages in (
        ("auto", {0: KvdWorkerPath(False), 1: KvdWorkerPath(False)}, False),
        ("auto", {0: KvdWorkerPath(False)}, True),                            # rank 1 did not report
        ("auto", {0: KvdWorkerPath(False), 1: KvdWorkerPath(True)}, True),    # rank 1 staged (fallback)
        ("auto", {0: KvdWorkerPath(False), 1: object()}, True),               # not ours: assume staged
        ("auto", {}, True),
        ("staged", {0: KvdWorkerPath(False), 1: KvdWorkerPath(False)}, True),
        ("direct", {0: KvdWorkerPath(True), 1: KvdWorkerPath(True)}, False),
    ):
        config = vllm_config(model_dir, fake.socket, kvd_peer_address="127.0.0.1:7000", kvd_data_path=data_path)
        config.parallel_config.tensor_parallel_size = 2
        sched = KvdScheduler(config, KvdShimConfig.from_extra(config.kv_transfer_config.kv_connector_extra_config),
                             "e")
        sched._saving["r"] = object()
        sched.set_worker_paths(paths)
        assert sched._stage is stages, (data_path, paths)
        turned_off = data_path == "auto" and not stages
        assert bool(sched._saving) is not turned_off, (data_path, paths)  # tracked saves dropped on turning off


def test_the_shims_info_lines_reach_vllms_log_handler(monkeypatch):
    """vLLM configures only its ``vllm`` logger; the connector hangs the
    ``kvd`` loggers on the same handlers (at vLLM's level), once, and only
    when ``kvd`` has none of its own."""
    import io

    from kvd.shim.vllm.connector import adopt_vllm_logging

    kvd_log, vllm_log = logging.getLogger("kvd"), logging.getLogger("vllm")
    monkeypatch.setattr(kvd_log, "handlers", [])
    monkeypatch.setattr(kvd_log, "level", logging.NOTSET)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    monkeypatch.setattr(vllm_log, "handlers", [handler])
    monkeypatch.setattr(vllm_log, "level", logging.INFO)
    adopt_vllm_logging()
    adopt_vllm_logging()
    (adopted,) = kvd_log.handlers
    assert adopted.targets == [handler] and kvd_log.level == logging.INFO
    logging.getLogger("kvd.shim.vllm").info("kvd engine=e: registered")
    logging.getLogger("kvd.shim.vllm").debug("not at INFO")
    # An id from an API client cannot forge a line or draw on a terminal.
    logging.getLogger("kvd.shim.vllm").warning("request=%s: failed", "r1\nINFO forged\x1b[2J\u2028")
    assert stream.getvalue() == ("kvd engine=e: registered\n"
                                 "request=r1\\nINFO forged\\x1b[2J\\u2028: failed\n"), stream.getvalue()
    own = logging.NullHandler()
    monkeypatch.setattr(kvd_log, "handlers", [own])
    adopt_vllm_logging()
    assert kvd_log.handlers == [own], "a handler the user set is left alone"
    monkeypatch.setattr(kvd_log, "handlers", [])
    monkeypatch.setattr(vllm_log, "handlers", [])  # VLLM_CONFIGURE_LOGGING=0
    adopt_vllm_logging()
    assert kvd_log.handlers == []


def test_the_schedulers_peer_address_question_to_a_missing_socket_says_nothing_is_there(tmp_path):
    from kvd.shim.vllm.worker import daemon_peer_address

    cfg = KvdShimConfig(socket=str(tmp_path / "typo.sock"), connect_timeout_s=0.5)
    with pytest.raises(RuntimeError) as e:
        daemon_peer_address(cfg)
    msg = str(e.value)
    assert f"nothing is at {tmp_path}/typo.sock: is kv_connector_extra_config.kvd_socket" in msg, msg


def test_a_reregistration_on_another_data_path_fills_new_mirrors_or_stops_the_copies(model_dir, fake):
    """Under CUDA ``auto`` the daemon decides at each registration: a restarted
    daemon may answer staged where the first answered direct (the new mirrors
    get the whole KV cache before the holds are sent again) or direct where
    the first answered staged (copies stop: no stale mirror is copied over
    blocks the daemon wrote). A staged answer to a registration that asked
    for direct contradicts it and is refused."""

    from kvd.shim.memory.staged import StagingError

    eng = Engine(model_dir, fake.socket, kvd_peer_address="127.0.0.1:7000")
    w = eng.worker.worker
    try:
        assert w.client.on_register == w._on_reregister, "installed for every data path"
        staged_answer = pb.RegisterEngineResponse(data_path=pb.DATA_PATH_STAGED)
        with pytest.raises(StagingError, match="asked for the direct one"):
            w._on_reregister(staged_answer)  # this worker asked for direct (CPU auto resolved)
        copied = []

        class Mirror:
            names = ["/m1"]

            def copy_all(self):
                copied.append(1)
                return 123

            def close(self):
                copied.append("closed")

        sharing = w.sharing
        real = (type(sharing).wire_data_path, sharing.attach)
        type(sharing).wire_data_path = property(lambda self: pb.DATA_PATH_AUTO)  # as CUDA auto asks
        sharing.attach = lambda response: setattr(sharing, "staging", Mirror())
        try:
            w._on_reregister(staged_answer)
            assert copied == [1] and w.registered is staged_answer and w.may_stage
            w._on_reregister(pb.RegisterEngineResponse(data_path=pb.DATA_PATH_DIRECT))
            assert sharing.staging is None and len(w._retired) == 1 and copied == [1]
        finally:
            type(sharing).wire_data_path, sharing.attach = real
    finally:
        eng.close()
    assert copied == [1, "closed"], "the retired mirror is closed at shutdown"
