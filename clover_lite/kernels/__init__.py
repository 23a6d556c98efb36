"""Triton kernels with their PyTorch references beside them, and the dispatch between the two."""

from .dispatch import apply, interpreting, select, triton_available

__all__ = ["apply", "interpreting", "select", "triton_available", "w4a16_matmul", "fused_moe"]


def __getattr__(name):
    # Importing triton is slow and optional: the kernels load on first use.
    if name == "w4a16_matmul":
        from .w4a16 import w4a16_matmul

        return w4a16_matmul
    if name == "fused_moe":
        from .moe import fused_moe

        return fused_moe
    raise AttributeError(name)
