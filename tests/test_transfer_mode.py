"""``transfer_mode``: which loads READ and which ask their source to WRITE
(``kvd.core.transfer_mode``). The end-to-end cases, readers over a TCP-only
``UCX_TLS`` pushing by default, are in tests/test_reliability_tcp.py."""

from __future__ import annotations

import asyncio

import pytest

from kvd.core import transfer_mode as tm
from kvd.core.transfer_mode import HOST_CACHE_MAX, TransferModes, rdma_devices, tcp_emulated_reads


@pytest.mark.parametrize("tls, tcp_only", [
    ("tcp", True), ("tcp,sm,self", True), ("cma,tcp", True), ("tcp:aux", True), ("TCP", True),
    ("^ib", True), ("^rc,dc,ud", True), ("^rc_verbs,rc_mlx5,dc,ud,ib", True),
    (None, False), ("", False), ("rc,tcp", False), ("dc_mlx5,tcp", False), ("all", False), ("ib,tcp", False),
    ("sm,self", False), ("^rc", False), ("^ib,tcp", False), ("^cuda_ipc", False),
])
def test_a_ucx_tls_that_leaves_only_tcp_between_hosts_is_told_apart(tls, tcp_only):
    assert tcp_emulated_reads({} if tls is None else {"UCX_TLS": tls}) is tcp_only


def _pushes(modes: TransferModes, *addresses: str) -> list[bool]:
    async def main():
        return [await modes.pushes(a) for a in addresses]
    return asyncio.run(main())


NO_RDMA, RDMA = (lambda: []), (lambda: ["mlx5_0"])
# TEST-NET-1 (RFC 5737): never an address of this host.
OTHER = "192.0.2.7:7600"


def test_a_set_mode_is_kept_for_every_load_whatever_the_host():
    for env in ({}, {"UCX_TLS": "tcp"}):
        for devices in (NO_RDMA, RDMA):
            assert _pushes(TransferModes("pull", env, devices), "127.0.0.1:1", OTHER) == [False, False]
            assert _pushes(TransferModes("push", env, devices), "127.0.0.1:1", OTHER) == [True, True]


def test_auto_pushes_every_load_when_ucx_tls_leaves_only_tcp():
    modes = TransferModes("auto", {"UCX_TLS": "tcp"}, RDMA)
    assert _pushes(modes, "127.0.0.1:1", "localhost:2", OTHER) == [True, True, True]
    assert "push for every load (UCX_TLS=tcp" in modes.describe() and modes.warning() is None


def test_auto_reads_everywhere_with_an_rdma_device():
    modes = TransferModes("auto", {}, RDMA)
    assert _pushes(modes, "127.0.0.1:1", OTHER) == [False, False]
    assert "pull (RDMA devices here: mlx5_0), push from a source whose handshake says" in modes.describe()


def test_a_daemons_handshakes_say_how_a_read_from_it_travels():
    assert TransferModes("pull", {"UCX_TLS": "tcp"}, RDMA).read_transport() == "tcp"
    assert TransferModes("push", {}, NO_RDMA).read_transport() == "tcp-between-hosts"
    assert TransferModes("auto", {}, RDMA).read_transport() == "native"


def test_auto_pushes_from_a_source_whose_handshake_says_its_reads_are_tcp():
    """What a source's handshake said (``learn``) overrides what this host
    alone would decide: a TCP-only ``UCX_TLS`` there is a push wherever it
    is; a source without RDMA is pushed from when it is another host's,
    even with an RDMA device here. Only news counts as news."""
    here = "127.0.0.1:1"
    rdma = TransferModes("auto", {}, RDMA)
    assert rdma.learn(OTHER, "native") is False and rdma.learn(OTHER, "") is False
    assert rdma.learn(here, "tcp") is True and rdma.learn(here, "tcp") is False
    assert rdma.learn(OTHER, "tcp-between-hosts") is True
    assert rdma.learn("127.0.0.1:2", "tcp-between-hosts") is True
    assert _pushes(rdma, here, OTHER, "127.0.0.1:2", "10.0.0.1:3") == [True, True, False, False]
    assert rdma.learn(here, "native") is True  # restarted with RDMA allowed
    assert _pushes(rdma, here) == [False]
    plain = TransferModes("auto", {}, NO_RDMA)
    plain.learn(here, "tcp")
    assert _pushes(plain, here, "127.0.0.1:9") == [True, False]
    fixed = TransferModes("pull", {}, NO_RDMA)
    fixed.learn(here, "tcp")
    assert _pushes(fixed, here) == [False]  # a set mode is kept


def test_no_warm_up_read_from_a_source_whose_loads_auto_pushes():
    assert TransferModes("auto", {}, NO_RDMA).no_warm_up_from() == {"tcp"}
    assert TransferModes("auto", {}, RDMA).no_warm_up_from() == {"tcp", "tcp-between-hosts"}
    assert TransferModes("pull", {}, RDMA).no_warm_up_from() == frozenset()


def test_the_memory_of_what_sources_said_is_bounded():
    modes = TransferModes("auto", {}, RDMA)
    for i in range(tm.SOURCES_MAX + 10):
        modes.learn(f"10.1.{i // 256}.{i % 256}:1", "tcp")
    assert len(modes._sources) == tm.SOURCES_MAX and "10.1.0.0:1" not in modes._sources  # the oldest went first
    assert modes.learn("10.1.0.0:1", "tcp") is True  # news again: a load from it learns from its pair


def test_auto_with_no_rdma_device_reads_from_this_host_and_pushes_from_others():
    said = []
    modes = TransferModes("auto", {}, NO_RDMA, said=lambda host, local: said.append((host, local)))
    got = _pushes(modes, "127.0.0.1:1", "[::1]:2", "localhost:3", "0.0.0.0:4", "[::ffff:127.0.0.1]:5", OTHER,
                  "[2001:db8::1]:6", "no-such-host.invalid:7", "not an address", OTHER, "no-such-host.invalid:8")
    assert got == [False, False, False, False, False, True, True, True, True, True, True]
    # Each host looked up once (the last OTHER came from the cache); a
    # malformed address is a push without a lookup; a name that did not
    # resolve is a push for that load only (looked up again next time).
    assert [h for h, _ in said] == ["127.0.0.1", "::1", "localhost", "0.0.0.0", "::ffff:127.0.0.1", "192.0.2.7",
                                    "2001:db8::1"]
    assert "no-such-host.invalid" not in modes._hosts
    assert "pull from daemons of this host, push from other hosts" in modes.describe()


def test_an_address_of_this_hosts_own_interface_is_this_host():
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.7", 9))  # sends nothing: the route's source address
        except OSError:
            pytest.skip("no route off loopback here")
        mine = s.getsockname()[0]
    assert _pushes(TransferModes("auto", {}, NO_RDMA), f"{mine}:7600") == [False]


def test_the_host_cache_is_bounded_whatever_hosts_requests_name():
    modes = TransferModes("auto", {}, NO_RDMA)
    _pushes(modes, *(f"10.255.{i // 256}.{i % 256}:1" for i in range(HOST_CACHE_MAX + 10)))
    assert len(modes._hosts) <= HOST_CACHE_MAX


def test_an_operator_who_sets_pull_where_reads_would_be_tcp_is_warned():
    assert "leaves UCX only TCP between hosts" in TransferModes("pull", {"UCX_TLS": "tcp"}, RDMA).warning()
    assert "no RDMA device" in TransferModes("pull", {}, NO_RDMA).warning()
    assert TransferModes("pull", {}, RDMA).warning() is None
    for setting in ("auto", "push"):
        assert TransferModes(setting, {"UCX_TLS": "tcp"}, NO_RDMA).warning() is None


def test_name_lookups_are_bounded_and_a_load_past_the_bound_is_a_push(monkeypatch):
    """A request names the host: names whose lookup never answers take at
    most MAX_LOOKUPS of the loop's executor threads; a load past that is a
    push, unlooked and unremembered; ``localhost`` is never looked up."""
    import socket
    import threading

    gate = threading.Event()
    asked = []

    def slow_getaddrinfo(host, *a, **k):
        asked.append(host)
        gate.wait(20)
        raise socket.gaierror("no answer")

    monkeypatch.setattr(socket, "getaddrinfo", slow_getaddrinfo)
    monkeypatch.setattr(tm, "RESOLVE_TIMEOUT_S", 0.2)
    modes = TransferModes("auto", {}, NO_RDMA)

    async def main():
        first = await asyncio.gather(*(modes.pushes(f"stuck-{i}.example:1") for i in range(tm.MAX_LOOKUPS)))
        assert first == [True] * tm.MAX_LOOKUPS and modes._lookups == tm.MAX_LOOKUPS  # threads still held
        assert await modes.pushes("one-more.example:1") is True
        assert await modes.pushes("localhost:1") is False
        gate.set()
        for _ in range(200):
            if modes._lookups == 0:
                break
            await asyncio.sleep(0.01)
        return modes._lookups

    try:
        assert asyncio.run(main()) == 0
    finally:
        gate.set()
    assert sorted(asked) == sorted(f"stuck-{i}.example" for i in range(tm.MAX_LOOKUPS))
    assert not modes._hosts.keys() - {"localhost"}


def test_an_unknown_mode_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="'both' is not auto | pull | push"):
        TransferModes("both")


def test_rdma_devices_lists_the_kernels_class_directory(tmp_path):
    assert rdma_devices(str(tmp_path / "missing")) == []
    (tmp_path / "mlx5_1").mkdir()
    (tmp_path / "mlx5_0").mkdir()
    assert rdma_devices(str(tmp_path)) == ["mlx5_0", "mlx5_1"]


def test_known_answers_what_pushes_would_without_a_lookup():
    """``known`` (what ``kvd status`` shows per remote worker) answers as
    ``pushes`` where no host name is looked up, and None where it would be."""
    assert TransferModes("push", {}, NO_RDMA).known("peer.example:1") is True
    assert TransferModes("pull", {}, NO_RDMA).known("peer.example:1") is False
    rdma = TransferModes("auto", {}, RDMA)
    assert rdma.known("peer.example:1") is False  # RDMA here: a pull unless the source says otherwise
    rdma.learn("peer.example:1", "tcp")
    assert rdma.known("peer.example:1") is True
    plain = TransferModes("auto", {}, NO_RDMA)
    assert plain.known("localhost:1") is None  # not looked up yet
    assert _pushes(plain, "localhost:1") == [False]
    assert plain.known("localhost:1") is False  # now remembered
    assert plain.known("not an address") is True  # as pushes: unparseable counts as another host's


def test_known_takes_a_pairs_own_read_transport_before_any_load_learned_it():
    """A pair made ahead of need (``warm_peers``) has its source's
    ``read_transport`` before any load learns it: ``kvd status`` passes it,
    and shows what the first load will end up as."""
    rdma = TransferModes("auto", {}, RDMA)
    assert rdma.known("src:1") is False and rdma.known("src:1", "tcp") is True
    assert rdma.known("src:1", "native") is False and rdma.known("src:1", "bogus") is False
    assert rdma.known("src:1") is False  # nothing learned by asking
    plain = TransferModes("auto", {}, NO_RDMA)
    assert plain.known("localhost:1", "tcp") is True  # this host's, but its READs are TCP's
    assert plain.known("localhost:1", "tcp-between-hosts") is None  # judged by host: not looked up yet
