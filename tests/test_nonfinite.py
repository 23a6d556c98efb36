"""NaN/Inf weights (issue 37): refused at load with the tensor named; with the scan off, a generation whose
logits go non-finite stops with NonFiniteError naming the module where the NaN/Inf arise, never an empty
"successful" reply."""

import json
import random
import re
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import clover_lite
from clover_lite.checkpoint.load import Checkpoint, build_model, plan_checkpoint
from clover_lite.cli.main import main
from clover_lite.errors import CheckpointError, CloverError, NonFiniteError
from clover_lite.models import load_config
from clover_lite.runtime.generation import GenerationConfig, RecomputeRunner, denoise, run_to_end

PROMPT = [10, 20, 30, 40, 50, 60]  # a whole block to prefill, then a block holding the prompt's tail


def corrupt(src, dst, edits):
    """A copy of checkpoint `src` at `dst` with edits[name](tensor) applied in place to those tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name, edit in edits.items():
        edit(tensors[name])
    save_file(tensors, dst / "model.safetensors")
    return dst


def nan_at(index):
    def edit(t):
        t[index] = float("nan")
    return edit


def inf_row(row):
    def edit(t):
        t[row] = float("inf")
    return edit


@pytest.fixture(scope="module")
def destinations(tiny_dir):
    """Checkpoint tensor name -> the model parameters it fills."""
    path = tiny_dir
    ckpt = Checkpoint(path)
    model = build_model(load_config(path), "cpu", torch.float32, ckpt, materialize=False)
    plans, _, _ = plan_checkpoint(model, ckpt)
    return {name: [a.dest for a in plan] for name, plan in plans.items()}


def generate_watching(engine, **kw):
    """generate(PROMPT) with the engine's chooser wrapped: (the result or the NonFiniteError, whether every
    step's logits were finite)."""
    seen = []
    choose = engine._choose

    def watching(logits, *a, **k):
        seen.append(bool(torch.isfinite(logits).all()))
        return choose(logits, *a, **k)

    engine._choose = watching
    try:
        return engine.generate(PROMPT, max_new_tokens=10, ignore_eos=True, **kw), all(seen)
    except NonFiniteError as e:
        return e, all(seen)
    finally:
        engine._choose = choose


@pytest.mark.parametrize("seed", range(8))
def test_random_tensor_poisoned(tiny_dir, tmp_path, destinations, seed):
    """Property over randomly chosen tensors: one NaN (or an Inf row) is refused at load naming the tensor;
    with the scan off, an error is raised exactly when some step's logits are non-finite, and it names a
    module holding that tensor."""
    rng = random.Random(seed)
    tensors = load_file(tiny_dir / "model.safetensors")
    names = sorted(n for n, t in tensors.items() if t.is_floating_point())
    experts = [n for n in names if ".mlp.experts." in n]  # 3/4 of the tensors: drawn a quarter of the time
    name = rng.choice(experts if rng.random() < 0.25 else [n for n in names if n not in experts])
    shape = tensors[name].shape
    if len(shape) >= 2 and rng.random() < 0.5:
        edit = inf_row(rng.randrange(shape[0]))
    else:
        edit = nan_at(tuple(rng.randrange(d) for d in shape))
    d = corrupt(tiny_dir, tmp_path / "m", {name: edit})

    with pytest.raises(CheckpointError, match=re.escape(f"tensor '{name}' in ")) as err:
        clover_lite.load(d, device="cpu")
    assert "model.safetensors" in str(err.value) and "re-download" in str(err.value)
    assert re.search(r"holds \d+ NaN and \d+ Inf value", str(err.value))

    engine = clover_lite.load(d, device="cpu", check_finite=False)
    assert any("NaN/Inf scan" in n and "skipped" in n for n in engine.load_report.notes)
    out, all_finite = generate_watching(engine)
    if isinstance(out, NonFiniteError):
        assert not all_finite
        assert out.module is not None, str(out)
        assert any(dest.startswith(out.module + ".") for dest in destinations[name]), (name, out.module)
        assert f"'{out.module}'" in str(out)
    else:  # a weight no step used (an expert never routed, an embedding row never looked up)
        assert all_finite and len(out.token_ids) == 10


@pytest.mark.parametrize(("name", "edit", "module"), [
    ("model.layers.0.linear_attn.in_proj_qkv.weight", nan_at((3, 5)), "layers.0.linear_attn.in_proj_qkv"),
    ("model.layers.0.linear_attn.out_proj.weight", inf_row(7), "layers.0.linear_attn.out_proj"),
    ("model.layers.0.linear_attn.A_log", nan_at(1), "layers.0.linear_attn"),
    ("model.layers.3.self_attn.q_proj.weight", nan_at((0, 0)), "layers.3.self_attn.q_proj"),
    ("model.norm.weight", nan_at(2), "norm"),
    ("lm_head.weight", inf_row(100), "lm_head"),
])
def test_always_used_tensor_names_its_module(tiny_dir, tmp_path, name, edit, module):
    d = corrupt(tiny_dir, tmp_path / "m", {name: edit})
    with pytest.raises(CheckpointError, match=re.escape(name)):
        clover_lite.load(d, device="cpu")
    out, all_finite = generate_watching(clover_lite.load(d, device="cpu", check_finite=False))
    assert isinstance(out, NonFiniteError) and not all_finite
    assert out.module == module and f"'{module}'" in str(out)


def test_expert_down_proj_nan_and_inf_row(tiny_dir, tmp_path):
    """The issue's case: a NaN element and an Inf row in the experts' down_proj (every expert of layer 1, so
    the routing cannot miss them) ran to 'success' with a reply of token 0."""
    edits = {}
    for e in range(8):
        edits[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] = lambda t: (nan_at((1, 2))(t), inf_row(5)(t))
    d = corrupt(tiny_dir, tmp_path / "m", edits)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.\d\.down_proj\.weight.*1 NaN and"):
        clover_lite.load(d, device="cpu")
    engine = clover_lite.load(d, device="cpu", check_finite=False)
    with pytest.raises(NonFiniteError, match=r"'layers\.1\.mlp\.experts'") as err:
        engine.generate("hi", max_new_tokens=256)
    assert isinstance(err.value, CloverError) and err.value.module == "layers.1.mlp.experts"


def test_nan_from_the_prefill_is_named_where_it_arose(tiny_dir, tmp_path):
    """An embedding row looked up only by the prefill's tokens: its NaN reaches the step through the cache,
    and the diagnosis (a replay from an empty cache) names the embedding, not the first layer reading the
    cache. The same through the RecomputeRunner."""
    d = corrupt(tiny_dir, tmp_path / "m", {"model.embed_tokens.weight": nan_at((PROMPT[0], 3))})
    engine = clover_lite.load(d, device="cpu", check_finite=False)
    out, all_finite = generate_watching(engine)
    assert isinstance(out, NonFiniteError) and not all_finite and out.module == "embed_tokens"
    cfg = GenerationConfig(max_new_tokens=6).resolved(4)
    with pytest.raises(NonFiniteError) as err:
        run_to_end(denoise(RecomputeRunner(engine.model, 4), PROMPT, cfg, engine.mask_token_id))
    assert err.value.module == "embed_tokens"


def test_finite_model_unchanged_and_no_note(tiny_dir):
    engine = clover_lite.load(tiny_dir, device="cpu")
    assert not any("NaN/Inf" in n for n in engine.load_report.notes)
    out, all_finite = generate_watching(engine)
    assert all_finite and len(out.token_ids) == 10


def test_cast_overflow_and_gptq_scales(tiny_dir, tmp_path):
    """Finite fp32 values beyond float16's range are named as an overflow of the cast; fp16 GPTQ scales are
    scanned (the integer tensors are not)."""
    d = corrupt(tiny_dir, tmp_path / "big", {"model.layers.2.linear_attn.out_proj.weight": nan_at((0, 0))})
    t = load_file(d / "model.safetensors")
    t["model.layers.2.linear_attn.out_proj.weight"][0, 0] = 1e6
    save_file(t, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"out_proj\.weight.*up to 1e\+06, beyond the range of torch\.float16.*"
                                              r"wider dtype \(bfloat16 or float32\).*--no-check-finite skips"):
        clover_lite.load(d, device="cpu", dtype="float16")
    clover_lite.load(d, device="cpu", dtype="float32")  # fits float32

    q = tmp_path / "gptq"
    shutil.copytree(tiny_dir, q)
    (q / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 32}))
    t = load_file(q / "model.safetensors")
    w = t.pop("model.layers.3.self_attn.o_proj.weight")
    t["model.layers.3.self_attn.o_proj.qweight"] = torch.zeros(w.shape[1] // 8, w.shape[0], dtype=torch.int32)
    t["model.layers.3.self_attn.o_proj.qzeros"] = torch.zeros(w.shape[1] // 32, w.shape[0] // 8, dtype=torch.int32)
    scales = torch.ones(w.shape[1] // 32, w.shape[0], dtype=torch.float16)
    t["model.layers.3.self_attn.o_proj.scales"] = scales
    save_file(t, q / "model.safetensors")
    clover_lite.load(q, device="cpu")  # finite scales, integer tensors not scanned
    scales[1, 2] = float("nan")
    save_file(t, q / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"o_proj\.scales.*1 NaN"):
        clover_lite.load(q, device="cpu")


def test_cli_run(tiny_dir, tmp_path):
    d = corrupt(tiny_dir, tmp_path / "m", {"model.layers.0.linear_attn.in_proj_qkv.weight": nan_at((3, 5))})
    runner = CliRunner()
    r = runner.invoke(main, ["run", str(d), "hi", "--no-check-finite", "-n", "8"])
    assert r.exit_code != 0, r.output
    assert "error:" in r.output and "NaN/Inf" in r.output and "'layers.0.linear_attn.in_proj_qkv'" in r.output
    assert "scan of the weights was skipped" in r.output  # the load note
    r = runner.invoke(main, ["run", str(d), "hi", "-n", "8"])
    assert r.exit_code == 1, r.output
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in r.output and "--no-check-finite" in r.output
    # The option is the shared load options' (chat too) and reaches load, not the generation settings.
    r = runner.invoke(main, ["run", str(tiny_dir), "hi", "--raw", "-n", "4", "--no-check-finite", "--no-stats"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, ["chat", str(tiny_dir), "--no-check-finite", "--plain", "-n", "3"], input="hi\n")
    assert r.exit_code == 0, r.output
