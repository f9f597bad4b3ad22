"""Two "hosts" on one machine: network namespaces joined by a veth pair
(needs root or CAP_NET_ADMIN and iproute2; ``tc`` for a rate cap)."""

from __future__ import annotations

import subprocess
import uuid


class NetnsPair:
    """Two network namespaces joined by a veth pair: two "hosts" on one machine.

    ``a`` and ``b`` are the namespace names, ``ip_a``/``ip_b`` their addresses
    on 10.<x>.<y>.0/24, ``dev_a``/``dev_b`` the veth ends. :meth:`link`
    cuts or restores the wire. Made in ``__enter__``, removed in ``__exit__``
    whatever happened. Raises OSError (with ip's message) when namespaces
    cannot be made here (not root, no CAP_NET_ADMIN, no ``ip``).
    """

    def __init__(self):
        tag = uuid.uuid4().hex[:6]
        n = int(tag, 16)
        self.a, self.b = f"kvdA{tag}", f"kvdB{tag}"
        self.dev_a, self.dev_b = f"kva{tag}", f"kvb{tag}"
        self.ip_a, self.ip_b = f"10.{200 + n % 50}.{(n >> 8) % 250}.1", f"10.{200 + n % 50}.{(n >> 8) % 250}.2"

    @staticmethod
    def _ip(*args: str) -> None:
        r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
        if r.returncode:
            raise OSError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")

    def __enter__(self) -> "NetnsPair":
        try:
            self._ip("netns", "add", self.a)
            self._ip("netns", "add", self.b)
            self._ip("link", "add", self.dev_a, "type", "veth", "peer", "name", self.dev_b)
            for ns, dev, ip in ((self.a, self.dev_a, self.ip_a), (self.b, self.dev_b, self.ip_b)):
                self._ip("link", "set", dev, "netns", ns)
                self._ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                self._ip("-n", ns, "link", "set", dev, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def wrap(self, ns: str) -> tuple[str, ...]:
        """Command prefix that runs a program inside namespace ``ns``."""
        return ("ip", "netns", "exec", ns)

    def limit_rate(self, mbit: int) -> bool:
        """Caps each end's sending rate (``tc`` token bucket), so that a
        transfer lasts long enough to be cut in the middle. False (and no
        cap) where ``tc``/``sch_tbf`` is not available."""
        try:
            for ns, dev in ((self.a, self.dev_a), (self.b, self.dev_b)):
                r = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                                    "burst", "64kb", "latency", "200ms"], capture_output=True, text=True, timeout=20)
                if r.returncode:
                    return False
        except (OSError, subprocess.TimeoutExpired):
            return False
        return True

    def link(self, up: bool) -> None:
        """Cuts (``up=False``) or restores the wire, on both ends."""
        for ns, dev in ((self.a, self.dev_a), (self.b, self.dev_b)):
            self._ip("-n", ns, "link", "set", dev, "up" if up else "down")

    def __exit__(self, *exc) -> None:
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", self.dev_a], capture_output=True, timeout=20)
