"""kvd.core.own_addresses: the spellings of an address that reach this daemon."""

from __future__ import annotations

import asyncio

import pytest

from kvd.core.own_addresses import OwnAddresses


def own(host: str, port: int = 7700, advertised: str = "") -> OwnAddresses:
    o = OwnAddresses()
    o.advertised = advertised or f"{host}:{port}"
    o.listening(host, port)
    return o


@pytest.mark.parametrize("address, ours", [
    ("127.0.0.1:7700", True), ("localhost:7700", True), ("[::ffff:127.0.0.1]:7700", True),
    ("0.0.0.0:7700", True), ("127.0.0.1:7701", False), ("127.0.0.2:7700", False), ("[::1]:7700", False),
    ("192.0.2.9:7700", False), ("no-such-host.invalid:7700", False), ("garbage", False), ("", False),
])
def test_a_loopback_listener(address, ours):
    o = own("127.0.0.1", advertised="127.0.0.1:7700")
    got = asyncio.run(o.canonical(address))
    assert got == ("127.0.0.1:7700" if ours else address)


@pytest.mark.parametrize("address, ours", [
    ("127.0.0.5:7700", True), ("[::1]:7700", True), ("[::]:7700", True), ("192.0.2.9:7700", False),
    ("10.9.9.9:7701", False),
])
def test_a_wildcard_listener_takes_every_address_of_this_host(address, ours):
    o = own("::", advertised="10.9.9.9:7700")
    assert asyncio.run(o.canonical(address)) == ("10.9.9.9:7700" if ours else address)


def test_an_ipv4_wildcard_does_not_take_ipv6():
    o = own("0.0.0.0", advertised="10.9.9.9:7700")
    assert asyncio.run(o.canonical("[::1]:7700")) == "[::1]:7700"
    assert asyncio.run(o.canonical("127.0.0.1:7700")) == "10.9.9.9:7700"
