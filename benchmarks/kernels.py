"""INT4 kernels against the hardware limit and the alternatives, side by side in one run.

For the Clover-35B-A3B shapes and M in 1, 4, 16, 32, 64: our W4A16 kernel, torch's 16-bit matmul (bf16,
the runtime's GPU dtype; --dtype fp16 for both) and bitsandbytes NF4 on the same inputs; time, bytes moved,
GB/s against the measured device copy bandwidth, TFLOP/s, and the ratios. Then the fused MoE on a block of M
tokens routed top-8 over 256 experts, against the floor set by reading the experts the block touches.

Two rules keep the numbers honest (the device notes' method): the calls rotate over enough copies of the
weights (or, for the MoE, routings) that one pass reads 4x the L2 cache, so each call reads its weights from
memory, not the cache; and each is timed twice: "eager", one call between events, launch and Python
overhead included as an eager step pays them, and "graph", every call of one pass captured in a CUDA graph
and replayed, the kernel time alone as the captured denoising step pays it. Bandwidth, TFLOP/s and the
ratio against 16-bit matmul come from graph times. NF4 (bitsandbytes) is timed both ways too; "x nf4" is
graph against graph where its calls could be captured, else eager against eager. "x tile" (M > 4): the
GEMM with its weight tile unpacked to [BK, BN] (an int-to-float conversion and a shared-memory store per
weight) over the nibble planes, both at the tuning table's config (the int4 column too, unless
CLOVER_AUTOTUNE=1). "x mma": the weights as the modules hold them on a GPU, rearranged in the MMA order
(kernels/mma_layout.py), against the checkpoint's GPTQ order of the int4 column (graph times; the MoE row
times both the same way).

Last, issue 4's goals, judged on the path the runtime takes (the MMA order wherever the groups allow it,
as kernels/forwards.py prepares them): >= 80% of copy bandwidth and >= 3.5x over 16-bit at M <= 16 on the large
shapes (8M weights or more), faster than NF4 at every M. They are saved under "goals" in the JSON.

    python benchmarks/kernels.py                         # on a GPU: full table, JSON and PNG in benchmarks/out
    python benchmarks/kernels.py --smoke                 # tiny shapes; runs anywhere (CPU: Triton interpreter)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# Run as a script, this folder comes first on sys.path, where bitsandbytes' optional `import kernels` (the
# Hugging Face kernels package) would find benchmarks/kernels.py instead: take the folder off.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

# Clover-35B-A3B (Qwen3.5-35B-A3B text backbone, shared DESIGN.md section 1): (name, K, N).
CLOVER_SHAPES = [
    ("expert gate/up", 2048, 512),  # x2: gate and up are both read (fused in the MoE kernel)
    ("expert down", 512, 2048),
    ("attn q+gate", 2048, 8192),
    ("attn k/v", 2048, 512),
    ("attn o", 4096, 2048),
    ("gdn qkv", 2048, 8192),
    ("gdn z", 2048, 4096),
    ("gdn out", 4096, 2048),
    ("shared down", 512, 2048),
    ("lm_head", 2048, 248320),
]
SMOKE_SHAPES = [("tiny", 128, 48)]  # K in a block of 128: the MMA order's too
MS = (1, 4, 16, 32, 64)
LARGE_WEIGHTS = 2048 * 4096  # the goals' "large shapes": 4 MB of INT4 or more, 1 us or more at 4 TB/s
GOAL_BANDWIDTH, GOAL_VS_16BIT, GOAL_MAX_M = 0.8, 3.5, 16


def timer(fn, device: torch.device, reps: int) -> float:
    """Median seconds of fn() over reps runs after warm-up (CUDA events on a GPU; on the CPU, where the
    interpreter's times mean nothing, no warm-up)."""
    for _ in range(max(2, reps // 10) if device.type == "cuda" else 0):
        fn()
    times = []
    if device.type == "cuda":
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (read + write counted), the practical ceiling."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    t = timer(lambda: b.copy_(a), device, 20)
    return 2 * n / t


def l2_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20)
    return 1 << 16  # CPU smoke run: tiny, so that the rotation path runs too


def n_copies(bytes_per_call: int, device: torch.device, cap: int = 512) -> int:
    """Weight sets to rotate over so that one pass reads 4x the L2: then no call finds its weights cached."""
    return max(1, min(cap, math.ceil(4 * l2_bytes(device) / max(1, bytes_per_call))))


def graph_time(calls: list, device: torch.device, reps: int) -> float | None:
    """Seconds per call with every call of `calls` captured in one CUDA graph and the graph replayed (the
    calls are warmed up first: compilation and autotuning stay outside). None off CUDA or if the calls
    cannot be captured (the reason goes to stderr)."""
    if device.type != "cuda":
        return None
    calls = calls * math.ceil(8 / len(calls))  # at least 8 calls a replay: the replay's own launch is amortised
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        t = timer(graph.replay, device, max(5, reps // 5)) / len(calls)
        del graph
        return t
    except Exception as e:  # report and fall back to the eager time
        print(f"graph capture failed ({type(e).__name__}: {e}); eager time used", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def time_calls(calls: list, device: torch.device, reps: int, graph: bool = True) -> tuple[float, float | None]:
    """(eager, graph) median seconds per call, rotating over `calls` (one per weight copy)."""
    turn = itertools.cycle(calls)
    eager = timer(lambda: next(turn)(), device, reps)
    return eager, graph_time(calls, device, reps) if graph else None


def kernel_time(eager_and_graph: tuple[float, float | None]) -> float:
    """The graph time where there is one (the kernels alone), else the eager time."""
    eager, graph = eager_and_graph
    return graph or eager


def random_int4(K: int, N: int, group: int, device, stack: int | None = None):
    lead = () if stack is None else (stack,)
    G = K // group
    return dict(
        qweight=torch.randint(-(2**31), 2**31 - 1, (*lead, K // 8, N), dtype=torch.int32, device=device),
        scales=(torch.rand(*lead, G, N, device=device) * 0.01).half(),
        qzeros=torch.full((*lead, G, N // 8), 0x77777777, dtype=torch.int32, device=device),
        group_size=group,
    )


def int4_bytes(K: int, N: int, group: int) -> int:
    return K * N // 2 + (K // group) * N * 2 + (K // group) * (N // 8) * 4


def mma_weights(w: dict):
    """Int4Weights of random_int4's tensors rearranged in the MMA order this Triton's dot takes (a copy)."""
    from clover_lite.kernels import mma_layout
    from clover_lite.kernels.int4_weights import Int4Weights

    return Int4Weights(**w).in_mma_order(mma_layout.kernel_order())


def bench_dense(shapes, ms, device, dtype, group, reps, bw, with_nf4: bool, on_row) -> None:
    from clover_lite.kernels import mma_layout
    from clover_lite.kernels.int4_gemm import gemm
    from clover_lite.kernels.int4_gemv import gemv
    from clover_lite.kernels.int4_launch import fill_split, gemm_config_for
    from clover_lite.kernels.int4_weights import Int4Weights
    from clover_lite.kernels.w4a16 import w4a16_matmul

    bnb = None
    if with_nf4:
        try:
            import bitsandbytes as bnb
            import bitsandbytes.functional as bnbf
        except ImportError:
            print("bitsandbytes not installed: no NF4 column", file=sys.stderr)
    for name, K, N in shapes:
        w4s = [random_int4(K, N, group, device) for _ in range(n_copies(int4_bytes(K, N, group), device))]
        w16s = [torch.randn(N, K, device=device, dtype=dtype) * 0.02
                for _ in range(n_copies(K * N * torch.finfo(dtype).bits // 8, device))]
        nf4s = ([bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4") for w in w16s]
                if bnb is not None else None)
        # The modules' own path: the MMA order where the groups allow it (kernels/forwards.py prepare_linear's rule).
        mmas = [mma_weights(w) for w in w4s] if mma_layout.eligible(K, group, None) else None
        for m in ms:
            x = torch.randn(m, K, device=device, dtype=dtype)
            e4, g4 = time_calls([lambda w=w, x=x: w4a16_matmul(x, **w) for w in w4s], device, reps)
            run = gemv if m <= 4 else gemm  # as w4a16_matmul chooses
            mma = (kernel_time(time_calls([lambda w=w, x=x, run=run: run(x, w) for w in mmas], device, reps))
                   if mmas else None)
            unpacked = planes = None  # the GEMM's former [BK, BN] weight tile against its nibble planes (M > 4),
            if m > 4:  # both at the table's config (no autotuning): the same tiles, only the path differs
                ws = [Int4Weights(**w) for w in w4s]
                cfg = fill_split(gemm_config_for(device, m), m, N, device)
                unpacked, planes = (
                    kernel_time(time_calls([lambda w=w, x=x, c=cfg, p=p: gemm(x, w, config=c, planes=p) for w in ws],
                                        device, reps))
                    for p in (False, True))
            e16, g16 = time_calls([lambda w=w, x=x: x @ w.t() for w in w16s], device, reps)
            enf4 = gnf4 = None
            if nf4s is not None:  # captured where bitsandbytes allows it (graph_time falls back to None)
                enf4, gnf4 = time_calls([lambda p=p, s=s, x=x: bnb.matmul_4bit(x, p.t(), quant_state=s)
                                         for p, s in nf4s], device, reps)
            t4, t16 = g4 or e4, g16 or e16
            act = (m * K + m * N) * x.element_size()
            b4 = int4_bytes(K, N, group) + act
            rt = mma or t4  # what the runtime's modules run
            # Kernel against kernel where both were captured; otherwise both eager (launch costs included).
            vs_nf4 = (gnf4 / rt if gnf4 and g4 else enf4 / e4) if enf4 else None
            on_row({
                "shape": name, "K": K, "N": N, "M": m, "timing": "graph" if g4 else "eager",
                "weight_copies": len(w4s), "int4_s": t4, "int4_eager_s": e4, "16bit_s": t16, "16bit_eager_s": e16,
                "nf4_eager_s": enf4, "nf4_graph_s": gnf4,
                "int4_GBps": b4 / t4 / 1e9, "int4_of_copy_bw": b4 / t4 / bw,
                "16bit_GBps": (K * N * x.element_size() + act) / t16 / 1e9,
                "int4_TFLOPs": 2 * m * K * N / t4 / 1e12,
                "speedup_vs_16bit": t16 / t4, "speedup_vs_nf4_eager": (enf4 / e4) if enf4 else None,
                "unpacked_tile_s": unpacked, "planes_tile_s": planes,
                "speedup_vs_unpacked_tile": (unpacked / planes) if unpacked else None,
                "mma_s": mma, "speedup_mma_vs_gptq": (t4 / mma) if mma else None,
                "runtime_path": "mma" if mma else "gptq", "runtime_s": rt, "runtime_of_copy_bw": b4 / rt / bw,
                "runtime_vs_16bit": t16 / rt, "runtime_vs_nf4": vs_nf4,
                "nf4_timing": None if not enf4 else "graph" if gnf4 and g4 else "eager",
            })
        del w4s, w16s, nf4s, mmas


def bench_moe(ms, device, dtype, group, reps, bw, on_row, hidden, inter, experts, top_k) -> None:
    from clover_lite.kernels.int4_weights import Int4Weights
    from clover_lite.kernels.moe import fused_moe

    parts = [random_int4(k, n, group, device, experts) for k, n in ((hidden, inter), (hidden, inter), (inter, hidden))]
    gate, up, down = (Int4Weights(**p) for p in parts)
    mmas = [mma_weights(p) for p in parts]
    del parts
    per_expert = 2 * int4_bytes(hidden, inter, group) + int4_bytes(inter, hidden, group)
    for m in ms:
        x = torch.randn(m, hidden, device=device, dtype=dtype)
        touched_per_call = experts * (1 - (1 - top_k / experts) ** m)
        routings = []
        for _ in range(n_copies(int(touched_per_call * per_expert), device, cap=64)):  # fresh experts each call
            w, ids = torch.topk(torch.softmax(torch.randn(m, experts, device=device), -1), top_k)
            routings.append((w.to(dtype), ids))
        touched = statistics.mean(int(torch.unique(ids).numel()) for _, ids in routings)
        # validate=False: no host-side check of the ids, so the call never waits for the GPU and can be captured
        calls = [lambda w=w, ids=ids, x=x: fused_moe(x, w, ids, gate, up, down, validate=False)
                 for w, ids in routings]
        e, g = time_calls(calls, device, reps)
        t = g or e
        mma = kernel_time(time_calls([lambda w=w, ids=ids, x=x: fused_moe(x, w, ids, *mmas, validate=False)
                                      for w, ids in routings], device, reps))
        b = touched * per_expert
        on_row({"M": m, "experts_touched": touched, "expected_touched": touched_per_call,
                     "routings": len(routings), "timing": "graph" if g else "eager", "moe_s": t, "moe_eager_s": e,
                     "GBps": b / t / 1e9, "of_copy_bw": b / t / bw, "floor_s": b / bw,
                     "mma_s": mma, "speedup_mma_vs_gptq": t / mma})


def _ratio(v: float | None) -> str:
    return f"{v:.2f}" if v else "-"


def print_dense_row(r: dict) -> None:
    nf4 = _ratio(r["runtime_vs_nf4"]) + ("e" if r["nf4_timing"] == "eager" else "")
    print(f"{r['shape']:>15} {r['M']:>3} {r['int4_s'] * 1e6:>9.1f} {r['int4_eager_s'] * 1e6:>9.1f} "
          f"{r['int4_GBps']:>7.0f} {r['int4_of_copy_bw'] * 100:>5.0f} {r['int4_TFLOPs']:>8.2f} "
          f"{r['speedup_vs_16bit']:>7.2f} {_ratio(r['speedup_vs_unpacked_tile']):>6} "
          f"{_ratio(r['speedup_mma_vs_gptq']):>6} {r['runtime_s'] * 1e6:>7.1f} {r['runtime_of_copy_bw'] * 100:>4.0f} "
          f"{r['runtime_vs_16bit']:>7.2f} {nf4:>7}", flush=True)


def goals(dense: list[dict]) -> dict:
    """Issue 4's three goals, judged on the runtime's path (rows' runtime_* fields): each with the worst
    row, its value, and whether it is met (None where no row applies, e.g. a smoke run or no NF4 column)."""
    def worst(rows: list[dict], key: str, target: float) -> dict:
        if not rows:
            return {"met": None, "target": target, "worst": None, "rows": 0}
        r = min(rows, key=lambda r: r[key])
        return {"met": r[key] >= target, "target": target, "rows": len(rows), "worst_value": r[key],
                "worst": f"{r['shape']} M={r['M']}", "below": sum(x[key] < target for x in rows)}

    small_m = [r for r in dense if r["M"] <= GOAL_MAX_M and r["K"] * r["N"] >= LARGE_WEIGHTS]
    return {
        "copy_bandwidth_at_small_m": worst(small_m, "runtime_of_copy_bw", GOAL_BANDWIDTH),
        "vs_16bit_at_small_m": worst(small_m, "runtime_vs_16bit", GOAL_VS_16BIT),
        "vs_nf4_every_m": worst([r for r in dense if r["runtime_vs_nf4"]], "runtime_vs_nf4", 1.0),
    }


def print_goals(g: dict) -> None:
    names = {"copy_bandwidth_at_small_m": f">= {GOAL_BANDWIDTH:.0%} of copy bandwidth, M <= {GOAL_MAX_M}, large shapes",
             "vs_16bit_at_small_m": f">= {GOAL_VS_16BIT}x over 16-bit matmul, M <= {GOAL_MAX_M}, large shapes",
             "vs_nf4_every_m": "faster than NF4 at every shape and M"}
    print("issue 4's goals, on the runtime's path:")
    for key, text in names.items():
        r = g[key]
        if r["met"] is None:
            print(f"  {text}: no row measures it")
            continue
        worst = f"{r['worst_value']:.0%}" if key.startswith("copy") else f"{r['worst_value']:.2f}x"
        print(f"  {text}: {'met' if r['met'] else 'NOT met'} ({r['below']} of {r['rows']} rows below; "
              f"worst {worst}, {r['worst']})")


def print_moe_row(r: dict) -> None:
    print(f"{r['M']:>6} {r['experts_touched']:>8.1f} {r['moe_s'] * 1e6:>9.1f} {r['moe_eager_s'] * 1e6:>9.1f} "
          f"{r['GBps']:>7.0f} {r['of_copy_bw'] * 100:>5.0f} {r['floor_s'] * 1e6:>9.1f} "
          f"{r['speedup_mma_vs_gptq']:>6.2f}", flush=True)


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in dict.fromkeys(r["shape"] for r in rows):
        pts = [r for r in rows if r["shape"] == name]
        ax.plot([r["M"] for r in pts], [r["runtime_of_copy_bw"] * 100 for r in pts], marker="o", label=name)
    ax.axhline(GOAL_BANDWIDTH * 100, color="grey", linestyle="--", linewidth=1, label="goal at M <= 16")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (rows)")
    ax.set_ylabel("% of measured copy bandwidth")
    ax.set_title("W4A16 as the runtime runs it (MMA-order weights): achieved bandwidth vs M")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few repetitions (CI, CPU)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                    help="activations, and the 16-bit matmul compared against (the runtime runs bf16 on a GPU)")
    ap.add_argument("--no-nf4", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out"))
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no GPU: rerun with TRITON_INTERPRET=1 --smoke to exercise the kernels on the CPU", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype] if device.type == "cuda" else torch.float32
    smoke = args.smoke or device.type == "cpu"
    shapes, ms = (SMOKE_SHAPES, (1, 16)) if smoke else (CLOVER_SHAPES, MS)
    group = 128 if smoke else args.group_size
    reps = 1 if device.type == "cpu" else 3 if smoke else args.reps  # CPU: each kernel runs, its time means nothing
    bw = copy_bandwidth(device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"{card}: copy bandwidth {bw / 1e9:.0f} GB/s, L2 {l2_bytes(device) / 2**20:.1f} MiB, {dtype}, "
          f"group {group}; us: {'graph' if device.type == 'cuda' else 'eager'} time per call, weights rotated")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"card": card, "copy_GBps": bw / 1e9, "dtype": str(dtype), "group": group, "dense": [], "moe": [],
              "date": time.strftime("%Y-%m-%d")}

    def save() -> None:
        tmp = out / "kernels.json.tmp"  # replaced whole, so a kill mid-write never truncates the last save
        tmp.write_text(json.dumps(result, indent=2))
        os.replace(tmp, out / "kernels.json")

    def recorder(kind: str, show):
        def on_row(row: dict) -> None:  # printed and saved as measured: a run stopped early keeps its rows
            result[kind].append(row)
            show(row)
            save()
        return on_row

    # int4 ... x mma: w4a16_matmul on the checkpoint's tensors (GPTQ order); run us ... x nf4: the runtime's
    # path ("e" after x nf4: eager against eager, bitsandbytes' calls could not be captured).
    print(f"{'shape':>15} {'M':>3} {'int4 us':>9} {'eager us':>9} {'GB/s':>7} {'%bw':>5} {'TFLOP/s':>8} "
          f"{'x 16bit':>7} {'x tile':>6} {'x mma':>6} {'run us':>7} {'%bw':>4} {'x 16bit':>7} {'x nf4':>7}",
          flush=True)
    bench_dense(shapes, ms, device, dtype, group, reps, bw, not args.no_nf4 and not smoke,
                recorder("dense", print_dense_row))
    dense = result["dense"]
    result["goals"] = goals(dense)  # from the dense table alone: saved before the MoE rows, which may time out
    save()
    print_goals(result["goals"])
    print(f"{'MoE M':>6} {'touched':>8} {'us':>9} {'eager us':>9} {'GB/s':>7} {'%bw':>5} {'floor us':>9} {'x mma':>6}")
    moe_kw = dict(hidden=128, inter=128, experts=8, top_k=2) if smoke else dict(hidden=2048, inter=512, experts=256,
                                                                             top_k=8)
    bench_moe((4,) if smoke else (1, 16, 32, 64), device, dtype, group, reps, bw, recorder("moe", print_moe_row),
              **moe_kw)
    if not smoke:
        plot(dense, out / "kernels.png")
    bad = [r for r in dense if not math.isfinite(r["int4_s"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
