"""Text from other processes made safe for one-line logs and terminals (a neutral leaf).

Request ids, engine ids and addresses come from engines, peers and API
clients; a newline in one would otherwise forge a log line (CWE-117), an
escape sequence would draw on the operator's terminal. Both the daemon's
formatters (``kvd.daemon.logs``) and the vLLM shim's log lines in the engine
(``kvd.shim.vllm.connector.adopt_vllm_logging``) escape them the same way.
"""

from __future__ import annotations

import re

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators
# (some log viewers break lines there).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_controls(text: str) -> str:
    """``text`` with every control character written as a Python escape
    (``"a\\nb"`` for ``"a\nb"``); other characters unchanged."""
    return _CONTROL.sub(lambda m: _NAMED.get(m[0]) or (f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100
                                                      else f"\\u{ord(m[0]):04x}"), text)


def clip(text: str, limit: int) -> str:
    """``text``, or its first ``limit`` characters and how many there were
    (a peer's or engine's id may be megabytes long)."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


def printable(text: str) -> str:
    """``text`` with every character but printable ASCII written as Python's
    ``ascii`` writes it (``\\x1b``, ``\\r``, ``\\u202e``, ``\\u3164``): engine
    ids, models, addresses and errors come from engines and peers, and ``kvd
    status`` prints them to an operator's terminal, where an escape sequence
    or a carriage return would rewrite what it shows, and where characters
    ``str.isprintable`` lets through still mislead (an attacker review:
    fillers that show as blank, so ``honest-engine`` + U+3164 looks like
    ``honest-engine``; combining strike-throughs, right-to-left letters,
    fullwidth lookalikes, wide characters that shift the columns)."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(c if " " <= c <= "~" else ascii(c)[1:-1] for c in text)
