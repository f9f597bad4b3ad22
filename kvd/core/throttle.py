"""A warning that anyone who can reach the daemon may set off: rate-limited.

Lives in the core, which may not import the daemon's modules, and is used by
both (``kvd.daemon.logs`` re-exports it): a dropped-event warning in the
core and a refused connection in the gate are floods of the same kind.
"""

from __future__ import annotations

import logging
import time


class Throttled:
    """A warning that may come once per connection or call from whoever asks:
    logged at most once per ``interval_s`` seconds, with the count of the
    ones left out since, so a flood cannot fill the log."""

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0):
        self.log = logger
        self.interval_s = interval_s
        self._last = -interval_s
        self._suppressed = 0

    def warning(self, msg: str, *args) -> None:
        """Logs ``msg % args`` at WARNING unless one was logged less than ``interval_s`` ago."""
        self._say(logging.WARNING, msg, args)

    def info(self, msg: str, *args) -> None:
        """As :meth:`warning`, at INFO: what a caller's own error or an honest
        retry also sets off, which anyone may repeat thousands of times a second."""
        self._say(logging.INFO, msg, args)

    def _say(self, level: int, msg: str, args: tuple) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more like it since the last message)" if self._suppressed else ""
        self._last, self._suppressed = now, 0
        self.log.log(level, msg + more, *args)
