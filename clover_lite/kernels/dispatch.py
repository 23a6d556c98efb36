"""Which implementation runs: the Triton kernels on CUDA, the PyTorch reference elsewhere.

Chosen once, when a model is loaded (`select`), and installed on the model's modules (`apply`). The environment
variable CLOVER_KERNELS=auto|torch|triton overrides the choice for every kernel; `triton` with CPU
tensors and TRITON_INTERPRET=1 runs the real kernels in Triton's interpreter (how the tests run them).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from clover_lite.kernels.host import interpreting

MODES = ("auto", "torch", "triton")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken triton install is the same as none for us
        return False
    return True


def select(device: torch.device | str, mode: str | None = None, verified: bool = True) -> str:
    """'triton' or 'torch' for tensors on `device`, honouring CLOVER_KERNELS. `verified` False: the model's
    kernel path has not run on a GPU yet (kernels/configs.py), so `auto` keeps it on torch; an explicit
    `triton` still gets the kernels."""
    mode = (mode or os.environ.get("CLOVER_KERNELS", "auto")).lower()
    if mode not in MODES:
        raise ValueError(f"CLOVER_KERNELS must be one of {MODES}, got '{mode}'")
    device = torch.device(device)
    if mode == "torch":
        return "torch"
    if mode == "triton":
        if not triton_available():
            raise RuntimeError("CLOVER_KERNELS=triton but triton is not installed (pip install triton)")
        if device.type != "cuda" and not interpreting():
            raise RuntimeError("CLOVER_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (set before import)")
        return "triton"
    return "triton" if device.type == "cuda" and triton_available() and verified else "torch"


def apply(model: torch.nn.Module, backend: str) -> None:
    """The one dispatch point, at load: with the Triton backend, bind the kernel-backed forwards on every
    module of `model` that has one (kernels/forwards.py); with torch, the modules stay the reference."""
    if backend == "triton":
        from clover_lite.kernels.forwards import install

        install(model)


def chooser(backend: str) -> Callable:
    """What picks each denoising step's tokens (`runtime.sampling.choose`'s contract): the fused Triton
    sampler with the Triton backend, else the PyTorch reference."""
    if backend == "triton":
        from clover_lite.kernels.sampling import choose_fused

        return choose_fused
    from clover_lite.runtime.sampling import choose

    return choose
