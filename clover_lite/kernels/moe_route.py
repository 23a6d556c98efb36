"""The MoE's routing glue in three kernels: router top-k, the sort of (token, expert) pairs by expert, and
the combine of the experts' outputs back to tokens.

In PyTorch a layer's routing was about 20 launches of a few microseconds each (softmax, top-k's two sorts,
the renormalisation, a radix sort of the pairs, gathers, casts, an index_put and a sum): about 45 us of an
H200's step per MoE layer, 1.8 ms over Clover's 40 (benchmarks/RESULTS.md, 2026-12-04, call 3 profile).

- `topk_softmax`: one program per token: softmax in fp32, top-k by repeated argmax (ties to the lower
  expert id), renormalised. The same numbers as models/moe.py's Router.select up to fp32 rounding.
- `sort_pairs`: the pairs' stable order by expert as a rank count: pair i lands at the number of pairs
  (e_j, j) before (e_i, i). O(P^2) comparisons, which for a block's P = 32 x 8 = 256 pairs is one launch
  of a few programs; past SORT_KERNEL_MAX_PAIRS (prefill) torch's radix sort takes over with the same output.
- `combine`: token t's output is the sum over its k pairs (and over the down projection's split-K
  partials) of the rows the experts wrote, routing weights already applied, rounded once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from clover_lite.kernels.host import cdiv, interpreting, next_power_of_2

SORT_KERNEL_MAX_PAIRS = 4096  # past this the O(P^2) rank count costs more than torch's radix sort


@dataclass
class ExpertPairs:
    """The T x k (token, expert) pairs in their stable order by expert (pair i = token i // k, choice i % k)."""

    expert: torch.Tensor  # [P] int32: expert of each sorted pair, ascending
    token: torch.Tensor  # [P] int32: its token
    scale: torch.Tensor  # [P] fp32: its routing weight
    position: torch.Tensor  # [P] int32: where pair i sits in the sorted order
    rank: torch.Tensor  # [P] int32: index of each sorted pair among its expert's pairs
    count: torch.Tensor  # [P] int32: pairs its expert holds


@triton.jit
def _topk_softmax_kernel(logits_ptr, w_ptr, ids_ptr, T, E, s_l, K: tl.constexpr, NORMALIZE: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    offs = tl.arange(0, BLOCK_E)[None, :]
    ok = (offs_t < T) & (offs < E)
    logit = tl.load(logits_ptr + offs_t * s_l + offs, mask=ok, other=float("-inf")).to(tl.float32)
    top = tl.max(logit, axis=1)[:, None]
    p = tl.exp(logit - tl.where(offs_t < T, top, 0.0))  # (rows past T: all -inf, kept from -inf - -inf)
    p = p / tl.where(offs_t < T, tl.sum(p, axis=1)[:, None], 1.0)
    left = tl.where(ok, p, -1.0)  # probabilities not yet chosen; -1 below any of them
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    chosen = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(left, axis=1)[:, None]
        e = tl.min(tl.where(left == best, offs, BLOCK_E), axis=1)[:, None]  # the lowest id among equals
        chosen = tl.where(offs_k == j, best, chosen)
        ids = tl.where(offs_k == j, e.to(tl.int64), ids)
        left = tl.where(offs == e, -1.0, left)
    if NORMALIZE:
        chosen = chosen / tl.sum(chosen, axis=1)[:, None]
    k_ok = (offs_t < T) & (offs_k < K)
    tl.store(w_ptr + offs_t * K + offs_k, chosen.to(w_ptr.dtype.element_ty), mask=k_ok)
    tl.store(ids_ptr + offs_t * K + offs_k, ids, mask=k_ok)


def topk_softmax(logits: torch.Tensor, k: int, normalize: bool,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in dtype, expert ids [T, k] int64): top-k of softmax(logits)
    in fp32, renormalised to sum 1 if `normalize`; ties go to the lower expert id."""
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got shape {tuple(logits.shape)}")
    T, E = logits.shape
    if not 0 < k <= E:
        raise ValueError(f"top-k must be in [1, {E}] for {E} experts, got {k}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(T, k, device=logits.device, dtype=dtype)
    ids = torch.empty(T, k, device=logits.device, dtype=torch.int64)
    if T:
        block_e = next_power_of_2(E)
        # a token per program on a GPU; under the interpreter, whose cost grows with the programs, up to 64
        block_t = min(64, next_power_of_2(T)) if interpreting() else 1
        _topk_softmax_kernel[(cdiv(T, block_t),)](
            logits, weights, ids, T, E, logits.stride(0), K=k, NORMALIZE=normalize, BLOCK_T=block_t,
            BLOCK_E=block_e, BLOCK_K=next_power_of_2(k), num_warps=1 if block_e <= 256 else 4)
    return weights, ids


@triton.jit
def _sort_pairs_kernel(ids_ptr, w_ptr, pos_ptr, expert_ptr, token_ptr, scale_ptr, rank_ptr, count_ptr, P, K,
                       BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    offs_i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = offs_i < P
    e_i = tl.load(ids_ptr + offs_i, mask=i_ok, other=0).to(tl.int32)
    less = tl.zeros((BLOCK_I,), dtype=tl.int32)  # pairs of a lower expert
    before = tl.zeros((BLOCK_I,), dtype=tl.int32)  # earlier pairs of the same expert
    same = tl.zeros((BLOCK_I,), dtype=tl.int32)  # all pairs of the same expert
    for j0 in range(0, P, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        j_ok = offs_j < P
        e_j = tl.load(ids_ptr + offs_j, mask=j_ok, other=0).to(tl.int32)
        eq = (e_j[None, :] == e_i[:, None]) & j_ok[None, :]
        less += tl.sum(((e_j[None, :] < e_i[:, None]) & j_ok[None, :]).to(tl.int32), axis=1)
        before += tl.sum((eq & (offs_j[None, :] < offs_i[:, None])).to(tl.int32), axis=1)
        same += tl.sum(eq.to(tl.int32), axis=1)
    pos = less + before
    tl.store(pos_ptr + offs_i, pos, mask=i_ok)
    tl.store(expert_ptr + pos, e_i, mask=i_ok)
    tl.store(token_ptr + pos, offs_i // K, mask=i_ok)
    tl.store(scale_ptr + pos, tl.load(w_ptr + offs_i, mask=i_ok, other=0.0).to(tl.float32), mask=i_ok)
    tl.store(rank_ptr + pos, before, mask=i_ok)
    tl.store(count_ptr + pos, same, mask=i_ok)


def sort_pairs(expert_ids: torch.Tensor, routing_weights: torch.Tensor, num_experts: int) -> ExpertPairs:
    """expert ids / routing weights [T, k] -> the pairs in their stable order by expert (ExpertPairs)."""
    if expert_ids.shape != routing_weights.shape or expert_ids.dim() != 2:
        raise ValueError(f"expert ids {tuple(expert_ids.shape)} and routing weights {tuple(routing_weights.shape)} "
                         "must both be [T, k]")
    P = expert_ids.numel()
    if P > SORT_KERNEL_MAX_PAIRS:
        return sort_pairs_reference(expert_ids, routing_weights, num_experts)
    ids, w = expert_ids.reshape(-1), routing_weights.reshape(-1)
    dev = expert_ids.device
    pos, expert, token, rank, count = (torch.empty(P, device=dev, dtype=torch.int32) for _ in range(5))
    scale = torch.empty(P, device=dev, dtype=torch.float32)
    if P:
        # [BLOCK_I, BLOCK_J] comparisons per step: 64 x 32 on a GPU (128 x 128 at 4 warps spilled on sm_90,
        # benchmarks/compile_check.py); under the interpreter few, large tiles.
        bi, bj = (min(128, next_power_of_2(P)),) * 2 if interpreting() else (64, 32)
        _sort_pairs_kernel[(cdiv(P, bi),)](ids, w, pos, expert, token, scale, rank, count, P,
                                           expert_ids.shape[1], BLOCK_I=bi, BLOCK_J=bj)
    return ExpertPairs(expert, token, scale, pos, rank, count)


def sort_pairs_reference(expert_ids: torch.Tensor, routing_weights: torch.Tensor, num_experts: int) -> ExpertPairs:
    """sort_pairs in torch: a stable radix sort (on 16-bit keys when the ids fit: an H200 took 27 us a layer
    for 256 int64 keys, 13.5 for int16)."""
    flat = expert_ids.reshape(-1).long()
    P, k = flat.numel(), expert_ids.shape[1]
    order = torch.argsort(flat.to(torch.int16) if num_experts <= 1 << 15 else flat, stable=True)
    expert = flat[order]
    counts = torch.bincount(expert, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(order)
    position[order] = torch.arange(P, device=flat.device)
    i32 = torch.int32
    return ExpertPairs(expert.to(i32), (order // k).to(i32), routing_weights.reshape(-1)[order].float(),
                       position.to(i32), (torch.arange(P, device=flat.device) - starts[expert]).to(i32),
                       counts[expert].to(i32))


@triton.jit
def _combine_kernel(y_ptr, rows_ptr, out_ptr, add_ptr, logit_ptr, res_ptr, T, N, SPLITS, s_ys, s_ym, s_om, s_am,
                    s_lm, s_rm, K: tl.constexpr, HAS_ADD: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = offs_t < T
    mask = t_ok[:, None] & (offs_n < N)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(rows_ptr + offs_t * K + j, mask=t_ok, other=0).to(tl.int64)
        for s in range(SPLITS):
            y = tl.load(y_ptr + s * s_ys + row[:, None] * s_ym + offs_n[None, :], mask=mask, other=0.0)
            acc += y.to(tl.float32)
    if HAS_ADD:  # the shared expert under its sigmoid gate
        gl = tl.load(logit_ptr + offs_t * s_lm, mask=t_ok, other=0.0).to(tl.float32)
        sh = tl.load(add_ptr + offs_t[:, None] * s_am + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += sh / (1.0 + tl.exp(-gl))[:, None]
    if HAS_RESIDUAL:  # the decoder layer's residual stream: x + mlp(h) with no launch of its own
        acc += tl.load(res_ptr + offs_t[:, None] * s_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_t[:, None] * s_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(y: torch.Tensor, rows: torch.Tensor, k: int, dtype: torch.dtype, add: torch.Tensor | None = None,
            add_logit: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """y [splits, R, N] (the down projection's split-K partials, or [1, R, N]), rows [T * k]: the row of y
    holding pair i -> out [T, N] in dtype, out[t] = sum over splits and j < k of y[:, rows[t * k + j]],
    plus sigmoid(add_logit[t]) * add[t] with `add` [T, N] and `add_logit` [T, 1] (the shared expert), plus
    residual[t] ([T, N]), all summed in fp32 and rounded once."""
    if y.dim() != 3 or y.stride(2) != 1:
        raise ValueError(f"y must be [splits, rows, N] with unit column stride, got shape {tuple(y.shape)}")
    if rows.numel() % k:
        raise ValueError(f"{rows.numel()} pair rows is not a multiple of top-k = {k}")
    T, N = rows.numel() // k, y.shape[2]
    if add is not None and (add.shape != (T, N) or add.stride(1) != 1 or add_logit is None
                            or add_logit.shape != (T, 1)):
        raise ValueError(f"add must be [T, N] = {(T, N)} (unit column stride) with add_logit [T, 1]")
    if residual is not None and (residual.shape != (T, N) or residual.stride(1) != 1):
        raise ValueError(f"residual must be [T, N] = {(T, N)} with unit column stride, got {tuple(residual.shape)}")
    out = torch.empty(T, N, device=y.device, dtype=dtype)
    if T and N:
        if interpreting():  # few, large tiles
            block_t, block_n = min(64, next_power_of_2(T)), next_power_of_2(N)
        else:
            block_t, block_n = 1, min(1024, next_power_of_2(N))
        _combine_kernel[(cdiv(T, block_t), cdiv(N, block_n))](
            y, rows, out, add if add is not None else y, add_logit if add is not None else y,
            residual if residual is not None else y, T, N, y.shape[0], y.stride(0), y.stride(1), out.stride(0),
            add.stride(0) if add is not None else 0, add_logit.stride(0) if add is not None else 0,
            residual.stride(0) if residual is not None else 0, K=k, HAS_ADD=add is not None,
            HAS_RESIDUAL=residual is not None, BLOCK_T=block_t, BLOCK_N=block_n, num_warps=4)
    return out
