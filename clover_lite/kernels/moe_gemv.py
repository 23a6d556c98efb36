"""The MoE's GEMV with two pairs of one expert in one program (GemvConfig.rows == 2).

w4a16._gemv_kernel runs one program per (token, expert) pair and column tile. It is bound by instruction
issue, not by memory: about 4.3 SASS instructions per weight and pair (sm_90), of which the nibble planes
(a LOP3 and an FADD per weight) are the same for every pair of an expert; pairs of one expert run side by
side, so their weight loads mostly hit L2. At a 32-token block an expert holds ~1.6 pairs (58% one, 29% two,
10% three under uniform routing). Here the pairs, sorted by expert (moe_route.sort_pairs), go two at a time
to the program of the first of them (its rank among its expert's pairs is even): the planes are made once
and multiplied into both rows. The other programs run no K loop and store nothing.
The arithmetic is the ungrouped kernel's: per K tile inside one group, s * (sum_J x_J q_J - z * sum_J x_J).
Weights with an act-order g_idx are left to the ungrouped kernel (the modules repack them by group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from clover_lite.kernels import configs
from clover_lite.kernels.host import cdiv
from clover_lite.kernels.w4a16 import (
    Int4Weights,
    _first_group,
    _gemv_plan,
    _gemv_words,
    _group_params,
    _next_group,
    _nibble_planes,
    _split_result,
    _x_planes,
)


@triton.jit
def _row_tile(x_row, offs_k, k_end, s_xk, ORDER: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row's x tile [BK] as its 8 planes [BK/8] (w4a16._x_planes), fp32, and their sum."""
    xt = tl.load(x_row + offs_k * s_xk, mask=offs_k < k_end, other=0.0).to(tl.float32)
    xp = _x_planes(xt, ORDER, BLOCK_K)
    return xp, xp[0] + xp[1] + xp[2] + xp[3] + xp[4] + xp[5] + xp[6] + xp[7]


@triton.jit
def _grouped_gemv_kernel(
    x_ptr, rows_ptr, expert_ptr, rank_ptr, count_ptr, out_ptr, row_scale_ptr,
    qw_ptr, sc_ptr, qz_ptr, qw2_ptr, sc2_ptr, qz2_ptr,
    N, K, k_per_split, group_size, zero_offset,
    s_xm, s_xk, s_os, s_om, s_on,
    s_qe, s_qk, s_qn, s_se, s_sg, s_sn, s_ze, s_zg, s_zn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_ROWS: tl.constexpr, FUSE_GATE_UP: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, PARTIAL: tl.constexpr,
    EVEN_K: tl.constexpr, MMA_ORDER: tl.constexpr = 0,
):
    """Two pairs of one expert: the ungrouped kernel's 2-D tiles and arithmetic, with each nibble plane
    (a LOP3 and an FADD per weight) made once and multiplied into both rows (an FFMA per weight and row).
    The second row's work sits behind a branch that is uniform across the program, so an expert holding one
    pair costs what the ungrouped kernel does. (A [rows, BK/8, BN] form of the same idea compiled to ~8
    instructions per weight for 2 rows against ~4.3 per weight and row ungrouped, and spilled at 2 warps:
    benchmarks/compile_check.py.)"""
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rank = tl.load(rank_ptr + p)
    leads = rank % 2 == 0
    e = tl.load(expert_ptr + p)
    two = leads & (tl.load(count_ptr + p) - rank > 1)
    row0 = p
    row1 = p + 1
    if HAS_ROWS:
        row0 = tl.load(rows_ptr + p)
        row1 = tl.load(rows_ptr + p + 1, mask=two, other=0)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_i = tl.arange(0, BLOCK_K // 8)
    acc0 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    acc0b = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    acc1b = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.where(leads, tl.minimum(k_start + k_per_split, K), k_start)  # a follower runs no K loop
    opaque_zero = K >> 31  # see w4a16._nibble_planes
    g, g_end = _first_group(k_start, group_size)
    for k0 in range(k_start, k_end, BLOCK_K):
        wq = _nibble_planes(_gemv_words(qw_ptr, e, s_qe, s_qk, s_qn, k0, k_end, N, n0, offs_i, offs_n, n_ok, EVEN_K,
                                        MMA_ORDER, BLOCK_K, BLOCK_N), opaque_zero)
        wq2 = wq
        if FUSE_GATE_UP:
            wq2 = _nibble_planes(_gemv_words(qw2_ptr, e, s_qe, s_qk, s_qn, k0, k_end, N, n0, offs_i, offs_n, n_ok,
                                             EVEN_K, MMA_ORDER, BLOCK_K, BLOCK_N), opaque_zero)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xp0, xr0 = _row_tile(x_ptr + row0 * s_xm, offs_k, k_end, s_xk, MMA_ORDER, BLOCK_K)
        s, z = _group_params(sc_ptr, qz_ptr, e, g, offs_n, n_ok, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset)
        s2, z2 = s, z
        if FUSE_GATE_UP:
            s2, z2 = _group_params(sc2_ptr, qz2_ptr, e, g, offs_n, n_ok, s_se, s_sg, s_sn, s_ze, s_zg, s_zn,
                                   zero_offset)
        t0 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        t0b = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        if two:
            xp1, xr1 = _row_tile(x_ptr + row1 * s_xm, offs_k, k_end, s_xk, MMA_ORDER, BLOCK_K)
            t1 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
            t1b = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
            for J in tl.static_range(8):
                t0 += xp0[J][:, None] * wq[J]
                t1 += xp1[J][:, None] * wq[J]
                if FUSE_GATE_UP:
                    t0b += xp0[J][:, None] * wq2[J]
                    t1b += xp1[J][:, None] * wq2[J]
            acc1 += s[None, :] * (t1 - z[None, :] * xr1[:, None])
            if FUSE_GATE_UP:
                acc1b += s2[None, :] * (t1b - z2[None, :] * xr1[:, None])
        else:
            for J in tl.static_range(8):
                t0 += xp0[J][:, None] * wq[J]
                if FUSE_GATE_UP:
                    t0b += xp0[J][:, None] * wq2[J]
        acc0 += s[None, :] * (t0 - z[None, :] * xr0[:, None])
        if FUSE_GATE_UP:
            acc0b += s2[None, :] * (t0b - z2[None, :] * xr0[:, None])
        g, g_end = _next_group(g, g_end, k0 + BLOCK_K, group_size)
    out = out_ptr + pid_k * s_os + offs_n * s_on
    _store_row(out + p * s_om, acc0, acc0b, row_scale_ptr + p, leads, offs_n, N, N * s_on,
               FUSE_GATE_UP, HAS_ROW_SCALE, PARTIAL)
    _store_row(out + (p + 1) * s_om, acc1, acc1b, row_scale_ptr + p + 1, two, offs_n, N, N * s_on,
               FUSE_GATE_UP, HAS_ROW_SCALE, PARTIAL)


@triton.jit
def _store_row(out, acc, acc2, scale_ptr, row_ok, offs_n, N, up_offset, FUSE_GATE_UP: tl.constexpr,
               HAS_ROW_SCALE: tl.constexpr, PARTIAL: tl.constexpr):
    """One pair's output row from its [BK/8, BN] sums: split-K partials (gate and up side by side), or
    silu(gate) * up, times the routing weight; nothing when row_ok is false."""
    mask = offs_n < tl.where(row_ok, N, 0)  # (the interpreter rejects a block mask ANDed with a scalar one)
    res = tl.sum(acc, axis=0)
    if FUSE_GATE_UP:
        res2 = tl.sum(acc2, axis=0)
        if PARTIAL:
            tl.store(out + up_offset, res2, mask=mask)
        else:
            res = res / (1.0 + tl.exp(-res)) * res2
    if HAS_ROW_SCALE:
        res = res * tl.load(scale_ptr, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out, res.to(out.dtype.element_ty), mask=mask)


def grouped_gemv(x: torch.Tensor, w: Int4Weights, expert: torch.Tensor, rank: torch.Tensor, count: torch.Tensor,
                 w2: Int4Weights | None = None, rows: torch.Tensor | None = None,
                 row_scale: torch.Tensor | None = None, config: configs.GemvConfig | None = None,
                 sum_splits: bool = True) -> torch.Tensor:
    """out [P, N]: row p = x[rows[p]] @ W_{expert[p]} (optionally silu(gate) * up fused, times row_scale[p]),
    for P pairs sorted by expert with each one's rank among its expert's pairs and that expert's pair count
    (moe_route.ExpertPairs). As w4a16.gemv(..., moe=True), whose table entry gives the tile;
    `sum_splits=False` returns the split-K partials [splits, P, N] as they are (not fused)."""
    if w.g_idx is not None:
        raise ValueError("the grouped GEMV takes weights without an act-order g_idx (repacked by group at load)")
    P = expert.numel()
    # Programs that do work: about one per expert touched and column tile (P / 2 is a lower bound).
    plan = _gemv_plan(x, w, w2, P, config, True, sum_splits, pairs_per_program=2)
    if plan is None:
        return torch.empty(*(() if sum_splits else (1,)), 0, w.N, device=x.device, dtype=x.dtype)
    xc, cdt, cfg, bk, k_per, out = plan
    fused = w2 is not None
    w2a = w2.args()[:3] if fused else w.args()[:3]
    dummy = out
    _grouped_gemv_kernel[(P, cdiv(w.N, cfg.block_n), out.shape[0])](
        xc, rows if rows is not None else dummy, expert, rank, count, out,
        row_scale if row_scale is not None else dummy,
        *w.args()[:3], *w2a,
        w.N, w.K, k_per, w.group_size, w.zero_offset,
        xc.stride(0), xc.stride(1), out.stride(0), out.stride(1), out.stride(2),
        *w.strides()[:9],
        BLOCK_N=cfg.block_n, BLOCK_K=bk,
        HAS_ROWS=rows is not None, FUSE_GATE_UP=fused, HAS_ROW_SCALE=row_scale is not None,
        PARTIAL=out.shape[0] > 1, EVEN_K=w.K % bk == 0, MMA_ORDER=w.mma_order, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out if not sum_splits else _split_result(out, x, w, cdt, fused)
