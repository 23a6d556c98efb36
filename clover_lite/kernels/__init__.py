"""Triton kernels with their PyTorch references beside them, and the dispatch between the two."""

from clover_lite.kernels.dispatch import apply, interpreting, select, triton_available

__all__ = ["apply", "interpreting", "select", "triton_available", "w4a16_matmul", "fused_moe"]


def __getattr__(name):
    # Importing triton is slow and optional: the kernels load on first use.
    if name == "w4a16_matmul":
        from clover_lite.kernels.w4a16 import w4a16_matmul

        return w4a16_matmul
    if name == "fused_moe":
        from clover_lite.kernels.moe import fused_moe

        return fused_moe
    raise AttributeError(name)
