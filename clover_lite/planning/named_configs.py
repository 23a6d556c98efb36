"""Models a plan or a benchmark can name without a checkpoint: `clover bench --config NAME`, `clover info NAME`."""

from __future__ import annotations

from typing import Any

from clover_lite.errors import CloverError
from clover_lite.models.config import ModelConfig, config_from_dict


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


def _tiny() -> dict[str, Any]:
    from clover_lite.checkpoint.tiny import tiny_config

    return tiny_config()


NAMED_CONFIGS = {"tiny": _tiny, "clover-35b-a3b": clover_35b_a3b_config}


def named_config(name: str) -> ModelConfig:
    if name not in NAMED_CONFIGS:
        raise CloverError(f"unknown config '{name}'; known: {', '.join(NAMED_CONFIGS)}")
    return config_from_dict(NAMED_CONFIGS[name](), source=name)
