"""sd_notify(3) in a few lines: tell systemd (``Type=notify``) that the daemon
is ready or stopping, without libsystemd.

systemd passes the path of a ``SOCK_DGRAM`` Unix socket in ``NOTIFY_SOCKET``
(read by :mod:`kvd.config`); a leading ``@`` means the Linux abstract
namespace. Each message is one datagram of newline-separated ``KEY=VALUE``
assignments: ``READY=1`` when startup is complete, ``STOPPING=1`` when
shutdown begins, ``STATUS=...`` a free-text line ``systemctl status`` shows,
``MAINPID=`` the daemon's pid, ``WATCHDOG=1`` the keep-alive of a unit
with ``WatchdogSec=`` and ``WATCHDOG=trigger`` its failure now (systemd
243 and later). Outside systemd (no socket) every call is a
no-op; a failed send is logged and never stops the daemon.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("kvd.sdnotify")


class Notifier:
    """Sends sd_notify datagrams to one socket path ("" disables)."""

    def __init__(self, socket_path: str):
        self.path = socket_path

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def send(self, **state: object) -> bool:
        """Sends ``KEY=VALUE`` lines (``send(READY=1, STATUS="serving")``).

        Returns True when the datagram went out.
        """
        if not self.path:
            return False
        addr = "\0" + self.path[1:] if self.path.startswith("@") else self.path
        data = "\n".join(f"{k}={v}" for k, v in state.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.connect(addr)
                s.sendall(data)
            return True
        except OSError as e:
            log.warning("sd_notify to %s failed: %s", self.path, e)
            return False

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status, MAINPID=os.getpid())

    def stopping(self, status: str) -> bool:
        return self.send(STOPPING=1, STATUS=status)

    def watchdog(self) -> bool:
        """The watchdog keep-alive (``WATCHDOG=1``)."""
        return self.send(WATCHDOG=1)

    def watchdog_trigger(self, status: str) -> bool:
        """Asks systemd to act as if the watchdog timed out, now (the unit's
        ``Restart=on-failure`` restarts it)."""
        return self.send(WATCHDOG="trigger", STATUS=status)
