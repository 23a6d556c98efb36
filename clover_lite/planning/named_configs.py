"""Models a plan or a benchmark can name without a checkpoint: `clover bench --config NAME`, `clover info NAME`."""

from __future__ import annotations

from typing import Any

from clover_lite.errors import CloverError
from clover_lite.models.config import ModelConfig, config_from_dict
from clover_lite.models.diffusion_gemma_config import DiffusionGemmaConfig, diffusion_gemma_config_from_dict


def clover_35b_a3b_config() -> dict[str, Any]:
    """config.json of the Clover-35B-A3B class: the Qwen3.5-35B-A3B text backbone (docs/ARCHITECTURE.md section 1)
    plus block diffusion (block 32, a mask token). For planning and random-weight benchmarks: the mask and
    EOS ids are placeholders in Qwen3.5's special-token range; a real checkpoint's config.json says which."""
    n = 40
    return {
        "model_type": "clover_moe",
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": n,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "eos_token_id": 248046,
        "pad_token_id": 248044,
        "mask_token_id": 248319,
        "block_size": 32,
        "dtype": "bfloat16",
    }


# SDAR keeps the architecture of the Qwen3 model it is trained from: JetLM/SDAR-4B-Chat's config.json is
# Qwen3-4B's with model_type "sdar" (max_position_embeddings 32768, eos 151643, no block or mask keys); the
# sizes below are the published Qwen3-8B and Qwen3-30B-A3B config.json values that SDAR-8B-Chat and
# SDAR-30B-A3B-Chat are built on (model_type "sdar_moe" as SGLang / LMDeploy read it). Block 4 and mask
# 151669 (`<|MASK|>`) are the family's defaults (models/config.py FAMILY_DEFAULTS).
def sdar_8b_config() -> dict[str, Any]:
    """config.json of JetLM/SDAR-8B-Chat (Qwen3-8B: 36 layers of GQA 32 q / 8 kv heads of 128, SwiGLU 12288)."""
    return {
        "architectures": ["SDARForCausalLM"],
        "model_type": "sdar",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "torch_dtype": "bfloat16",
    }


def sdar_30b_a3b_config() -> dict[str, Any]:
    """config.json of JetLM/SDAR-30B-A3B-Chat (Qwen3-30B-A3B: 48 layers of GQA 32 q / 4 kv heads of 128;
    128 experts of 768, top-8 renormalised, no shared expert)."""
    return {
        "architectures": ["SDARMoeForCausalLM"],
        "model_type": "sdar_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "torch_dtype": "bfloat16",
    }


def _llada2(**sizes: Any) -> dict[str, Any]:
    cfg = {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        "vocab_size": 157184,
        "head_dim": 128,
        "hidden_act": "silu",
        "use_qkv_bias": False,
        "use_bias": False,
        "use_qk_norm": True,
        "norm_head": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 600000,
        "rope_scaling": None,
        "partial_rotary_factor": 0.5,
        "rotary_dim": 64,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "moe_router_enable_expert_bias": True,
        "score_function": "sigmoid",
        "tie_word_embeddings": False,
        "pad_token_id": 156892,
        "dtype": "bfloat16",
    }
    return {**cfg, **sizes}


def llada2_1_mini_config() -> dict[str, Any]:
    """config.json of inclusionAI/LLaDA2.1-mini (16B-A1.4B), as published on its model page: 20 layers (the
    first dense, 5120 wide), GQA 16 q / 4 kv heads of 128 with RoPE on 64 dims, 256 experts of 512 top-8 in
    8 groups (best 4) plus one shared expert."""
    return _llada2(hidden_size=2048, intermediate_size=5120, moe_intermediate_size=512, num_hidden_layers=20,
                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768)


def llada2_flash_config() -> dict[str, Any]:
    """config.json of inclusionAI/LLaDA2.0-flash (100B-A6.1B), as inclusionAI/dFactory's
    configs/model_configs/llada2_flash/config.json gives it: 32 layers (the first dense, 9216 wide), GQA 32 q /
    4 kv heads of 128, 256 experts of 1024 top-8 plus one shared expert."""
    return _llada2(hidden_size=4096, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=16384)


def _tiny() -> dict[str, Any]:
    from clover_lite.checkpoint.tiny import tiny_config

    return tiny_config()


def diffusiongemma_26b_a4b_config() -> dict[str, Any]:
    """config.json (text path) of google/diffusiongemma-26B-A4B-it as its published config gives it: 30 Gemma-4
    layers of 2816 (five sliding, window 1024, 16 q / 8 kv heads of 256, then one full, 16 q / 2 kv heads of
    512 with keys as values), a dense GELU MLP of 2112 beside 128 GELU experts of 704 top-8, vocabulary 262,144
    tied, canvas 256. Keys as values (`attention_k_eq_v`, no v_proj in full layers) is what transformers 5.24
    builds and the only choice the published bf16 size allows (planning/diffusion_gemma.py; tests)."""
    n = 30
    text = {
        "model_type": "diffusion_gemma_text",
        "vocab_size": 262144,
        "hidden_size": 2816,
        "intermediate_size": 2112,
        "num_hidden_layers": n,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)],
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "num_global_key_value_heads": 2,
        "head_dim": 256,
        "global_head_dim": 512,
        "attention_k_eq_v": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "moe_intermediate_size": 704,
        "num_experts": 128,
        "top_k_experts": 8,
        "sliding_window": 1024,
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
    }
    return {"model_type": "diffusion_gemma", "architectures": ["DiffusionGemmaForBlockDiffusion"], "canvas_length": 256,
            "tie_word_embeddings": True, "text_config": text, "dtype": "bfloat16"}


NAMED_CONFIGS = {"tiny": _tiny, "clover-35b-a3b": clover_35b_a3b_config, "sdar-8b": sdar_8b_config,
                 "sdar-30b-a3b": sdar_30b_a3b_config, "llada2.1-mini": llada2_1_mini_config,
                 "llada2-flash": llada2_flash_config}
# DiffusionGemma is not a block denoiser (its own config, model and plan: docs/ARCHITECTURE.md section 11), so
# its names live apart: `clover info` and `clover_lite.plan` take them, `clover bench --config` does not.
DIFFUSION_GEMMA_CONFIGS = {"diffusiongemma-26b-a4b": diffusiongemma_26b_a4b_config}


def named_config(name: str) -> ModelConfig:
    if name not in NAMED_CONFIGS:
        if name in DIFFUSION_GEMMA_CONFIGS:
            raise CloverError(f"'{name}' is a DiffusionGemma config: `clover info {name}` and clover_lite.plan take "
                              "it; this command runs block denoisers only")
        raise CloverError(f"unknown config '{name}'; known: {', '.join([*NAMED_CONFIGS, *DIFFUSION_GEMMA_CONFIGS])}")
    return config_from_dict(NAMED_CONFIGS[name](), source=name)


def named_diffusion_gemma_config(name: str) -> DiffusionGemmaConfig:
    if name not in DIFFUSION_GEMMA_CONFIGS:
        raise CloverError(f"unknown DiffusionGemma config '{name}'; known: {', '.join(DIFFUSION_GEMMA_CONFIGS)}")
    return diffusion_gemma_config_from_dict(DIFFUSION_GEMMA_CONFIGS[name](), source=name)
