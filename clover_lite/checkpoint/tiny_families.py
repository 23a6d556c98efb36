"""Tiny random checkpoints of the other block-diffusion families, in their Hub layout.

`write_family_checkpoint(out, "sdar" | "sdar_moe" | "llada2")` writes what the family's published checkpoints
hold, at toy sizes: config.json with the family's model_type and keys (SDAR: a Qwen3 / Qwen3-MoE config
with no block-diffusion keys, as JetLM/SDAR-*-Chat ship; LLaDA2: a BailingMoeV2 config as
inclusionAI/LLaDA2.1-mini ships, first layer dense, grouped sigmoid routing with expert bias, a shared
expert), generation_config.json with the EOS ids, safetensors under the Hub names (SDAR: Qwen's, experts per
expert; LLaDA2: word_embeddings, attention.query_key_value / dense / query_layernorm / key_layernorm,
mlp.shared_experts, mlp.gate.expert_bias), and a byte-level tokenizer whose mask token is the family's
(`<|MASK|>` / `<|mask|>`). Neither config names a mask id or block size: the family defaults and the
tokenizer supply them, as for the real checkpoints. Random weights: for tests, not for reading the output.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from clover_lite.checkpoint.names import hub_layout
from clover_lite.checkpoint.output import save_tensors, write_directory
from clover_lite.checkpoint.random_weights import init_random_
from clover_lite.checkpoint.save import checkpoint_tensors
from clover_lite.models.config import config_from_dict
from clover_lite.models.denoiser import Denoiser
from clover_lite.tokenizer.byte_tokenizer import write_byte_tokenizer

FAMILY_KINDS = ("sdar", "sdar_moe", "llada2")

SDAR_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
LLADA2_SPECIALS = ["<|endoftext|>", "<role>", "</role>", "<|role_end|>", "<|mask|>"]
# LLaDA2's chat format: <role>HUMAN</role>...<|role_end|><role>ASSISTANT</role>
LLADA2_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<role>' + message['role'] | upper + '</role>' + message['content'] + '<|role_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<role>ASSISTANT</role>' }}{% endif %}"
)


def sdar_config(moe: bool = False, **overrides: Any) -> dict[str, Any]:
    """config.json of a tiny SDAR (Qwen3) or SDAR-MoE (Qwen3-MoE) model; vocab: 256 bytes + SDAR_SPECIALS."""
    cfg: dict[str, Any] = {
        "architectures": ["SDARMoeForCausalLM" if moe else "SDARForCausalLM"],
        "model_type": "sdar_moe" if moe else "sdar",
        "vocab_size": 256 + len(SDAR_SPECIALS),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 256,  # <|endoftext|>, as SDAR's config.json; generation_config.json adds <|im_end|>
        "torch_dtype": "float32",
    }
    if moe:
        cfg.update({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
                    "decoder_sparse_step": 1, "mlp_only_layers": [1]})
    cfg.update(overrides)
    return cfg


def llada2_config(**overrides: Any) -> dict[str, Any]:
    """config.json of a tiny LLaDA2 (BailingMoeV2) model; vocab: 256 bytes + LLADA2_SPECIALS."""
    cfg: dict[str, Any] = {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        "vocab_size": 256 + len(LLADA2_SPECIALS),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "use_qkv_bias": False,
        "use_bias": False,
        "use_qk_norm": True,
        "norm_head": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 600000,
        "rope_scaling": None,
        "partial_rotary_factor": 0.5,
        "rotary_dim": 8,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "moe_router_enable_expert_bias": True,
        "score_function": "sigmoid",
        "router_dtype": "fp32",
        "pad_token_id": 256,
        "dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def family_config(kind: str, **overrides: Any) -> dict[str, Any]:
    if kind not in FAMILY_KINDS:
        raise ValueError(f"unknown family '{kind}'; one of {', '.join(FAMILY_KINDS)}")
    return llada2_config(**overrides) if kind == "llada2" else sdar_config(kind == "sdar_moe", **overrides)


def _tokenizer_files(kind: str):
    def write(d: Path) -> None:
        if kind == "llada2":
            write_byte_tokenizer(d, LLADA2_SPECIALS, LLADA2_TEMPLATE, eos_token="<|endoftext|>",
                                 mask_token="<|mask|>")
            eos = [256 + LLADA2_SPECIALS.index(t) for t in ("<|endoftext|>", "<|role_end|>")]
        else:
            write_byte_tokenizer(d, SDAR_SPECIALS, eos_token="<|im_end|>", mask_token="<|MASK|>")
            eos = [256 + SDAR_SPECIALS.index(t) for t in ("<|im_end|>", "<|endoftext|>")]
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": 256}, indent=2))

    return write


@torch.no_grad()
def write_family_checkpoint(out: str | os.PathLike, kind: str, seed: int = 0, force: bool = False,
                            **config_overrides: Any) -> Path:
    """Write a tiny random `kind` checkpoint ("sdar", "sdar_moe", "llada2") in its Hub layout, with
    tokenizer and generation_config.json, to `out` (atomically; checkpoint/output.py's rules)."""
    cfg_json = family_config(kind, **config_overrides)
    config = config_from_dict(cfg_json, source=f"tiny {kind}")
    model = init_random_(Denoiser(config).float(), seed)

    def write(tmp: Path) -> None:
        tensors = dict(hub_layout(config, checkpoint_tensors(model, torch.float32)))
        save_tensors(tensors, tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2))
        _tokenizer_files(kind)(tmp)

    return write_directory(out, write, "tiny", force=force)
