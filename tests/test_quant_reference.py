"""RTN and GPTQ against hand-worked cases and a float64 reference written here from the GPTQ paper (column by
column, no lazy blocks), on fresh random weights with ragged widths: the quantizer's own parameter search is
not reused on the reference side."""

import pytest
import torch

from clover_lite.quant.gptq import gptq_quantize
from clover_lite.quant.rtn import QuantSpec, quantize_rtn

from .seed import SEED


def test_rtn_hand_worked_asymmetric_row():
    """[-0.75, 0, 2.25], one asymmetric group: span 3 over 15 steps is a scale of 0.2, stored as fp16
    0.199951171875; the zero is round(0.75 / scale) = round(3.751) = 4; the weights quantize to 0, 4 and
    round(11.253) + 4 = 15."""
    w = torch.tensor([[-0.75, 0.0, 2.25]])
    q = quantize_rtn(w, QuantSpec(-1, sym=False))
    assert float(q.scales[0, 0]) == 0.199951171875
    assert float(q.zeros[0, 0]) == 4.0
    assert q.q.tolist() == [[0, 4, 15]]
    s = 0.199951171875
    torch.testing.assert_close(q.dequantize(), torch.tensor([[-4 * s, 0.0, 11 * s]]), atol=0, rtol=0)


def test_rtn_hand_worked_symmetric_row():
    """Symmetric: the scale is max|w| * 2 / 15 (fp16) with the zero at 8, so -max|w| is exactly step -7.5
    rounded to -8 (q 0) and +max|w| clamps at step +7 (q 15)."""
    w = torch.tensor([[-1.5, 0.2, 1.0]])
    q = quantize_rtn(w, QuantSpec(-1, sym=True))
    s = float(torch.tensor(3.0 / 15).half())
    assert float(q.scales[0, 0]) == s and float(q.zeros[0, 0]) == 8.0
    expected = [min(max(round(v / s) + 8, 0), 15) for v in (-1.5, 0.2, 1.0)]
    assert q.q.tolist() == [expected]


def test_rtn_hand_worked_positive_row_in_v1():
    """[0.5, 1.4], asymmetric v1: the zero would be 0, which v1 cannot store, so it is 1 and the scale is
    1.4 / 14 = 0.1 (fp16 0.0999755859375): 0.5 -> step 5 (q 6), 1.4 -> step 14 (q 15)."""
    q = quantize_rtn(torch.tensor([[0.5, 1.4]]), QuantSpec(-1, sym=False, checkpoint_format="gptq"))
    assert float(q.zeros[0, 0]) == 1.0 and float(q.scales[0, 0]) == 0.0999755859375
    assert q.q.tolist() == [[6, 15]]
    v2 = quantize_rtn(torch.tensor([[0.5, 1.4]]), QuantSpec(-1, sym=False, checkpoint_format="gptq_v2"))
    assert float(v2.zeros[0, 0]) == 0.0 and v2.q.tolist() == [[round(0.5 / float(v2.scales[0, 0])), 15]]


@pytest.mark.parametrize("sym,fmt", [(True, "gptq"), (False, "gptq"), (False, "gptq_v2")])
@pytest.mark.parametrize("K,group", [(40, 8), (96, 32), (24, -1), (56, 56)])
def test_rtn_error_is_at_most_half_a_step(K, group, sym, fmt):
    """Min-max round to nearest: every weight is within half a quantization step of its dequantized value
    (fp16 rounding of the scale can move the range's ends by a few thousandths of a step), also in a group of
    positive weights, whose zero v1 cannot store as 0."""
    gen = torch.Generator().manual_seed(SEED)
    w = torch.randn(7, K, generator=gen) * torch.rand(7, 1, generator=gen) * 3
    w[0] = w[0].abs() + 0.01  # all positive (asymmetric: the zero at the bottom of the range)
    w[1] = w[1].abs()
    w[1, 0] = -0.2 * float(w[1].max()) / 15  # a hair below zero: the zero rounds to 0
    q = quantize_rtn(w, QuantSpec(group, sym, checkpoint_format=fmt))
    assert int(q.zeros.min()) >= (1 if fmt == "gptq" else 0)
    glen = K if group == -1 else group
    step = q.scales.repeat_interleave(glen, dim=-2).transpose(-1, -2)  # [N, K]
    worst = float(((q.dequantize() - w).abs() / step).max())
    assert worst <= 0.51, f"seed {SEED}: {worst:.3f} steps"


def _params(w: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's min-max quantizer for rows of w [N, k] (the range includes 0), scale rounded to fp16 as stored."""
    lo, hi = w.min(1).values.clamp(max=0), w.max(1).values.clamp(min=0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    span = torch.where(hi - lo == 0, torch.ones_like(hi), hi - lo)
    scale = (span / 15).half().double()
    if sym:
        return scale, torch.full_like(scale, 8.0)
    zero = torch.round(-lo / scale)
    low = zero < 1  # v1 cannot store a zero of 0: zero 1, the maximum fitted in the 14 steps above it
    return torch.where(low, (hi / 14).half().double(), scale), torch.where(low, 1.0, zero).clamp(max=15)


def _reference_gptq(w: torch.Tensor, H: torch.Tensor, group: int, sym: bool, act_order: bool, damp: float = 0.01):
    """Float64 GPTQ, static groups: parameters from the unpermuted weight; columns quantized in the order of
    H's diagonal (largest first) with act_order, each column's error spread over the columns still to come
    by the Cholesky factor of H^-1."""
    W = w.double().clone()
    H = H.double().clone()
    N, K = W.shape
    params = [_params(W[:, s : s + group], sym) for s in range(0, K, group)]
    order = torch.argsort(torch.diagonal(H), descending=True) if act_order else torch.arange(K)
    W, H = W[:, order], H[order][:, order]
    H += damp * torch.diagonal(H).mean() * torch.eye(K, dtype=torch.float64)
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    Q = torch.zeros(N, K, dtype=torch.float64)
    for i in range(K):
        scale, zero = params[int(order[i]) // group]
        q = torch.clamp(torch.round(W[:, i] / scale) + zero, 0, 15)
        Q[:, i] = q
        err = (W[:, i] - (q - zero) * scale) / U[i, i]
        W[:, i:] -= err[:, None] * U[i, i:][None, :]
    out = torch.empty_like(Q)
    out[:, order] = Q
    return out


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("K,N,group", [(48, 10, 16), (72, 7, 24)])
def test_gptq_equals_float64_reference(K, N, group, sym, act_order):
    """Same integers as the float64 reference (float32 summation may flip a rare rounding), in particular the
    act-order direction: quantizing the small-diagonal columns first gives other integers."""
    gen = torch.Generator().manual_seed(SEED + K)
    mix = torch.randn(K, K, generator=gen) / K**0.5 + torch.eye(K)
    X = torch.randn(4 * K, K, generator=gen) @ mix * torch.rand(K, generator=gen).mul(3).add(0.2)
    H = 2 * X.T @ X / X.shape[0]
    W = torch.randn(N, K, generator=gen)
    got = gptq_quantize(W, H, QuantSpec(group, sym), act_order=act_order, static_groups=True, block=32)
    ref = _reference_gptq(W, H, group, sym, act_order)
    mismatch = float((got.q.double() != ref).double().mean())
    assert mismatch < 0.01, f"seed {SEED}: {mismatch:.1%} of the integers differ"
    if act_order:
        other = _reference_gptq(W, H, group, sym, act_order=False)
        assert float((other != ref).double().mean()) > 0.05  # the order matters on these inputs: the test can tell
