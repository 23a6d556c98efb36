"""Out-of-bounds memory access by an interpreted Triton kernel, caught on the CPU.

The interpreter reads any host address it is given, so an unmasked load past a tensor's end returns
garbage instead of failing (shared DESIGN.md section 5); on a GPU the same load is an illegal-address
crash or a silently wrong result. `check_bounds()` wraps the interpreter's loads and stores: every address
a kernel touches under its mask must lie inside the memory span of one of the tensors passed to that
launch (a view's span: from its first to its last element, by its strides).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from triton.runtime import interpreter


class OutOfBounds(AssertionError):
    pass


def _spans(args) -> list[tuple[int, int]]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.numel():
                last = sum((n - 1) * s for n, s in zip(a.shape, a.stride(), strict=True))
                out.append((a.data_ptr(), a.data_ptr() + (last + 1) * a.element_size()))
        elif isinstance(a, (tuple, list)):
            out += _spans(a)
    return out


def _check(launch: list, kind: str, ptrs, mask, elt: int) -> None:
    addr = np.broadcast_to(ptrs.data, np.broadcast_shapes(ptrs.data.shape, mask.data.shape))
    addr = addr[np.broadcast_to(mask.data, addr.shape)].astype(np.uint64)
    if not addr.size:
        return
    spans = sorted(launch[-1]) if launch else []
    lo = np.array([s for s, _ in spans], dtype=np.uint64)
    hi = np.array([e for _, e in spans], dtype=np.uint64)
    i = np.searchsorted(lo, addr, side="right") - 1  # the last span starting at or before each address
    ok = i >= 0
    ok[ok] = addr[ok] + np.uint64(elt) <= hi[i[ok]]
    if not ok.all():
        bad = int(addr[~ok][0])
        near = min(spans, key=lambda s: min(abs(bad - s[0]), abs(bad - s[1])), default=None)
        where = f"; nearest tensor spans bytes [{near[0]:#x}, {near[1]:#x})" if near else ""
        raise OutOfBounds(f"{kind} of {int((~ok).sum())} element(s) outside every tensor argument, first at "
                          f"{bad:#x}{where}")


@contextlib.contextmanager
def check_bounds():
    """While active, an interpreted kernel that loads or stores outside its tensor arguments raises
    OutOfBounds (wrapped by the interpreter in an InterpreterError)."""
    launch: list[list[tuple[int, int]]] = []
    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    init_args, call = executor._init_args_hst, executor.__call__
    load, store = builder.create_masked_load, builder.create_masked_store

    def init_args_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        launch.append(_spans(list(args_hst) + list(kwargs_hst.values())))
        return args_hst, kwargs_hst

    def call_checked(self, *args, **kwargs):
        depth = len(launch)
        try:
            return call(self, *args, **kwargs)
        finally:
            del launch[depth:]

    def load_checked(self, ptrs, mask, other, *rest):
        _check(launch, "load", ptrs, mask, np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize)
        return load(self, ptrs, mask, other, *rest)

    def store_checked(self, ptrs, value, mask, *rest):
        _check(launch, "store", ptrs, mask, value.data.dtype.itemsize)
        return store(self, ptrs, value, mask, *rest)

    executor._init_args_hst, executor.__call__ = init_args_checked, call_checked
    builder.create_masked_load, builder.create_masked_store = load_checked, store_checked
    try:
        yield
    finally:
        executor._init_args_hst, executor.__call__ = init_args, call
        builder.create_masked_load, builder.create_masked_store = load, store
