"""INT4 weights rearranged, at load time, into the order of the tensor cores' operand registers.

GPTQ packs rows 8i .. 8i + 7 of a column into word i (quant/pack.py). A tensor-core dot wants each thread
to hold pairs of neighbouring rows of a few columns, so a GPTQ tile reaches the operand registers only
through byte permutes, shuffles or a transposed copy in shared memory: more instructions than the weights
are worth at the bandwidth they arrive with (benchmarks/RESULTS.md).

Here each 128-row block b of column n is 16 words, at flat index ((b N + n) 4 + t) 4 + c (t, c in 0..3),
so a thread's words are 16 contiguous bytes. Nibble J = m + 4h (m in 0..3, h in 0..1) of word (t, c) holds
row 128 b + 32 c + r, with r in one of two orders:
  order 2: r = 8 m + 2 t + h                    (an operand register holds rows 2t, 2t + 1: kWidth 2)
  order 4: r = 16 (m // 2) + 4 t + 2 (m % 2) + h   (a thread holds rows 4t .. 4t + 3: kWidth 4)
One AND-OR (masks 0x000F000F) makes nibbles m and m + 4 of a word one register of two 16-bit operands, rows
r and r + 1. With the order the installed Triton gives its 16-bit dot operands (2 in 3.9, 4 in 3.6, as
compiled for sm_86 and sm_90), the tile the GEMM builds from the loaded words is laid out as the dot wants
it, with no data movement; with the other order it is correct but pays shuffles.

Repacked: weights without an act-order g_idx (after kernels/forwards.py's repack by group), K a multiple
of 128, groups of a multiple of 128 rows or one group per column. The buffer keeps its shape and size.
"""

from __future__ import annotations

import torch

from clover_lite.quant.pack import _pack_rows, _unpack_rows

BLOCK = 128  # rows per block: 16 words of one column
ORDERS = (2, 4)


def kernel_order() -> int:
    """The order whose tile the installed Triton's 16-bit dot takes as it is: kWidth 2 from Triton 3.9 on,
    4 in 3.6 (the H200 image's; 3.7 and 3.8 not checked)."""
    import triton  # (the reference path needs no Triton: only the kernels ask)

    major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    return 2 if (major, minor) >= (3, 9) else 4


def eligible(K: int, group_size: int, g_idx: torch.Tensor | None) -> bool:
    """Whether weights of K rows in groups of group_size (K: one group per column) can be repacked."""
    return g_idx is None and K % BLOCK == 0 and (group_size % BLOCK == 0 or group_size >= K)


def rows(order: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[4 t, 4 c, 8 J] -> the row within its 128-row block held by nibble J of word (t, c)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order}")
    t = torch.arange(4, device=device).view(4, 1, 1)
    c = torch.arange(4, device=device).view(1, 4, 1)
    J = torch.arange(8, device=device).view(1, 1, 8)
    m, h = J % 4, J // 4
    r = 8 * m + 2 * t + h if order == 2 else 16 * (m // 2) + 4 * t + 2 * (m % 2) + h
    return 32 * c + r


PIECE = 1 << 22  # weights converted at a time: tens of MB of temporaries, whatever the matrix


def to_mma(qweight: torch.Tensor, order: int) -> torch.Tensor:
    """GPTQ words [..., K/8, N] -> the same shape, words in the MMA order (a new tensor)."""
    out = qweight.clone()
    repack_(out, order)
    return out


def repack_(qweight: torch.Tensor, order: int) -> None:
    """GPTQ words [..., K/8, N] rearranged into the MMA order in place, a piece at a time: block b's words take
    the flat range its GPTQ rows did, so only the block being converted is copied (a 2048 x 248k lm_head:
    16 MB a block, in pieces of 4M weights). A stack's experts are consecutive blocks of one [E K/8, N]."""
    R, N = qweight.shape[-2:]
    if (R * 8) % BLOCK or not qweight.is_contiguous():
        raise ValueError(f"MMA order needs contiguous weights with K a multiple of {BLOCK}, got K = {R * 8}")
    idx = rows(order, qweight.device).reshape(-1)  # [(t, c, J)]
    words = qweight.view(-1, N)
    blocks, cols = max(1, PIECE // (BLOCK * N)), max(1, PIECE // BLOCK)
    for b0 in range(0, words.shape[0] // 16, blocks):
        part = words[16 * b0:16 * (b0 + blocks)]
        src = part.clone() if N > cols else part  # every column read before any is overwritten
        dest = part.view(-1, 16 * N)  # [B, 16 N]: block b's words, column n's 16 at 16 n
        for n0 in range(0, N, cols):
            q = _unpack_rows(src[:, n0:n0 + cols]).view(dest.shape[0], BLOCK, -1)  # [B, 128, nc]
            q = q[:, idx].view(q.shape[0], 16, 8, -1).permute(0, 3, 1, 2)  # [B, nc, (t, c), J]
            packed = _pack_rows(q.reshape(-1, 8).t().contiguous())  # [1, B * nc * 16]
            dest[:, 16 * n0:16 * (n0 + q.shape[1])] = packed.view(dest.shape[0], -1)


def from_mma(qweight: torch.Tensor, order: int) -> torch.Tensor:
    """Words in the MMA order [..., K/8, N] -> GPTQ's (a new tensor): the inverse of to_mma."""
    N = qweight.shape[-1]
    idx = rows(order, qweight.device).reshape(-1)
    nib = _unpack_rows(qweight.reshape(1, -1)).view(8, -1, N, 16)  # [J, B, N, (t, c)]
    q = torch.empty(nib.shape[1], BLOCK, N, dtype=nib.dtype, device=nib.device)
    q[:, idx] = nib.permute(1, 3, 0, 2).reshape(nib.shape[1], BLOCK, N)
    return _pack_rows(q.reshape(-1, N)).view(qweight.shape)
