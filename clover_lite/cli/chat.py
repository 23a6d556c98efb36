"""`clover chat`: a multi-turn chat that shows the block being denoised.

Three parts, so the conversation logic is testable without a terminal:
- `ChatSession`: the conversation (messages, system prompt, generation settings), slash commands, and
  turning a user message into token ids through the model's chat template;
- `ChatLoop`: reads lines from an input function, runs commands, streams replies into a view, handles
  Ctrl-C (stop the reply, keep the session) and end of input (exit);
- views: `TerminalView` (rich: the current block drawn with a dim placeholder per masked position that
  fills in, out of order, as the denoiser commits positions; committed text stays) and `PlainView`
  (plain streamed text and no control codes, for pipes).
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TextIO

from clover_lite.cli.terminal import for_stream, terminal_safe
from clover_lite.errors import CloverError, GenerationError
from clover_lite.runtime.generation import DoneEvent, GenerationConfig, StepEvent
from clover_lite.runtime.text_stream import TextStreamer

PLACEHOLDER = "\u2591"  # one per masked position of the current block (dim)



def chat_help(how: str, settings: str) -> str:
    """/help's text: `how` the reply is written, `settings` what /set takes (the loop's own), within 79 columns
    (a terminal's narrowest common width: wider lines wrap mid-phrase)."""
    set_line = textwrap.fill(f"change a setting: {settings}; /set alone lists them", width=79,
                             initial_indent="  /set KEY VALUE   ", subsequent_indent=" " * 19)
    return f"""\
Type a message and press Enter; end a line with \\ to continue on the next one.
{textwrap.fill(how, width=79)}

{set_line}
  /stats           statistics of the last reply and of the session
  /system TEXT     set the system message (/system alone shows it,
                   /system none removes it)
  /reset           forget the conversation (the system message and settings
                   stay)
  /help            this help
  /quit            leave (or Ctrl-D)

Ctrl-C stops the current reply after the denoising step under way (press it
twice to stop at once): the part already shown is KEPT in the conversation as
the assistant's answer (/reset to start over). Ctrl-C at the prompt clears the
line; Ctrl-D (or /quit) leaves."""


HELP = chat_help(f"The reply is denoised a block at a time: {PLACEHOLDER} marks a position still masked.",
                 "threshold, block (block size), temperature, max (max tokens), top_p, top_k, seed, policy "
                 "(threshold|fixed), confidence (prob|margin|entropy), steps (per block for the fixed policy), "
                 "commit (exact|reuse)")

# /set KEY -> GenerationConfig field
SETTING_ALIASES = {
    "threshold": "threshold",
    "block": "block_size", "block_size": "block_size", "block-size": "block_size", "blocksize": "block_size",
    "temperature": "temperature", "temp": "temperature", "t": "temperature",
    "max": "max_new_tokens", "max_tokens": "max_new_tokens", "max-tokens": "max_new_tokens",
    "max_new_tokens": "max_new_tokens", "n": "max_new_tokens",
    "top_p": "top_p", "top-p": "top_p", "top_k": "top_k", "top-k": "top_k", "seed": "seed",
    "policy": "policy", "steps": "steps_per_block", "steps_per_block": "steps_per_block",
    "confidence": "confidence", "commit": "commit",
}
SETTING_NAMES = ("threshold", "block", "temperature", "max", "top_p", "top_k", "seed", "policy", "steps",
                 "confidence", "commit")
_INT_FIELDS = {"max_new_tokens", "block_size", "steps_per_block", "top_k", "seed"}
_FLOAT_FIELDS = {"threshold", "temperature", "top_p"}
_NULLABLE = {"block_size", "steps_per_block", "seed"}  # "/set block default" goes back to the model's

# Control characters other than newline and tab would move the cursor or worse: shown as U+FFFD.
# ---- the conversation --------------------------------------------------------------------------
@dataclass
class ReplyStats:
    tokens: int
    seconds: float
    forwards: int
    committed: int
    finish_reason: str  # eos | stop | length | interrupted
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        decode = self.seconds - self.prefill_seconds
        return self.tokens / decode if decode > 0 else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.committed / self.forwards if self.forwards else 0.0

    def line(self) -> str:
        end = {"length": "max tokens reached", "interrupted": "interrupted", "stop": "stop string"}.get(
            self.finish_reason, "")
        parts = [f"{self.tokens} tokens", f"{self.tokens_per_second:.1f} tok/s",
                 f"{self.tokens_per_forward:.2f} tokens/forward", f"{self.forwards} forwards",
                 f"{self.seconds:.2f} s"]
        return " \u00b7 ".join(parts + ([end] if end else []))


@dataclass
class CommandResult:
    text: str = ""
    error: bool = False
    quit: bool = False


class ChatSession:
    """Messages, system prompt and settings of one conversation; slash commands. No terminal I/O."""

    help = HELP

    def __init__(self, engine, config: GenerationConfig | None = None, system: str | None = None):
        self.engine = engine
        self.config = self.initial_config(config)
        self.system = system
        self.messages: list[dict] = []
        self.last: ReplyStats | None = None
        self.replies = 0
        self.total_tokens = 0
        self.total_forwards = 0
        self.total_committed = 0
        self.total_seconds = 0.0
        tok = engine.tokenizer
        if tok is None:
            raise CloverError(f"{engine.path}: the model has no tokenizer files; chat needs text in and out")
        self.templated = tok.has_chat_template

    def initial_config(self, config: GenerationConfig | None):
        return self.engine.resolve_config(config)

    # ---- prompts ---------------------------------------------------------------------------------
    def conversation(self, user_text: str | None = None) -> list[dict]:
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + list(self.messages)
        if user_text is not None:
            msgs.append({"role": "user", "content": user_text})
        return msgs

    def prompt_ids(self, user_text: str) -> list[int]:
        """The whole conversation plus the new message, through the chat template (or, for a model
        without one, a plain 'User: / Assistant:' transcript)."""
        msgs = self.conversation(user_text)
        if self.templated:
            return self.engine.encode_prompt(msgs)
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in msgs) + "Assistant:"
        return self.engine.encode_prompt(text)

    def request(self, user_text: str) -> tuple[list[int], GenerationConfig]:
        """Token ids and settings for a reply; max tokens is trimmed to what the context has left."""
        ids = self.prompt_ids(user_text)
        cfg = self.config
        if not self.templated:
            cfg = cfg.replace(stop=tuple(cfg.stop) + ("\nUser:",))
        limit = self.engine.context_limit
        room = limit - len(ids)
        if room < 1:
            raise GenerationError(
                f"the conversation ({len(ids)} tokens) fills the context ({limit} tokens); /reset to start over"
            )
        if cfg.max_new_tokens > room:
            cfg = cfg.replace(max_new_tokens=room)
        return ids, cfg

    def record(self, user_text: str, reply: str, stats: ReplyStats) -> None:
        self.messages.append({"role": "user", "content": user_text})
        if reply:
            self.messages.append({"role": "assistant", "content": reply})
        self.last = stats
        self.replies += 1
        self.total_tokens += stats.tokens
        self.total_forwards += stats.forwards
        self.total_committed += stats.committed
        self.total_seconds += stats.seconds

    # ---- settings ----------------------------------------------------------------------------------
    def set(self, key: str, value: str) -> str:
        """Change one generation setting; raises GenerationError with a clear message when invalid."""
        name = SETTING_ALIASES.get(key.lower())
        if name is None:
            raise GenerationError(f"unknown setting '{key}'; settings: {', '.join(SETTING_NAMES)}")
        raw = value.strip()
        parsed: object
        if name in _NULLABLE and raw.lower() in ("default", "auto", "none"):
            parsed = None
        elif name in _INT_FIELDS:
            try:
                parsed = int(raw)
            except ValueError:
                raise GenerationError(f"{key} expects a whole number, got '{raw}'") from None
        elif name in _FLOAT_FIELDS:
            try:
                parsed = float(raw)
            except ValueError:
                raise GenerationError(f"{key} expects a number, got '{raw}'") from None
        else:
            parsed = raw
        cfg = self.config.replace(**{name: parsed})
        if name == "block_size" and self.config.steps_per_block == self.config.block_size:
            cfg = cfg.replace(steps_per_block=None)  # steps followed the old block size: follow the new one
        self.config = self.engine.resolve_config(cfg)  # validates (GenerationError with the reason)
        return f"{name} = {getattr(self.config, name)}"

    def settings_text(self) -> str:
        c = self.config
        shown = ("threshold", "block_size", "temperature", "max_new_tokens", "top_p", "top_k", "seed", "policy",
                 "steps_per_block", "confidence", "commit")
        names = {f.name for f in fields(c)}
        return "\n".join(f"  {k:<16} {getattr(c, k)}" for k in shown if k in names)

    def stats_text(self) -> str:
        lines = []
        if self.last is None:
            lines.append("no reply yet")
        else:
            s = self.last
            lines.append(f"last reply: {s.line()}")
            lines.append(f"  prompt {s.prompt_tokens} tokens (prefill {s.prefill_seconds:.2f} s), "
                         f"{s.committed} positions committed by {s.forwards} denoising forwards, "
                         f"finish: {s.finish_reason}")
        if self.replies:
            tps = self.total_tokens / self.total_seconds if self.total_seconds > 0 else 0.0
            tpf = self.total_committed / self.total_forwards if self.total_forwards else 0.0
            lines.append(f"session: {self.replies} replies, {self.total_tokens} tokens, {tps:.1f} tok/s overall, "
                         f"{tpf:.2f} tokens/forward, {self.total_forwards} forwards")
        used = len(self.prompt_ids("")) if self.messages or self.system else 0
        lines.append(f"conversation: {len(self.messages)} messages, ~{used} of "
                     f"{self.engine.context_limit} context tokens")
        return "\n".join(lines)

    def command(self, line: str) -> CommandResult:
        """Run a slash command ('/set threshold 0.5')."""
        cmd, _, rest = line.strip().partition(" ")
        cmd, rest = cmd.lower(), rest.strip()
        if cmd in ("/quit", "/exit", "/bye", "/q"):
            return CommandResult(quit=True)
        if cmd in ("/help", "/?", "/h"):
            return CommandResult(self.help)
        if cmd == "/reset":
            n = len(self.messages)
            self.messages.clear()
            return CommandResult(f"conversation cleared ({n} messages forgotten)")
        if cmd == "/stats":
            return CommandResult(self.stats_text())
        if cmd == "/system":
            if not rest:
                return CommandResult(f"system: {self.system}" if self.system else "no system message")
            if rest.lower() == "none":
                self.system = None
                return CommandResult("system message removed")
            self.system = rest
            return CommandResult("system message set (it applies to the whole conversation)")
        if cmd == "/set":
            if not rest:
                return CommandResult("settings:\n" + self.settings_text())
            key, _, value = rest.partition(" ")
            if not value.strip():
                return CommandResult(f"usage: /set {key} VALUE", error=True)
            try:
                return CommandResult(self.set(key, value))
            except GenerationError as e:
                return CommandResult(str(e), error=True)
        return CommandResult(f"unknown command {cmd}; /help lists the commands", error=True)


# ---- views -------------------------------------------------------------------------------------
TailItem = tuple[str, bool]  # (text, committed): committed positions after the first masked one


class PlainView:
    """Plain text: replies stream to `out`, statistics and errors go to `err`; no control codes."""

    def __init__(self, out: TextIO, err: TextIO, prompts: bool = False):
        self.out, self.err, self.prompts = out, err, prompts
        self._shown = 0

    def prompt(self, continuation: bool = False) -> str:
        return ("... " if continuation else ">>> ") if self.prompts else ""

    def banner(self, text: str) -> None:
        if self.prompts:
            self.err.write(text + "\n")

    def reply_start(self) -> None:
        self._shown = 0

    def reply_update(self, stable: str, tail: list[TailItem]) -> None:
        if len(stable) > self._shown:
            self.out.write(for_stream(stable[self._shown :], self.out))
            self.out.flush()
            self._shown = len(stable)

    def reply_end(self, stable: str, stats: ReplyStats | None) -> None:
        self.reply_update(stable, [])
        if self._shown or stats is not None:
            self.out.write("\n")
        self.out.flush()
        if stats is None:
            return
        if stats.finish_reason == "interrupted":
            self.err.write("[interrupted: the part shown stays in the conversation]\n")
        self.err.write(f"[{stats.line()}]\n")
        self.err.flush()

    def info(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def cancelled(self) -> None:
        """Ctrl-C at the prompt: the line is dropped."""
        self.err.write("\n(Ctrl-D or /quit to leave)\n" if self.prompts else "")
        self.err.flush()

    def error(self, text: str) -> None:
        self.err.write(f"error: {text}\n")
        self.err.flush()


class TerminalView:
    """rich on a terminal. Finished lines of the reply are printed for good; a rich Live region holds only
    the current line: its committed text plus the current block, where each still-masked position is a dim
    placeholder and positions committed out of order show in colour until the text before them is final."""

    FRAME_SECONDS = 1 / 60  # redraws at most this often (the last frame of a reply is always drawn)

    def __init__(self, console=None):
        from rich.console import Console

        self.console = console or Console(highlight=False)
        self.live = None
        self._flushed = 0
        self._last_draw = 0.0

    def prompt(self, continuation: bool = False) -> str:
        # \001 ... \002 tell readline the escape codes take no room on the line.
        return "\001\033[2m\002... \001\033[0m\002" if continuation else "\001\033[1;32m\002>>> \001\033[0m\002"

    def banner(self, text: str) -> None:
        self.console.print(text, style="dim", markup=False)

    def reply_start(self) -> None:
        from rich.live import Live

        self._flushed = 0
        self._last_draw = 0.0
        self.live = Live(console=self.console, auto_refresh=False, transient=False, redirect_stdout=False,
                         redirect_stderr=False, vertical_overflow="visible")
        self.live.start()

    def _flush_lines(self, stable: str) -> str:
        """Print the finished lines of `stable` above the live region; return the current line. A current
        line wider than the terminal is broken at a space (as word wrap would) and printed too, so the live
        region stays one or two rows high."""
        from rich.cells import cell_len
        from rich.text import Text

        pending = stable[self._flushed :]
        nl = pending.rfind("\n")
        if nl >= 0:
            for line in pending[:nl].split("\n"):
                self.live.console.print(Text(terminal_safe(line).expandtabs(8)))
            self._flushed += nl + 1
        width = max(self.console.width, 20)
        current = stable[self._flushed :]
        while cell_len(terminal_safe(current).expandtabs(8)) > width:
            cut, cells = 0, 0
            for i, ch in enumerate(current):
                cells += cell_len(terminal_safe(ch).expandtabs(8))
                if cells > width:
                    break
                cut = i + 1
            space = current.rfind(" ", 0, cut + 1)
            end = space if space > 0 else cut
            self.live.console.print(Text(terminal_safe(current[:end]).expandtabs(8)))
            self._flushed += end + (1 if space > 0 else 0)
            current = stable[self._flushed :]
        return current

    def reply_update(self, stable: str, tail: list[TailItem], final: bool = False) -> None:
        from rich.text import Text

        now = time.perf_counter()
        if not final and now - self._last_draw < self.FRAME_SECONDS:
            return
        self._last_draw = now
        current = self._flush_lines(stable)
        text = Text(terminal_safe(current).expandtabs(8))
        for piece, committed in tail:
            if committed:
                text.append(terminal_safe(piece).replace("\n", "\u21b5").replace("\t", " "), style="bold cyan")
            else:
                text.append(PLACEHOLDER, style="dim")
        self.live.update(text, refresh=True)

    def reply_end(self, stable: str, stats: ReplyStats | None) -> None:
        from rich.text import Text

        if self.live is not None:
            self.reply_update(stable, [], final=True)
            self.live.stop()
            self.live = None
        if stats is None:
            return
        if stats.finish_reason == "interrupted":
            self.console.print(Text("\u23f9 interrupted: the part shown stays in the conversation", style="yellow"))
        self.console.print(Text(stats.line(), style="dim"))

    def info(self, text: str) -> None:
        from rich.text import Text

        self.console.print(Text(text, style="cyan"))

    def cancelled(self) -> None:
        """Ctrl-C at the prompt: readline dropped the line; the cursor is still after it."""
        from rich.text import Text

        self.console.print()
        self.console.print(Text("(Ctrl-D or /quit to leave)", style="dim"))

    def error(self, text: str) -> None:
        from rich.text import Text

        self.console.print(Text(f"error: {text}", style="bold red"))


# ---- Ctrl-C ------------------------------------------------------------------------------------
class InterruptGuard:
    """While a reply streams: the first Ctrl-C asks the loop to stop after the current denoising step (the
    screen and the engine stay consistent); a second one raises KeyboardInterrupt at once."""

    def __init__(self):
        self.requested = False
        self._old = None

    def _handler(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> InterruptGuard:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


class EofWatch:
    """While a reply streams on a terminal: Ctrl-D (end of input) stops the reply after the current step and
    leaves the chat, as it does at the prompt. The terminal stays in its normal line mode, where Ctrl-D on
    an empty line makes a read return nothing; whole lines typed ahead meanwhile are kept for the prompt."""

    def __init__(self, fd: int | None):
        self.fd = fd
        self.seen = False
        self.typed_ahead: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _watch(self) -> None:
        import select

        while not self._stop.is_set():
            ready, _, _ = select.select([self.fd], [], [], 0.05)
            if not ready or self._stop.is_set():
                continue
            data = os.read(self.fd, 4096)
            if not data:
                self.seen = True
                return
            self.typed_ahead += data.decode("utf-8", "replace").splitlines()

    def __enter__(self) -> EofWatch:
        if self.fd is not None:
            self._thread = threading.Thread(target=self._watch, name="clover-chat-eof", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# ---- the loop ----------------------------------------------------------------------------------
class ChatLoop:
    """Reads lines with `read_line(prompt)` (raises EOFError at the end of input, KeyboardInterrupt on
    Ctrl-C), runs slash commands, and streams replies from the session's engine into `view`."""

    def __init__(self, session: ChatSession, read_line: Callable[[str], str], view, watch_fd: int | None = None,
                 strict: bool = False):
        """`watch_fd`: the terminal's input, watched for Ctrl-D during a reply (EofWatch); None: not watched.
        `strict` (a script's piped input): run() returns 1 if a message or command failed."""
        self.session = session
        self.read_line = read_line
        self.view = view
        self.watch_fd = watch_fd
        self.typed_ahead: list[str] = []
        self.leaving = False
        self.strict = strict
        self.failed = 0  # messages and commands that ended in an error

    def _next_line(self, prompt: str) -> str:
        if self.typed_ahead:  # typed during the reply: already echoed by the terminal
            return self.typed_ahead.pop(0)
        return self.read_line(prompt)

    def read_message(self) -> str:
        line = self._next_line(self.view.prompt())
        parts = []
        while line.endswith("\\"):
            parts.append(line[:-1])
            line = self._next_line(self.view.prompt(continuation=True))
        parts.append(line)
        return "\n".join(parts)

    def exit_status(self) -> int:
        """0; 1 when strict and a message or command failed, so a script sees that a turn went wrong."""
        return int(self.strict and self.failed > 0)

    def run(self) -> int:
        """Chat until the input ends or /quit; the exit status (exit_status)."""
        while True:
            try:
                text = self.read_message()
            except EOFError:
                return self.exit_status()
            except KeyboardInterrupt:
                self.view.cancelled()
                continue
            if not text.strip():
                continue
            if text.lstrip().startswith("/"):
                result = self.session.command(text)
                if result.quit:
                    return self.exit_status()
                self.failed += result.error
                (self.view.error if result.error else self.view.info)(result.text)
                continue
            try:
                self.reply(text)
            except CloverError as e:
                self.failed += 1
                self.view.error(str(e))
            if self.leaving:  # Ctrl-D during the reply
                return self.exit_status()

    def drive(self, events: Iterator, handle: Callable[[object], bool]) -> None:
        """Advance a reply's `events`, each passed to `handle` (True once the result has arrived). Ctrl-C stops it
        after the step under way (twice: at once), and so does Ctrl-D, which then leaves the chat."""
        with InterruptGuard() as guard, EofWatch(self.watch_fd) as eof:
            try:
                for event in events:
                    if not handle(event) and (guard.requested or eof.seen):
                        break
            except KeyboardInterrupt:
                pass
            finally:
                events.close()
        self.typed_ahead += eof.typed_ahead
        self.leaving = eof.seen

    def tail(self, event: StepEvent, prompt_len: int) -> list[TailItem]:
        """The current block from its first masked position on: placeholders and out-of-order commits."""
        first = max(prompt_len - event.block_start, 0)
        block = event.block[first:]
        if None not in block:
            return []
        start = block.index(None)
        decode = self.session.engine.decode
        return [("", False) if t is None else (decode([t]), True) for t in block[start:]]

    def reply(self, user_text: str) -> ReplyStats:
        """Stream one reply into the view and record it; Ctrl-C ends it early (the part shown is kept), and so
        does Ctrl-D, which then leaves the chat."""
        session = self.session
        ids, cfg = session.request(user_text)
        streamer = TextStreamer(cfg.stop)
        forwards = committed = contiguous = 0
        result = None
        t0 = time.perf_counter()
        self.view.reply_start()

        def handle(event) -> bool:
            nonlocal forwards, committed, contiguous, result
            if isinstance(event, StepEvent):
                forwards += 1
                committed += len(event.committed)
                done = event.block.index(None) if None in event.block else len(event.block)
                contiguous = max(event.block_start + done - len(ids), 0)
                streamer.feed(event.text)
                self.view.reply_update(streamer.printed, self.tail(event, len(ids)))
            elif isinstance(event, DoneEvent):
                result = event.generation
            return result is not None

        try:
            self.drive(session.engine.stream(ids, cfg), handle)
        except BaseException:
            self.view.reply_end(streamer.printed, None)
            raise
        if result is not None:
            s = result.stats
            stats = ReplyStats(s.new_tokens, s.seconds, s.forwards, s.committed_tokens, result.finish_reason,
                               s.prompt_tokens, s.prefill_seconds)
            reply = result.text
        else:
            reply = streamer.printed
            stats = ReplyStats(contiguous, time.perf_counter() - t0, forwards, committed, "interrupted", len(ids))
        self.view.reply_end(reply, stats)
        session.record(user_text, reply, stats)
        return stats


# ---- the command -------------------------------------------------------------------------------
def _history_file() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "clover" / "chat_history"


def _readline_input() -> Callable[[str], str]:
    """input() with line editing and a persistent history (stdlib readline, where the platform has it)."""
    try:
        import readline
    except ImportError:  # Windows without pyreadline: plain input()
        return input
    path = _history_file()
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass

    import atexit

    atexit.register(save)
    return input


def _plain_input(prompt_stream: TextIO | None) -> Callable[[str], str]:
    def read(prompt: str) -> str:
        if prompt and prompt_stream is not None:
            prompt_stream.write(prompt)
            prompt_stream.flush()
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n").rstrip("\r")

    return read


def banner(engine) -> str:
    c = engine.config
    total, _ = engine.model.num_parameters()
    name = engine.path.name if engine.path else c.model_type
    size = f"{total / 1e9:.1f}B" if total >= 1e9 else f"{total / 1e6:.1f}M"
    dtype = str(engine.model.embed_tokens.weight.dtype).replace("torch.", "")
    return (f"clover chat \u00b7 {name} ({c.model_type}, {size} parameters, block {c.block_size}) on "
            f"{engine.device} {dtype} \u00b7 /help for commands, Ctrl-D to leave")


__all__ = ["ChatSession", "ChatLoop", "PlainView", "TerminalView", "ReplyStats", "CommandResult", "HELP", "chat_help"]
