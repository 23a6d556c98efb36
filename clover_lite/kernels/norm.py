"""RMSNorm (and the GDN output's gated RMSNorm) in one kernel per call.

The PyTorch modules (models/layers.py, the reference) run each norm as 8-10 elementwise and reduction
kernels: at Clover's 131 norms a denoising step, about 1,100 launches and 1.6 ms of an H200's 24.5 ms step
(benchmarks/RESULTS.md, 2026-12-04). Here one program normalises one row in fp32 and rounds where the
reference rounds, so the result matches it to fp32 summation order. The attention's q and k norms also
apply the rotary embedding in the same program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from clover_lite.kernels.host import interpreting, next_power_of_2


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, gate_ptr, out_ptr, cos_ptr, sin_ptr, res_ptr, sum_ptr, N, s_x, s_g, s_o, s_r, s_s,
                     eps, heads, L, rd, s_c,
                     UNIT_OFFSET: tl.constexpr, GATED: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
                     ROTARY: tl.constexpr, ROUND_INPUT: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    if ROUND_INPUT:  # x given wider than the output (the GDN's fp32 output): rounded first, as x.to(dtype)
        x = x.to(dtype).to(tl.float32)
    if RESIDUAL:  # the decoder's residual add, rounded to the dtype as `x = x + mixed` is, and kept
        x = (x + tl.load(res_ptr + row * s_r + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row * s_s + offs, x, mask=mask)
        x = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    xn = x * inv
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if ROTARY:
        # layers.apply_rotary on the norm's output (rounded to the dtype first, as the modules hand it on):
        # dims d < rd/2 take y_d cos - y_{d+rd/2} sin, dims rd/2 <= d < rd take y_d cos + y_{d-rd/2} sin.
        half = rd // 2
        rot = offs < rd
        partner = tl.where(offs < half, offs + half, offs - half)
        xp = tl.load(x_ptr + row * s_x + partner, mask=rot, other=0.0).to(tl.float32) * inv
        wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
        wf = w.to(tl.float32)
        if UNIT_OFFSET:
            wf = 1.0 + wf
            wp = 1.0 + wp
        y = (xn * wf).to(dtype).to(tl.float32)
        yp = (xp * wp).to(dtype).to(tl.float32)
        tok = (row // heads) % L
        c = tl.load(cos_ptr + tok * s_c + offs, mask=rot, other=1.0)
        sn = tl.load(sin_ptr + tok * s_c + offs, mask=rot, other=0.0)
        y = tl.where(rot, y * c + tl.where(offs < half, -yp, yp) * sn, y)
    elif GATED:
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
             gate: torch.Tensor | None = None, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
             out_dtype: torch.dtype | None = None, residual: torch.Tensor | None = None):
    """RMSNorm over x's last dim: x * rsqrt(mean(x^2) + eps) * (1 + weight if unit_offset else weight), in
    fp32, returned in x's dtype (layers.RMSNorm); with `gate` [x's shape], the gated form
    weight * norm(x) * silu(gate) (layers.GatedRMSNorm, which never offsets its weight). With `rotary`
    (cos, sin [L, rd] fp32) and x [..., L, heads, head_dim]: layers.apply_rotary on the result, per position
    (the attention's q/k norm and RoPE in one launch instead of ~10). `out_dtype`: x rounded to it first
    and the result in it. `residual` [x's shape]: returns (norm(residual + x), residual + x), the sum
    rounded to x's dtype (the decoder layer's residual add and the next norm in one launch)."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({n},)")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate has shape {tuple(gate.shape)}, expected {tuple(x.shape)}")
    cos, sin = rotary if rotary is not None else (weight, weight)
    if rotary is not None:
        if gate is not None or x.dim() < 3 or cos.dim() != 2 or cos.shape != sin.shape \
                or cos.shape[0] != x.shape[-3] or cos.shape[1] % 2 or cos.shape[1] > n:
            raise ValueError(f"rotary cos/sin must be [L, rd] (rd even, <= {n}) for x [..., L, heads, head_dim]; "
                             f"got {tuple(cos.shape)} / {tuple(sin.shape)} for x {tuple(x.shape)}")
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
    if x.device.type != "cuda" and not interpreting():
        raise ValueError("the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tests)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or gate is not None
                                 or rotary is not None):
        raise ValueError(f"residual must be a {x.dtype} tensor of shape {tuple(x.shape)} (not with gate or rotary)")
    dtype = out_dtype or x.dtype
    x2 = _rows(x, n)
    g2 = _rows(gate, n) if gate is not None else x2
    r2 = _rows(residual, n) if residual is not None else x2
    out = torch.empty(x2.shape, device=x.device, dtype=dtype)
    total = torch.empty(x2.shape, device=x.device, dtype=x.dtype) if residual is not None else out
    # A row shorter than the program's threads would be held several times over (replicated lanes): rows
    # under 128 get one warp and at least 32 slots. 128-2048 (Clover's 128, 256, 2048) as checked on an H200.
    block = max(32, next_power_of_2(n))
    warps = 1 if block < 128 else 4 if n <= 1024 else 8
    if x2.shape[0]:
        heads, length = (x.shape[-2], x.shape[-3]) if rotary is not None else (1, 1)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, g2, out, cos, sin, r2, total, n, x2.stride(0), g2.stride(0), out.stride(0), r2.stride(0),
            total.stride(0), eps, heads, length, cos.shape[-1] if rotary is not None else 0, cos.stride(0),
            UNIT_OFFSET=unit_offset and gate is None, GATED=gate is not None,
            ROUND_PRODUCT=torch.promote_types(weight.dtype, dtype) == dtype, ROTARY=rotary is not None,
            ROUND_INPUT=dtype != x.dtype, RESIDUAL=residual is not None, BLOCK=block, num_warps=warps,
        )
    if residual is not None:
        return out.view(x.shape), total.view(x.shape)
    return out.view(x.shape)
