"""Log lines that anyone who can reach the daemon may set off: rate-limited.

Lives in the core, which may not import the daemon's modules, and is used by
both (``kvd.daemon.logs`` re-exports it): a dropped-event warning in the
core and a refused connection in the gate are floods of the same kind.

:class:`Throttled` keeps one line a second for a site; :class:`Throttles`
one a second per key (a caller uid, a worker), so that one caller's flood
does not hide another's lines (attacker review: a uid refused 4,669 times a
second hid every refusal of another uid).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Hashable


class Throttles:
    """Lines logged at most once per ``interval_s`` seconds per key, with the
    count of the ones left out since; at most ``max_keys`` keys are kept
    (the least recently used is forgotten, with its count).

    Args:
        logger: where the lines go.
        interval_s: seconds between two lines of one key.
        max_keys: keys remembered; a key forgotten logs its next line at once.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0, max_keys: int = 4096):
        self.log = logger
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._keys: OrderedDict[Hashable, list] = OrderedDict()  # key -> [last logged (monotonic s), left out]

    def warning(self, key: Hashable, msg: str, *args) -> None:
        """Logs ``msg % args`` at WARNING unless ``key`` logged one less than ``interval_s`` ago."""
        self._say(logging.WARNING, key, msg, args)

    def info(self, key: Hashable, msg: str, *args) -> None:
        """As :meth:`warning`, at INFO."""
        self._say(logging.INFO, key, msg, args)

    def _say(self, level: int, key: Hashable, msg: str, args: tuple) -> None:
        now = time.monotonic()
        state = self._keys.get(key)
        if state is None:
            self._keys[key] = state = [now - self.interval_s, 0]
            if len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(key)
        if now - state[0] < self.interval_s:
            state[1] += 1
            return
        more = f" ({state[1]} more like it since the last message)" if state[1] else ""
        state[0], state[1] = now, 0
        self.log.log(level, msg + more, *args)


class Throttled:
    """A line that may come once per connection or call from whoever asks:
    logged at most once per ``interval_s`` seconds, with the count of the
    ones left out since, so a flood cannot fill the log (one key of
    :class:`Throttles`)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0):
        self._lines = Throttles(logger, interval_s, max_keys=1)

    def warning(self, msg: str, *args) -> None:
        """Logs ``msg % args`` at WARNING unless one was logged less than ``interval_s`` ago."""
        self._lines.warning(None, msg, *args)

    def info(self, msg: str, *args) -> None:
        """As :meth:`warning`, at INFO: what a caller's own error or an honest
        retry also sets off, which anyone may repeat thousands of times a second."""
        self._lines.info(None, msg, *args)
