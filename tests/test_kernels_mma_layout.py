"""INT4 weights in the MMA order (kernels/mma_layout.py): the rearrangement against a hand-worked case and an
independent unpacking, and every INT4 kernel taking such weights against float64, under the interpreter (or
on the GPU with --device cuda)."""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from clover_lite.kernels import configs, dispatch, mma_layout  # noqa: E402
from clover_lite.kernels.int4_gemm import gemm  # noqa: E402
from clover_lite.kernels.int4_gemv import gemv  # noqa: E402
from clover_lite.kernels.int4_weights import Int4Weights  # noqa: E402
from clover_lite.kernels.moe import fused_moe  # noqa: E402
from clover_lite.models.moe import dispatch as moe_reference  # noqa: E402
from clover_lite.quant.pack import unpack_qweight  # noqa: E402

from .devices import to  # noqa: E402
from .test_kernels_int4 import GEN, _quant_linear, random_int4, weights_on  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.interpret_only("the layout's index arithmetic: no launch")
def test_rows_hand_worked():
    """Nibble J = m + 4h of word (t, c): order 2 row 32c + 8m + 2t + h, order 4 row 32c + 16(m//2) + 4t +
    2(m%2) + h; each a permutation of a block's 128 rows."""
    for order in mma_layout.ORDERS:
        assert sorted(mma_layout.rows(order).flatten().tolist()) == list(range(128))
    assert mma_layout.rows(2)[1, 2, 5] == 64 + 8 + 2 + 1  # t=1, c=2, m=1, h=1
    assert mma_layout.rows(4)[1, 2, 6] == 64 + 16 + 4 + 0 + 1  # t=1, c=2, m=2, h=1
    assert mma_layout.rows(4)[3, 0, 1] == 12 + 2  # t=3, c=0, m=1, h=0
    with pytest.raises(ValueError, match="order"):
        mma_layout.rows(3)


@pytest.mark.interpret_only("the repacking is torch on the host's tensors: no launch")
@pytest.mark.parametrize("order", mma_layout.ORDERS)
def test_repack_places_every_nibble_and_round_trips(order, monkeypatch):
    """Word ((b N + n) 4 + t) 4 + c, nibble J, holds row 128 b + rows[t, c, J] of column n; a stack of two,
    converted in pieces (a block, 16 columns: a ragged last piece), in place, and back."""
    monkeypatch.setattr(mma_layout, "PIECE", 128 * 16)  # pieces of one block and 16 of its 40 columns
    t, _ = random_int4(384, 40, 128, stack=2)
    qw = t["qweight"]
    packed = mma_layout.to_mma(qw, order)
    assert packed.shape == qw.shape and not torch.equal(packed, qw)
    rows = mma_layout.rows(order)
    for e in range(2):
        q = unpack_qweight(qw[e])  # [K, N]
        flat = packed[e].reshape(-1)
        for _ in range(200):
            b, n, tt, c, J = (int(torch.randint(0, hi, (), generator=GEN)) for hi in (3, 40, 4, 4, 8))
            word = int(flat[((b * 40 + n) * 4 + tt) * 4 + c])
            assert (word >> (4 * J)) & 15 == q[128 * b + rows[tt, c, J], n]
    assert torch.equal(mma_layout.from_mma(packed, order), qw)
    inplace = qw.clone()
    mma_layout.repack_(inplace, order)
    assert torch.equal(inplace, packed)


@pytest.mark.interpret_only("eligibility rules and argument checks: no launch")
def test_eligibility_and_errors():
    assert mma_layout.eligible(256, 128, None) and mma_layout.eligible(256, 256, None)
    assert not mma_layout.eligible(256, 64, None) and not mma_layout.eligible(192, 192, None)
    assert not mma_layout.eligible(256, 128, torch.zeros(256))
    t, _ = random_int4(256, 16, 64)
    with pytest.raises(ValueError, match="MMA order"):
        Int4Weights(**t, mma_order=2)
    with pytest.raises(ValueError, match="multiple of 128"):
        mma_layout.to_mma(t["qweight"][:8], 2)


@pytest.mark.parametrize("order, variant", [(2, "sym-v1-g128"), (4, "sym-v1-g128"), (4, "asym-v2-g256"),
                                            (2, "asym-v1-perchannel")])
def test_gemm_and_gemv_take_the_mma_order(device, order, variant):
    """The GEMM (K tiles of 32, 64 and 128 rows: slices of a block and whole blocks, split-K; operands as they
    are and swapped, configs.mma_swap) and the GEMV, fp32 and fp16, ragged M and N, against float64."""
    fmt = "gptq_v2" if "v2" in variant else "gptq"
    group = -1 if "perchannel" in variant else int(variant.split("-g")[1])
    t, w = random_int4(256, 72, group, fmt, sym=variant.startswith("sym"))
    W = weights_on(device, t).in_mma_order(order)
    for dtype, tiles in ((torch.float32, ((32, 1, False), (128, 2, True))),
                         (torch.float16, ((64, 2, True), (128, 1, False)))):
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        for M in (1, 17):
            x = torch.randn(M, 256, generator=GEN).to(dtype)
            ref = x.double() @ w.t()
            xd = x.to(device)
            torch.testing.assert_close(gemv(xd, W).double().cpu(), ref, **tol)
            for bk, split, swap in tiles:
                cfg = configs.GemmConfig(16, 64, bk, split, 4, 1, swap=swap)
                torch.testing.assert_close(gemm(xd, W, config=cfg).double().cpu(), ref, **tol)


@pytest.mark.parametrize("order, path", [(2, "gemv"), (4, "gemv"), (2, "padded")])
def test_fused_moe_takes_the_mma_order(device, monkeypatch, order, path):
    """Experts in the MMA order on each MoE path (gate/up K = 128: one block; down K = 256: two), fp32; the
    padded path's GEMM with swapped operands (configs.mma_swap)."""
    monkeypatch.setattr(configs, "INTERPRET_MOE_GEMV", configs.GemvConfig(64, 64, 4, 1, split_k=2))
    if path == "padded":
        monkeypatch.setattr(configs, "INTERPRET_GEMM", replace(configs.INTERPRET_GEMM, swap=True))
    E, k, T, hidden, inter = 4, 2, (24 if path == "padded" else 5), 128, 256
    parts = [random_int4(hidden, inter, 128, stack=E), random_int4(hidden, inter, 128, sym=False, stack=E),
             random_int4(inter, hidden, 128, sym=False, stack=E)]
    ws = [weights_on(device, t).in_mma_order(order) for t, _ in parts]
    x = torch.randn(T, hidden, generator=GEN)
    weights, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=GEN), -1), k)

    def expert(e, h):
        g, u = h.double() @ parts[0][1][e].t(), h.double() @ parts[1][1][e].t()
        return (torch.nn.functional.silu(g) * u) @ parts[2][1][e].t()

    ref = moe_reference(x.double(), weights.double(), ids, E, expert)
    out = fused_moe(*to(device, (x, weights, ids)), *ws, gemv_max_rows=0 if path == "padded" else 1 << 20)
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-4, rtol=1e-4)


def test_quant_linear_prepare_repacks_eligible_weights(device, monkeypatch):
    """Installing the kernels rearranges eligible weights in place (once), the reference reads them back, the kernel
    path takes them; act-order weights repacked by group first; ineligible ones (groups of 64) stay GPTQ."""
    monkeypatch.setenv("CLOVER_KERNELS_UNVERIFIED", "1")  # the MMA order is not yet verified on a GPU
    g_idx = torch.arange(256) % 2  # act-order: the two groups of 128 rows interleaved
    cases = [(random_int4(256, 40, 128), True), (random_int4(256, 40, 128, act_order=True,
                                                              g_idx=g_idx[None].int()), True),
             (random_int4(256, 40, 64), False)]
    for (t, w), repacked in cases:
        lin = _quant_linear(t, 256, 40, t["group_size"]).to(device)
        before = lin.weight_of(dtype=torch.float64)
        torch.testing.assert_close(before.cpu(), w)
        dispatch.apply(lin, "triton")
        assert (lin.mma_order == mma_layout.kernel_order()) == repacked and lin._int4.mma_order == lin.mma_order
        words = lin.qweight.clone()
        dispatch.apply(lin, "triton")  # a second installation leaves the words as they are
        assert torch.equal(lin.qweight, words)
        torch.testing.assert_close(lin.weight_of(dtype=torch.float64).cpu(), w)
        x = torch.randn(5, 256, generator=GEN)
        torch.testing.assert_close(lin(x.to(device)).double().cpu(), x.double() @ w.t(), atol=1e-4, rtol=1e-4)


@pytest.mark.interpret_only("the swap rule's table: no launch")
def test_mma_swap_rule():
    """Where the GEMM on MMA-order weights swaps its operands (configs.mma_swap), by hand from the compiled
    counts in RESULTS.md: sm_90 and sm_100 at every M with Triton < 3.9's order 4, elsewhere above 32 rows,
    fp32 always; never for the GPTQ order or under the interpreter unless a config asks."""
    small, large = configs.gemm_config("sm_90", 16), configs.gemm_config("sm_90", 64)
    assert configs.mma_swap(small, "sm_90", 4) and configs.mma_swap(small, "sm_100", 4)
    assert not configs.mma_swap(small, "sm_90", 2) and configs.mma_swap(small, "sm_90", 2, fp32=True)
    assert not configs.mma_swap(configs.gemm_config("sm_86", 32), "sm_86", 4)
    assert configs.mma_swap(large, "sm_90", 2) and configs.mma_swap(configs.gemm_config("sm_86", 64), "sm_86", 2)
    assert not configs.mma_swap(large, "sm_90", 0) and not configs.mma_swap(large, None, 4)
    assert configs.mma_swap(replace(small, swap=True), None, 2) and not configs.mma_swap(replace(large, swap=False),
                                                                                           "sm_90", 4)


def test_the_default_is_the_gpu_verified_configuration(device, monkeypatch):
    """Without CLOVER_KERNELS_UNVERIFIED the kernels run as the last GPU session verified them (recorded in
    configs.VERIFIED: changing the default is an edit there): no MMA order at load, so no swapped operands,
    and split-K partials summed by a launch of their own; with the switch, every unverified change is on."""
    monkeypatch.delenv("CLOVER_KERNELS_UNVERIFIED", raising=False)
    assert (configs.VERIFIED.date, configs.VERIFIED.card, configs.VERIFIED.commit) == ("2026-12-04", "H200", "fe1975c")
    assert configs.VERIFIED.changes == configs.KernelChanges(mma_order=False, sum_in_kernel=False,
                                                             diffusion_gemma=False)
    assert configs.kernel_changes() == configs.VERIFIED.changes
    t, w = random_int4(256, 40, 128)
    lin = _quant_linear(t, 256, 40, 128).to(device)
    dispatch.apply(lin, "triton")
    assert lin.mma_order == 0 and not lin._int4.sum_in_kernel
    x = torch.randn(5, 256, generator=GEN)
    torch.testing.assert_close(lin(x.to(device)).double().cpu(), x.double() @ w.t(), atol=1e-4, rtol=1e-4)
    monkeypatch.setenv("CLOVER_KERNELS_UNVERIFIED", "1")
    assert configs.kernel_changes() == configs.UNVERIFIED == configs.KernelChanges(mma_order=True, sum_in_kernel=True,
                                                                                   diffusion_gemma=True)
    lin = _quant_linear(t, 256, 40, 128).to(device)
    dispatch.apply(lin, "triton")
    assert lin.mma_order == mma_layout.kernel_order() and lin._int4.sum_in_kernel
    torch.testing.assert_close(lin(x.to(device)).double().cpu(), x.double() @ w.t(), atol=1e-4, rtol=1e-4)
    monkeypatch.setenv("CLOVER_KERNELS_UNVERIFIED", "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        configs.kernel_changes()
