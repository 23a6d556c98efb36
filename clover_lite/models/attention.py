"""Full attention: q/k RMSNorm, (partial) RoPE, GQA, and, by config, a sigmoid output gate.

Qwen3.5 / Qwen3-Next gate the output (`attention_output_gate`: q_proj twice as wide, [query, gate] per head);
Qwen3 (SDAR) and BailingMoeV2 (LLaDA2) do not. LLaDA2 stores q, k and v fused (`query_key_value`): the loader
splits it into the three projections here (checkpoint/names.py).

Queries are the positions being run (a block, or a prefill chunk of whole blocks); keys are the
committed cache plus those positions. The caller supplies the block-causal mask for the new
positions; committed positions are always visible to them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from clover_lite.models.config import ModelConfig
from clover_lite.models.layers import RMSNorm, apply_rotary
from clover_lite.runtime.cache import AttentionUpdate


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           expand_kv: bool) -> torch.Tensor:
    """softmax(q k^T * scale, where mask) v for q [b, heads, L, d] and GQA k, v [b, kv_heads, S, d].

    expand_kv: K/V repeated to the q heads first. CUDA's fused SDPA kernels take a mask or GQA, not both:
    masked GQA would fall back to the math kernel and its fp32 scores and probabilities [heads, L, S] (8 GB
    for a 2K-token prefill chunk at 32K context on Clover); the copies cost 2*heads*S*d. On the CPU masked
    GQA stays fused."""
    gqa = q.shape[1] != k.shape[1]
    if gqa and expand_kv:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.n_heads = c.num_attention_heads
        self.n_kv = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.gated = c.attention_output_gate
        bias = c.attention_bias
        # With the output gate q_proj is twice as wide: per head [query, gate].
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim * (2 if self.gated else 1), bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=c.attention_output_bias)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps, unit_offset=c.norm_unit_offset)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps, unit_offset=c.norm_unit_offset)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> AttentionUpdate:
        """Keys (normed, rotated) and values of x [b, L, hidden] -> [b, kv_heads, L, head_dim]."""
        b, L, _ = x.shape
        k = self.k_proj(x).view(b, L, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(b, L, self.n_kv, self.head_dim).transpose(1, 2)
        return AttentionUpdate(k=self.norm_rotary(self.k_norm, k, cos, sin), v=v)

    def norm_rotary(self, norm: RMSNorm, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """t [b, L, heads, head_dim] -> RoPE(norm(t)) [b, heads, L, head_dim] (one kernel once installed)."""
        return apply_rotary(norm(t).transpose(1, 2), cos, sin)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Queries (normed, rotated) [b, heads, L, head_dim] and the output gate [b, L, heads, head_dim] of x
        (None without the gate)."""
        b, L, _ = x.shape
        if not self.gated:
            q = self.q_proj(x).view(b, L, self.n_heads, self.head_dim)
            return self.norm_rotary(self.q_norm, q, cos, sin), None
        qg = self.q_proj(x).view(b, L, self.n_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]
        return self.norm_rotary(self.q_norm, q, cos, sin), gate

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_len: torch.Tensor | None = None,
        num_splits: int | None = None,
    ) -> tuple[torch.Tensor, AttentionUpdate]:
        """x [b, L, hidden]; mask bool [L, past_len + L] (True = visible) or None for all visible.

        `past_len` (a device tensor, with `num_splits`) marks `past` as the cache's whole buffers of which
        the first past_len positions are committed: the static step of a CUDA graph (kernel attention)."""
        q, gate = self.project_q(x, cos, sin)
        new = self.project_kv(x, cos, sin)
        return self.o_proj(self.attention(q, gate, new, mask, past, past_len, num_splits)), new

    def attention(
        self,
        q: torch.Tensor,
        gate: torch.Tensor | None,
        new: AttentionUpdate,
        mask: torch.Tensor | None,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        past_len: torch.Tensor | None = None,
        num_splits: int | None = None,
    ) -> torch.Tensor:
        """The attention output [b, L, heads * head_dim] of queries q over the past and the new keys, times
        sigmoid(gate) when the layer has the output gate."""
        if past_len is not None:  # SDPA below would attend to the whole buffers, unwritten rows included
            raise ValueError("a device-side past_len needs the block-attention kernel (installed at load on a GPU) "
                             "and no mask")
        b, _, L, _ = q.shape
        k, v = new.k, new.v
        if past is not None and past[0].shape[2] > 0:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        out = attend(q, k, v, mask, self.head_dim**-0.5, expand_kv=q.is_cuda and mask is not None)
        out = out.transpose(1, 2).reshape(b, L, self.n_heads * self.head_dim)
        return out if gate is None else out * torch.sigmoid(gate.reshape(b, L, -1))
