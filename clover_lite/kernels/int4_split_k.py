"""Split-K for the INT4 GEMM and GEMV: K split over the grid's third axis, each split storing fp32 partials.

The last split of each output tile to finish sums them in the same launch (last_split_sums: an atomic
counter per tile), where a second launch (_sum_splits) used to, and still does where the config or the
weights turn the in-kernel sum off. Also the launchers' split sizes, partial buffers and results.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from clover_lite.kernels import configs
from clover_lite.kernels.host import cdiv
from clover_lite.kernels.int4_launch import as_dtype
from clover_lite.kernels.int4_weights import Int4Weights


@triton.jit
def last_split_sums(part_ptr, s_split, part_offs, up_offset, sum_ptrs, mask, tile_done_ptr, GATED: tl.constexpr):
    """Called by every split (axis 2) of an output tile once its fp32 partial is stored (at part_ptr + split *
    s_split + part_offs; up's at up_offset further when GATED). The split that counts itself last on the tile's
    counter sums the partials in split order, exactly as _sum_splits does, writes them (silu(gate) * up when
    GATED) at sum_ptrs in their dtype, and sets the counter back to 0 for the next launch on these weights.
    Ordering on a GPU: the barrier puts every thread's partial before the count, the counter's acquire-release
    makes the other splits' partials visible to the last one, and its loads go to L2 (.cg), past an L1 that
    may hold stale lines. One launch less after each split GEMM (_sum_splits' launch costs more than the sum)."""
    tl.debug_barrier()
    done = tl.atomic_add(tile_done_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    splits = tl.num_programs(2)
    if done == splits - 1:
        acc = tl.zeros_like(part_offs).to(tl.float32)
        acc2 = tl.zeros_like(part_offs).to(tl.float32)
        for s in range(splits):
            acc += tl.load(part_ptr + s * s_split + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
            if GATED:
                acc2 += tl.load(part_ptr + s * s_split + part_offs + up_offset, mask=mask, other=0.0,
                                cache_modifier=".cg")
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc2
        tl.store(sum_ptrs, acc.to(sum_ptrs.dtype.element_ty), mask=mask)
        tl.atomic_xchg(tile_done_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _sum_splits_kernel(src_ptr, dst_ptr, n_out, N, SPLITS, s_split, GATED: tl.constexpr, BLOCK: tl.constexpr):
    """dst [M, N] = the fp32 partials src [SPLITS, M, N] summed, in dst's dtype. GATED: src rows hold the gate's
    and the up projection's partials side by side ([SPLITS, M, 2N]) and dst = silu(gate) * up of the sums."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_out
    src = offs
    if GATED:
        src = (offs // N) * (2 * N) + offs % N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(src_ptr + s * s_split + src, mask=mask, other=0.0)
        if GATED:
            acc2 += tl.load(src_ptr + s * s_split + src + N, mask=mask, other=0.0)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    tl.store(dst_ptr + offs, acc.to(dst_ptr.dtype.element_ty), mask=mask)


def _sum_splits(partials: torch.Tensor, n: int, dtype: torch.dtype, gated: bool = False) -> torch.Tensor:
    """[splits, M, N (2N gated)] fp32 partials -> [M, N] in dtype, in one launch (a sum and a cast in torch were
    two, after each of a step's 250 split GEMMs on an H200; benchmarks/RESULTS.md)."""
    m = partials.shape[1]
    out = torch.empty(m, n, device=partials.device, dtype=dtype)
    if out.numel():
        block = 1024
        _sum_splits_kernel[(cdiv(out.numel(), block),)](
            partials, out, out.numel(), n, partials.shape[0], partials.stride(0), GATED=gated, BLOCK=block)
    return out


def k_splits(K: int, split: int, bk: int) -> tuple[int, int]:
    """K rows per split (whole BLOCK_K tiles) and the number of splits that leaves none empty."""
    k_per = cdiv(cdiv(K, max(1, min(split, cdiv(K, bk)))), bk) * bk
    return k_per, cdiv(K, k_per)


def check_partials(sum_splits: bool, w2: Int4Weights | None) -> None:
    if not sum_splits and w2 is not None:
        raise ValueError("fused gate/up partials hold both projections: sum_splits=False is for one weight set")


def split_buffer(split: int, rows: int, w: Int4Weights, fused: bool, cdt: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """The INT4 launchers' output [split, rows, N]: fp32 partials when K is split (gate's and up's side by
    side, 2N, when fused), else in the compute dtype."""
    width = 2 * w.N if fused and split > 1 else w.N
    return torch.empty(split, rows, width, device=device, dtype=torch.float32 if split > 1 else cdt)


def sum_target(split: int, sum_splits: bool, cfg: configs.GemmConfig | configs.GemvConfig, rows: int,
               w: Int4Weights, cdt: torch.dtype, grid: tuple[int, int, int],
               dummy: torch.Tensor) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """Whether the kernel sums its K splits itself (more than one, summed, the config's and the weights'
    sum_in_kernel),
    with the output [rows, N] that the last split of each tile writes and the tiles' counters; else `dummy`
    for both (pointers the kernel never touches)."""
    if not (split > 1 and sum_splits and cfg.sum_in_kernel and w.sum_in_kernel):
        return False, dummy, dummy
    return True, torch.empty(rows, w.N, device=dummy.device, dtype=cdt), w.tile_counters(grid[0] * grid[1])


def split_result(out: torch.Tensor, x: torch.Tensor, w: Int4Weights, cdt: torch.dtype,
                 fused: bool, summed: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, N] in x's dtype from a split_buffer: the one split, the partials summed (with the fused
    SiLU, which is not linear: after the sum), or `summed` where the kernel's last splits did that."""
    if summed is not None:
        return as_dtype(summed, x.dtype)
    if out.shape[0] == 1:
        return as_dtype(out[0], x.dtype)
    return as_dtype(_sum_splits(out, w.N, cdt, gated=fused), x.dtype)
