"""Tiny random block-diffusion checkpoints in the real Hugging Face layout.

What `clover tiny DIR` writes and what the tests load: a `clover_moe` config (Qwen3.5-MoE backbone
with GDN and gated-attention layers, experts and a shared expert), random weights, and a byte-level
tokenizer with a mask token and a ChatML template. Random weights produce random text: this is for
trying the runtime and testing it, not for reading the output.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from clover_lite.checkpoint.random_weights import init_random_
from clover_lite.checkpoint.save import save_checkpoint
from clover_lite.models.config import config_from_dict
from clover_lite.models.denoiser import Denoiser
from clover_lite.tokenizer.byte_tokenizer import DEFAULT_SPECIALS, write_byte_tokenizer


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """config.json contents of a tiny clover_moe model (vocab: 256 bytes + the special tokens)."""
    specials = DEFAULT_SPECIALS
    cfg: dict[str, Any] = {
        "architectures": ["CloverMoeForBlockDiffusion"],
        "model_type": "clover_moe",
        "vocab_size": 256 + len(specials),
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "eos_token_id": 256 + specials.index("<|im_end|>"),
        "pad_token_id": 256 + specials.index("<|endoftext|>"),
        "mask_token_id": 256 + specials.index("<|mask|>"),
        "block_size": 4,
        "dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def init_random(model: Denoiser, seed: int = 0, std: float = 0.02) -> Denoiser:
    """Random weights (see clover_lite.random_weights), deterministic for a seed."""
    return init_random_(model, seed, std)


def write_tiny_checkpoint(
    out: str | os.PathLike,
    seed: int = 0,
    max_shard_bytes: int | None = None,
    force: bool = False,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random clover_moe checkpoint with tokenizer files to `out` (atomically)."""
    cfg_json = tiny_config(**config_overrides)
    config = config_from_dict(cfg_json)
    model = init_random(Denoiser(config).float(), seed)
    return save_checkpoint(
        model, out, cfg_json, dtype=torch.float32, max_shard_bytes=max_shard_bytes,
        extra_files=lambda d: write_byte_tokenizer(d), force=force, kind="tiny",
    )
