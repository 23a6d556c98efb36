"""The Gated DeltaNet layer's inputs to the delta rule in one kernel: causal conv1d + SiLU continuing from the
conv tail, q and k L2-normalised (q scaled by K^-0.5), v, the log-decay g and the write strength beta.

In PyTorch (models/gdn.py: causal_conv, GatedDeltaNet.heads, and the casts and normalisations before the
delta-rule kernel) these were about 30 launches per layer, each a few microseconds on a few hundred KB:
~2 ms of an H200's step over Clover's 30 GDN layers (benchmarks/RESULTS.md, 2026-12-04 profile). Here one
program takes a tile of tokens and heads (q, k and v heads of the conv output alike) and computes g and
beta for the v heads among them. It rounds where the modules round: the conv output and its
SiLU to the activations' dtype, beta to it too; g, the normalisation and everything after in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from clover_lite.kernels.host import cdiv, interpreting, next_power_of_2


@triton.jit
def _gdn_prep_kernel(
    qkv_ptr, tail_ptr, w_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, new_tail_ptr,
    L, HK, HV, K, V, q_scale, eps,
    s_xb, s_xt, s_tb, s_tc, s_tk, s_ab, s_at, s_bb, s_bt, s_ntb, s_ntc, s_ntk,
    KW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    WRITE_TAIL: tl.constexpr,
):
    """Tiles [BLOCK_T tokens, BLOCK_S head slots, BLOCK_D channels]: slots are the q heads, then the k heads,
    then the v heads of the conv output, each K (q, k) or V (v) channels wide."""
    bi = tl.program_id(0)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
    slot = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)[None, :, None]
    offs_d = tl.arange(0, BLOCK_D)[None, None, :]
    is_v = slot >= 2 * HK
    head = tl.where(is_v, slot - 2 * HK, slot % HK)
    width = tl.where(is_v, V, K)
    ch = tl.where(is_v, 2 * HK * K + head * V, slot * K) + offs_d  # conv channel
    ok = (offs_t < L) & (slot < 2 * HK + HV) & (offs_d < width)
    dtype = qkv_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_T, BLOCK_S, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(KW):
        # full = [tail (KW - 1 columns), x (L tokens)]; output t reads full[t .. t + KW - 1]
        f = offs_t + j
        from_x = f >= KW - 1
        xv = tl.load(qkv_ptr + bi * s_xb + (f - (KW - 1)) * s_xt + ch, mask=ok & from_x, other=0.0)
        tv = tl.load(tail_ptr + bi * s_tb + ch * s_tc + f * s_tk, mask=ok & (f < KW - 1), other=0.0).to(dtype)
        w = tl.load(w_ptr + ch * KW + j, mask=ok, other=0.0).to(tl.float32)
        acc += w * tl.where(from_x, xv.to(tl.float32), tv.to(tl.float32))
    conv = acc.to(dtype).to(tl.float32)  # conv1d's output in the activations' dtype
    y = (conv / (1.0 + tl.exp(-conv))).to(dtype).to(tl.float32)  # SiLU, rounded as F.silu(...).to(dtype)
    if WRITE_TAIL:  # the last KW - 1 conv inputs become the new tail (L >= KW - 1: the launcher checks)
        jt = offs_t - (L - (KW - 1))
        x_t = tl.load(qkv_ptr + bi * s_xb + offs_t * s_xt + ch, mask=ok & (jt >= 0), other=0.0)
        tl.store(new_tail_ptr + bi * s_ntb + ch * s_ntc + jt * s_ntk, x_t.to(new_tail_ptr.dtype.element_ty),
                 mask=ok & (jt >= 0))
    token = bi * L + offs_t
    tl.store(v_ptr + (token * HV + head) * V + offs_d, y, mask=ok & is_v)
    yn = y * tl.rsqrt(tl.sum(y * y, axis=2)[:, :, None] + eps)  # models.gdn.l2_normalize in fp32
    tl.store(q_ptr + (token * HK + head) * K + offs_d, yn * q_scale, mask=ok & (slot < HK))
    tl.store(k_ptr + (token * HK + head) * K + offs_d, yn, mask=ok & (slot >= HK) & (slot < 2 * HK))
    # Per (token, v head): g = -exp(A_log) * softplus(a + dt_bias) in fp32, beta = sigmoid(b) in the dtype.
    t2 = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    h2 = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)[None, :] - 2 * HK
    ok2 = (t2 < L) & (h2 >= 0) & (h2 < HV)
    a = (tl.load(a_ptr + bi * s_ab + t2 * s_at + h2, mask=ok2, other=0.0).to(tl.float32)
         + tl.load(dt_bias_ptr + h2, mask=ok2, other=0.0).to(tl.float32))
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
    g = -tl.exp(tl.load(a_log_ptr + h2, mask=ok2, other=0.0).to(tl.float32)) * softplus
    bv = tl.load(b_ptr + bi * s_bb + t2 * s_bt + h2, mask=ok2, other=0.0).to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-bv))).to(dtype).to(tl.float32)
    tl.store(g_ptr + (bi * L + t2) * HV + h2, g, mask=ok2)
    tl.store(beta_ptr + (bi * L + t2) * HV + h2, beta, mask=ok2)


def gdn_prepare(qkv: torch.Tensor, tail: torch.Tensor, conv_weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                a_log: torch.Tensor, dt_bias: torch.Tensor, num_k_heads: int, key_dim: int, value_dim: int,
                need_tail: bool, eps: float = 1e-6, tile: tuple[int, int] | None = None):
    """qkv [b, L, C] (in_proj_qkv's output, C = 2 HK K + HV V), conv tail [b, C, KW-1], conv weight [C, KW],
    a, b [b, L, HV] (in_proj_a / in_proj_b outputs), A_log, dt_bias [HV] ->
    (q, k [b, L, HK, K] normalised (q times K^-0.5), v [b, L, HV, V], g, beta [b, L, HV], all fp32
    contiguous, and the new conv tail [b, C, KW-1] in the tail's dtype if need_tail else None).
    `tile`: (tokens, heads) per program, powers of two (default: the GPU's, or large under the interpreter)."""
    if qkv.dim() != 3 or qkv.stride(2) != 1:
        raise ValueError(f"qkv must be [b, L, C] with unit channel stride, got shape {tuple(qkv.shape)}")
    B, L, C = qkv.shape
    HK, K = num_k_heads, key_dim
    KW = conv_weight.shape[-1]
    HV = a.shape[-1]
    if HV == 0 or value_dim % HV or C != 2 * HK * K + value_dim:
        raise ValueError(f"conv channels {C} != 2 x {HK} x {K} + {value_dim} (value heads {HV})")
    V = value_dim // HV
    if tail.shape != (B, C, KW - 1) or conv_weight.shape != (C, KW):
        raise ValueError(f"conv tail {tuple(tail.shape)} / weight {tuple(conv_weight.shape)} do not match "
                         f"({B}, {C}, {KW - 1}) / ({C}, {KW})")
    if a.shape != (B, L, HV) or b.shape != (B, L, HV) or a.stride(2) != 1 or b.stride(2) != 1:
        raise ValueError(f"a and b must be [b, L, HV] = {(B, L, HV)} with unit head stride")
    if not (qkv.is_cuda or interpreting()):
        raise ValueError("the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tests)")
    dev, f32 = qkv.device, torch.float32
    q = torch.empty(B, L, HK, K, device=dev, dtype=f32)
    k = torch.empty(B, L, HK, K, device=dev, dtype=f32)
    v = torch.empty(B, L, HV, V, device=dev, dtype=f32)
    g = torch.empty(B, L, HV, device=dev, dtype=f32)
    beta = torch.empty(B, L, HV, device=dev, dtype=f32)
    new_tail = None
    in_kernel = need_tail and L >= KW - 1
    if need_tail:
        new_tail = (torch.empty(tail.shape, device=dev, dtype=tail.dtype) if in_kernel else
                    torch.cat([tail.to(qkv.dtype), qkv.transpose(1, 2)], dim=-1)[..., L:].to(tail.dtype))
    if B * L:
        w = conv_weight.contiguous()
        nt = new_tail if in_kernel else q
        slots = 2 * HK + HV
        bd = next_power_of_2(max(K, V))
        # The interpreter's cost grows with the programs: a few large tiles there; on a GPU a token and
        # 4 heads per program (Clover's 32-token block: 512 programs of 512 channels).
        bt, bs = tile or ((min(64, next_power_of_2(L)), next_power_of_2(slots)) if interpreting()
                          else (1, 4))
        _gdn_prep_kernel[(B, cdiv(L, bt), cdiv(slots, bs))](
            qkv, tail, w, a, b, a_log, dt_bias, q, k, v, g, beta, nt,
            L, HK, HV, K, V, K**-0.5, eps,
            qkv.stride(0), qkv.stride(1), *tail.stride(), a.stride(0), a.stride(1),
            b.stride(0), b.stride(1), *(nt.stride() if in_kernel else (0, 0, 0)),
            KW=KW, BLOCK_T=bt, BLOCK_S=bs, BLOCK_D=bd, WRITE_TAIL=in_kernel, num_warps=4,
        )
    return q, k, v, g, beta, new_tail
