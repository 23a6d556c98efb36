"""RMSNorm (and the GDN output's gated RMSNorm) in one kernel per call.

The PyTorch modules (models/layers.py, the reference) run each norm as 8-10 elementwise and reduction
kernels: at Clover's 131 norms a denoising step, about 1,100 launches and 1.6 ms of an H200's 24.5 ms step
(benchmarks/RESULTS.md, 2026-12-04). Here one program normalises one row in fp32 and rounds where the
reference rounds, so the result matches it to fp32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import interpreting


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, gate_ptr, out_ptr, N, s_x, s_g, s_o, eps,
                     UNIT_OFFSET: tl.constexpr, GATED: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    xn = x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    if GATED:
        # GatedRMSNorm: norm(x) rounded to x's dtype, times the weight (rounded to x's dtype too unless the
        # weight is wider: torch's type promotion), then times silu(gate) in fp32.
        y = w.to(tl.float32) * xn.to(dtype).to(tl.float32)
        if ROUND_PRODUCT:
            y = y.to(dtype).to(tl.float32)
        g = tl.load(gate_ptr + row * s_g + offs, mask=mask, other=0.0).to(tl.float32)
        y = y * (g / (1.0 + tl.exp(-g)))
    else:
        wf = w.to(tl.float32)
        if UNIT_OFFSET:
            wf = 1.0 + wf
        y = xn * wf
    tl.store(out_ptr + row * s_o + offs, y.to(dtype), mask=mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t [..., n] as [rows, n] with unit column stride (a view where the rows are evenly spaced)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(1) == 1 else t2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = True,
             gate: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over x's last dim: x * rsqrt(mean(x^2) + eps) * (1 + weight if unit_offset else weight), in
    fp32, returned in x's dtype (layers.RMSNorm); with `gate` [x's shape], the gated form
    weight * norm(x) * silu(gate) (layers.GatedRMSNorm, which never offsets its weight)."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({n},)")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate has shape {tuple(gate.shape)}, expected {tuple(x.shape)}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError("the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tests)")
    x2 = _rows(x, n)
    g2 = _rows(gate, n) if gate is not None else x2
    out = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    # A row shorter than the program's threads would be held several times over (replicated lanes): rows
    # under 128 get one warp and at least 32 slots. 128-2048 (Clover's 128, 256, 2048) as checked on an H200.
    block = max(32, triton.next_power_of_2(n))
    warps = 1 if block < 128 else 4 if n <= 1024 else 8
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, g2, out, n, x2.stride(0), g2.stride(0), out.stride(0), eps,
            UNIT_OFFSET=unit_offset and gate is None, GATED=gate is not None,
            ROUND_PRODUCT=torch.promote_types(weight.dtype, x.dtype) == x.dtype, BLOCK=block, num_warps=warps,
        )
    return out.view(x.shape)
