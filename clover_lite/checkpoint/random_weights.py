"""Random weights on the scale of a trained model's, made in place on the model's device.

Used for tiny test checkpoints (`clover tiny`) and for `clover bench --random-weights` (a 35B model made
on the GPU in seconds). Every tensor gets a value that matters: a zero-centred norm left at zero, or a
GDN decay left at its init, would hide bugs in the code that reads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

ProgressFn = Callable[[str, int, int], None]  # (stage, done, total)


@torch.no_grad()
def init_random_(model: torch.nn.Module, seed: int = 0, std: float = 0.02,
                 progress: ProgressFn | None = None) -> torch.nn.Module:
    """Fill a materialised model in place, on its device: float weights normal(0, std); zero-centred (1 + w)
    norms near 0, GDN gated norms and plain (w) norms near 1, decays log-uniform in [1, 16], conv filters on
    the 1/sqrt(kernel) scale; GPTQ tensors random nibbles with a symmetric zero of 8 and scales giving the
    same spread; random codes for NF4."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    owners = {f"{n}.{b}" if n else b: m for n, m in model.named_modules()
              for b, _ in [*m.named_buffers(recurse=False), *m.named_parameters(recurse=False)]}
    items = list(model.named_parameters()) + list(model.named_buffers())
    for i, (name, t) in enumerate(items):
        if t.is_floating_point() and not name.endswith(("scales", "nf4_absmax")):
            if name.endswith("A_log"):
                t.copy_(torch.empty(t.shape, device=device).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                t.normal_(1.0, 0.1, generator=gen)
            elif name.endswith("norm.weight") and ("linear_attn" in name
                                                   or not getattr(owners[name], "unit_offset", True)):
                t.normal_(1.0, 0.1, generator=gen)  # GDN's gated norms and norms scaling by w (not 1 + w)
            elif "norm" in name:
                t.normal_(0.0, 0.1, generator=gen)
            elif name.endswith("conv1d.weight"):
                t.normal_(0.0, 1.0 / math.sqrt(t.shape[-1]), generator=gen)
            else:
                t.normal_(0.0, std, generator=gen)
        elif name.endswith("qweight"):
            t.copy_(torch.randint(-(2**31), 2**31 - 1, t.shape, generator=gen, device=device, dtype=torch.int32))
        elif name.endswith("qzeros"):
            t.fill_(0x77777777)  # symmetric GPTQ v1 (meta_model's format): every nibble holds zero - 1 = 7
        elif name.endswith("scales"):
            t.fill_(std / 4.6)  # nibbles - 8 have a standard deviation of ~4.6
        elif name.endswith("g_idx"):
            m = owners[name]
            k = m.in_features
            t.copy_((torch.arange(k, device=device, dtype=torch.int32) // (k // m.groups)).expand_as(t))
        elif name.endswith("nf4_weight"):
            t.copy_(torch.randint(0, 256, t.shape, generator=gen, device=device, dtype=torch.uint8))
        elif name.endswith("nf4_absmax"):
            t.fill_(std * 2.5)
        if progress:
            progress("initialising random weights", i + 1, len(items))
    return model
