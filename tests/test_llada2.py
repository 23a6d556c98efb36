"""LLaDA2.x (model type `llada2_moe`, BailingMoeV2) against a float64 model written here from the public
modeling file (inclusionAI's modeling_llada2_moe.py, as dInfer ships it):

- attention: one fused query_key_value viewed as heads + 2 kv heads of head_dim, q/k RMSNorm scaling by w,
  RoPE on the first head_dim * partial_rotary_factor dims, 1/sqrt(head_dim), `dense` out;
- the first first_k_dense_replace layers dense, the rest MoE: the gate's logits in fp32, sigmoid scores,
  group-limited top-k on score + expert_bias (a group scored by its two best), the unbiased scores of the
  chosen experts renormalised (+1e-20) and times routed_scaling_factor, plus the shared experts' MLP;
- the routing on a hand-worked example (numbers computed by hand below);
- one decoder layer and the whole model's logits at block sizes 1, 4 and 32 (ragged lengths), and the tiny
  checkpoint's generation through the cache equal to the RecomputeRunner's at every step."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import clover_lite
from clover_lite.checkpoint.tiny_families import llada2_config, write_family_checkpoint
from clover_lite.errors import ConfigError
from clover_lite.models import config_from_dict
from clover_lite.models.moe import GroupedSigmoidRouter
from clover_lite.runtime.generation import CachedRunner, GenerationConfig, RecomputeRunner, denoise, run_to_end

from .seed import SEED
from .test_block_diffusion import Recorder


# ---- routing, worked by hand --------------------------------------------------------------------------
def test_grouped_biased_scaled_routing_hand_worked():
    """8 experts in 4 groups of 2, the best 2 groups kept, top-3, scaling 2.5.

    Token 0: scores s = [.9 .1 | .6 .5 | .2 .3 | .8 .05], bias [0 0 | 0 0 | .5 .5 | -.5 0]
      s + bias = [.9 .1 | .6 .5 | .7 .8 | .3 .05]; group scores (sum of the two best) 1.0, 1.1, 1.5, .35
      -> groups 2 and 1 -> experts {2, 3, 4, 5}, by s + bias .6 .5 .7 .8 -> top-3: 5, 4, 2
      (expert 0, the best score, is in a dropped group; expert 6 falls behind on its bias)
      weights: unbiased s = .3 .2 .6, sum 1.1 -> .3/1.1, .2/1.1, .6/1.1, times 2.5 = .681818, .454545, 1.363636
    Token 1: s = [.2 .2 | .9 .1 | .4 .45 | .3 .35], bias as token 0
      s + bias = [.2 .2 | .9 .1 | .9 .95 | -.2 .35]; group scores .4, 1.0, 1.85, .15 -> groups 2 and 1
      -> by s + bias .9 .1 .9 .95 -> top-3: 5 (.95), then 2 and 4 (.9 each: the lower id first), so 5, 2, 4
      weights: s = .45 .9 .4, sum 1.75 -> times 2.5/1.75 = .642857, 1.285714, .571429
    """
    r = GroupedSigmoidRouter(hidden=8, num_experts=8, top_k=3, groups=4, topk_groups=2, scaling=2.5,
                             expert_bias=True)
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([0, 0, 0, 0, 0.5, 0.5, -0.5, 0]))
    s = torch.tensor([[0.9, 0.1, 0.6, 0.5, 0.2, 0.3, 0.8, 0.05],
                      [0.2, 0.2, 0.9, 0.1, 0.4, 0.45, 0.3, 0.35]], dtype=torch.float64)
    weights, ids = r.select(s, torch.float64)
    assert ids[0].tolist() == [5, 4, 2]
    torch.testing.assert_close(weights[0], torch.tensor([0.75, 0.5, 1.5], dtype=torch.float64) / 1.1)
    assert ids[1, 0] == 5 and sorted(ids[1, 1:].tolist()) == [2, 4]
    w1 = dict(zip(ids[1].tolist(), weights[1].tolist(), strict=True))
    for e, want in ((5, 0.45), (2, 0.9), (4, 0.4)):
        assert w1[e] == pytest.approx(want * 2.5 / 1.75, rel=1e-12)
    # the same from the gate's weights: logits = logit(s) for a one-hot input, sigmoid in fp32
    with torch.no_grad():
        r.weight.copy_(torch.zeros(8, 8))
        r.weight[:, 0] = torch.logit(s[0]).float()
    w2, i2 = r(F.one_hot(torch.tensor([0]), 8).float())
    assert i2[0].tolist() == [5, 4, 2]
    torch.testing.assert_close(w2[0], weights[0].float(), atol=1e-6, rtol=1e-6)


def _group_limited_topk_reference(scores, bias, groups, topk_groups, k, scaling):
    """One token, float64, written out with loops (the modeling file's group_limited_topk and gate)."""
    E = scores.shape[0]
    size = E // groups
    biased = [float(scores[e] + bias[e]) for e in range(E)]
    group_score = [sum(sorted(biased[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(groups)]
    kept = sorted(range(groups), key=lambda g: -group_score[g])[:topk_groups]
    allowed = [e for g in kept for e in range(g * size, (g + 1) * size)]
    chosen = sorted(allowed, key=lambda e: -biased[e])[:k]
    w = [float(scores[e]) for e in chosen]
    total = sum(w) + 1e-20
    return chosen, [x / total * scaling if k > 1 else x * scaling for x in w]


# ---- the float64 model, from the public modeling file -------------------------------------------------
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w  # LLaDA2MoeRMSNorm: weight * x_normed


def _partial_rope(x, start, theta, rd):  # x [T, heads, d]: rotate-half RoPE on the first rd dims
    inv = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    f = torch.arange(start, start + x.shape[0], dtype=torch.float64)[:, None] * inv
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    r = x[..., :rd]
    rotated = torch.cat([-r[..., rd // 2:], r[..., : rd // 2]], -1)
    return torch.cat([r * cos + rotated * sin, x[..., rd:]], -1)


def _mlp(h, w, p):
    return (F.silu(h @ w[p + "gate_proj.weight"].T) * (h @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T


def llada2_layer(w, cfg, i, x, mask):
    """Decoder layer i on hidden states x [T, H] (float64), mask [T, T] (True = visible)."""
    nh, nkv, hd, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    rd = int(hd * cfg["partial_rotary_factor"])
    T = x.shape[0]
    p = f"model.layers.{i}."
    h = _rms(x, w[p + "input_layernorm.weight"], eps)
    qkv = (h @ w[p + "attention.query_key_value.weight"].T).view(T, nh + 2 * nkv, hd)
    q, k, v = qkv.split([nh, nkv, nkv], dim=1)
    q = _partial_rope(_rms(q, w[p + "attention.query_layernorm.weight"], eps), 0, cfg["rope_theta"], rd)
    k = _partial_rope(_rms(k, w[p + "attention.key_layernorm.weight"], eps), 0, cfg["rope_theta"], rd)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    a = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    x = x + torch.einsum("hqk,khd->qhd", a, v).reshape(T, nh * hd) @ w[p + "attention.dense.weight"].T
    h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
    if i < cfg["first_k_dense_replace"]:
        return x + _mlp(h, w, p + "mlp.")
    scores = torch.sigmoid(h @ w[p + "mlp.gate.weight"].T)
    out = _mlp(h, w, p + "mlp.shared_experts.")
    for t in range(T):
        chosen, weights = _group_limited_topk_reference(scores[t], w[p + "mlp.gate.expert_bias"], cfg["n_group"],
                                                        cfg["topk_group"], cfg["num_experts_per_tok"],
                                                        cfg["routed_scaling_factor"])
        for e, wt in zip(chosen, weights, strict=True):
            out[t] = out[t] + wt * _mlp(h[t], w, f"{p}mlp.experts.{e}.")
    return x + out


def block_mask(T, block):
    b = torch.arange(T) // block
    return b[None, :] <= b[:, None]


def llada2_reference(w, cfg, ids, block):
    x = w["model.word_embeddings.weight"][ids]
    mask = block_mask(ids.shape[0], block)
    for i in range(cfg["num_hidden_layers"]):
        x = llada2_layer(w, cfg, i, x, mask)
    return _rms(x, w["model.norm.weight"], cfg["rms_norm_eps"]) @ w["lm_head.weight"].T


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny LLaDA2 checkpoint in the Hub layout, its router made decisive (larger gate weights and expert
    biases than the random init's, so routing differs across tokens and the bias matters)."""
    path = write_family_checkpoint(tmp_path_factory.mktemp("llada2") / "tiny", "llada2", seed=3)
    tensors = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(SEED)
    for name, t in tensors.items():
        if name.endswith("mlp.gate.weight"):
            tensors[name] = torch.randn(t.shape, generator=gen) * 0.6
        elif name.endswith("mlp.gate.expert_bias"):
            tensors[name] = torch.randn(t.shape, generator=gen) * 0.3
    save_file(tensors, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    return path, {k: v.double() for k, v in tensors.items()}, cfg, clover_lite.load(path, device="cpu")


def test_hub_layout_and_config(tiny):
    _, w, cfg, engine = tiny
    c = engine.config
    assert "model.layers.1.attention.query_key_value.weight" in w and "model.word_embeddings.weight" in w
    assert "model.layers.1.mlp.gate.expert_bias" in w and "model.layers.2.mlp.shared_experts.up_proj.weight" in w
    assert c.mlp_types == ("dense", "moe", "moe") and c.router == "sigmoid_grouped" and not c.shared_expert_gate
    assert c.rotary_dim == 8 and not c.attention_output_gate and not c.norm_unit_offset
    assert c.block_size == 32 and engine.mask_token_id == engine.tokenizer.encode("<|mask|>")[0]
    assert set(engine.tokenizer.encode("<|endoftext|><|role_end|>")) <= set(engine.eos_token_ids)


def test_decoder_layers_match_the_reference(tiny):
    _, w, cfg, engine = tiny
    model = engine.model
    gen = torch.Generator().manual_seed(SEED + 1)
    T = 13
    x = torch.randn(1, T, cfg["hidden_size"], generator=gen)
    mask = block_mask(T, 4)
    cos, sin = model.rotary(torch.arange(T))
    for i in range(cfg["num_hidden_layers"]):  # the dense layer and the MoE layers
        with torch.no_grad():
            ours, _ = model.layers[i](x, cos, sin, mask, None, None)
        ref = llada2_layer(w, cfg, i, x[0].double(), mask)
        torch.testing.assert_close(ours[0].double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block", [1, 4, 32])
def test_model_logits_match_the_reference(tiny, block):
    _, w, cfg, engine = tiny
    gen = torch.Generator().manual_seed(SEED + block)
    for T in (1, 7, 19):
        ids = torch.randint(0, cfg["vocab_size"], (2, T), generator=gen)
        with torch.no_grad():
            out = engine.model(ids, block_size=block)
        for b in range(2):
            torch.testing.assert_close(out[b].double(), llada2_reference(w, cfg, ids[b], block), atol=2e-5, rtol=2e-5)


# ---- config and generation defaults ------------------------------------------------------------------
LLADA2_1_MINI_CONFIG = {  # inclusionAI/LLaDA2.1-mini config.json as published (the keys we read)
    "architectures": ["LLaDA2MoeModelLM"], "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 5120, "max_position_embeddings": 32768, "model_type": "llada2_moe",
    "moe_intermediate_size": 512, "moe_router_enable_expert_bias": True, "n_group": 8, "norm_head": False,
    "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8,
    "num_hidden_layers": 20, "num_key_value_heads": 4, "num_shared_experts": 1, "pad_token_id": 156892,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 600000,
    "rotary_dim": 64, "routed_scaling_factor": 2.5, "router_dtype": "fp32", "score_function": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "use_bias": False, "use_cache": False, "use_qkv_bias": False,
    "vocab_size": 157184, "dtype": "bfloat16",
}


def test_published_config_gets_the_family_defaults():
    c = config_from_dict(LLADA2_1_MINI_CONFIG)
    assert (c.block_size, c.mask_token_id, c.eos_token_ids) == (32, 156895, (156892,))
    assert c.mlp_types == ("dense",) + ("moe",) * 19 and c.shared_expert_intermediate_size == 512
    assert (c.router_groups, c.router_topk_groups, c.routed_scaling_factor) == (8, 4, 2.5)
    assert c.router_expert_bias and c.rotary_dim == 64 and c.attention_layers == list(range(20))
    for bad, match in (({"n_group": 7}, "n_group"), ({"topk_group": 1, "num_experts_per_tok": 40}, "groups"),
                       ({"use_qk_norm": False}, "use_qk_norm"), ({"score_function": "softmax"}, "score_function")):
        with pytest.raises(ConfigError, match=match):
            config_from_dict({**LLADA2_1_MINI_CONFIG, **bad})
    assert llada2_config()["model_type"] == "llada2_moe"


@pytest.mark.parametrize("prompt_len, block_size", [(5, 32), (11, 4), (37, 32)])
def test_cached_generation_equals_recompute_runner(tiny, prompt_len, block_size):
    *_, engine = tiny
    gen = torch.Generator().manual_seed(SEED + prompt_len)
    prompt = torch.randint(0, 256, (prompt_len,), generator=gen).tolist()
    cfg = GenerationConfig(max_new_tokens=12, block_size=block_size, threshold=0.01).resolved(None)
    cached, ref = Recorder(CachedRunner(engine.model, block_size)), Recorder(RecomputeRunner(engine.model, block_size))
    a = run_to_end(denoise(cached, prompt, cfg, engine.mask_token_id))
    b = run_to_end(denoise(ref, prompt, cfg, engine.mask_token_id))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    for x, y in zip(cached.logits, ref.logits, strict=True):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=2e-5)
    out = engine.generate(prompt, max_new_tokens=5, ignore_eos=True)  # the engine's default: block 32
    assert len(out.token_ids) == 5


# ---- kernels and quantization --------------------------------------------------------------------------
def test_kernels_match_reference(tiny):
    """Interpreted Triton kernels: attention without the gate, partial RoPE, norms scaling by w; the grouped
    sigmoid router stays on the reference (kernels/forwards.py), the ungated shared expert is added as is."""
    pytest.importorskip("triton")
    path, *_ = tiny
    ref, tri = clover_lite.load(path, device="cpu"), clover_lite.load(path, device="cpu", kernels="triton")
    assert tri.model.backend == "triton" and "route" not in vars(tri.model.layers[1].mlp)  # the reference route
    prompt, kw = [3, 1, 4, 1, 5, 9, 2], dict(max_new_tokens=6, threshold=0.006, block_size=4)
    assert ref.generate(prompt, **kw).token_ids == tri.generate(prompt, **kw).token_ids


def test_quantized_static_step(tmp_path):
    """INT4 LLaDA2 (RTN) through the static step (the CUDA-graph forward, run eagerly): the fused MoE with the
    ungated shared expert folded into the residual, and the reference grouped router, which never waits for
    the device (capture needs that); its logits equal the reference step's, its commit the reference's."""
    pytest.importorskip("triton")
    from clover_lite.quant.pipeline import QuantizeOptions, quantize_model
    from clover_lite.runtime.graph import StaticStep

    from .host_sync import HostSyncTrap

    src = write_family_checkpoint(tmp_path / "src", "llada2", seed=5, num_hidden_layers=2, block_size=4)
    q = quantize_model(src, tmp_path / "q", QuantizeOptions(method="rtn", group_size=32, nsamples=2, seqlen=32)).out
    ref = clover_lite.load(q, device="cpu")
    eng = clover_lite.load(q, device="cpu", kernels="triton", static_step=True, context=64)
    assert isinstance(eng._static, StaticStep)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eng.model.prefill(ids[:, :8], eng._cache, 4)
        eng._static(ids[:, 8:])  # a warm-up, as capture's
        with HostSyncTrap():
            static = eng._static.forward()[0]
        cache = ref.model.new_cache()
        ref.model.prefill(ids[:, :8], cache, 4)
        dynamic, _ = ref.model.step(ids[:, 8:], cache)
        torch.testing.assert_close(static, dynamic[0], atol=1e-4, rtol=1e-4)
        with HostSyncTrap():  # the captured commit: the block's keys and values at the device-side length
            eng._static.commit(ids[0, 8:].tolist())
        ref.model.commit(ids[:, 8:], cache, 4)
    assert eng._cache.length == cache.length == 12
    for i in ref.model.config.attention_layers:
        torch.testing.assert_close(eng._cache.keys[i][:, :, :12], cache.keys[i][:, :, :12], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(eng._cache.values[i][:, :, :12], cache.values[i][:, :, :12], atol=1e-4, rtol=1e-4)


# ---- planning ------------------------------------------------------------------------------------------
def test_named_configs_counted_by_hand():
    """LLaDA2.1-mini and LLaDA2.0-flash, counted from their published config.json: a fused query_key_value
    of (q + 2 kv) heads, no GDN, the first layer dense, 256 experts, one ungated shared expert, the router
    and its expert bias. The planner's bytes and the meta model's agree with the count."""
    from clover_lite.planning.planner import meta_model, model_bytes, plan

    for name, H, L, nh, I, Im, published in (("llada2.1-mini", 2048, 20, 16, 5120, 512, (16.26e9, 1.43e9)),  # noqa: E741
                                              ("llada2-flash", 4096, 32, 32, 9216, 1024, (102.9e9, 6.15e9))):
        V, kv, hd, E, k = 157184, 4, 128, 256, 8
        per_layer = 2 * H + H * (nh + 2 * kv) * hd + nh * hd * H + 2 * hd  # norms, qkv, dense, q/k norms
        moe = 3 * H * Im * (E + 1) + E * H + E  # experts + shared expert, router, expert bias
        total = 2 * V * H + H + L * per_layer + 3 * H * I + (L - 1) * moe
        active = total - (L - 1) * 3 * H * Im * (E - k)
        m = meta_model(name, "bf16")
        assert m.num_parameters() == (total, active)
        assert abs(total - published[0]) < 0.01 * published[0] and abs(active - published[1]) < 0.01 * published[1]
        p16, p4 = plan(name, "bf16", 8192), plan(name, "int4", 8192)
        assert p16.weight_bytes == 2 * total and p4.weight_bytes == model_bytes(meta_model(name, "int4"))
        assert p16.gdn_state == 0 and p16.kv_per_token == 2 * kv * hd * 2 * L and p16.block_size == 32
    # the mini at INT4 fits a 16 GB card at 8K (bf16 needs more than a 32 GB one); the flash fits none of them
    mini, flash = plan("llada2.1-mini", "int4", 8192).fits_on(), plan("llada2-flash", "int4", 8192).fits_on()
    assert mini["rtx4080"] and mini["rtx4090"] and not plan("llada2.1-mini", "bf16", 8192).fits_on()["rtx5090"]
    assert not any(flash[c] for c in ("rtx4080", "rtx4090", "rtx5090")) and flash["h200"]


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_fused_query_key_value_as_other_tools_write_it(tmp_path, act_order):
    """A GPTQ LLaDA2 checkpoint as GPTQ tools write it (query_key_value quantized as one linear: qweight,
    scales and qzeros concatenated along the output, one g_idx) loads to the same model as our own split
    q/k/v output: equal logits on a fresh random block."""
    import shutil

    from safetensors.torch import load_file, save_file

    from clover_lite.quant.pipeline import QuantizeOptions, quantize_model

    src = write_family_checkpoint(tmp_path / "src", "llada2", seed=int(torch.randint(0, 1000, ())), num_hidden_layers=2,
                                  block_size=4)
    opts = QuantizeOptions(method="gptq", group_size=32, nsamples=2, seqlen=32, act_order=act_order)
    ours = quantize_model(src, tmp_path / "ours", opts).out
    tensors = {}
    for f in sorted(ours.glob("*.safetensors")):
        tensors.update(load_file(f))
    fused = {}
    for name, t in tensors.items():
        if ".self_attn.q_proj." not in name:
            if ".self_attn.k_proj." not in name and ".self_attn.v_proj." not in name:
                fused[name] = t
            continue
        head, kind = name.split(".self_attn.q_proj.")
        parts = [tensors[f"{head}.self_attn.{p}.{kind}"] for p in ("q_proj", "k_proj", "v_proj")]
        if kind == "g_idx":  # one input, one Hessian: the three projections' act-order groups agree
            assert all(torch.equal(parts[0], p) for p in parts)
            t = parts[0]
        else:
            t = torch.cat(parts, dim=0 if kind == "bias" else 1)
        fused[f"{head}.attention.query_key_value.{kind}"] = t
    assert any(".attention.query_key_value.qweight" in n for n in fused)
    other = tmp_path / "other"
    other.mkdir()
    for f in ours.iterdir():
        if not f.name.startswith("model") and f.is_file():
            shutil.copy(f, other / f.name)
    save_file(fused, str(other / "model.safetensors"), metadata={"format": "pt"})
    a, b = clover_lite.load(ours, device="cpu"), clover_lite.load(other, device="cpu")
    ids = torch.randint(0, 256, (1, 11))
    with torch.no_grad():
        torch.testing.assert_close(b.model(ids, block_size=4), a.model(ids, block_size=4), atol=0, rtol=0)
