"""The GDN layer's fused input kernel (kernels/gdn_prep.py) in the Triton interpreter (or on the GPU with
--device cuda) against the layer's PyTorch path (causal_conv, GatedDeltaNet.heads, the delta rule's
normalisation), and the layer end to end."""

import pytest
import torch

from clover_lite.checkpoint.tiny import tiny_config
from clover_lite.kernels.gdn_prep import gdn_prepare
from clover_lite.models.config import config_from_dict
from clover_lite.models.gdn import GatedDeltaNet, causal_conv, l2_normalize

from .devices import assert_near, assert_same, on_gpu, rel_err

pytestmark = pytest.mark.gpu


def _layer(seed: int, **overrides) -> GatedDeltaNet:
    cfg = config_from_dict(tiny_config(**overrides))
    torch.manual_seed(seed)
    layer = GatedDeltaNet(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return layer


def _reference(layer: GatedDeltaNet, x, tail):
    """The torch path's q, k (normalised, q scaled), v, g, beta in float64, and the new conv tail."""
    mixed, new_tail = causal_conv(layer.in_proj_qkv(x).transpose(1, 2), tail, layer.conv1d.weight.squeeze(1))
    q, k, v, g, beta = layer.heads(x, mixed)
    q = l2_normalize(q.double()) * q.shape[-1] ** -0.5
    return q, l2_normalize(k.double()), v.double(), g.double(), beta.double(), new_tail


@pytest.mark.parametrize("L, dtype, heads, tile", [
    (5, torch.float32, (2, 4, 16, 32), None), (1, torch.float32, (2, 2, 16, 16), None),
    (2, torch.float16, (2, 4, 32, 16), None), (33, torch.float16, (1, 2, 16, 16), None),
    (6, torch.float32, (2, 4, 16, 32), (1, 4)), (7, torch.float16, (3, 3, 16, 16), (4, 2)),
])
def test_gdn_prepare_matches_the_layers_torch_path(device, L, dtype, heads, tile):
    """Ragged L (1 and 2: shorter than the conv tail, which then shifts), GQA (2 v heads per k head),
    K != V, a non-zero conv tail, fp32 and fp16 activations; the GPU's tile of one token and 4 heads, and
    tiles that cut the heads and tokens raggedly."""
    hk, hv, dk, dv = heads
    layer = _layer(L, linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                   linear_value_head_dim=dv).to(device, dtype)
    b = 2
    x = torch.randn(b, L, layer.in_proj_qkv.in_features).to(device, dtype)
    tail = torch.randn(b, layer.in_proj_qkv.out_features, layer.kernel - 1).to(device, dtype)
    with torch.no_grad():
        want = _reference(layer, x, tail)
        got = gdn_prepare(layer.in_proj_qkv(x), tail, layer.conv1d.weight.squeeze(1), layer.in_proj_a(x),
                          layer.in_proj_b(x), layer.A_log, layer.dt_bias, layer.n_k, layer.dk, layer.value_dim,
                          need_tail=True, tile=tile)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for name, w, g in zip(("q", "k", "v", "g", "beta"), want[:5], got[:5], strict=True):
        assert g.dtype == torch.float32 and g.is_contiguous(), name
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol, msg=name)
    assert torch.equal(got[5], want[5].to(tail.dtype))
    without = gdn_prepare(layer.in_proj_qkv(x), tail, layer.conv1d.weight.squeeze(1), layer.in_proj_a(x),
                          layer.in_proj_b(x), layer.A_log, layer.dt_bias, layer.n_k, layer.dk, layer.value_dim,
                          need_tail=False)
    assert without[5] is None and torch.equal(without[0], got[0])


def test_gdn_layer_with_the_kernels_matches_torch(device):
    """GatedDeltaNet.forward on the Triton path (prepare + delta-rule kernel) against its torch path,
    output and the state after the block."""
    from clover_lite.kernels import dispatch

    layer = _layer(7).to(device)
    x = torch.randn(1, 6, layer.in_proj_qkv.in_features).to(device)
    state = (torch.randn(1, layer.n_v, layer.dk, layer.dv).to(device) * 0.1,
             torch.randn(1, layer.in_proj_qkv.out_features, layer.kernel - 1).to(device))
    with torch.no_grad():
        ref, ref_up = layer(x, state)
        dispatch.apply(layer, "triton")
        assert layer._ab_weight.shape == (2 * layer.n_v, x.shape[-1])  # in_proj_a and in_proj_b as one matmul
        assert layer.in_proj_a.weight.data_ptr() == layer._ab_weight.data_ptr()  # viewed, not copied
        out, up = layer(x, state)
        step, none = layer(x, state, need_state=False)
    # tf32 dots in the delta rule on a GPU: there 2e-3 of the largest value (tests/devices.py assert_near)
    assert_near(out, ref, 2e-3, rtol=2e-3, atol=2e-3)
    assert_near(up.recurrent, ref_up.recurrent, 2e-3, rtol=2e-3, atol=2e-3)
    assert torch.equal(up.conv, ref_up.conv)
    assert none is None
    assert_same(step, out)


# The GPU check's shapes: Clover's heads (16 k, 32 v heads of 128) in the runtime's dtype (bf16: a GPU's
# alone), a step (1, 2 tokens) and commits (32, 64); the interpreter's are small, in fp32.
@pytest.mark.parametrize("L", [1, 2, 32, 64] if on_gpu() else [1, 5])
def test_gdn_prepare_at_the_models_heads(device, L, report_err):
    """The GDN layer's input kernel (conv, SiLU, q/k norms, g, beta) against the layer's torch functions on the
    same inputs; the conv tail exactly."""
    hk, hv, d, kw = (16, 32, 128, 4) if on_gpu() else (2, 4, 16, 4)
    dt = torch.bfloat16 if on_gpu() else torch.float32
    C = 2 * hk * d + hv * d
    gen = torch.Generator().manual_seed(L)
    qkv = torch.randn(1, L, C, generator=gen).to(device, dt)
    tail = torch.randn(1, C, kw - 1, generator=gen).to(device, dt)
    w = (torch.randn(C, kw, generator=gen) * 0.5).to(device, dt)
    a, b = (torch.randn(1, L, hv, generator=gen).to(device, dt) for _ in range(2))
    a_log, dt_bias = (torch.randn(hv, generator=gen).to(device, dt) for _ in range(2))
    got = gdn_prepare(qkv, tail, w, a, b, a_log, dt_bias, hk, d, hv * d, need_tail=True)
    mixed, new_tail = causal_conv(qkv.transpose(1, 2), tail, w)
    mixed = mixed.transpose(1, 2).float()
    q, k = mixed[..., : hk * d].reshape(1, L, hk, d), mixed[..., hk * d : 2 * hk * d].reshape(1, L, hk, d)
    want = (l2_normalize(q) * d**-0.5, l2_normalize(k), mixed[..., 2 * hk * d :].reshape(1, L, hv, d),
            -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float()),
            torch.sigmoid(b).float())
    for name, x, y in zip(("q", "k", "v", "g", "beta"), got[:5], want, strict=True):
        err = report_err(f"GDN inputs, {str(dt).removeprefix('torch.')}", rel_err(x, y))
        assert err < (1e-5 if dt == torch.float32 else 2e-2), name
    assert torch.equal(got[5], new_tail)


@pytest.mark.interpret_only("argument checks before any launch, the same on every device")
def test_gdn_prepare_bad_shapes():
    layer = _layer(1)
    x = torch.randn(1, 3, layer.in_proj_qkv.in_features)
    tail = torch.zeros(1, layer.in_proj_qkv.out_features, layer.kernel - 1)
    args = (layer.in_proj_qkv(x), tail, layer.conv1d.weight.squeeze(1), layer.in_proj_a(x), layer.in_proj_b(x),
            layer.A_log, layer.dt_bias)
    with pytest.raises(ValueError, match="conv channels"):
        gdn_prepare(*args, layer.n_k + 1, layer.dk, layer.value_dim, need_tail=True)
    with pytest.raises(ValueError, match="conv tail"):
        gdn_prepare(args[0], tail[..., :1], *args[2:], layer.n_k, layer.dk, layer.value_dim, need_tail=True)
