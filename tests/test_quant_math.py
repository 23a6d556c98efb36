"""GPTQ packing, the GPTQ algorithm and NF4, against hand-worked cases and independent references."""

import numpy as np
import pytest
import torch

from clover_lite.models.quantized import NF4Linear, QuantLinear
from clover_lite.quant.gptq import HessianAccumulator, gptq_quantize, weighted_error
from clover_lite.quant.nf4 import dequantize_nf4, quantize_nf4
from clover_lite.quant.pack import dequantize, pack_qweight, pack_qzeros, unpack_qweight, unpack_qzeros
from clover_lite.quant.rtn import QuantSpec, quantize_rtn


def test_hand_worked_packing():
    # Column 0 holds rows 0..7 = 1..8: nibble j of the word is row j -> 0x87654321.
    q = torch.tensor([[1], [2], [3], [4], [5], [6], [7], [8]])
    assert pack_qweight(q).item() == 0x87654321 - 2**32  # int32: the top bit set makes it negative
    # A symmetric v1 zero of 8 is stored as 7 in all eight nibbles: 0x77777777.
    assert pack_qzeros(torch.full((1, 8), 7)).item() == 0x77777777
    z = torch.arange(8)[None, :]  # column c -> nibble c
    assert pack_qzeros(z).item() == 0x76543210


def np_pack_rows(v: np.ndarray) -> np.ndarray:
    """Independent packer: row 8i+j -> bits 4j of word i (numpy, uint32 then viewed as int32)."""
    out = np.zeros((v.shape[0] // 8, v.shape[1]), dtype=np.uint32)
    for j in range(8):
        out |= v[j::8].astype(np.uint32) << np.uint32(4 * j)
    return out.view(np.int32)


def test_pack_round_trip_random():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 24), generator=gen)
    packed = pack_qweight(q)
    assert torch.equal(unpack_qweight(packed), q.int())
    assert np.array_equal(packed.numpy(), np_pack_rows(q.numpy()))
    z = torch.randint(0, 16, (3, 40), generator=gen)
    pz = pack_qzeros(z)
    assert torch.equal(unpack_qzeros(pz), z.int())
    assert np.array_equal(pz.numpy(), np_pack_rows(z.numpy().T).T)


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_dequantize_and_quantlinear_match_float64_reference(fmt):
    gen = torch.Generator().manual_seed(1)
    K, N, G = 64, 16, 4
    q = torch.randint(0, 16, (K, N), generator=gen)
    zeros = torch.randint(1, 16, (G, N), generator=gen)
    scales = (torch.rand(G, N, generator=gen) * 0.1 + 0.01).half()
    g_idx = torch.randperm(K, generator=gen) % G  # act-order style: groups scattered over the columns
    stored = zeros - (1 if fmt == "gptq" else 0)
    ref = (q.double() - zeros[g_idx].double()) * scales[g_idx].double()  # [K, N]
    w = dequantize(pack_qweight(q), pack_qzeros(stored), scales, g_idx.int(), fmt, torch.float64)
    torch.testing.assert_close(w, ref.t())
    lin = QuantLinear(K, N, G, checkpoint_format=fmt)
    lin.qweight.copy_(pack_qweight(q))
    lin.qzeros.copy_(pack_qzeros(stored))
    lin.scales.copy_(scales)
    lin.g_idx.copy_(g_idx)
    x = torch.randn(5, K, generator=gen)
    out = torch.full((5, N), float("nan"))
    out = lin(x)
    torch.testing.assert_close(out.double(), x.double() @ ref, atol=1e-4, rtol=1e-4)


def _correlated_inputs(n, k, gen):
    mix = torch.randn(k, k, generator=gen) / k**0.5 + torch.eye(k)
    scale = torch.linspace(0.2, 3.0, k)
    return (torch.randn(n, k, generator=gen) @ mix) * scale


@pytest.mark.parametrize("group_size", [32, -1])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_beats_rtn_on_output_error(group_size, sym):
    gen = torch.Generator().manual_seed(2)
    K, N = 128, 48
    X = _correlated_inputs(2048, K, gen)
    W = torch.randn(N, K, generator=gen) * 0.05
    acc = HessianAccumulator(K)
    for chunk in X.split(300):
        acc.add(chunk)
    torch.testing.assert_close(acc.H, 2 * X.T @ X / X.shape[0], atol=1e-3, rtol=1e-4)
    spec = QuantSpec(group_size, sym)
    rtn = quantize_rtn(W, spec)
    err_rtn = float(weighted_error(W, rtn.dequantize(), acc.H))
    for act_order in (False, True):
        g = gptq_quantize(W, acc.H, spec, act_order=act_order)
        err = float(weighted_error(W, g.dequantize(), acc.H))
        assert err < 0.9 * err_rtn, (act_order, err, err_rtn)
        # weighted_error is the relative output error on the actual inputs
        direct = ((X @ (W - g.dequantize()).T).norm() / (X @ W.T).norm()).item()
        assert abs(direct - err) < 1e-3
        assert int(g.q.min()) >= 0 and int(g.q.max()) <= 15


def test_act_order_static_groups_keep_plain_g_idx():
    gen = torch.Generator().manual_seed(3)
    K, N, G = 64, 16, 16
    X = _correlated_inputs(512, K, gen)
    H = 2 * X.T @ X / 512
    W = torch.randn(N, K, generator=gen)
    g = gptq_quantize(W, H, QuantSpec(G), act_order=True, static_groups=True)
    assert torch.equal(g.g_idx, torch.arange(K, dtype=torch.int32) // G)
    packed = g.pack("gptq")
    w_plain = dequantize(**packed, checkpoint_format="gptq", dtype=torch.float32)
    torch.testing.assert_close(w_plain, g.dequantize(), atol=0, rtol=0)
    dyn = gptq_quantize(W, H, QuantSpec(G), act_order=True, static_groups=False)
    assert not torch.equal(dyn.g_idx, g.g_idx)  # dynamic groups follow the permutation
    torch.testing.assert_close(dequantize(**dyn.pack("gptq"), dtype=torch.float32), dyn.dequantize())



@pytest.mark.parametrize("block", [32, 64])
def test_dynamic_groups_wider_than_the_lazy_block(block):
    """Dynamic groups find their parameters when their first column comes up, from columns of the current
    lazy block and the (updated) ones after it: blocked runs equal one unblocked pass (block = K). Group 48
    over blocks of 32 or 64 starts inside a block and spans the next."""
    gen = torch.Generator().manual_seed(6)
    K, N, G = 96, 24, 48
    X = _correlated_inputs(512, K, gen)
    H = 2 * X.T @ X / 512
    W = torch.randn(N, K, generator=gen)
    for act_order in (False, True):
        whole = gptq_quantize(W, H, QuantSpec(G, sym=False), act_order=act_order, static_groups=False, block=K)
        lazy = gptq_quantize(W, H, QuantSpec(G, sym=False), act_order=act_order, static_groups=False, block=block)
        torch.testing.assert_close(lazy.scales, whole.scales, atol=1e-5, rtol=1e-4)
        assert torch.equal(lazy.g_idx, whole.g_idx)
        assert (lazy.q != whole.q).float().mean() < 0.01  # float summation order may flip a rounding

def test_batched_gptq_equals_one_at_a_time():
    gen = torch.Generator().manual_seed(4)
    E, N, K = 3, 16, 32
    W = torch.randn(E, N, K, generator=gen)
    Hs = torch.stack([2 * (x := _correlated_inputs(256, K, gen)).T @ x / 256 for _ in range(E)])
    for H in (Hs, Hs[0]):  # per-expert Hessians, and one shared by all
        batched = gptq_quantize(W, H, QuantSpec(16), act_order=True)
        for e in range(E):
            one = gptq_quantize(W[e], H[e] if H.dim() == 3 else H, QuantSpec(16), act_order=True)
            assert torch.equal(batched.q[e], one.q) and torch.equal(batched.g_idx[e], one.g_idx)
            torch.testing.assert_close(batched.scales[e], one.scales)


def test_dead_inputs_and_bad_group():
    W = torch.randn(8, 32)
    H = torch.eye(32)
    H[5, 5] = 0  # an input that never fires
    g = gptq_quantize(W, H, QuantSpec(16))
    assert g.q.shape == (8, 32)
    with pytest.raises(ValueError, match="does not divide"):
        gptq_quantize(W, H, QuantSpec(24))


def test_nf4_matches_bitsandbytes():
    bnbf = pytest.importorskip("bitsandbytes.functional")
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(24, 64, generator=gen)
    packed, absmax = quantize_nf4(w, 64)
    q, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
    ref = bnbf.dequantize_4bit(q, state)
    ours = dequantize_nf4(packed, absmax, (24, 64), 64)
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    lin = NF4Linear(64, 24, 64)
    lin.nf4_weight.copy_(packed)
    lin.nf4_absmax.copy_(absmax)
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(lin(x), x @ ref.T, atol=1e-5, rtol=1e-5)
