"""Which device and dtype a model runs on: "auto", "cuda:N" checked against this machine, defaults per device."""

from __future__ import annotations

import contextlib

import torch

from clover_lite.errors import CloverError


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise CloverError(f"unknown device {device!r}: clover-lite runs on 'cpu' or 'cuda' ('cuda:N' for one GPU "
                          "of several); 'auto' picks CUDA when there is one")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CloverError(f"device '{device}' requested but CUDA is not available here; use the CPU (device "
                          "'cpu', --device cpu) or 'auto'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise CloverError(f"device '{device}' requested but this machine has {n} CUDA device{'s' * (n != 1)} "
                          f"(cuda:0 to cuda:{n - 1})")
    return dev


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` made the current CUDA device for the block (nothing to do elsewhere)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype is None:
        # bf16 matmuls on CPU are slow and fp16 inexact there: fp32 on CPU, bf16 on GPUs.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in names:
        raise CloverError(f"unknown dtype '{dtype}'; use one of {sorted(names)}")
    return names[dtype]
