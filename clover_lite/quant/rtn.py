"""Min-max round-to-nearest INT4 quantization of groups of input channels (GPTQ's quantizer).

Every function takes weights with optional leading batch dimensions ([..., N, K]), so all experts of a
layer are quantized in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clover_lite.quant.pack import MAXQ, pack_qweight, pack_qzeros, zero_offset


@dataclass(frozen=True)
class QuantSpec:
    """How a linear is quantized. group_size -1 means one group per output channel (per-channel)."""

    group_size: int = 128
    sym: bool = True
    checkpoint_format: str = "gptq"  # gptq (v1: zero stored minus one) | gptq_v2

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else in_features // self.group_size

    def group_len(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


def find_params(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero per row of w [..., N, k] (one group of k input channels): the fp16-rounded scale (what
    is stored, so quantization and dequantization agree exactly) and the integer zero, both [..., N] fp32."""
    w = w.float()
    xmin = w.amin(-1).clamp(max=0)
    xmax = w.amax(-1).clamp(min=0)
    if spec.sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = -xmax
    span = xmax - xmin
    span = torch.where(span == 0, torch.ones_like(span), span)  # all-zero group: any scale works
    scale = (span / MAXQ).half().float()
    if spec.sym:
        zero = torch.full_like(scale, (MAXQ + 1) / 2)
    else:
        zero = torch.round(-xmin / scale)
        if spec.checkpoint_format == "gptq":
            # v1 stores zero - 1 in 4 bits: a zero of 0 cannot be written. Such a group (no weight below minus
            # half a step) takes zero 1 and a scale fitting its maximum in the 14 steps above it: every weight
            # stays within half a step (a plain clamp of the zero would push the top weights a whole step off).
            low = zero < 1
            scale = torch.where(low, (xmax / (MAXQ - 1)).half().float(), scale)
            zero = torch.where(low, torch.ones_like(zero), zero)
        zero = zero.clamp(0, MAXQ)
    scale = torch.where(scale == 0, torch.full_like(scale, 2.0**-24), scale)  # below the fp16 range
    return scale, zero


def quantize_to_int(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """w [..., N, k] -> integers in 0..15 for per-row scale/zero [..., N]."""
    return torch.clamp(torch.round(w.float() / scale[..., None]) + zero[..., None], 0, MAXQ)


@dataclass
class QuantizedWeight:
    """A quantized linear (or a batch of them) before packing: q [..., N, K] integers, scales and true
    zeros [..., G, N], g_idx [..., K]."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor

    def __getitem__(self, i) -> QuantizedWeight:
        return QuantizedWeight(self.q[i], self.scales[i], self.zeros[i], self.g_idx[i])

    def dequantize(self) -> torch.Tensor:
        """W [..., N, K] fp32 as the runtime will see it."""
        N = self.q.shape[-2]
        idx = self.g_idx.long().unsqueeze(-1).expand(*self.g_idx.shape, N)  # [..., K, N]
        zeros = self.zeros.gather(-2, idx).transpose(-1, -2)
        scales = self.scales.gather(-2, idx).transpose(-1, -2)
        return (self.q.float() - zeros) * scales

    def pack(self, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
        """The GPTQ tensors (qweight, qzeros, scales fp16, g_idx) of one linear in the given format."""
        if self.q.dim() != 2:
            raise ValueError("pack one linear at a time (index a batch first)")
        stored = self.zeros - zero_offset(checkpoint_format)
        if stored.min() < 0 or stored.max() > MAXQ:
            raise ValueError(f"zeros do not fit the {checkpoint_format} format")
        return {
            "qweight": pack_qweight(self.q.t().contiguous()),
            "qzeros": pack_qzeros(stored.to(torch.int32)),
            "scales": self.scales.half(),
            "g_idx": self.g_idx.to(torch.int32),
        }


def quantize_rtn(w: torch.Tensor, spec: QuantSpec) -> QuantizedWeight:
    """Round-to-nearest: each group of input channels gets its own min-max scale and zero. w [..., N, K]."""
    K = w.shape[-1]
    glen = spec.group_len(K)
    if K % glen:
        raise ValueError(f"group size {glen} does not divide in_features {K}")
    scales, zeros, qs = [], [], []
    for s in range(0, K, glen):
        scale, zero = find_params(w[..., s : s + glen], spec)
        qs.append(quantize_to_int(w[..., s : s + glen], scale, zero))
        scales.append(scale)
        zeros.append(zero)
    g_idx = (torch.arange(K, device=w.device, dtype=torch.int32) // glen).expand(*w.shape[:-2], K).contiguous()
    return QuantizedWeight(torch.cat(qs, -1).to(torch.int32), torch.stack(scales, -2), torch.stack(zeros, -2), g_idx)
