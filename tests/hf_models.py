"""Tiny random transformers models (test-only reference implementations) saved in Hugging Face layout."""

from __future__ import annotations

import torch

TEXT_KW = dict(
    vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
    max_position_embeddings=512,
)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Perturb every parameter (norms, decays and router included) so none sits at a neutral init."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.0, 2.5, generator=gen))
        elif "norm" in name or name.endswith("dt_bias"):
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(0.08 * torch.randn(p.shape, generator=gen))


def qwen3_5_moe_causal(path, seed: int = 0, **overrides):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(**{**TEXT_KW, **overrides})
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    return model


def qwen3_5_moe_multimodal(path, seed: int = 0):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    cfg = Qwen3_5MoeConfig(text_config=dict(TEXT_KW), vision_config=vision)
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    return model


def qwen3_next_causal(path, seed: int = 0, **overrides):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    kw = {**TEXT_KW, "intermediate_size": 40, "decoder_sparse_step": 1, "mlp_only_layers": [1], **overrides}
    cfg = Qwen3NextConfig(**kw)
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(cfg).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    return model
