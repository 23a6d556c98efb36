"""The INT4 GEMM: x [M, K] (16 bits or fp32) times GPTQ INT4 weights dequantized inside the kernel, for dense
linears and MoE experts (shared DESIGN.md sections 3, 4, 7).

`_gemm_kernel`: tiles of BLOCK_M rows with tl.dot and fp32 accumulation, split-K for small M (int4_split_k.py).
Rows may be gathered through an index (MoE: tokens sorted and padded per expert, one expert per tile). It can
fuse SiLU(gate) * up (two weight sets, two accumulators) and a per-row scale (routing weight). A weight tile
is multiplied in the MMA order (_mma_tile_product), as 8 nibble planes (_plane_tile_product) or unpacked
(_tile_product). `gemm` launches it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from clover_lite.kernels import configs, int4_launch
from clover_lite.kernels.host import cdiv
from clover_lite.kernels.int4_dequant import (
    biased_planes16,
    first_group,
    group_params,
    load_int4,
    mma_operand,
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
def _mma_tile_product(x, xsum, qw_ptr, sc_ptr, qz_ptr, e, n0, offs_n, n_ok, k0, g, N,
                      s_qe, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset, opaque_zero,
                      ORDER: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr = False):
    """x [BM, BK] (natural column order) times the tile of weights in the MMA order, one group:
    s * (x . q - z * sum(x)), with B folded into z for 16-bit operands. SWAP: the same product transposed,
    [BN, BM] = W^T x^T, the weights as the dot's first operand: with kWidth 4 (order 4) x as the first
    operand is copied register by register into every MMA's operand quad, as the second it loads into place
    (configs.mma_swap says where that pays)."""
    words = mma_words(qw_ptr, e, s_qe, k0, N, n0, offs_n.shape[0], BLOCK_K)
    w = mma_operand(words, opaque_zero, x.dtype, ORDER, BLOCK_K, offs_n.shape[0], SWAP)
    s, z = group_params(sc_ptr, qz_ptr, e, g, offs_n, n_ok, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset)
    if x.dtype != tl.float32:
        z += 128.0 if x.dtype == tl.bfloat16 else 1024.0
    if SWAP:
        a, b = w, tl.trans(x)
    else:
        a, b = x, w
    if x.dtype == tl.float32:
        xq = tl.dot(a, b, input_precision="ieee")
    else:
        xq = tl.dot(a, b)
    if SWAP:  # (one return: Triton takes the branches' shapes as one function's)
        res = s[:, None] * (xq - z[:, None] * xsum[None, :])
    else:
        res = s[None, :] * (xq - z[None, :] * xsum[:, None])
    return res


@triton.jit
def _plane_tile_product(xplanes, xsum, qw_ptr, sc_ptr, qz_ptr, e, offs_n, n_ok, k0, k_end, g,
                        s_qe, s_qk, s_qn, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset, opaque_zero,
                        DOT_IEEE: tl.constexpr, BLOCK_K: tl.constexpr):
    """x times the weight tile of rows k0.. (one group, BLOCK_K >= 128) as 8 dots over nibble planes: plane
    J [BK/8, BN] holds rows k0 + 8i + J, in the layout the words were loaded in, against x's columns
    k0 + 8i + J (xplanes, from split_planes; xsum: x's row sums in fp32). Its floats come from bit
    operations: exact q for fp32 dots (nibble_planes), B + q for 16-bit ones (biased_planes16), B then
    removed with the zero point; padding words (0) become B, against x columns masked to 0. Expanding the
    words to [BK, BN] instead stored every dequantized element to shared memory on its own after an
    int-to-float conversion per weight (sm_90, per thread per tile: 771 instructions, 131 conversions;
    this way 578 and 1)."""
    offs_i = tl.arange(0, BLOCK_K // 8)
    i_ok = k0 // 8 + offs_i < k_end // 8
    words = tl.load(qw_ptr + e * s_qe + (k0 // 8 + offs_i)[:, None] * s_qk + offs_n[None, :] * s_qn,
                    mask=i_ok[:, None] & n_ok[None, :], other=0)
    dtype: tl.constexpr = xplanes[0].dtype
    xq = tl.zeros((xsum.shape[0], offs_n.shape[0]), dtype=tl.float32)
    if DOT_IEEE:
        wq = nibble_planes(words, opaque_zero)
        for J in tl.static_range(8):
            xq = tl.dot(xplanes[J], wq[J], xq, input_precision="ieee")
    else:
        wq = biased_planes16(words, dtype)
        for J in tl.static_range(8):
            xq = tl.dot(xplanes[J], wq[J], xq)
    s, z = group_params(sc_ptr, qz_ptr, e, g, offs_n, n_ok, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset)
    if not DOT_IEEE:
        z += 128.0 if dtype == tl.bfloat16 else 1024.0
    return s[None, :] * (xq - z[None, :] * xsum[:, None])


@triton.jit
def _tile_product(x, qw_ptr, sc_ptr, qz_ptr, gi_ptr, e, offs_k, offs_n, k_ok, n_ok, k0, k_end, g,
                  s_qe, s_qk, s_qn, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, s_ge, s_gk,
                  zero_offset, HAS_GIDX: tl.constexpr, DOT_IEEE: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """x [BM, BK] (masked, in the dot dtype) times the dequantized weight tile [BK, BN] -> fp32 [BM, BN];
    g: the tile's group when there is no g_idx."""
    mask = k_ok[:, None] & n_ok[None, :]
    q = load_int4(qw_ptr, e, k0, k_end, offs_n, n_ok, s_qe, s_qk, s_qn, BLOCK_K, BLOCK_N)
    if HAS_GIDX:
        gk = tl.load(gi_ptr + e * s_ge + offs_k * s_gk, mask=k_ok, other=0)
        s, z = group_params(sc_ptr, qz_ptr, e, gk[:, None], offs_n[None, :], mask,
                            s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset)
        w = ((q.to(tl.float32) - z) * s).to(x.dtype)
        if DOT_IEEE:
            return tl.dot(x, w, input_precision="ieee")
        return tl.dot(x, w)
    # The whole tile is in one group: the integers go into the dot as they are (exact in 16 bits).
    s, z = group_params(sc_ptr, qz_ptr, e, g, offs_n, n_ok, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset)
    if DOT_IEEE:
        xq = tl.dot(x, q.to(x.dtype), input_precision="ieee")
    else:
        xq = tl.dot(x, q.to(x.dtype))
    xsum = tl.sum(x.to(tl.float32), axis=1)
    return s[None, :] * (xq - z[None, :] * xsum[:, None])


@triton.jit
def _gemm_kernel(
    x_ptr, rows_ptr, tile_expert_ptr, out_ptr, row_scale_ptr, sum_ptr, tile_done_ptr,
    qw_ptr, sc_ptr, qz_ptr, gi_ptr, qw2_ptr, sc2_ptr, qz2_ptr, gi2_ptr,
    M, N, K, k_per_split, group_size, zero_offset,
    s_xm, s_xk, s_os, s_om, s_on, s_fm, s_fn,
    s_qe, s_qk, s_qn, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, s_ge, s_gk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_ROWS: tl.constexpr, HAS_EXPERTS: tl.constexpr, HAS_GIDX: tl.constexpr, FUSE_GATE_UP: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr, DOT_IEEE: tl.constexpr, PLANES: tl.constexpr, PARTIAL: tl.constexpr,
    MMA_ORDER: tl.constexpr = 0, MMA_SWAP: tl.constexpr = False, SUM_IN_KERNEL: tl.constexpr = False,
):
    """SUM_IN_KERNEL (with PARTIAL): the last split of each output tile sums the tile's partials into sum_ptr
    [M, N] (last_split_sums), instead of a launch of int4_split_k._sum_splits after this one.
    MMA_SWAP (weights in the MMA order): the tile accumulated transposed, [BN, BM] (_mma_tile_product)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if HAS_ROWS:  # gathered rows (MoE): -1 marks padding
        rows = tl.load(rows_ptr + offs_m, mask=m_ok, other=-1)
        row_ok = m_ok & (rows >= 0)
    else:
        rows = offs_m
        row_ok = m_ok
    e = 0
    if HAS_EXPERTS:
        e = tl.load(tile_expert_ptr + pid_m)
    if MMA_SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    opaque_zero = K >> 31  # see nibble_planes
    g, g_end = first_group(k_start, group_size)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(x_ptr + rows[:, None] * s_xm + offs_k[None, :] * s_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if MMA_ORDER != 0:  # weights in the MMA order (mma_layout.py): x as it is, one tile a group
            xsum = tl.sum(x.to(tl.float32), axis=1)
            acc += _mma_tile_product(x, xsum, qw_ptr, sc_ptr, qz_ptr, e, n0, offs_n, n_ok, k0, g, N, s_qe, s_se, s_sg,
                                     s_sn, s_ze, s_zg, s_zn, zero_offset, opaque_zero, MMA_ORDER, BLOCK_K, MMA_SWAP)
            if FUSE_GATE_UP:
                acc2 += _mma_tile_product(x, xsum, qw2_ptr, sc2_ptr, qz2_ptr, e, n0, offs_n, n_ok, k0, g, N, s_qe, s_se,
                                          s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset, opaque_zero, MMA_ORDER, BLOCK_K,
                                          MMA_SWAP)
        elif PLANES:
            xplanes = split_planes(tl.reshape(x, (BLOCK_M, BLOCK_K // 8, 8)))  # plane J: columns k0 + 8i + J
            xsum = tl.sum(x.to(tl.float32), axis=1)
            acc += _plane_tile_product(xplanes, xsum, qw_ptr, sc_ptr, qz_ptr, e, offs_n, n_ok, k0, k_end, g,
                                       s_qe, s_qk, s_qn, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset,
                                       opaque_zero, DOT_IEEE, BLOCK_K)
            if FUSE_GATE_UP:
                acc2 += _plane_tile_product(xplanes, xsum, qw2_ptr, sc2_ptr, qz2_ptr, e, offs_n, n_ok, k0, k_end, g,
                                            s_qe, s_qk, s_qn, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset,
                                            opaque_zero, DOT_IEEE, BLOCK_K)
        else:
            acc += _tile_product(x, qw_ptr, sc_ptr, qz_ptr, gi_ptr, e, offs_k, offs_n, k_ok, n_ok, k0, k_end, g,
                                 s_qe, s_qk, s_qn, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, s_ge, s_gk,
                                 zero_offset, HAS_GIDX, DOT_IEEE, BLOCK_K, BLOCK_N)
            if FUSE_GATE_UP:
                acc2 += _tile_product(x, qw2_ptr, sc2_ptr, qz2_ptr, gi2_ptr, e, offs_k, offs_n, k_ok, n_ok, k0, k_end,
                                      g, s_qe, s_qk, s_qn, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, s_ge, s_gk,
                                      zero_offset, HAS_GIDX, DOT_IEEE, BLOCK_K, BLOCK_N)
        g, g_end = next_group(g, g_end, k0 + BLOCK_K, group_size)
    if MMA_SWAP:  # once per program, back to [BM, BN] for the epilogue
        acc = tl.trans(acc)
        acc2 = tl.trans(acc2)
    out = out_ptr + pid_k * s_os + offs_m[:, None] * s_om + offs_n[None, :] * s_on
    if FUSE_GATE_UP:
        if PARTIAL:  # split K: gate's and up's sums side by side; SiLU after the sum (int4_split_k._sum_splits)
            tl.store(out + N * s_on, acc2, mask=m_ok[:, None] & n_ok[None, :])
        else:
            acc = acc / (1.0 + tl.exp(-acc)) * acc2  # silu(gate) * up
    if HAS_ROW_SCALE:
        acc = acc * tl.load(row_scale_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    if SUM_IN_KERNEL:
        last_split_sums(out_ptr, s_os, offs_m[:, None] * s_om + offs_n[None, :] * s_on, N * s_on,
                        sum_ptr + offs_m[:, None] * s_fm + offs_n[None, :] * s_fn, m_ok[:, None] & n_ok[None, :],
                        tile_done_ptr + pid_m * tl.num_programs(1) + pid_n, FUSE_GATE_UP)


def gemm(x: torch.Tensor, w: Int4Weights, w2: Int4Weights | None = None, rows: torch.Tensor | None = None,
         tile_expert: torch.Tensor | None = None, row_scale: torch.Tensor | None = None, n_rows: int | None = None,
         config: configs.GemmConfig | None = None, planes: bool | None = None,
         sum_splits: bool = True) -> torch.Tensor:
    """out [n_rows, N] = x[rows] @ W_e (per tile expert), optionally silu(x W) * (x W2) and * row_scale.
    `planes`: dot the packed words as 8 nibble planes (default: the config's choice, where possible: no g_idx,
    K tile >= 128); False keeps the unpacked [BK, BN] tile, which benchmarks/kernels.py times side by side.
    `sum_splits=False` (not fused): the split-K partials [splits, n_rows, N] as they are."""
    check_x(x, w)
    check_partials(sum_splits, w2)
    check_pair(w, w2)
    cdt = int4_launch.compute_dtype(x)
    xc = int4_launch.as_dtype(x, cdt)
    M = n_rows if n_rows is not None else x.shape[0]
    cfg = config
    arch = int4_launch.device_arch(x.device)
    if cfg is None:
        cfg = int4_launch.fill_split(int4_launch.gemm_config_for(x.device, M), M, w.N, x.device)
        if arch is not None and os.environ.get("CLOVER_AUTOTUNE", "0") == "1":
            bucket = next(b for b in configs.M_BUCKETS if M <= b)
            key = (x.device.index, bucket, w.N, w.K, w2 is not None, w.g_idx is not None, rows is not None, planes)
            cfg = int4_launch.autotune(
                key, configs.autotune_configs(arch, M, base=cfg),
                lambda c: gemm(x, w, w2, rows, tile_expert, row_scale, n_rows, config=c, planes=planes))
    if arch is not None and w.g_idx is not None:  # gathered scales and zeros: a narrower K tile must fit
        cfg = configs.for_gathered_groups(cfg, arch, fused=w2 is not None)
    if arch is not None and w.mma_order:
        cfg = configs.for_mma_order(cfg, arch)
    bk = block_k_for(cfg.block_k, w)
    k_per, split = k_splits(w.K, cfg.split_k, bk)
    use_planes = w.g_idx is None and bk >= 128 and (cfg.planes if planes is None else planes)
    fused = w2 is not None
    out = split_buffer(split, M, w, fused, cdt, x.device)
    grid = (cdiv(M, cfg.block_m), cdiv(w.N, cfg.block_n), split)
    w2a = w2.args() if w2 is not None else w.args()
    dummy = out
    in_kernel, total, tile_done = sum_target(split, sum_splits, cfg, M, w, cdt, grid, dummy)
    _gemm_kernel[grid](
        xc, rows if rows is not None else dummy, tile_expert if tile_expert is not None else dummy, out,
        row_scale if row_scale is not None else dummy, total, tile_done,
        *w.args(), *w2a,
        M, w.N, w.K, k_per, w.group_size, w.zero_offset,
        xc.stride(0), xc.stride(1), out.stride(0), out.stride(1), out.stride(2), total.stride(-2), total.stride(-1),
        *w.strides(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk,
        HAS_ROWS=rows is not None, HAS_EXPERTS=tile_expert is not None, HAS_GIDX=w.g_idx is not None,
        FUSE_GATE_UP=w2 is not None, HAS_ROW_SCALE=row_scale is not None, DOT_IEEE=cdt == torch.float32,
        PLANES=use_planes, PARTIAL=split > 1, MMA_ORDER=w.mma_order,
        MMA_SWAP=bool(w.mma_order) and configs.mma_swap(cfg, arch, w.mma_order, fp32=cdt == torch.float32),
        SUM_IN_KERNEL=in_kernel, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out if not sum_splits else split_result(out, x, w, cdt, fused, total if in_kernel else None)
