"""Uninitialized memory made visible on the CPU: every tensor from torch.empty and its kin starts as poison.

On a GPU, torch.empty returns whatever the caching allocator's block last held: a kernel (or torch code)
that reads an element nobody wrote gets a previous tensor's values, finite and plausible, and its result is
off by an amount that changes from run to run. On a CPU the same read mostly sees fresh zero pages, which
a masked row or a padded tile multiplies away, so the bug passes every test. `poisoned_empty()` fills each
new uninitialized tensor with NaN (floats) or a huge value (integers: as an index it lands outside every
tensor, which tests/triton_memcheck.py reports), so any result that depends on such a read is NaN or an
out-of-bounds error, as compute-sanitizer's initcheck would report on a GPU.
"""

from __future__ import annotations

import contextlib

import torch

try:  # private: present from torch 2.0 to at least 2.13 (the GPU image runs 2.11)
    from torch.utils._device import _device_constructors
except ImportError:
    _device_constructors = None

# Integer poison: far past any tensor's end as an element index, and not a value any kernel writes as a
# sentinel (-1, 0).
_INT_POISON = {torch.int64: 0x3FFF_FFF1_0000_0001, torch.int32: 0x3FFF_FFF1, torch.int16: 0x3FF1,
               torch.int8: 0x5A, torch.uint8: 0xA5}


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill `t` in place with the poison of its dtype (nothing for meta tensors, bools and complex)."""
    if t.device.type == "meta" or not t.numel():
        return t
    with torch.no_grad():
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype in _INT_POISON:
            t.fill_(_INT_POISON[t.dtype])
    return t


@contextlib.contextmanager
def poisoned_empty():
    """While active, torch.empty, empty_like, empty_strided and Tensor.new_empty return poisoned tensors."""
    # `with torch.device(...)` recognizes factory functions by identity, from a set it builds once: build it
    # before torch.empty is replaced, or the builtin would no longer be in it and land on the CPU.
    if _device_constructors is not None:
        _device_constructors()
    originals = {name: getattr(torch, name) for name in ("empty", "empty_like", "empty_strided")}
    new_empty = torch.Tensor.new_empty

    def wrap(fn):
        def poisoned(*args, **kwargs):
            return poison_(fn(*args, **kwargs))
        return poisoned

    for name, fn in originals.items():
        setattr(torch, name, wrap(fn))
    torch.Tensor.new_empty = wrap(new_empty)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)
        torch.Tensor.new_empty = new_empty
