"""The typed config of a DiffusionGemma checkpoint (model_type `diffusion_gemma`), text path only.

Read from the Hugging Face config.json as transformers 5.24 writes it: the top level holds the canvas length
and the image token ids, `text_config` the Gemma-4 text stack. Gemma-4 layers come in two kinds: sliding
attention (`head_dim`, `num_key_value_heads`, default RoPE) and full attention (`global_head_dim`,
`num_global_key_value_heads`, proportional RoPE, keys doubling as values). A saved config carries the
full-attention sizes as `per_layer_config` overrides; a hand-written one may use the two `global_*` keys.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clover_lite.errors import ConfigError

MODEL_TYPES = ("diffusion_gemma",)
LAYER_TYPES = ("sliding_attention", "full_attention")
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")

# transformers' defaults for a text config that leaves them out (configuration_diffusion_gemma.py).
_ROPE_DEFAULTS = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class LayerShape:
    """The attention shape of one layer kind."""

    head_dim: int
    num_key_value_heads: int
    rope_type: str  # "default" or "proportional"
    rope_theta: float
    partial_rotary_factor: float
    rope_factor: float = 1.0


@dataclass(frozen=True)
class DiffusionGemmaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_types: tuple[str, ...]
    sliding: LayerShape
    full: LayerShape
    sliding_window: int
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    final_logit_softcapping: float | None = 30.0
    attention_bias: bool = False
    max_position_embeddings: int = 131_072
    canvas_length: int = 256
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    bos_token_id: int | None = 2
    image_token_id: int | None = 258_880
    boi_token_id: int | None = 255_999
    eoi_token_id: int | None = 258_882
    model_type: str = "diffusion_gemma"

    def shape(self, layer: int) -> LayerShape:
        return self.sliding if self.layer_types[layer] == "sliding_attention" else self.full

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)


def is_diffusion_gemma(raw: dict[str, Any]) -> bool:
    return raw.get("model_type") in MODEL_TYPES


def is_diffusion_gemma_dir(path: str | Path) -> bool:
    """Whether path/config.json names DiffusionGemma (an unreadable one is left to the reader that loads it)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and is_diffusion_gemma(raw)


def load_diffusion_gemma_config(path: str | Path) -> DiffusionGemmaConfig:
    """Parse `path`/config.json (or a config.json path itself)."""
    file = Path(path)
    file = file / "config.json" if file.is_dir() else file
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: cannot read config.json ({e})") from e
    return diffusion_gemma_config_from_dict(raw, source=str(file))


def _int(d: dict, key: str, source: str, default: Any = ConfigError) -> int:
    v = d.get(key, default)
    if v is ConfigError:
        raise ConfigError(f"{source}: text_config lacks '{key}'; is this a DiffusionGemma config.json?")
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{source}: '{key}' must be a positive integer, got {json.dumps(v)[:40]}")
    return v


def _ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return (v,) if isinstance(v, int) else tuple(int(x) for x in v)


def _layer_shape(rope: dict, kind: str, head_dim: int, kv_heads: int, source: str) -> LayerShape:
    params = rope.get(kind) or _ROPE_DEFAULTS[kind]
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise ConfigError(f"{source}: {kind} RoPE type '{rope_type}' is not supported (default or proportional)")
    return LayerShape(head_dim=head_dim, num_key_value_heads=kv_heads, rope_type=rope_type,
                      rope_theta=float(params.get("rope_theta", _ROPE_DEFAULTS[kind]["rope_theta"])),
                      partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
                      rope_factor=float(params.get("factor", 1.0)))


def diffusion_gemma_config_from_dict(raw: dict[str, Any], source: str = "config.json") -> DiffusionGemmaConfig:
    """The typed config of a DiffusionGemma config.json (its dict); ConfigError naming what is wrong."""
    if not is_diffusion_gemma(raw):
        raise ConfigError(f"{source}: model_type {raw.get('model_type')!r} is not diffusion_gemma")
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: a diffusion_gemma config needs a 'text_config' object")
    if text.get("use_bidirectional_attention") == "all":
        # transformers then runs the encoder bidirectionally with a halved window; no released checkpoint does
        raise ConfigError(f"{source}: use_bidirectional_attention='all' is not supported (text encoder is causal)")
    act = text.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise ConfigError(f"{source}: hidden_activation '{act}' is not supported ({', '.join(ACTIVATIONS)})")
    n_layers = _int(text, "num_hidden_layers", source)
    heads = _int(text, "num_attention_heads", source)
    layer_types = text.get("layer_types")
    if layer_types is None:  # transformers' default: five sliding layers then one full
        layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)]
    layer_types = list(layer_types)
    if len(layer_types) != n_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ConfigError(f"{source}: layer_types must list {n_layers} of {', '.join(LAYER_TYPES)}")
    layer_types[-1] = "full_attention"  # transformers forces the last layer to full attention

    head_dim = _int(text, "head_dim", source, 256)
    kv_heads = _int(text, "num_key_value_heads", source, 4)
    # Full-attention sizes: per_layer_config overrides (as saved) win over the global_* keys (hand-written).
    g_head_dim = _int(text, "global_head_dim", source, 512)
    g_kv = text.get("num_global_key_value_heads")
    g_kv = kv_heads if g_kv is None else _int(text, "num_global_key_value_heads", source)
    overrides = text.get("per_layer_config") or {}
    full_idx = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    seen = {json.dumps(overrides.get(str(i), overrides.get(i, {})), sort_keys=True) for i in full_idx}
    if len(seen) > 1:
        raise ConfigError(f"{source}: full-attention layers with different per_layer_config are not supported")
    first = overrides.get(str(full_idx[0]), overrides.get(full_idx[0])) if overrides else None
    if first:
        g_head_dim = _int(first, "head_dim", source, head_dim)
        g_kv = _int(first, "num_key_value_heads", source, kv_heads)
    for i in range(n_layers):
        if i not in full_idx and (overrides.get(str(i)) or overrides.get(i)):
            raise ConfigError(f"{source}: per_layer_config overrides a sliding layer ({i}); not supported")
    for kv, what in ((kv_heads, "num_key_value_heads"), (g_kv, "full-attention key/value heads")):
        if heads % kv:
            raise ConfigError(f"{source}: num_attention_heads {heads} is not a multiple of {what} {kv}")

    rope = text.get("rope_parameters") or {}
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if not text.get(key):
            raise ConfigError(f"{source}: text_config lacks '{key}': every DiffusionGemma layer has an MoE block")
    top_k, experts = _int(text, "top_k_experts", source), _int(text, "num_experts", source)
    if top_k > experts:
        raise ConfigError(f"{source}: top_k_experts {top_k} exceeds num_experts {experts}")
    cap = text.get("final_logit_softcapping", 30.0)
    return DiffusionGemmaConfig(
        vocab_size=_int(text, "vocab_size", source),
        hidden_size=_int(text, "hidden_size", source),
        intermediate_size=_int(text, "intermediate_size", source),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        layer_types=tuple(layer_types),
        sliding=_layer_shape(rope, "sliding_attention", head_dim, kv_heads, source),
        full=_layer_shape(rope, "full_attention", g_head_dim, g_kv, source),
        sliding_window=_int(text, "sliding_window", source, 512),
        num_experts=experts,
        top_k_experts=top_k,
        moe_intermediate_size=_int(text, "moe_intermediate_size", source),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        hidden_activation=act,
        final_logit_softcapping=None if cap is None else float(cap),
        attention_bias=bool(text.get("attention_bias", False)),
        max_position_embeddings=_int(text, "max_position_embeddings", source, 131_072),
        canvas_length=_int(raw, "canvas_length", source, 256),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        pad_token_id=text.get("pad_token_id", 0),
        # the released config.json lists the turn end beside EOS at the top level
        eos_token_ids=_ids(raw["eos_token_id"] if raw.get("eos_token_id") is not None else text.get("eos_token_id", 1)),
        bos_token_id=text.get("bos_token_id", 2),
        image_token_id=raw.get("image_token_id", 258_880),
        boi_token_id=raw.get("boi_token_id", 255_999),
        eoi_token_id=raw.get("eoi_token_id", 258_882),
    )
