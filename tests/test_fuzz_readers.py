"""Bounded fuzz runs of every reader of a model directory (config.json, tokenizer.json, tokenizer_config.json
and its chat template, quantize_config.json): each mutation reads, or is refused with clover-lite's own
error. A fresh seed each run (CLOVER_TEST_SEED repeats one); benchmarks/fuzz_readers.py runs them longer."""


import pytest

from tests.fuzz_targets import TARGETS
from tests.seed import SEED

CASES = {"config": 150, "tokenizer": 150, "tokenizer_config": 150, "chat_template": 150, "safetensors_header": 150,
         "quantize_config": 60}


# jinja2 decodes a fuzzed string literal's stray backslash with Python's unicode-escape, which warns.
@pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning")
@pytest.mark.parametrize("name", list(TARGETS))
def test_reader_fuzz(name, tmp_path):
    counts = TARGETS[name].run(tmp_path, SEED, CASES[name])
    assert sum(counts.values()) == CASES[name]
    assert counts["refused"] > 0, f"seed {SEED}: no mutation of {name} was refused"
