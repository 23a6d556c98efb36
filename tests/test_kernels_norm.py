"""The fused RMSNorm kernel (interpreter) against float64 and against the PyTorch modules it replaces."""

import pytest
import torch

pytest.importorskip("triton")

from clover_lite.kernels import dispatch  # noqa: E402
from clover_lite.kernels.norm import rms_norm  # noqa: E402
from clover_lite.models.layers import GatedRMSNorm, RMSNorm  # noqa: E402

GEN = torch.Generator().manual_seed(20261204)


def rms64(x, w, eps, unit_offset):
    x = x.double()
    w = w.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w if unit_offset else w)


@pytest.mark.parametrize("n", [48, 200, 256])
@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_matches_float64_and_the_module(n, unit_offset, dtype):
    # Rows evenly strided inside a wider tensor (the attention's q is a view of [query, gate] per head).
    wide = torch.randn(3, 5, 2, 2 * n, generator=GEN).to(dtype) * 3
    x = wide[..., :n]
    mod = RMSNorm(n, eps=1e-6, unit_offset=unit_offset)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(n, generator=GEN) * 0.5)
    y = rms_norm(x, mod.weight, mod.eps, unit_offset)
    assert y.shape == x.shape and y.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(y.double(), rms64(x, mod.weight, mod.eps, unit_offset), **tol)
    ref = mod(x)  # the torch path (its backend is "torch" until dispatch.apply)
    dispatch.apply(mod, "triton")
    torch.testing.assert_close(mod(x), ref, atol=1e-5 if dtype == torch.float32 else 1e-3, rtol=1e-5)


@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.float32])
def test_gated_rms_norm_rounds_where_the_module_does(weight_dtype):
    """weight * norm(x) * silu(gate): with an fp16 weight the product is rounded to fp16 before the gate, as
    torch's type promotion makes the module do; with an fp32 weight it is not."""
    n = 128
    x = (torch.randn(2, 7, 4, n, generator=GEN) * 2).half()
    gate = torch.randn(2, 7, 4, n, generator=GEN).half()
    mod = GatedRMSNorm(n, eps=1e-6).to(weight_dtype)
    with torch.no_grad():
        mod.weight.copy_(1 + torch.randn(n, generator=GEN) * 0.3)
    ref = mod(x, gate)
    dispatch.apply(mod, "triton")
    y = mod(x, gate)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, ref, atol=1e-3, rtol=1e-3)
    exact = rms64(x, mod.weight, mod.eps, False) * torch.nn.functional.silu(gate.double())
    torch.testing.assert_close(y.double(), exact, atol=2e-2, rtol=2e-2)


def test_rms_norm_rejects_mismatched_shapes():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(x, torch.zeros(16), 1e-6)
    with pytest.raises(ValueError, match="gate has shape"):
        rms_norm(x, torch.zeros(32), 1e-6, gate=torch.randn(4, 16))
    assert rms_norm(torch.randn(0, 32), torch.zeros(32), 1e-6).shape == (0, 32)
