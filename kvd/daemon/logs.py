"""The daemon's log output: one line per record, human text or JSON.

``human`` (default): ``2026-01-02 03:04:05,678 WARNING kvd.core: engine=e rank=0 request=r peer=h:p: ...``.

``json`` (``--log-format json``): one JSON object per line, for log shippers
(Loki, Elasticsearch, Cloud Logging)::

    {"ts": "2026-01-02T03:04:05.678Z", "level": "warning", "logger": "kvd.core",
     "msg": "engine=e rank=0 request=r peer=h:p: load failed: ...",
     "engine": "e", "rank": "0", "request": "r", "peer": "h:p"}

The ``engine``, ``rank``, ``request`` and ``peer`` fields are lifted from the
``key=value`` words that kvd's transfer log lines carry (STYLE.md: a request
id and an engine id appear in every log line about a transfer), so a log
query can filter on them; ``exc`` holds a traceback when there is one.
Every record's message is formatted with its control characters escaped
(``\\n``, ``\\x1b``, ``\\u2028``): request ids, engine ids and addresses come
from other processes, and a newline in one would otherwise forge a log line
(CWE-117). In the human format a traceback's lines are indented, so every line
that starts at column 0 starts a record.

Stdlib ``logging`` only: no dependency. Records of NIXL's Python layer go
through the same handler; native libraries (UCX, gRPC core) may still print
lines of their own.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

from kvd.core.throttle import Throttled, Throttles  # noqa: F401 (the daemon's modules take them from here)
from kvd.logtext import escape_controls

HUMAN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

def _escaped(record: logging.LogRecord) -> logging.LogRecord:
    """A copy of ``record`` whose message is formatted and escaped (no args left)."""
    out = logging.makeLogRecord(record.__dict__)
    out.msg, out.args = escape_controls(record.getMessage()), None
    return out


class HumanFormatter(logging.Formatter):
    """``HUMAN_FORMAT`` with the message escaped and traceback lines indented."""

    def __init__(self):
        super().__init__(HUMAN_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        return super().format(_escaped(record))

    def formatException(self, ei) -> str:  # noqa: N802 (logging's name)
        return _indent(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:  # noqa: N802 (logging's name)
        return _indent(super().formatStack(stack_info))


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


# key=value words kvd puts in transfer log lines; the value ends at a space,
# a comma or the ": " that starts the next part of the message.
_FIELDS = re.compile(r"(?<![\w.-])(engine|rank|request|peer)=(\S+?)(?=:\s|:$|,|\s|$)")


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object (UTC timestamp with milliseconds)."""

    def format(self, record: logging.LogRecord) -> str:
        msg = escape_controls(record.getMessage())
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": msg,
        }
        for key, value in _FIELDS.findall(msg):
            out.setdefault(key, value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, ensure_ascii=False)


def configure(level: str = "info", fmt: str = "human", stream=None) -> None:
    """Sends every log record at ``level`` or above to ``stream`` (stderr).

    Args:
        level: ``debug`` | ``info`` | ``warning`` | ``error`` (Config.log_level).
        fmt: ``human`` | ``json`` (Config.log_format).
    """
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else HumanFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    # NIXL's Python layer gives its "nixl" logger its own stdout handler and
    # propagate=False (logging.config.dictConfig) when it is first imported,
    # which is later. Made now as an _Adopted logger, it ignores that and
    # propagates to our handler: NIXL's records come out once, in our format.
    # Its INFO records (each agent made, each backend loaded, naming its CUDA
    # build, nixl_cu13, on a CPU-only node too) say what kvd's own lines say:
    # shown at debug only; its warnings and errors always.
    _adopt("nixl", logging.DEBUG if root.level <= logging.DEBUG else logging.WARNING)


class _Adopted(logging.Logger):
    """A logger that keeps no handler of its own, always propagates, and
    keeps the level kvd gave it (the library's ``dictConfig`` and
    ``NIXL_LOG_LEVEL`` would set INFO again)."""

    def addHandler(self, hdlr: logging.Handler) -> None:  # noqa: N802 (logging's name)
        pass

    def setLevel(self, level) -> None:  # noqa: N802 (logging's name)
        pass

    @property
    def propagate(self) -> bool:
        return True

    @propagate.setter
    def propagate(self, value: bool) -> None:
        pass


def _adopt(name: str, level: int) -> None:
    existing = logging.Logger.manager.loggerDict.get(name)
    if isinstance(existing, logging.Logger) and not isinstance(existing, _Adopted):  # configured already
        for h in list(existing.handlers):
            existing.removeHandler(h)
        existing.propagate = True
        existing.setLevel(level)
        return
    previous = logging.getLoggerClass()
    logging.setLoggerClass(_Adopted)
    try:
        logger = logging.getLogger(name)
    finally:
        logging.setLoggerClass(previous)
    logging.Logger.setLevel(logger, level)
