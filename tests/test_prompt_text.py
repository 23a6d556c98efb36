"""Text a tokenizer cannot read (a lone UTF-16 surrogate: how Python shows argv, stdin or file bytes that are
not UTF-8) is one error naming where it is, through the API, `clover run` (argument and stdin) and `clover
chat`, never a traceback from the tokenizers library. The bytes are drawn per run (tests/seed.py)."""

import os
import random
import subprocess
import sys

import pytest

import clover_lite
from clover_lite.errors import TokenizerError

from .seed import SEED

RUN = [sys.executable, "-c", "from clover_lite.cli.launch import main; main()"]


def bad_bytes(rng: random.Random) -> bytes:
    """ASCII text with one byte that cannot start or continue UTF-8 here, at a random place."""
    text = "".join(rng.choice("sort: 0123456789 ") for _ in range(rng.randint(3, 20)))
    at = rng.randint(0, len(text))
    return text[:at].encode() + bytes([rng.choice([0xFF, 0xFE, 0xC0, 0x80])]) + text[at:].encode()


@pytest.fixture(scope="module")
def engine():
    return clover_lite.load()


def test_the_api_names_the_prompt_or_message(engine):
    rng = random.Random(SEED)
    for _ in range(5):
        raw = bad_bytes(rng)
        text = raw.decode("utf-8", "surrogateescape")
        at = next(i for i, ch in enumerate(text) if "\udc80" <= ch <= "\udcff")
        with pytest.raises(TokenizerError, match=f"the prompt holds U\\+{ord(text[at]):04X} at character {at},"):
            engine.generate(text, raw=True, max_new_tokens=2)
        with pytest.raises(TokenizerError, match=f"message 1 holds U\\+{ord(text[at]):04X} at character {at},"):
            engine.generate([{"role": "system", "content": "ok"}, {"role": "user", "content": text}])
        with pytest.raises(TokenizerError, match="the text holds"):
            engine.tokenizer.encode(text)


def test_clover_run_and_chat_say_it_in_one_line():
    rng = random.Random(SEED + 1)
    raw = bad_bytes(rng)
    env = {**os.environ, "PYTHONUTF8": "1"}  # argv and stdin decoded as UTF-8 with surrogateescape
    for args, stdin in (([os.fsdecode(raw)], b""), (["-"], raw + b"\n")):
        out = subprocess.run([*RUN, "run", *args, "-n", "2"], input=stdin, capture_output=True, env=env, timeout=120)
        err = out.stderr.decode()
        assert out.returncode == 1 and "Traceback" not in err, err
        assert [line for line in err.splitlines() if line.startswith("error:")] and "which is not text" in err, err
    out = subprocess.run([*RUN, "chat"], input=raw + b"\n/quit\n", capture_output=True, env=env, timeout=120)
    assert "Traceback" not in out.stderr.decode() and "which is not text" in out.stdout.decode() + out.stderr.decode()
