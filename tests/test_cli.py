"""The `clover` command as an installed console script, run the way a user runs it."""

import json
import os
import random
import re
import shutil
import subprocess
import sys

import pytest
import torch

import clover_lite
from clover_lite.cli.main import layer_pattern
from clover_lite.runtime.text_stream import TextStreamer


def clover(*args, input=None):
    exe = shutil.which("clover")
    cmd = [exe] if exe else [sys.executable, "-m", "clover_lite.cli.main"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, input=input, timeout=300)


def test_tiny_info_run(tmp_path):
    out = tmp_path / "model"
    r = clover("tiny", str(out), "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert json.loads((out / "config.json").read_text())["model_type"] == "clover_moe"

    r = clover("tiny", str(out))
    assert r.returncode == 1 and "already exists" in r.stderr and "--force" in r.stderr

    r = clover("info", str(out))
    assert r.returncode == 0, r.stderr
    for word in ("clover_moe", "active per token", "3 x GDN + 1 x attention", "8 experts, top-2", "block size 4"):
        assert word in r.stdout, word

    r = clover("run", "--model", str(out), "Hello", "-n", "12", "--threshold", "0.01")
    assert r.returncode == 0, r.stderr
    assert "tokens/forward" in r.stderr and "finish:" in r.stderr

    r = clover("run", "--model", str(out), "-", "--raw", "-n", "5", "--temperature", "0.8", "--seed", "1",
               "--no-stats", input="from stdin")
    assert r.returncode == 0 and r.stderr == ""


def test_run_and_chat_take_the_model_before_the_prompt(tmp_path):
    """After `clover quantize SRC OUT` a user types `clover run OUT "prompt"`: MODEL may come first (or with
    --model, not both), and an unquoted prompt or a missing one gets a usage error with the command to type."""
    import click

    from clover_lite.cli.main import run_arguments

    model = tmp_path / "model"
    r = clover("tiny", str(model), "--seed", "3")
    assert r.returncode == 0, r.stderr
    r = clover("run", str(model), "Hello", "-n", "3", "--raw")
    assert r.returncode == 0 and "finish:" in r.stderr, r.stderr
    r = clover("chat", str(model), "-n", "3", input="hi\n")
    assert r.returncode == 0 and "tokens/forward" in r.stderr, r.stderr
    m = str(model)
    assert run_arguments(("Hello",), None) == (None, "Hello")
    assert run_arguments(("Hello",), m) == (m, "Hello")
    assert run_arguments((m, "Hello"), None) == (m, "Hello")
    for words, option, expected in [
        ((m,), None, f"'{m}' is a model directory: give a prompt after it"),
        ((m, "Hello", "there"), None, f'clover run {m} "Hello there"'),
        (("Hello", "there"), None, "'Hello' is not a model directory"),
        (("Hello", "there", "you"), None, 'clover run "Hello there you"'),
        ((m, "Hello"), str(tmp_path), "the model is given twice"),
    ]:
        with pytest.raises(click.UsageError, match=re.escape(expected)):
            run_arguments(words, option)
    r = clover("run", "Hello", "there")
    assert r.returncode == 2 and 'clover run "Hello there"' in r.stderr and "Traceback" not in r.stderr


def test_run_errors_are_one_line(tmp_path):
    r = clover("run", "--model", str(tmp_path / "missing"), "hi")
    assert r.returncode == 1 and r.stderr.startswith("error:") and "Traceback" not in r.stderr
    (tmp_path / "config.json").write_text('{"model_type": "gpt9"}')
    r = clover("info", str(tmp_path))
    assert r.returncode == 1 and "unknown model_type 'gpt9'" in r.stderr and "diffusion_gemma" in r.stderr
    r = clover("run", "--context", "6", "--raw", "a prompt longer than the context")  # the bundled model
    assert r.returncode == 1 and r.stderr.startswith("error:") and "fills the 6-token context by itself" in r.stderr
    # A prompt that fits gets a reply shortened to the room left, said on stderr, instead of a refusal.
    r = clover("run", "--context", "40", "--raw", "-n", "256", "sort: 5 3 9 1")
    assert r.returncode == 0, r.stderr
    m = re.search(r"the prompt is (\d+) tokens; the reply is limited to (\d+) tokens \(asked 256\) to fit the "
                  r"40-token context", r.stderr)
    assert m and int(m[1]) + int(m[2]) == 40, r.stderr
    assert int(re.search(r"\[(\d+) tokens", r.stderr)[1]) <= int(m[2])
    r = clover("run", "--context", "0", "hi")
    assert r.returncode == 2 and "--context" in r.stderr
    r = clover("run", "--context", "100000000", "hi")  # refused, not planned for (nor capped quietly)
    assert r.returncode == 1 and "context must be 1 to 2048 positions" in r.stderr and "GiB" not in r.stderr
    r = clover("run", "--raw", "--system", "be brief", "hi")
    assert r.returncode == 2 and "--system" in r.stderr and "--raw" in r.stderr
    r = clover("run", "--block-size", "64", "-n", "4", "hi")  # a library warning is a note line
    assert r.returncode == 0 and "note: block_size 64 is over 4x" in r.stderr and "Warning" not in r.stderr


def test_a_prompt_from_stdin_is_the_line_without_its_newline():
    """`echo PROMPT | clover run -` answers PROMPT, as `clover run PROMPT` does (greedy: the same reply)."""
    direct = clover("run", "--raw", "-n", "8", "sort: 5 3 9 1")
    piped = clover("run", "--raw", "-n", "8", "-", input="sort: 5 3 9 1\n")
    assert direct.returncode == piped.returncode == 0, piped.stderr
    assert piped.stdout == direct.stdout
    assert re.search(r"prefill (\d+) tokens", piped.stderr)[1] == re.search(r"prefill (\d+) tokens", direct.stderr)[1]


def test_no_model_and_no_bundled_model_explains_what_to_do(tmp_path, monkeypatch):
    """An install whose package data went missing: load() without a path says what to pass instead."""
    import clover_lite
    from clover_lite.errors import CloverError
    from clover_lite.runtime import engine

    monkeypatch.setattr(engine, "BUNDLED_MODEL", tmp_path / "clover-tiny")
    with pytest.raises(CloverError, match="no bundled default model.*clover tiny"):
        clover_lite.load()


def test_text_streamer_holds_back_partial_characters_and_stop_prefixes():
    s = TextStreamer()
    assert s.feed("ab\ufffd") == "ab"
    assert s.feed("abé") == "é"
    assert s.finish("abé!") == "!"
    s = TextStreamer(stop=("STOP",))
    assert s.feed("hello ST") == "hello"
    assert s.feed("hello STOP and more") == " STOP and m"  # only what cannot start a stop string
    assert TextStreamer(("STOP",)).finish("hello ") == "hello "
    s = TextStreamer(stop=("import os",))
    assert s.feed("impo") == ""  # shorter than what is held back: nothing is safe to show yet
    assert s.finish("") == ""


def test_text_streamer_chunks_are_the_reply_cut_at_its_stop_string():
    """Texts growing by random pieces, cut at the first stop string as the decoding loop cuts them: what the
    streamer shows is always a prefix of the final reply, and with its finish it is the whole reply."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    for _ in range(300):
        full = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 30)))
        stop = tuple("".join(rng.choice("ab\n") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(0, 2)))
        s, shown, text = TextStreamer(stop), "", ""
        for end in sorted(rng.sample(range(len(full) + 1), rng.randint(1, len(full) + 1))):
            text = full[:end]
            hits = [i for t in stop if (i := text.find(t)) >= 0]
            text = text[: min(hits)] if hits else text
            shown += s.feed(text)
            if hits:
                break
        final = text
        if not hits:
            final = full
            for t in stop:
                final = final[: i] if (i := final.find(t)) >= 0 else final
        assert final.startswith(shown), (seed, full, stop)
        assert shown + s.finish(final) == final, (seed, full, stop)


def test_layer_pattern():
    assert layer_pattern(("linear_attention",) * 3 + ("full_attention",)) == "3 x GDN + 1 x attention  [GGGA]"
    p = layer_pattern((("linear_attention",) * 3 + ("full_attention",)) * 10)
    assert p.startswith("(3 x GDN + 1 x attention) x 10")


def test_quantize_eval_run(tmp_path):
    src, out = tmp_path / "src", tmp_path / "int4"
    assert clover("tiny", str(src)).returncode == 0
    r = clover("quantize", str(src), str(out), "--group-size", "32", "--nsamples", "4", "--seqlen", "32")
    assert r.returncode == 0, r.stderr
    assert "layer 4/4 attention" in r.stderr  # per-layer progress when not on a terminal
    for word in ("size", "rel. output error: experts", "experts on RTN fallback"):
        assert word in r.stdout, word
    r = clover("quantize", str(src), str(out), "--group-size", "32")
    assert r.returncode == 1 and "--force" in r.stderr
    r = clover("eval", str(out), "--against", str(src), "--nsamples", "8", "--seqlen", "32")
    assert r.returncode == 0, r.stderr
    assert "KL(ref" in r.stdout and "positions" in r.stdout
    r = clover("run", "--model", str(out), "hello", "-n", "4")
    assert r.returncode == 0, r.stderr
    r = clover("quantize", str(src), str(tmp_path / "bad"), "--group-size", "48")
    assert r.returncode == 1 and "group size 48" in r.stderr


def test_info_defaults_to_the_bundled_model_and_labels_its_format():
    from click.testing import CliRunner

    from clover_lite.cli.main import main

    outs = []
    for args in (["info", "--json"], ["info", "clover-tiny", "--json"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        outs.append(json.loads(r.output))
    assert outs[0] == outs[1] and outs[0]["model"] == "clover-tiny"
    assert outs[0]["quant"] == "fp16"  # its weights are stored fp16 (config.json says so), not bf16


@pytest.mark.parametrize("family,block", [("sdar_moe", 4), ("llada2", 32)])
def test_tiny_family_writes_that_family_and_it_runs(tmp_path, family, block):
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from clover_lite.checkpoint.tiny_families import write_family_checkpoint
    from clover_lite.cli.main import main as cli

    out = tmp_path / "m"
    r = CliRunner().invoke(cli, ["tiny", str(out), "--family", family, "--seed", "5"])
    assert r.exit_code == 0, r.output
    ref = write_family_checkpoint(tmp_path / "ref", family, seed=5)
    got, want = load_file(out / "model.safetensors"), load_file(ref / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    engine = clover_lite.load(out)
    assert engine.config.block_size == block
    assert engine.generate([1, 2, 3], max_new_tokens=5, ignore_eos=True).stats.new_tokens == 5
    r = CliRunner().invoke(cli, ["tiny", str(tmp_path / "b"), "--family", family, "--block-size", "8"])
    assert r.exit_code == 0 and clover_lite.load(tmp_path / "b").config.block_size == 8


def test_decide_reads_the_context_line_from_stdin_and_shows_options_verbatim():
    """`--context -` is the line without its newline (the same decision as the text given inline); names and
    options are shown as typed, never read as the table's markup."""
    from click.testing import CliRunner

    from clover_lite.cli.main import main

    args = ["decide", "-q", "w=[red]on,[/b]off", "--device", "cpu"]
    inline = CliRunner().invoke(main, [*args, "--context", "cabin hot", "--json"])
    piped = CliRunner().invoke(main, [*args, "--context", "-", "--json"], input="cabin hot\n")
    assert inline.exit_code == piped.exit_code == 0, piped.output
    assert json.loads(piped.output) | {"seconds": 0} == json.loads(inline.output) | {"seconds": 0}
    table = CliRunner().invoke(main, [*args, "--context", "cabin hot"])
    assert table.exit_code == 0, table.output
    assert "[red]on" in table.output and "[/b]off" in table.output


def test_info_plans_within_the_model_and_refuses_impossible_settings():
    """The bundled model takes 2048 positions: the default plan is at 2048, not 8192, and no card is said to fit
    more. Group sizes that cannot pack its layers and block sizes below 1 are refused, one line each."""
    from click.testing import CliRunner

    from clover_lite.cli.main import main

    r = CliRunner().invoke(main, ["info", "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)
    assert plan["context_len"] == 2048 and all(c["max_context"] <= 2048 for c in plan["cards"].values())
    r = CliRunner().invoke(main, ["info", "tiny", "--quant", "int4-g7"])
    assert r.exit_code == 1 and "group size 7 does not divide every layer" in r.output and "int4-g32" in r.output
    r = CliRunner().invoke(main, ["info", "tiny", "--quant", "int4-g0"])
    assert r.exit_code == 1 and "group size must be positive" in r.output
    for value in ("0", "-4"):
        r = CliRunner().invoke(main, ["info", "tiny", "--block-size", value])
        assert r.exit_code == 2 and "--block-size" in r.output


def test_a_text_that_no_longer_extends_what_was_shown_shows_nothing_more():
    s = TextStreamer()
    assert s.feed("abc") == "abc"
    assert s.feed("xbcd") == ""  # not an extension of "abc": nothing appended to the garbled prefix
    assert s.finish("xbcd") == "\nxbcd"


def test_import_is_light_and_the_public_names_load_when_used():
    """`import clover_lite` imports no torch (the `clover` command's first instant stays interruptible); each
    public name, looked up, is the object its module defines."""
    code = ("import sys, clover_lite\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "from clover_lite.runtime import engine, generation\n"
            "assert clover_lite.load is engine.load and clover_lite.GenerationConfig is generation.GenerationConfig\n"
            "assert set(clover_lite.__all__) <= set(dir(clover_lite))\n"
            "try:\n    clover_lite.nonexistent\nexcept AttributeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "has no attribute 'nonexistent'" in out.stdout


def test_ctrl_c_while_the_command_imports_is_aborted_not_a_traceback():
    """SIGINT right after the entry point starts (torch still importing: seconds here) ends as click's own
    interrupt does, "Aborted!" and exit 1; before, a KeyboardInterrupt traceback from inside torch."""
    import signal
    import time

    code = ("import sys\nsys.argv = ['clover', 'info', '--help']\n"
            "from clover_lite.cli.launch import main\nprint('ready', flush=True)\nmain()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\n"
    time.sleep(0.3)  # into main()'s import (not between the print and main); torch takes seconds here
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert "Traceback" not in err, err
    assert (p.returncode, err.strip()) == (1, "Aborted!") or (p.returncode == 0 and "Usage" in out), (out, err)


def test_python_dash_m_is_the_clover_command():
    """`python -m clover_lite` runs the same command group as the console script (its version, its commands)."""
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", "clover_lite", "--version"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith(f"version {version('clover-lite')}"), out
    out = subprocess.run([sys.executable, "-m", "clover_lite", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and all(f" {c} " in out.stdout for c in ("run", "chat", "quantize", "serve")), out
