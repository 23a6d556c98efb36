"""Which implementation runs: the Triton kernels on CUDA, the PyTorch reference elsewhere.

Chosen once, when a model is loaded (`select`), and stored on each quantized module. The environment
variable CLOVER_KERNELS=auto|torch|triton overrides the choice for every kernel; `triton` with CPU
tensors and TRITON_INTERPRET=1 runs the real kernels in Triton's interpreter (how the tests run them).
"""

from __future__ import annotations

import functools
import os

import torch

MODES = ("auto", "torch", "triton")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken triton install is the same as none for us
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def select(device: torch.device | str, mode: str | None = None) -> str:
    """'triton' or 'torch' for tensors on `device`, honouring CLOVER_KERNELS."""
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
    return "triton" if device.type == "cuda" and triton_available() else "torch"


def apply(model: torch.nn.Module, backend: str) -> None:
    """Record the backend on every module that has a kernel path and let it prepare for the kernels,
    children before parents (a parent may combine what its children prepared)."""
    modules = [m for m in model.modules() if hasattr(m, "backend")]
    for module in modules:
        module.backend = backend
    if backend == "triton":
        for module in reversed(modules):
            if hasattr(module, "prepare"):
                module.prepare()
