"""W4A16: activations in 16 bits (or fp32) times GPTQ INT4 weights, dequantized inside the kernel.

Two Triton kernels serve both dense linears and MoE experts (shared DESIGN.md sections 3, 4, 7):
- `_gemm_kernel`: tiles of BLOCK_M rows with tl.dot and fp32 accumulation, split-K for small M. Rows may be
  gathered through an index (MoE: tokens sorted and padded per expert, one expert per tile).
- `_gemv_kernel`: one row per program, no tl.dot: for M <= 4 and for MoE experts holding ~1-2 rows each,
  where padding every expert to a 16-row tile would waste most of the work. It works on the packed words as
  loaded (nibble planes, no int-to-float conversion) and splits K when too few programs would fill the GPU.
Both can fuse SiLU(gate) * up (two weight sets, two accumulators) and a per-row scale (routing weight).
With K split, each split stores fp32 partials and the last split of each output tile to finish sums them in
the same launch (_last_split_sums: an atomic counter per tile), where a second launch used to.
When BLOCK_K stays inside one group (no act-order g_idx) the scale and zero apply once per tile:
out += s * (x . q - z * sum(x)) (DESIGN section 7); with an act-order g_idx they are gathered per element
(the modules avoid that: kernels/forwards.py reorders desc_act rows by group once, and x's columns are
gathered instead, see Int4Weights.perm). Weights whose groups are whole 128-row blocks are then rearranged
into the order of the tensor cores' operand registers (mma_layout.py, Int4Weights.mma_order): the GEMM builds
its operand from 16-byte loads with no shuffles (_mma_tile_product), the GEMV reads the same words.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from clover_lite.kernels import configs, mma_layout
from clover_lite.kernels.host import cdiv, interpreting


@triton.jit
def _load_int4(qw_ptr, e, k0, k_end, offs_n, n_ok, s_qe, s_qk, s_qn,
               BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Integers [BLOCK_K, BLOCK_N] of rows k0.. : the packed words [BLOCK_K/8, BLOCK_N] are loaded once and
    each is expanded to its 8 rows in registers (row k is nibble k % 8 of word k // 8)."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(qw_ptr + e * s_qe + offs_w[:, None] * s_qk + offs_n[None, :] * s_qn,
                    mask=(offs_w[:, None] < k_end // 8) & n_ok[None, :], other=0)
    words = tl.reshape(tl.broadcast_to(words[:, None, :], (BLOCK_K // 8, 8, BLOCK_N)), (BLOCK_K, BLOCK_N))
    shifts = (tl.arange(0, BLOCK_K) % 8) * 4
    return (words >> shifts[:, None]) & 0xF


@triton.jit
def _group_params(sc_ptr, qz_ptr, e, g, offs_n, mask, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset):
    """Scales and true zeros (fp32) for group indices g (broadcastable against offs_n)."""
    s = tl.load(sc_ptr + e * s_se + g * s_sg + offs_n * s_sn, mask=mask, other=0.0).to(tl.float32)
    zw = tl.load(qz_ptr + e * s_ze + g * s_zg + (offs_n // 8) * s_zn, mask=mask, other=0)
    z = ((zw >> ((offs_n % 8) * 4)) & 0xF) + zero_offset
    return s, z.to(tl.float32)


@triton.jit
def _first_group(k_start, group_size):
    """Group of the tile at k_start and where that group ends. Tiles never straddle groups (their rows are a
    power of two dividing the group size), so the loop steps the group with _next_group instead of dividing
    (an integer division per tile costs ~20 instructions and, on sm_86, a call)."""
    g = k_start // group_size
    return g, (g + 1) * group_size


@triton.jit
def _next_group(g, g_end, k_next, group_size):
    step = (k_next >= g_end).to(tl.int32)
    return g + step, g_end + step * group_size


@triton.jit
def _nibble_planes(words, opaque_zero):
    """The 8 nibbles of each packed word (plane J holds rows 8i + J of the tile) as exact fp32 integers
    0..15, with no int-to-float conversion (the CUDA guide gives conversions 16 per clock per SM, an eighth
    of the FMA rate: one per weight would hold an H200 to about 44% of its bandwidth). Nibble J, masked in
    place at bit 4J, is ORed into the mantissa of 2**(23 - 4J), whose last place is worth 2**-4J, so the
    float is 2**(23 - 4J) + q and one subtraction leaves q. Nibbles 5-7 are first shifted down 20 bits (the
    mantissa has 23). `opaque_zero` is a run-time 0 added to the exponent constant: with both constants
    known, ptxas keeps the masks in registers it re-creates by a MOV per nibble; this way the OR is one
    LOP3 per nibble. All 8 in one call: the interpreter re-patches triton.language on every call of a jit
    function (one call per plane cost the interpreted GEMV ~10% more time)."""
    hi = words >> 20
    return (((words & 0xF) | (((127 + 23) << 23) + opaque_zero)).to(tl.float32, bitcast=True) - 8388608.0,
            ((words & 0xF0) | (((127 + 19) << 23) + opaque_zero)).to(tl.float32, bitcast=True) - 524288.0,
            ((words & 0xF00) | (((127 + 15) << 23) + opaque_zero)).to(tl.float32, bitcast=True) - 32768.0,
            ((words & 0xF000) | (((127 + 11) << 23) + opaque_zero)).to(tl.float32, bitcast=True) - 2048.0,
            ((words & 0xF0000) | (((127 + 7) << 23) + opaque_zero)).to(tl.float32, bitcast=True) - 128.0,
            ((hi & 0xF) | (((127 + 23) << 23) + opaque_zero)).to(tl.float32, bitcast=True) - 8388608.0,
            ((hi & 0xF0) | (((127 + 19) << 23) + opaque_zero)).to(tl.float32, bitcast=True) - 524288.0,
            ((hi & 0xF00) | (((127 + 15) << 23) + opaque_zero)).to(tl.float32, bitcast=True) - 32768.0)


@triton.jit
def _biased_planes16(words, dtype: tl.constexpr):
    """The 8 nibbles of each word as the 16-bit floats B + q (B = 128 in bf16, 1024 in fp16: the nibble
    fills the low mantissa bits of B, whose last place is 1), each by a shift and one OR, no conversion."""
    b: tl.constexpr = 0x4300 if dtype == tl.bfloat16 else 0x6400
    return (((words & 15) | b).to(tl.int16).to(dtype, bitcast=True),
            (((words >> 4) & 15) | b).to(tl.int16).to(dtype, bitcast=True),
            (((words >> 8) & 15) | b).to(tl.int16).to(dtype, bitcast=True),
            (((words >> 12) & 15) | b).to(tl.int16).to(dtype, bitcast=True),
            (((words >> 16) & 15) | b).to(tl.int16).to(dtype, bitcast=True),
            (((words >> 20) & 15) | b).to(tl.int16).to(dtype, bitcast=True),
            (((words >> 24) & 15) | b).to(tl.int16).to(dtype, bitcast=True),
            (((words >> 28) & 15) | b).to(tl.int16).to(dtype, bitcast=True))


@triton.jit
def _split_planes(x):
    """x [..., 8] -> its 8 columns, in order (tl.split halves a last dim of 2: three times over)."""
    c0, c1 = tl.split(tl.reshape(x, x.shape[:-1] + (2, 2, 2)))
    b00, b01 = tl.split(c0)
    b10, b11 = tl.split(c1)
    p0, p4 = tl.split(b00)
    p2, p6 = tl.split(b01)
    p1, p5 = tl.split(b10)
    p3, p7 = tl.split(b11)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _mma_words(qw_ptr, e, s_qe, k0, N, n0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Words [BN, 4 t, BK/32 c] of rows k0 .. k0 + BK, columns n0 .. n0 + BN, of weights in the MMA order
    (kernels/mma_layout.py): 16 bytes per column and 128 rows, the whole tile contiguous at BK = 128. Loaded
    flat, with offsets the compiler sees as contiguous and aligned (16-byte copies; three-dimensional
    offsets compiled to 4-byte ones for sm_90)."""
    CB: tl.constexpr = BLOCK_K // 32
    f = tl.arange(0, BLOCK_N * 4 * CB)
    n = n0 + f // (4 * CB)
    base = qw_ptr + e * s_qe + (k0 // 128) * N * 16
    if CB == 4:
        words = tl.load(base + n0 * 16 + f, mask=n < N, other=0)
    else:  # the tile's 32-row slices c0 .. c0 + CB of each column's 4 x 4 words
        c0 = ((k0 // BLOCK_K) % (4 // CB)) * CB
        words = tl.load(base + n * 16 + (f % (4 * CB)) // CB * 4 + c0 + f % CB, mask=n < N, other=0)
    return tl.reshape(words, (BLOCK_N, 4, CB))


@triton.jit
def _mma_operand(words, opaque_zero, dtype: tl.constexpr, ORDER: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, SWAP: tl.constexpr = False):
    """The dot operand [BK, BN] from words [BN, 4 t, BK/32 c] in the MMA order: exact fp32 integers q, or
    16-bit floats B + q (B = 128 in bf16, 1024 in fp16) two per AND-OR: nibbles m and m + 4 under the masks
    0x000F000F are rows r and r + 1 of one operand register. The joins build [BN, t, c, h, m0, m1] (m = m0
    + 2 m1, nibble m + 4h) and the permute puts the rows in the order's sequence: laid out as the installed
    Triton's dot takes them when ORDER is mma_layout.kernel_order(). SWAP: its transpose [BN, BK], the
    dot's first operand, whose registers pair neighbouring K the same way (the same words serve both)."""
    if dtype == tl.float32:
        p = _nibble_planes(words, opaque_zero)
        q0, q1, q2, q3 = tl.join(p[0], p[4]), tl.join(p[1], p[5]), tl.join(p[2], p[6]), tl.join(p[3], p[7])
    else:
        b = (0x43004300 if dtype == tl.bfloat16 else 0x64006400) + opaque_zero
        p0 = (words & 0x000F000F) | b
        p1 = ((words >> 4) & 0x000F000F) | b
        p2 = ((words >> 8) & 0x000F000F) | b
        p3 = ((words >> 12) & 0x000F000F) | b
        q0 = tl.join(p0.to(tl.int16), (p0 >> 16).to(tl.int16))
        q1 = tl.join(p1.to(tl.int16), (p1 >> 16).to(tl.int16))
        q2 = tl.join(p2.to(tl.int16), (p2 >> 16).to(tl.int16))
        q3 = tl.join(p3.to(tl.int16), (p3 >> 16).to(tl.int16))
    w = tl.join(tl.join(q0, q1), tl.join(q2, q3))  # [BN, t, c, h, m0, m1]
    if SWAP:  # [BN, BK], K in the same sequence
        if ORDER == 2:
            w = tl.reshape(tl.permute(w, (0, 2, 5, 4, 1, 3)), (BLOCK_N, BLOCK_K))
        else:
            w = tl.reshape(tl.permute(w, (0, 2, 5, 1, 4, 3)), (BLOCK_N, BLOCK_K))
    elif ORDER == 2:  # row 32 c + 16 m1 + 8 m0 + 2 t + h
        w = tl.reshape(tl.permute(w, (2, 5, 4, 1, 3, 0)), (BLOCK_K, BLOCK_N))
    else:  # row 32 c + 16 m1 + 4 t + 2 m0 + h
        w = tl.reshape(tl.permute(w, (2, 5, 1, 4, 3, 0)), (BLOCK_K, BLOCK_N))
    if dtype != tl.float32:
        w = w.to(dtype, bitcast=True)
    return w


@triton.jit
def _mma_tile_product(x, xsum, qw_ptr, sc_ptr, qz_ptr, e, n0, offs_n, n_ok, k0, g, N,
                      s_qe, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset, opaque_zero,
                      ORDER: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr = False):
    """x [BM, BK] (natural column order) times the tile of weights in the MMA order, one group:
    s * (x . q - z * sum(x)), with B folded into z for 16-bit operands. SWAP: the same product transposed,
    [BN, BM] = W^T x^T, the weights as the dot's first operand: with kWidth 4 (order 4) x as the first
    operand is copied register by register into every MMA's operand quad, as the second it loads into place
    (configs.mma_swap says where that pays)."""
    words = _mma_words(qw_ptr, e, s_qe, k0, N, n0, offs_n.shape[0], BLOCK_K)
    w = _mma_operand(words, opaque_zero, x.dtype, ORDER, BLOCK_K, offs_n.shape[0], SWAP)
    s, z = _group_params(sc_ptr, qz_ptr, e, g, offs_n, n_ok, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset)
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
    return _split_planes(tl.reshape(x8, (BLOCK_K // 8, 8)))


@triton.jit
def _gemv_words(qw_ptr, e, s_qe, s_qk, s_qn, k0, k_end, N, n0, offs_i, offs_n, n_ok, EVEN_K: tl.constexpr,
                ORDER: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The GEMV's words [BK/8, BN] of rows k0 .. k0 + BK: GPTQ's rows (ORDER 0), or in the MMA order the
    words (t, c) of each column, row t * BK/32 + c (the order _x_planes gives x's planes)."""
    if ORDER != 0:
        words = tl.trans(tl.reshape(_mma_words(qw_ptr, e, s_qe, k0, N, n0, BLOCK_N, BLOCK_K),
                                    (BLOCK_N, BLOCK_K // 8)))
    else:
        i_ok = k0 // 8 + offs_i < k_end // 8
        w_mask = n_ok[None, :] if EVEN_K else i_ok[:, None] & n_ok[None, :]  # EVEN_K: every tile is whole
        words = tl.load(qw_ptr + e * s_qe + (k0 // 8 + offs_i)[:, None] * s_qk + offs_n[None, :] * s_qn,
                        mask=w_mask, other=0)
    return words


@triton.jit
def _plane_tile_product(xplanes, xsum, qw_ptr, sc_ptr, qz_ptr, e, offs_n, n_ok, k0, k_end, g,
                        s_qe, s_qk, s_qn, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset, opaque_zero,
                        DOT_IEEE: tl.constexpr, BLOCK_K: tl.constexpr):
    """x times the weight tile of rows k0.. (one group, BLOCK_K >= 128) as 8 dots over nibble planes: plane
    J [BK/8, BN] holds rows k0 + 8i + J, in the layout the words were loaded in, against x's columns
    k0 + 8i + J (xplanes, from _split_planes; xsum: x's row sums in fp32). Its floats come from bit
    operations: exact q for fp32 dots (_nibble_planes), B + q for 16-bit ones (_biased_planes16), B then
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
        wq = _nibble_planes(words, opaque_zero)
        for J in tl.static_range(8):
            xq = tl.dot(xplanes[J], wq[J], xq, input_precision="ieee")
    else:
        wq = _biased_planes16(words, dtype)
        for J in tl.static_range(8):
            xq = tl.dot(xplanes[J], wq[J], xq)
    s, z = _group_params(sc_ptr, qz_ptr, e, g, offs_n, n_ok, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset)
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
    q = _load_int4(qw_ptr, e, k0, k_end, offs_n, n_ok, s_qe, s_qk, s_qn, BLOCK_K, BLOCK_N)
    if HAS_GIDX:
        gk = tl.load(gi_ptr + e * s_ge + offs_k * s_gk, mask=k_ok, other=0)
        s, z = _group_params(sc_ptr, qz_ptr, e, gk[:, None], offs_n[None, :], mask,
                             s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset)
        w = ((q.to(tl.float32) - z) * s).to(x.dtype)
        if DOT_IEEE:
            return tl.dot(x, w, input_precision="ieee")
        return tl.dot(x, w)
    # The whole tile is in one group: the integers go into the dot as they are (exact in 16 bits).
    s, z = _group_params(sc_ptr, qz_ptr, e, g, offs_n, n_ok, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset)
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
    [M, N] (_last_split_sums), instead of a _sum_splits launch after this one.
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
    opaque_zero = K >> 31  # see _nibble_planes
    g, g_end = _first_group(k_start, group_size)
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
            xplanes = _split_planes(tl.reshape(x, (BLOCK_M, BLOCK_K // 8, 8)))  # plane J: columns k0 + 8i + J
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
        g, g_end = _next_group(g, g_end, k0 + BLOCK_K, group_size)
    if MMA_SWAP:  # once per program, back to [BM, BN] for the epilogue
        acc = tl.trans(acc)
        acc2 = tl.trans(acc2)
    out = out_ptr + pid_k * s_os + offs_m[:, None] * s_om + offs_n[None, :] * s_on
    if FUSE_GATE_UP:
        if PARTIAL:  # split K: gate's and up's sums side by side; SiLU after the sum (_sum_splits)
            tl.store(out + N * s_on, acc2, mask=m_ok[:, None] & n_ok[None, :])
        else:
            acc = acc / (1.0 + tl.exp(-acc)) * acc2  # silu(gate) * up
    if HAS_ROW_SCALE:
        acc = acc * tl.load(row_scale_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    if SUM_IN_KERNEL:
        _last_split_sums(out_ptr, s_os, offs_m[:, None] * s_om + offs_n[None, :] * s_on, N * s_on,
                         sum_ptr + offs_m[:, None] * s_fm + offs_n[None, :] * s_fn, m_ok[:, None] & n_ok[None, :],
                         tile_done_ptr + pid_m * tl.num_programs(1) + pid_n, FUSE_GATE_UP)


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
    (SUM_IN_KERNEL: by the row tile's last split, as _gemm_kernel's)."""
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
    opaque_zero = K >> 31  # 0 (K > 0) that the compiler cannot fold: see _nibble_planes
    g, g_end = _first_group(k_start, group_size)
    for k0 in range(k_start, k_end, BLOCK_K):
        i_ok = k0 // 8 + offs_i < k_end // 8
        w_mask = n_ok[None, :] if EVEN_K else i_ok[:, None] & n_ok[None, :]  # EVEN_K: every tile is whole
        wq = _nibble_planes(_gemv_words(qw_ptr, e, s_qe, s_qk, s_qn, k0, k_end, N, n0, offs_i, offs_n, n_ok, EVEN_K,
                                        MMA_ORDER, BLOCK_K, BLOCK_N), opaque_zero)
        wq2 = wq
        if FUSE_GATE_UP:
            wq2 = _nibble_planes(_gemv_words(qw2_ptr, e, s_qe, s_qk, s_qn, k0, k_end, N, n0, offs_i, offs_n, n_ok,
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
                s, z = _group_params(sc_ptr, qz_ptr, e, gk[:, None], offs_n[None, :], w_mask,
                                     s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset)
                t += xj[:, None] * ((wq[J] - z) * s)
                if FUSE_GATE_UP:
                    g2 = tl.load(gi2_ptr + e * s_ge + offs_k * s_gk, mask=i_ok, other=0)
                    s2, z2 = _group_params(sc2_ptr, qz2_ptr, e, g2[:, None], offs_n[None, :], w_mask,
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
            s, z = _group_params(sc_ptr, qz_ptr, e, g, offs_n, n_ok, s_se, s_sg, s_sn, s_ze, s_zg, s_zn,
                                 zero_offset)
            acc += s[None, :] * (t - z[None, :] * xr[:, None])
            if FUSE_GATE_UP:
                s2, z2 = _group_params(sc2_ptr, qz2_ptr, e, g, offs_n, n_ok, s_se, s_sg, s_sn, s_ze, s_zg, s_zn,
                                       zero_offset)
                acc2 += s2[None, :] * (t2 - z2[None, :] * xr[:, None])
        g, g_end = _next_group(g, g_end, k0 + BLOCK_K, group_size)
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
        _last_split_sums(out_ptr, s_os, p * s_om + offs_n * s_on, N * s_on, sum_ptr + p * s_fm + offs_n * s_fn,
                         n_ok, tile_done_ptr + p * tl.num_programs(1) + pid_n, FUSE_GATE_UP)


@triton.jit
def _last_split_sums(part_ptr, s_split, part_offs, up_offset, sum_ptrs, mask, tile_done_ptr, GATED: tl.constexpr):
    """Called by every split (axis 2) of an output tile once its fp32 partial is stored (at part_ptr + split *
    s_split + part_offs; up's at up_offset further when GATED). The split that counts itself last on the tile's
    counter sums the partials in split order, exactly as _sum_splits does, writes them (silu(gate) * up when
    GATED) at sum_ptrs in their dtype, and sets the counter back to 0 for the next launch on these weights.
    Ordering on a GPU: the barrier puts every thread's partial before the count, the counter's acquire-release
    makes the other splits' partials visible to the last one, and its loads go to L2 (.cg), past an L1 that
    may hold stale lines. One launch less after each split GEMM (_sum_splits' launch costs more than the sum)."""
    tl.debug_barrier()
    done = tl.atomic_add(tile_done_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    splits = tl.num_programs(2)
    if done == splits - 1:
        acc = tl.zeros_like(part_offs).to(tl.float32)
        acc2 = tl.zeros_like(part_offs).to(tl.float32)
        for s in range(splits):
            acc += tl.load(part_ptr + s * s_split + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
            if GATED:
                acc2 += tl.load(part_ptr + s * s_split + part_offs + up_offset, mask=mask, other=0.0,
                                cache_modifier=".cg")
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc2
        tl.store(sum_ptrs, acc.to(sum_ptrs.dtype.element_ty), mask=mask)
        tl.atomic_xchg(tile_done_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _sum_splits_kernel(src_ptr, dst_ptr, n_out, N, SPLITS, s_split, GATED: tl.constexpr, BLOCK: tl.constexpr):
    """dst [M, N] = the fp32 partials src [SPLITS, M, N] summed, in dst's dtype. GATED: src rows hold the gate's
    and the up projection's partials side by side ([SPLITS, M, 2N]) and dst = silu(gate) * up of the sums."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_out
    src = offs
    if GATED:
        src = (offs // N) * (2 * N) + offs % N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(src_ptr + s * s_split + src, mask=mask, other=0.0)
        if GATED:
            acc2 += tl.load(src_ptr + s * s_split + src + N, mask=mask, other=0.0)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    tl.store(dst_ptr + offs, acc.to(dst_ptr.dtype.element_ty), mask=mask)


def _sum_splits(partials: torch.Tensor, n: int, dtype: torch.dtype, gated: bool = False) -> torch.Tensor:
    """[splits, M, N (2N gated)] fp32 partials -> [M, N] in dtype, in one launch (a sum and a cast in torch were
    two, after each of a step's 250 split GEMMs on an H200; benchmarks/RESULTS.md)."""
    m = partials.shape[1]
    out = torch.empty(m, n, device=partials.device, dtype=dtype)
    if out.numel():
        block = 1024
        _sum_splits_kernel[(cdiv(out.numel(), block),)](
            partials, out, out.numel(), n, partials.shape[0], partials.stride(0), GATED=gated, BLOCK=block)
    return out


# ---- launchers ---------------------------------------------------------------------------------------
def _capturing(t: torch.Tensor) -> bool:
    """Whether work on t's device is being captured into a CUDA graph now (recorded, not run)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class Int4Weights:
    """GPTQ tensors of one linear ([K/8, N] ...) or a stack of experts ([E, K/8, N] ...), validated."""

    def __init__(self, qweight, scales, qzeros, group_size: int, g_idx=None, checkpoint_format: str = "gptq",
                 perm=None, mma_order: int = 0, sum_in_kernel: bool = True):
        """`perm` [.., K]: weights whose rows were reordered by group at load (quant.pack.sort_rows_by_group):
        row k multiplies input column perm[k]. The kernels do not read it; callers gather x's columns first.
        `mma_order` 2 or 4: qweight's words are in that MMA order (mma_layout.py), contiguous; 0: GPTQ's.
        `sum_in_kernel` False: split-K partials are summed by a launch of their own even where the config
        would sum them in the kernel (the GPU-verified way; kernels/forwards.py sets it from
        configs.kernel_changes)."""
        if qweight.dim() == 2:
            qweight, scales, qzeros = qweight[None], scales[None], qzeros[None]
            g_idx = None if g_idx is None else g_idx[None]
            perm = None if perm is None else perm[None]
        if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
            raise ValueError(f"qweight and qzeros must be int32, got {qweight.dtype} and {qzeros.dtype}")
        if scales.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"scales must be fp16/bf16/fp32, got {scales.dtype}")
        E, K8, N = qweight.shape
        K = K8 * 8
        if group_size == -1:
            group_size = K
        if group_size <= 0 or K % group_size:
            raise ValueError(f"group_size {group_size} does not divide K = {K}")
        G = K // group_size
        if scales.shape != (E, G, N):
            raise ValueError(f"scales have shape {tuple(scales.shape)}, expected {(E, G, N)} for K={K}, N={N}")
        if N % 8 or qzeros.shape != (E, G, N // 8):
            raise ValueError(f"qzeros have shape {tuple(qzeros.shape)}, expected {(E, G, N // 8)}")
        if g_idx is not None and g_idx.shape != (E, K):
            raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}, expected ({K},) per linear")
        if perm is not None and perm.shape != (E, K):
            raise ValueError(f"perm has shape {tuple(perm.shape)}, expected ({K},) per linear")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"checkpoint_format must be 'gptq' or 'gptq_v2', got '{checkpoint_format}'")
        devices = {t.device for t in (qweight, scales, qzeros) + (() if g_idx is None else (g_idx,))}
        if len(devices) != 1:
            raise ValueError(f"weight tensors are on different devices: {devices}")
        if g_idx is None and group_size < K and group_size & -group_size < 16:
            # Tiles are powers of two >= 16 inside one group: groups of 8 or 40 rows are followed row by row,
            # as act-order groups are.
            g_idx = (torch.arange(K, device=qweight.device, dtype=torch.int32) // group_size).expand(E, K)
        if mma_order and (mma_order not in mma_layout.ORDERS or not mma_layout.eligible(K, group_size, g_idx)
                          or not qweight.is_contiguous()):
            raise ValueError(f"weights in MMA order {mma_order} must be contiguous, without a g_idx, with K a multiple "
                             f"of {mma_layout.BLOCK} and groups of a multiple of {mma_layout.BLOCK} rows (orders "
                             f"{mma_layout.ORDERS}); got K = {K}, group size {group_size}")
        self.mma_order = mma_order
        self.sum_in_kernel = sum_in_kernel
        self.qweight, self.scales, self.qzeros = qweight, scales, qzeros
        self.g_idx = None if g_idx is None else g_idx.to(torch.int32)
        self.E, self.K, self.N, self.group_size = E, K, N, group_size
        self.perm = perm
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0
        self._tile_done: torch.Tensor | None = None
        self._outgrown: list[torch.Tensor] = []

    def tile_counters(self, tiles: int) -> torch.Tensor:
        """Zeroed int32 counters, one per output tile, for the kernels' in-kernel sum over K splits
        (_last_split_sums). Kept with the weights: every launch leaves them at zero again, so launches in
        stream order (eager or replayed from a CUDA graph) share one set with no memset. A set that a call
        outgrows stays allocated: a CUDA graph captured with it still counts there when replayed. While a
        graph is being captured, a set too small is not replaced: the zeros of a new one would be a captured
        memset, not yet run, so that call gets a set of its own, zeroed in the graph before its launch."""
        if self._tile_done is not None and self._tile_done.numel() >= tiles:
            return self._tile_done
        fresh = torch.zeros(tiles, dtype=torch.int32, device=self.qweight.device)
        if _capturing(self.qweight):
            return fresh
        if self._tile_done is not None:
            self._outgrown.append(self._tile_done)
        self._tile_done = fresh
        return fresh

    def in_mma_order(self, order: int) -> Int4Weights:
        """These weights with a copy of the words rearranged in `order` (mma_layout.py)."""
        return Int4Weights(mma_layout.to_mma(self.qweight, order), self.scales, self.qzeros, self.group_size,
                           self.g_idx, "gptq" if self.zero_offset else "gptq_v2", self.perm, mma_order=order,
                           sum_in_kernel=self.sum_in_kernel)

    def args(self):
        gi = self.g_idx if self.g_idx is not None else self.qweight  # any pointer; unused without g_idx
        return self.qweight, self.scales, self.qzeros, gi

    def strides(self):
        sg = (self.g_idx.stride(0), self.g_idx.stride(1)) if self.g_idx is not None else (0, 0)
        return (*self.qweight.stride(), *self.scales.stride(), *self.qzeros.stride(), *sg)


def _block_k(block_k: int, w: Int4Weights) -> int:
    """Without a g_idx a tile must not straddle two groups: the largest power of two up to block_k that
    divides the group size (Int4Weights gives a group with none >= 16, say 8 or 40 rows, a g_idx). In the MMA
    order a tile is 1-4 of a 128-row block's 32-row slices (its groups are whole blocks)."""
    if w.mma_order:
        return min(max(block_k, 32), mma_layout.BLOCK)
    if w.g_idx is None and w.group_size < w.K:
        return min(block_k, w.group_size & -w.group_size)
    return block_k


def _k_splits(K: int, split: int, bk: int) -> tuple[int, int]:
    """K rows per split (whole BLOCK_K tiles) and the number of splits that leaves none empty."""
    k_per = cdiv(cdiv(K, max(1, min(split, cdiv(K, bk)))), bk) * bk
    return k_per, cdiv(K, k_per)


def _check_x(x: torch.Tensor, w: Int4Weights) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if x.shape[1] != w.K:
        raise ValueError(f"x has K = {x.shape[1]} but the weights have K = {w.K}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if x.device != w.qweight.device:
        raise ValueError(f"x is on {x.device} but the weights are on {w.qweight.device}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError("the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tests)")


def _check_pair(w: Int4Weights, w2: Int4Weights | None) -> None:
    """Fused gate/up: the kernel reads both weight sets with w's sizes, strides, group size and zero offset."""
    if w2 is None:
        return
    mine = (w.E, w.K, w.N, w.group_size, w.zero_offset, w.g_idx is None, w.strides(), w.mma_order)
    theirs = (w2.E, w2.K, w2.N, w2.group_size, w2.zero_offset, w2.g_idx is None, w2.strides(), w2.mma_order)
    if mine != theirs:
        raise ValueError("fused gate and up weights must share experts, K, N, group size, checkpoint format, "
                         "act-order and memory layout; got (E, K, N, group, zero offset, no g_idx, strides, "
                         f"MMA order) {mine} and {theirs}: quantize both projections with the same settings")


def _check_partials(sum_splits: bool, w2: Int4Weights | None) -> None:
    if not sum_splits and w2 is not None:
        raise ValueError("fused gate/up partials hold both projections: sum_splits=False is for one weight set")


def _arch(device: torch.device) -> str | None:
    if device.type != "cuda" or interpreting():
        return None
    return configs.arch_of(torch.cuda.get_device_capability(device))


def gemm_config_for(device: torch.device, m: int) -> configs.GemmConfig:
    arch = _arch(device)
    return configs.INTERPRET_GEMM if arch is None else configs.gemm_config(arch, m)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fill_split(cfg: configs.GemmConfig, m: int, n: int, device: torch.device) -> configs.GemmConfig:
    """The table's split-K trimmed to what fills this GPU for an [m, n] output (configs.split_to_fill)."""
    if _arch(device) is None:
        return cfg
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    return configs.split_to_fill(cfg, tiles, _sm_count(device.index or 0))


# (device index, M bucket, N, K, fused, g_idx) -> the fastest config measured on this GPU.
_TUNED: dict[tuple, configs.GemmConfig] = {}


def autotune(key: tuple, candidates: list[configs.GemmConfig], run, measure=None) -> configs.GemmConfig:
    """Time `run(config)` for each candidate once per key and keep the fastest; a candidate that fails to
    compile or run (e.g. out of shared memory on this part) is skipped. `measure` defaults to Triton's
    do_bench (milliseconds)."""
    if key in _TUNED:
        return _TUNED[key]
    if measure is None:
        from triton.testing import do_bench

        measure = lambda fn: do_bench(fn, warmup=5, rep=20)  # noqa: E731
    best, best_t = candidates[0], float("inf")
    for cfg in candidates:
        try:
            t = measure(lambda cfg=cfg: run(cfg))
        except Exception:  # noqa: BLE001 - an unusable config is simply not chosen
            continue
        if t < best_t:
            best, best_t = cfg, t
    _TUNED[key] = best
    return best


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # The interpreter gets bf16 arithmetic wrong (DESIGN section 5): compute in fp32 there.
    return torch.float32 if x.dtype == torch.bfloat16 and interpreting() else x.dtype


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype, without Tensor.to's call when it already is (host time of an eager launch)."""
    return t if t.dtype == dtype else t.to(dtype)


def gemm(x: torch.Tensor, w: Int4Weights, w2: Int4Weights | None = None, rows: torch.Tensor | None = None,
         tile_expert: torch.Tensor | None = None, row_scale: torch.Tensor | None = None, n_rows: int | None = None,
         config: configs.GemmConfig | None = None, planes: bool | None = None,
         sum_splits: bool = True) -> torch.Tensor:
    """out [n_rows, N] = x[rows] @ W_e (per tile expert), optionally silu(x W) * (x W2) and * row_scale.
    `planes`: dot the packed words as 8 nibble planes (default: the config's choice, where possible: no g_idx,
    K tile >= 128); False keeps the unpacked [BK, BN] tile, which benchmarks/kernels.py times side by side.
    `sum_splits=False` (not fused): the split-K partials [splits, n_rows, N] as they are."""
    _check_x(x, w)
    _check_partials(sum_splits, w2)
    _check_pair(w, w2)
    cdt = _compute_dtype(x)
    xc = _as(x, cdt)
    M = n_rows if n_rows is not None else x.shape[0]
    cfg = config
    arch = _arch(x.device)
    if cfg is None:
        cfg = fill_split(gemm_config_for(x.device, M), M, w.N, x.device)
        if arch is not None and os.environ.get("CLOVER_AUTOTUNE", "0") == "1":
            bucket = next(b for b in configs.M_BUCKETS if M <= b)
            key = (x.device.index, bucket, w.N, w.K, w2 is not None, w.g_idx is not None, rows is not None, planes)
            cfg = autotune(key, configs.autotune_configs(arch, M, base=cfg),
                           lambda c: gemm(x, w, w2, rows, tile_expert, row_scale, n_rows, config=c, planes=planes))
    if arch is not None and w.g_idx is not None:  # gathered scales and zeros: a narrower K tile must fit
        cfg = configs.for_gathered_groups(cfg, arch, fused=w2 is not None)
    if arch is not None and w.mma_order:
        cfg = configs.for_mma_order(cfg, arch)
    bk = _block_k(cfg.block_k, w)
    k_per, split = _k_splits(w.K, cfg.split_k, bk)
    use_planes = w.g_idx is None and bk >= 128 and (cfg.planes if planes is None else planes)
    fused = w2 is not None
    out = _split_buffer(split, M, w, fused, cdt, x.device)
    grid = (cdiv(M, cfg.block_m), cdiv(w.N, cfg.block_n), split)
    w2a = w2.args() if w2 is not None else w.args()
    dummy = out
    in_kernel, total, tile_done = _sum_target(split, sum_splits, cfg, M, w, cdt, grid, dummy)
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
    return out if not sum_splits else _split_result(out, x, w, cdt, fused, total if in_kernel else None)


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
    in_kernel, total, tile_done = _sum_target(out.shape[0], sum_splits, cfg, P, w, cdt, grid, dummy)
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
    return out if not sum_splits else _split_result(out, x, w, cdt, fused, total if in_kernel else None)


def _gemv_plan(x: torch.Tensor, w: Int4Weights, w2: Int4Weights | None, P: int, config, moe: bool,
               sum_splits: bool):
    """gemv's argument checks, config (the table's, its split-K trimmed to fill the GPU for P programs per
    column tile), K tile and split, and output [splits, P, N] (2N: fused gate/up partials). None for P = 0."""
    _check_x(x, w)
    _check_pair(w, w2)
    _check_partials(sum_splits, w2)
    cdt = _compute_dtype(x)
    arch = _arch(x.device)
    interp = configs.INTERPRET_MOE_GEMV if moe else configs.INTERPRET_GEMV
    cfg = config or (interp if arch is None else configs.gemv_config(arch, moe))
    if config is None and arch is not None:
        programs = P * cdiv(w.N, cfg.block_n)
        cfg = configs.gemv_split_to_fill(cfg, programs, w.K, _sm_count(x.device.index or 0))
    if P == 0:
        return None
    bk = _block_k(cfg.block_k, w)
    k_per, split = _k_splits(w.K, cfg.split_k, bk)
    return _as(x, cdt), cdt, cfg, bk, k_per, _split_buffer(split, P, w, w2 is not None, cdt, x.device)


def _split_buffer(split: int, rows: int, w: Int4Weights, fused: bool, cdt: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """The INT4 launchers' output [split, rows, N]: fp32 partials when K is split (gate's and up's side by
    side, 2N, when fused), else in the compute dtype."""
    width = 2 * w.N if fused and split > 1 else w.N
    return torch.empty(split, rows, width, device=device, dtype=torch.float32 if split > 1 else cdt)


def _sum_target(split: int, sum_splits: bool, cfg: configs.GemmConfig | configs.GemvConfig, rows: int,
                w: Int4Weights, cdt: torch.dtype, grid: tuple[int, int, int],
                dummy: torch.Tensor) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """Whether the kernel sums its K splits itself (more than one, summed, the config's and the weights'
    sum_in_kernel),
    with the output [rows, N] that the last split of each tile writes and the tiles' counters; else `dummy`
    for both (pointers the kernel never touches)."""
    if not (split > 1 and sum_splits and cfg.sum_in_kernel and w.sum_in_kernel):
        return False, dummy, dummy
    return True, torch.empty(rows, w.N, device=dummy.device, dtype=cdt), w.tile_counters(grid[0] * grid[1])


def _split_result(out: torch.Tensor, x: torch.Tensor, w: Int4Weights, cdt: torch.dtype,
                  fused: bool, summed: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, N] in x's dtype from a _split_buffer: the one split, the partials summed (with the fused
    SiLU, which is not linear: after the sum), or `summed` where the kernel's last splits did that."""
    if summed is not None:
        return _as(summed, x.dtype)
    if out.shape[0] == 1:
        return _as(out[0], x.dtype)
    return _as(_sum_splits(out, w.N, cdt, gated=fused), x.dtype)


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    checkpoint_format: str = "gptq",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (fp16/bf16; fp32 too) @ INT4 GPTQ weights as a checkpoint stores them (qweight [K/8, N],
    scales [K/G, N], qzeros [K/G, N/8], optional act-order g_idx [K]; `gptq` v1 zeros are stored minus
    one, `gptq_v2` true) -> [M, N] in x's dtype, written into `out` if given."""
    w = Int4Weights(qweight, scales, qzeros, group_size, g_idx, checkpoint_format)
    if w.E != 1:
        raise ValueError("w4a16_matmul takes one linear; use the MoE entry point for stacked experts")
    _check_x(x, w)
    if out is not None and (out.shape != (x.shape[0], w.N) or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"out must be a {x.dtype} tensor of shape {(x.shape[0], w.N)} on {x.device}")
    y = gemv(x, w) if x.shape[0] <= 4 else gemm(x, w)
    if out is None:
        return _as(y, x.dtype)
    out.copy_(y)
    return out


def w4a16_matmul_reference(x, qweight, scales, qzeros, group_size, g_idx=None, checkpoint_format="gptq"):
    """The PyTorch reference: dequantize, then matmul (in x's dtype, as QuantLinear's reference path)."""
    from clover_lite.quant.pack import dequantize

    K = qweight.shape[0] * 8
    if g_idx is None:
        g_idx = torch.arange(K, device=qweight.device, dtype=torch.int32) // (K if group_size == -1 else group_size)
    w = dequantize(qweight, qzeros, scales, g_idx, checkpoint_format, dtype=x.dtype)
    return x @ w.t()
