"""`clover bench` on a DiffusionGemma checkpoint: the report's counts against the run's definition (whole
canvases with EOS ignored, at most max_denoising_steps decoder forwards each, the timed steps and prompt as
asked), its projection against its own median latencies, and the options that do not apply refused. Sizes
are drawn per run (tests/seed.py); timings are reported, never asserted."""

import json
import math
import random

import pytest
from click.testing import CliRunner

from clover_lite.checkpoint.tiny_diffusion_gemma import write_tiny_diffusion_gemma
from clover_lite.cli.main import main as cli

from .seed import SEED


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_diffusion_gemma(tmp_path_factory.mktemp("dgbench") / "dg", seed=SEED % 1000,
                                      max_position_embeddings=256, max_denoising_steps=4)


def test_report_counts_follow_the_run(model_dir, tmp_path):
    rng = random.Random(SEED)
    P, n, steps = rng.randint(1, 40), rng.randint(1, 30), rng.randint(1, 4)
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(cli, ["bench", str(model_dir), "--prompt-tokens", str(P), "--new-tokens", str(n),
                                 "--steps", str(steps), "--seed", str(SEED), "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "steps per canvas" in r.output and "canvas commit" in r.output
    rep = json.loads(out.read_text())
    C, N, g = 8, 4, rep["generation"]
    assert rep["canvas_length"] == C and rep["max_denoising_steps"] == N and rep["quant"] == "fp32"
    assert rep["prefill"]["tokens"] == g["prompt_tokens"] == P
    assert rep["step"]["n"] == rep["commit"]["n"] == steps
    assert g["canvases"] == math.ceil(n / C) and g["new_tokens"] == g["canvases"] * C  # EOS ignored
    assert g["canvases"] <= g["forwards"] <= g["canvases"] * N
    assert g["steps_per_canvas"] == pytest.approx(g["forwards"] / g["canvases"])
    assert g["tokens_per_forward"] == pytest.approx(g["new_tokens"] / g["forwards"])
    step, commit = rep["step"]["median_ms"] / 1e3, rep["commit"]["median_ms"] / 1e3
    assert [x["steps_per_canvas"] for x in rep["projection"]] == [1, 2, 4]
    for x in rep["projection"]:
        assert x["tokens_per_second"] == pytest.approx(C / (x["steps_per_canvas"] * step + commit))
    assert rep["plan"]["total_bytes"] > 0 and rep["peak_memory_bytes"] > 0


@pytest.mark.parametrize("args,code,words", [
    (["--threshold", "0.5"], 2, "--threshold does not apply to DiffusionGemma"),
    (["--block-size", "4"], 2, "--block-size does not apply to DiffusionGemma"),
    (["--policy", "fixed"], 2, "--policy does not apply to DiffusionGemma"),
    (["--plot", "x.png"], 2, "--plot does not apply to DiffusionGemma"),
    (["--prompt-tokens", "200", "--new-tokens", "64"], 1, "over the model's context of 256"),
])
def test_options_that_do_not_apply_are_refused(model_dir, args, code, words):
    r = CliRunner().invoke(cli, ["bench", str(model_dir), *args])
    assert r.exit_code == code and words in r.output, r.output
