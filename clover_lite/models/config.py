"""One typed config for every supported checkpoint family, read from a Hugging Face config.json.

Supported model types: `qwen3_5_moe` (multimodal wrapper, its `text_config` is used), `qwen3_5_moe_text`,
`qwen3_next`, and `clover_moe` (the Qwen3.5-MoE backbone plus the block-diffusion keys `block_size` and
`mask_token_id`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clover_lite.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "clover_moe")

# Keys without a sensible default: a checkpoint lacking one is not a model we can build.
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" (GDN) or "full_attention" per layer
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    # Gated DeltaNet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # MLP / MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    intermediate_size: int = 0  # dense SwiGLU layers (qwen3_next mlp_only_layers / decoder_sparse_step)
    mlp_types: tuple[str, ...] = ()  # "moe" or "dense" per layer
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    # tokens and block diffusion
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    mask_token_id: int | None = None
    block_size: int | None = None  # the block size the model was trained with, when it says
    torch_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d


def _require(cfg: dict, key: str, source: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{source}: required key '{key}' is missing; is this a complete Hugging Face config.json?")
    return cfg[key]


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def config_from_dict(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from the parsed config.json dictionary; `source` names it in errors."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level")
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source}: no 'model_type' key; clover-lite reads {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: unknown model_type '{model_type}'. clover-lite runs {', '.join(SUPPORTED_MODEL_TYPES)}; "
            "convert the checkpoint to one of these or open an issue for the architecture."
        )

    outer = raw
    cfg = raw
    if "text_config" in raw and raw["text_config"] is not None:
        if not isinstance(raw["text_config"], dict):
            raise ConfigError(f"{source}: 'text_config' must be a JSON object")
        # Token ids and diffusion keys may live on either level; the text config wins.
        cfg = {**{k: v for k, v in raw.items() if k != "text_config"}, **raw["text_config"]}
    elif model_type == "qwen3_5_moe":
        raise ConfigError(f"{source}: model_type 'qwen3_5_moe' needs a 'text_config' section")

    for key in REQUIRED_KEYS:
        _require(cfg, key, source)
    n_layers = int(cfg["num_hidden_layers"])
    hidden = int(cfg["hidden_size"])
    n_heads = int(cfg["num_attention_heads"])

    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers:
        raise ConfigError(
            f"{source}: 'layer_types' has {len(layer_types)} entries but num_hidden_layers is {n_layers}"
        )
    bad = sorted({t for t in layer_types if t not in ("linear_attention", "full_attention")})
    if bad:
        raise ConfigError(f"{source}: unknown layer type(s) {bad}; expected 'linear_attention' or 'full_attention'")

    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10_000_000.0)))
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"{source}: rope_type '{rope_type}' is not supported (only default / text-only mRoPE)")

    num_experts = int(cfg.get("num_experts", 0) or 0)
    if model_type == "qwen3_next":
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        mlp_types = tuple(
            "moe" if (i not in mlp_only and num_experts > 0 and (i + 1) % step == 0) else "dense"
            for i in range(n_layers)
        )
    else:
        mlp_types = tuple("moe" if num_experts > 0 else "dense" for _ in range(n_layers))
    if "moe" in mlp_types:
        for key in ("num_experts_per_tok", "moe_intermediate_size"):
            _require(cfg, key, source)
        if int(cfg["num_experts_per_tok"]) > num_experts:
            raise ConfigError(
                f"{source}: num_experts_per_tok ({cfg['num_experts_per_tok']}) exceeds num_experts ({num_experts})"
            )
    if "dense" in mlp_types:
        _require(cfg, "intermediate_size", source)

    if "linear_attention" in layer_types:
        for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
            _require(cfg, key, source)
        if int(cfg["linear_num_value_heads"]) % int(cfg["linear_num_key_heads"]):
            raise ConfigError(f"{source}: linear_num_value_heads must be a multiple of linear_num_key_heads")

    n_kv = int(cfg.get("num_key_value_heads") or n_heads)
    if n_heads % n_kv:
        raise ConfigError(
            f"{source}: num_attention_heads ({n_heads}) is not a multiple of num_key_value_heads ({n_kv})"
        )
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)

    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act not in ("silu", "swish"):
        raise ConfigError(f"{source}: hidden_act '{hidden_act}' is not supported (only silu)")

    eos = _as_id_tuple(cfg.get("eos_token_id"))
    block_size = cfg.get("block_size", cfg.get("block_length"))
    if block_size is not None and int(block_size) < 1:
        raise ConfigError(f"{source}: block_size must be >= 1, got {block_size}")
    if model_type == "clover_moe":
        _require(cfg, "block_size", source)
        _require(cfg, "mask_token_id", source)
    mask_id = cfg.get("mask_token_id")
    if mask_id is not None and not 0 <= int(mask_id) < int(cfg["vocab_size"]):
        raise ConfigError(f"{source}: mask_token_id {mask_id} is outside the vocabulary (size {cfg['vocab_size']})")

    return ModelConfig(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        layer_types=layer_types,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rope_theta=rope_theta,
        partial_rotary_factor=partial,
        attention_bias=bool(cfg.get("attention_bias", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        linear_num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
        num_experts=num_experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0) or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        intermediate_size=int(cfg.get("intermediate_size", 0) or 0),
        mlp_types=mlp_types,
        hidden_act="silu",
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(outer.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        eos_token_ids=eos,
        pad_token_id=cfg.get("pad_token_id"),
        bos_token_id=cfg.get("bos_token_id"),
        mask_token_id=None if mask_id is None else int(mask_id),
        block_size=None if block_size is None else int(block_size),
        torch_dtype=cfg.get("dtype", cfg.get("torch_dtype")),
        extra={"raw": raw},
    )


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read `path/config.json` (or `path` itself if it is a file) into a ModelConfig."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.exists():
        raise ConfigError(f"{file}: not found; a model directory needs a Hugging Face config.json")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e}); the file may be truncated or corrupt") from e
    return config_from_dict(raw, source=str(file))
