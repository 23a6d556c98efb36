"""`clover chat`: driven on a pseudo-terminal as a person would (type, slash commands, Ctrl-C during a reply,
Ctrl-D), through pipes (plain text, no escape codes), and its session and loop in-process."""

import io
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from clover_lite.cli.chat import PLACEHOLDER, ChatLoop, ChatSession, PlainView, ReplyStats
from clover_lite.runtime.generation import GenerationConfig, StepEvent

sys.path.insert(0, str(Path(__file__).parent))
from pty_driver import Screen, Terminal, strip_ansi  # noqa: E402


def clover_argv(*args):
    exe = shutil.which("clover")
    return ([exe] if exe else [sys.executable, "-m", "clover_lite.cli.main"]) + list(args)


def _env(tmp_path, **extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", HOME=str(tmp_path), TERM="xterm-256color", **extra)
    for key in ("COLUMNS", "LINES", "XDG_STATE_HOME", "NO_COLOR", "FORCE_COLOR"):
        env.pop(key, None)
    return env


# ---- a person at a terminal ------------------------------------------------------------------------
def test_chat_on_a_terminal(tiny_dir, tmp_path):
    t = Terminal.spawn(clover_argv("chat", "--model", str(tiny_dir)), env=_env(tmp_path), rows=40, cols=100)

    def enter(text, pattern, timeout=60):
        """Type a line and Enter, wait for `pattern`, then for the next prompt (as a person waits)."""
        mark = len(t.output)
        t.type(text + "\r")
        m = t.expect(pattern, timeout, since=mark)
        t.expect(r">>> ", 30, since=m.end())
        t.drain(0.1)

    try:
        t.expect(r">>> ", 60)
        enter("/set block 8", "block_size = 8")
        enter("/set temperature -1", "temperature must be >= 0")
        enter("/set max 24", "max_new_tokens = 24")
        enter("Hello there", r"24 tokens .* tokens/forward")
        enter("/stats", "session: 1 replies, 24 tokens")

        # A long reply, interrupted by Ctrl-C once the block drawing is on screen.
        enter("/set max 6000", "max_new_tokens = 6000")
        mark = len(t.output)
        t.type("tell me a long story\r")
        t.expect(PLACEHOLDER, 30, since=mark)
        t.drain(0.3)
        t.type(b"\x03")
        t.expect(r"interrupted: the part shown stays", 30, since=mark)
        m = t.expect(r"tokens/forward .* interrupted", 30, since=mark)
        t.expect(r">>> ", 30, since=m.end())

        # The session goes on.
        enter("/set max 16", "max_new_tokens = 16")
        enter("and again", r"16 tokens .* tokens/forward")
        mark = len(t.output)
        t.type(b"\x03")  # Ctrl-C at the prompt clears the line, does not leave
        t.expect(r"Ctrl-D or /quit to leave\)\s*>>> ", 30, since=mark)
        t.drain(0.2)
        t.type(b"\x04")  # Ctrl-D leaves
        assert t.wait(30) == 0
    finally:
        t.close()

    raw = t.raw.decode("utf-8", errors="replace")
    screen = t.screen.text()
    print(screen)  # what a person saw (pytest -s shows it)
    assert "Traceback" not in screen
    assert PLACEHOLDER in raw and "\x1b[" in raw  # placeholders were drawn, with rich's styling
    assert PLACEHOLDER not in screen  # ...and every one was replaced: committed text stays, nothing masked remains
    lines = screen.splitlines()
    assert lines[0].startswith("clover chat") and "/help" in screen
    prompts = [line[4:] for line in lines if line.startswith(">>>")]
    assert prompts == ["/set block 8", "/set temperature -1", "/set max 24", "Hello there", "/stats",
                       "/set max 6000", "tell me a long story", "/set max 16", "and again", "", ""]
    assert lines[-2:] == ["(Ctrl-D or /quit to leave)", ">>>"]
    status = [line for line in lines if " tok/s \u00b7 " in line and not line.startswith(("last", "session"))]
    assert len(status) == 3 and status[1].endswith("interrupted") and status[0].startswith("24 tokens")
    # the reply to "Hello there" sits between its prompt and its status line, on the screen for good
    i, j = lines.index(">>> Hello there"), lines.index(status[0])
    assert j > i + 1 and any(line.strip() for line in lines[i + 1 : j])


def test_screen_emulator_applies_redraws():
    s = Screen(rows=5, cols=10)
    s.feed("abc\r\x1b[2Kxy\x1b[1;36mz\x1b[0m\r\nline two is long")
    assert s.text() == "xyz\nline two i\ns long"
    s.feed("\r\x1b[2K\x1b[1Aok\x1b[K")
    assert s.text().splitlines()[1] == "ok"
    assert strip_ansi("\x1b[?25la\x1b[2mb\x1b[0m\r\n") == "ab\n"


# ---- pipes -----------------------------------------------------------------------------------------
def test_chat_through_pipes_is_plain_text(tiny_dir, tmp_path):
    script = "hello\n/set block 0\n/set max 8\nsecond \\\nline\n/stats\n/system be brief\n/quit\nnever read\n"
    r = subprocess.run(clover_argv("chat", "--model", str(tiny_dir), "-n", "20"), input=script,
                       capture_output=True, text=True, timeout=120, env=_env(tmp_path))
    assert r.returncode == 1, r.stderr  # the script's "/set block 0" failed: a script sees it in the exit status
    assert "\x1b" not in r.stdout and "\x1b" not in r.stderr and PLACEHOLDER not in r.stdout
    assert ">>>" not in r.stdout  # no prompts when stdin is not a terminal
    assert "max_new_tokens = 8" in r.stdout and "session: 2 replies, 28 tokens" in r.stdout
    assert "system message set" in r.stdout
    assert "error: block_size must be >= 1, got 0" in r.stderr
    assert r.stderr.count("tokens/forward") == 2 and "[20 tokens" in r.stderr and "[8 tokens" in r.stderr


def test_chat_without_a_model_uses_the_bundled_one_or_says_what_to_do(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from clover_lite.cli.main import main
    from clover_lite.runtime.engine import BUNDLED_MODEL

    monkeypatch.setenv("HOME", str(tmp_path))
    r = CliRunner().invoke(main, ["chat", "-n", "8"], input="Hello!\n/stats\n")
    if (BUNDLED_MODEL / "config.json").exists():
        assert r.exit_code == 0, r.output
        assert "session: 1 replies" in r.output and "\x1b" not in r.output
    else:
        assert r.exit_code == 1 and "no bundled default model" in r.output and "clover tiny" in r.output


# ---- in-process: the session and the loop ---------------------------------------------------------
def _loop(engine, lines, view=None, **config):
    session = ChatSession(engine, GenerationConfig(**config) if config else None)
    feed = iter(lines)

    def read(prompt):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    out, err = io.StringIO(), io.StringIO()
    view = view or PlainView(out, err)
    return ChatLoop(session, read, view), session, out, err


def test_settings_are_validated_with_clear_messages(tiny_engine):
    session = ChatSession(tiny_engine)
    assert session.command("/set threshold 0.5").text == "threshold = 0.5"
    assert session.command("/set block 8").text == "block_size = 8" and session.config.steps_per_block == 8
    assert session.command("/set block default").text == "block_size = 4"
    assert session.command("/set temp 0.7").text == "temperature = 0.7"
    assert session.command("/set max 64").text == "max_new_tokens = 64"
    for cmd, msg in [("/set threshold abc", "threshold expects a number, got 'abc'"),
                     ("/set threshold 2", "threshold must be in [0, 1]"),
                     ("/set max 1.5", "max expects a whole number"),
                     ("/set block 0", "block_size must be >= 1"),
                     ("/set temperature -2", "temperature must be >= 0"),
                     ("/set top_p 0", "top_p must be in (0, 1]"),
                     ("/set policy greedy", "policy must be one of"),
                     ("/set colour red", "unknown setting 'colour'"),
                     ("/set threshold", "usage: /set threshold VALUE"),
                     ("/frobnicate", "unknown command /frobnicate")]:
        r = session.command(cmd)
        assert r.error and msg in r.text, (cmd, r.text)
    assert session.config.threshold == 0.5 and session.config.temperature == 0.7  # errors change nothing
    assert "threshold" in session.command("/set").text
    assert "KEPT in the conversation" in session.command("/help").text
    assert session.command("/quit").quit and session.command("/exit").quit


def test_multi_turn_history_system_and_reset(tiny_engine):
    loop, session, out, err = _loop(tiny_engine, ["/system You are terse.", "first question", "second", "/stats"],
                                    max_new_tokens=6)
    assert loop.run() == 0
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]
    ids = session.prompt_ids("third")
    text = tiny_engine.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>") and "first question" in text
    assert session.messages[1]["content"] in text and text.endswith("<|im_start|>assistant\n")
    assert "session: 2 replies, 12 tokens" in out.getvalue()
    assert err.getvalue().count("tokens/forward") == 2
    assert session.command("/reset").text == "conversation cleared (4 messages forgotten)"
    assert session.messages == [] and session.system == "You are terse."
    assert session.command("/system none").text == "system message removed" and session.system is None


def test_ctrl_c_during_a_reply_keeps_the_part_shown(tiny_engine):
    class InterruptingView(PlainView):
        updates = 0

        def reply_update(self, stable, tail):
            super().reply_update(stable, tail)
            self.updates += 1
            if self.updates == 12:
                os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C on a terminal sends

    out, err = io.StringIO(), io.StringIO()
    view = InterruptingView(out, err)
    loop, session, _, _ = _loop(tiny_engine, ["tell me everything", "next"], view=view, max_new_tokens=40,
                                  ignore_eos=True)
    assert loop.run() == 0
    assert session.replies == 2
    first = session.messages[1]["content"]
    assert session.messages[0]["content"] == "tell me everything" and first
    assert first in out.getvalue()  # not a terminal: the reply byte-exact
    assert "[interrupted: the part shown stays in the conversation]" in err.getvalue()
    assert session.last.finish_reason == "length"  # the second reply ran normally
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler was put back


def test_context_is_trimmed_and_a_full_context_is_reported(tiny_engine):
    session = ChatSession(tiny_engine, GenerationConfig(max_new_tokens=100_000))
    ids, cfg = session.request("hi")
    assert cfg.max_new_tokens == tiny_engine.config.max_position_embeddings - len(ids)
    session.messages = [{"role": "user", "content": "x" * 9000}]
    with pytest.raises(Exception, match="fills the context .* /reset"):
        session.request("hi")


def test_block_tail_shows_placeholders_and_out_of_order_commits(tiny_engine):
    loop, _, _, _ = _loop(tiny_engine, [])
    # prompt of 6 tokens; block [4, 8): positions 4-5 are prompt, 6 masked, 7 committed out of order
    ev = StepEvent(block_start=4, committed=[7], tokens=[ord("x")], block=[1, 2, None, ord("x")], text="")
    assert loop.tail(ev, 6) == [("", False), ("x", True)]
    ev = StepEvent(block_start=8, committed=[8], tokens=[ord("a")], block=[ord("a"), None, ord("b"), None],
                   text="a")
    assert loop.tail(ev, 6) == [("", False), ("b", True), ("", False)]
    ev = StepEvent(block_start=8, committed=[9], tokens=[1], block=[1, 2, 3, 4], text="")
    assert loop.tail(ev, 6) == []
    assert ReplyStats(10, 2.0, 5, 10, "interrupted").line().endswith("interrupted")


def test_a_model_without_chat_template_gets_a_plain_transcript(tiny_dir, tmp_path):
    import json

    import clover_lite

    d = tmp_path / "plain"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    session = ChatSession(clover_lite.load(d, device="cpu"), system="Be kind.")
    assert not session.templated
    session.messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ids, cfg = session.request("how are you?")
    text = session.engine.tokenizer.decode(ids)
    assert text == "System: Be kind.\n\nUser: hi\n\nAssistant: hello\n\nUser: how are you?\n\nAssistant:"
    assert "\nUser:" in cfg.stop


def test_ctrl_d_during_a_reply_stops_it_and_leaves(tiny_dir, tmp_path):
    t = Terminal.spawn(clover_argv("chat", "--model", str(tiny_dir)), env=_env(tmp_path), rows=40, cols=100)
    try:
        t.expect(r">>> ", 60)
        t.type("/set max 6000\r")
        t.expect("max_new_tokens = 6000", 30)
        t.expect(r">>> ", 30)
        mark = len(t.output)
        t.type("tell me a long story\r")
        t.expect(PLACEHOLDER, 30, since=mark)
        t.drain(0.3)
        t.type(b"\x04")  # Ctrl-D while the reply streams: it stops at the next step and the chat ends
        assert t.wait(30) == 0
    finally:
        t.close()
    screen = t.screen.text()
    assert "Traceback" not in screen and "interrupted" in screen
    assert "6000 tokens" not in screen  # stopped early, not at the end of the reply


def _help_settings(session) -> list[str]:
    """The /set keys a session's /help lists ("change a setting: a, b (what), ...; /set alone lists them")."""
    text = " ".join(session.command("/help").text.split())  # the help wraps lines: one space between words
    listed = text.split("change a setting:", 1)[1].split("; /set alone", 1)[0]
    return [item.split()[0] for item in listed.split(",")]


def test_help_lists_exactly_the_settings_each_chat_takes(tiny_engine, tmp_path):
    """Block chat and DiffusionGemma chat each list their own /set keys, and every listed key takes a value."""
    from clover_lite.checkpoint.tiny_diffusion_gemma import write_tiny_diffusion_gemma
    from clover_lite.cli.chat_canvas import CanvasChatSession
    from clover_lite.runtime.diffusion_gemma_engine import DiffusionGemmaEngine

    dg = DiffusionGemmaEngine.load(write_tiny_diffusion_gemma(tmp_path / "dg", seed=2))
    cases = [
        (ChatSession(tiny_engine), {"threshold": "0.5", "block": "4", "temperature": "0.5", "max": "8",
                                    "top_p": "0.9", "top_k": "5", "seed": "3", "policy": "fixed", "steps": "2",
                                    "confidence": "margin", "commit": "reuse"}),
        (CanvasChatSession(dg), {"max": "8", "steps": "6", "entropy_bound": "0.2", "t_min": "0.3", "t_max": "0.9",
                                 "stability": "2", "confidence": "0.01", "seed": "3"}),
    ]
    for session, values in cases:
        assert sorted(_help_settings(session)) == sorted(values)
        assert max(map(len, session.command("/help").text.splitlines())) <= 79  # an 80-column terminal: no wraps
        for key, value in values.items():
            result = session.command(f"/set {key} {value}")
            assert not result.error, (key, result.text)
    assert CanvasChatSession(dg).command("/set threshold 0.5").error  # not DiffusionGemma's
