"""GPTQ (Frantar et al. 2022): quantize a linear column by column, pushing each column's rounding error
onto the not-yet-quantized columns through the inverse Hessian of the layer's inputs.

Follows the published algorithm (docs/ARCHITECTURE.md section 3): H = 2 X X^T / n, dead inputs zeroed,
damping of damp_percent * mean(diag H), upper Cholesky factor of H^-1, lazy batches of 128 columns,
optional act-order (columns by decreasing diag H) with static groups (group parameters fixed from the
unpermuted weight, so g_idx stays k // group_size and inference is unchanged).

Batched: w [E, N, K] quantizes E linears at once (all experts of a layer) against H [E, K, K] or one
shared H [K, K]; the column loop, which dominates on small matrices, then runs once instead of E times.
"""

from __future__ import annotations

import torch

from clover_lite.errors import CloverError
from clover_lite.quant.rtn import QuantizedWeight, QuantSpec, find_params, quantize_to_int


class HessianAccumulator:
    """Running H = 2/n sum x x^T over the inputs a linear sees."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.H = torch.zeros(in_features, in_features, device=device, dtype=dtype)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(self.H.dtype)
        m = x.shape[0]
        if m == 0:
            return
        # Running mean of 2 x x^T, rescaled as samples arrive (as the reference implementation does).
        self.H *= self.n / (self.n + m)
        self.n += m
        x = x * (2.0 / self.n) ** 0.5
        self.H += x.t() @ x


def _batched_take(t: torch.Tensor, perm: torch.Tensor, dim: int) -> torch.Tensor:
    """t [B, ..] permuted along `dim` by perm [B or 1, K] (per batch element)."""
    shape = [1] * t.dim()
    shape[0], shape[dim] = perm.shape[0], perm.shape[1]
    idx = perm.view(shape).expand(*[t.shape[i] if i != dim else perm.shape[1] for i in range(t.dim())])
    if idx.shape[0] != t.shape[0]:
        idx = idx.expand(t.shape[0], *idx.shape[1:])
    return t.gather(dim, idx)


def gptq_quantize(
    w: torch.Tensor,
    H: torch.Tensor,
    spec: QuantSpec,
    damp_percent: float = 0.01,
    act_order: bool = False,
    static_groups: bool = True,
    block: int = 128,
) -> QuantizedWeight:
    """w [N, K] or [E, N, K]; H [K, K] (shared) or [E, K, K] -> QuantizedWeight of w's shape.

    Raises ValueError if a Hessian cannot be made positive definite."""
    single = w.dim() == 2
    W = w.detach().float().clone().reshape(-1, *w.shape[-2:])
    Hs = H.detach().float().clone().reshape(-1, H.shape[-2], H.shape[-1]).to(W.device)
    B, N, K = W.shape
    glen = spec.group_len(K)
    if K % glen:
        raise ValueError(f"group size {glen} does not divide in_features {K}")
    if Hs.shape[0] not in (1, B):
        raise ValueError(f"{Hs.shape[0]} Hessians for {B} weights")
    diag = Hs.diagonal(dim1=1, dim2=2)
    dead = diag == 0
    diag[dead] = 1
    W.masked_fill_(dead[:, None, :].expand(B, N, K), 0)

    # Static groups: parameters fixed up front from the unpermuted weight. Otherwise each group's
    # parameters are found when its first column comes up, from the weights as updated so far.
    static = None
    if static_groups:
        params = [find_params(W[..., s : s + glen], spec) for s in range(0, K, glen)]
        static = (torch.stack([p[0] for p in params], 1), torch.stack([p[1] for p in params], 1))  # [B, G, N]

    perm = None
    if act_order:
        perm = torch.argsort(diag, dim=-1, descending=True)  # [Bh, K]
        W = _batched_take(W, perm, 2)
        Hs = _batched_take(_batched_take(Hs, perm, 1), perm, 2)
    orig = perm if perm is not None else torch.arange(K, device=W.device)[None]
    orig = orig.expand(B, K)

    diag = Hs.diagonal(dim1=1, dim2=2)
    diag += damp_percent * diag.mean(-1, keepdim=True)
    try:
        L = torch.linalg.cholesky(Hs)
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    except RuntimeError as e:  # torch raises a LinAlgError (a RuntimeError) for non-PD matrices
        # A CloverError: `clover quantize` reports it in one line (not a traceback) and removes its partial output.
        raise CloverError(f"a Hessian is not positive definite even after damping ({e}); raise --damp-percent") from e

    Q = torch.zeros_like(W)
    G = K // glen
    scales = torch.zeros(B, G, N, device=W.device)
    zeros = torch.zeros(B, G, N, device=W.device)
    g_idx = torch.empty(B, K, dtype=torch.long, device=W.device)
    rows = torch.arange(B, device=W.device)
    current = None
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1 = W[:, :, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if static is not None:
                g = orig[:, col] // glen  # [B] group of this column in each weight
                scale, zero = static[0][rows, g], static[1][rows, g]
            else:
                g = torch.full((B,), col // glen, device=W.device)
                if col % glen == 0:
                    head = W1[:, :, i : i + glen]  # the group's columns as updated so far
                    if head.shape[2] < glen:  # it runs past the block: those columns lack the block's errors
                        j2 = i2 + glen - head.shape[2]
                        head = torch.cat([head, W[:, :, i2:j2] - Err1 @ Hinv[:, i1:i2, i2:j2]], 2)
                    current = find_params(head, spec)
                    scales[:, col // glen], zeros[:, col // glen] = current
                scale, zero = current
            g_idx[:, col] = g
            q = quantize_to_int(W1[:, :, i : i + 1], scale, zero)[..., 0]
            Q[:, :, col] = q
            err = (W1[:, :, i] - (q - zero) * scale) / Hinv1[:, i, i][:, None]
            W1[:, :, i:] -= err[:, :, None] * Hinv1[:, i, i:][:, None, :]
            Err1[:, :, i] = err
        W[:, :, i2:] -= Err1 @ Hinv[:, i1:i2, i2:]

    if static is not None:
        scales, zeros = static
    if perm is not None:
        invperm = torch.argsort(perm, dim=-1)
        Q = _batched_take(Q, invperm, 2)
        g_idx = _batched_take(g_idx, invperm, 1)
    out = QuantizedWeight(Q.to(torch.int32), scales, zeros, g_idx.to(torch.int32))
    return out[0] if single else out


def weighted_error(w: torch.Tensor, w_hat: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """Relative output error ||X (W - W_hat)^T|| / ||X W^T|| from H (proportional to X^T X), per weight:
    w, w_hat [..., N, K], H [K, K] or [..., K, K] -> [...]."""
    w = w.detach().float()
    d = w - w_hat.detach().float()
    H = H.float()
    num = ((d @ H) * d).sum((-1, -2))
    den = ((w @ H) * w).sum((-1, -2))
    return (num / den.clamp_min(1e-30)).clamp_min(0).sqrt()
