"""The exit codes of every ``kvd`` command and the argument parser they all
use (a leaf module: the CLI, ``kvd bench`` and ``kvd demo`` import it, it
imports nothing of kvd's).

Exit codes: 0 ok; 1 not serving (``kvd health``: draining, or an unknown
``--service``), or a failed startup or run; 2 unreachable (``kvd health``,
``kvd status``: no answer within ``--timeout``, or refused); 64 a usage
error or an invalid setting (sysexits.h ``EX_USAGE``).
"""

from __future__ import annotations

import argparse
import sys

EXIT_OK, EXIT_NOT_SERVING, EXIT_UNREACHABLE, EXIT_USAGE = 0, 1, 2, 64


class UsageParser(argparse.ArgumentParser):
    """argparse with usage errors exiting EXIT_USAGE (64, sysexits' EX_USAGE),
    not argparse's 2, which ``kvd health`` uses for "unreachable"; and no
    abbreviated long flags (argparse's default): ``--max-lease-life 900``
    must not mean ``--max-lease-life-s`` today and something else when a
    flag with that prefix is added."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def positive(kind: type = float):
    """An argparse ``type`` for a number of ``kind`` (``int`` or ``float``)
    > 0, and finite: anything else is a usage error (exit 64) whose message
    quotes the text."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not 0 < v < float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0" + ("" if kind is int else " and finite"))
        return v
    return parse
