"""DiffusionGemma's text model: an encoder over the committed text and a decoder that denoises a canvas.

Both run the same Gemma-4 layers (one set of weights when tied, as released): sandwich RMSNorms around
attention and around the feed-forward, which is a dense GELU MLP and a routed GELU MoE side by side, each with
its own post-norm, and a per-layer scalar that differs between the encoder and the decoder. Attention has no
1/sqrt(d) scale (q and k are RMS-normed instead) and v is RMS-normed without a weight; full-attention layers
reuse the raw key projection as values. The encoder is causal (sliding layers see the last `sliding_window`
positions) and writes keys/values into a PrefixCache; the decoder reads it and never writes: the canvas
attends to every cached position of full layers and to the cached last `sliding_window - 1` of sliding layers
(what transformers' sliding cache layer keeps), and bidirectionally within itself.
Semantics follow transformers 5.24 `models/diffusion_gemma` (the reference the tests compare against).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from clover_lite.models.attention import attend
from clover_lite.models.diffusion_gemma_config import DiffusionGemmaConfig, LayerShape
from clover_lite.models.layers import ACTIVATIONS, RMSNorm, apply_rotary
from clover_lite.models.moe import Experts

PREFILL_CHUNK = 2048  # the causal encoder is exact in chunks; bounds a long prompt's activations


def normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in fp32 (Gemma's `with_scale=False` norms)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def gelu(x: torch.Tensor, config: DiffusionGemmaConfig) -> torch.Tensor:
    return ACTIVATIONS[config.hidden_activation](x)


def rope_inv_freq(shape: LayerShape, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32. `proportional` (full layers) rotates the first
    partial_rotary_factor of the pairs with exponents over the whole head_dim and leaves the rest unrotated
    (zero frequency), so rotate-half always spans the full head."""
    d = shape.head_dim
    if shape.rope_type == "proportional":
        angles = int(shape.partial_rotary_factor * d // 2)
        exps = torch.arange(0, 2 * angles, 2, dtype=torch.float32, device=device) / d
        inv = torch.cat([1.0 / shape.rope_theta**exps, torch.zeros(d // 2 - angles, device=device)])
        return inv / shape.rope_factor
    dim = int(d * shape.partial_rotary_factor)
    exps = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    return 1.0 / shape.rope_theta**exps


def rope_cos_sin(shape: LayerShape, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * rope_inv_freq(shape, positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


@dataclass
class PrefixCache:
    """Keys/values [b, kv_heads, n, head_dim] per layer of the committed (encoded) positions. Sliding layers
    keep only their last `sliding_window - 1` positions: all a later query can see. `length` counts every
    committed position; the decoder's canvas starts there."""

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)
    length: int = 0

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if not self.keys or self.keys[i] is None else (self.keys[i], self.values[i])


class GemmaAttention(nn.Module):
    def __init__(self, config: DiffusionGemmaConfig, layer: int):
        super().__init__()
        c = config
        s = c.shape(layer)
        self.sliding = c.layer_types[layer] == "sliding_attention"
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, s.num_key_value_heads, s.head_dim
        self.eps = c.rms_norm_eps
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=bias)
        # Full layers have no value projection: the raw keys are the values (attention_k_eq_v).
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=bias) if self.sliding else None
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps, unit_offset=False)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps, unit_offset=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [b, heads, L, d], k and v [b, kv_heads, L, d] of x [b, L, hidden]."""
        b, L, _ = x.shape
        q = self.q_proj(x).view(b, L, self.n_heads, self.head_dim)
        k_raw = self.k_proj(x).view(b, L, self.n_kv, self.head_dim)
        v = k_raw if self.v_proj is None else self.v_proj(x).view(b, L, self.n_kv, self.head_dim)
        q = apply_rotary(self.q_norm(q).transpose(1, 2), cos, sin)
        k = apply_rotary(self.k_norm(k_raw).transpose(1, 2), cos, sin)
        return q, k, normalize(v, self.eps).transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Output [b, L, hidden] of x attending to past + itself (mask bool [L, past + L], True = visible;
        None = all), and x's own keys and values."""
        q, k, v = self.project(x, cos, sin)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        out = attend(q, keys, values, mask, 1.0, expand_kv=q.is_cuda and mask is not None)
        b, _, L, _ = q.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, L, -1)), k, v


class GeluMLP(nn.Module):
    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu(self.gate_proj(x), self.config) * self.up_proj(x))


class GemmaRouter(nn.Module):
    """Softmax top-k over the RMS-normed input (times a learned scale and hidden^-0.5), renormalised, then
    each chosen weight times its expert's learned scale."""

    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__()
        self.eps, self.top_k, self.root = config.rms_norm_eps, config.top_k_experts, config.hidden_size**-0.5
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] fp32, expert ids [T, k])."""
        probs = torch.softmax(self.proj(normalize(x, self.eps) * self.scale * self.root), -1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return weights / weights.sum(-1, keepdim=True) * self.per_expert_scale[ids], ids


class GeluExperts(Experts):
    """The fused expert weights of moe.Experts ([gate; up] then down) with Gemma's GELU."""

    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.config = config

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(h, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(gelu(gate, self.config) * up, self.down_proj[e])


class GemmaLayer(nn.Module):
    NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm", "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
             "post_feedforward_layernorm_2")

    def __init__(self, config: DiffusionGemmaConfig, layer: int):
        super().__init__()
        self.self_attn = GemmaAttention(config, layer)
        self.mlp = GeluMLP(config)
        self.router = GemmaRouter(config)
        self.experts = GeluExperts(config)
        for name in self.NORMS:
            setattr(self, name, RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=False))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None, scalar: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's output for h [b, L, hidden], and h's keys and values."""
        a, k, v = self.self_attn(self.input_layernorm(h), cos, sin, past, mask)
        h = h + self.post_attention_layernorm(a)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        flat = h.reshape(-1, h.shape[-1])
        weights, ids = self.router(flat)  # routed on the un-normed residual stream
        # The experts' forward is the seam: GPTQ experts (QuantExperts, GELU) and their fused kernel replace it.
        routed = self.experts(self.pre_feedforward_layernorm_2(flat), weights, ids)
        routed = self.post_feedforward_layernorm_2(routed.reshape(h.shape))
        h = h + self.post_feedforward_layernorm(dense + routed)
        return h * scalar, k, v


class SelfConditioning(nn.Module):
    """Adds a GELU MLP of the previous step's soft embeddings to the canvas embeddings, then RMS-normalises."""

    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.pre_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=False)
        self.mlp = GeluMLP(config)

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        # No signal (a canvas's first step) is a zero input, whose MLP output is exactly zero: skipped.
        return normalize(embeds if soft is None else embeds + self.mlp(self.pre_norm(soft)), self.eps)


class Stack(nn.Module):
    """Embedding, layers and final norm: the decoder's, and the encoder's when the checkpoint is untied."""

    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=False)

    def embed(self, ids: torch.Tensor, scale: float) -> torch.Tensor:
        w = self.embed_tokens.weight
        return F.embedding(ids, w) * torch.tensor(scale, dtype=w.dtype, device=w.device)


def encoder_mask(config: DiffusionGemmaConfig, sliding: bool, start: int, n: int, n_past: int,
                 device: torch.device) -> torch.Tensor:
    """Causal mask [n, n_past + n] for queries at positions start.. over the past's last n_past positions
    then the queries; sliding layers also hide keys `sliding_window` or more positions back."""
    q = torch.arange(start, start + n, device=device)[:, None]
    k = torch.arange(start - n_past, start + n, device=device)[None, :]
    visible = k <= q
    if sliding:
        visible &= q - k < config.sliding_window
    return visible


def encode_chunk(config: DiffusionGemmaConfig) -> int:
    """How many prompt positions `DiffusionGemma.encode` takes per pass: at most PREFILL_CHUNK and no more
    than the sliding window (256 at least). The planner sizes the encoder's workspace by it."""
    return min(PREFILL_CHUNK, max(256, config.sliding_window))


class DiffusionGemma(nn.Module):
    """The text model. `encode` commits tokens into a PrefixCache; `denoise` returns a canvas's logits."""

    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__()
        self.config = config
        self.decoder = Stack(config)
        self.self_conditioning = SelfConditioning(config)
        # Tied (as released): the encoder is the decoder's weights; untied checkpoints store their own.
        self.encoder = None if config.tie_word_embeddings else Stack(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)
        self.register_buffer("encoder_layer_scalar", torch.ones(config.num_hidden_layers))
        self.register_buffer("decoder_layer_scalar", torch.ones(config.num_hidden_layers))

    def encoder_stack(self) -> Stack:
        return self.decoder if self.encoder is None else self.encoder

    def new_cache(self) -> PrefixCache:
        n = self.config.num_hidden_layers
        return PrefixCache(keys=[None] * n, values=[None] * n, length=0)

    def _cos_sin(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        return {t: rope_cos_sin(c.sliding if t == "sliding_attention" else c.full, positions)
                for t in set(c.layer_types)}

    @torch.no_grad()
    def encode(self, ids: torch.Tensor, cache: PrefixCache) -> torch.Tensor:
        """Run the encoder over ids [b, T] after the cache's positions, appending their keys/values (in chunks of
        at most PREFILL_CHUNK). Returns the encoder's final hidden states [b, T, hidden] (normed).

        Chunks no longer than the sliding window (256 at least, so a tiny window does not mean tiny chunks):
        a sliding layer's chunk then attends to its window's keys and itself, n x (window + chunk) scores
        instead of n^2 for the whole prompt at once (3x fewer at 2K tokens and a 512 window)."""
        chunk = encode_chunk(self.config)
        starts = range(0, ids.shape[1], chunk)
        return torch.cat([self._encode_chunk(ids[:, i : i + chunk], cache) for i in starts], dim=1)

    def _encode_chunk(self, ids: torch.Tensor, cache: PrefixCache) -> torch.Tensor:
        c, stack = self.config, self.encoder_stack()
        start, n = cache.length, ids.shape[1]
        h = stack.embed(ids, c.embed_scale)
        rope = self._cos_sin(torch.arange(start, start + n, device=ids.device))
        keep = c.sliding_window - 1
        masks: dict[tuple[bool, int], torch.Tensor] = {}  # one per layer type and past length, not per layer
        for i, layer in enumerate(stack.layers):
            past = cache.layer(i)
            sliding = c.layer_types[i] == "sliding_attention"
            key = (sliding, 0 if past is None else past[0].shape[2])
            if key not in masks:  # additive (0 / -inf): SDPA would convert a bool mask again in every layer
                visible = encoder_mask(c, sliding, start, n, key[1], ids.device)
                masks[key] = torch.zeros(visible.shape, dtype=h.dtype, device=h.device).masked_fill(~visible,
                                                                                                     float("-inf"))
            mask = masks[key]
            h, k, v = layer(h, *rope[c.layer_types[i]], past, mask, self.encoder_layer_scalar[i])
            k, v = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
            if sliding:  # later queries never see further back
                k, v = k[:, :, k.shape[2] - min(keep, k.shape[2]):], v[:, :, v.shape[2] - min(keep, v.shape[2]):]
            cache.keys[i], cache.values[i] = k, v
        cache.length = start + n
        return stack.norm(h)

    def soft_embeddings(self, logits: torch.Tensor) -> torch.Tensor:
        """The expected (scaled) embedding under softmax(logits) [b, C, V]: the self-conditioning signal."""
        w = self.decoder.embed_tokens.weight
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(w.dtype)
        return (probs @ w) * torch.tensor(self.config.embed_scale, dtype=w.dtype, device=w.device)

    @torch.no_grad()
    def denoise(self, canvas: torch.Tensor, cache: PrefixCache, self_conditioning: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Logits [b, C, V] (fp32, soft-capped) of canvas [b, C] placed after the cache, conditioned on the
        previous step's logits [b, C, V] (None at a canvas's first step). Reads the cache only."""
        c, stack = self.config, self.decoder
        soft = None if self_conditioning is None else self.soft_embeddings(self_conditioning)
        h = self.self_conditioning(stack.embed(canvas, c.embed_scale), soft)
        rope = self._cos_sin(torch.arange(cache.length, cache.length + canvas.shape[1], device=canvas.device))
        for i, layer in enumerate(stack.layers):
            h, _, _ = layer(h, *rope[c.layer_types[i]], cache.layer(i), None, self.decoder_layer_scalar[i])
        return self.logits(stack.norm(h))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states, soft-capped at final_logit_softcapping."""
        w = self.decoder.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        out = F.linear(hidden, w).float()
        cap = self.config.final_logit_softcapping
        return out if cap is None else torch.tanh(out / cap) * cap

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

