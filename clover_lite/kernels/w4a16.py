"""W4A16 on a checkpoint's tensors: `w4a16_matmul`, x [M, K] in 16 bits (or fp32) times GPTQ INT4 weights as
stored, checked on every call and run by the GEMV (M <= 4, int4_gemv.py) or the GEMM (int4_gemm.py); and its
PyTorch reference. The modules prepare their weights once (int4_weights.Int4Weights) and call those directly.
"""

from __future__ import annotations

import torch

from clover_lite.kernels.int4_gemm import gemm
from clover_lite.kernels.int4_gemv import gemv
from clover_lite.kernels.int4_launch import as_dtype
from clover_lite.kernels.int4_weights import Int4Weights, check_x


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
    check_x(x, w)
    if out is not None and (out.shape != (x.shape[0], w.N) or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"out must be a {x.dtype} tensor of shape {(x.shape[0], w.N)} on {x.device}")
    y = gemv(x, w) if x.shape[0] <= 4 else gemm(x, w)
    if out is None:
        return as_dtype(y, x.dtype)
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
