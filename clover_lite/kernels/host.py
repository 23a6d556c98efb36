"""Host-side helpers of the kernels: launch arithmetic in plain Python integers, and whether Triton interprets.

In Triton 3.9 `triton.cdiv` and `triton.next_power_of_2` are constexpr functions: called from Python,
each first unwraps its arguments, a few microseconds a call, and an INT4 GEMM's launch made eight of them
(benchmarks/RESULTS.md, host time per call). Inside kernels, tl.cdiv as before.
"""

from __future__ import annotations

import os


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0, as triton.next_power_of_2)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1, set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
