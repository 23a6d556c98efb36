"""NF4 (QLoRA's 4-bit NormalFloat) as the no-calibration baseline, in bitsandbytes' layout.

Quantizing uses bitsandbytes itself (an optional dependency: `pip install clover-lite[nf4]`) so the
baseline is the real thing; dequantizing is plain PyTorch, so NF4 models run without it.
"""

from __future__ import annotations

import logging

import torch

from clover_lite.errors import CloverError

# The 16 NF4 levels (Dettmers et al. 2023, QLoRA, appendix E), as bitsandbytes uses them.
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


def quantize_nf4(w: torch.Tensor, blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (packed uint8 [N*K/2], absmax fp32 [N*K/blocksize]) with bitsandbytes."""
    # bitsandbytes warns on import that an optional CPU GEMM kernel is missing: we only quantize with it.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes.functional as bnbf
    except ImportError as e:
        raise CloverError("--method nf4 needs bitsandbytes: pip install 'clover-lite[nf4]'") from e
    packed, state = bnbf.quantize_4bit(w.float().contiguous(), blocksize=blocksize, quant_type="nf4")
    if state.nested:
        raise CloverError("nested (double-quantized) NF4 absmax is not supported")
    return packed.reshape(-1).cpu(), state.absmax.float().reshape(-1).cpu()


def dequantize_nf4(
    packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], blocksize: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """(packed, absmax) -> W [N, K]: each byte holds two codes, high nibble first."""
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=packed.device)
    p = packed.reshape(-1).to(torch.int32)
    codes = torch.stack([p >> 4, p & 15], dim=1).reshape(-1)
    w = levels[codes].view(-1, blocksize) * absmax.float().view(-1, 1)
    return w.view(shape).to(dtype or torch.float32)
