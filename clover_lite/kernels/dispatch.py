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

from clover_lite.errors import CloverError
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
    where = "kernels=" if mode else "CLOVER_KERNELS="  # the user's setting, named in its errors
    mode = (mode or os.environ.get("CLOVER_KERNELS", "auto")).lower()
    if mode not in MODES:
        raise CloverError(f"{where}{mode!r}: use one of {', '.join(MODES)}")
    device = torch.device(device)
    if mode == "torch":
        return "torch"
    if mode == "triton":
        if not triton_available():
            raise CloverError(f"{where}triton, but triton is not installed: pip install triton, or use torch")
        if device.type != "cuda" and not interpreting():
            raise CloverError(f"{where}triton on the CPU runs Triton's interpreter, which must be asked for: set "
                              "TRITON_INTERPRET=1 before starting (slow: for tests), or use torch or auto")
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
