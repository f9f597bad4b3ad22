"""SIGTERM and SIGINT that arrive before the daemon's event loop takes them.

``kvd serve`` spends its first second or so importing gRPC, NIXL and numpy
and reading its settings; the event loop installs its own handlers only once
it runs (``Server.startup``). Before that, SIGTERM's default action killed
the process, and SIGINT's KeyboardInterrupt could be lost: Python drops an
exception raised inside a weakref callback, and the import system runs
such callbacks (``_get_module_lock.<locals>.cb``, "Exception ignored in"),
so 2 of 760 daemons sent a SIGINT 0-2 s after their start served on.

:func:`note_stops` replaces both handlers, as soon as ``kvd.cli.main`` sees ``serve``, with
one that only notes the signal (it raises nothing, so nothing can drop it);
:func:`take_stops` hands what was noted to the event loop's handlers, which
then stop the daemon once started as they would at any later time.
"""

from __future__ import annotations

import signal

_STOPS = (signal.SIGTERM, signal.SIGINT)
_noted: list[int] = []


def _note(signum: int, _frame) -> None:
    _noted.append(signum)


def note_stops() -> None:
    """Notes SIGTERM and SIGINT from now on instead of acting on them, until
    the event loop's handlers replace these (main thread only, as every
    Python signal handler). Also takes over a SIGINT the parent left
    ignored (a shell without job control starts background jobs so): the
    daemon's own handlers would take it once running as well. Calling it
    again changes nothing."""
    for sig in _STOPS:
        if signal.getsignal(sig) is not _note:  # a second call keeps what was noted
            signal.signal(sig, _note)


def take_stops() -> list[signal.Signals]:
    """The signals noted since :func:`note_stops`, oldest first, and forgets them."""
    taken = [signal.Signals(s) for s in _noted]
    _noted.clear()
    return taken
