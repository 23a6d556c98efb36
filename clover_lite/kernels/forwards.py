"""The kernel-backed forwards of the model's modules, installed once at load (`install`).

The modules in models/ are plain PyTorch and never import a kernel: each exposes the seam its kernel
replaces (RMSNorm.forward / forward_add, GatedAttention.norm_rotary / attention, GatedDeltaNet.mix,
SparseMoE.route, SwiGLU.forward, QuantLinear.forward, QuantExperts.forward), and `install` binds the
Triton version on the instance, so the class's method stays the reference. Where a kernel wants the
weights in another layout (INT4 words in the tensor cores' order, act-order rows grouped, rows of
several linears joined into one matmul) it is prepared here, once; a module's own reference still
computes the same from the prepared tensors (docs/ARCHITECTURE.md, dispatch).

What stays on the reference (the rule for model variants a kernel was not written for): a kernel is bound
only where it computes what the module's reference does for this variant, checked per module in
`_install_one`, never by model type. Today:
- routing: the top-k-softmax kernel serves `Router` (softmax, Qwen) only; a `GroupedSigmoidRouter` (LLaDA2's
  sigmoid scores, expert bias, group-limited top-k, routed scaling) keeps `SparseMoE.route`, the torch
  reference (a few launches; no host synchronisation, so the CUDA-graph step can still capture it);
- the shared expert without a gate (LLaDA2): the experts' combine adds a gated shared expert only, so an
  ungated one is added to the residual it sums (the same sum in another order);
- attention without the output gate (SDAR, LLaDA2) runs the same block-attention kernel with no gate, and
  norms without the (1 + w) offset the same norm kernel with unit_offset off: both kernels take these as
  arguments and are tested on them;
- experts with another activation than SiLU (DiffusionGemma's GELU experts): the same MoE launches with gate
  and up unfused and the activation in torch between them (the fused epilogue computes SiLU only);
- DiffusionGemma (docs/ARCHITECTURE.md section 11): its INT4 linears, experts and RMSNorms take the kernels
  above; its attention (`GemmaAttention`, over a prefix cache with sliding windows and no 1/sqrt(d) scale) and
  router have no kernel and stay on the reference.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from clover_lite.kernels import configs, mma_layout
from clover_lite.kernels.attention import block_attention
from clover_lite.kernels.configs import ATTENTION_MAX_BLOCK_LEN
from clover_lite.kernels.gdn import gdn_chunked
from clover_lite.kernels.gdn_prep import gdn_prepare
from clover_lite.kernels.int4_gemm import gemm
from clover_lite.kernels.int4_gemv import gemv
from clover_lite.kernels.int4_weights import Int4Weights, check_pair
from clover_lite.kernels.moe import fused_moe
from clover_lite.kernels.moe_route import topk_softmax
from clover_lite.kernels.norm import rms_norm
from clover_lite.models.attention import GatedAttention
from clover_lite.models.denoiser import Denoiser
from clover_lite.models.gdn import GatedDeltaNet
from clover_lite.models.layers import ACTIVATIONS, GatedRMSNorm, RMSNorm, SwiGLU, join_rows
from clover_lite.models.moe import Router, SparseMoE
from clover_lite.models.quantized import QuantExperts, QuantLinear
from clover_lite.quant.pack import sort_rows_by_group


def _bind(module: nn.Module, name: str, fn: Callable) -> None:
    setattr(module, name, types.MethodType(fn, module))


# ---- INT4 linears --------------------------------------------------------------------------------------
def int4_weights(lin: QuantLinear, changes: configs.KernelChanges) -> Int4Weights:
    """The weights as the kernels take them; an act-order g_idx that is plain k // group_size (static
    groups) is dropped so the kernel takes its per-tile fast path."""
    K, G = lin.in_features, lin.groups
    g_idx = None if bool((lin.g_idx == lin.plain_groups()).all()) else lin.g_idx
    return Int4Weights(lin.qweight, lin.scales, lin.qzeros, K // G, g_idx, lin.checkpoint_format,
                       perm=lin.k_perm, mma_order=lin.mma_order, sum_in_kernel=changes.sum_in_kernel)


def _packed_from_mma(self: QuantLinear, index: int | None = None):
    qweight, *rest = QuantLinear.packed(self, index)
    return (mma_layout.from_mma(qweight, self.mma_order), *rest)


def prepare_linear(lin: QuantLinear, changes: configs.KernelChanges) -> None:
    """The kernels' view of a GPTQ linear, cached on it (the g_idx checks sync with the device, which must
    not happen on every step). Act-order weights whose groups are only reordered (every group exactly
    group_size rows, as GPTQ's desc_act writes them) are repacked in place once so that each group's rows
    are contiguous: the kernels then take their per-tile path and the input's columns are gathered instead
    (M x K values, where the per-element path gathers K x N scales and zeros and needs several times the
    shared memory). Then, where the groups allow it, the words are rearranged in place into the order of
    the tensor cores' operand registers (mma_layout.py; only with `changes.mma_order`, not yet verified on a
    GPU), and `packed` reads them back. Neither is saved: the
    buffers are in the kernels' order (k_perm and mma_order live on the module only). Idempotent."""
    lin.mma_order = getattr(lin, "mma_order", 0)  # 0: the GPTQ order
    plain = lin.plain_groups()
    if lin.k_perm is None and not bool((lin.g_idx == plain).all()):
        repacked = sort_rows_by_group(lin.qweight, lin.g_idx, lin.in_features // lin.groups)
        if repacked is not None:
            lin.qweight.copy_(repacked[0])
            lin.g_idx.copy_(plain.expand_as(lin.g_idx))
            lin.k_perm = repacked[1]
    if changes.mma_order and not lin.mma_order and bool((lin.g_idx == plain).all()) \
            and mma_layout.eligible(lin.in_features, lin.in_features // lin.groups, None):
        order = mma_layout.kernel_order()
        mma_layout.repack_(lin.qweight, order)
        lin.mma_order = order
        _bind(lin, "packed", _packed_from_mma)
    lin._int4 = int4_weights(lin, changes)


def int4_matmul(x: torch.Tensor, w: Int4Weights, w2: Int4Weights | None = None) -> torch.Tensor:
    """x [..., K] times one linear's INT4 weights -> [..., N]: the GEMV for up to 4 rows, else the GEMM; x's
    columns gathered first for weights repacked by group. With `w2` (fused_gate_up's pair):
    silu(x w^T) * (x w2^T) in the same launch."""
    x2 = x.reshape(-1, w.K)
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm[0])
    y = gemv(x2, w, w2) if x2.shape[0] <= 4 else gemm(x2, w, w2)
    return y.reshape(*x.shape[:-1], w.N)


def _quant_linear_forward(self: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    y = int4_matmul(x, self._int4)
    return y if self.bias is None else y + self.bias


def share_row_order(gate: nn.Module, up: nn.Module) -> None:
    """Gate and up projections see the same inputs, so GPTQ's act-order gives them the same row order: they
    then share one permutation tensor, and the fused gate/up kernel reads one gathered input (the kernels
    tell the orders apart by identity)."""
    if not (isinstance(gate, QuantLinear) and isinstance(up, QuantLinear)):
        return
    if gate.k_perm is not None and up.k_perm is not None and gate.k_perm is not up.k_perm \
            and torch.equal(gate.k_perm, up.k_perm):
        up.k_perm = gate.k_perm
        up._int4 = Int4Weights(up.qweight, up.scales, up.qzeros, up._int4.group_size, up._int4.g_idx,
                               up.checkpoint_format, perm=up.k_perm, mma_order=up.mma_order,
                               sum_in_kernel=up._int4.sum_in_kernel)


def fused_gate_up(gate: nn.Module, up: nn.Module) -> tuple[Int4Weights, Int4Weights] | None:
    """The INT4 weights of a gate and an up projection that one fused GEMM can take (both prepared GPTQ
    linears without bias, same sizes, groups, format and row order), else None."""
    if not (isinstance(gate, QuantLinear) and isinstance(up, QuantLinear)) or gate.bias is not None \
            or up.bias is not None:
        return None
    share_row_order(gate, up)
    if gate.k_perm is not up.k_perm:  # one gathered input for both, or none
        return None
    g, u = gate._int4, up._int4
    if g.E != 1:
        return None
    try:
        check_pair(g, u)
    except ValueError:
        return None
    return g, u


def _swiglu_fused_forward(self: SwiGLU, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    out = self.down_proj(int4_matmul(x, *self._gate_up))
    return out if residual is None else residual + out


# ---- MoE -----------------------------------------------------------------------------------------------
def _quant_experts_forward(self: QuantExperts, x, weights, ids, shared=None, shared_logit=None, residual=None):
    parts = [p._int4 for p in (self.gate_proj, self.up_proj, self.down_proj)]
    if shared is not None and shared_logit is None:  # an ungated shared expert (LLaDA2): into the residual sum
        residual, shared = (shared if residual is None else residual + shared), None
    # SiLU is fused into the gate/up launch; another activation (DiffusionGemma's GELU) runs in torch between.
    act = None if self.activation == "silu" else ACTIVATIONS[self.activation]
    extra = dict(validate=False, shared=shared, shared_logit=shared_logit, residual=residual, activation=act)
    if self.graph_safe:  # inside StaticStep.forward: never the padded path (its buffers are sized on the host)
        return fused_moe(x, weights, ids, *parts, gemv_max_rows=1 << 30, **extra)
    return fused_moe(x, weights, ids, *parts, **extra)


def _moe_route(self: SparseMoE, flat: torch.Tensor):
    # One matmul gives the router's logits and the shared expert's gate logit (last column); the softmax,
    # top-k and renormalisation are one kernel, the gate is applied in the experts' combine.
    E = self.gate.weight.shape[0]
    logits = F.linear(flat, self._gate_rows)
    weights, ids = topk_softmax(logits[:, :E], self.gate.top_k, self.gate.normalize, flat.dtype)
    return weights, ids, (logits[:, E:] if self.shared_expert is not None else None)


# ---- norms, attention, GDN -----------------------------------------------------------------------------
def _rms_norm_forward(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, self.weight, self.eps, self.unit_offset)


def _rms_norm_forward_add(self: RMSNorm, x: torch.Tensor, residual: torch.Tensor):
    return rms_norm(x, self.weight, self.eps, self.unit_offset, residual=residual)


def _gated_rms_norm_forward(self: GatedRMSNorm, x, gate, dtype=None):
    return rms_norm(x, self.weight, self.eps, unit_offset=False, gate=gate, out_dtype=dtype)


def _norm_rotary(self: GatedAttention, norm: RMSNorm, t, cos, sin):
    return rms_norm(t, norm.weight, norm.eps, norm.unit_offset, rotary=(cos, sin)).transpose(1, 2)


def _attention(self: GatedAttention, q, gate, new, mask, past, past_len=None, num_splits=None):
    if mask is not None or q.shape[2] > ATTENTION_MAX_BLOCK_LEN:  # a prefill chunk: the reference (SDPA)
        if past_len is not None:
            raise ValueError("a device-side past_len needs no mask and a block of at most "
                             f"{ATTENTION_MAX_BLOCK_LEN} positions (the block-attention kernel)")
        return GatedAttention.attention(self, q, gate, new, mask, past)
    # A denoising step (or a single-block commit): every key is visible, the flash-decoding kernel.
    kc, vc = past if past is not None else (new.k[:, :, :0], new.v[:, :, :0])
    length = past_len if past_len is not None else kc.shape[2]
    return block_attention(q, kc, vc, new.k, new.v, length, self.head_dim**-0.5, gate=gate, num_splits=num_splits)


def _gdn_mix(self: GatedDeltaNet, x, recurrent, tail, need_state=True):
    # conv, SiLU, the heads' normalisation, g and beta in one kernel (instead of ~30 torch launches)
    if self._ab_weight is not None:  # in_proj_a and in_proj_b as one matmul
        a_b = F.linear(x, self._ab_weight)
        a, b = a_b[..., : self.n_v], a_b[..., self.n_v :]
    else:
        a, b = self.in_proj_a(x), self.in_proj_b(x)
    q, k, v, g, beta, new_tail = gdn_prepare(
        self.in_proj_qkv(x), tail, self.conv1d.weight.squeeze(1), a, b,
        self.A_log, self.dt_bias, self.n_k, self.dk, self.value_dim, need_tail=need_state)
    o, new_recurrent = gdn_chunked(q, k, v, g, beta, recurrent, write_state=need_state, normalized=True)
    return o, new_recurrent, new_tail


# ---- install -------------------------------------------------------------------------------------------
def _install_one(m: nn.Module, changes: configs.KernelChanges) -> None:
    if isinstance(m, QuantLinear):
        prepare_linear(m, changes)
        _bind(m, "forward", _quant_linear_forward)
    elif isinstance(m, RMSNorm):
        _bind(m, "forward", _rms_norm_forward)
        _bind(m, "forward_add", _rms_norm_forward_add)
    elif isinstance(m, GatedRMSNorm):
        _bind(m, "forward", _gated_rms_norm_forward)
    elif isinstance(m, GatedAttention):
        _bind(m, "norm_rotary", _norm_rotary)
        _bind(m, "attention", _attention)
    elif isinstance(m, GatedDeltaNet):
        a, b = m.in_proj_a, m.in_proj_b
        plain = all(type(p) is nn.Linear and p.bias is None for p in (a, b))
        m._ab_weight = join_rows([a, b]) if plain else None  # both then view the joined weight
        _bind(m, "mix", _gdn_mix)
    elif isinstance(m, SwiGLU):
        m._gate_up = fused_gate_up(m.gate_proj, m.up_proj)
        if m._gate_up is not None:
            _bind(m, "forward", _swiglu_fused_forward)
    elif isinstance(m, QuantExperts):
        share_row_order(m.gate_proj, m.up_proj)
        if isinstance(m.gate_proj, QuantLinear):
            m.graph_safe = False  # True only inside StaticStep.forward
            _bind(m, "forward", _quant_experts_forward)
    elif isinstance(m, SparseMoE) and type(m.gate) is Router:  # softmax top-k only (see the module docstring)
        mods = [m.gate] + ([m.shared_expert_gate] if m.shared_expert_gate is not None else [])
        m._gate_rows = join_rows(mods)  # the router's and the shared gate's weights then view it
        _bind(m, "route", _moe_route)
    elif isinstance(m, Denoiser):
        m.backend = "triton"


def install(model: nn.Module) -> None:
    """Bind the kernel-backed forwards on every module of `model` that has one, children before parents (a
    parent combines what its children prepared: the fused gate/up reads both projections' INT4 weights). The
    kernel changes in force (configs.kernel_changes: the GPU-verified ones unless CLOVER_KERNELS_UNVERIFIED=1)
    are read here, once."""
    changes = configs.kernel_changes()
    for m in reversed(list(model.modules())):
        _install_one(m, changes)
