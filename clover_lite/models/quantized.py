"""Runtime modules holding GPTQ INT4 weights, with a PyTorch reference matmul (dequantize, then matmul).

`QuantLinear` (GPTQ) and `NF4Linear` (the bitsandbytes baseline) replace an nn.Linear; `QuantExperts`
replaces the fused float experts of an MoE layer with per-part stacks (gate / up / down, each
[experts, ...]). kernels/dispatch.py installs the Triton kernels behind `forward` at load, and may then
rearrange the packed words for them (`packed` reads them back in the GPTQ order).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from clover_lite.models.layers import ACTIVATIONS
from clover_lite.models.moe import add_shared_and_residual, dispatch
from clover_lite.quant.nf4 import dequantize_nf4
from clover_lite.quant.pack import PACK, dequantize, zero_offset


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W held as GPTQ tensors exactly as the checkpoint stores them."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        groups: int,
        bias: bool = False,
        checkpoint_format: str = "gptq",
        stack: int | None = None,
    ):
        super().__init__()
        if in_features % PACK or out_features % PACK:
            raise ValueError(
                f"INT4 GPTQ needs in and out features divisible by {PACK}, got {in_features} x {out_features}"
            )
        zero_offset(checkpoint_format)  # validates the name
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        self.checkpoint_format = checkpoint_format
        lead = () if stack is None else (stack,)
        self.register_buffer("qweight", torch.zeros(*lead, in_features // PACK, out_features, dtype=torch.int32))
        self.register_buffer("qzeros", torch.zeros(*lead, groups, out_features // PACK, dtype=torch.int32))
        self.register_buffer("scales", torch.zeros(*lead, groups, out_features, dtype=torch.float16))
        self.register_buffer("g_idx", torch.zeros(*lead, in_features, dtype=torch.int32))
        # Set when the kernels are installed, for act-order weights repacked by group: qweight row k is input
        # column k_perm[k]. Not saved: a prepared module's buffers are in the kernels' order.
        self.register_buffer("k_perm", None, persistent=False)
        self.bias = nn.Parameter(torch.zeros(*lead, out_features)) if bias else None

    def packed(self, index: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qweight, qzeros, scales, g_idx) as the checkpoint stores them (of stack entry `index`)."""
        t = (self.qweight, self.qzeros, self.scales, self.g_idx)
        return t if index is None else tuple(x[index] for x in t)

    def weight_of(self, index: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantized W [out, in] (of stack entry `index` for stacked experts)."""
        w = dequantize(*self.packed(index), checkpoint_format=self.checkpoint_format, dtype=dtype)
        if self.k_perm is not None:  # repacked rows: put each column back at its input position
            perm = self.k_perm if index is None else self.k_perm[index]
            w = torch.empty_like(w).scatter_(-1, perm.unsqueeze(-2).expand_as(w), w)
        return w

    def plain_groups(self) -> torch.Tensor:
        """The g_idx of weights without act-order: input column k is in group k // group_size."""
        K, G = self.in_features, self.groups
        return torch.arange(K, device=self.g_idx.device, dtype=torch.int32) // (K // G)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_of(dtype=x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, groups={self.groups}, {self.checkpoint_format}"


class NF4Linear(nn.Module):
    """y = x W^T with W in bitsandbytes' NF4 layout: 4-bit codes of the NF4 table, two per byte (high nibble
    first) over the row-major weight, one fp32 absmax per block of `blocksize` values. The baseline of
    `clover quantize --method nf4`; dequantized here in plain PyTorch, so bitsandbytes is not needed to run."""

    def __init__(self, in_features: int, out_features: int, blocksize: int = 64, stack: int | None = None,
                 bias: bool = False):
        super().__init__()
        numel = in_features * out_features
        if numel % blocksize or blocksize % 2:
            raise ValueError(f"NF4 blocksize {blocksize} must be even and divide {out_features} x {in_features}")
        self.in_features, self.out_features, self.blocksize = in_features, out_features, blocksize
        lead = () if stack is None else (stack,)
        self.register_buffer("nf4_weight", torch.zeros(*lead, numel // 2, dtype=torch.uint8))
        self.register_buffer("nf4_absmax", torch.zeros(*lead, numel // blocksize, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(*lead, out_features)) if bias else None

    def weight_of(self, index: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        packed, absmax = self.nf4_weight, self.nf4_absmax
        if index is not None:
            packed, absmax = packed[index], absmax[index]
        return dequantize_nf4(packed, absmax, (self.out_features, self.in_features), self.blocksize, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_of(dtype=x.dtype), self.bias)




class QuantExperts(nn.Module):
    """All experts of a layer as stacked quantized linears gate_proj / up_proj / down_proj, each [E, ...];
    `make(in_features, out_features, stack)` builds one stack (GPTQ or NF4). Each expert computes
    down(act(gate(x)) * up(x)), `activation` one of ACTIVATIONS."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 make: Callable[[int, int, int], nn.Module], activation: str = "silu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown expert activation '{activation}'; one of {', '.join(ACTIVATIONS)}")
        self.num_experts = num_experts
        self.activation = activation
        self.gate_proj = make(hidden, intermediate, num_experts)
        self.up_proj = make(hidden, intermediate, num_experts)
        self.down_proj = make(intermediate, hidden, num_experts)

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        gate = F.linear(h, self.gate_proj.weight_of(e, h.dtype))
        up = F.linear(h, self.up_proj.weight_of(e, h.dtype))
        return F.linear(ACTIVATIONS[self.activation](gate) * up, self.down_proj.weight_of(e, h.dtype))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor | None = None,
                shared_logit: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """As moe.Experts.forward (the kernels add the shared expert's gated output and the residual in their
        combine)."""
        # Reference path: each expert that received tokens is dequantized and run once.
        out = dispatch(x, weights, ids, self.num_experts, self.expert)
        return add_shared_and_residual(out, shared, shared_logit, residual)


def gptq_experts(num_experts: int, hidden: int, intermediate: int, groups_in: int, groups_down: int,
                 checkpoint_format: str = "gptq", activation: str = "silu") -> QuantExperts:
    def make(k: int, n: int, stack: int) -> QuantLinear:
        return QuantLinear(k, n, groups_in if k == hidden else groups_down, checkpoint_format=checkpoint_format,
                           stack=stack)

    return QuantExperts(num_experts, hidden, intermediate, make, activation)


def nf4_experts(num_experts: int, hidden: int, intermediate: int, blocksize: int = 64) -> QuantExperts:
    return QuantExperts(num_experts, hidden, intermediate, lambda k, n, stack: NF4Linear(k, n, blocksize, stack))
