"""`clover bench`, run as a user runs it (the installed console script), on random weights."""

import json
import os
import shutil
import subprocess
import sys

from click.testing import CliRunner


def clover(*args, cwd=None):
    exe = shutil.which("clover")
    cmd = [exe] if exe else [sys.executable, "-m", "clover_lite.cli.main"]
    env = dict(os.environ, COLUMNS="160", OMP_NUM_THREADS="1")
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


FAST = ("--prompt-tokens", "32", "--new-tokens", "12", "--steps", "3")


def test_bench_tiny_random_weights(tmp_path):
    out = tmp_path / "results.json"
    r = clover("bench", "--config", "tiny", "--random-weights", *FAST, "--plot", str(tmp_path / "p.png"),
               "--json", out.name, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for word in ("clover bench: tiny", "tok/s", "tokens/forward", "step latency", "commit latency", "prefill",
                 "peak memory", "random weights"):
        assert word in r.stdout, word
    assert f"wrote {out.name}" in r.stderr
    data = json.loads(out.read_text())
    assert data["random_weights"] and data["quant"] == "fp32" and data["block_size"] == 4
    assert data["generation"]["new_tokens"] == 12 and data["generation"]["tokens_per_second"] > 0
    assert data["step"]["n"] == 3 and data["step"]["median_ms"] > 0 and data["prefill"]["tokens"] == 32
    assert data["peak_memory_bytes"] > data["plan"]["weight_bytes"] > 0
    assert [p["tokens_per_forward"] for p in data["projection"]] == [1, 2, 4]
    try:
        import matplotlib  # noqa: F401

        assert (tmp_path / "p.png").exists()
    except ImportError:
        assert "needs matplotlib, which is not a dependency" in r.stderr


def test_bench_tiny_int4(tmp_path):
    r = clover("bench", "--config", "tiny", "--random-weights", "--quant", "int4", *FAST, "--json",
               str(tmp_path / "b.json"))
    assert r.returncode == 0, r.stderr
    # 128 does not divide the tiny config's 64- and 32-wide layers: the group `clover quantize` would pick.
    assert "INT4 GPTQ g32" in r.stdout and "step latency" in r.stdout
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["plan"]["weights"]["routed experts"].keys() == {"qweight", "qzeros", "scales", "g_idx"}


def test_bench_argument_errors_and_refusal(monkeypatch):
    from clover_lite.cli.main import main
    from clover_lite.planning import devices

    runner = CliRunner()
    r = runner.invoke(main, ["bench", "--config", "tiny"])  # usage errors, as click's own
    assert r.exit_code == 2 and "--random-weights" in r.output
    r = runner.invoke(main, ["bench"])
    assert r.exit_code == 2 and "either a model directory (MODEL or --model PATH) or --config NAME" in r.output
    # A model that does not fit is refused with the plan before anything is allocated.
    monkeypatch.setattr(devices, "available_ram", lambda: 2 * 2**30)
    r = runner.invoke(main, ["bench", "--config", "clover-35b-a3b", "--random-weights", "--quant", "int4",
                             "--device", "cpu"])
    assert r.exit_code == 1 and "exceed the available RAM" in r.output and "on a GPU it fits" in r.output
    # One that fits, but only just: it runs, with a warning before anything is allocated.
    from clover_lite.planning.planner import plan

    need = plan("tiny", "fp32", 64, "cpu").total
    monkeypatch.setattr(devices, "available_ram", lambda: int(need * 1.1))
    r = runner.invoke(main, ["bench", "--config", "tiny", "--random-weights", "--device", "cpu", *FAST])
    assert r.exit_code == 0 and "warning: this needs about" in r.output and "of RAM available now" in r.output
    monkeypatch.setattr(devices, "available_ram", lambda: int(need * 0.8))
    r = runner.invoke(main, ["bench", "--config", "tiny", "--random-weights", "--device", "cpu", *FAST])
    assert r.exit_code == 1 and "cache and workspace" in r.output, r.output


def test_bench_on_a_checkpoint(tiny_dir, tmp_path):
    from clover_lite.cli.main import main

    r = CliRunner().invoke(main, ["bench", str(tiny_dir), *FAST, "--json", str(tmp_path / "c.json")])  # or --model
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "c.json").read_text())
    assert not data["random_weights"] and data["generation"]["new_tokens"] == 12


def test_bench_times_the_step_the_engine_decodes_with(tiny_dir):
    """`clover run` on a GPU decodes through the engine's CUDA-graph step over its fixed cache: the bench's
    timed steps and its generation go through that same step (here a spy standing in for graph.StaticStep,
    computing what it computes: every block position's logits against the engine's cache)."""
    import pytest
    import torch

    import clover_lite
    from clover_lite.cli.bench import bench_context, run_bench
    from clover_lite.errors import CloverError
    from clover_lite.runtime.graph import StaticStep

    eng = clover_lite.load(tiny_dir, device="cpu")
    eng._cache = eng.model.new_cache(capacity=bench_context(32, 12, 3, 4))
    lengths, commits = [], []

    class SpyStep:
        block_size, graph = 4, None

        def __call__(self, block_ids):
            lengths.append(eng._cache.length)
            ids = torch.as_tensor(block_ids).view(1, -1)
            return eng.model.step(ids, eng._cache, torch.arange(ids.shape[1]))[0]

        def commit(self, block_ids):  # graph.StaticStep.commit: a full block at a block boundary
            commits.append(eng._cache.length)
            eng.model.commit(torch.as_tensor(block_ids).view(1, -1), eng._cache, 4)

        serves = StaticStep.serves  # the real rule: which generations run on the static step

    eng._static = SpyStep()
    report = run_bench(eng, 4, prompt_tokens=32, new_tokens=12, steps=3)
    assert report["step_kind"] == "static, eager" and report["step"]["n"] == 3
    # Warm-up at 4 committed positions, the 3 timed steps after the 32-token prefill, then the generation's.
    assert lengths[:4] == [4, 32, 36, 40]
    assert len(lengths) - 4 == report["generation"]["forwards"]  # every denoising step of the generation
    assert eng._cache.capacity == bench_context(32, 12, 3, 4)  # never grown: a graph points at its buffers
    assert report["generation"]["new_tokens"] == 12
    # The generation's finished blocks are committed through the static step too (its commit graph on a GPU).
    assert commits and all(n % 4 == 0 and n >= 32 for n in commits)
    plain = run_bench(clover_lite.load(tiny_dir, device="cpu"), 4, prompt_tokens=32, new_tokens=12, steps=3)
    assert plain["step_kind"] == "eager"
    # A prompt shorter than a block is one block: counted, so a fixed cache is never grown under its graph.
    assert bench_context(1, 1, 1, 4) == 4 + 8
    with pytest.raises(CloverError, match="cache holds 48 positions and this benchmark needs 56"):
        run_bench(eng, 4, prompt_tokens=32, new_tokens=12, steps=5)


def test_bench_writes_only_what_is_asked_and_checks_it_first(tmp_path):
    r = clover("bench", "--config", "tiny", "--random-weights", *FAST, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written into the working directory unasked
    (tmp_path / "afile").write_text("mine")
    for target in (tmp_path / "afile" / "b.json", tmp_path / "missing" / "b.json", tmp_path):
        r = clover("bench", "--config", "tiny", "--random-weights", *FAST, "--json", str(target), cwd=tmp_path)
        assert r.returncode == 1 and "cannot write" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert "tok/s" not in r.stdout  # refused before the run, not after it
    assert (tmp_path / "afile").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_bench_labels_a_checkpoint_by_its_stored_dtype(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from clover_lite.checkpoint.tiny import write_tiny_checkpoint
    from clover_lite.cli.main import main

    labels = {}
    for dtype in ("float16", "bfloat16"):
        path = write_tiny_checkpoint(tmp_path / dtype, seed=1, dtype=dtype)
        tensors = {k: v.to(getattr(torch, dtype)) for k, v in load_file(path / "model.safetensors").items()}
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        r = CliRunner().invoke(main, ["bench", str(path), *FAST, "--json", str(tmp_path / f"{dtype}.json")])
        assert r.exit_code == 0, r.output
        labels[dtype] = json.loads((tmp_path / f"{dtype}.json").read_text())["quant"]
    assert labels == {"float16": "fp16", "bfloat16": "bf16"}
