"""`clover info` on a DiffusionGemma model: its architecture rows (the plan tables are the block denoisers')."""

from __future__ import annotations

from clover_lite.cli.common import count_label, layer_pattern
from clover_lite.models.diffusion_gemma_config import DiffusionGemmaConfig
from clover_lite.planning.diffusion_gemma import parameter_counts

FULL_OR_SLIDING = {"full_attention": ("F", "full"), "sliding_attention": ("S", "sliding")}


def info_rows(c: DiffusionGemmaConfig, weights: str) -> list[tuple[str, str]]:
    """(label, value) rows describing the model; `weights` says what the checkpoint's files hold."""
    total, active = parameter_counts(c)
    s, f = c.sliding, c.full
    return [
        ("model type", f"{c.model_type} (text path: an encoder over the committed text, a canvas decoder)"),
        ("parameters", f"{count_label(total)} total, {count_label(active)} active per token (text model)"),
        ("layers", f"{c.num_hidden_layers}: {layer_pattern(c.layer_types, FULL_OR_SLIDING)}"
                   + ("" if c.tie_word_embeddings else "; encoder stored apart (untied)")),
        ("hidden size", str(c.hidden_size)),
        ("attention", f"{c.num_attention_heads} q heads; sliding: {s.num_key_value_heads} kv heads of {s.head_dim}, "
                      f"window {c.sliding_window}; full: {f.num_key_value_heads} kv heads of {f.head_dim}, keys as "
                      "values"),
        ("MLP", f"dense GELU {c.intermediate_size} beside {c.num_experts} experts of {c.moe_intermediate_size}, "
                f"top-{c.top_k_experts}"),
        ("vocabulary", f"{c.vocab_size}" + (" (tied lm_head)" if c.tie_word_embeddings else "")),
        ("context", str(c.max_position_embeddings)),
        ("canvas", f"{c.canvas_length} positions per canvas"),
        ("weights", weights),
    ]
