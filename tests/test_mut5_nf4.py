"""Mutation round 5: NF4 packing against bitsandbytes itself (the layout it defines), on fresh random weights."""

import pytest
import torch

from clover_lite.errors import CloverError
from clover_lite.quant.nf4 import dequantize_nf4, quantize_nf4

from .seed import SEED

bnbf = pytest.importorskip("bitsandbytes.functional")


def _weights(rows=16, cols=128):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(SEED)) * 0.05


def test_default_blocksize_is_bitsandbytes_default():
    """quantize_nf4(w) with no blocksize packs exactly what bitsandbytes' own NF4 default does (blocks of 64)."""
    w = _weights()
    packed, absmax = quantize_nf4(w)
    q, state = bnbf.quantize_4bit(w, quant_type="nf4")
    assert torch.equal(packed, q.reshape(-1).cpu()) and torch.equal(absmax, state.absmax.float().reshape(-1))
    assert absmax.numel() == w.numel() // state.blocksize


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dequantize_returns_the_asked_dtype(dtype):
    """dequantize_nf4(..., dtype) gives W in that dtype: bitsandbytes' fp32 dequantization, rounded once to it."""
    w = _weights()
    packed, absmax = quantize_nf4(w, 64)
    q, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
    ref = bnbf.dequantize_4bit(q, state).float()
    got = dequantize_nf4(packed, absmax, tuple(w.shape), 64, dtype)
    assert got.dtype == dtype and got.shape == w.shape
    assert torch.equal(got, ref.to(dtype))


def test_a_nested_absmax_is_refused(monkeypatch):
    """If bitsandbytes returns double-quantized (nested) absmax, quantizing stops with CloverError rather than
    storing the nested codes as if they were the fp32 scales."""
    real = bnbf.quantize_4bit
    monkeypatch.setattr(bnbf, "quantize_4bit", lambda w, **kw: real(w, compress_statistics=True, **kw))
    with pytest.raises(CloverError, match="nested"):
        quantize_nf4(_weights(), 64)
