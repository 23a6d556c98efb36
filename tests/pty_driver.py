"""Drive a program through a pseudo-terminal the way a person at a keyboard would (stdlib only).

`Terminal.spawn(argv)` starts a program on a new pty of a fixed size; `type()` writes keystrokes
(b"\\x03" is Ctrl-C, b"\\x04" Ctrl-D: the terminal's line discipline turns them into SIGINT / EOF),
`expect()` waits for text on the screen. `Screen` is a small VT100 emulator: it applies the cursor moves,
erases and wraps a program writes, so a test checks what a person would see rather than the raw stream
(which also holds every intermediate frame of a redraw). `strip_ansi` gives the raw stream as text.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import select
import signal
import struct
import termios
import time
import unicodedata

ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_=>78c]|\x1b[()][0-9A-Za-z]")


def strip_ansi(text: str) -> str:
    """The text of a raw terminal stream without escape sequences (and without carriage returns)."""
    return ANSI.sub("", text).replace("\r", "")


class Screen:
    """A minimal VT100/xterm screen: printable text with auto-wrap, CR, LF, BS, TAB, and the CSI
    sequences rich and readline use (cursor up/down/forward/back/column/position, erase in line/display);
    colours and modes are ignored. Lines scrolled off the top are kept in `history`."""

    def __init__(self, rows: int = 40, cols: int = 100):
        self.rows, self.cols = rows, cols
        self.lines = [[" "] * cols for _ in range(rows)]
        self.history: list[str] = []
        self.x = self.y = 0
        self.pending_wrap = False
        self._buf = ""

    # ---- output ------------------------------------------------------------------------------------
    def _newline(self) -> None:
        if self.y == self.rows - 1:
            self.history.append("".join(self.lines.pop(0)).rstrip())
            self.lines.append([" "] * self.cols)
        else:
            self.y += 1

    def _put(self, ch: str) -> None:
        if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
            # zero width: joins the character before it, as a terminal draws it
            x, y = (self.x, self.y) if self.pending_wrap else (self.x - 1, self.y)
            if x >= 0:
                self.lines[y][x] += ch
            return
        wide = unicodedata.east_asian_width(ch) in ("W", "F")
        if self.pending_wrap or (wide and self.x == self.cols - 1):
            self.x = 0
            self._newline()
            self.pending_wrap = False
        self.lines[self.y][self.x] = ch
        if wide:
            self.x += 1
            self.lines[self.y][self.x] = ""  # the second cell of a wide character
        if self.x == self.cols - 1:
            self.pending_wrap = True
        else:
            self.x += 1

    def _csi(self, params: str, final: str) -> None:
        private = params.startswith("?")
        nums = [int(p) if p.isdigit() else 0 for p in params.lstrip("?").split(";")] if params else []
        n = nums[0] if nums and nums[0] else 1
        if private:
            return
        if final in "ABCDGHfJK":
            self.pending_wrap = False
        if final == "A":
            self.y = max(0, self.y - n)
        elif final == "B":
            self.y = min(self.rows - 1, self.y + n)
        elif final == "C":
            self.x = min(self.cols - 1, self.x + n)
        elif final == "D":
            self.x = max(0, self.x - n)
        elif final == "G":
            self.x = min(self.cols - 1, n - 1)
        elif final in "Hf":
            row = nums[0] if nums and nums[0] else 1
            col = nums[1] if len(nums) > 1 and nums[1] else 1
            self.y, self.x = min(self.rows - 1, row - 1), min(self.cols - 1, col - 1)
        elif final == "K":
            mode = nums[0] if nums else 0
            line = self.lines[self.y]
            span = range(self.x, self.cols) if mode == 0 else range(0, self.x + 1) if mode == 1 else range(self.cols)
            for i in span:
                line[i] = " "
        elif final == "J":
            mode = nums[0] if nums else 0
            if mode == 0:
                self._csi("0", "K")
                for r in range(self.y + 1, self.rows):
                    self.lines[r] = [" "] * self.cols
            elif mode in (2, 3):
                self.lines = [[" "] * self.cols for _ in range(self.rows)]

    def feed(self, data: str) -> None:
        data = self._buf + data
        self._buf = ""
        i = 0
        while i < len(data):
            ch = data[i]
            if ch == "\x1b":
                m = ANSI.match(data, i)
                if m is None:
                    if len(data) - i < 32:  # an escape sequence cut by a read: finish it next time
                        self._buf = data[i:]
                        return
                    i += 1
                    continue
                seq = m.group(0)
                if seq.startswith("\x1b["):
                    self._csi(seq[2:-1], seq[-1])
                elif seq == "\x1b7":
                    self._saved = (self.x, self.y)
                elif seq == "\x1b8":
                    self.x, self.y = getattr(self, "_saved", (0, 0))
                    self.pending_wrap = False
                i = m.end()
                continue
            if ch == "\r":
                self.x, self.pending_wrap = 0, False
            elif ch == "\n":
                self.pending_wrap = False
                self._newline()
            elif ch == "\b":
                self.x, self.pending_wrap = max(0, self.x - 1), False
            elif ch == "\t":
                self.x = min(self.cols - 1, (self.x // 8 + 1) * 8)
            elif ch == "\x07" or ord(ch) < 32:
                pass
            else:
                self._put(ch)
            i += 1

    def text(self) -> str:
        """Everything a person could scroll back through: history and the screen, trailing blanks dropped."""
        lines = self.history + ["".join(line).rstrip() for line in self.lines]
        while lines and not lines[-1]:
            lines.pop()
        return "\n".join(lines)


class Terminal:
    """A program running on a pseudo-terminal of `rows` x `cols`."""

    def __init__(self, pid: int, fd: int, rows: int, cols: int):
        self.pid, self.fd = pid, fd
        self.raw = b""
        self.screen = Screen(rows, cols)
        self._decoder_buf = b""
        self.returncode: int | None = None

    @classmethod
    def spawn(cls, argv: list[str], env: dict | None = None, rows: int = 40, cols: int = 100,
              cwd: str | None = None) -> Terminal:
        import pty

        pid, fd = pty.fork()
        if pid == 0:  # child: the pty is its controlling terminal, stdin/stdout/stderr
            try:
                if cwd:
                    os.chdir(cwd)
                os.execvpe(argv[0], argv, env if env is not None else os.environ)
            finally:
                os._exit(127)
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        return cls(pid, fd, rows, cols)

    # ---- reading -----------------------------------------------------------------------------------
    def _read_some(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError as e:  # EIO: the program exited and the pty closed
            if e.errno == errno.EIO:
                return False
            raise
        if not data:
            return False
        self.raw += data
        buf = self._decoder_buf + data
        # Keep an incomplete UTF-8 sequence at the end for the next read.
        cut = len(buf)
        for back in range(1, min(4, len(buf)) + 1):
            b = buf[-back]
            if b & 0xC0 == 0xC0:  # a lead byte: is its sequence complete?
                need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4
                if back < need:
                    cut = len(buf) - back
                break
            if b & 0x80 == 0:
                break
        self._decoder_buf = buf[cut:]
        self.screen.feed(buf[:cut].decode("utf-8", errors="replace"))
        return True

    @property
    def output(self) -> str:
        """The raw stream so far as text, escape sequences removed."""
        return strip_ansi(self.raw.decode("utf-8", errors="replace"))

    def expect(self, pattern: str, timeout: float = 30.0, since: int = 0) -> re.Match:
        """Wait until the raw output (escape codes stripped, from character `since` on) matches `pattern`."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.output, since)
            if m:
                return m
            left = deadline - time.monotonic()
            if left <= 0 or (not self._read_some(min(left, 0.2)) and not self.alive()):
                m = rx.search(self.output, since)
                if m:
                    return m
                raise TimeoutError(f"{pattern!r} did not appear within {timeout} s; screen:\n{self.screen.text()}")

    def drain(self, seconds: float = 0.2) -> None:
        """Read whatever arrives for `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._read_some(max(0.0, deadline - time.monotonic()))

    # ---- writing -----------------------------------------------------------------------------------
    def type(self, text: str | bytes, delay: float = 0.0) -> None:
        """Keystrokes; "\\r" is Enter. With `delay`, one character at a time."""
        data = text.encode() if isinstance(text, str) else text
        if delay:
            for b in data:
                os.write(self.fd, bytes([b]))
                time.sleep(delay)
        else:
            os.write(self.fd, data)

    # ---- process -----------------------------------------------------------------------------------
    def alive(self) -> bool:
        if self.returncode is not None:
            return False
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            return True
        self.returncode = os.waitstatus_to_exitcode(status)
        return False

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the program did not exit within {timeout} s; screen:\n{self.screen.text()}")
            self._read_some(0.1)
        while self._read_some(0.05):
            pass
        return self.returncode

    def close(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        try:
            os.close(self.fd)
        except OSError:
            pass
