"""The INT4 GEMV: one row per program, no tl.dot, for M <= 4 and for MoE experts holding ~1-2 rows each,
where padding every expert to a 16-row tile would waste most of the work (shared DESIGN.md sections 3, 4, 7).

`_gemv_kernel` works on the packed words as loaded (nibble planes, no int-to-float conversion), splits K when
too few programs would fill the GPU (int4_split_k.py) and fuses SiLU(gate) * up and a per-row scale as the
GEMM does. `gemv` launches it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from clover_lite.kernels import configs, int4_launch
from clover_lite.kernels.host import cdiv
from clover_lite.kernels.int4_dequant import (
    first_group,
    group_params,
    mma_words,
    next_group,
    nibble_planes,
    split_planes,
)
from clover_lite.kernels.int4_split_k import (
    check_partials,
    k_splits,
    last_split_sums,
    split_buffer,
    split_result,
    sum_target,
)
from clover_lite.kernels.int4_weights import Int4Weights, block_k_for, check_pair, check_x


@triton.jit
def _x_planes(xt, ORDER: tl.constexpr, BLOCK_K: tl.constexpr):
    """x's tile [BK] as the 8 planes [BK/8] that multiply nibble J of the tile's words: columns 8i + J in
    GPTQ's order (ORDER 0), else the rows nibble J holds in the MMA order, as (t, c) (see _gemv_words)."""
    CB: tl.constexpr = BLOCK_K // 32
    if ORDER == 2:  # row 32 c + 16 m1 + 8 m0 + 2 t + h -> [t, c, h, m1, m0]: J = m + 4h last
        x8 = tl.permute(tl.reshape(xt, (CB, 2, 2, 4, 2)), (3, 0, 4, 1, 2))
    elif ORDER == 4:  # row 32 c + 16 m1 + 4 t + 2 m0 + h
        x8 = tl.permute(tl.reshape(xt, (CB, 2, 4, 2, 2)), (2, 0, 4, 1, 3))
    else:
        x8 = xt
    return split_planes(tl.reshape(x8, (BLOCK_K // 8, 8)))


@triton.jit
def _gemv_words(qw_ptr, e, s_qe, s_qk, s_qn, k0, k_end, N, n0, offs_i, offs_n, n_ok, EVEN_K: tl.constexpr,
                ORDER: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The GEMV's words [BK/8, BN] of rows k0 .. k0 + BK: GPTQ's rows (ORDER 0), or in the MMA order the
    words (t, c) of each column, row t * BK/32 + c (the order _x_planes gives x's planes)."""
    if ORDER != 0:
        words = tl.trans(tl.reshape(mma_words(qw_ptr, e, s_qe, k0, N, n0, BLOCK_N, BLOCK_K),
                                    (BLOCK_N, BLOCK_K // 8)))
    else:
        i_ok = k0 // 8 + offs_i < k_end // 8
        w_mask = n_ok[None, :] if EVEN_K else i_ok[:, None] & n_ok[None, :]  # EVEN_K: every tile is whole
        words = tl.load(qw_ptr + e * s_qe + (k0 // 8 + offs_i)[:, None] * s_qk + offs_n[None, :] * s_qn,
                        mask=w_mask, other=0)
    return words


@triton.jit
def _gemv_kernel(
    x_ptr, rows_ptr, row_expert_ptr, out_ptr, row_scale_ptr, sum_ptr, tile_done_ptr,
    qw_ptr, sc_ptr, qz_ptr, gi_ptr, qw2_ptr, sc2_ptr, qz2_ptr, gi2_ptr,
    N, K, k_per_split, group_size, zero_offset,
    s_xm, s_xk, s_os, s_om, s_on, s_fm, s_fn,
    s_qe, s_qk, s_qn, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, s_ge, s_gk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_ROWS: tl.constexpr, HAS_EXPERTS: tl.constexpr, HAS_GIDX: tl.constexpr, FUSE_GATE_UP: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr, MMA_ORDER: tl.constexpr = 0,
    SUM_IN_KERNEL: tl.constexpr = False,
):
    """One row times one column tile over one K split. The tile's packed words [BK/8, BN] are used as they
    were loaded: row 8i + J of the tile is nibble J of word row i, so x's tile, loaded whole (8 strided
    plane loads cost 62 more instructions per tile on sm_90), is split into its 8 planes (columns 8i + J),
    and the products accumulate elementwise in [BK/8, BN], reduced across rows once at the end. Without
    g_idx the tile lies in one group: acc += s * (sum_J x_J q_J - z * sum_J x_J), one scale and zero per
    column.
    PARTIAL (split K): fp32 sums, gate and up side by side when fused, SiLU and the sum over splits after
    (SUM_IN_KERNEL: by the row tile's last split, as int4_gemm._gemm_kernel's)."""
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    row = p
    if HAS_ROWS:
        row = tl.load(rows_ptr + p)
    e = 0
    if HAS_EXPERTS:
        e = tl.load(row_expert_ptr + p)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_i = tl.arange(0, BLOCK_K // 8)
    acc = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_row = x_ptr + row * s_xm
    opaque_zero = K >> 31  # 0 (K > 0) that the compiler cannot fold: see nibble_planes
    g, g_end = first_group(k_start, group_size)
    for k0 in range(k_start, k_end, BLOCK_K):
        i_ok = k0 // 8 + offs_i < k_end // 8
        w_mask = n_ok[None, :] if EVEN_K else i_ok[:, None] & n_ok[None, :]  # EVEN_K: every tile is whole
        wq = nibble_planes(_gemv_words(qw_ptr, e, s_qe, s_qk, s_qn, k0, k_end, N, n0, offs_i, offs_n, n_ok, EVEN_K,
                                       MMA_ORDER, BLOCK_K, BLOCK_N), opaque_zero)
        wq2 = wq
        if FUSE_GATE_UP:
            wq2 = nibble_planes(_gemv_words(qw2_ptr, e, s_qe, s_qk, s_qn, k0, k_end, N, n0, offs_i, offs_n, n_ok,
                                            EVEN_K, MMA_ORDER, BLOCK_K, BLOCK_N), opaque_zero)
        t = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        t2 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        xr = tl.zeros((BLOCK_K // 8,), dtype=tl.float32)
        offs_k8 = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            xt = tl.load(x_row + offs_k8 * s_xk).to(tl.float32)
        else:
            xt = tl.load(x_row + offs_k8 * s_xk, mask=offs_k8 < k_end, other=0.0).to(tl.float32)
        xplanes = _x_planes(xt, MMA_ORDER, BLOCK_K)
        for J in tl.static_range(8):
            xj = xplanes[J]
            if HAS_GIDX:  # scales and zeros per element
                offs_k = k0 + 8 * offs_i + J
                gk = tl.load(gi_ptr + e * s_ge + offs_k * s_gk, mask=i_ok, other=0)
                s, z = group_params(sc_ptr, qz_ptr, e, gk[:, None], offs_n[None, :], w_mask,
                                    s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset)
                t += xj[:, None] * ((wq[J] - z) * s)
                if FUSE_GATE_UP:
                    g2 = tl.load(gi2_ptr + e * s_ge + offs_k * s_gk, mask=i_ok, other=0)
                    s2, z2 = group_params(sc2_ptr, qz2_ptr, e, g2[:, None], offs_n[None, :], w_mask,
                                          s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset)
                    t2 += xj[:, None] * ((wq2[J] - z2) * s2)
            else:
                xr += xj
                t += xj[:, None] * wq[J]
                if FUSE_GATE_UP:
                    t2 += xj[:, None] * wq2[J]
        if HAS_GIDX:
            acc += t
            acc2 += t2
        else:
            s, z = group_params(sc_ptr, qz_ptr, e, g, offs_n, n_ok, s_se, s_sg, s_sn, s_ze, s_zg, s_zn,
                                zero_offset)
            acc += s[None, :] * (t - z[None, :] * xr[:, None])
            if FUSE_GATE_UP:
                s2, z2 = group_params(sc2_ptr, qz2_ptr, e, g, offs_n, n_ok, s_se, s_sg, s_sn, s_ze, s_zg, s_zn,
                                      zero_offset)
                acc2 += s2[None, :] * (t2 - z2[None, :] * xr[:, None])
        g, g_end = next_group(g, g_end, k0 + BLOCK_K, group_size)
    res = tl.sum(acc, axis=0)
    out = out_ptr + pid_k * s_os + p * s_om + offs_n * s_on
    if FUSE_GATE_UP:
        res2 = tl.sum(acc2, axis=0)
        if PARTIAL:
            tl.store(out + N * s_on, res2, mask=n_ok)
        else:
            res = res / (1.0 + tl.exp(-res)) * res2
    if HAS_ROW_SCALE:
        res = res * tl.load(row_scale_ptr + p).to(tl.float32)
    tl.store(out, res.to(out_ptr.dtype.element_ty), mask=n_ok)
    if SUM_IN_KERNEL:
        last_split_sums(out_ptr, s_os, p * s_om + offs_n * s_on, N * s_on, sum_ptr + p * s_fm + offs_n * s_fn,
                        n_ok, tile_done_ptr + p * tl.num_programs(1) + pid_n, FUSE_GATE_UP)


def gemv(x: torch.Tensor, w: Int4Weights, w2: Int4Weights | None = None, rows: torch.Tensor | None = None,
         row_expert: torch.Tensor | None = None, row_scale: torch.Tensor | None = None,
         n_rows: int | None = None, config: configs.GemvConfig | None = None, moe: bool = False,
         sum_splits: bool = True) -> torch.Tensor:
    """out [n_rows, N]: row p = x[rows[p]] @ W_{row_expert[p]}, optionally fused gate/up and row scale.
    `moe`: the table's MoE entry (configs.MOE_GEMV_TABLE) instead of the dense one. `sum_splits=False` (not
    fused): the split-K partials as they are, [splits, n_rows, N] (fp32 when split), for a caller that sums
    them itself (the MoE's combine)."""
    P = n_rows if n_rows is not None else x.shape[0]
    plan = _gemv_plan(x, w, w2, P, config, moe, sum_splits)
    if plan is None:
        return torch.empty(*(() if sum_splits else (1,)), 0, w.N, device=x.device, dtype=x.dtype)
    xc, cdt, cfg, bk, k_per, out = plan
    fused = w2 is not None
    w2a = w2.args() if fused else w.args()
    dummy = out
    grid = (P, cdiv(w.N, cfg.block_n), out.shape[0])
    in_kernel, total, tile_done = sum_target(out.shape[0], sum_splits, cfg, P, w, cdt, grid, dummy)
    _gemv_kernel[grid](
        xc, rows if rows is not None else dummy, row_expert if row_expert is not None else dummy, out,
        row_scale if row_scale is not None else dummy, total, tile_done,
        *w.args(), *w2a,
        w.N, w.K, k_per, w.group_size, w.zero_offset,
        xc.stride(0), xc.stride(1), out.stride(0), out.stride(1), out.stride(2), total.stride(-2), total.stride(-1),
        *w.strides(),
        BLOCK_N=cfg.block_n, BLOCK_K=bk,
        HAS_ROWS=rows is not None, HAS_EXPERTS=row_expert is not None, HAS_GIDX=w.g_idx is not None,
        FUSE_GATE_UP=fused, HAS_ROW_SCALE=row_scale is not None, PARTIAL=out.shape[0] > 1, EVEN_K=w.K % bk == 0,
        MMA_ORDER=w.mma_order, SUM_IN_KERNEL=in_kernel, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out if not sum_splits else split_result(out, x, w, cdt, fused, total if in_kernel else None)


def _gemv_plan(x: torch.Tensor, w: Int4Weights, w2: Int4Weights | None, P: int, config, moe: bool,
               sum_splits: bool):
    """gemv's argument checks, config (the table's, its split-K trimmed to fill the GPU for P programs per
    column tile), K tile and split, and output [splits, P, N] (2N: fused gate/up partials). None for P = 0."""
    check_x(x, w)
    check_pair(w, w2)
    check_partials(sum_splits, w2)
    cdt = int4_launch.compute_dtype(x)
    arch = int4_launch.device_arch(x.device)
    interp = configs.INTERPRET_MOE_GEMV if moe else configs.INTERPRET_GEMV
    cfg = config or (interp if arch is None else configs.gemv_config(arch, moe))
    if config is None and arch is not None:
        programs = P * cdiv(w.N, cfg.block_n)
        cfg = configs.gemv_split_to_fill(cfg, programs, w.K, int4_launch.sm_count(x.device.index or 0))
    if P == 0:
        return None
    bk = block_k_for(cfg.block_k, w)
    k_per, split = k_splits(w.K, cfg.split_k, bk)
    return int4_launch.as_dtype(x, cdt), cdt, cfg, bk, k_per, split_buffer(split, P, w, w2 is not None, cdt, x.device)
