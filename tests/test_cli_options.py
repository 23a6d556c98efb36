"""Bad option values and combinations of `clover quantize`, `clover eval` and `clover bench` get one error line
naming the option (a click usage error, exit 2, or a runtime error, exit 1), never a traceback, and a
refused quantization leaves neither OUT nor its `.OUT.partial` behind."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import clover_lite
from clover_lite.checkpoint.tiny import write_tiny_checkpoint
from clover_lite.cli.main import main
from clover_lite.errors import CheckpointError

from .seed import SEED

FAST = ("--nsamples", "4", "--seqlen", "32")
BENCH_FAST = ("--prompt-tokens", "32", "--new-tokens", "12", "--steps", "3")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("opts") / "src", seed=3)  # vocab 260, context 8192


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.lower().startswith("error")]


def assert_refused(r, code: int, *words: str) -> None:
    assert r.exit_code == code, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception  # no traceback
    assert "Traceback" not in r.output
    lines = error_lines(r.output)
    assert len(lines) == 1, r.output
    for word in words:
        assert word in lines[0], (word, lines[0])


def assert_nothing_written(tmp_path, name="out"):
    assert not (tmp_path / name).exists() and not (tmp_path / f".{name}.partial").exists()


# ---- clover quantize ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,option", [
    (("--nsamples", "0"), "--nsamples"), (("--nsamples", "-3"), "--nsamples"), (("--seqlen", "0"), "--seqlen"),
    (("--group-size", "0"), "--group-size"), (("--group-size", "-2"), "--group-size"),
    (("--damp-percent", "-1"), "--damp-percent"), (("--damp-percent", "nan"), "--damp-percent"),
    (("--device", "foo"), "--device"), (("--calib", "/nonexistent/calib.txt"), "--calib"),
])
def test_quantize_refuses_bad_values(src, tmp_path, args, option):
    r = invoke("quantize", src, tmp_path / "out", *FAST, *args)
    assert_refused(r, 2, f"'{option}'")
    assert_nothing_written(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_quantize_refuses_cuda_without_a_gpu(src, tmp_path):
    r = invoke("quantize", src, tmp_path / "out", *FAST, "--device", "cuda")
    assert_refused(r, 2, "'--device'", "CUDA is not available")
    assert_nothing_written(tmp_path)


def test_quantize_refuses_a_window_past_the_context(src, tmp_path):
    r = invoke("quantize", src, tmp_path / "out", "--nsamples", "4", "--seqlen", "9000")
    assert_refused(r, 1, "--seqlen 9000", "max_position_embeddings 8192", "--seqlen 8192 or less")
    assert_nothing_written(tmp_path)


def test_quantize_console_script_gives_a_usage_line(src, tmp_path):
    """As a user runs it: the installed command, its stderr."""
    exe = shutil.which("clover")
    cmd = [exe] if exe else [sys.executable, "-m", "clover_lite.cli.main"]
    r = subprocess.run([*cmd, "quantize", str(src), str(tmp_path / "out"), "--group-size", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert error_lines(r.stderr) == ["Error: Invalid value for '--group-size': 0 is not a group size: use a positive "
                                     "one (128, 64, 32, ...) or -1 (per-channel)"]
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("args,named", [
    (("--group-size", "64"), "--group-size applies"), (("--asym", "--format", "gptq_v2"), "--asym, --format apply"),
    (("--nsamples", "4"), "--nsamples applies"),
])
def test_nf4_refuses_int4_options(src, tmp_path, args, named):
    r = invoke("quantize", src, tmp_path / "out", "--method", "nf4", *args)
    assert_refused(r, 2, named, "--method gptq/rtn, not nf4")
    assert_nothing_written(tmp_path)


def test_rtn_refuses_gptq_only_options(src, tmp_path):
    r = invoke("quantize", src, tmp_path / "out", "--method", "rtn", *FAST, "--damp-percent", "0.1")
    assert_refused(r, 2, "--damp-percent applies to --method gptq, not rtn")
    assert_nothing_written(tmp_path)


def test_nf4_reports_its_block_and_quantizes_lm_head(src, tmp_path):
    """NF4 has no INT4 group: the report shows the block quantize_config.json records, and lm_head
    (260 x 64, a multiple of NF4's block but not of INT4's packing) is quantized, loads and runs."""
    pytest.importorskip("bitsandbytes")
    from clover_lite.models.quantized import NF4Linear

    out = tmp_path / "nf4"
    r = invoke("quantize", src, out, "--method", "nf4", "--quantize-lm-head")
    assert r.exit_code == 0, r.output
    qc = json.loads((out / "quantize_config.json").read_text())
    assert qc["quant_method"] == "nf4" and qc["lm_head"] is True
    assert f"NF4 block size │ {qc['blocksize']} weights" in " ".join(r.output.split())
    assert "group size" not in r.output
    engine = clover_lite.load(out, device="cpu")
    assert isinstance(engine.model.lm_head, NF4Linear)
    assert engine.generate("hello", max_new_tokens=4).stats.new_tokens > 0


def test_gptq_lm_head_refusals(src, tmp_path):
    r = invoke("quantize", src, tmp_path / "out", *FAST, "--method", "rtn", "--quantize-lm-head")
    assert_refused(r, 1, "lm_head is 260 x 64", "INT4 GPTQ packing", "leave out --quantize-lm-head")
    assert_nothing_written(tmp_path)
    # A tied lm_head is the embeddings: refused up front, not a KeyError after the last layer.
    tied = write_tiny_checkpoint(tmp_path / "tied", seed=1, tie_word_embeddings=True)
    r = invoke("quantize", tied, tmp_path / "out", *FAST, "--method", "rtn", "--quantize-lm-head")
    assert_refused(r, 1, "--quantize-lm-head", "tie_word_embeddings")
    assert_nothing_written(tmp_path)


def test_quantize_refuses_nonfinite_weights_before_any_layer(tmp_path):
    bad = write_tiny_checkpoint(tmp_path / "nan", seed=2)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.mlp.experts.3.up_proj.weight"][0, 0] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    r = invoke("quantize", bad, tmp_path / "out", *FAST, "--method", "rtn", "--group-size", "32")
    assert_refused(r, 1, "tensor 'model.layers.1.mlp.experts.3.up_proj.weight'", "1 NaN", "index [0, 0]")
    assert "layer 1/" not in r.output and "gate_up_proj" not in r.output  # before any layer was quantized
    assert "--no-check-finite" not in r.output  # load's switch; quantize has none
    assert_nothing_written(tmp_path)
    with pytest.raises(CheckpointError) as load_error:  # the error `clover run` gives on the same folder
        clover_lite.load(bad, device="cpu")
    assert error_lines(r.output)[0].removeprefix("error: ") in str(load_error.value)


# ---- clover eval --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,option", [
    (("--nsamples", "0"), "--nsamples"), (("--nsamples", "-1"), "--nsamples"), (("--seqlen", "0"), "--seqlen"),
    (("--text", "/nonexistent/heldout.txt"), "--text"),
])
def test_eval_refuses_bad_values(src, args, option):
    assert_refused(invoke("eval", src, *args), 2, f"'{option}'")


def test_eval_refuses_a_window_past_the_context(src):
    r = invoke("eval", src, "--seqlen", "100000")
    assert_refused(r, 1, "--seqlen 100000", "max_position_embeddings 8192")


def test_eval_names_its_text_as_evaluation_text(tmp_path):
    from clover_lite.errors import CloverError
    from clover_lite.quant.calibration import read_calibration_file

    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(CloverError, match="evaluation text"):
        read_calibration_file(tmp_path / "empty.txt", what="evaluation text (--text)")
    with pytest.raises(CloverError, match="cannot read the calibration file"):
        read_calibration_file(tmp_path)  # a directory


def test_calibration_text_that_is_binary_is_refused_and_a_few_stray_bytes_are_not(tmp_path):
    """A model shard, random bytes or a NUL in JSONL given as text: one error naming the file, the first bad
    offset and what to give. A Latin-1 file (a few bytes that are not UTF-8) reads, each as U+FFFD."""
    from clover_lite.errors import CloverError
    from clover_lite.quant.calibration import read_calibration_file

    rng = torch.Generator().manual_seed(SEED)
    shard = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(64, 64, generator=rng)}, str(shard))
    noise = tmp_path / "noise.txt"
    noise_bytes = torch.randint(0xF8, 0x100, (4000,), generator=rng).tolist()  # bytes UTF-8 never uses
    noise.write_bytes(b"plain words first " + bytes(noise_bytes))
    nul = tmp_path / "docs.jsonl"
    nul.write_bytes(b'{"text": "one"}\n{"text": "t\x00wo"}\n')
    # The shard starts with its header's length, a little-endian u64 under 256: byte 1 is NUL.
    for path, offset in ((shard, 1), (noise, 18), (nul, 27)):
        with pytest.raises(CloverError, match=f"not text \\(binary bytes from offset {offset}\\).*\\.jsonl"):
            read_calibration_file(path)
    words = " ".join(f"caf\u00e9 number {i}" for i in range(40))  # one byte in 16 not UTF-8
    latin = tmp_path / "latin.txt"
    latin.write_bytes(words.encode("latin-1"))
    assert read_calibration_file(latin) == [words.replace("\u00e9", "\ufffd")]


def test_quantize_refuses_binary_calibration_before_writing(src, tmp_path):
    (tmp_path / "calib.txt").write_bytes(bytes(range(256)) * 8)
    r = invoke("quantize", src, tmp_path / "out", *FAST, "--calib", tmp_path / "calib.txt")
    assert_refused(r, 1, "calib.txt", "not text")
    assert_nothing_written(tmp_path)


def test_quantize_without_tokenizer_files_says_the_output_takes_token_ids(src, tmp_path):
    """NF4 needs no calibration text, so a source without tokenizer files quantizes; the run ends with a note
    saying what to copy, and the output generates from token ids. With the files there is no note."""
    bare = tmp_path / "bare"
    shutil.copytree(src, bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    r = invoke("quantize", bare, tmp_path / "out", "--method", "nf4")
    assert r.exit_code == 0, r.output
    notes = [line for line in r.output.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "no tokenizer files" in notes[0] and "copy tokenizer.json" in notes[0], r.output
    out = clover_lite.load(tmp_path / "out").generate([5, 6, 7], max_new_tokens=4)
    assert len(out.token_ids) == 4
    r = invoke("quantize", src, tmp_path / "with", "--method", "nf4")
    assert r.exit_code == 0 and "note:" not in r.output, r.output


# ---- clover bench -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,words", [
    (("--block-size", "-4"), ("'--block-size'",)), (("--block-size", "0"), ("'--block-size'",)),
    (("--quant", "int4", "--group-size", "0"), ("'--group-size'",)),
    (("--group-size", "32"), ("--group-size applies to", "--quant int4")),
])
def test_bench_refuses_bad_values(args, words):
    assert_refused(invoke("bench", "--config", "tiny", "--random-weights", *BENCH_FAST, *args), 2, *words)


def test_bench_refuses_a_group_size_that_does_not_divide_the_layers():
    r = invoke("bench", "--config", "tiny", "--random-weights", "--quant", "int4", "--group-size", "7", *BENCH_FAST)
    assert_refused(r, 1, "group size 7", "--group-size 32, 16 or -1")


def test_bench_refuses_random_weights_with_a_checkpoint(src):
    r = invoke("bench", src, "--random-weights", *BENCH_FAST)
    assert_refused(r, 2, "--random-weights applies to --config NAME")
    assert "tok/s" not in r.output


def test_bench_memory_advice_matches_its_options(monkeypatch):
    from clover_lite.cli import bench
    from clover_lite.planning.planner import plan

    monkeypatch.setattr(bench, "ram_warning", lambda p: "tight")  # the planner says "warn"; bench says how
    r = invoke("bench", "--config", "tiny", "--random-weights", "--quant", "int4", *BENCH_FAST)
    assert r.exit_code == 0, r.output
    warning = next(line for line in r.output.splitlines() if line.startswith("warning:"))
    assert "--prompt-tokens" in warning and "--context" not in warning and "int4" not in warning.lower()
    assert "--quant int4" in bench._smaller(plan("tiny", "fp32", 48, "cpu"), random_weights=True)
    assert "clover quantize" in bench._smaller(plan("tiny", "fp32", 48, "cpu"), random_weights=False)
    assert "int4" not in bench._smaller(plan("tiny", "int4", 48, "cpu"), random_weights=False).lower()


# ---- --seed, on every command that takes one -----------------------------------------------------------------
@pytest.mark.parametrize("command", ["quantize", "eval", "bench", "tiny", "run"])
@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_past_64_bits_is_a_usage_error(src, tmp_path, command, seed):
    """Every --seed takes what torch.Generator.manual_seed takes; beyond it one usage line names the option
    and its range, before any work (tiny and quantize write nothing)."""
    args = {"quantize": (src, tmp_path / "out"), "eval": (src,), "bench": (src,), "tiny": (tmp_path / "out",),
            "run": ("--model", src, "hi")}[command]
    assert_refused(invoke(command, *args, "--seed", seed), 2, "'--seed'", "-9223372036854775808<=x<=")
    assert_nothing_written(tmp_path)


def test_eval_says_which_model_directory_is_missing(src, tmp_path):
    from clover_lite.checkpoint.tiny_diffusion_gemma import write_tiny_diffusion_gemma

    dg = write_tiny_diffusion_gemma(tmp_path / "dg", seed=1)
    for args in ((dg, "--against", tmp_path / "none"), (tmp_path / "none", "--against", dg),
                 (src, "--against", tmp_path / "none")):
        assert_refused(invoke("eval", *args), 1, f"{tmp_path / 'none'}: no such model directory")
