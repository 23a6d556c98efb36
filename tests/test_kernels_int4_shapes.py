"""The INT4 kernels at the model's shapes, as the GPU check ran them (docs/ARCHITECTURE.md section 5): W4A16
linears of Clover's sizes at every M bucket's config, in the GPTQ order and in the MMA order (operands as they
are and swapped), the split-K sum inside the launch against the separate sum over many repeated launches (and
weights first used inside a CUDA graph's capture), and the fused MoE with Clover's 256 experts, in fp32 and in
the runtime's bf16. With --device cuda on the GPU, in 16-bit as the runtime runs them; in the interpreter the
same checks at small shapes in fp32 (bf16 arithmetic is wrong there), so they never rot. Every error is
relative to the largest reference value (devices.rel_err) and reported for the run's summary (report_err)."""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from clover_lite.kernels import configs, mma_layout  # noqa: E402
from clover_lite.kernels.int4_gemm import gemm  # noqa: E402
from clover_lite.kernels.int4_gemv import gemv  # noqa: E402
from clover_lite.kernels.int4_launch import device_arch, fill_split, gemm_config_for  # noqa: E402
from clover_lite.kernels.int4_weights import Int4Weights  # noqa: E402
from clover_lite.kernels.moe import fused_moe  # noqa: E402
from clover_lite.kernels.w4a16 import w4a16_matmul, w4a16_matmul_reference  # noqa: E402
from clover_lite.quant.pack import dequantize, pack_qweight, pack_qzeros  # noqa: E402

from .devices import on_gpu, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def random_gptq(K, N, group, device, gen, stack=None, act_order=False, fmt="gptq"):
    """Random GPTQ tensors (packed on the CPU, then moved): the kernels' arguments, no float64 copy (at 256
    experts of 2048 x 512 that would be gigabytes); the references dequantize them on the device."""
    lead = () if stack is None else (stack,)
    G = K // group
    q = torch.randint(0, 16, (*lead, K, N), generator=gen)
    z = torch.randint(1, 16, (*lead, G, N), generator=gen)
    s = (torch.rand(*lead, G, N, generator=gen) * 0.02 + 0.002).half()
    off = 1 if fmt == "gptq" else 0
    if stack is None:
        qw, qz = pack_qweight(q), pack_qzeros(z - off)
        gi = (torch.randperm(K, generator=gen) % G).int() if act_order else None
    else:
        qw = torch.stack([pack_qweight(q[e]) for e in range(stack)])
        qz = torch.stack([pack_qzeros(z[e] - off) for e in range(stack)])
        gi = torch.stack([(torch.randperm(K, generator=gen) % G).int() for _ in range(stack)]) if act_order else None
    return dict(qweight=qw.to(device), scales=s.to(device), qzeros=qz.to(device), group_size=group,
                g_idx=None if gi is None else gi.to(device), checkpoint_format=fmt)


# Clover's dense linears (K, N, group) and, on a GPU, the tiny model's group of 32; tiny ones in the interpreter.
W4A16_SHAPES = ([(2048, 512, 128), (512, 2048, 128), (4096, 2048, 128), (2048, 8192, 64), (64, 64, 32),
                 (64, 256, 32)] if on_gpu() else [(64, 40, 32), (128, 40, 128)])
# Every M bucket in the runtime's dtypes; on a GPU also fp32 (IEEE dots: the tiny model's path) at each
# bucket's config.
W4A16_CASES = ([(m, dt) for m in (1, 3, 16, 33, 64) for dt in (F16, BF16)] + [(m, F32) for m in (3, 16, 33, 64)]
               if on_gpu() else [(m, F32) for m in (1, 3, 16, 33, 64)])


@pytest.mark.parametrize("act_order, fmt", [(False, "gptq"), (True, "gptq_v2")])
@pytest.mark.parametrize("K, N, group", W4A16_SHAPES)
def test_w4a16_at_the_models_shapes(device, K, N, group, act_order, fmt, report_err):
    """w4a16_matmul into a NaN-filled output (every element must be written), and the modules' weights in the
    MMA order (this Triton's order, then the other): the GEMV at M <= 4, the GEMM at the launcher's config
    with its operands as they are and swapped (configs.mma_swap picks one at run time)."""
    gen = torch.Generator().manual_seed(K * 7 + N + act_order)
    w = random_gptq(K, N, group, device, gen, act_order=act_order, fmt=fmt)
    orders = (mma_layout.kernel_order(), 6 - mma_layout.kernel_order())
    eligible = mma_layout.eligible(K, group, w["g_idx"])
    mma = {o: Int4Weights(**w).in_mma_order(o) for o in orders} if eligible else {}
    for m, dt in W4A16_CASES:
        tol = 1e-4 if dt == F32 else 2e-2
        x = torch.randn(m, K, generator=gen).to(device, dt)
        out = torch.full((m, N), float("nan"), device=device, dtype=dt)
        w4a16_matmul(x, **w, out=out)
        ref = w4a16_matmul_reference(x.float(), **w)
        err = report_err(f"w4a16, {_name(dt)}", rel_err(out, ref))
        assert err < tol, (m, dt)
        for order in orders if eligible and (on_gpu() or m in (3, 33)) else ():
            for swap in (None,) if m <= 4 else (False, True):
                if swap is None:
                    got = gemv(x, mma[order])
                else:
                    cfg = replace(fill_split(gemm_config_for(device, m), m, N, device), swap=swap)
                    got = gemm(x, mma[order], config=cfg)
                err = report_err(f"w4a16, MMA order, {_name(dt)}", rel_err(got, ref))
                assert err < tol, (m, dt, order, swap)


# The dense linears of Clover's step with the launcher's tiles and an explicit split; tiny in the interpreter.
SPLIT_SHAPES = [(2048, 8192, 128), (4096, 2048, 128), (2048, 512, 128)] if on_gpu() else [(128, 40, 32)]
# (M, fused gate/up, split): each (kernel, fused) pair compiles twice (the sum in the kernel or not), seconds
# of device time each, so three on a GPU; a fused GEMV and a fused GEMM in the interpreter.
SPLIT_RUNS = ((1, False, 4), (33, True, 2), (16, False, 8)) if on_gpu() else ((3, True, 8), (33, True, 2))


@pytest.mark.parametrize("K, N, group", SPLIT_SHAPES)
def test_split_sum_in_the_kernel_at_the_models_shapes(device, K, N, group, report_err):
    """Split-K partials summed by each tile's last split (an atomic counter per tile): within rounding of the
    separate sum launch, the same result on every one of many repeated launches (a missed ordering between
    the splits would show as a launch that read a partial before it was written), every counter back at zero
    after them; GEMM and GEMV, fused gate/up too, in the modules' MMA order where eligible, in the runtime's
    dtype. On a GPU also: weights first used inside a CUDA graph's capture (their counters made there: a
    captured memset), replayed, then called eagerly, give the same result."""
    gen = torch.Generator().manual_seed(K + N)
    arch = device_arch(device)
    dt = BF16 if on_gpu() else F32
    repeats = 40 if on_gpu() else 2
    ws = [Int4Weights(**random_gptq(K, N, group, device, gen)) for _ in range(2)]
    if mma_layout.eligible(K, group, None):
        ws = [w.in_mma_order(mma_layout.kernel_order()) for w in ws]
    for m, fused, split in SPLIT_RUNS:
        x = torch.randn(m, K, generator=gen).to(device, dt)
        w2 = ws[1] if fused else None
        if m <= 4:
            cfg = replace(configs.INTERPRET_GEMV if arch is None else configs.gemv_config(arch), split_k=split)
            run = lambda c, x=x, w2=w2: gemv(x, ws[0], w2, config=c)  # noqa: E731
        else:
            cfg = replace(gemm_config_for(device, m), split_k=split)
            run = lambda c, x=x, w2=w2: gemm(x, ws[0], w2, config=c)  # noqa: E731
        separate = run(replace(cfg, sum_in_kernel=False)).float()
        first = run(cfg)
        err = report_err("split-K sum in the kernel vs the separate sum", rel_err(first, separate))
        assert err < 1e-3, (m, fused, split)
        for i in range(repeats):
            assert torch.equal(run(cfg), first), f"M={m} fused={fused}: launch {i + 2} gave another result"
        assert ws[0]._tile_done is None or not ws[0]._tile_done.any(), "a tile's split counter was left non-zero"
        if on_gpu() and m > 4:
            fresh = Int4Weights(ws[0].qweight, ws[0].scales, ws[0].qzeros, group, mma_order=ws[0].mma_order)
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.graph(graph, stream=stream):
                captured = gemm(x, fresh, w2, config=cfg)
            graph.replay()
            torch.cuda.synchronize()
            eager = gemm(x, fresh, w2, config=cfg)
            assert torch.equal(captured, first) and torch.equal(eager, first), (
                f"M={m} fused={fused}: weights first used in a graph's capture gave another result")


def test_fused_moe_at_the_models_shapes(device, report_err):
    """The routed experts of Clover's MoE layer (256 experts of 2048 -> 512, top 8) through fused_moe, in the
    GPTQ order and in the MMA order, from a step's token to a prefill's 512, against the experts dequantized
    on the device and summed in fp32; fp32 activations, and bf16 on a GPU (the runtime's dtype, whose tensor-core
    tiles take the weights as 16-bit planes of 128 + q). Small in the interpreter."""
    from clover_lite.models.moe import dispatch

    gen = torch.Generator().manual_seed(256)
    E, k, H, inter, group = (256, 8, 2048, 512, 128) if on_gpu() else (8, 2, 64, 32, 32)
    shapes = {"gate": (H, inter), "up": (H, inter), "down": (inter, H)}
    ws = {p: random_gptq(K, N, group, device, gen, stack=E) for p, (K, N) in shapes.items()}
    dense = {p: torch.stack([dequantize(w["qweight"][e], w["qzeros"][e], w["scales"][e],
                                        torch.arange(w["qweight"].shape[1] * 8, device=device) // w["group_size"],
                                        dtype=torch.float32) for e in range(E)]) for p, w in ws.items()}

    def expert(e, h):
        act = torch.nn.functional.silu(h @ dense["gate"][e].t()) * (h @ dense["up"][e].t())
        return act @ dense["down"][e].t()

    plain = [Int4Weights(**ws[p]) for p in shapes]
    orders = {"GPTQ order": plain}
    if all(mma_layout.eligible(shapes[p][0], group, None) for p in shapes):
        orders["MMA order"] = [Int4Weights(**ws[p]).in_mma_order(mma_layout.kernel_order()) for p in shapes]
    cases = ([(T, F32) for T in (1, 32, 64, 512)] + [(T, BF16) for T in (1, 32, 512)] if on_gpu()
             else [(T, F32) for T in (3, 40)])
    for T, dt in cases:
        x = torch.randn(T, H, generator=gen).to(device)
        logits = torch.randn(T, E, generator=gen).to(device)
        w, ids = torch.topk(torch.softmax(logits, -1), k)
        ref = dispatch(x.to(dt).float(), w.to(dt).float(), ids, E, expert)
        for order, weights in orders.items():
            err = report_err(f"fused MoE, {_name(dt)}, {order}", rel_err(fused_moe(x.to(dt), w.to(dt), ids, *weights),
                                                                          ref))
            assert err < (1e-3 if dt == F32 else 2e-2), (T, dt, order)
