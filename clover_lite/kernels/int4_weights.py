"""The INT4 weights as the kernels take them: `Int4Weights` (GPTQ tensors of one linear or a stack of experts,
validated, in GPTQ's order or the MMA order of mma_layout.py), the K tile their groups allow, and the checks
of activations and fused gate/up pairs against them.

With an act-order g_idx the kernels gather scales and zeros per element; the modules avoid that:
kernels/forwards.py reorders desc_act rows by group once and gathers x's columns instead (Int4Weights.perm).
"""

from __future__ import annotations

import torch

from clover_lite.kernels import mma_layout
from clover_lite.kernels.host import interpreting


def _capturing(t: torch.Tensor) -> bool:
    """Whether work on t's device is being captured into a CUDA graph now (recorded, not run)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class Int4Weights:
    """GPTQ tensors of one linear ([K/8, N] ...) or a stack of experts ([E, K/8, N] ...), validated."""

    def __init__(self, qweight, scales, qzeros, group_size: int, g_idx=None, checkpoint_format: str = "gptq",
                 perm=None, mma_order: int = 0, sum_in_kernel: bool = True):
        """`perm` [.., K]: weights whose rows were reordered by group at load (quant.pack.sort_rows_by_group):
        row k multiplies input column perm[k]. The kernels do not read it; callers gather x's columns first.
        `mma_order` 2 or 4: qweight's words are in that MMA order (mma_layout.py), contiguous; 0: GPTQ's.
        `sum_in_kernel` False: split-K partials are summed by a launch of their own even where the config
        would sum them in the kernel (the GPU-verified way; kernels/forwards.py sets it from
        configs.kernel_changes)."""
        if qweight.dim() == 2:
            qweight, scales, qzeros = qweight[None], scales[None], qzeros[None]
            g_idx = None if g_idx is None else g_idx[None]
            perm = None if perm is None else perm[None]
        if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
            raise ValueError(f"qweight and qzeros must be int32, got {qweight.dtype} and {qzeros.dtype}")
        if scales.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"scales must be fp16/bf16/fp32, got {scales.dtype}")
        E, K8, N = qweight.shape
        K = K8 * 8
        if group_size == -1:
            group_size = K
        if group_size <= 0 or K % group_size:
            raise ValueError(f"group_size {group_size} does not divide K = {K}")
        G = K // group_size
        if scales.shape != (E, G, N):
            raise ValueError(f"scales have shape {tuple(scales.shape)}, expected {(E, G, N)} for K={K}, N={N}")
        if N % 8 or qzeros.shape != (E, G, N // 8):
            raise ValueError(f"qzeros have shape {tuple(qzeros.shape)}, expected {(E, G, N // 8)}")
        if g_idx is not None and g_idx.shape != (E, K):
            raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}, expected ({K},) per linear")
        if perm is not None and perm.shape != (E, K):
            raise ValueError(f"perm has shape {tuple(perm.shape)}, expected ({K},) per linear")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"checkpoint_format must be 'gptq' or 'gptq_v2', got '{checkpoint_format}'")
        devices = {t.device for t in (qweight, scales, qzeros) + (() if g_idx is None else (g_idx,))}
        if len(devices) != 1:
            raise ValueError(f"weight tensors are on different devices: {devices}")
        if g_idx is None and group_size < K and group_size & -group_size < 16:
            # Tiles are powers of two >= 16 inside one group: groups of 8 or 40 rows are followed row by row,
            # as act-order groups are.
            g_idx = (torch.arange(K, device=qweight.device, dtype=torch.int32) // group_size).expand(E, K)
        if mma_order and (mma_order not in mma_layout.ORDERS or not mma_layout.eligible(K, group_size, g_idx)
                          or not qweight.is_contiguous()):
            raise ValueError(f"weights in MMA order {mma_order} must be contiguous, without a g_idx, with K a multiple "
                             f"of {mma_layout.BLOCK} and groups of a multiple of {mma_layout.BLOCK} rows (orders "
                             f"{mma_layout.ORDERS}); got K = {K}, group size {group_size}")
        self.mma_order = mma_order
        self.sum_in_kernel = sum_in_kernel
        self.qweight, self.scales, self.qzeros = qweight, scales, qzeros
        self.g_idx = None if g_idx is None else g_idx.to(torch.int32)
        self.E, self.K, self.N, self.group_size = E, K, N, group_size
        self.perm = perm
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0
        self._tile_done: torch.Tensor | None = None
        self._outgrown: list[torch.Tensor] = []

    def tile_counters(self, tiles: int) -> torch.Tensor:
        """Zeroed int32 counters, one per output tile, for the kernels' in-kernel sum over K splits
        (int4_split_k.last_split_sums). Kept with the weights: every launch leaves them at zero again, so launches in
        stream order (eager or replayed from a CUDA graph) share one set with no memset. A set that a call
        outgrows stays allocated: a CUDA graph captured with it still counts there when replayed. While a
        graph is being captured, a set too small is not replaced: the zeros of a new one would be a captured
        memset, not yet run, so that call gets a set of its own, zeroed in the graph before its launch."""
        if self._tile_done is not None and self._tile_done.numel() >= tiles:
            return self._tile_done
        fresh = torch.zeros(tiles, dtype=torch.int32, device=self.qweight.device)
        if _capturing(self.qweight):
            return fresh
        if self._tile_done is not None:
            self._outgrown.append(self._tile_done)
        self._tile_done = fresh
        return fresh

    def in_mma_order(self, order: int) -> Int4Weights:
        """These weights with a copy of the words rearranged in `order` (mma_layout.py)."""
        return Int4Weights(mma_layout.to_mma(self.qweight, order), self.scales, self.qzeros, self.group_size,
                           self.g_idx, "gptq" if self.zero_offset else "gptq_v2", self.perm, mma_order=order,
                           sum_in_kernel=self.sum_in_kernel)

    def args(self):
        gi = self.g_idx if self.g_idx is not None else self.qweight  # any pointer; unused without g_idx
        return self.qweight, self.scales, self.qzeros, gi

    def strides(self):
        sg = (self.g_idx.stride(0), self.g_idx.stride(1)) if self.g_idx is not None else (0, 0)
        return (*self.qweight.stride(), *self.scales.stride(), *self.qzeros.stride(), *sg)


def block_k_for(block_k: int, w: Int4Weights) -> int:
    """Without a g_idx a tile must not straddle two groups: the largest power of two up to block_k that
    divides the group size (Int4Weights gives a group with none >= 16, say 8 or 40 rows, a g_idx). In the MMA
    order a tile is 1-4 of a 128-row block's 32-row slices (its groups are whole blocks)."""
    if w.mma_order:
        return min(max(block_k, 32), mma_layout.BLOCK)
    if w.g_idx is None and w.group_size < w.K:
        return min(block_k, w.group_size & -w.group_size)
    return block_k


def check_x(x: torch.Tensor, w: Int4Weights) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if x.shape[1] != w.K:
        raise ValueError(f"x has K = {x.shape[1]} but the weights have K = {w.K}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if x.device != w.qweight.device:
        raise ValueError(f"x is on {x.device} but the weights are on {w.qweight.device}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError("the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tests)")


def check_pair(w: Int4Weights, w2: Int4Weights | None) -> None:
    """Fused gate/up: the kernel reads both weight sets with w's sizes, strides, group size and zero offset."""
    if w2 is None:
        return
    mine = (w.E, w.K, w.N, w.group_size, w.zero_offset, w.g_idx is None, w.strides(), w.mma_order)
    theirs = (w2.E, w2.K, w2.N, w2.group_size, w2.zero_offset, w2.g_idx is None, w2.strides(), w2.mma_order)
    if mine != theirs:
        raise ValueError("fused gate and up weights must share experts, K, N, group size, checkpoint format, "
                         "act-order and memory layout; got (E, K, N, group, zero offset, no g_idx, strides, "
                         f"MMA order) {mine} and {theirs}: quantize both projections with the same settings")
