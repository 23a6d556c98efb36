"""Model output on a terminal: control characters are shown, never acted on; piped output is untouched."""

import io
import random

from clover_lite.cli.terminal import for_stream, terminal_safe


def _acts_on_a_terminal(ch: str) -> bool:
    c = ord(ch)
    return (c < 0x20 and ch not in "\n\t") or 0x7F <= c < 0xA0 or c in (0x200E, 0x200F) or 0x202A <= c <= 0x202E \
        or 0x2066 <= c <= 0x2069


def test_no_control_character_survives():
    rng = random.Random()
    alphabet = [chr(c) for c in range(0x00, 0x100)] + ["\u202e", "\u2066", "\u200f", "é", "中", "\U0001f600"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        safe = terminal_safe(text)
        assert not any(_acts_on_a_terminal(ch) for ch in safe), repr(safe)
        # Character by character: the others are kept as they are, each control becomes a visible stand-in.
        for ch in text:
            out = terminal_safe(ch)
            assert out == ch if not _acts_on_a_terminal(ch) else (out and out.isprintable()), (ch, out)
        split = rng.randint(0, len(text))
        assert safe == terminal_safe(text[:split]) + terminal_safe(text[split:])


def test_hand_worked_cases():
    assert terminal_safe("a\x1b[31mred\x07\x00b\n\tc") == "a\u241b[31mred\u2407\u2400b\n\tc"
    assert terminal_safe("\r\x7f\x9b") == "\u240d\u2421<U+009B>"
    assert terminal_safe("abc\u202edef") == "abc<U+202E>def"
    assert terminal_safe("héllo 中文 🙂") == "héllo 中文 🙂"


def test_only_a_terminal_gets_the_stand_ins():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    raw = "x\x1b]0;title\x07y"
    assert for_stream(raw, io.StringIO()) == raw  # a pipe or file: byte-exact
    assert for_stream(raw, Tty()) == "x\u241b]0;title\u2407y"
