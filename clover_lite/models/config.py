"""One typed config for every supported checkpoint family, read from a Hugging Face config.json.

Supported model types: `qwen3_5_moe` (multimodal wrapper, its `text_config` is used), `qwen3_5_moe_text`,
`qwen3_next`, and `clover_moe` (the Qwen3.5-MoE backbone plus the block-diffusion keys `block_size` and
`mask_token_id`); `sdar` / `sdar_moe` (SDAR: the Qwen3 / Qwen3-MoE backbone) and `llada2_moe` (LLaDA2.x:
BailingMoeV2). Every family is built from the same parts, chosen by fields of ModelConfig (docs/ARCHITECTURE.md
section 1.3): the attention's output gate and biases, the norms' weight style, the router, the shared expert's
gate, which layers are dense. Generation defaults a checkpoint leaves out (block size, mask id, EOS ids) come
from its generation_config.json, then from the family's documented defaults (FAMILY_DEFAULTS).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clover_lite.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "clover_moe", "sdar", "sdar_moe",
                         "llada2_moe")

# model_type -> family: which defaults and checkpoint layout apply.
FAMILIES = {"qwen3_5_moe": "qwen3_5", "qwen3_5_moe_text": "qwen3_5", "qwen3_next": "qwen3_5", "clover_moe": "qwen3_5",
            "sdar": "sdar", "sdar_moe": "sdar", "llada2_moe": "llada2"}

# What a family's checkpoints leave out of config.json and their reference generation code assumes. Each
# default is used only when config.json and generation_config.json say nothing and the id is inside the
# vocabulary (a tiny test checkpoint has its own ids; its tokenizer names the mask token).
# - sdar: JetAstra/SDAR generate.py (block_length 4, mask id from the tokenizer's mask token `<|MASK|>`, EOS from
#   generation_config.json); SGLang's srt/dllm/config.py and LMDeploy's SDAR builder fix block 4 / mask 151669.
# - llada2: the inclusionAI LLaDA2.0/2.1 model cards and dInfer (block_length 32, mask_id 156895, eos_id 156892);
#   SGLang's srt/dllm/config.py: block 32 / mask 156895.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_5": {},
    "sdar": {"block_size": 4, "mask_token_id": 151669},
    "llada2": {"block_size": 32, "mask_token_id": 156895, "eos_token_ids": (156892,)},
}

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
    attention_bias: bool = False  # q/k/v projections (Qwen: every projection; LLaDA2: use_qkv_bias)
    attention_output_bias: bool = False  # o_proj (LLaDA2's `dense`: use_bias)
    attention_output_gate: bool = True  # Qwen3.5 gated attention: q_proj twice as wide, output * sigmoid(gate)
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
    # "softmax": softmax top-k (Qwen). "sigmoid_grouped" (LLaDA2): sigmoid scores, top-k chosen on score +
    # expert bias within the best `router_topk_groups` of `router_groups` groups, weights renormalised and
    # times routed_scaling_factor.
    router: str = "softmax"
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    router_expert_bias: bool = False
    shared_expert_gate: bool = True  # Qwen's shared expert sits under a sigmoid gate; LLaDA2's is added as is
    intermediate_size: int = 0  # dense SwiGLU layers (qwen3_next mlp_only_layers / decoder_sparse_step)
    mlp_types: tuple[str, ...] = ()  # "moe" or "dense" per layer
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    norm_unit_offset: bool = True  # RMSNorm scales by (1 + w) (Qwen3.5: zero-centred weights) or by w (Qwen3, LLaDA2)
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
    def family(self) -> str:
        """"qwen3_5", "sdar" or "llada2": the checkpoint layout and generation defaults."""
        return FAMILIES[self.model_type]

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


# Bounds past every released model, so a corrupt value is refused before it builds a model of 10^9 layers.
MAX_DIM, MAX_LAYERS, MAX_VOCAB, MAX_POSITIONS = 1 << 18, 4096, 1 << 24, 1 << 31


def _int(cfg: dict, key: str, source: str, default: Any = None, lo: int = 1, hi: int = MAX_DIM) -> int:
    """cfg[key] as an int in [lo, hi] (integral floats such as 64.0 pass); `default` when absent or null."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            _require(cfg, key, source)
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{source}: '{key}' must be an integer, got {json.dumps(value)[:60]}")
    if not lo <= value <= hi:
        raise ConfigError(f"{source}: '{key}' is {value}, outside [{lo}, {hi}]; the file may be corrupt")
    return value


def _float(cfg: dict, key: str, source: str, default: float, lo: float, hi: float) -> float:
    value = cfg.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{source}: '{key}' must be a number, got {json.dumps(value)[:60]}")
    if not lo < value <= hi:
        raise ConfigError(f"{source}: '{key}' is {value}, outside ({lo}, {hi}]")
    return float(value)


def _bool(cfg: dict, key: str, source: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: '{key}' must be true or false, got {json.dumps(value)[:60]}")
    return value


def _token_ids(cfg: dict, key: str, source: str, vocab: int) -> tuple[int, ...]:
    """A token id or a list of them, each inside the vocabulary; () when absent."""
    value = cfg.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(_int({key: v}, key, source, lo=0, hi=vocab - 1) for v in values)


def _one_id(cfg: dict, key: str, source: str, vocab: int, strict: bool = True) -> int | None:
    """One token id inside the vocabulary. Not `strict` (pad, bos): an id outside it, such as the -1 that
    older configs write for "none", reads as no id."""
    value = cfg.get(key)
    if isinstance(value, list):
        raise ConfigError(f"{source}: '{key}' must be one token id, got a list")
    if not strict and isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < vocab:
        return None
    ids = _token_ids(cfg, key, source, vocab)
    return ids[0] if ids else None


def config_from_dict(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from the parsed config.json dictionary; `source` names it in errors. Every value
    is checked for its type and range: a config.json is untrusted input."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level")
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source}: no 'model_type' key; clover-lite reads {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "clover_moe" and raw.get("auto_map"):
        classes = ", ".join(sorted(str(v) for v in raw["auto_map"].values())[:3]) \
            if isinstance(raw["auto_map"], dict) else str(raw["auto_map"])[:80]
        raise ConfigError(
            f"{source}: this is the official Clover checkpoint, with its own modeling code ({classes}). Its "
            "block-diffusion parts (the GDN's clean-prefix and right convolutions, block coreset routing, semantic "
            "RoPE positions) are not public, so clover-lite cannot run them exactly and refuses the checkpoint "
            "rather than run its Qwen3.5-MoE backbone alone, which is not the model. The public block-diffusion "
            "families (SDAR, LLaDA2, DiffusionGemma) run; see README, Supported models"
        )
    if model_type == "diffusion_gemma":
        raise ConfigError(
            f"{source}: a DiffusionGemma checkpoint (an encoder-decoder, not a block denoiser): clover_lite.load(), "
            "`clover run`, `chat`, `serve`, `info`, `bench`, `quantize` and `eval` read it; this command does not "
            "read it yet"
        )
    if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: unknown model_type '{str(model_type)[:60]}'. clover-lite runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} and diffusion_gemma; convert the checkpoint to one of these or "
            "open an issue for the architecture."
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
    vocab = _int(cfg, "vocab_size", source, hi=MAX_VOCAB)
    n_layers = _int(cfg, "num_hidden_layers", source, hi=MAX_LAYERS)
    hidden = _int(cfg, "hidden_size", source)
    n_heads = _int(cfg, "num_attention_heads", source, hi=4096)

    family = FAMILIES[model_type]
    attention_only = family != "qwen3_5"  # SDAR and LLaDA2 stack attention layers only
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = _int(cfg, "full_attention_interval", source, default=4, hi=MAX_LAYERS)
        layer_types = ["full_attention" if attention_only or (i + 1) % interval == 0 else "linear_attention"
                       for i in range(n_layers)]
    if not isinstance(layer_types, list):
        raise ConfigError(f"{source}: 'layer_types' must be a list of layer type names")
    allowed = ("full_attention",) if attention_only else ("linear_attention", "full_attention")
    bad = sorted({str(t) for t in layer_types if t not in allowed})
    if bad:
        raise ConfigError(f"{source}: unknown layer type(s) {bad} for {model_type}; expected "
                          + " or ".join(f"'{t}'" for t in allowed)
                          + (" (sliding-window attention is not supported)" if attention_only else ""))
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers:
        raise ConfigError(
            f"{source}: 'layer_types' has {len(layer_types)} entries but num_hidden_layers is {n_layers}"
        )
    if attention_only and _bool(cfg, "use_sliding_window", source, False):
        raise ConfigError(f"{source}: use_sliding_window is true; clover-lite runs full attention only")

    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{source}: 'rope_parameters' must be a JSON object")
    rope_src = {**cfg, **rope}  # rope keys may sit at either level; rope_parameters wins
    # Defaults of each family's own config class: Qwen3.5 (1e7, 0.25), Qwen3Config (1e4, full RoPE),
    # LLaDA2MoeConfig (1e4, 0.5).
    theta_default, partial_default = {"qwen3_5": (10_000_000.0, 0.25), "sdar": (10_000.0, 1.0),
                                      "llada2": (10_000.0, 0.5)}[family]
    rope_theta = _float(rope_src, "rope_theta", source, theta_default, 0.0, 1e12)
    partial = _float(rope_src, "partial_rotary_factor", source, partial_default, 0.0, 1.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"{source}: rope_type {json.dumps(rope_type)[:60]} is not supported (only default / "
                          "text-only mRoPE)")

    num_experts = _int(cfg, "num_experts", source, default=0, lo=0, hi=1 << 16)
    if model_type == "sdar":
        num_experts = 0  # the dense SDAR: a Qwen3 (num_experts is not one of its keys)
    if model_type in ("qwen3_next", "sdar_moe"):
        mlp_only = cfg.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
            raise ConfigError(f"{source}: 'mlp_only_layers' must be a list of layer indices")
        step = _int(cfg, "decoder_sparse_step", source, default=1, hi=MAX_LAYERS)
        mlp_types = tuple(
            "moe" if (i not in set(mlp_only) and num_experts > 0 and (i + 1) % step == 0) else "dense"
            for i in range(n_layers)
        )
    elif model_type == "llada2_moe":
        first_dense = _int(cfg, "first_k_dense_replace", source, default=0, lo=0, hi=MAX_LAYERS)
        mlp_types = tuple("moe" if num_experts > 0 and i >= first_dense else "dense" for i in range(n_layers))
    else:
        mlp_types = tuple("moe" if num_experts > 0 else "dense" for _ in range(n_layers))
    moe = "moe" in mlp_types
    top_k = _int(cfg, "num_experts_per_tok", source, default=None if moe else 0, lo=int(moe), hi=1 << 16)
    moe_inter = _int(cfg, "moe_intermediate_size", source, default=None if moe else 0, lo=int(moe), hi=1 << 20)
    if top_k > num_experts and moe:
        raise ConfigError(f"{source}: num_experts_per_tok ({top_k}) exceeds num_experts ({num_experts})")
    dense = "dense" in mlp_types
    inter = _int(cfg, "intermediate_size", source, default=None if dense else 0, lo=int(dense), hi=1 << 20)
    if family == "llada2":
        # BailingMoeV2: num_shared_experts experts of moe_intermediate_size, fused into one ungated MLP.
        n_shared = _int(cfg, "num_shared_experts", source, default=0, lo=0, hi=64)
        shared_inter = n_shared * moe_inter if moe else 0
    else:
        shared_inter = _int(cfg, "shared_expert_intermediate_size", source, default=0, lo=0, hi=1 << 20)
    router = _router(cfg, source, family, num_experts, top_k) if moe else {}

    gdn = "linear_attention" in layer_types
    lin = {key: _int(cfg, key, source, default=None if gdn else fallback, hi=4096)
           for key, fallback in (("linear_num_key_heads", 16), ("linear_num_value_heads", 32),
                                 ("linear_key_head_dim", 128), ("linear_value_head_dim", 128))}
    if lin["linear_num_value_heads"] % lin["linear_num_key_heads"]:
        raise ConfigError(f"{source}: linear_num_value_heads must be a multiple of linear_num_key_heads")
    conv = _int(cfg, "linear_conv_kernel_dim", source, default=4, hi=64)

    n_kv = _int(cfg, "num_key_value_heads", source, default=n_heads, lo=0, hi=4096) or n_heads  # LLaDA2: 0 = MHA
    if n_heads % n_kv:
        raise ConfigError(
            f"{source}: num_attention_heads ({n_heads}) is not a multiple of num_key_value_heads ({n_kv})"
        )
    head_dim = _int(cfg, "head_dim", source, default=max(hidden // n_heads, 1), hi=4096)
    if "full_attention" in layer_types and (int(head_dim * partial) < 2 or int(head_dim * partial) % 2):
        raise ConfigError(f"{source}: head_dim {head_dim} x partial_rotary_factor {partial} gives "
                          f"{int(head_dim * partial)} rotary dims; RoPE needs an even number >= 2")
    if family == "llada2":
        qkv_bias = _bool(cfg, "use_qkv_bias", source, False)
        out_bias = _bool(cfg, "use_bias", source, True)  # LLaDA2MoeConfig's default; published configs: false
        for key, want in (("use_qk_norm", True), ("norm_head", False)):
            if _bool(cfg, key, source, want) != want:
                raise ConfigError(f"{source}: {key} = {str(not want).lower()} is not supported (every published "
                                  f"LLaDA2 checkpoint has {str(want).lower()})")
        rotary = _int(cfg, "rotary_dim", source, default=0, lo=0, hi=4096)
        if rotary and rotary != int(head_dim * partial):
            raise ConfigError(f"{source}: rotary_dim {rotary} is not head_dim {head_dim} x partial_rotary_factor "
                              f"{partial}; the modeling code rotates head_dim x partial_rotary_factor dims")
    else:
        qkv_bias = out_bias = _bool(cfg, "attention_bias", source, False)

    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act not in ("silu", "swish"):
        raise ConfigError(f"{source}: hidden_act {json.dumps(hidden_act)[:60]} is not supported (only silu)")

    defaults = FAMILY_DEFAULTS[family]
    eos = _token_ids(cfg, "eos_token_id", source, vocab)
    if not eos:
        eos = tuple(i for i in defaults.get("eos_token_ids", ()) if i < vocab)
    block_key = "block_size" if cfg.get("block_size") is not None else "block_length"
    block_size = _int(cfg, block_key, source, default=0, lo=1, hi=1 << 16) or defaults.get("block_size")
    if model_type == "clover_moe":
        _require(cfg, "block_size", source)
        _require(cfg, "mask_token_id", source)
    mask_id = cfg.get("mask_token_id")
    if mask_id is not None and isinstance(mask_id, int) and not 0 <= mask_id < vocab:
        raise ConfigError(f"{source}: mask_token_id {mask_id} is outside the vocabulary (size {vocab})")
    mask_id = _one_id(cfg, "mask_token_id", source, vocab)
    if mask_id is None and defaults.get("mask_token_id", vocab) < vocab:
        mask_id = defaults["mask_token_id"]
    dtype = cfg.get("dtype", cfg.get("torch_dtype"))
    if dtype is not None and not isinstance(dtype, str):
        raise ConfigError(f"{source}: 'dtype' must be a string such as \"bfloat16\", got {json.dumps(dtype)[:60]}")

    # Qwen3MoeConfig leaves norm_topk_prob off by default; Qwen3.5's is on. (LLaDA2 renormalises whenever
    # top-k > 1, as its modeling code does, whatever the flag says: it is true in every published config.)
    norm_topk = _bool(cfg, "norm_topk_prob", source, model_type != "sdar_moe")
    eps_default = 1e-5 if family == "llada2" else 1e-6
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        layer_types=layer_types,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rope_theta=rope_theta,
        partial_rotary_factor=partial,
        attention_bias=qkv_bias,
        attention_output_bias=out_bias,
        attention_output_gate=family == "qwen3_5",
        max_position_embeddings=_int(cfg, "max_position_embeddings", source, default=32768, hi=MAX_POSITIONS),
        **lin,
        linear_conv_kernel_dim=conv,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=shared_inter,
        norm_topk_prob=norm_topk,
        **router,
        shared_expert_gate=family != "llada2",
        intermediate_size=inter,
        mlp_types=mlp_types,
        hidden_act="silu",
        rms_norm_eps=_float(cfg, "rms_norm_eps", source, eps_default, 0.0, 1.0),
        norm_unit_offset=family == "qwen3_5",
        tie_word_embeddings=_bool(outer if "tie_word_embeddings" in outer else cfg, "tie_word_embeddings", source,
                                  False),
        eos_token_ids=eos,
        pad_token_id=_one_id(cfg, "pad_token_id", source, vocab, strict=False),
        bos_token_id=_one_id(cfg, "bos_token_id", source, vocab, strict=False),
        mask_token_id=mask_id,
        block_size=block_size,
        torch_dtype=dtype,
        extra={"raw": raw},
    )


def _router(cfg: dict, source: str, family: str, num_experts: int, top_k: int) -> dict[str, Any]:
    """The router's fields: softmax top-k for Qwen; LLaDA2's sigmoid scores with expert bias, group-limited
    top-k and routed scaling (BailingMoeV2Gate)."""
    if family != "llada2":
        return {}
    score = cfg.get("score_function", "sigmoid")
    if score != "sigmoid":
        raise ConfigError(f"{source}: score_function {json.dumps(score)[:40]} is not supported (LLaDA2: sigmoid)")
    groups = _int(cfg, "n_group", source, default=1, hi=num_experts)
    topk_groups = _int(cfg, "topk_group", source, default=1, hi=groups)
    if num_experts % groups or num_experts // groups < 2:
        raise ConfigError(f"{source}: num_experts ({num_experts}) must split into n_group ({groups}) groups of at "
                          "least 2 experts (a group is scored by its two best)")
    if top_k > topk_groups * (num_experts // groups):
        raise ConfigError(f"{source}: num_experts_per_tok ({top_k}) is more than the {topk_groups} chosen groups of "
                          f"{num_experts // groups} experts hold")
    return {
        "router": "sigmoid_grouped",
        "router_groups": groups,
        "router_topk_groups": topk_groups,
        "routed_scaling_factor": _float(cfg, "routed_scaling_factor", source, 1.0, 0.0, 1e4),
        "router_expert_bias": _bool(cfg, "moe_router_enable_expert_bias", source, True),
    }


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read `path/config.json` (or `path` itself if it is a file) into a ModelConfig; a generation_config.json
    beside it adds its EOS ids and fills a block size or mask id that config.json leaves out."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.exists():
        raise ConfigError(f"{file}: not found; a model directory needs a Hugging Face config.json")
    raw = _read_json(file)
    gen_file = file.parent / "generation_config.json"
    if isinstance(raw, dict) and gen_file.is_file():
        raw = with_generation_config(raw, _read_json(gen_file), str(gen_file))
    return config_from_dict(raw, source=str(file))


def _read_json(file: Path) -> Any:
    if not file.is_file():
        raise ConfigError(f"{file}: not a file; it should be the model's JSON configuration")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e}); the file may be truncated or corrupt") from e


GENERATION_KEYS = ("block_size", "block_length", "mask_token_id")


def with_generation_config(raw: dict[str, Any], gen: Any, source: str) -> dict[str, Any]:
    """config.json's dict with what generation_config.json adds: its EOS ids after config.json's, and the
    diffusion keys config.json does not have. Values are checked where config.json's are (config_from_dict)."""
    if not isinstance(gen, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level")
    target = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    merged = dict(target)
    extra = gen.get("eos_token_id")
    if extra is not None:
        more = extra if isinstance(extra, list) else [extra]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in more):
            raise ConfigError(f"{source}: eos_token_id must be a token id or a list of them, got "
                              f"{json.dumps(extra)[:60]}")
        vocab = merged.get("vocab_size", raw.get("vocab_size"))
        more = [i for i in more if not isinstance(vocab, int) or 0 <= i < vocab]  # ids past the vocabulary: none
        own = merged.get("eos_token_id", raw.get("eos_token_id"))
        own = [] if own is None else own if isinstance(own, list) else [own]
        if more:
            merged["eos_token_id"] = list(dict.fromkeys([*own, *more])) if all(
                isinstance(i, int) and not isinstance(i, bool) for i in own) else own
    if not any(merged.get(k) is not None or raw.get(k) is not None for k in ("block_size", "block_length")):
        for key in ("block_size", "block_length"):
            if gen.get(key) is not None:
                merged[key] = gen[key]
                break
    if merged.get("mask_token_id") is None and raw.get("mask_token_id") is None:
        if gen.get("mask_token_id") is not None:
            merged["mask_token_id"] = gen["mask_token_id"]
    return {**raw, "text_config": merged} if target is not raw else merged
