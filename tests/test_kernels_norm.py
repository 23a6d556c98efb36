"""The fused RMSNorm kernel (interpreter, or the GPU with --device cuda) against float64 and against the
PyTorch modules it replaces."""

import pytest
import torch

pytest.importorskip("triton")

from clover_lite.kernels import dispatch  # noqa: E402
from clover_lite.kernels.norm import rms_norm  # noqa: E402
from clover_lite.models.layers import GatedRMSNorm, RMSNorm  # noqa: E402

from .devices import on_gpu, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu
GEN = torch.Generator().manual_seed(20261204)


def rms64(x, w, eps, unit_offset):
    x = x.double()
    w = w.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w if unit_offset else w)


@pytest.mark.parametrize("n", [48, 200, 256])
@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_matches_float64_and_the_module(device, n, unit_offset, dtype):
    # Rows evenly strided inside a wider tensor (the attention's q is a view of [query, gate] per head).
    wide = torch.randn(3, 5, 2, 2 * n, generator=GEN).to(device, dtype) * 3
    x = wide[..., :n]
    mod = RMSNorm(n, eps=1e-6, unit_offset=unit_offset).to(device)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(n, generator=GEN) * 0.5)
    y = rms_norm(x, mod.weight, mod.eps, unit_offset)
    assert y.shape == x.shape and y.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(y.double(), rms64(x, mod.weight, mod.eps, unit_offset), **tol)
    ref = mod(x)  # the torch path (the reference until dispatch.apply installs the kernel)
    dispatch.apply(mod, "triton")
    torch.testing.assert_close(mod(x), ref, atol=1e-5 if dtype == torch.float32 else 1e-3, rtol=_module_rtol(dtype))


def _module_rtol(dtype):
    """Against the module's torch path, 16-bit: on a GPU within one rounding (its rsqrt and exp are approximate,
    torch's and the kernel's in other ways, so the fp32 value can round to the neighbouring 16-bit number)."""
    return torch.finfo(dtype).eps if on_gpu() and dtype != torch.float32 else 1e-5


@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.float32])
def test_gated_rms_norm_rounds_where_the_module_does(device, weight_dtype):
    """weight * norm(x) * silu(gate): with an fp16 weight the product is rounded to fp16 before the gate, as
    torch's type promotion makes the module do; with an fp32 weight it is not."""
    n = 128
    x = (torch.randn(2, 7, 4, n, generator=GEN) * 2).to(device, torch.float16)
    gate = torch.randn(2, 7, 4, n, generator=GEN).to(device, torch.float16)
    mod = GatedRMSNorm(n, eps=1e-6).to(device, weight_dtype)
    with torch.no_grad():
        mod.weight.copy_(1 + torch.randn(n, generator=GEN) * 0.3)
    ref = mod(x, gate)
    dispatch.apply(mod, "triton")
    y = mod(x, gate)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, ref, atol=1e-3, rtol=1e-3)
    exact = rms64(x, mod.weight, mod.eps, False) * torch.nn.functional.silu(gate.double())
    torch.testing.assert_close(y.double(), exact, atol=2e-2, rtol=2e-2)


def rotary64(y, cos, sin):
    """RoPE (rotate-half over the first rd dims) of y [b, L, heads, d] in float64, written out per dim."""
    rd = cos.shape[-1]
    half = rd // 2
    out = y.clone()
    c, s = cos.double()[None, :, None, :], sin.double()[None, :, None, :]
    out[..., :half] = y[..., :half] * c[..., :half] - y[..., half:rd] * s[..., :half]
    out[..., half:rd] = y[..., half:rd] * c[..., half:] + y[..., :half] * s[..., half:]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, rd, heads, L", [(64, 16, 3, 5), (32, 32, 2, 1), (256, 64, 4, 7)])
def test_norm_with_rotary_matches_float64_and_the_modules(device, dtype, n, rd, heads, L):
    """The attention's q/k norm + RoPE in one kernel: strided rows (q is a view of [query, gate]), a batch of
    2, the rotary over part of the head or all of it; against float64 and RMSNorm + layers.apply_rotary."""
    from clover_lite.models.layers import RotaryEmbedding, apply_rotary

    wide = torch.randn(2, L, heads, 2 * n, generator=GEN).to(device, dtype) * 3
    x = wide[..., :n]
    mod = RMSNorm(n, eps=1e-6).to(device)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(n, generator=GEN) * 0.5)
    cos, sin = RotaryEmbedding(rd, 10_000.0)(torch.arange(100, 100 + L, device=device))
    y = rms_norm(x, mod.weight, mod.eps, True, rotary=(cos, sin))
    assert y.shape == x.shape and y.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(y.double(), rotary64(rms64(x, mod.weight, mod.eps, True), cos, sin), **tol)
    ref = apply_rotary(mod(x).transpose(1, 2), cos, sin).transpose(1, 2)
    # 16-bit: within one rounding of the module's result (the norm's fp32 sum, taken in another order, can
    # round the normed value the modules hand on to the neighbouring 16-bit number; CI once saw 1 of 14336)
    rtol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(y, ref, atol=1e-5 if dtype == torch.float32 else 1e-3, rtol=rtol)


def test_attention_layer_norm_rotary_path_matches_torch(device):
    """GatedAttention's q and k through the fused norm + RoPE (Triton backend) against its torch path."""
    from clover_lite.checkpoint.tiny import tiny_config
    from clover_lite.models.attention import GatedAttention
    from clover_lite.models.config import config_from_dict
    from clover_lite.models.layers import RotaryEmbedding

    cfg = config_from_dict(tiny_config())
    torch.manual_seed(3)
    attn = GatedAttention(cfg)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    attn.to(device)
    x = torch.randn(1, 6, cfg.hidden_size).to(device)
    cos, sin = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)(torch.arange(10, 16, device=device))
    with torch.no_grad():
        q_ref, gate_ref = attn.project_q(x, cos, sin)
        kv_ref = attn.project_kv(x, cos, sin)
        dispatch.apply(attn, "triton")
        q, gate = attn.project_q(x, cos, sin)
        kv = attn.project_kv(x, cos, sin)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv.k, kv_ref.k, atol=1e-5, rtol=1e-5)
    assert torch.equal(gate, gate_ref) and torch.equal(kv.v, kv_ref.v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_residual_add_and_norm_in_one_kernel(device, dtype):
    """RMSNorm.forward_add: (norm(residual + x), residual + x), the sum rounded to the dtype as the decoder's
    `x = x + mixed` rounds it, against the torch path and float64."""
    n = 96
    x, res = (torch.randn(2, 5, n, generator=GEN).to(device, dtype) * 2 for _ in range(2))
    mod = RMSNorm(n, eps=1e-6).to(device)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(n, generator=GEN) * 0.5)
    ref_h, ref_sum = mod.forward_add(x, res)
    dispatch.apply(mod, "triton")
    h, total = mod.forward_add(x, res)
    assert torch.equal(total, ref_sum)
    torch.testing.assert_close(h, ref_h, atol=1e-5 if dtype == torch.float32 else 1e-3, rtol=_module_rtol(dtype))
    torch.testing.assert_close(h.double(), rms64(ref_sum, mod.weight, mod.eps, True),
                               **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)))


def test_gated_norm_rounds_a_wider_input_first(device):
    """GatedRMSNorm(x, gate, dtype): the GDN's fp32 output rounded to the activations' dtype in the kernel,
    as the torch path's x.to(dtype)."""
    n = 64
    x = (torch.randn(3, 4, n, generator=GEN) * 2).to(device)
    gate = torch.randn(3, 4, n, generator=GEN).to(device, torch.float16)
    mod = GatedRMSNorm(n, eps=1e-6).to(device)
    with torch.no_grad():
        mod.weight.copy_(1 + torch.randn(n, generator=GEN) * 0.3)
    ref = mod(x, gate, dtype=torch.float16)
    assert ref.dtype == torch.float16 and torch.equal(ref, mod(x.half(), gate))
    dispatch.apply(mod, "triton")
    y = mod(x, gate, dtype=torch.float16)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, ref, atol=1e-3, rtol=1e-3)


# The GPU check's shapes: Clover's widths (2048; 16 attention heads of 256, rotary 64; 32 GDN heads of 128,
# gated; 200: ragged) and the tiny model's, in every 16-bit dtype on a GPU (bf16 arithmetic is wrong in the
# interpreter), as many rows as a block's step has there and 3 in the interpreter (a program per row).
NORM_DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if on_gpu() else [])
NORM_SHAPES = [(32, 2048, False), (32 * 16, 256, False), (32 * 32, 128, True), (7, 200, False), (40, 64, False),
               (40 * 4, 32, False), (40 * 4, 16, True)]


@pytest.mark.parametrize("dtype", NORM_DTYPES)
def test_norm_at_the_models_widths(device, dtype, report_err):
    """RMSNorm and GatedRMSNorm with the kernel installed against their torch path, on strided rows."""
    for rows, n, gated in NORM_SHAPES:
        rows = rows if on_gpu() else 3
        mod = (GatedRMSNorm(n) if gated else RMSNorm(n)).to(device, dtype)
        with torch.no_grad():
            mod.weight.copy_(torch.randn(n, generator=GEN) * 0.5)
        x = (torch.randn(rows, 2 * n, generator=GEN) * 3).to(device, dtype)[:, :n]  # strided rows
        args = (x, torch.randn(rows, n, generator=GEN).to(device, dtype)) if gated else (x,)
        ref = mod(*args).float()
        dispatch.apply(mod, "triton")
        err = report_err(f"RMSNorm, {str(dtype).removeprefix('torch.')}", rel_err(mod(*args), ref))
        assert err < (1e-5 if dtype == torch.float32 else 1e-2), (rows, n, gated)


@pytest.mark.parametrize("dtype", NORM_DTYPES)
def test_norm_with_rotary_and_residual_at_the_models_heads(device, dtype, report_err):
    """The attention's q/k norm with RoPE (Clover: 16 heads of 256, rotary 64, positions past 5000) and the
    residual add with the post-attention norm (2048) against the modules' torch path."""
    from clover_lite.models.layers import RotaryEmbedding, apply_rotary

    heads, d, rd, hidden = (16, 256, 64, 2048) if on_gpu() else (2, 32, 16, 64)
    for L in (1, 32) if on_gpu() else (1, 5):
        mod = RMSNorm(d).to(device, dtype)
        with torch.no_grad():
            mod.weight.copy_(torch.randn(d, generator=GEN) * 0.5)
        x = (torch.randn(1, L, heads, 2 * d, generator=GEN) * 3).to(device, dtype)[..., :d]
        cos, sin = RotaryEmbedding(rd, 1e7)(torch.arange(5000, 5000 + L, device=device))
        ref = apply_rotary(mod(x).transpose(1, 2), cos, sin).transpose(1, 2).float()
        out = rms_norm(x, mod.weight, mod.eps, True, rotary=(cos, sin))
        norm = RMSNorm(hidden).to(device, dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(hidden, generator=GEN) * 0.5)
        mixed, res = (torch.randn(L, hidden, generator=GEN).to(device, dtype) for _ in range(2))
        h, total = rms_norm(mixed, norm.weight, norm.eps, True, residual=res)
        assert torch.equal(total, res + mixed), L  # the sum rounded as torch rounds it
        name = f"RMSNorm with RoPE / residual, {str(dtype).removeprefix('torch.')}"
        errs = [report_err(name, rel_err(out, ref)), report_err(name, rel_err(h, norm(res + mixed)))]
        assert max(errs) < (1e-5 if dtype == torch.float32 else 1e-2), (L, errs)


@pytest.mark.interpret_only("argument checks before any launch, the same on every device")
def test_rms_norm_rejects_mismatched_shapes():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(x, torch.zeros(16), 1e-6)
    with pytest.raises(ValueError, match="gate has shape"):
        rms_norm(x, torch.zeros(32), 1e-6, gate=torch.randn(4, 16))
    assert rms_norm(torch.randn(0, 32), torch.zeros(32), 1e-6).shape == (0, 32)
    with pytest.raises(ValueError, match="rotary cos/sin"):
        rms_norm(torch.randn(1, 5, 2, 32), torch.zeros(32), 1e-6, rotary=(torch.ones(4, 8), torch.ones(4, 8)))
    with pytest.raises(ValueError, match="rotary cos/sin"):
        rms_norm(torch.randn(1, 5, 2, 32), torch.zeros(32), 1e-6, rotary=(torch.ones(5, 7), torch.ones(5, 7)))
    with pytest.raises(ValueError, match="residual must be"):
        rms_norm(x, torch.zeros(32), 1e-6, residual=torch.randn(4, 16))
