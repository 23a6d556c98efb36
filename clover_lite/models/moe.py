"""Sparse MoE block: a router, fused expert weights, an optional shared expert.

Two routers, by config.router: `Router` (softmax top-k, renormalised when configured: Qwen) and
`GroupedSigmoidRouter` (LLaDA2's BailingMoeV2Gate: sigmoid scores, group-limited top-k on score + expert bias,
renormalised, times routed_scaling_factor). The shared expert is added under a sigmoid gate (Qwen) or as is
(LLaDA2, config.shared_expert_gate false).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from clover_lite.models.config import ModelConfig
from clover_lite.models.layers import SwiGLU


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, normalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k = top_k
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        return self.select(self.probs(x), x.dtype)

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> router probabilities [T, E] (fp32)."""
        return torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)

    def select(self, probs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of the probabilities: (weights [T, k] in dtype, renormalised if configured, expert ids [T, k])."""
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(dtype), ids


class GroupedSigmoidRouter(nn.Module):
    """BailingMoeV2's gate (LLaDA2). Logits in fp32; scores s = sigmoid(logits). Experts are split into
    `groups` consecutive groups; each group is scored by the sum of its two best (s + expert_bias); the best
    `topk_groups` groups stay and the top-k of s + expert_bias among their experts are chosen. Their weights
    are the unbiased s, renormalised to sum 1 (when k > 1, with 1e-20 in the denominator) and multiplied by
    `scaling`. Ties go to the lower index (torch.topk on CPU; the reference does the same)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, groups: int, topk_groups: int, scaling: float,
                 expert_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.expert_bias = nn.Parameter(torch.zeros(num_experts)) if expert_bias else None
        self.top_k, self.groups, self.topk_groups, self.scaling = top_k, groups, topk_groups, scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        return self.select(self.probs(x), x.dtype)

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the sigmoid scores [T, E] (fp32, logits computed in fp32 as the reference does)."""
        return torch.sigmoid(F.linear(x.float(), self.weight.float()))

    def select(self, scores: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        T, E = scores.shape
        biased = scores if self.expert_bias is None else scores + self.expert_bias.float()
        group_score = biased.view(T, self.groups, E // self.groups).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, torch.topk(group_score, self.topk_groups, dim=-1).indices, True)
        allowed = keep.repeat_interleave(E // self.groups, dim=1)
        ids = torch.topk(biased.masked_fill(~allowed, float("-inf")), self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return (weights * self.scaling).to(dtype), ids


def make_router(config: ModelConfig) -> nn.Module:
    c = config
    if c.router == "sigmoid_grouped":
        return GroupedSigmoidRouter(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.router_groups,
                                    c.router_topk_groups, c.routed_scaling_factor, c.router_expert_bias)
    return Router(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.norm_topk_prob)


class Experts(nn.Module):
    """All experts of a layer as two 3-D tensors: gate_up [E, 2I, hidden] ([gate; up]) and down [E, hidden, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(h, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor | None = None,
                shared_logit: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' weighted sum [T, hidden], plus sigmoid(shared_logit) * shared and residual if
        given."""
        out = dispatch(x, weights, ids, self.gate_up_proj.shape[0], self.expert)
        return add_shared_and_residual(out, shared, shared_logit, residual)


def add_shared_and_residual(out: torch.Tensor, shared: torch.Tensor | None, shared_logit: torch.Tensor | None,
                            residual: torch.Tensor | None = None) -> torch.Tensor:
    """out + sigmoid(shared_logit) * shared (the shared expert's output [T, hidden] under its gate [T, 1]; with
    no gate logit, out + shared), then residual + that: the torch path of what the Triton combine sums in one
    kernel."""
    if shared is not None:
        out = out + (shared if shared_logit is None else torch.sigmoid(shared_logit) * shared)
    return out if residual is None else residual + out


def dispatch(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Reference MoE combine: group the (token, k) pairs by expert, run each expert that received tokens
    once on its rows (`expert(e, rows)`), and sum the outputs weighted by the routing weights.
    x [T, hidden], weights / ids [T, k]."""
    out = torch.zeros_like(x)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    token_of = order // ids.shape[1]
    w_of = weights.reshape(-1)[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[start : start + n]
        y = expert(e, x[tok]) * w_of[start : start + n, None]
        out.index_add_(0, tok, y.to(out.dtype))
        start += n
    return out


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.gate = make_router(c)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size)
        self.shared_expert = (
            SwiGLU(c.hidden_size, c.shared_expert_intermediate_size) if c.shared_expert_intermediate_size else None
        )
        gated = self.shared_expert is not None and c.shared_expert_gate
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False) if gated else None

    def forward(
        self, x: torch.Tensor, return_routing: bool = False, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., hidden] -> output of x's shape, plus `residual` (x's shape) if given: the decoder's
        residual add, done in the experts' combine on the kernel path; with return_routing also the router's
        probabilities [T, E] and chosen expert ids [T, k] (training's load-balancing loss reads them)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        res = residual.reshape(flat.shape) if residual is not None else None
        shared = self.shared_expert(flat) if self.shared_expert is not None else None
        if return_routing:  # training reads the router's probabilities: the reference routing
            probs = self.gate.probs(flat)
            weights, ids = self.gate.select(probs, flat.dtype)
            shared_logit = self.shared_expert_gate(flat) if self.shared_expert_gate is not None else None
            out = self.experts(flat, weights, ids, shared=shared, shared_logit=shared_logit, residual=res)
            return out.reshape(shape), probs, ids
        weights, ids, shared_logit = self.route(flat)
        return self.experts(flat, weights, ids, shared=shared, shared_logit=shared_logit, residual=res).reshape(shape)

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Routing weights and expert ids [T, k] of tokens flat [T, hidden], and the shared expert's gate logit
        [T, 1] (None without a shared expert or its gate). The kernels do this as one matmul and one top-k kernel
        (softmax routers; the grouped sigmoid router keeps this reference: kernels/forwards.py)."""
        weights, ids = self.gate.select(self.gate.probs(flat), flat.dtype)
        shared_logit = self.shared_expert_gate(flat) if self.shared_expert_gate is not None else None
        return weights, ids, shared_logit
