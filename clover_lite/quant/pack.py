"""GPTQ INT4 packing (docs/ARCHITECTURE.md section 3).

For a linear y = x W^T with W [N out, K in], GPTQ stores the transposed integer weights q [K, N]:
  qweight int32 [K/8, N]   nibble j (bits 4j..4j+3) of word [i, n] is q[8i + j, n]
  qzeros  int32 [G, N/8]   nibble j of word [g, c] is the zero of column 8c + j in group g
  scales  fp16  [G, N]
  g_idx   int32 [K]        the group of input channel k
  W[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])
`gptq` (v1) checkpoints store zero - 1 (a symmetric zero of 8 is stored as 7); `gptq_v2` the true zero.
"""

from __future__ import annotations

import torch

BITS = 4
PACK = 32 // BITS  # values per int32 word
MAXQ = (1 << BITS) - 1
FORMATS = ("gptq", "gptq_v2")


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """values [R, C] ints in 0..15, R % 8 == 0 -> int32 [R/8, C]: row 8i+j goes to nibble j of word i."""
    R, C = values.shape
    if R % PACK:
        raise ValueError(f"cannot pack {R} rows: not a multiple of {PACK}")
    v = values.to(torch.int64).reshape(R // PACK, PACK, C)
    shifts = (torch.arange(PACK, device=values.device, dtype=torch.int64) * BITS).view(1, PACK, 1)
    words = (v << shifts).sum(1)  # < 2**32, exact in int64
    return (words - ((words >> 31) << 32)).to(torch.int32)  # reinterpret as signed 32-bit


def _unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [R/8, C] -> int32 [R, C] in 0..15 (the inverse of _pack_rows)."""
    shifts = (torch.arange(PACK, device=words.device, dtype=torch.int32) * BITS).view(1, PACK, 1)
    v = (words.unsqueeze(1) >> shifts) & MAXQ  # arithmetic shift, masked: sign bits do not leak
    return v.reshape(-1, words.shape[1])


def pack_qweight(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] in 0..15 -> qweight int32 [K/8, N]."""
    return _pack_rows(q)


def unpack_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [K/8, N] -> q int32 [K, N]."""
    return _unpack_rows(qweight)


def pack_qzeros(stored: torch.Tensor) -> torch.Tensor:
    """stored zeros [G, N] in 0..15 (already offset for the format) -> qzeros int32 [G, N/8]."""
    return _pack_rows(stored.t().contiguous()).t().contiguous()


def unpack_qzeros(qzeros: torch.Tensor) -> torch.Tensor:
    """qzeros int32 [G, N/8] -> stored zeros int32 [G, N]."""
    return _unpack_rows(qzeros.t().contiguous()).t().contiguous()


def zero_offset(checkpoint_format: str) -> int:
    """What to add to a stored zero to get the true zero."""
    if checkpoint_format not in FORMATS:
        raise ValueError(f"unknown GPTQ checkpoint_format '{checkpoint_format}'; expected one of {FORMATS}")
    return 1 if checkpoint_format == "gptq" else 0


def dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    checkpoint_format: str = "gptq",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """GPTQ tensors -> W [N, K] (the nn.Linear layout) in `dtype` (default: the scales' dtype)."""
    q = unpack_qweight(qweight)  # [K, N]
    zeros = unpack_qzeros(qzeros) + zero_offset(checkpoint_format)  # [G, N]
    g = g_idx.long()
    w = (q - zeros[g]).to(torch.float32) * scales[g].to(torch.float32)  # [K, N]
    return w.t().to(dtype or scales.dtype)


def sort_rows_by_group(qweight: torch.Tensor, g_idx: torch.Tensor,
                       group_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Act-order weights (qweight [.., K/8, N], g_idx [.., K]) with their rows reordered so that each group's
    rows are contiguous, as static groups are: (qweight in the new order, perm [.., K] int64 where new row k
    is old row perm[k], so x[..., perm] multiplies it). None when a group does not hold exactly group_size
    rows (then no reordering makes the groups plain)."""
    K, N = qweight.shape[-2] * PACK, qweight.shape[-1]
    qw, gi = qweight.reshape(-1, K // PACK, N), g_idx.reshape(-1, K).long()
    perm = torch.argsort(gi, dim=1, stable=True)
    plain = (torch.arange(K, device=gi.device) // group_size).expand_as(gi)
    if not torch.equal(torch.gather(gi, 1, perm), plain):
        return None
    out = torch.empty_like(qw)
    for e in range(qw.shape[0]):  # one stack entry at a time: the unpacked copy stays small
        out[e] = pack_qweight(unpack_qweight(qw[e])[perm[e]])
    return out.view_as(qweight), perm.view(g_idx.shape)
