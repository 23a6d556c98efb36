"""SDAR (model types `sdar`, `sdar_moe`: the Qwen3 / Qwen3-MoE backbone, block diffusion on top).

- At block size 1 the model is the causal LM: logits equal transformers' Qwen3ForCausalLM /
  Qwen3MoeForCausalLM with the same weights, saved as SDAR's checkpoints store them (config.json with
  model_type sdar / sdar_moe and no diffusion keys, experts per expert).
- At block size 4 the block-causal forward equals a float64 model written here from SDAR's modeling and
  generate.py: attention under generate.py's own mask (a lower-triangular block matrix repeated over each
  block's positions), q/k RMSNorm scaling by w, full RoPE, no output gate.
- Tiny SDAR checkpoints in the Hub layout load through clover_lite.load with the family's defaults (block 4,
  the tokenizer's `<|MASK|>`, EOS from config.json and generation_config.json), and the cached runner's
  generation equals the RecomputeRunner's at every step."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import clover_lite
from clover_lite.checkpoint.load import load_model
from clover_lite.checkpoint.tiny_families import write_family_checkpoint
from clover_lite.errors import ConfigError
from clover_lite.models import config_from_dict, load_config
from clover_lite.runtime.generation import CachedRunner, GenerationConfig, RecomputeRunner, denoise, run_to_end

from . import hf_models
from .seed import SEED
from .test_block_diffusion import Recorder

transformers = pytest.importorskip("transformers")

QWEN3_KW = dict(vocab_size=80, hidden_size=48, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                tie_word_embeddings=False)


def _sdar_dir(tmp_path, hf_model, moe: bool):
    """The transformers model's weights as an SDAR checkpoint: its config as SDAR's config.json writes it
    and its tensors under SDAR's (Qwen3's) names, experts split per expert as SDAR-30B-A3B stores them."""
    c = hf_model.config
    cfg = {
        "architectures": ["SDARMoeForCausalLM" if moe else "SDARForCausalLM"],
        "model_type": "sdar_moe" if moe else "sdar",
        **{k: getattr(c, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                      "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                                      "max_position_embeddings", "tie_word_embeddings")},
        "rope_theta": c.rope_parameters["rope_theta"], "rope_scaling": None, "attention_bias": False,
        "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None, "torch_dtype": "float32",
    }
    if moe:
        cfg.update({k: getattr(c, k) for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                               "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")})
    tensors = {}
    for name, t in hf_model.state_dict().items():
        t = t.detach().contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] in memory: gate rows, then up rows
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[f"{base}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                tensors[f"{base}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                tensors[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            tensors[name] = t
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path, tensors, cfg


def _qwen3(tmp_path, seed):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_KW, rope_theta=10000.0)).eval()
    hf_models.randomize(model, seed)
    return model, *_sdar_dir(tmp_path, model, moe=False)


def _qwen3_moe(tmp_path, seed, norm_topk_prob=True):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**QWEN3_KW, rope_theta=10000.0, num_experts=8, num_experts_per_tok=3,
                         moe_intermediate_size=24, norm_topk_prob=norm_topk_prob, decoder_sparse_step=1,
                         mlp_only_layers=[1])
    model = Qwen3MoeForCausalLM(cfg).eval()
    hf_models.randomize(model, seed)
    return model, *_sdar_dir(tmp_path, model, moe=True)


def _compare_causal(hf_model, path, lengths=(1, 5, 23)):
    config = load_config(path)
    ours, _ = load_model(path, config)
    gen = torch.Generator().manual_seed(SEED + sum(lengths))
    for T in lengths:
        ids = torch.randint(0, config.vocab_size, (2, T), generator=gen)
        with torch.no_grad():
            ref = hf_model(input_ids=ids).logits.float()
            out = ours(ids, block_size=1)
        err = (out - ref).abs().max().item()
        assert err < 2e-5 * max(1.0, ref.abs().max().item()), f"T={T}: max abs diff {err}"
    return ours


def test_sdar_matches_qwen3_causal_lm(tmp_path):
    hf, path, _, _ = _qwen3(tmp_path, seed=1)
    ours = _compare_causal(hf, path)
    c = ours.config
    assert c.model_type == "sdar" and not c.attention_output_gate and not c.norm_unit_offset
    assert c.rotary_dim == c.head_dim and c.gdn_layers == [] and set(c.mlp_types) == {"dense"}
    assert c.block_size == 4 and c.mask_token_id is None  # 151669 is past this tiny vocabulary


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_sdar_moe_matches_qwen3_moe_causal_lm(tmp_path, norm_topk_prob):
    hf, path, tensors, _ = _qwen3_moe(tmp_path, seed=2, norm_topk_prob=norm_topk_prob)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in tensors  # per expert, as SDAR-30B-A3B stores them
    ours = _compare_causal(hf, path)
    assert ours.config.mlp_types == ("moe", "dense", "moe") and ours.config.shared_expert_intermediate_size == 0


# ---- the block-causal forward, against a float64 model written from SDAR's own code ---------------------
def sdar_generate_mask(T: int, block: int) -> torch.Tensor:
    """generate.py's block_diffusion_attention_mask: tril over blocks, repeated over each block's positions."""
    n = (T + block - 1) // block
    m = torch.tril(torch.ones(n, n)).repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return m[:T, :T].bool()


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w  # SDARRMSNorm: scales by w


def _rope(x, theta):  # x [T, heads, d], full rotate-half RoPE at positions 0..T-1
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def sdar_reference(w: dict, cfg: dict, ids: torch.Tensor, block: int) -> torch.Tensor:
    """Logits [T, vocab] of one sequence, float64, under generate.py's block mask."""
    w = {k: v.double() for k, v in w.items()}
    nh, nkv, hd, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    T = ids.shape[0]
    mask = sdar_generate_mask(T, block)
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = _rope(_rms((h @ w[p + "self_attn.q_proj.weight"].T).view(T, nh, hd), w[p + "self_attn.q_norm.weight"], eps),
                  cfg["rope_theta"])
        k = _rope(_rms((h @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd), w[p + "self_attn.k_norm.weight"],
                       eps), cfg["rope_theta"])
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, hd)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        a = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
        x = x + torch.einsum("hqk,khd->qhd", a, v).reshape(T, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        if p + "mlp.gate.weight" in w:  # Qwen3-MoE: softmax top-k, renormalised when norm_topk_prob
            probs = torch.softmax(h @ w[p + "mlp.gate.weight"].T, -1)
            top, idx = torch.topk(probs, cfg["num_experts_per_tok"], -1)
            if cfg["norm_topk_prob"]:
                top = top / top.sum(-1, keepdim=True)
            out = torch.zeros_like(h)
            for t in range(T):
                for j in range(idx.shape[1]):
                    e = f"{p}mlp.experts.{int(idx[t, j])}."
                    y = F.silu(h[t] @ w[e + "gate_proj.weight"].T) * (h[t] @ w[e + "up_proj.weight"].T)
                    out[t] += top[t, j] * (y @ w[e + "down_proj.weight"].T)
        else:
            out = (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
                @ w[p + "mlp.down_proj.weight"].T
        x = x + out
    return _rms(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


@pytest.mark.parametrize("moe", [False, True])
def test_block_causal_forward_matches_sdar_mask_semantics(tmp_path, moe):
    _, path, tensors, cfg = (_qwen3_moe(tmp_path, seed=3) if moe else _qwen3(tmp_path, seed=3))
    model, _ = load_model(path, load_config(path))
    gen = torch.Generator().manual_seed(SEED + 5)
    for T in (4, 11, 18):  # whole blocks, and a last partial block
        ids = torch.randint(0, cfg["vocab_size"], (2, T), generator=gen)
        with torch.no_grad():
            out = model(ids, block_size=4)
        for b in range(2):
            ref = sdar_reference(tensors, cfg, ids[b], 4)
            torch.testing.assert_close(out[b].double(), ref, atol=2e-5, rtol=2e-5)
        assert not torch.allclose(out, model(ids, block_size=1))  # the mask matters


# ---- config and generation defaults ------------------------------------------------------------------
SDAR_4B_CHAT_CONFIG = {  # JetLM/SDAR-4B-Chat config.json as published (the keys we read)
    "architectures": ["SDARForCausalLM"], "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151643,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 9728,
    "max_position_embeddings": 32768, "model_type": "sdar", "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_published_config_gets_the_family_defaults(tmp_path):
    c = config_from_dict(SDAR_4B_CHAT_CONFIG)
    assert (c.block_size, c.mask_token_id, c.eos_token_ids) == (4, 151669, (151643,))
    assert c.partial_rotary_factor == 1.0 and c.rope_theta == 1e6 and c.layer_types == ("full_attention",) * 36
    # a fine-tune that says otherwise (the -b8 / -b32 checkpoints' block_size key) wins
    assert config_from_dict({**SDAR_4B_CHAT_CONFIG, "block_size": 8, "mask_token_id": 151670}).block_size == 8
    # generation_config.json: its EOS ids join config.json's
    (tmp_path / "config.json").write_text(json.dumps(SDAR_4B_CHAT_CONFIG))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert load_config(tmp_path).eos_token_ids == (151643, 151645)
    with pytest.raises(ConfigError, match="use_sliding_window"):
        config_from_dict({**SDAR_4B_CHAT_CONFIG, "use_sliding_window": True})
    with pytest.raises(ConfigError, match="sliding"):
        config_from_dict({**SDAR_4B_CHAT_CONFIG, "num_hidden_layers": 2,
                          "layer_types": ["full_attention", "sliding_attention"]})


# ---- tiny Hub-layout checkpoints: load, and the cached generation equals the recomputing one ----------
@pytest.fixture(scope="module", params=["sdar", "sdar_moe"])
def sdar_engine(request, tmp_path_factory):
    path = write_family_checkpoint(tmp_path_factory.mktemp(request.param) / "tiny", request.param, seed=7)
    return clover_lite.load(path, device="cpu")


def test_tiny_checkpoint_loads_with_family_defaults(sdar_engine):
    e = sdar_engine
    assert e.config.model_type in ("sdar", "sdar_moe") and e.config.block_size == 4
    assert e.mask_token_id == e.tokenizer.encode("<|MASK|>")[0]  # from the tokenizer, as generate.py finds it
    ids = e.tokenizer.encode("<|endoftext|><|im_end|>")
    assert set(ids) <= set(e.eos_token_ids)  # config.json's and generation_config.json's
    out = e.generate("abc", max_new_tokens=6, raw=True, ignore_eos=True)
    assert len(out.token_ids) == 6 and e.mask_token_id not in out.token_ids


@pytest.mark.parametrize("prompt_len, block_size", [(3, 4), (9, 4), (5, 1)])
def test_cached_generation_equals_recompute_runner(sdar_engine, prompt_len, block_size):
    model = sdar_engine.model
    gen = torch.Generator().manual_seed(SEED + prompt_len)
    prompt = torch.randint(0, 256, (prompt_len,), generator=gen).tolist()
    cfg = GenerationConfig(max_new_tokens=14, block_size=block_size, threshold=0.01).resolved(None)
    cached, ref = Recorder(CachedRunner(model, block_size)), Recorder(RecomputeRunner(model, block_size))
    a = run_to_end(denoise(cached, prompt, cfg, sdar_engine.mask_token_id))
    b = run_to_end(denoise(ref, prompt, cfg, sdar_engine.mask_token_id))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 14
    assert len(cached.logits) == len(ref.logits) == a.stats.forwards
    for x, y in zip(cached.logits, ref.logits, strict=True):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("chunk", [4, 10, 12, 2048])
def test_prefill_in_chunks_equals_one_forward(sdar_engine, chunk):
    """Every layer attends (no GDN), so a prompt committed in chunks (10 is rounded down to whole blocks of 4:
    8) must leave the cache a step reads exactly as one block-causal forward over prompt + block sees it."""
    model, B = sdar_engine.model, 4
    gen = torch.Generator().manual_seed(SEED + chunk)
    prompt = torch.randint(0, 256, (1, 4 * int(torch.randint(3, 7, (), generator=gen))), generator=gen)
    block = torch.randint(0, 256, (1, B), generator=gen)
    with torch.no_grad():
        cache = model.new_cache()
        model.prefill(prompt, cache, B, chunk_tokens=chunk)
        out, _ = model.step(block, cache)
        ref = model(torch.cat([prompt, block], 1), block_size=B)[:, prompt.shape[1]:]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


# ---- kernels and quantization --------------------------------------------------------------------------
def test_kernels_match_reference_on_sdar_moe(tmp_path):
    """The Triton kernels (interpreted) on attention without the output gate, norms scaling by w and full
    RoPE, softmax routing with no shared expert: the reference's greedy tokens and step logits."""
    pytest.importorskip("triton")
    path = write_family_checkpoint(tmp_path / "m", "sdar_moe", seed=2, num_hidden_layers=2)
    ref, tri = clover_lite.load(path, device="cpu"), clover_lite.load(path, device="cpu", kernels="triton")
    assert tri.model.backend == "triton" and "route" in vars(tri.model.layers[0].mlp)  # the top-k kernel is bound
    prompt, kw = [3, 1, 4, 1, 5, 9, 2], dict(max_new_tokens=6, threshold=0.006)
    assert ref.generate(prompt, **kw).token_ids == tri.generate(prompt, **kw).token_ids
    with torch.no_grad():
        logits = []
        for e in (ref, tri):
            cache = e.model.new_cache()
            e.model.prefill(torch.tensor([prompt[:4]]), cache, 4)
            logits.append(e.model.step(torch.tensor([[7, e.mask_token_id, 8, e.mask_token_id]]), cache)[0])
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


def test_quantize_tiny_sdar_moe_and_load_back(tmp_path):
    """`clover quantize` on the SDAR-MoE layout: attention, the dense layer and every expert to GPTQ INT4;
    the router stays 16-bit; the output loads back through the same path and keeps the family's defaults."""
    from clover_lite.models.quantized import QuantExperts, QuantLinear
    from clover_lite.quant.pipeline import QuantizeOptions, quantize_model

    src = write_family_checkpoint(tmp_path / "src", "sdar_moe", seed=4)
    r = quantize_model(src, tmp_path / "q", QuantizeOptions(group_size=32, nsamples=4, seqlen=32))
    assert set(r.error_by_kind) == {"attention", "dense", "experts"} and max(r.error_by_kind.values()) < 0.1
    assert r.fallback_experts == []
    q, ref = clover_lite.load(r.out, device="cpu"), clover_lite.load(src, device="cpu")
    layer0, layer1 = q.model.layers[0], q.model.layers[1]
    assert isinstance(layer0.mlp.experts, QuantExperts) and isinstance(layer0.self_attn.q_proj, QuantLinear)
    assert isinstance(layer1.mlp.down_proj, QuantLinear) and type(layer0.mlp.gate.weight) is torch.nn.Parameter
    assert (q.config.block_size, q.mask_token_id, q.eos_token_ids) == (4, ref.mask_token_id, ref.eos_token_ids)
    # Each quantized weight is its source's (an expert or projection read into the wrong place would be as far
    # off as another random matrix, ~1.4), and the INT4 model is the 16-bit one with those weights, exactly.
    qm, rm = dict(q.model.named_modules()), dict(ref.model.named_modules())
    pairs = []  # (dequantized, the source's tensor it replaces)
    with torch.no_grad():
        for name, m in qm.items():
            if isinstance(m, QuantExperts):
                E = m.num_experts
                gate_up = torch.stack([torch.cat([m.gate_proj.weight_of(e, torch.float32),
                                                  m.up_proj.weight_of(e, torch.float32)]) for e in range(E)])
                down = torch.stack([m.down_proj.weight_of(e, torch.float32) for e in range(E)])
                pairs += [(gate_up, rm[name].gate_up_proj), (down, rm[name].down_proj)]
            elif isinstance(m, QuantLinear) and m.qweight.dim() == 2:
                pairs.append((m.weight_of(dtype=torch.float32), rm[name].weight))
        assert len(pairs) >= 8
        for deq, w in pairs:
            assert ((deq - w).norm() / w.norm()).item() < 0.25  # INT4 group 32 on random weights: about 0.16
            w.copy_(deq)
        ids = torch.randint(0, 256, (1, 13), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(q.model(ids, block_size=4), ref.model(ids, block_size=4), atol=1e-4, rtol=1e-4)
    assert len(q.generate("abc", max_new_tokens=4, raw=True, ignore_eos=True).token_ids) == 4


# ---- planning ------------------------------------------------------------------------------------------
def test_named_configs_counted_by_hand():
    """SDAR-8B (Qwen3-8B) and SDAR-30B-A3B (Qwen3-30B-A3B), counted from their config.json: attention
    without the output gate (q_proj heads x head_dim wide), no GDN, dense SwiGLU or 128 experts with no shared
    expert; the planner's bytes and the meta model's agree with the count."""
    from clover_lite.planning.planner import meta_model, model_bytes, plan

    V, hd = 151936, 128
    for name, H, L, nh, kv, I, E, Im, published in (  # noqa: E741
            ("sdar-8b", 4096, 36, 32, 8, 12288, 0, 0, (8.19e9, 8.19e9)),
            ("sdar-30b-a3b", 2048, 48, 32, 4, 0, 128, 768, (30.5e9, 3.35e9))):
        attn = H * nh * hd + 2 * H * kv * hd + nh * hd * H + 2 * hd
        mlp = 3 * H * I if not E else 3 * H * Im * E + E * H
        total = 2 * V * H + H + L * (2 * H + attn + mlp)
        active = total - (L * 3 * H * Im * (E - 8) if E else 0)
        m = meta_model(name, "bf16")
        assert m.num_parameters() == (total, active)
        assert abs(total - published[0]) < 0.01 * published[0] and abs(active - published[1]) < 0.01 * published[1]
        p16, p4 = plan(name, "bf16", 8192), plan(name, "int4", 8192)
        assert p16.weight_bytes == 2 * total and p4.weight_bytes == model_bytes(meta_model(name, "int4"))
        assert p16.gdn_state == 0 and p16.kv_per_token == 2 * kv * hd * 2 * L and p16.block_size == 4
    eight, moe = plan("sdar-8b", "int4", 8192).fits_on(), plan("sdar-30b-a3b", "int4", 8192).fits_on()
    assert eight["rtx4080"] and not plan("sdar-8b", "bf16", 8192).fits_on()["rtx4080"]
    assert not moe["rtx4080"] and moe["rtx4090"] and not plan("sdar-30b-a3b", "bf16", 8192).fits_on()["rtx5090"]


def test_static_step_on_an_attention_only_model(tmp_path):
    """The CUDA-graph step's forward (run eagerly) over a stack with no GDN layer: the cache holds keys and
    values only, nothing waits for the device, the logits and the commit equal the reference's."""
    pytest.importorskip("triton")
    from clover_lite.runtime.graph import StaticStep

    from .host_sync import HostSyncTrap

    path = write_family_checkpoint(tmp_path / "d", "sdar", seed=6, num_hidden_layers=2)
    ref = clover_lite.load(path, device="cpu")
    eng = clover_lite.load(path, device="cpu", kernels="triton", static_step=True, context=32)
    assert isinstance(eng._static, StaticStep) and all(t is None for t in eng._cache.recurrent)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        eng.model.prefill(ids[:, :8], eng._cache, 4)
        eng._static(ids[:, 8:])  # a warm-up, as capture's
        with HostSyncTrap():
            static = eng._static.forward()[0]
            eng._static.commit(ids[0, 8:].tolist())
        cache = ref.model.new_cache()
        ref.model.prefill(ids[:, :8], cache, 4)
        dynamic, _ = ref.model.step(ids[:, 8:], cache)
        ref.model.commit(ids[:, 8:], cache, 4)
    torch.testing.assert_close(static, dynamic[0], atol=1e-4, rtol=1e-4)
    for i in range(2):
        torch.testing.assert_close(eng._cache.keys[i][:, :, :12], cache.keys[i][:, :, :12], atol=1e-4, rtol=1e-4)
