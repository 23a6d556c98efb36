"""The INT4 Triton kernels, run by Triton's interpreter on CPU (TRITON_INTERPRET=1, set in conftest; compiled
on the GPU with --device cuda), against float64 references on fresh random inputs: ragged shapes, act-order,
sym/asym, v1/v2. Inputs are made on the CPU and moved to the device; the float64 references stay on the CPU."""

from dataclasses import replace

import pytest
import torch

from clover_lite.errors import CloverError

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from clover_lite.kernels import configs, dispatch, int4_gemm, int4_weights  # noqa: E402
from clover_lite.kernels.int4_dequant import biased_planes16, nibble_planes  # noqa: E402
from clover_lite.kernels.int4_gemm import gemm  # noqa: E402
from clover_lite.kernels.int4_gemv import gemv  # noqa: E402
from clover_lite.kernels.int4_weights import Int4Weights  # noqa: E402
from clover_lite.kernels.moe import fused_moe  # noqa: E402
from clover_lite.kernels.w4a16 import w4a16_matmul  # noqa: E402
from clover_lite.models.moe import dispatch as moe_reference  # noqa: E402
from clover_lite.quant.pack import pack_qweight, pack_qzeros  # noqa: E402

from .devices import assert_near, assert_same, on_gpu, to  # noqa: E402

pytestmark = pytest.mark.gpu
GEN = torch.Generator().manual_seed(20261201)


def random_int4(K, N, group, fmt="gptq", sym=True, act_order=False, stack=None, g_idx=None):
    """Random GPTQ tensors and the float64 weight W [.., N, K] they encode (computed independently);
    `g_idx` [stack or 1, K] imposes an act-order grouping."""
    lead = () if stack is None else (stack,)
    G = 1 if group == -1 else K // group
    q = torch.randint(0, 16, (*lead, K, N), generator=GEN)
    zeros = torch.full((*lead, G, N), 8) if sym else torch.randint(1, 16, (*lead, G, N), generator=GEN)
    scales = (torch.rand(*lead, G, N, generator=GEN) * 0.02 + 0.005).half()
    base = torch.arange(K) // (K // G)
    if act_order and g_idx is None:
        g_idx = torch.stack([base[torch.randperm(K, generator=GEN)] for _ in range(stack or 1)])
    gi = g_idx if g_idx is not None else base.expand(stack or 1, K)
    packs, w = [], []
    for e in range(stack or 1):
        qe = q[e] if stack else q
        ze = zeros[e] if stack else zeros
        se = scales[e] if stack else scales
        packs.append((pack_qweight(qe), pack_qzeros(ze - (1 if fmt == "gptq" else 0)), se))
        w.append(((qe.double() - ze[gi[e]].double()) * se[gi[e]].double()).t())
    qweight, qzeros, sc = (torch.stack([p[i] for p in packs]) for i in range(3))
    if stack is None:
        qweight, qzeros, sc, w = qweight[0], qzeros[0], sc[0], w[0]
        g_idx = None if g_idx is None else g_idx[0]
    else:
        w = torch.stack(w)
    return dict(qweight=qweight, scales=sc, qzeros=qzeros, group_size=group,
                g_idx=None if g_idx is None else g_idx.int(), checkpoint_format=fmt), w


def weights_on(device, t) -> Int4Weights:
    """random_int4's tensors as the kernels' weights on `device`."""
    return Int4Weights(**to(device, t))


def tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("M", [1, 3, 5, 17, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("variant", ["sym-v1", "asym-v1-actorder", "asym-v2", "sym-v2-actorder-perchannel"])
def test_w4a16_matmul_matches_float64(device, M, dtype, variant):
    sym = variant.startswith("sym")
    fmt = "gptq_v2" if "v2" in variant else "gptq"
    group = -1 if "perchannel" in variant else 32
    t, w = random_int4(96, 40, group, fmt, sym, act_order="actorder" in variant)  # N, K not multiples of tiles
    x = torch.randn(M, 96, generator=GEN).to(dtype)
    out = torch.full((M, 40), float("nan"), dtype=dtype, device=device)  # poisoned: every element must be written
    y = w4a16_matmul(x.to(device), **to(device, t), out=out)
    assert y is out and not torch.isnan(out).any()
    ref = x.double() @ w.t()
    torch.testing.assert_close(out.double().cpu(), ref, **tol(dtype))


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_gemm_tiles_ragged_k_and_split_k(device, split_k, act_order, fused):
    # Tiles wider than N and K (BLOCK_K 64 over K = 96: the second tile is ragged) and split-K; fused
    # SiLU(gate) * up, whose split-K partials hold both sums (SiLU after the sum).
    t, w = random_int4(96, 24, -1 if not act_order else 32, act_order=act_order)
    cfg = configs.GemmConfig(16, 64, 64, split_k, 4, 1)
    x = torch.randn(21, 96, generator=GEN)
    if fused:
        t2, w2 = random_int4(96, 24, -1 if not act_order else 32, g_idx=t["g_idx"][None] if act_order else None)
        y = gemm(x.to(device), weights_on(device, t), weights_on(device, t2), config=cfg)
        ref = torch.nn.functional.silu(x.double() @ w.t()) * (x.double() @ w2.t())
    else:
        y = gemm(x.to(device), weights_on(device, t), config=cfg)
        ref = x.double() @ w.t()
    torch.testing.assert_close(y.double().cpu(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["gemm", "gemv"])
@pytest.mark.parametrize("fused", [False, True])
def test_split_k_summed_by_the_last_split_equals_the_separate_sum(device, kernel, fused):
    """The last split of each output tile sums the tile's partials in the kernel (int4_split_k.last_split_sums):
    the same values, bit for bit (in the interpreter; within rounding on a GPU, where the two are compiled
    apart), as _sum_splits' launch after the kernel, and float64's within rounding; the
    tiles' counters are back at zero after every launch, so calls on the same weights with other grids (more
    rows, more tiles: the counters grow) and other splits reuse them. Under the memory check, the last split
    reads the other splits' partials only after acquiring their counter."""
    K, N = 320, 72  # 5 K tiles of 64 over 2 or 4 splits (ragged), 3 column tiles of 32 (ragged)
    t, w = random_int4(K, N, 64, "gptq_v2", sym=False)
    t2, w2 = random_int4(K, N, 64, "gptq_v2")
    wt = weights_on(device, t)
    w2t = weights_on(device, t2) if fused else None
    for M, split in ((1, 2), (3, 4), (21, 4), (40, 2)) if kernel == "gemm" else ((1, 4), (4, 2), (2, 3)):
        x = torch.randn(M, K, generator=GEN).half()
        xd = x.to(device)
        if kernel == "gemm":
            cfg = configs.GemmConfig(16, 32, 64, split, 4, 1)
            run = lambda c, x=xd: gemm(x, wt, w2t, config=c)  # noqa: E731
        else:
            cfg = configs.GemvConfig(32, 64, 4, 1, split_k=split)
            run = lambda c, x=xd: gemv(x, wt, w2t, config=c)  # noqa: E731
        y = run(cfg)
        assert wt._tile_done is not None and not wt._tile_done.any()  # every tile's counter reset
        assert_same(y, run(replace(cfg, sum_in_kernel=False)))
        ref = x.double() @ w.t()
        if fused:
            ref = torch.nn.functional.silu(ref) * (x.double() @ w2.t())
        torch.testing.assert_close(y.double().cpu(), ref, atol=2e-2, rtol=2e-2)
    tiles = {"gemm": 3 * 3, "gemv": 4 * 3}[kernel]  # the most a call above used: 40 rows / 16, or 4 rows
    assert wt._tile_done.numel() >= tiles
    # Outgrown sets stay allocated (a CUDA graph captured with one keeps its address) and at zero
    assert wt._outgrown and all(not c.any() for c in wt._outgrown)


def test_split_counters_are_not_replaced_while_a_graph_is_captured(device, monkeypatch):
    """During a CUDA graph's capture a counter set's zeros would be a recorded memset, run only at replay: a
    call that needs more tiles then gets a set of its own, and the weights keep theirs for eager calls."""
    t, w = random_int4(128, 40, 64)
    wt = weights_on(device, t)
    cfg = configs.GemmConfig(16, 32, 64, 2, 4, 1)
    x = torch.randn(17, 128, generator=GEN)
    gemm(x[:5].to(device), wt, config=cfg)  # one row tile x 2 column tiles
    kept = wt._tile_done
    monkeypatch.setattr(int4_weights, "_capturing", lambda t: True)
    y = gemm(x.to(device), wt, config=cfg)  # two row tiles: more counters than the weights hold
    assert wt._tile_done is kept and kept.numel() == 2 and not wt._outgrown
    torch.testing.assert_close(y.double().cpu(), x.double() @ w.t(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("K,group,split", [(256, 128, 1), (200, -1, 1), (384, -1, 2), (512, 256, 3)])
@pytest.mark.parametrize("variant", ["dense", "experts-fused", "experts-scaled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemm_nibble_planes(device, K, group, split, variant, dtype):
    """With BLOCK_K >= 128 and no g_idx the GEMM takes each packed word tile as 8 nibble planes, 8 dots
    against strided columns of x (fp16: planes of 1024 + q, the bias removed with the zero point): ragged
    last tile (K = 200 over 128), split-K, a K tile that is half a group (BLOCK_K 128, group 256), MoE
    tiles with -1 padding rows, fused SiLU(gate) * up and routing weights, against float64."""
    E = 1 if variant == "dense" else 3
    t, w = random_int4(K, 40, group, "gptq", sym=False, stack=E)
    x = torch.randn(6, K, generator=GEN).to(dtype)
    cfg = configs.GemmConfig(16, 32, 128, split, 4, 1)
    xd = x.to(device)
    if E == 1:
        y = gemm(xd, weights_on(device, t), config=cfg)
        ref = x.double() @ w[0].t()
    else:  # two 16-row tiles: experts 2 then 0, each padded with -1
        rows = torch.full((32,), -1, dtype=torch.int32)
        rows[:5] = torch.tensor([4, 0, 5, 2, 1])
        rows[16:19] = torch.tensor([3, 0, 5])
        tile_expert = torch.tensor([2, 0], dtype=torch.int32)
        ex = torch.tensor([2] * 16 + [0] * 16)
        ok = rows >= 0
        xr = x.double()[rows.long().clamp(min=0)]
        if variant == "experts-fused":
            t2, w2 = random_int4(K, 40, group, "gptq", sym=False, stack=E)
            y = gemm(xd, weights_on(device, t), weights_on(device, t2), rows=rows.to(device),
                     tile_expert=tile_expert.to(device), n_rows=32, config=cfg)
            g = torch.einsum("pk,pnk->pn", xr, w[ex])
            ref = torch.nn.functional.silu(g) * torch.einsum("pk,pnk->pn", xr, w2[ex])
        else:
            scale = torch.rand(32, generator=GEN)
            y = gemm(xd, weights_on(device, t), rows=rows.to(device), tile_expert=tile_expert.to(device),
                     row_scale=scale.to(device), n_rows=32, config=cfg)
            ref = torch.einsum("pk,pnk->pn", xr, w[ex]) * scale.double()[:, None]
        y, ref = y.cpu()[ok], ref[ok]
    torch.testing.assert_close(y.double().cpu(), ref, **tol(dtype))


@triton.jit
def _planes_kernel(w_ptr, out16_ptr, out32_ptr, DTYPE: tl.constexpr):
    offs = tl.arange(0, 64)
    words = tl.load(w_ptr + offs)
    p16 = biased_planes16(words, DTYPE)
    p32 = nibble_planes(words, 0)
    for J in tl.static_range(8):
        tl.store(out16_ptr + J * 64 + offs, p16[J].to(tl.int16, bitcast=True))
        tl.store(out32_ptr + J * 64 + offs, p32[J])


@pytest.mark.parametrize("dtype,bias", [(torch.bfloat16, 128), (torch.float16, 1024)])
def test_nibble_planes_are_exact(device, dtype, bias):
    """The INT4 kernels' weight operands, run through the interpreter and read back as bits: the 16-bit
    planes are the floats bias + q, the fp32 planes exactly q, for every nibble of random words (bf16
    arithmetic is wrong under the interpreter, so the bf16 GEMM itself only runs on a GPU: this pins its
    operand)."""
    words = torch.randint(-(2**31), 2**31, (64,), generator=GEN, dtype=torch.int64).to(torch.int32)
    words[:2] = torch.tensor([-1, 0], dtype=torch.int32)  # every nibble 15, every nibble 0
    out16 = torch.empty(8, 64, dtype=torch.int16, device=device)
    out32 = torch.empty(8, 64, dtype=torch.float32, device=device)
    _planes_kernel[(1,)](words.to(device), out16, out32, DTYPE=tl.bfloat16 if dtype == torch.bfloat16 else tl.float16)
    q = torch.stack([(words.long() >> (4 * j)) & 15 for j in range(8)])
    assert torch.equal(out16.cpu().view(dtype).double(), (q + bias).double())
    assert torch.equal(out32.cpu().double(), q.double())


def spy_gemm_launches(monkeypatch, flag: str) -> list:
    """The value of constexpr `flag` at every GEMM launch from here on (the kernel still runs)."""
    launched, real = [], int4_gemm._gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append(kw[flag])
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(int4_gemm, "_gemm_kernel", Spy())
    return launched


@pytest.mark.parametrize("K,group,split", [(96, 32, 3), (72, -1, 2), (128, 64, 1), (256, 128, 8)])
@pytest.mark.parametrize("variant", ["dense", "dense-actorder", "experts-fused", "experts-scaled"])
def test_gemv_nibble_planes_and_split_k(device, K, group, split, variant):
    """The GEMV reads each packed word once and takes its 8 nibbles as planes (no int-to-float conversion),
    over K split into fp32 partials when too few programs would fill the GPU: ragged last tiles (K = 72 over
    BLOCK_K 32), splits that do not divide the tiles (3 over 3 tiles of 32), act-order, MoE rows with fused
    SiLU(gate) * up (applied after the partials are summed) and routing weights, against float64."""
    actorder = variant.endswith("actorder") and group != -1
    E = 1 if variant.startswith("dense") else 3
    t, w = random_int4(K, 40, group, "gptq", sym=False, act_order=actorder, stack=E)
    x = torch.randn(5, K, generator=GEN)
    xd = x.to(device)
    cfg = configs.GemvConfig(32, 32, 4, 1, split_k=split)
    if E == 1:
        y = gemv(xd, weights_on(device, t), config=cfg)
        ref = x.double() @ w[0].t()
    else:
        rows = torch.tensor([4, 0, 4, 2, 1, 3, 0], dtype=torch.int32)
        experts = torch.tensor([2, 0, 1, 1, 2, 0, 2], dtype=torch.int32)
        xr = x.double()[rows.long()]
        if variant == "experts-fused":
            t2, w2 = random_int4(K, 40, group, "gptq", sym=True, stack=E)  # one format per layer
            y = gemv(xd, weights_on(device, t), weights_on(device, t2), rows=rows.to(device),
                     row_expert=experts.to(device), n_rows=7, config=cfg)
            g = torch.einsum("pk,pnk->pn", xr, w[experts.long()])
            u = torch.einsum("pk,pnk->pn", xr, w2[experts.long()])
            ref = torch.nn.functional.silu(g) * u
        else:
            scale = torch.rand(7, generator=GEN)
            y = gemv(xd, weights_on(device, t), rows=rows.to(device), row_expert=experts.to(device),
                     row_scale=scale.to(device), n_rows=7, config=cfg)
            ref = torch.einsum("pk,pnk->pn", xr, w[experts.long()]) * scale.double()[:, None]
    torch.testing.assert_close(y.double().cpu(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.interpret_only("the split-K rule's arithmetic: no launch")
def test_gemv_split_only_as_far_as_filling_the_gpu():
    """H200 (132 SMs, 128 x 128 tiles, split up to 16, about 4 programs per SM): a 2048 -> 8192 row (64 column
    tiles) splits 8 ways; the lm_head (1,940 tiles) none; K = 512 at most into 4 splits of one tile."""
    cfg = configs.GEMV_TABLE["sm_90"]
    fill = configs.gemv_split_to_fill
    assert fill(cfg, programs=64, k=2048, sms=132).split_k == 8
    assert fill(cfg, programs=4 * 64, k=2048, sms=132).split_k == 2  # M = 4
    assert fill(cfg, programs=1940, k=2048, sms=132).split_k == 1
    assert fill(cfg, programs=16, k=512, sms=132).split_k == 4
    assert fill(cfg, programs=16, k=4096, sms=132).split_k == 16  # the table's cap
    assert (fill(cfg, programs=1, k=2048, sms=132).block_n, cfg.block_k) == (cfg.block_n, 128)


@pytest.mark.parametrize("K,group", [(64, 8), (80, 40), (96, 48), (192, 96), (256, 128)])
@pytest.mark.parametrize("M", [2, 17])
def test_any_group_size_that_divides_k(device, K, group, M):
    """Groups of 8 or 40 rows (no power-of-two tile >= 16 fits them) are followed row by row; 48 or 96 rows
    in 16- or 32-row tiles; a group spanning several tiles (128 over BLOCK_K 32) applies one scale and zero
    per tile."""
    t, w = random_int4(K, 24, group, "gptq_v2", sym=False)
    x = torch.randn(M, K, generator=GEN)
    y = w4a16_matmul(x.to(device), **to(device, t))
    torch.testing.assert_close(y.double().cpu(), x.double() @ w.t(), atol=1e-4, rtol=1e-4)


def test_bf16_input_is_computed_in_fp32_under_the_interpreter(device):
    """bf16 activations: computed in fp32 under the interpreter (its bf16 arithmetic is wrong), in bf16 on a
    GPU."""
    t, w = random_int4(64, 16, 32)
    x = torch.randn(6, 64, generator=GEN).bfloat16()
    y = w4a16_matmul(x.to(device), **to(device, t))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double().cpu(), x.double() @ w.t(), atol=5e-2, rtol=2e-2)


def _moe_case(E, k, T, hidden=64, inter=32, fmt="gptq", sym=True, act_order=False, group=32, device=None):
    """A routed MoE case: its inputs and weights on `device` (the CPU if None), the float64 reference on the CPU."""
    gate_t, gate_w = random_int4(hidden, inter, group, fmt, sym, act_order, stack=E)
    up_t, up_w = random_int4(hidden, inter, group, fmt, sym, act_order, stack=E)
    down_t, down_w = random_int4(inter, hidden, 32, fmt, sym, act_order, stack=E)
    x = torch.randn(T, hidden, generator=GEN)
    logits = torch.randn(T, E, generator=GEN)
    logits[:, 1] = -1e4  # expert 1 never receives a token
    weights, ids = torch.topk(torch.softmax(logits, -1), k)
    weights = weights / weights.sum(-1, keepdim=True)

    def expert(e, h):
        g, u = h.double() @ gate_w[e].t(), h.double() @ up_w[e].t()
        return (torch.nn.functional.silu(g) * u) @ down_w[e].t()

    ref = moe_reference(x.double(), weights.double(), ids, E, expert)
    dev = device or torch.device("cpu")
    return (*to(dev, (x, weights, ids)), *(weights_on(dev, t) for t in (gate_t, up_t, down_t)), ref)


@pytest.mark.parametrize("E,k,T,variant", [(8, 2, 3, "sym"), (8, 2, 40, "asym-actorder"), (6, 3, 25, "sym-v2"),
                                           (256, 8, 2, "sym"), (128, 8, 3, "asym")])
def test_fused_moe_matches_reference(device, E, k, T, variant):
    x, wts, ids, gate, up, down, ref = _moe_case(
        E, k, T, fmt="gptq_v2" if "v2" in variant else "gptq", sym=variant.startswith("sym"),
        act_order="actorder" in variant, device=device,
    )
    assert not (ids == 1).any()
    out = fused_moe(x, wts, ids, gate, up, down)
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-4, rtol=1e-4)


def test_fused_moe_both_paths_agree(device):
    x, wts, ids, gate, up, down, ref = _moe_case(8, 2, 30, device=device)
    gemv_path = fused_moe(x, wts, ids, gate, up, down, gemv_max_rows=1 << 20)
    tiled_path = fused_moe(x, wts, ids, gate, up, down, gemv_max_rows=0)
    torch.testing.assert_close(gemv_path.double().cpu(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(tiled_path.double().cpu(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("T", [3, 30])  # GEMV path, padded path
def test_fused_moe_adds_the_gated_shared_expert_and_the_residual_in_the_combine(device, monkeypatch, T):
    """sigmoid(logit) * shared (the MoE layer's shared expert) and the decoder's residual added to the
    experts' sum, on the GEMV path and the padded path, against float64."""
    monkeypatch.setattr(configs, "INTERPRET_MOE_GEMV", configs.GemvConfig(128, 64, 4, 1, split_k=2))
    x, wts, ids, gate, up, down, ref = _moe_case(8, 2, T, device=device)
    shared = torch.randn(T, x.shape[1], generator=GEN)
    logit = torch.randn(T, 1, generator=GEN) * 2
    residual = torch.randn(T, x.shape[1], generator=GEN)
    want = ref + torch.sigmoid(logit.double()) * shared.double() + residual.double()
    shared, logit, residual = to(device, (shared, logit, residual))
    out = fused_moe(x, wts, ids, gate, up, down, shared=shared, shared_logit=logit, residual=residual)
    torch.testing.assert_close(out.double().cpu(), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="shared expert"):
        fused_moe(x, wts, ids, gate, up, down, shared=shared)
    with pytest.raises(ValueError, match="residual must have"):
        fused_moe(x, wts, ids, gate, up, down, residual=residual[:, 1:])


@pytest.mark.parametrize("M", [3, 21])
@pytest.mark.parametrize("order", ["plain", "act-order shared", "act-order apart"])
def test_swiglu_fuses_int4_gate_and_up(device, M, order):
    """SwiGLU (shared expert, dense MLP) with GPTQ projections on the Triton path: gate and up as one fused
    GEMV (M <= 4) or GEMM launch when their layouts and row orders agree, else three linears as before."""
    from clover_lite.models.layers import SwiGLU

    H, inter = 64, 32
    act = order != "plain"
    gate_t, gate_w = random_int4(H, inter, 32, sym=False, act_order=act)
    up_t, up_w = random_int4(H, inter, 32, sym=False, act_order=act,
                             g_idx=gate_t["g_idx"][None] if order == "act-order shared" else None)
    down_t, down_w = random_int4(inter, H, 16, sym=False)
    mlp = SwiGLU(H, inter)
    mlp.gate_proj, mlp.up_proj = _quant_linear(gate_t, H, inter, 32), _quant_linear(up_t, H, inter, 32)
    mlp.down_proj = _quant_linear(down_t, inter, H, 16)
    x = torch.randn(M, H, generator=GEN)
    mlp.to(device)
    dispatch.apply(mlp, "triton")
    assert (mlp._gate_up is not None) == (order != "act-order apart")
    ref = (torch.nn.functional.silu(x.double() @ gate_w.t()) * (x.double() @ up_w.t())) @ down_w.t()
    torch.testing.assert_close(mlp(x.to(device)).double().cpu(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("static_groups", [True, False])
def test_model_with_triton_kernels_generates_like_the_reference(device, tiny2_dir, tmp_path, static_groups):
    """Our default checkpoint (act-order with static groups: plain g_idx), and desc_act without static
    groups (scattered groups, repacked by group at load) through every kernel. On a GPU the GDN kernel's
    products run in tf32: the logits agree within its rounding, and greedy tokens may part at a near-tie, so
    there the logits decide."""
    import clover_lite
    from clover_lite.models.quantized import QuantLinear
    from clover_lite.quant.pipeline import QuantizeOptions, quantize_model

    opts = QuantizeOptions(group_size=32, nsamples=4, seqlen=32, static_groups=static_groups)
    out = quantize_model(tiny2_dir, tmp_path / "q", opts).out
    ref = clover_lite.load(out, device=device, dtype=torch.float32, kernels="torch")
    tri = clover_lite.load(out, device=device, dtype=torch.float32, kernels="torch")
    dispatch.apply(tri.model, "triton")
    repacked = [m for m in tri.model.modules() if isinstance(m, QuantLinear) and m.k_perm is not None]
    assert bool(repacked) == (not static_groups)
    with torch.no_grad():
        ids = torch.randint(0, 256, (1, 20), generator=GEN).to(device)  # 40 (token, expert) pairs: tiled MoE
        # on a GPU 5e-3 of the largest logit (tf32 in the GDN kernel), the GPU check's bound
        assert_near(tri.model(ids, block_size=4), ref.model(ids, block_size=4), 5e-3, atol=1e-4, rtol=1e-4)
    if not on_gpu():
        kw = dict(max_new_tokens=4, steps_per_block=1)  # steps of 4 rows: the GEMV paths, and a commit between
        assert tri.generate([5, 6, 7], **kw).token_ids == ref.generate([5, 6, 7], **kw).token_ids


@pytest.mark.interpret_only("the tables' arithmetic: no launch (the GPU run compiles the entries in use)")
def test_every_tuning_config_fits_its_architecture():
    for arch, table in configs.GEMM_TABLE.items():
        assert set(table) == set(configs.M_BUCKETS), arch
        for m, c in table.items():
            assert min(c.block_m, c.block_n, c.block_k) >= 16, (arch, m, c)
            assert 128 % c.block_k == 0 and c.split_k >= 1, (arch, m, c)
            assert c.smem_bytes() <= configs.SMEM_LIMIT[arch], (arch, m, c, c.smem_bytes())
            assert all(a.smem_bytes() <= configs.SMEM_LIMIT[arch] for a in configs.autotune_configs(arch, m))
            # Weights in the MMA order: 128-row K tiles, the table's stages.
            assert configs.for_mma_order(c, arch) == replace(c, block_k=128), (arch, m, c)
            for a in configs.autotune_configs(arch, m):
                a = configs.for_mma_order(a, arch)
                assert a.smem_bytes(fused=True) <= configs.SMEM_LIMIT[arch], (arch, m, a)
            for fused in (False, True):  # act-order g_idx: scales and zeros gathered per element
                for a in configs.autotune_configs(arch, m):
                    g = configs.for_gathered_groups(a, arch, fused)
                    assert g.block_k >= 16 and 128 % g.block_k == 0, (arch, m, fused, g)
                    assert g.smem_bytes(gathered=True, fused=fused) <= configs.SMEM_LIMIT[arch], (arch, m, fused, g)
        for gv in (configs.gemv_config(arch), configs.gemv_config(arch, moe=True)):
            assert min(gv.block_n, gv.block_k) >= 16 and 128 % gv.block_k == 0, (arch, gv)
            assert gv.smem_bytes() <= configs.SMEM_LIMIT[arch], (arch, gv)
    assert set(configs.MOE_GEMV_TABLE) <= set(configs.GEMV_TABLE)
    assert configs.arch_of((8, 6)) == "sm_86" and configs.arch_of((9, 0)) == "sm_90"
    assert configs.arch_of((8, 7)) == "sm_80"  # an unknown minor falls back within its major


def test_gemm_takes_the_configs_choice_of_nibble_planes(device, monkeypatch):
    """A config's `planes` picks the GEMM's weight path (sm_90's M <= 64 entry takes the unpacked tile) and the
    `planes` argument overrides it; both paths give the float64 result."""
    launched = spy_gemm_launches(monkeypatch, "PLANES")
    t, w = random_int4(256, 24, 128)
    x = torch.randn(5, 256, generator=GEN)
    for planes, arg, want in ((True, None, True), (False, None, False), (True, False, False), (False, True, True)):
        y = gemm(x.to(device), weights_on(device, t), config=configs.GemmConfig(16, 32, 128, 1, 4, 1, planes),
                 planes=arg)
        assert launched[-1] is want
        torch.testing.assert_close(y.double().cpu(), x.double() @ w.t(), atol=1e-4, rtol=1e-4)
    assert configs.gemm_config("sm_90", 64).planes is False and configs.gemm_config("sm_90", 32).planes


@pytest.mark.interpret_only("the launchers' integer arithmetic: no launch")
def test_host_launch_arithmetic_equals_tritons():
    """kernels/host.py: the launchers' plain-integer cdiv and next power of two (Triton's are constexpr
    functions, slow to call from Python) give what Triton's give."""
    import triton

    from clover_lite.kernels.host import cdiv, next_power_of_2

    for a in [0, 1, 2, 3, 15, 16, 17, 127, 128, 129, 4095, 248320, 2**31 + 5]:
        assert next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 16, 64, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


@pytest.mark.interpret_only("the split-K rule's arithmetic: no launch")
@pytest.mark.parametrize("n,want", [(248320, 1), (8192, 4), (2048, 4), (512, 4)])
def test_split_k_only_as_far_as_filling_the_gpu(n, want):
    """At M = 16 on an H200 (132 SMs, sm_90 table: 128-column tiles, split up to 4): the lm_head's 1,940
    column tiles fill the GPU unsplit (no fp32 partials: half again its weight traffic saved); narrower
    projections keep the table's split."""
    cfg = configs.gemm_config("sm_90", 16)
    tiles = -(-16 // cfg.block_m) * -(-n // cfg.block_n)
    got = configs.split_to_fill(cfg, tiles, sms=132)
    assert got.split_k == want and (got.block_m, got.block_n, got.block_k) == (cfg.block_m, cfg.block_n, cfg.block_k)
    assert configs.split_to_fill(cfg, tiles=200, sms=132).split_k == 2  # 200 programs: one split fills 264
    assert configs.split_to_fill(configs.GemmConfig(16, 64, 64, 1), tiles=1, sms=132).split_k == 1


@pytest.mark.interpret_only("argument checks before any launch, the same on every device")
def test_bad_arguments_fail_before_launch():
    t, _ = random_int4(64, 16, 32)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="K = 48"):
        w4a16_matmul(torch.randn(4, 48), **t)
    with pytest.raises(ValueError, match="int32"):
        w4a16_matmul(x, **{**t, "qweight": t["qweight"].float()})
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        w4a16_matmul(x.double(), **t)
    with pytest.raises(ValueError, match="does not divide"):
        w4a16_matmul(x, **{**t, "group_size": 48})
    with pytest.raises(ValueError, match="scales have shape"):
        w4a16_matmul(x, **{**t, "scales": t["scales"][:1]})
    with pytest.raises(ValueError, match="g_idx"):
        w4a16_matmul(x, **{**t, "g_idx": torch.zeros(10, dtype=torch.int32)})
    with pytest.raises(ValueError, match="checkpoint_format"):
        w4a16_matmul(x, **{**t, "checkpoint_format": "awq"})
    with pytest.raises(ValueError, match="x must be"):
        w4a16_matmul(x[0], **t)
    with pytest.raises(ValueError, match="out must be"):
        w4a16_matmul(x, **t, out=torch.empty(4, 15))
    with pytest.raises(ValueError, match="expert ids"):
        gate = Int4Weights(**random_int4(64, 32, 32, stack=2)[0])
        down = Int4Weights(**random_int4(32, 64, 32, stack=2)[0])
        fused_moe(x, torch.ones(4, 1), torch.full((4, 1), 5), gate, gate, down)
    up_v2 = Int4Weights(**random_int4(64, 32, 32, "gptq_v2", stack=2)[0])
    for kernel in (gemm, gemv):  # one gate/up pair is read with the gate's format
        with pytest.raises(ValueError, match="fused gate and up weights must share"):
            kernel(x, gate, up_v2)


@pytest.mark.interpret_only("the backend's choice for CPU tensors, which needs the interpreter")
def test_dispatch_choice(monkeypatch):
    monkeypatch.setenv("CLOVER_KERNELS", "torch")
    assert dispatch.select("cpu") == "torch"
    monkeypatch.setenv("CLOVER_KERNELS", "auto")
    assert dispatch.select("cpu") == "torch"  # the reference off CUDA
    monkeypatch.setenv("CLOVER_KERNELS", "triton")
    assert dispatch.select("cpu") == "triton"  # CPU tensors in the interpreter (tests)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(CloverError, match="CLOVER_KERNELS=triton on the CPU .* TRITON_INTERPRET=1"):
        dispatch.select("cpu")
    with pytest.raises(CloverError, match="kernels=triton on the CPU"):
        dispatch.select("cpu", "triton")
    monkeypatch.setenv("CLOVER_KERNELS", "fast")
    with pytest.raises(CloverError, match="CLOVER_KERNELS='fast': use one of auto, torch, triton"):
        dispatch.select("cpu")
    with pytest.raises(ValueError, match="CUDA tensors"):
        gemv(torch.randn(1, 64), Int4Weights(**random_int4(64, 16, 32)[0]))


@pytest.mark.interpret_only("the autotuner's choice on stand-in timings: no launch")
def test_autotune_keeps_the_fastest_working_config():
    from clover_lite.kernels.int4_launch import autotune

    cands = [configs.GemmConfig(16, 64, 64, s) for s in (1, 2, 4)]
    times = {1: 3.0, 2: 1.0, 4: 2.0}

    def run(cfg):
        if cfg.split_k == 4:
            raise RuntimeError("out of resources")
        return cfg

    seen = []
    best = autotune(("test", 1), cands, run, measure=lambda fn: (seen.append(fn()), times[seen[-1].split_k])[1])
    assert best.split_k == 2 and autotune(("test", 1), cands, run) is best  # cached: not measured again


def _quant_linear(t, K, N, group, stack=None):
    from clover_lite.models.quantized import QuantLinear

    lin = QuantLinear(K, N, K // group, checkpoint_format=t["checkpoint_format"], stack=stack)
    gi = t["g_idx"] if t["g_idx"] is not None else torch.arange(K) // group
    for name, v in (("qweight", t["qweight"]), ("qzeros", t["qzeros"]), ("scales", t["scales"]), ("g_idx", gi)):
        getattr(lin, name).copy_(v.reshape(getattr(lin, name).shape))
    return lin


@pytest.mark.parametrize("M", [2, 17])
def test_act_order_linear_is_repacked_by_group(device, M):
    """desc_act weights (every group 32 rows, scattered over K): installing the kernels reorders the rows by group once,
    the kernels take the per-tile path on the gathered input, and the module still computes x W^T."""
    t, w = random_int4(96, 40, 32, "gptq", sym=False, act_order=True)
    lin = _quant_linear(t, 96, 40, 32).to(device)
    before = lin.qweight.clone()
    dispatch.apply(lin, "triton")
    assert lin.k_perm is not None and lin._int4.g_idx is None and not torch.equal(lin.qweight, before)
    assert torch.equal(lin.g_idx.cpu(), torch.arange(96, dtype=torch.int32) // 32)
    torch.testing.assert_close(lin.weight_of(dtype=torch.float64).cpu(), w)  # the reference path follows k_perm
    dispatch.apply(lin, "triton")  # idempotent: a second installation repacks nothing
    assert torch.equal(torch.sort(lin.k_perm).values.cpu(), torch.arange(96))
    x = torch.randn(M, 96, generator=GEN)
    torch.testing.assert_close(lin(x.to(device)).double().cpu(), x.double() @ w.t(), atol=1e-4, rtol=1e-4)


def test_irregular_groups_keep_the_gathering_path(device):
    """A g_idx whose groups are not all 32 rows cannot be reordered into plain groups: no repacking."""
    g_idx = (torch.arange(96) // 32)[torch.randperm(96, generator=GEN)]
    g_idx[:5] = 0  # group 0 now holds more than 32 rows
    t, w = random_int4(96, 40, 32, "gptq", act_order=True, g_idx=g_idx[None])
    lin = _quant_linear(t, 96, 40, 32).to(device)
    dispatch.apply(lin, "triton")
    assert lin.k_perm is None and lin._int4.g_idx is not None
    x = torch.randn(5, 96, generator=GEN)
    torch.testing.assert_close(lin(x.to(device)).double().cpu(), x.double() @ w.t(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shared_order", [True, False])
@pytest.mark.parametrize("T", [2, 40])  # GEMV, padded path (10 rows/expert)
def test_act_order_experts_repacked_by_group(device, monkeypatch, shared_order, T):
    """Stacks of act-order experts through fused_moe: gate and up in one row order (as GPTQ writes them:
    one gathered input, fused kernel) or in two; down in its own; against a float64 reference."""
    from clover_lite.models.quantized import gptq_experts

    monkeypatch.setattr(configs, "INTERPRET_MOE_GEMV", configs.GemvConfig(128, 64, 4, 1, split_k=2))

    E, k, H, inter = 4, 2, 64, 32
    gate_t, gate_w = random_int4(H, inter, 32, act_order=True, stack=E)
    up_t, up_w = random_int4(H, inter, 32, act_order=True, stack=E, g_idx=gate_t["g_idx"] if shared_order else None)
    down_t, down_w = random_int4(inter, H, 16, act_order=True, stack=E)
    experts = gptq_experts(E, H, inter, H // 32, inter // 16)
    for name, t, K, N, g in (("gate_proj", gate_t, H, inter, 32), ("up_proj", up_t, H, inter, 32),
                             ("down_proj", down_t, inter, H, 16)):
        setattr(experts, name, _quant_linear(t, K, N, g, stack=E))
    experts.to(device)
    dispatch.apply(experts, "triton")
    assert all(p.k_perm is not None for p in (experts.gate_proj, experts.up_proj, experts.down_proj))
    assert (experts.up_proj.k_perm is experts.gate_proj.k_perm) == shared_order
    x = torch.randn(T, H, generator=GEN)
    weights, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=GEN), -1), k)

    def expert(e, h):
        g, u = h.double() @ gate_w[e].t(), h.double() @ up_w[e].t()
        return (torch.nn.functional.silu(g) * u) @ down_w[e].t()

    ref = moe_reference(x.double(), weights.double(), ids, E, expert)
    out = experts(*to(device, (x, weights, ids)))
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-4, rtol=1e-4)
