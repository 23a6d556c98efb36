"""Model output made safe for a terminal: it is untrusted text, and on a terminal raw control characters
become escape sequences (cursor moves, colours, titles, a bell) or hide what was written.

C0 controls other than newline and tab, DEL, and the C1 controls are shown as their Unicode control
pictures (ESC as U+241B) or as <U+XXXX>; the bidirectional overrides and isolates, which can make a line
read differently from what it holds, are shown as <U+XXXX>. Only what goes to a terminal is changed:
piped output stays byte-exact.
"""

from __future__ import annotations

from typing import TextIO

_BIDI = [0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_TABLE = {c: chr(0x2400 + c) for c in range(0x20) if c not in (0x09, 0x0A)}
_TABLE[0x7F] = "\u2421"
_TABLE.update({c: f"<U+{c:04X}>" for c in (*range(0x80, 0xA0), *_BIDI)})


def terminal_safe(text: str) -> str:
    """`text` with every control character that a terminal would act on replaced by a visible stand-in."""
    return text.translate(_TABLE)


def for_stream(text: str, stream: TextIO) -> str:
    """`text` made terminal-safe when `stream` is a terminal, unchanged otherwise."""
    isatty = getattr(stream, "isatty", None)
    return terminal_safe(text) if isatty is not None and isatty() else text
