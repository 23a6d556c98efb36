"""Gated DeltaNet layer (Qwen3.5 / Qwen3-Next linear attention) and its PyTorch math.

Per value head, with state S [K, V] in fp32 (docs/ARCHITECTURE.md section 1):
    S <- S * exp(g_t);  d_t = beta_t * (v_t - S^T k_t);  S <- S + k_t d_t^T;  o_t = S^T q_t
q and k are L2-normalised and q is scaled by K^-0.5; each qk head serves HV/HK consecutive v heads.
The layer runs causally from a given (recurrent, conv tail) state and returns the state after its
input, which the caller commits or drops: a denoising step never writes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from clover_lite.models.config import ModelConfig
from clover_lite.models.layers import GatedRMSNorm
from clover_lite.runtime.cache import GDNUpdate


def causal_conv(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU continuing from `tail`.

    x [b, C, L], tail [b, C, kernel-1] (the previous inputs, zeros at the sequence start),
    weight [C, kernel] -> (out [b, C, L], new tail [b, C, kernel-1]).
    """
    kernel = weight.shape[-1]
    full = torch.cat([tail.to(x.dtype), x], dim=-1)
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])
    return F.silu(out).to(x.dtype), full[..., full.shape[-1] - (kernel - 1) :]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, state):
    """Heads first in the state's precision (fp32, or fp64 for reference checks): q,k [b, HV, L, K]
    repeated to the v heads and normalised, v [b, HV, L, V], g/beta [b, HV, L]; a copy of the state."""
    dtype = torch.float64 if state.dtype == torch.float64 else torch.float32
    rep = v.shape[2] // q.shape[2]
    if rep > 1:
        q = q.repeat_interleave(rep, dim=2)
        k = k.repeat_interleave(rep, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).to(dtype) for t in (q, k, v, g, beta))
    q = l2_normalize(q) * q.shape[-1] ** -0.5
    k = l2_normalize(k)
    return q, k, v, g, beta, state.to(dtype).clone()


def gated_delta_rule_recurrent(q, k, v, g, beta, state):
    """Token-by-token recurrence, the definition. q,k [b, L, HK, K]; v [b, L, HV, V]; g, beta [b, L, HV];
    state [b, HV, K, V] (fp32, not modified) -> (out [b, L, HV, V] fp32, new state)."""
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, state)
    outs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t].exp()[..., None, None]
        d = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, :, t]))
        S = S + k[:, :, t, :, None] * d[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
    return torch.stack(outs, dim=1), S


def gated_delta_rule_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The same recurrence in chunks of `chunk` tokens (WY form), exact up to rounding.

    Inside a chunk with cumulative log-decay c_t: d = (I + A)^-1 (beta*v - beta*exp(c) * K S0) with
    A[t,s] = beta_t exp(c_t - c_s) k_t.k_s (s < t); o = exp(c) Q S0 + (exp(c_t - c_s) q_t.k_s)_{s<=t} d;
    S' = exp(c_C) S0 + sum_s exp(c_C - c_s) k_s d_s^T. Every exponent is <= 0, so nothing overflows.
    """
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, state)
    L = q.shape[2]
    outs = []
    for s0 in range(0, L, chunk):
        qc, kc, vc = q[:, :, s0 : s0 + chunk], k[:, :, s0 : s0 + chunk], v[:, :, s0 : s0 + chunk]
        gc, bc = g[:, :, s0 : s0 + chunk], beta[:, :, s0 : s0 + chunk]
        n = qc.shape[2]
        c = gc.cumsum(-1)  # [b, h, n]
        diff = c[..., :, None] - c[..., None, :]  # c_t - c_s
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()  # s <= t
        strict = decay.tril(-1)
        A = bc[..., :, None] * strict * (kc @ kc.transpose(-1, -2))
        eye = torch.eye(n, dtype=S.dtype, device=q.device)
        rhs = bc[..., None] * (vc - c.exp()[..., None] * (kc @ S))
        d = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        o = c.exp()[..., None] * (qc @ S) + (decay * (qc @ kc.transpose(-1, -2))) @ d
        outs.append(o)
        tail_decay = (c[..., -1:] - c).exp()  # exp(c_C - c_s)
        S = c[..., -1].exp()[..., None, None] * S + (kc * tail_decay[..., None]).transpose(-1, -2) @ d
    out = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape)
    return out.transpose(1, 2), S


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.n_k = c.linear_num_key_heads
        self.n_v = c.linear_num_value_heads
        self.dk = c.linear_key_head_dim
        self.dv = c.linear_value_head_dim
        self.key_dim = c.gdn_key_dim
        self.value_dim = c.gdn_value_dim
        self.kernel = c.linear_conv_kernel_dim
        conv_dim = c.gdn_conv_dim
        self.in_proj_qkv = nn.Linear(c.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, self.n_v, bias=False)
        # Only its weight [C, 1, kernel] is used (causal_conv); kept as a Conv1d for checkpoint names.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.kernel, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = GatedRMSNorm(self.dv, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, c.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], need_state: bool = True
    ) -> tuple[torch.Tensor, GDNUpdate | None]:
        """x [b, L, hidden]; state = (recurrent [b, HV, K, V] fp32, conv tail [b, C, kernel-1]), not modified.
        Returns the output and, if need_state, the state after x (a denoising step does not need it)."""
        recurrent, tail = state
        o, new_recurrent, new_tail = self.mix(x, recurrent, tail, need_state)
        update = GDNUpdate(recurrent=new_recurrent, conv=new_tail.to(tail.dtype)) if need_state else None
        return self.output(x, o), update

    def mix(
        self, x: torch.Tensor, recurrent: torch.Tensor, tail: torch.Tensor, need_state: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The causal conv and the gated delta rule over x from the given state: (o [b, L, HV, V] fp32, the
        recurrent state and conv tail after x; the kernels skip computing those when need_state is False)."""
        mixed, new_tail = causal_conv(self.in_proj_qkv(x).transpose(1, 2), tail, self.conv1d.weight.squeeze(1))
        q, k, v, g, beta = self.heads(x, mixed)
        o, new_recurrent = gated_delta_rule_chunked(q, k, v, g, beta, recurrent)
        return o, new_recurrent, new_tail

    def heads(self, x: torch.Tensor, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """From x [b, L, hidden] and the conv output [b, C, L]: q, k [b, L, HK, K], v [b, L, HV, V],
        log-decay g (fp32: in fp16 exp(A_log) can overflow) and write strength beta [b, L, HV]."""
        b, L, _ = x.shape
        mixed = mixed.transpose(1, 2)
        q = mixed[..., : self.key_dim].reshape(b, L, self.n_k, self.dk)
        k = mixed[..., self.key_dim : 2 * self.key_dim].reshape(b, L, self.n_k, self.dk)
        v = mixed[..., 2 * self.key_dim :].reshape(b, L, self.n_v, self.dv)
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        return q, k, v, g, beta

    def output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The delta rule's output o [b, L, HV, V] through the z-gated norm and out_proj."""
        b, L, _ = x.shape
        z = self.in_proj_z(x).reshape(b, L, self.n_v, self.dv)
        return self.out_proj(self.norm(o, z, dtype=x.dtype).reshape(b, L, self.value_dim))


def gated_delta_rule_block_states(q, k, v, g, beta, state, chunk: int):
    """`gated_delta_rule_chunked` that also returns the state at the start of every chunk, for training.

    Same inputs; L must be a multiple of `chunk`. Returns (out [b, L, HV, V] fp32, starts [b, L/chunk, HV,
    K, V]: the state before each chunk, starts[:, 0] == state). The intra-chunk work runs for all chunks at
    once; only the K x V state update is sequential: with W = (I + A)^-1 beta exp(c) k and U = (I + A)^-1
    beta v (A as in the chunked form), a chunk's d = U - W S0, so S0 is all a chunk needs from earlier ones.
    """
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, state)
    b, h, L, dk = q.shape
    if L % chunk:
        raise ValueError(f"length {L} is not a multiple of the chunk size {chunk}")
    n = L // chunk
    qc, kc, vc = (t.reshape(b, h, n, chunk, t.shape[-1]) for t in (q, k, v))
    gc, bc = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    c = gc.cumsum(-1)
    diff = c[..., :, None] - c[..., None, :]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()
    A = bc[..., :, None] * decay.tril(-1) * (kc @ kc.transpose(-1, -2))
    eye = torch.eye(chunk, dtype=S.dtype, device=q.device)
    IA = eye + A
    W = torch.linalg.solve_triangular(IA, (bc * c.exp())[..., None] * kc, upper=False, unitriangular=True)
    U = torch.linalg.solve_triangular(IA, bc[..., None] * vc, upper=False, unitriangular=True)
    kd = kc * (c[..., -1:] - c).exp()[..., None]  # k_s exp(c_C - c_s)
    last = c[..., -1].exp()[..., None, None]  # [b, h, n, 1, 1]
    starts, ds = [], []
    for i in range(n):
        starts.append(S)
        d = U[:, :, i] - W[:, :, i] @ S
        ds.append(d)
        S = last[:, :, i] * S + kd[:, :, i].transpose(-1, -2) @ d
    S0 = torch.stack(starts, dim=2)  # [b, h, n, K, V]
    d = torch.stack(ds, dim=2)
    o = c.exp()[..., None] * (qc @ S0) + (decay * (qc @ kc.transpose(-1, -2))) @ d
    return o.reshape(b, h, L, -1).transpose(1, 2), S0.transpose(1, 2)


def gdn_block_states(
    layer: GatedDeltaNet, x: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GDN layer run causally over x [b, L, hidden] from the zero state, as `layer(x, zero state)`,
    plus the state at the start of each block of the grid (for training every block at once).

    Returns (out [b, L, hidden], recurrent [b, L/B, HV, K, V] fp32, conv tails [b, L/B, C, kernel-1]):
    entry j is what a DenoiseCache holds after committing blocks 0..j-1 (zeros for j = 0).
    """
    b, L, _ = x.shape
    qkv = layer.in_proj_qkv(x).transpose(1, 2)  # [b, C, L]
    tail0 = qkv.new_zeros(b, qkv.shape[1], layer.kernel - 1)
    mixed, _ = causal_conv(qkv, tail0, layer.conv1d.weight.squeeze(1))
    # The conv tail before block j is the k-1 raw conv inputs ending at position jB (zeros before 0).
    padded = F.pad(qkv, (layer.kernel - 1, 0))
    tails = padded.unfold(2, layer.kernel - 1, block_size)[:, :, : L // block_size].permute(0, 2, 1, 3)
    q, k, v, g, beta = layer.heads(x, mixed)
    zero = x.new_zeros(b, layer.n_v, layer.dk, layer.dv, dtype=torch.float32)
    o, starts = gated_delta_rule_block_states(q, k, v, g, beta, zero, block_size)
    return layer.output(x, o), starts, tails.contiguous()
