"""Tiny random DiffusionGemma checkpoints in the Hub layout transformers 5.24 reads and writes.

`write_tiny_diffusion_gemma(out)` writes config.json (model_type `diffusion_gemma`, a Gemma-4 `text_config`
with sliding and full-attention layers, the full layers' sizes as `global_head_dim` /
`num_global_key_value_heads` as the released config.json has them, and a tiny `vision_config`, whose tower
holds no weights here: this is the text path), model.safetensors under the Hub names (decoder weights,
encoder and decoder layer scalars, the self-conditioning MLP; encoder tied to the decoder),
generation_config.json (the entropy-bound sampler and EOS ids) and a byte-level tokenizer with Gemma's special
tokens and turn template. Random weights: for tests and benchmarks, not for reading the output.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from clover_lite.checkpoint.diffusion_gemma_weights import hub_name
from clover_lite.checkpoint.output import save_tensors, write_directory
from clover_lite.checkpoint.random_weights import init_random_
from clover_lite.models.diffusion_gemma import DiffusionGemma
from clover_lite.models.diffusion_gemma_config import diffusion_gemma_config_from_dict
from clover_lite.tokenizer.byte_tokenizer import write_byte_tokenizer

SPECIALS = ["<pad>", "<eos>", "<bos>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
            "<image_soft_token>", "<end_of_image>"]
TEMPLATE = (
    "{{ '<bos>' }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' "
    "+ message['content'] + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def special_id(token: str) -> int:
    return 256 + SPECIALS.index(token)


def tiny_config(canvas_length: int = 8, tie_word_embeddings: bool = True, **text: Any) -> dict[str, Any]:
    """config.json of a tiny DiffusionGemma; `text` overrides text_config keys. The full layers' sizes are
    `global_head_dim` / `num_global_key_value_heads`, as the released config.json has them (transformers'
    save_pretrained writes them as per_layer_config instead; both are read)."""
    t: dict[str, Any] = {
        "model_type": "diffusion_gemma_text",
        "vocab_size": 256 + len(SPECIALS),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        "sliding_window": 8,
        "num_experts": 8,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": 30.0,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        "attention_bias": False,
        "use_bidirectional_attention": "vision",
        "tie_word_embeddings": True,
        "pad_token_id": special_id("<pad>"),
        "eos_token_id": special_id("<eos>"),
        "bos_token_id": special_id("<bos>"),
    }
    t.update({"global_head_dim": 32, "num_global_key_value_heads": 1, **text})
    t["layer_types"] = [*t["layer_types"][:-1], "full_attention"]  # transformers forces the last layer full
    vision = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8}
    return {
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "model_type": "diffusion_gemma",
        "canvas_length": canvas_length,
        "tie_word_embeddings": tie_word_embeddings,
        "image_token_id": special_id("<image_soft_token>"),
        "boi_token_id": special_id("<start_of_image>"),
        "eoi_token_id": special_id("<end_of_image>"),
        "eos_token_id": [special_id("<eos>"), special_id("<end_of_turn>")],
        "text_config": t,
        "vision_config": vision,
        "dtype": "float32",
    }


def generation_config(max_denoising_steps: int = 8) -> dict[str, Any]:
    return {
        "max_new_tokens": 64,
        "max_denoising_steps": max_denoising_steps,
        "sampler_config": {"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig"},
        "t_min": 0.4,
        "t_max": 0.8,
        "stability_threshold": 1,
        "confidence_threshold": 0.005,
        "eos_token_id": [special_id("<eos>"), special_id("<end_of_turn>")],
        "pad_token_id": special_id("<pad>"),
        "bos_token_id": special_id("<bos>"),
    }


@torch.no_grad()
def randomize_(model: DiffusionGemma, seed: int) -> DiffusionGemma:
    """Random weights with every scale away from its neutral value: norms and router scales near 1, layer
    scalars in [0.5, 1.5] (encoder's and decoder's differ)."""
    init_random_(model, seed, std=0.05)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith(("router.scale", "per_expert_scale")):
            t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=gen))
        elif name.endswith("layer_scalar"):
            t.copy_(torch.empty(t.shape).uniform_(0.5, 1.5, generator=gen))
    return model


def hub_tensors(model: DiffusionGemma, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint names (layer scalars as one [1] tensor per layer)."""
    out = {hub_name(n): p.detach().to(dtype).contiguous() for n, p in model.named_parameters()}
    for which in ("encoder", "decoder"):
        scalars = getattr(model, f"{which}_layer_scalar")
        for i in range(model.config.num_hidden_layers):
            out[hub_name(f"{which}_layer_scalar.{i}")] = scalars[i : i + 1].detach().to(dtype).clone()
    return out


def write_tiny_diffusion_gemma(out: str | os.PathLike, seed: int = 0, force: bool = False,
                               canvas_length: int = 8, tie_word_embeddings: bool = True,
                               max_denoising_steps: int = 8, **text: Any) -> Path:
    """Write a tiny random DiffusionGemma checkpoint to `out` (atomically; checkpoint/output.py's rules)."""
    cfg_json = tiny_config(canvas_length, tie_word_embeddings, **text)
    config = diffusion_gemma_config_from_dict(cfg_json, source="tiny diffusion_gemma")
    model = randomize_(DiffusionGemma(config).float(), seed)

    def write(tmp: Path) -> None:
        save_tensors(hub_tensors(model), tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(max_denoising_steps), indent=2))
        write_byte_tokenizer(tmp, SPECIALS, TEMPLATE, eos_token="<end_of_turn>", mask_token="<mask>")

    return write_directory(out, write, "tiny", force=force)
