"""Decoding GPTQ INT4 words inside the kernels: the jit helpers the GEMM (int4_gemm.py) and the GEMV
(int4_gemv.py) share.

The words become integers (load_int4), nibble planes of floats made by bit operations with no int-to-float
conversion (nibble_planes, biased_planes16), or, for weights in the MMA order (mma_layout.py,
Int4Weights.mma_order), the dot operand built from 16-byte loads with no shuffles (mma_words, mma_operand);
group_params gives a group's scales and zeros, first_group / next_group step the groups. When BLOCK_K stays
inside one group (no act-order g_idx) the scale and zero apply once per tile: out += s * (x . q - z * sum(x))
(DESIGN section 7).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_int4(qw_ptr, e, k0, k_end, offs_n, n_ok, s_qe, s_qk, s_qn,
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
def group_params(sc_ptr, qz_ptr, e, g, offs_n, mask, s_se, s_sg, s_sn, s_ze, s_zg, s_zn, zero_offset):
    """Scales and true zeros (fp32) for group indices g (broadcastable against offs_n)."""
    s = tl.load(sc_ptr + e * s_se + g * s_sg + offs_n * s_sn, mask=mask, other=0.0).to(tl.float32)
    zw = tl.load(qz_ptr + e * s_ze + g * s_zg + (offs_n // 8) * s_zn, mask=mask, other=0)
    z = ((zw >> ((offs_n % 8) * 4)) & 0xF) + zero_offset
    return s, z.to(tl.float32)


@triton.jit
def first_group(k_start, group_size):
    """Group of the tile at k_start and where that group ends. Tiles never straddle groups (their rows are a
    power of two dividing the group size), so the loop steps the group with next_group instead of dividing
    (an integer division per tile costs ~20 instructions and, on sm_86, a call)."""
    g = k_start // group_size
    return g, (g + 1) * group_size


@triton.jit
def next_group(g, g_end, k_next, group_size):
    step = (k_next >= g_end).to(tl.int32)
    return g + step, g_end + step * group_size


@triton.jit
def nibble_planes(words, opaque_zero):
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
def biased_planes16(words, dtype: tl.constexpr):
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
def split_planes(x):
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
def mma_words(qw_ptr, e, s_qe, k0, N, n0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
def mma_operand(words, opaque_zero, dtype: tl.constexpr, ORDER: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_N: tl.constexpr, SWAP: tl.constexpr = False):
    """The dot operand [BK, BN] from words [BN, 4 t, BK/32 c] in the MMA order: exact fp32 integers q, or
    16-bit floats B + q (B = 128 in bf16, 1024 in fp16) two per AND-OR: nibbles m and m + 4 under the masks
    0x000F000F are rows r and r + 1 of one operand register. The joins build [BN, t, c, h, m0, m1] (m = m0
    + 2 m1, nibble m + 4h) and the permute puts the rows in the order's sequence: laid out as the installed
    Triton's dot takes them when ORDER is mma_layout.kernel_order(). SWAP: its transpose [BN, BK], the
    dot's first operand, whose registers pair neighbouring K the same way (the same words serve both)."""
    if dtype == tl.float32:
        p = nibble_planes(words, opaque_zero)
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
