"""Gated DeltaNet over a block (or a prefill chunk) from the committed state, in Triton.

One program per (sequence, value head, tile of value columns): the delta rule is independent across the
columns of the state S [K, V], so each program keeps S[:, tile] (fp32) on chip and walks the tokens in
chunks of BLOCK_T, in the chunked (WY) form of `models.gdn.gated_delta_rule_chunked`:
    d = (I + A)^-1 beta (v - exp(c) K S),   o = exp(c) Q S + (decay * Q K^T) d,
    S' = exp(c_T) S + (K * exp(c_T - c))^T d.
The unit lower-triangular inverse uses the nilpotent product (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...
(A is strictly lower triangular, so A^BLOCK_T = 0): log2(BLOCK_T) small matmuls instead of a sequential
substitution. A step computes the block's outputs and leaves the state alone (`write_state=False`); a
commit also writes the advanced state. The products run on tensor cores in tf32 (configs.GDN_*: the fp32
FMA form spilled heavily), the state stays fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from clover_lite.kernels import configs
from clover_lite.kernels.host import cdiv, interpreting, next_power_of_2


@triton.jit
def _gdn_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr, s_out_ptr,
    L, K, V, HV, REP,
    s_qb, s_qt, s_qh, s_vb, s_vt, s_vh, s_gb, s_gt, s_sb, s_sh, s_sk, s_ob, s_ot, s_oh,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, LOG2_T: tl.constexpr,
    WRITE_STATE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = pid_bh // HV
    h = pid_bh % HV
    hk = h // REP  # the qk head serving this value head
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = offs_k < K
    v_ok = offs_v < V
    sv = s_ptr + b * s_sb + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :]
    S = tl.load(sv, mask=k_ok[:, None] & v_ok[None, :], other=0.0)
    rows = tl.arange(0, BLOCK_T)
    lower = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for t0 in range(0, L, BLOCK_T):
        offs_t = t0 + rows
        t_ok = offs_t < L
        qk_mask = t_ok[:, None] & k_ok[None, :]
        qc = tl.load(q_ptr + b * s_qb + offs_t[:, None] * s_qt + hk * s_qh + offs_k[None, :], mask=qk_mask, other=0.0)
        kc = tl.load(k_ptr + b * s_qb + offs_t[:, None] * s_qt + hk * s_qh + offs_k[None, :], mask=qk_mask, other=0.0)
        vc = tl.load(v_ptr + b * s_vb + offs_t[:, None] * s_vt + h * s_vh + offs_v[None, :],
                     mask=t_ok[:, None] & v_ok[None, :], other=0.0)
        gc = tl.load(g_ptr + b * s_gb + offs_t * s_gt + h, mask=t_ok, other=0.0)  # padding: no decay...
        bc = tl.load(beta_ptr + b * s_gb + offs_t * s_gt + h, mask=t_ok, other=0.0)  # ...and no update
        c = tl.cumsum(gc, axis=0)
        c_last = tl.sum(gc, axis=0)
        diff = tl.where(lower, c[:, None] - c[None, :], float("-inf"))
        decay = tl.exp(diff)  # exp(c_t - c_s) for s <= t, else 0
        kk = tl.dot(kc, tl.trans(kc), input_precision=DOT_PREC)
        A = tl.where(strict, bc[:, None] * decay * kk, 0.0)
        inv = eye - A
        apow = A
        for _ in tl.static_range(LOG2_T - 1):
            apow = tl.dot(apow, apow, input_precision=DOT_PREC)
            inv = tl.dot(inv, eye + apow, input_precision=DOT_PREC)
        ks = tl.dot(kc, S, input_precision=DOT_PREC)
        rhs = bc[:, None] * (vc - tl.exp(c)[:, None] * ks)
        d = tl.dot(inv, rhs, input_precision=DOT_PREC)
        qkd = tl.dot(qc, tl.trans(kc), input_precision=DOT_PREC) * decay
        o = tl.exp(c)[:, None] * tl.dot(qc, S, input_precision=DOT_PREC) + tl.dot(qkd, d, input_precision=DOT_PREC)
        tl.store(o_ptr + b * s_ob + offs_t[:, None] * s_ot + h * s_oh + offs_v[None, :], o,
                 mask=t_ok[:, None] & v_ok[None, :])
        kd = kc * tl.exp(c_last - c)[:, None]
        S = tl.exp(c_last) * S + tl.dot(tl.trans(kd), d, input_precision=DOT_PREC)
    if WRITE_STATE:
        tl.store(s_out_ptr + b * s_sb + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :], S,
                 mask=k_ok[:, None] & v_ok[None, :])


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, next_power_of_2(n))


def gdn_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    write_state: bool,
    block_t: int | None = None,
    block_v: int | None = None,
    normalized: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule from `state`, as `models.gdn.gated_delta_rule_chunked` (same inputs: q, k
    [b, L, HK, K] before normalisation, v [b, L, HV, V], g, beta [b, L, HV], state [b, HV, K, V] fp32,
    never modified) -> (out [b, L, HV, V] fp32, the state after the L tokens if write_state else None).
    `normalized`: q and k are already L2-normalised (q times K^-0.5) and all five are fp32 and contiguous,
    as kernels.gdn_prep.gdn_prepare returns them."""
    from clover_lite.models.gdn import l2_normalize

    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k must be [b, L, HK, K] and v [b, L, HV, V]; got {q.shape}, {k.shape}, {v.shape}")
    b, L, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % HK:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({HK})")
    if g.shape != (b, L, HV) or beta.shape != (b, L, HV):
        raise ValueError(f"g and beta must be [b, L, HV] = {(b, L, HV)}, got {tuple(g.shape)}, {tuple(beta.shape)}")
    if state.shape != (b, HV, K, V):
        raise ValueError(f"state must be [b, HV, K, V] = {(b, HV, K, V)}, got {tuple(state.shape)}")
    if state.dtype != torch.float32:
        raise ValueError(f"the recurrent state must be fp32, got {state.dtype}")
    if not (state.is_cuda or interpreting()):
        raise ValueError("the Triton GDN kernel needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tests)")
    if normalized:
        qf, kf, vf, gf, bf = q, k, v, g, beta
    else:  # normalisation and the K^-0.5 query scale in fp32 (elementwise; the kernel does the recurrence)
        qf = (l2_normalize(q.float()) * K**-0.5).contiguous()
        kf = l2_normalize(k.float()).contiguous()
        vf, gf, bf = v.float().contiguous(), g.float().contiguous(), beta.float().contiguous()
    out = torch.empty(b, L, HV, V, device=v.device, dtype=torch.float32)
    new_state = torch.empty_like(state) if write_state else state  # never written when not asked
    if L == 0:
        return out, (state.clone() if write_state else None)
    bt = block_t or min(configs.GDN_BLOCK_T, _pow2(L))
    bv = block_v or min(configs.GDN_BLOCK_V, _pow2(V))
    bk = _pow2(K)
    st = state.contiguous()
    _gdn_kernel[(b * HV, cdiv(V, bv))](
        qf, kf, vf, gf, bf, st, out, new_state,
        L, K, V, HV, HV // HK,
        qf.stride(0), qf.stride(1), qf.stride(2), vf.stride(0), vf.stride(1), vf.stride(2),
        gf.stride(0), gf.stride(1), st.stride(0), st.stride(1), st.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_T=bt, BLOCK_K=bk, BLOCK_V=bv, LOG2_T=bt.bit_length() - 1, WRITE_STATE=write_state,
        DOT_PREC=configs.GDN_DOT_PRECISION, num_warps=configs.GDN_NUM_WARPS,
    )
    return out, (new_state if write_state else None)
