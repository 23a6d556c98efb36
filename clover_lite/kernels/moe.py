"""Fused INT4 MoE: route -> (gate, up) GEMM with SiLU * up fused -> down GEMM with the routing weight
fused -> combine. Runs on the experts a block actually touches.

Two paths (shared DESIGN.md sections 4 and 7): when the touched experts hold few rows each (a 32-token
block with top-8 of 256 experts gives ~1.6 rows per touched expert) every (token, expert) pair is one
GEMV-style program that reads its expert's weights once, with no padding; with many rows per expert
(prefill) pairs are sorted by expert and padded to BLOCK_M-row tiles with one expert per tile, as vLLM's
fused_moe does, and run through the tiled tl.dot kernel. Act-order experts repacked by group at load
(Int4Weights.perm) get each pair's input with its columns gathered into the expert's row order. The sort
of the pairs by expert and the combine of their outputs per token are kernels of their own (moe_route.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from clover_lite.kernels import configs
from clover_lite.kernels.int4_gemm import gemm
from clover_lite.kernels.int4_gemv import gemv
from clover_lite.kernels.int4_launch import fill_split, gemm_config_for
from clover_lite.kernels.int4_weights import Int4Weights
from clover_lite.kernels.moe_route import combine, sort_pairs


def align_by_expert(sorted_expert: torch.Tensor, num_experts: int, block_m: int):
    """Pairs sorted by expert -> (padded position of each pair, rows [n_pad] of pair indices with -1 padding,
    expert of each BLOCK_M tile, n_pad). Each expert's pairs start on a tile boundary."""
    counts = torch.bincount(sorted_expert, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(counts, 0) - counts
    pstarts = torch.cumsum(padded, 0) - padded
    P = sorted_expert.shape[0]
    idx = torch.arange(P, device=sorted_expert.device)
    pos = pstarts[sorted_expert] + (idx - starts[sorted_expert])
    n_pad = int(padded.sum())
    rows = torch.full((n_pad,), -1, dtype=torch.int32, device=sorted_expert.device)
    rows[pos] = idx.to(torch.int32)
    tile_expert = torch.repeat_interleave(torch.arange(num_experts, device=sorted_expert.device, dtype=torch.int32),
                                          padded // block_m)
    return pos, rows, tile_expert, n_pad


def _gather_columns(rows: torch.Tensor, w: Int4Weights, experts: torch.Tensor) -> torch.Tensor:
    """rows [R, K], each multiplying expert experts[r]: columns in that expert's weight-row order."""
    return rows if w.perm is None else torch.gather(rows, 1, w.perm[experts])


def _act_mul(gate: torch.Tensor, up: torch.Tensor, activation: Callable | None = None) -> torch.Tensor:
    act = torch.nn.functional.silu if activation is None else activation
    return (act(gate.float()) * up.float()).to(gate.dtype)


def fused_moe(
    x: torch.Tensor,
    routing_weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate: Int4Weights,
    up: Int4Weights,
    down: Int4Weights,
    gemv_max_rows: int = configs.MOE_GEMV_MAX_ROWS_PER_EXPERT,
    validate: bool = True,
    shared: torch.Tensor | None = None,
    shared_logit: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: Callable | None = None,
) -> torch.Tensor:
    """x [T, hidden], routing weights / expert ids [T, k] -> sum_k w * down(silu(gate(x)) * up(x)) [T, hidden],
    plus sigmoid(shared_logit) * shared ([T, 1] and [T, hidden]: the shared expert) and `residual`
    ([T, hidden]) if given, in the combine. `activation` (a torch function, e.g. GELU for DiffusionGemma)
    replaces SiLU: gate and up then run as two launches and the activation in torch between them and the
    down projection (the fused SiLU * up epilogue is SiLU's only)."""
    T, k = expert_ids.shape
    if x.dim() != 2 or x.shape[0] != T:
        raise ValueError(f"x must be [T, hidden] with T = {T}, got {tuple(x.shape)}")
    if routing_weights.shape != expert_ids.shape:
        raise ValueError("routing weights and expert ids must have the same shape")
    E = gate.E
    if validate and expert_ids.numel() and (int(expert_ids.min()) < 0 or int(expert_ids.max()) >= E):
        raise ValueError(f"expert ids must be in [0, {E})")
    if (shared is None) != (shared_logit is None) or (shared is not None and (
            shared.shape != x.shape or shared_logit.shape != (T, 1))):
        raise ValueError(f"the shared expert needs its output {tuple(x.shape)} and gate logits {(T, 1)} together")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    add = (shared, shared_logit, residual)
    pairs = sort_pairs(expert_ids, routing_weights, E)
    sorted_e, token_of = pairs.expert, pairs.token
    P = sorted_e.numel()
    # Rows per touched expert, expected under uniform routing: decided on the host from T alone, so the
    # common (GEMV) path never waits for the GPU. T tokens top-k of E touch E (1 - (1 - k/E)^T) experts.
    touched = E * (1 - (1 - k / E) ** T) if P else 1.0
    permuted = gate.perm is not None or up.perm is not None
    if permuted:  # act-order weights repacked by group: each pair's input, columns in its expert's row order
        x_pairs = x[token_of.long()]
        x_gate = _gather_columns(x_pairs, gate, sorted_e)
        x_up = x_gate if up.perm is gate.perm else _gather_columns(x_pairs, up, sorted_e)
    if P <= touched * gemv_max_rows:  # a program per pair
        def mv(inp, w, w2=None, **kw):
            return gemv(inp, w, w2, row_expert=sorted_e, n_rows=P, moe=True, **kw)
        if activation is not None:  # not SiLU: unfused, each from its own (gathered) input
            inter = _act_mul(mv(x, gate, rows=token_of) if not permuted else mv(x_gate, gate),
                              mv(x, up, rows=token_of) if not permuted else mv(x_up, up), activation)
        elif not permuted:
            inter = mv(x, gate, up, rows=token_of)
        elif x_up is x_gate:
            inter = mv(x_gate, gate, up)
        else:  # gate and up in different row orders (not what GPTQ writes): unfused
            inter = _act_mul(mv(x_gate, gate), mv(x_up, up))
        inter = _gather_columns(inter, down, sorted_e)
        # The split-K partials go to the combine as they are: it sums them with the token's k rows.
        y = mv(inter, down, row_scale=pairs.scale, sum_splits=False)
        return combine(y, pairs.position, k, x.dtype, *add)
    cfg = gemm_config_for(x.device, int(P / max(touched, 1.0)))
    pos, padded_pairs, tile_expert, n_pad = align_by_expert(sorted_e.long(), E, cfg.block_m)
    cfg = fill_split(cfg, n_pad, x.shape[1], x.device)  # the down projection's split (gate/up: none)
    tiles = dict(tile_expert=tile_expert, n_rows=n_pad, config=replace(cfg, split_k=1))
    if not permuted:
        x_rows = torch.where(padded_pairs >= 0, token_of[padded_pairs.clamp(min=0).long()], -1).to(torch.int32)
        inter = gemm(x, gate, up, rows=x_rows, **tiles) if activation is None else _act_mul(
            gemm(x, gate, rows=x_rows, **tiles), gemm(x, up, rows=x_rows, **tiles), activation)
    elif x_up is x_gate and activation is None:
        inter = gemm(x_gate, gate, up, rows=padded_pairs, **tiles)
    else:
        inter = _act_mul(gemm(x_gate, gate, rows=padded_pairs, **tiles), gemm(x_up, up, rows=padded_pairs, **tiles),
                          activation)
    inter = _gather_columns(inter, down, tile_expert.long().repeat_interleave(cfg.block_m))
    scale_pad = torch.zeros(n_pad, device=x.device, dtype=torch.float32)
    scale_pad[pos] = pairs.scale
    y = gemm(inter, down, tile_expert=tile_expert, row_scale=scale_pad, n_rows=n_pad, config=cfg)
    return combine(y[None], pos[pairs.position.long()].to(torch.int32), k, x.dtype, *add)
