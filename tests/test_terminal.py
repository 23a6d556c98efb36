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


def test_clover_run_on_a_terminal_never_writes_control_bytes(tmp_path):
    """A random tiny model writes ESC, BEL and NUL bytes: piped, they come through exactly; on a terminal
    (stdout a pty) they are shown as stand-ins."""
    import os
    import subprocess
    import sys

    import clover_lite
    from clover_lite.checkpoint.tiny import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "m", seed=0)
    args = [sys.executable, "-m", "clover_lite.cli.main", "run", str(model), "--raw", "--no-stats", "-n", "160",
            "--device", "cpu", "zz"]
    piped = subprocess.run(args, capture_output=True, timeout=300)
    assert piped.returncode == 0, piped.stderr
    expected = piped.stdout.decode()[:-1]  # a pipe gets the model's text as it is
    assert expected == clover_lite.load(model, device="cpu").generate("zz", raw=True, max_new_tokens=160).text
    assert any(_acts_on_a_terminal(ch) for ch in expected)  # the test has something to catch

    leader, follower = os.openpty()
    proc = subprocess.Popen(args, stdout=follower, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the pty closes with the process
            break
        if not chunk:
            break
        shown += chunk
    assert proc.wait(300) == 0
    os.close(leader)
    text = shown.decode()
    assert text.replace("\r\n", "\n") == terminal_safe(expected) + "\n"
    assert not any(_acts_on_a_terminal(ch) for ch in text.replace("\r\n", "\n"))
