"""The memory plan of a DiffusionGemma model (docs/ARCHITECTURE.md sections 6 and 11), from its config alone.

What it holds differs from a block denoiser's (planning/memory.py), so it is counted here, in the same units:

- weights: the decoder stack (and the encoder's when untied), the self-conditioning MLP, the embedding (the
  lm_head when untied) and the per-layer scalars, exactly as models/diffusion_gemma.py and, for INT4, the
  GPTQ modules checkpoint/diffusion_gemma_weights.py installs allocate them: attention q/k/v/o (full layers
  have no v), the dense MLP and the experts INT4; embeddings, norms, the router, the self-conditioning MLP
  and the lm_head 16-bit (what `clover quantize` writes);
- the prefix cache: keys and values of every committed position in full layers, and of at most the last
  `sliding_window - 1` in sliding layers (all a later query sees: what the cache keeps);
- the canvas's sampling buffers: the decoder's [canvas, vocabulary] logits and the sampler's temporaries;
- the activation workspace: an estimate (DG_WORKSPACE_FORMULA), the larger of a denoising step over the
  canvas and an encoder chunk of the prompt.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clover_lite.errors import CloverError
from clover_lite.kernels.configs import kernel_changes
from clover_lite.models.diffusion_gemma import encode_chunk
from clover_lite.models.diffusion_gemma_config import (
    DiffusionGemmaConfig,
    diffusion_gemma_config_from_dict,
    is_diffusion_gemma,
    load_diffusion_gemma_config,
)
from clover_lite.planning.devices import CUDA_CONTEXT_BYTES, Target, fmt_bytes, resolve_target
from clover_lite.planning.memory import DTYPE_NAMES, FLOAT_KINDS, QuantScheme, _add, _linear, dtype_name, parse_quant
from clover_lite.planning.memory_plan import PREFILL_CHUNK, MemoryPlan, _default_backend
from clover_lite.planning.named_configs import DIFFUSION_GEMMA_CONFIGS, named_diffusion_gemma_config


def diffusion_gemma_of(config: Any) -> tuple[DiffusionGemmaConfig, str, dict | str | None] | None:
    """(config, display name, the checkpoint's quantization or stored dtype) when `config` names a DiffusionGemma
    model (its config, a config.json dict, a named config, a model directory or its config.json), else None."""
    if isinstance(config, DiffusionGemmaConfig):
        return config, config.model_type, None
    if isinstance(config, dict):
        return (diffusion_gemma_config_from_dict(config), "diffusion_gemma", None) if is_diffusion_gemma(config) \
            else None
    if isinstance(config, str) and config in DIFFUSION_GEMMA_CONFIGS and not Path(config).exists():
        return named_diffusion_gemma_config(config), config, None
    if not isinstance(config, (str, os.PathLike)):
        return None
    p = Path(config)
    file = p / "config.json" if p.is_dir() else p
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the block denoisers' reader reports a missing or broken config.json
    if not (isinstance(raw, dict) and is_diffusion_gemma(raw)):
        return None
    from clover_lite.checkpoint.load import read_quant_config

    qc = read_quant_config(p) if p.is_dir() else None
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    stored = str(raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or "").replace("torch.", "")
    name = p.name if p.is_dir() else p.parent.name
    return load_diffusion_gemma_config(file), name, qc if qc is not None else DTYPE_NAMES.get(stored)


# ---- weights -----------------------------------------------------------------------------------
def quantized_shapes(c: DiffusionGemmaConfig) -> list[tuple[int, int]]:
    """(in, out) features of the linears `clover quantize` makes INT4, one of each kind (experts once)."""
    H, nh = c.hidden_size, c.num_attention_heads
    shapes = [(H, c.intermediate_size), (c.intermediate_size, H), (H, c.moe_intermediate_size),
              (c.moe_intermediate_size, H)]
    for s in (c.sliding, c.full):
        shapes += [(H, nh * s.head_dim), (H, s.num_key_value_heads * s.head_dim), (nh * s.head_dim, H)]
    return shapes


def fitted_scheme(c: DiffusionGemmaConfig, scheme: QuantScheme) -> QuantScheme:
    """The scheme `clover quantize` produces for this model: NF4 refused (GPTQ INT4 only), lm_head 16-bit, and a
    group size that does not divide every quantized linear replaced by the largest that does (the published
    model's 704-wide experts take 64, not 128: what the command's default picks)."""
    if scheme.kind == "nf4":
        raise CloverError("NF4 is not supported for DiffusionGemma (GPTQ INT4 or 16-bit weights)")
    if not scheme.quantized:
        return scheme
    scheme = scheme.replace(lm_head=False)
    ks = [k for k, _ in quantized_shapes(c)]
    if scheme.group_size == -1 or all(k % scheme.group_size == 0 for k in ks):
        return scheme
    from clover_lite.quant.checks import GROUP_SIZES  # what `clover quantize` picks from

    fits = [g for g in GROUP_SIZES if all(k % g == 0 for k in ks)]
    return scheme.replace(group_size=fits[0] if fits else -1)


def _stack_bytes(c: DiffusionGemmaConfig, scheme: QuantScheme, d: int, cats: dict[str, dict[str, int]]) -> None:
    """One stack (embedding, layers, final norm) into `cats`."""
    fl = "16-bit" if d == 2 else "float"
    H, nh, b = c.hidden_size, c.num_attention_heads, c.attention_bias

    def cat(name: str) -> dict[str, int]:
        return cats.setdefault(name, {})

    _add(cat("embeddings"), {fl: c.vocab_size * H * d})
    small = cat("norms, routers, layer scalars")
    _add(small, {fl: H * d})  # final norm
    for kind in c.layer_types:
        s = c.sliding if kind == "sliding_attention" else c.full
        a = cat("attention (q/k/v/o)")
        _add(a, _linear(H, nh * s.head_dim, scheme, d, True, b))
        _add(a, _linear(H, s.num_key_value_heads * s.head_dim, scheme, d, True, b),
             2 if kind == "sliding_attention" else 1)  # full layers: keys are the values (no v_proj)
        _add(a, _linear(nh * s.head_dim, H, scheme, d, True, b))
        m = cat("dense MLP")
        _add(m, _linear(H, c.intermediate_size, scheme, d, True), 2)
        _add(m, _linear(c.intermediate_size, H, scheme, d, True))
        ex = cat("routed experts")
        E, inter = c.num_experts, c.moe_intermediate_size
        _add(ex, _linear(H, inter, scheme, d, True, stack=E), 2)
        _add(ex, _linear(inter, H, scheme, d, True, stack=E))
        # 7 sandwich norms, q/k norms, the router's projection, scale and per-expert scale
        _add(small, {fl: (7 * H + 2 * s.head_dim + E * H + H + E) * d})


def weight_bytes(c: DiffusionGemmaConfig, scheme: QuantScheme, dtype: str) -> dict[str, dict[str, int]]:
    """Bytes of every weight and buffer by category and tensor kind, as the model allocates them."""
    d = FLOAT_KINDS[dtype]
    fl = "16-bit" if d == 2 else "float"
    H = c.hidden_size
    cats: dict[str, dict[str, int]] = {}
    for _ in range(1 if c.tie_word_embeddings else 2):  # the decoder, and the encoder when untied
        _stack_bytes(c, scheme, d, cats)
    if not c.tie_word_embeddings:
        _add(cats.setdefault("lm_head", {}), {fl: c.vocab_size * H * d})
    _add(cats["norms, routers, layer scalars"], {fl: 2 * c.num_hidden_layers * d})  # encoder's, decoder's
    # The self-conditioning MLP and its norm: 16-bit (run once per step on the canvas).
    _add(cats.setdefault("self-conditioning MLP", {}), {fl: (3 * H * c.intermediate_size + H) * d})
    return cats


def parameter_counts(c: DiffusionGemmaConfig) -> tuple[int, int]:
    """(total, active per token) parameters of the text model: every expert, and top_k of them."""
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size
    total = sum(v for kinds in weight_bytes(c, QuantScheme("fp32"), "fp32").values() for v in kinds.values()) // 4
    total -= 2 * c.num_hidden_layers  # the layer scalars are buffers
    stacks = 1 if c.tie_word_embeddings else 2
    idle = stacks * c.num_hidden_layers * (c.num_experts - c.top_k_experts) * per_expert
    return total, total - idle


# ---- caches, buffers, workspace ----------------------------------------------------------------
def prefix_cache_bytes(c: DiffusionGemmaConfig, dtype: str, tokens: int) -> tuple[int, int]:
    """(bytes of the full layers' keys and values, of the sliding layers') for `tokens` committed positions."""
    d = FLOAT_KINDS[dtype]
    full = sliding = 0
    for kind in c.layer_types:
        s = c.sliding if kind == "sliding_attention" else c.full
        per = 2 * s.num_key_value_heads * s.head_dim * d
        if kind == "sliding_attention":
            sliding += per * min(tokens, c.sliding_window - 1)
        else:
            full += per * tokens
    return full, sliding


def canvas_buffer_bytes(c: DiffusionGemmaConfig, dtype: str, canvas: int) -> int:
    """The [canvas, vocabulary] tensors of a step: fp32 logits, tempered logits, probabilities and three
    entropy temporaries, and the self-conditioning logits and their soft-embedding probabilities in the model
    dtype (runtime/diffusion_gemma_loop.py)."""
    return canvas * c.vocab_size * (6 * 4 + 2 * FLOAT_KINDS[dtype])


DG_WORKSPACE_FORMULA = (
    "an estimate, the larger of one denoising step (T = canvas) and one encoder\n"
    "chunk (T = chunk), S = context, d = dtype bytes, per layer kind with its\n"
    "heads and S' = S + T keys (sliding: min(S, window - 1) + T):\n"
    "  4*T*H*d (residual stream) + the largest layer transient of\n"
    "    attention  T*(nh + 2*kv)*hd*d + 2*kv*S'*hd*d (cache and new keys joined)\n"
    "               + 2*T*nh*S'*d (scores, probabilities) + 2*nh*S'*hd*d (K/V to the q heads)\n"
    "    MLP + MoE  3*T*I_dense*d + T*H*d + 2*T*E*4 + 2*T*k*H*d + T*k*2*I*d\n"
    "  + the largest INT4 linear dequantized to d (PyTorch reference matmul)\n"
    "  + 2*S*H*d (encoder chunk: the prompt's output states encode returns)\n"
    "The canvas's sampling buffers are counted apart: C*V*(6*4 + 2*d)."
)


def workspace_bytes(c: DiffusionGemmaConfig, scheme: QuantScheme, dtype: str, tokens: int, context: int,
                    step: bool, backend: str = "torch") -> int:
    """DG_WORKSPACE_FORMULA for `tokens` positions against `context` committed ones. Attention has no kernel
    (the reference on every backend); with the Triton kernels INT4 linears are never dequantized."""
    d = FLOAT_KINDS[dtype]
    T, S, H, nh = tokens, context, c.hidden_size, c.num_attention_heads
    layer = 0
    for kind in set(c.layer_types):
        s = c.sliding if kind == "sliding_attention" else c.full
        keys = (min(S, c.sliding_window - 1) if kind == "sliding_attention" else S) + T
        kv, hd = s.num_key_value_heads, s.head_dim
        layer = max(layer, T * (nh + 2 * kv) * hd * d + 2 * kv * keys * hd * d + 2 * T * nh * keys * d
                    + 2 * nh * keys * hd * d)
    k, inter = c.top_k_experts, c.moe_intermediate_size
    layer = max(layer, 3 * T * c.intermediate_size * d + T * H * d + 2 * T * c.num_experts * 4 + 2 * T * k * H * d
                + T * k * 2 * inter * d)
    dequant = 0
    if scheme.kind == "int4" and backend != "triton":
        dequant = max(a * b for a, b in quantized_shapes(c)) * d
    states = 0 if step else 2 * S * H * d
    return 4 * T * H * d + layer + dequant + states


# ---- the plan ----------------------------------------------------------------------------------
@dataclass
class DiffusionGemmaPlan(MemoryPlan):
    """MemoryPlan's totals, advice and output for DiffusionGemma: `block_size` is the canvas, `kv_per_token`
    the full layers' prefix cache per position, `sliding_kv_per_token` the sliding layers' (kept for at most
    `sliding_window - 1` positions), `logits` the canvas's sampling buffers."""

    sliding_kv_per_token: int = 0
    sliding_window: int = 0
    lm_head_quantizable = False  # `clover quantize` keeps DiffusionGemma's lm_head 16-bit

    @property
    def step_label(self) -> str:
        return f"canvas {self.block_size}"

    @property
    def kv_cache(self) -> int:
        return (self.kv_per_token * self.context_len
                + self.sliding_kv_per_token * min(self.context_len, self.sliding_window - 1))

    def _replan(self, scheme: QuantScheme, context_len: int, dtype: str) -> DiffusionGemmaPlan:
        return plan_diffusion_gemma(self.config, scheme, context_len, None, dtype=dtype,
                                    prefill_chunk=self.prefill_chunk, backend=self.backend, _target=self.target,
                                    _name=self.model, _canvas=self.block_size)

    def rows(self) -> list[tuple[str, int, str]]:
        c, d = self.config, FLOAT_KINDS[self.dtype]
        rows = []
        for name, kinds in self.weights.items():
            detail = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in kinds.items() if v)
            rows.append((f"weights: {name}", sum(kinds.values()), detail))
        n_full = c.layer_types.count("full_attention")
        rows.append(("prefix cache", self.kv_cache,
                     f"{n_full} full layers x 2 x {c.full.num_key_value_heads} kv x {c.full.head_dim} x {d} B x "
                     f"{self.context_len} tokens + {len(c.layer_types) - n_full} sliding x 2 x "
                     f"{c.sliding.num_key_value_heads} kv x {c.sliding.head_dim} x {d} B x at most "
                     f"{self.sliding_window - 1} tokens"))
        rows.append(("activation workspace (estimate)", self.workspace,
                     f"max(step over a canvas of {self.block_size} {fmt_bytes(self.step_workspace)}, encoder chunk "
                     f"of {self.prefill_chunk} {fmt_bytes(self.prefill_workspace)}), {self.backend} kernels"))
        rows.append(("canvas sampling buffers", self.logits,
                     f"{self.block_size} x {c.vocab_size} x (6 x 4 B + 2 x {d} B)"))
        if self.cuda_context:
            rows.append(("CUDA context", self.cuda_context, "constant CUDA_CONTEXT_BYTES (driver, runtime, cuBLAS)"))
        return rows

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.update(model_type="diffusion_gemma", canvas_length=self.block_size, workspace_formula=DG_WORKSPACE_FORMULA,
                   prefix_cache_bytes=self.kv_cache, sliding_kv_bytes_per_token=self.sliding_kv_per_token,
                   sliding_window=self.sliding_window, canvas_buffer_bytes=self.logits)
        return out


def plan_diffusion_gemma(
    config: DiffusionGemmaConfig,
    quant: str | dict | QuantScheme | None = None,
    context_len: int = 8192,
    device: str | torch.device | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    backend: str | None = None,
    _target: Target | None = None,
    _name: str | None = None,
    _canvas: int | None = None,
) -> DiffusionGemmaPlan:
    """The memory a DiffusionGemma model needs at `context_len` committed positions (planner.plan's arguments;
    the canvas is the config's canvas_length)."""
    scheme = fitted_scheme(config, parse_quant(quant))
    dt = dtype_name(dtype, scheme)
    if context_len < 0:
        raise CloverError(f"context length must be >= 0, got {context_len}")
    target = _target if _target is not None else resolve_target(device)
    gpu = target.gpu if target is not None else True
    # What its loader picks: the reference until a GPU verifies its kernels (kernels/configs.py).
    backend = backend or _default_backend(device, gpu, verified=kernel_changes().diffusion_gemma)
    if backend not in ("torch", "triton"):
        raise CloverError(f"backend must be 'torch' or 'triton', got '{backend}'")
    C = _canvas or config.canvas_length
    chunk = min(prefill_chunk, encode_chunk(config), max(context_len, 1))  # as the encoder takes a prompt
    full, sliding = prefix_cache_bytes(config, dt, 1)
    return DiffusionGemmaPlan(
        model=_name or config.model_type, config=config, scheme=scheme, dtype=dt, context_len=context_len,
        block_size=C, prefill_chunk=chunk, weights=weight_bytes(config, scheme, dt), kv_per_token=full,
        gdn_state=0,
        step_workspace=workspace_bytes(config, scheme, dt, C, context_len, step=True, backend=backend),
        prefill_workspace=workspace_bytes(config, scheme, dt, chunk, context_len, step=False, backend=backend),
        logits=canvas_buffer_bytes(config, dt, C), cuda_context=CUDA_CONTEXT_BYTES if gpu else 0, target=target,
        backend=backend, sliding_kv_per_token=sliding, sliding_window=config.sliding_window,
    )
