"""The exit codes of every ``kvd`` command and the argument parser they all
use (a leaf module: the CLI, ``kvd bench`` and ``kvd demo`` import it, it
imports nothing of kvd's).

Exit codes: 0 ok; 1 not serving (``kvd health``: draining, or an unknown
``--service``), or a failed startup or run; 2 unreachable (``kvd health``,
``kvd status``: no answer within ``--timeout``, or refused); 64 a usage
error or an invalid setting (sysexits.h ``EX_USAGE``); 69 what the command
runs is not installed (``kvd demo`` without vLLM: kvd installed without its
``vllm`` extra; ``kvd bench`` without NIXL; sysexits.h ``EX_UNAVAILABLE``, "a
support program or file does not exist"), found by :func:`missing_modules`
before anything starts.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import re
from typing import Iterable

EXIT_OK, EXIT_NOT_SERVING, EXIT_UNREACHABLE, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 64, 69


class UsageParser(argparse.ArgumentParser):
    """argparse with usage errors exiting EXIT_USAGE (64, sysexits' EX_USAGE),
    not argparse's 2, which ``kvd health`` uses for "unreachable"; and no
    abbreviated long flags (argparse's default): ``--max-lease-life 900``
    must not mean ``--max-lease-life-s`` today and something else when a
    flag with that prefix is added."""

    def __init__(self, *args, flag_hints: dict[str, str] | None = None, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        #: Unknown flag -> the flag meant, where spelling does not tell
        #: (another command's name for the same thing).
        self.flag_hints = dict(flag_hints or {})

    def error(self, message: str):
        """Exits 64 with the error, a hint for a misspelt flag, and the usage
        when it is short (``kvd serve``'s fills a screen: its first line and
        a pointer to ``--help`` instead)."""
        usage = self.format_usage()
        if usage.count("\n") > 4:
            usage = f"usage: {self.prog} [options]  (`{self.prog} --help` lists them)\n"
        hint = ""
        if message.startswith("unrecognized arguments:"):
            known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            for flag in re.findall(r"(--[^\s=]+)", message):
                meant = self.flag_hints.get(flag)
                hint += f"; did you mean {meant}?" if meant else did_you_mean(flag, known)
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:  # a misspelt command (``kvd statsu``) or a value of a flag with choices
            hint += did_you_mean(choice[1], re.findall(r"'([^']*)'", choice[2]))
        self.exit(EXIT_USAGE, f"{usage}{self.prog}: error: {message}{hint}\n")


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean X?"`` for the ``known`` name closest to a misspelt
    ``name`` (difflib ratio 0.75 or more, one letter off in a key such as
    ``leese_s``), else ``""``: the hint of unknown flags, file keys and
    ``KVD_*`` variables alike."""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


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


def missing_modules(names: Iterable[str]) -> list[str]:
    """The modules of ``names`` this interpreter cannot find, in order: what
    a command that needs them reports before it starts anything, exiting
    EXIT_UNAVAILABLE. Looked up, not imported (importing vllm takes
    seconds); a lookup that fails (ImportError, ValueError) counts as
    missing."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing
