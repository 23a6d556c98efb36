"""The memory planner: its numbers against real allocations (tiny model on CPU), against a count written out
by hand (Clover-35B-A3B, built on the meta device: nothing allocated), and its verdicts."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import clover_lite
from clover_lite.planning.devices import CUDA_CONTEXT_BYTES, GPU_RESERVE_BYTES, KNOWN_GPUS, normalize_gpu_name
from clover_lite.planning.memory import parse_quant
from clover_lite.planning.planner import MemoryPlanError, meta_model, model_bytes, plan

GiB = 1 << 30


def clover(*args):
    exe = shutil.which("clover")
    cmd = [exe] if exe else [sys.executable, "-m", "clover_lite.cli.main"]
    env = dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1")  # wide enough that rich wraps no line
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120, env=env)


def close(a, b, rel=0.10):
    return abs(a - b) <= rel * max(a, b)


# ---- real allocations ----------------------------------------------------------------------------
def test_tiny_plan_matches_what_load_allocates_on_cpu(tiny_engine, tiny_dir):
    model = tiny_engine.model
    allocated = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    p = plan(tiny_dir, "fp32", 1000, "cpu")
    assert close(p.weight_bytes, allocated) and p.weight_bytes == allocated  # exact, in fact
    for n in (64, 1000, 4096):
        cache = model.new_cache(capacity=n)
        q = plan(tiny_dir, "fp32", n, "cpu")
        assert close(q.kv_cache + q.gdn_state, cache.nbytes())
        assert q.kv_cache + q.gdn_state == cache.nbytes()
    # the cache a generation really builds (reserve grows it to prompt + new tokens)
    from clover_lite.runtime.generation import CachedRunner

    runner = CachedRunner(model, 4)
    runner.reserve(300)
    assert plan(tiny_dir, "fp32", 300, "cpu").kv_cache + p.gdn_state == runner.cache.nbytes()
    assert p.cuda_context == 0 and p.target.name.startswith("cpu")


def test_int4_checkpoint_plan_matches_its_loaded_allocation(tmp_path, tiny_dir):
    from clover_lite.quant.pipeline import QuantizeOptions, quantize_model

    options = QuantizeOptions(method="rtn", group_size=32, nsamples=2, seqlen=32)
    out = quantize_model(tiny_dir, tmp_path / "int4", options).out
    engine = clover_lite.load(out, device="cpu")
    p = plan(out, None, 512, "cpu", dtype="fp32")  # the quantize_config is read from the checkpoint
    assert p.scheme.kind == "int4" and p.scheme.group_size == 32 and not p.scheme.lm_head
    assert p.weight_bytes == model_bytes(engine.model)
    assert p.weights["routed experts"].keys() == {"qweight", "qzeros", "scales", "g_idx"}
    assert set(p.weights["lm_head"]) == {"float"} and set(p.weights["embeddings"]) == {"float"}


def test_random_weight_models_allocate_what_the_plan_says():
    from clover_lite.cli.bench import random_model

    for quant in ("fp32", "int4", "nf4"):
        model = random_model("tiny", quant, torch.device("cpu"), torch.float32)
        assert model_bytes(model) == plan("tiny", quant, 64, dtype="fp32").weight_bytes, quant
        ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
        assert torch.isfinite(model(ids, block_size=4)).all(), quant


# ---- Clover-35B-A3B, counted by hand -------------------------------------------------------------
def test_clover_35b_a3b_hand_count():
    H, V, E, I, Is = 2048, 248320, 256, 512, 512  # noqa: E741 (moe_intermediate_size)
    nh, kv, hd = 16, 2, 256
    nk, nv, dk, dv, kernel = 16, 32, 128, 128, 4
    conv = 2 * nk * dk + nv * dv  # 8192: the q, k, v channels of in_proj_qkv
    attn_layers, gdn_layers, layers = 10, 30, 40

    # Linears that INT4 quantizes, as (in K, out N, how many in the model).
    quantized = [
        (H, 2 * nh * hd, attn_layers),  # q_proj (query + output gate)
        (H, kv * hd, 2 * attn_layers),  # k_proj, v_proj
        (nh * hd, H, attn_layers),  # o_proj
        (H, conv, gdn_layers),  # in_proj_qkv
        (H, nv * dv, gdn_layers),  # in_proj_z
        (nv * dv, H, gdn_layers),  # out_proj
        (H, Is, 2 * layers),  # shared expert gate_proj, up_proj
        (Is, H, layers),  # shared expert down_proj
        (H, I, 2 * E * layers),  # routed experts gate_proj, up_proj
        (I, H, E * layers),  # routed experts down_proj
    ]
    # Everything else: embeddings, lm_head, norms, router, GDN b/a, conv1d, dt_bias, A_log, shared-expert gate.
    other = (
        V * H + V * H + H  # embed_tokens, lm_head, final norm
        + layers * 2 * H  # input / post-attention norms
        + attn_layers * 2 * hd  # q_norm, k_norm
        + gdn_layers * (2 * H * nv + conv * kernel + 2 * nv + dv)  # in_proj_b/a, conv1d, dt_bias + A_log, norm
        + layers * (E * H + H)  # router, shared_expert_gate
    )
    params = other + sum(k * n * count for k, n, count in quantized)
    assert params == 34_660_610_688
    bf16 = 2 * params
    assert bf16 == 69_321_221_376  # 64.56 GiB

    # GPTQ g128 per linear: qweight K/8 x N int32, qzeros K/128 x N/8 int32, scales K/128 x N fp16, g_idx K int32.
    def gptq(k, n):
        return (k // 8) * n * 4 + (k // 128) * (n // 8) * 4 + (k // 128) * n * 2 + k * 4

    int4 = 2 * other + sum(gptq(k, n) * count for k, n, count in quantized)
    assert int4 == 19_742_663_936  # 18.39 GiB

    kv_per_token = 2 * kv * hd * 2 * attn_layers  # K and V, bf16, full-attention layers only
    assert kv_per_token == 20_480
    gdn_state = gdn_layers * (nv * dk * dv * 4 + conv * (kernel - 1) * 2)
    assert gdn_state == 64_389_120

    p16 = plan("clover-35b-a3b", "bf16", 8192)
    p4 = plan("clover-35b-a3b", "int4", 8192)
    assert p16.weight_bytes == bf16 and p4.weight_bytes == int4
    assert p16.kv_per_token == p4.kv_per_token == kv_per_token
    assert p4.kv_cache == 8192 * kv_per_token and p4.gdn_state == gdn_state
    assert p4.logits == 32 * V * 4 and p4.cuda_context == CUDA_CONTEXT_BYTES
    # the same models built on the meta device, with the loader's own quantized modules: nothing allocated
    m16, m4 = meta_model("clover-35b-a3b", "bf16"), meta_model("clover-35b-a3b", "int4")
    assert next(m4.parameters()).device.type == "meta"
    assert model_bytes(m16) == bf16 and model_bytes(m4) == int4
    assert sum(t.numel() for t in m16.parameters()) == params


def test_int4_35b_fits_a_24gb_card_at_8k_and_bf16_does_not():
    for card in ("rtx3090", "rtx4090"):
        p4 = plan("clover-35b-a3b", "int4", 8192, card)
        p16 = plan("clover-35b-a3b", "bf16", 8192, card)
        assert p4.fits() and not p16.fits()
        assert p4.total < 22 * GiB < p16.total
        advice = p16.suggestions()
        assert any("weights alone" in s for s in advice) and any("INT4" in s and "fits" in s for s in advice)
        assert "does NOT fit" in p16.message() and "RTX" in p16.message()
    assert plan("clover-35b-a3b", "bf16", 8192).fits_on() == {
        "rtx4080": False, "rtx3090": False, "rtx4090": False, "rtx5090": False, "h200": True, "gb300": True}
    # too long a context: the advice is a context that fits, and it does
    p = plan("clover-35b-a3b", "int4", 131072, "rtx4090")
    assert not p.fits()
    n = p.max_context(p.target.capacity)
    assert 8192 < n < 131072 and p.with_context(n).fits() and not p.with_context(n + 1).fits()
    assert any(f"{n} tokens" in s for s in p.suggestions())


def test_known_cards_and_names():
    assert KNOWN_GPUS["rtx3090"].capacity == KNOWN_GPUS["rtx4090"].capacity == 24 * GiB
    assert KNOWN_GPUS["rtx5090"].capacity == 32 * GiB
    assert 139 * GiB < KNOWN_GPUS["h200"].capacity < 141 * GiB and KNOWN_GPUS["gb300"].capacity == 288 * 10**9
    assert all(g.usable == g.capacity - GPU_RESERVE_BYTES for g in KNOWN_GPUS.values())
    assert normalize_gpu_name("RTX 4090") == normalize_gpu_name("4090") == "rtx4090"
    assert normalize_gpu_name("NVIDIA H200") == "h200" and normalize_gpu_name("NVIDIA GeForce RTX 5090") == "rtx5090"
    with pytest.raises(clover_lite.CloverError, match="unknown GPU 'rtx9999'"):
        plan("tiny", "bf16", 100, "rtx9999")
    assert parse_quant("int4").group_size == 128 and not parse_quant("int4").lm_head
    assert parse_quant({"quant_method": "gptq", "bits": 4, "group_size": 32, "lm_head": True}).lm_head
    assert parse_quant("int4-g64").group_size == 64 and parse_quant("bfloat16").kind == "bf16"
    with pytest.raises(clover_lite.CloverError, match="unknown quantization"):
        parse_quant("int3")


# ---- load refuses instead of running out of memory ----------------------------------------------
def test_load_refuses_with_the_plan_on_cpu(tiny_dir, monkeypatch):
    from clover_lite.planning import devices

    monkeypatch.setattr(devices, "available_ram", lambda: 100_000)
    with pytest.raises(MemoryPlanError) as e:
        clover_lite.load(tiny_dir, device="cpu")
    assert "exceed the available RAM" in str(e.value) and "tiny" in str(e.value)
    assert clover_lite.load(tiny_dir, device="cpu", check_memory=False).model is not None


def test_load_check_on_cuda_uses_free_memory(tiny_dir, monkeypatch):
    import clover_lite.planning.planner as planner
    from clover_lite.models.config import load_config
    from clover_lite.planning import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = load_config(tiny_dir)
    monkeypatch.setattr(devices, "cuda_free_memory", lambda dev: (10 * 2**20, 24 * GiB))
    with pytest.raises(MemoryPlanError, match="run out of GPU memory") as e:
        planner.check_load(tiny_dir, config, torch.device("cuda"), torch.bfloat16)
    assert "cuda (free now, less 512.0 MiB headroom)" in str(e.value)
    monkeypatch.setattr(devices, "cuda_free_memory", lambda dev: (20 * GiB, 24 * GiB))
    p = planner.check_load(tiny_dir, config, torch.device("cuda"), torch.bfloat16)
    assert p.fits() and p.target.capacity == 20 * GiB - devices.CUDA_FREE_HEADROOM_BYTES
    # A context the caller fixed is the one checked (the engine's cache is allocated at it).
    assert planner.check_load(tiny_dir, config, torch.device("cuda"), torch.bfloat16, 8000).context_len == 8000
    # A model that needs all the free memory but the headroom is refused.
    free = p.total + devices.CUDA_FREE_HEADROOM_BYTES // 2
    monkeypatch.setattr(devices, "cuda_free_memory", lambda dev: (free, 24 * GiB))
    with pytest.raises(MemoryPlanError, match="run out of GPU memory"):
        planner.check_load(tiny_dir, config, torch.device("cuda"), torch.bfloat16)
    monkeypatch.setattr(devices, "cuda_free_memory", lambda dev: (free + GiB, 24 * GiB))
    assert planner.check_load(tiny_dir, config, torch.device("cuda"), torch.bfloat16).fits()


def test_cuda_free_memory_counts_the_allocators_unused_blocks(monkeypatch):
    """Memory PyTorch's allocator reserved but no tensor uses is this process's to use (a second model in
    one process), though the driver does not report it free."""
    from clover_lite.planning import devices

    dev = torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (3 * GiB, 24 * GiB) if d == dev else None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 5 * GiB if d == dev else None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 4 * GiB if d == dev else None)
    assert devices.cuda_free_memory(dev) == (4 * GiB, 24 * GiB)


# ---- clover info ----------------------------------------------------------------------------------
def test_clover_info_plans_and_compares():
    r = clover("info", "clover-35b-a3b", "--quant", "bf16", "--quant", "int4", "--gpu", "rtx4090",
               "--context", "8192")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for word in ("memory plan at 8192 tokens", "KV cache", "GDN state", "activation workspace (estimate)",
                 "logits buffer", "CUDA context", "qweight", "RTX 4090", "H200", "2*T*nh*S*d"):
        assert word in out, word
    assert "RTX 4090, bf16: does NOT fit" in out and "RTX 4090, INT4 GPTQ g128, lm_head 16-bit: fits" in out
    assert "use INT4 weights" in out
    from click.testing import CliRunner

    from clover_lite.cli.main import main

    r = CliRunner().invoke(main, ["info", "clover-35b-a3b", "--quant", "int4", "--context", "8192", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["weight_bytes"] == 19_742_663_936 and data["cards"]["rtx4090"]["fits"]
