"""One script for a GPU session: every kernel's correctness against its PyTorch reference on fresh random
inputs, then the benchmarks, within 10 minutes; a short table last.

    python benchmarks/gpu_check.py                  # on the GPU machine (benchmarks/gpu_session.sh runs it)
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --smoke   # the same checks on a CPU, tiny and slow

The checks run first; the kernel benchmark then gets at most 60% of the time left under --time-limit and
the step benchmark the rest, each stopped at its share. Copy the final table, the benchmark tables, the card
and the date into benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).parent


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in float64 on ref's device (0 where both are all zero)."""
    ref = ref.double()
    return ((out.to(ref.device, torch.float64) - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def _int4(K, N, group, device, gen, stack=None, act_order=False, fmt="gptq"):
    from clover_lite.quant.pack import pack_qweight, pack_qzeros

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


def check_w4a16(device, gen, smoke) -> str:
    from dataclasses import replace

    from clover_lite.kernels import mma_layout
    from clover_lite.kernels.int4_gemm import gemm
    from clover_lite.kernels.int4_gemv import gemv
    from clover_lite.kernels.int4_launch import fill_split, gemm_config_for
    from clover_lite.kernels.int4_weights import Int4Weights
    from clover_lite.kernels.w4a16 import w4a16_matmul, w4a16_matmul_reference

    shapes = ([(64, 40, 32), (128, 40, 128)] if smoke else
              [(2048, 512, 128), (512, 2048, 128), (4096, 2048, 128), (2048, 8192, 64)])
    dtypes = [torch.float32] if device.type == "cpu" else [torch.float16, torch.bfloat16]
    mma_orders = (mma_layout.kernel_order(), 6 - mma_layout.kernel_order())
    worst = worst_mma = 0.0
    # fp32 on a GPU (IEEE dots, the tiny model's path in check_model) at each M bucket's config, and the
    # tiny model's group of 32
    cases = [(m, dt) for m in (1, 3, 16, 33, 64) for dt in dtypes]
    cases += [] if device.type == "cpu" else [(m, torch.float32) for m in (3, 16, 33, 64)]
    for K, N, G in shapes + ([] if device.type == "cpu" else [(64, 64, 32), (64, 256, 32)]):
        for act_order, fmt in ((False, "gptq"), (True, "gptq_v2")):
            w = _int4(K, N, G, device, gen, act_order=act_order, fmt=fmt)  # packed on the CPU: once per shape
            eligible = mma_layout.eligible(K, G, w["g_idx"])
            mma = {o: Int4Weights(**w).in_mma_order(o) for o in mma_orders} if eligible else {}
            for m, dt in cases:
                x = torch.randn(m, K, generator=gen).to(device, dt)
                out = torch.full((m, N), float("nan"), device=device, dtype=dt)
                w4a16_matmul(x, **w, out=out)
                ref = w4a16_matmul_reference(x.float(), **w)
                err = rel_err(out, ref)
                worst = max(worst, err)
                if not err < (1e-4 if dt == torch.float32 else 2e-2):
                    raise AssertionError(f"w4a16 K={K} N={N} M={m} {dt} act_order={act_order}: rel err {err}")
                # The modules' weights: rearranged in the MMA order (this Triton's first, then the other).
                checked = eligible and (not smoke or m in (3, 33))
                for order in mma_orders if checked else ():
                    # The GEMM with operands as they are and swapped (the launcher picks one: configs.mma_swap)
                    swaps = (None,) if m <= 4 else (False, True)
                    for swap in swaps:
                        if swap is None:
                            out = gemv(x, mma[order])
                        else:
                            cfg = replace(fill_split(gemm_config_for(device, m), m, N, device), swap=swap)
                            out = gemm(x, mma[order], config=cfg)
                        err = rel_err(out, ref)
                        worst_mma = max(worst_mma, err)
                        if not err < (1e-4 if dt == torch.float32 else 2e-2):
                            raise AssertionError(f"w4a16 MMA order {order} swap {swap} K={K} N={N} M={m} {dt}: "
                                                 f"rel err {err}")
    return (f"max rel err {worst:.1e}; weights in the MMA order (orders {mma_orders}, operands as they are and "
            f"swapped) {worst_mma:.1e}")


def check_moe(device, gen, smoke) -> str:
    from clover_lite.kernels.int4_weights import Int4Weights
    from clover_lite.kernels.moe import fused_moe
    from clover_lite.models.moe import dispatch
    from clover_lite.quant.pack import dequantize

    E, k, H, inter = (8, 2, 64, 32) if smoke else (256, 8, 2048, 512)
    ws = {p: _int4(H if p != "down" else inter, inter if p != "down" else H, 32 if smoke else 128, device, gen,
                   stack=E) for p in ("gate", "up", "down")}
    dense = {p: torch.stack([dequantize(w["qweight"][e], w["qzeros"][e], w["scales"][e],
                                        torch.arange(w["qweight"].shape[1] * 8, device=device) // w["group_size"],
                                        dtype=torch.float32) for e in range(E)]) for p, w in ws.items()}
    def expert(e, h):
        act = torch.nn.functional.silu(h @ dense["gate"][e].t()) * (h @ dense["up"][e].t())
        return act @ dense["down"][e].t()

    from clover_lite.kernels import mma_layout

    order = mma_layout.kernel_order()
    mma = [Int4Weights(**ws[p]).in_mma_order(order) for p in ("gate", "up", "down")] if all(
        mma_layout.eligible(ws[p]["qweight"].shape[1] * 8, ws[p]["group_size"], None) for p in ws) else None

    worst = {}
    # bf16: the runtime's GPU dtype, whose tensor-core tiles take the weights as 16-bit planes of 128 + q
    cases = [(T, torch.float32) for T in ((3, 40) if smoke else (1, 32, 64, 512))]
    cases += [] if device.type == "cpu" else [(T, torch.bfloat16) for T in (1, 32, 512)]
    for T, dt in cases:
        x = torch.randn(T, H, generator=gen).to(device)
        logits = torch.randn(T, E, generator=gen).to(device)
        w, ids = torch.topk(torch.softmax(logits, -1), k)
        ref = dispatch(x.to(dt).float(), w.to(dt).float(), ids, E, expert)
        out = fused_moe(x.to(dt), w.to(dt), ids, *(Int4Weights(**ws[p]) for p in ("gate", "up", "down")))
        if mma:  # the same with the experts in the MMA order, as modules hold them
            err = rel_err(fused_moe(x.to(dt), w.to(dt), ids, *mma), ref)
            key = (dt, "MMA order")
            worst[key] = max(worst.get(key, 0.0), err)
            if not err < (1e-3 if dt == torch.float32 else 2e-2):
                raise AssertionError(f"fused MoE T={T} {dt} (MMA order): rel err {err}")
        err = rel_err(out, ref)
        key = (dt, None)
        worst[key] = max(worst.get(key, 0.0), err)
        if not err < (1e-3 if dt == torch.float32 else 2e-2):
            raise AssertionError(f"fused MoE T={T} {dt}: rel err {err}")
    return "max rel err " + ", ".join(f"{v:.1e} ({str(d).removeprefix('torch.')}{f', {p}' if p else ''})"
                                      for (d, p), v in worst.items())


def check_moe_route(device, gen, smoke) -> str:
    """Router top-k, the sort of the pairs by expert and the combine (moe_route.py) against torch."""
    from clover_lite.kernels.moe_route import combine, sort_pairs, sort_pairs_reference, topk_softmax

    E, k, H = (16, 2, 64) if smoke else (256, 8, 2048)
    worst_w = worst_c = 0.0
    ties = 0
    for T in (1, 5, 32, 64) if not smoke else (3, 9):
        dt = torch.float32 if device.type == "cpu" else torch.bfloat16
        logits = torch.randn(T, E, generator=gen).to(device, dt)
        w, ids = topk_softmax(logits, k, True, dt)
        ref_w, ref_ids = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), k)
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        same = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1)
        ties += int((~same).sum())  # a bf16 tie at the k-th place may be broken either way
        if same.any():
            worst_w = max(worst_w, (w[same].float() - ref_w[same]).abs().max().item())
        pairs, ref = sort_pairs(ids, w, E), sort_pairs_reference(ids, w, E)
        for f in ("expert", "token", "scale", "position", "rank", "count"):
            if not torch.equal(getattr(pairs, f), getattr(ref, f)):
                raise AssertionError(f"sort_pairs T={T}: {f} differs from torch's sort")
        y = torch.randn(3, T * k, H, generator=gen).to(device)
        out = combine(y, pairs.position, k, dt)
        want = y.sum(0)[pairs.position.long()].view(T, k, H).sum(1)
        worst_c = max(worst_c, rel_err(out, want))
    if not worst_w < 1e-2 or not worst_c < 1e-2:
        raise AssertionError(f"routing weights err {worst_w:.1e}, combine err {worst_c:.1e}")
    if ties > 1:
        raise AssertionError(f"{ties} tokens chose other experts than torch.topk")
    return f"weights {worst_w:.1e}, sort exact, combine {worst_c:.1e}, ties {ties}"


def check_model(device, gen, smoke) -> str:
    """A tiny quantized model generates the same greedy tokens with the kernels as with the reference."""
    import tempfile

    import clover_lite
    from clover_lite.checkpoint.tiny import write_tiny_checkpoint
    from clover_lite.quant.pipeline import QuantizeOptions, quantize_model

    with tempfile.TemporaryDirectory() as tmp:
        src = write_tiny_checkpoint(Path(tmp) / "src", seed=1)
        out = quantize_model(src, Path(tmp) / "q", QuantizeOptions(group_size=32, nsamples=4, seqlen=32)).out
        # The path is chosen at load: on CUDA load() captures the step's CUDA graph with it, so
        # switching kernels afterwards would leave generate() replaying the other path's graph.
        ref = clover_lite.load(out, device=device, dtype=torch.float32, kernels="torch")
        tri = clover_lite.load(out, device=device, dtype=torch.float32, kernels="triton", static_step=True,
                               context=64)
        ids = torch.randint(0, 256, (1, 40), generator=gen).to(device)
        with torch.no_grad():
            lr, lt = ref.model(ids, block_size=4).float(), tri.model(ids, block_size=4).float()
        err = rel_err(lt, lr)
        a = ref.generate([5, 6, 7, 8, 9], max_new_tokens=16).token_ids
        b = tri.generate([5, 6, 7, 8, 9], max_new_tokens=16).token_ids
        commit_err = _static_commit_error(tri, ids)
        step_err = _static_step_error(tri, ids)
        # The GDN kernel's products run in tf32 on a GPU (~5e-4): logits agree closely, greedy tokens may
        # part at a near-tie, so the logits decide and the tokens are reported.
        if not err < 5e-3:  # say where, so that one device call finds the kernel (call 3's failure did not)
            try:
                where = first_divergence(ref.model, tri.model, ids, block_size=4)
            except Exception as e:  # the report must not hide the failure it explains
                where = f"no report of where ({type(e).__name__}: {e})"
            raise AssertionError(f"logits differ from the reference: rel err {err:.1e}; {where}")
    if not commit_err < 1e-3:
        raise AssertionError(f"the captured commit's cache differs from the eager commit's: rel err {commit_err:.1e}")
    if not step_err < 1e-3:
        raise AssertionError(f"the captured step's logits differ from the eager step's: rel err {step_err:.1e}")
    same = sum(x == y for x, y in zip(a, b, strict=False))
    return (f"logits rel err {err:.1e}; greedy tokens {'identical' if a == b else f'{same}/{len(a)} equal'}; "
            f"static step {step_err:.1e}, commit {commit_err:.1e}{'' if tri._static.graph is None else ' (graphs)'}")


def first_divergence(ref, test, ids, threshold: float = 1e-3, **kw) -> str:
    """Both models run on ids with a hook on every module; the first module, in `test`'s order of execution,
    whose output differs from the same-named module's in `ref` by more than threshold (relative to its
    largest value), then the three largest differences. Modules the two paths do not both run (fused by
    the kernels' prepare) or whose outputs differ in shape are skipped."""
    outs: list[dict] = [{}, {}]
    order: list[str] = []

    def hook(i: int, name: str):
        def record(module, args, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(t, torch.Tensor) and t.is_floating_point() and name not in outs[i]:
                outs[i][name] = t.detach().float().cpu()  # the first call's output
                if i == 1:
                    order.append(name)
        return record

    handles = [module.register_forward_hook(hook(i, name))
               for i, model in enumerate((ref, test)) for name, module in model.named_modules() if name]
    try:
        with torch.no_grad():
            ref(ids, **kw)
            test(ids, **kw)
    finally:
        for h in handles:
            h.remove()
    errs = []
    for name in order:
        a, b = outs[0].get(name), outs[1][name]
        if a is not None and a.shape == b.shape:
            errs.append((name, rel_err(b, a)))
    first = next(((n, e) for n, e in errs if not e <= threshold), None)
    worst = ", ".join(f"{n} {e:.1e}" for n, e in sorted(errs, key=lambda x: -x[1])[:3])
    where = f"first module over {threshold:.0e}: {first[0]} ({first[1]:.1e})" if first else "no module over it"
    return f"{where}; largest: {worst} ({len(errs)} modules compared)"


def _prefill_both(model, caches, ids, block: int) -> None:
    """The static step's cache and the eager reference's, each emptied and then holding the same prefill."""
    for c in caches:
        c.reset()
        model.prefill(ids, c, block)


def _static_step_error(engine, ids) -> float:
    """The static step (its CUDA graph on a GPU, captured at an empty cache) against Denoiser.step at 0, 2 and
    all but one blocks of ids committed: the largest relative difference of the logits. A host value that a
    launch took at capture (a length, a bound) would show here as the replays' error."""
    static, model = engine._static, engine.model
    block = static.block_size
    theirs = model.new_cache(capacity=static.cache.capacity)
    worst = 0.0
    with torch.no_grad():
        for n in sorted({0, 2 * block, ids.shape[1] - block}):
            _prefill_both(model, (static.cache, theirs), ids[:, :n], block)
            ref, _ = model.step(ids[:, n:n + block], theirs)
            worst = max(worst, rel_err(static(ids[0, n:n + block].tolist()), ref))
    static.cache.reset()
    return worst


def _static_commit_error(engine, ids) -> float:
    """The static commit (its CUDA graph on a GPU) against Denoiser.commit after one prefilled block: the
    largest relative difference over the committed keys and values and the GDN states."""
    static, model = engine._static, engine.model
    block = static.block_size
    mine, theirs = static.cache, model.new_cache(capacity=static.cache.capacity)
    with torch.no_grad():
        _prefill_both(model, (mine, theirs), ids[:, :block], block)
        static.commit(ids[0, block:2 * block].tolist())
        model.commit(ids[:, block:2 * block], theirs, block)
    if mine.length != theirs.length:
        return float("inf")
    cfg, n = model.config, 2 * block
    pairs = [(store_a[i][:, :, :n], store_b[i][:, :, :n]) for i in cfg.attention_layers
             for store_a, store_b in ((mine.keys, theirs.keys), (mine.values, theirs.values))]
    pairs += [(x, y) for i in cfg.gdn_layers for x, y in zip(mine.gdn_state(i), theirs.gdn_state(i), strict=True)]
    return max(rel_err(x, y)
               for x, y in pairs)


def check_attention(device, gen, smoke) -> str:
    from clover_lite.kernels.attention import block_attention, block_attention_reference

    cases = [(2, 2, 64, 40, 4)] if smoke else [(16, 2, 256, n, L) for n in (0, 1, 1000, 8191, 32768) for L in (4, 32)]
    dtypes = [torch.float32] if device.type == "cpu" else [torch.float16, torch.bfloat16]
    worst = 0.0
    for hq, hkv, d, n, L in cases:
        for dt in dtypes:
            q = torch.randn(1, hq, L, d, generator=gen).to(device, dt)
            kc, vc = (torch.randn(1, hkv, n + 7, d, generator=gen).to(device, dt) for _ in range(2))
            kb, vb = (torch.randn(1, hkv, L, d, generator=gen).to(device, dt) for _ in range(2))
            gate = torch.randn(1, L, hq * d, generator=gen).to(device, dt)
            out = block_attention(q, kc, vc, kb, vb, n, gate=gate)
            ref = block_attention_reference(q, kc, vc, kb, vb, n, gate=gate)
            err = rel_err(out, ref)
            worst = max(worst, err)
            if not err < (1e-4 if dt == torch.float32 else 2e-2):
                raise AssertionError(f"attention cache {n} L {L} {dt}: rel err {err}")
    return f"max rel err {worst:.1e}"


def check_gdn(device, gen, smoke) -> str:
    from clover_lite.kernels.gdn import gdn_chunked
    from clover_lite.models.gdn import gated_delta_rule_recurrent

    b, hk, hv, dk = (1, 2, 4, 16) if smoke else (1, 16, 32, 128)
    worst = 0.0
    for L in ((4, 33) if smoke else (1, 32, 64, 300)):
        q, k = (torch.randn(b, L, hk, dk, generator=gen) for _ in range(2))
        v = torch.randn(b, L, hv, dk, generator=gen)
        g = -torch.rand(b, L, hv, generator=gen) * 2
        beta = torch.rand(b, L, hv, generator=gen)
        s0 = torch.randn(b, hv, dk, dk, generator=gen)
        s0_dev = s0.to(device)  # the copy the kernel gets must be the one checked for writes
        out, state = gdn_chunked(*(t.to(device) for t in (q, k, v, g, beta)), s0_dev, write_state=True)
        ro, rs = gated_delta_rule_recurrent(*(t.double() for t in (q, k, v, g, beta, s0)))
        err = max(rel_err(out, ro), rel_err(state, rs))
        worst = max(worst, err)
        if not err < (1e-4 if device.type == "cpu" else 2e-3) or not torch.equal(s0_dev.cpu(), s0):  # tf32 on a GPU
            raise AssertionError(f"GDN L={L}: rel err {err}")
    return f"max rel err {worst:.1e}"


def check_gdn_inputs(device, gen, smoke) -> str:
    """The GDN layer's input kernel (conv, SiLU, q/k norms, g, beta: gdn_prep.py) against the layer's torch
    path, at Clover's heads (16 k, 32 v heads of 128) in the runtime's dtype, step and commit."""
    from clover_lite.kernels.gdn_prep import gdn_prepare
    from clover_lite.models.gdn import causal_conv, l2_normalize

    hk, hv, d, kw = (2, 4, 16, 4) if smoke else (16, 32, 128, 4)
    dt = torch.float32 if device.type == "cpu" else torch.bfloat16
    C = 2 * hk * d + hv * d
    worst = 0.0
    for L in ((1, 5) if smoke else (1, 2, 32, 64)):
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
            err = rel_err(x, y)
            worst = max(worst, err)
            if not err < (1e-5 if dt == torch.float32 else 2e-2):
                raise AssertionError(f"GDN inputs L={L} {name}: rel err {err}")
        if not torch.equal(got[5], new_tail):
            raise AssertionError(f"GDN inputs L={L}: the conv tail differs")
    return f"max rel err {worst:.1e}, conv tail exact"


def check_sampling(device, gen, smoke) -> str:
    from clover_lite.kernels.sampling import choose_fused
    from clover_lite.runtime.sampling import choose

    V = 1000 if smoke else 248320
    logits = (torch.randn(32, V, generator=gen) * 4).to(device)
    for conf in ("prob", "margin", "entropy"):
        a, ca = choose(logits, confidence=conf, banned_token_id=5)
        b, cb = choose_fused(logits, confidence=conf, banned_token_id=5)
        if not torch.equal(a, b) or not torch.allclose(ca, cb, atol=1e-5, rtol=1e-4):
            raise AssertionError(f"sampling ({conf}) differs from the reference")
    g1 = torch.Generator(device=device).manual_seed(1)
    g2 = torch.Generator(device=device).manual_seed(1)
    if not torch.equal(choose_fused(logits, 1.0, generator=g1)[0], choose_fused(logits, 1.0, generator=g2)[0]):
        raise AssertionError("a seed does not reproduce the sampled tokens")
    return "greedy + confidences equal, seeded"


def check_norm(device, gen, smoke) -> str:
    from clover_lite.kernels import dispatch
    from clover_lite.models.layers import GatedRMSNorm, RMSNorm

    dtypes = [torch.float32] if device.type == "cpu" else [torch.bfloat16, torch.float16, torch.float32]
    worst = 0.0
    shapes = [(32, 2048, False), (32 * 16, 256, False), (32 * 32, 128, True), (7, 200, False)]
    shapes += [(40, 64, False), (40 * 4, 32, False), (40 * 4, 16, True)]  # the tiny model's (fp32 in check_model)
    if smoke:  # the widths, few rows (the interpreter runs a program per row)
        shapes = [(3, n, gated) for _, n, gated in shapes]
    for dt in dtypes:
        for rows, n, gated in shapes:
            mod = (GatedRMSNorm(n) if gated else RMSNorm(n)).to(device, dt)
            with torch.no_grad():
                mod.weight.copy_(torch.randn(n, generator=gen) * 0.5)
            x = (torch.randn(rows, 2 * n, generator=gen) * 3).to(device, dt)[:, :n]  # strided rows
            args = (x, torch.randn(rows, n, generator=gen).to(device, dt)) if gated else (x,)
            ref = mod(*args).float()
            dispatch.apply(mod, "triton")
            err = rel_err(mod(*args), ref)
            worst = max(worst, err)
            if not err < (1e-5 if dt == torch.float32 else 1e-2):
                raise AssertionError(f"RMSNorm rows {rows} n {n} gated {gated} {dt}: rel err {err}")
        worst = max(worst, _check_norm_rotary_residual(device, gen, dt, smoke))
    return f"max rel err {worst:.1e} (incl. RoPE and the residual add)"


def _check_norm_rotary_residual(device, gen, dt, smoke) -> float:
    """The attention's q/k norm with RoPE (Clover: 16 heads of 256, rotary 64) and the residual add with the
    post-attention norm (2048), against the modules' torch path."""
    from clover_lite.kernels.norm import rms_norm
    from clover_lite.models.layers import RMSNorm, RotaryEmbedding, apply_rotary

    heads, d, rd, hidden = (2, 32, 16, 64) if smoke else (16, 256, 64, 2048)
    worst = 0.0
    for L in (1, 5) if smoke else (1, 32):
        mod = RMSNorm(d).to(device, dt)
        with torch.no_grad():
            mod.weight.copy_(torch.randn(d, generator=gen) * 0.5)
        x = (torch.randn(1, L, heads, 2 * d, generator=gen) * 3).to(device, dt)[..., :d]
        cos, sin = RotaryEmbedding(rd, 1e7)(torch.arange(5000, 5000 + L, device=device))
        ref = apply_rotary(mod(x).transpose(1, 2), cos, sin).transpose(1, 2).float()
        out = rms_norm(x, mod.weight, mod.eps, True, rotary=(cos, sin)).float()
        norm = RMSNorm(hidden).to(device, dt)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(hidden, generator=gen) * 0.5)
        mixed, res = (torch.randn(L, hidden, generator=gen).to(device, dt) for _ in range(2))
        h, total = rms_norm(mixed, norm.weight, norm.eps, True, residual=res)
        if not torch.equal(total, res + mixed):
            raise AssertionError(f"residual add L={L} {dt}: the sum differs from torch's")
        errs = [rel_err(out, ref),
                ((h.float() - norm(res + mixed).float()).abs().max() / h.float().abs().max()).item()]
        worst = max(worst, *errs)
        if not max(errs) < (1e-5 if dt == torch.float32 else 1e-2):
            raise AssertionError(f"RMSNorm with RoPE / residual L={L} {dt}: rel err {errs}")
    return worst


def check_split_sum(device, gen, smoke) -> str:
    """Split-K partials summed by each tile's last split (int4_split_k.last_split_sums, an atomic counter per tile):
    equal to _sum_splits' separate launch, the same result on every one of many repeated launches (a missed
    ordering between the splits would show as a launch that read a partial before it was written), and every
    counter back at zero after them. GEMM and GEMV, fused gate/up too, the modules' MMA order."""
    from dataclasses import replace

    from clover_lite.kernels import configs, mma_layout
    from clover_lite.kernels.int4_gemm import gemm
    from clover_lite.kernels.int4_gemv import gemv
    from clover_lite.kernels.int4_launch import device_arch, gemm_config_for
    from clover_lite.kernels.int4_weights import Int4Weights

    arch = device_arch(device)
    shapes = [(128, 40, 32)] if smoke else [(2048, 8192, 128), (4096, 2048, 128), (2048, 512, 128)]
    dt = torch.float32 if device.type == "cpu" else torch.bfloat16
    repeats = 2 if smoke else 40
    launches, differ, worst = 0, 0, 0.0
    for K, N, G in shapes:
        ws = [Int4Weights(**_int4(K, N, G, device, gen)) for _ in range(2)]
        if mma_layout.eligible(K, G, None):
            ws = [w.in_mma_order(mma_layout.kernel_order()) for w in ws]
        # Each (kernel, fused) pair compiles twice (in the kernel or not): seconds of device time each, so
        # three; smoke: a fused GEMV and a fused GEMM
        runs = ((1, False, 4), (33, True, 2), (16, False, 8)) if not smoke else ((3, True, 8), (33, True, 2))
        for m, fused, split in runs:
            x = torch.randn(m, K, generator=gen).to(device, dt)
            w2 = ws[1] if fused else None
            if m <= 4:
                cfg = replace(configs.INTERPRET_GEMV if arch is None else configs.gemv_config(arch), split_k=split)
                run = lambda c, x=x, w=ws[0], w2=w2: gemv(x, w, w2, config=c)  # noqa: E731
            else:
                cfg = replace(gemm_config_for(device, m), split_k=split)
                run = lambda c, x=x, w=ws[0], w2=w2: gemm(x, w, w2, config=c)  # noqa: E731
            separate = run(replace(cfg, sum_in_kernel=False)).float()
            first = run(cfg)
            err = rel_err(first, separate)
            worst = max(worst, err)
            differ += not torch.equal(first.float(), separate)
            if not err < 1e-3:
                raise AssertionError(f"split sum K={K} N={N} M={m} fused={fused} split={split}: rel err {err} "
                                     "against the separate sum")
            for _ in range(repeats):
                if not torch.equal(run(cfg), first):
                    raise AssertionError(f"split sum K={K} N={N} M={m} fused={fused} split={split}: a repeated "
                                         "launch gave another result (the splits' ordering failed)")
            launches += repeats + 1
            if ws[0]._tile_done is not None and bool(ws[0]._tile_done.any()):
                raise AssertionError("a tile's split counter was left non-zero after its launch")
            if device.type == "cuda" and m > 4:  # weights first used inside a graph's capture (their counters
                # made there: a captured memset), replayed, then called eagerly
                fresh = Int4Weights(ws[0].qweight, ws[0].scales, ws[0].qzeros, G, mma_order=ws[0].mma_order)
                graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.graph(graph, stream=stream):
                    captured = gemm(x, fresh, ws[1] if fused else None, config=cfg)
                graph.replay()
                torch.cuda.synchronize()
                eager = gemm(x, fresh, ws[1] if fused else None, config=cfg)
                if not (torch.equal(captured, first) and torch.equal(eager, first)):
                    raise AssertionError(f"split sum M={m} fused={fused}: weights first used in a graph's capture "
                                         "gave another result (replayed, or eager after it)")
    return f"{launches} launches, all repeatable; max rel err {worst:.1e} vs the separate sum ({differ} not bitwise)"


CHECKS = [("w4a16 matmul", check_w4a16), ("split-K sum in the kernel", check_split_sum),
          ("fused INT4 MoE", check_moe), ("MoE routing", check_moe_route),
          ("block attention", check_attention), ("GDN block kernel", check_gdn), ("GDN inputs", check_gdn_inputs),
          ("masked-position sampling", check_sampling), ("RMSNorm", check_norm),
          ("tiny model, kernels vs torch", check_model)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU with TRITON_INTERPRET=1)")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--checks", nargs="+", help="run only the checks whose names contain these words")
    ap.add_argument("--no-poison", action="store_true",
                    help="run the checks on torch.empty's memory as it comes, not poisoned (tests/poison_empty.py)")
    ap.add_argument("--time-limit", type=int, default=540,
                    help="seconds for the whole run; the benchmarks share what the checks leave")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    smoke = args.smoke or device.type == "cpu"
    gen = torch.Generator().manual_seed(int(time.time()))  # fresh inputs every run
    t0 = time.time()
    results = []
    # The checks run the tuning table's configs as they stand, even where CLOVER_AUTOTUNE=1 is set:
    # autotuning (dozens of candidate compiles per shape) would spend minutes of device time checking nothing.
    autotune = os.environ.get("CLOVER_AUTOTUNE")
    os.environ["CLOVER_AUTOTUNE"] = "0"
    # Uninitialized memory is NaN (or an out-of-range index) during the checks, as in every test: a kernel
    # that reads an element nobody wrote, in a path only a GPU runs (CUDA graphs, the tables' tiles), then
    # fails with NaN where the caching allocator would have handed it a previous tensor's plausible values.
    poison = contextlib.nullcontext()
    if not args.no_poison:
        try:
            poison = runpy.run_path(str(HERE.parent / "tests" / "poison_empty.py"))["poisoned_empty"]()
        except Exception as e:  # a check of the checks must not cost the session its device call
            print(f"uninitialized memory not poisoned: {type(e).__name__}: {e}", flush=True)
            args.no_poison = True
    with poison:
        for name, fn in CHECKS:
            if args.checks and not any(w in name for w in args.checks):
                continue
            t = time.time()
            try:
                results.append((name, "ok", fn(device, gen, smoke), time.time() - t))
            except Exception as e:  # report every check, then fail
                traceback.print_exc()
                results.append((name, "FAIL", str(e)[:100], time.time() - t))
    if autotune is None:
        os.environ.pop("CLOVER_AUTOTUNE")
    else:
        os.environ["CLOVER_AUTOTUNE"] = autotune
    benches = []
    if not args.no_bench:
        out = HERE / "out"
        out.mkdir(exist_ok=True)
        # The kernel table (issue 4's goals) first, with at most 60% of the time left; the step gets the rest.
        # Output streams straight through, so a benchmark stopped at its limit still leaves what it printed.
        runs = [("kernels", [str(HERE / "kernels.py")] + (["--smoke"] if smoke else []), 0.6),
                ("step", [str(HERE / "step.py"), "--json", str(out / "step.json"), "--profile", "25", "--memory"]
                 + (["--contexts", "32", "--reps", "2"] if smoke else []), 1.0)]
        for name, cmd, share in runs:
            left = args.time_limit - 10 - (time.time() - t0)  # 10 s kept for the table
            limit = int(left * share)
            if limit < 20:
                benches.append((name, "skipped: no time left"))
                continue
            print(f"\n== {name} benchmark (limit {limit} s) ==", flush=True)
            try:
                r = subprocess.run([sys.executable, *cmd], timeout=limit)
                benches.append((name, "ok" if r.returncode == 0 else f"exit {r.returncode}"))
            except subprocess.TimeoutExpired:
                benches.append((name, f"stopped at its limit, {limit} s"))
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"\n== gpu_check on {card}, {time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s"
          f"{', torch.empty as it comes' if args.no_poison else ', uninitialized memory poisoned'} ==")
    for name, status, detail, secs in results:
        print(f"{status:>4}  {name:<32} {detail:<40} {secs:6.1f} s")
    for name, status in benches or [("benchmarks", "skipped")]:
        print(f"{'':>4}  {name + ' benchmark':<32} {status} (benchmarks/out/)")
    kernels_json = HERE / "out" / "kernels.json"
    if benches and kernels_json.exists() and kernels_json.stat().st_mtime >= t0:  # this run's, not an old one
        goals = json.loads(kernels_json.read_text()).get("goals")
        if goals:
            runpy.run_path(str(HERE / "kernels.py"), run_name="goals")["print_goals"](goals)
    return 0 if all(s == "ok" for _, s, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
