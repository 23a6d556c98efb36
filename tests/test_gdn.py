"""Gated DeltaNet math: the chunked form against the token-by-token definition in float64, on ragged
lengths, with initial states; state continuation across calls; the conv tail."""

import pytest
import torch

from clover_lite.models.gdn import causal_conv, gated_delta_rule_chunked, gated_delta_rule_recurrent

from .seed import SEED


def _inputs(b, L, hk, hv, dk, dv, gen, dtype=torch.float64):
    q = torch.randn(b, L, hk, dk, generator=gen, dtype=dtype)
    k = torch.randn(b, L, hk, dk, generator=gen, dtype=dtype)
    v = torch.randn(b, L, hv, dv, generator=gen, dtype=dtype)
    g = -torch.rand(b, L, hv, generator=gen, dtype=dtype) * 3  # log-decay <= 0, some strong
    beta = torch.rand(b, L, hv, generator=gen, dtype=dtype)
    s0 = torch.randn(b, hv, dk, dv, generator=gen, dtype=dtype)
    return q, k, v, g, beta, s0


def _naive(q, k, v, g, beta, S):
    """Written straight from the definition, one head and one token at a time."""
    b, L, hk, dk = q.shape
    hv = v.shape[2]
    S = S.clone()
    out = torch.zeros(b, L, hv, v.shape[-1], dtype=S.dtype)
    for bi in range(b):
        for h in range(hv):
            kh = h // (hv // hk)
            for t in range(L):
                qt = q[bi, t, kh] / q[bi, t, kh].norm().clamp_min(1e-12) / dk**0.5
                kt = k[bi, t, kh] / k[bi, t, kh].norm().clamp_min(1e-12)
                S[bi, h] = S[bi, h] * torch.exp(g[bi, t, h])
                d = beta[bi, t, h] * (v[bi, t, h] - S[bi, h].T @ kt)
                S[bi, h] = S[bi, h] + torch.outer(kt, d)
                out[bi, t, h] = S[bi, h].T @ qt
    return out, S


@pytest.mark.parametrize("L,hk,hv", [(1, 2, 2), (7, 1, 2), (33, 2, 4), (130, 2, 2)])
def test_chunked_equals_definition(L, hk, hv):
    gen = torch.Generator().manual_seed(SEED + L * 10 + hv)
    q, k, v, g, beta, s0 = _inputs(2, L, hk, hv, 8, 6, gen)
    ref_o, ref_s = _naive(q, k, v, g, beta, s0)
    rec_o, rec_s = gated_delta_rule_recurrent(q, k, v, g, beta, s0)
    ch_o, ch_s = gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk=16)
    # The l2norm eps (1e-6 inside the sqrt) is the only difference from the naive form.
    for o, s in ((rec_o, rec_s), (ch_o, ch_s)):
        torch.testing.assert_close(o, ref_o, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(s, ref_s, atol=1e-6, rtol=1e-6)


def test_state_continues_across_calls_and_input_state_untouched():
    gen = torch.Generator().manual_seed(SEED + 7)
    q, k, v, g, beta, s0 = _inputs(1, 50, 2, 4, 8, 8, gen, dtype=torch.float32)
    s0_copy = s0.clone()
    whole_o, whole_s = gated_delta_rule_chunked(q, k, v, g, beta, s0)
    o1, s1 = gated_delta_rule_chunked(q[:, :23], k[:, :23], v[:, :23], g[:, :23], beta[:, :23], s0)
    o2, s2 = gated_delta_rule_chunked(q[:, 23:], k[:, 23:], v[:, 23:], g[:, 23:], beta[:, 23:], s1)
    assert torch.equal(s0, s0_copy)
    torch.testing.assert_close(torch.cat([o1, o2], 1), whole_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s2, whole_s, atol=1e-5, rtol=1e-5)


def test_causal_conv_tail_continuation():
    gen = torch.Generator().manual_seed(SEED + 3)
    C, K, L = 6, 4, 11
    x = torch.randn(2, C, L, generator=gen)
    w = torch.randn(C, K, generator=gen)
    tail0 = torch.zeros(2, C, K - 1)
    whole, tail = causal_conv(x, tail0, w)
    # Hand-written depthwise causal conv with zero history.
    padded = torch.cat([tail0, x], -1)
    ref = torch.stack([(padded[..., t : t + K] * w).sum(-1) for t in range(L)], -1)
    torch.testing.assert_close(whole, torch.nn.functional.silu(ref), atol=1e-6, rtol=1e-6)
    a, ta = causal_conv(x[..., :5], tail0, w)
    b, tb = causal_conv(x[..., 5:], ta, w)
    torch.testing.assert_close(torch.cat([a, b], -1), whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(tb, tail)
    torch.testing.assert_close(tail, x[..., -(K - 1) :])
