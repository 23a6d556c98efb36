"""Runtime modules holding GPTQ INT4 weights, with a PyTorch reference matmul (dequantize, then matmul).

`QuantLinear` (GPTQ) and `NF4Linear` (the bitsandbytes baseline) replace an nn.Linear; `QuantExperts`
replaces the fused float experts of an MoE layer with per-part stacks (gate / up / down, each
[experts, ...]). The Triton kernels plug in behind `forward`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..quant.nf4 import dequantize_nf4
from ..quant.pack import PACK, dequantize, sort_rows_by_group, zero_offset
from .moe import add_shared_and_residual, dispatch


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
        # Set by prepare() for act-order weights repacked for the kernels: qweight row k is input column
        # k_perm[k]. Not saved: a prepared module's buffers are in the kernels' order.
        self.register_buffer("k_perm", None, persistent=False)
        self.bias = nn.Parameter(torch.zeros(*lead, out_features)) if bias else None

    backend = "torch"  # "triton" once kernels.apply chose it at load time
    mma_order = 0  # set by prepare() when qweight's words were rearranged for the tensor cores (mma_layout.py)

    def weight_of(self, index: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantized W [out, in] (of stack entry `index` for stacked experts)."""
        t = (self.qweight, self.qzeros, self.scales, self.g_idx)
        if index is not None:
            t = tuple(x[index] for x in t)
        if self.mma_order:
            from ..kernels.mma_layout import from_mma

            t = (from_mma(t[0], self.mma_order), *t[1:])
        w = dequantize(*t, checkpoint_format=self.checkpoint_format, dtype=dtype)
        if self.k_perm is not None:  # repacked rows: put each column back at its input position
            perm = self.k_perm if index is None else self.k_perm[index]
            w = torch.empty_like(w).scatter_(-1, perm.unsqueeze(-2).expand_as(w), w)
        return w

    def _plain_groups(self) -> torch.Tensor:
        K, G = self.in_features, self.groups
        return torch.arange(K, device=self.g_idx.device, dtype=torch.int32) // (K // G)

    def int4(self):
        """The weights as the Triton kernels take them; an act-order g_idx that is plain k // group_size
        (static groups) is dropped so the kernel takes its per-tile fast path."""
        from ..kernels.w4a16 import Int4Weights

        K, G = self.in_features, self.groups
        g_idx = None if bool((self.g_idx == self._plain_groups()).all()) else self.g_idx
        return Int4Weights(self.qweight, self.scales, self.qzeros, K // G, g_idx, self.checkpoint_format,
                           perm=self.k_perm, mma_order=self.mma_order)

    def prepare(self) -> None:
        """Called when the Triton backend is chosen: the kernels' view of the weights, cached (the g_idx
        checks sync with the device, which must not happen on every step). Act-order weights whose groups
        are only reordered (every group exactly group_size rows, as GPTQ's desc_act writes them) are
        repacked in place once so that each group's rows are contiguous: the kernels then take their
        per-tile path and the input's columns are gathered instead (M x K values, where the per-element
        path gathers K x N scales and zeros and needs several times the shared memory). Then, where the
        groups allow it, the words are rearranged in place into the order of the tensor cores' operand
        registers (kernels/mma_layout.py); weight_of reads them back. Neither is saved: the buffers are in
        the kernels' order (k_perm and mma_order live on the module only)."""
        from ..kernels import mma_layout

        plain = self._plain_groups()
        if self.k_perm is None and not bool((self.g_idx == plain).all()):
            repacked = sort_rows_by_group(self.qweight, self.g_idx, self.in_features // self.groups)
            if repacked is not None:
                self.qweight.copy_(repacked[0])
                self.g_idx.copy_(plain.expand_as(self.g_idx))
                self.k_perm = repacked[1]
        if not self.mma_order and mma_layout.eligible(self.in_features, self.in_features // self.groups, None) \
                and bool((self.g_idx == plain).all()):
            order = mma_layout.kernel_order()
            mma_layout.repack_(self.qweight, order)
            self.mma_order = order
        self._int4 = self.int4()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton":
            y = int4_matmul(x, getattr(self, "_int4", None) or self.int4())
            return y if self.bias is None else y + self.bias
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
    `make(in_features, out_features, stack)` builds one stack (GPTQ or NF4)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 make: Callable[[int, int, int], nn.Module]):
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = make(hidden, intermediate, num_experts)
        self.up_proj = make(hidden, intermediate, num_experts)
        self.down_proj = make(intermediate, hidden, num_experts)

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        gate = F.linear(h, self.gate_proj.weight_of(e, h.dtype))
        up = F.linear(h, self.up_proj.weight_of(e, h.dtype))
        return F.linear(F.silu(gate) * up, self.down_proj.weight_of(e, h.dtype))

    backend = "torch"
    graph_safe = False  # True only inside graph.StaticStep.forward: never the padded path (host-sized buffers)

    def prepare(self) -> None:
        """After the stacks' own prepare (dispatch.apply prepares children first): gate and up share one
        row order where GPTQ's act-order gave them the same (share_row_order)."""
        share_row_order(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor | None = None,
                shared_logit: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """As moe.Experts.forward; the shared expert's gated output and the residual are added in the combine
        on the kernel path."""
        if self.backend == "triton" and isinstance(self.gate_proj, QuantLinear):
            from ..kernels.moe import fused_moe

            parts = [getattr(p, "_int4", None) or p.int4() for p in (self.gate_proj, self.up_proj, self.down_proj)]
            extra = dict(validate=False, shared=shared, shared_logit=shared_logit, residual=residual)
            if self.graph_safe:
                return fused_moe(x, weights, ids, *parts, gemv_max_rows=1 << 30, **extra)
            return fused_moe(x, weights, ids, *parts, **extra)
        # Reference path: each expert that received tokens is dequantized and run once.
        out = dispatch(x, weights, ids, self.num_experts, self.expert)
        return add_shared_and_residual(out, shared, shared_logit, residual)


def share_row_order(gate: nn.Module, up: nn.Module) -> None:
    """Gate and up projections see the same inputs, so GPTQ's act-order gives them the same row order: they
    then share one permutation tensor, and the fused gate/up kernel reads one gathered input (the kernels
    tell the orders apart by identity)."""
    if not (isinstance(gate, QuantLinear) and isinstance(up, QuantLinear)):
        return
    if gate.k_perm is not None and up.k_perm is not None and gate.k_perm is not up.k_perm \
            and torch.equal(gate.k_perm, up.k_perm):
        up.k_perm = gate.k_perm
        up._int4 = up.int4()


def fused_gate_up(gate: nn.Module, up: nn.Module):
    """The kernels' INT4 weights of a gate and an up projection that one fused GEMM can take (both GPTQ
    linears without bias, same sizes, groups, format and row order), else None."""
    from ..kernels.w4a16 import _check_pair

    if not (isinstance(gate, QuantLinear) and isinstance(up, QuantLinear)) or gate.bias is not None \
            or up.bias is not None:
        return None
    share_row_order(gate, up)
    if gate.k_perm is not up.k_perm:  # one gathered input for both, or none
        return None
    g, u = (getattr(p, "_int4", None) or p.int4() for p in (gate, up))
    if g.E != 1:
        return None
    try:
        _check_pair(g, u)
    except ValueError:
        return None
    return g, u


def int4_matmul(x: torch.Tensor, w, w2=None) -> torch.Tensor:
    """x [..., K] times one linear's INT4 weights (kernels.w4a16.Int4Weights) -> [..., N] on the kernels: the
    GEMV for up to 4 rows, else the GEMM; x's columns gathered first for weights repacked by group. With `w2`
    (fused_gate_up's pair): silu(x w^T) * (x w2^T) in the same launch."""
    from ..kernels.w4a16 import gemm, gemv

    x2 = x.reshape(-1, w.K)
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm[0])
    y = gemv(x2, w, w2) if x2.shape[0] <= 4 else gemm(x2, w, w2)
    return y.reshape(*x.shape[:-1], w.N)


def gptq_experts(num_experts: int, hidden: int, intermediate: int, groups_in: int, groups_down: int,
                 checkpoint_format: str = "gptq") -> QuantExperts:
    def make(k: int, n: int, stack: int) -> QuantLinear:
        return QuantLinear(k, n, groups_in if k == hidden else groups_down, checkpoint_format=checkpoint_format,
                           stack=stack)

    return QuantExperts(num_experts, hidden, intermediate, make)


def nf4_experts(num_experts: int, hidden: int, intermediate: int, blocksize: int = 64) -> QuantExperts:
    return QuantExperts(num_experts, hidden, intermediate, lambda k, n, stack: NF4Linear(k, n, blocksize, stack))
