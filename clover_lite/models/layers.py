"""Small building blocks shared by the layers: RMSNorm variants, rotary embedding, SwiGLU MLP.

Plain PyTorch, the reference of every kernel; kernels/dispatch.py installs kernel-backed forwards on these
modules at load (docs/ARCHITECTURE.md, dispatch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Gate activations by config name: SiLU (Qwen, SDAR, LLaDA2), GELU (DiffusionGemma's MLP and experts).
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32. Qwen3.5/Qwen3-Next store the weight zero-centred and scale by (1 + w)."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = True):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        return (xf * (1.0 + w if self.unit_offset else w)).to(x.dtype)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): a decoder layer's residual add and this norm (one kernel once
        the kernels are installed)."""
        total = residual + x
        return self(total), total


class GatedRMSNorm(nn.Module):
    """RMSNorm of the GDN output followed by a SiLU gate: w * norm(x) * silu(z) (norm before gate)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`dtype`: x is rounded to it first and the result is in it (the GDN's fp32 output, in the kernel)."""
        x = x if dtype is None else x.to(dtype)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * F.silu(gate.float())).to(dtype)


class RotaryEmbedding(nn.Module):
    """Partial RoPE (rotate-half layout) over the first `rotary_dim` dims of each head.

    Text-only mRoPE gives every section the same position, so it reduces to this plain RoPE.
    """

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.theta = theta

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [L] (int) -> cos, sin [L, rotary_dim] in fp32."""
        # Computed per call (tiny) rather than held in a buffer, so a model built on the meta device
        # and materialised by the loader needs no re-initialisation.
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=positions.device) / self.rotary_dim
        inv_freq = 1.0 / (self.theta**exponent)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, L, head_dim]; rotates the first cos.shape[-1] dims, passes the rest through."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = (rot.float() * cos + rotated.float() * sin).to(x.dtype)
    return torch.cat([out, rest], dim=-1)


class SwiGLU(nn.Module):
    """Dense gated MLP: down(silu(gate(x)) * up(x)). Used for the shared expert and dense layers."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)), plus `residual` (x's shape) if given."""
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out if residual is None else residual + out


def join_rows(linears: list[nn.Module]) -> torch.Tensor:
    """One weight [sum of out rows, in] for linears that see the same input, so one matmul serves them all;
    each module's weight becomes a view of its rows, so nothing is stored twice and a module's own forward
    still computes the same."""
    joined = torch.cat([m.weight.detach() for m in linears])
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = joined[start : start + n]
        start += n
    return joined
