"""INT4 kernels against the hardware limit and the alternatives, side by side in one run.

For the Clover-35B-A3B shapes and M in 1, 4, 16, 32, 64: our W4A16 kernel, torch's 16-bit matmul and
bitsandbytes NF4 on the same inputs; time, bytes moved, GB/s against the measured device copy bandwidth,
TFLOP/s, and the ratios. Then the fused MoE on a block of M tokens routed top-8 over 256 experts, against
the floor set by reading the experts the block touches.

    python benchmarks/kernels.py                         # on a GPU: full table, JSON and PNG in benchmarks/out
    python benchmarks/kernels.py --smoke                 # tiny shapes; runs anywhere (CPU: Triton interpreter)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

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
SMOKE_SHAPES = [("tiny a", 64, 48), ("tiny b", 128, 64)]
MS = (1, 4, 16, 32, 64)


def timer(fn, device: torch.device, reps: int) -> float:
    """Median seconds of fn() over reps runs after warm-up (CUDA events on a GPU)."""
    for _ in range(max(2, reps // 10)):
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


def bench_dense(shapes, ms, device, dtype, group, reps, bw, with_nf4: bool) -> list[dict]:
    from clover_lite.kernels.w4a16 import w4a16_matmul

    bnb = None
    if with_nf4:
        try:
            import bitsandbytes as bnb
            import bitsandbytes.functional as bnbf
        except ImportError:
            print("bitsandbytes not installed: no NF4 column", file=sys.stderr)
    rows = []
    for name, K, N in shapes:
        w4 = random_int4(K, N, group, device)
        w16 = torch.randn(N, K, device=device, dtype=dtype) * 0.02
        nf4 = bnbf.quantize_4bit(w16, blocksize=64, quant_type="nf4") if bnb is not None else None
        for m in ms:
            x = torch.randn(m, K, device=device, dtype=dtype)
            t4 = timer(lambda x=x, w4=w4: w4a16_matmul(x, **w4), device, reps)
            t16 = timer(lambda x=x, w16=w16: x @ w16.t(), device, reps)
            tnf4 = None
            if nf4 is not None:
                packed, state = nf4
                tnf4 = timer(lambda x=x, p=packed, s=state: bnb.matmul_4bit(x, p.t(), quant_state=s), device, reps)
            act = (m * K + m * N) * x.element_size()
            b4 = int4_bytes(K, N, group) + act
            rows.append({
                "shape": name, "K": K, "N": N, "M": m, "int4_s": t4, "bf16_s": t16, "nf4_s": tnf4,
                "int4_GBps": b4 / t4 / 1e9, "int4_of_copy_bw": b4 / t4 / bw,
                "bf16_GBps": (K * N * x.element_size() + act) / t16 / 1e9,
                "int4_TFLOPs": 2 * m * K * N / t4 / 1e12,
                "speedup_vs_bf16": t16 / t4, "speedup_vs_nf4": (tnf4 / t4) if tnf4 else None,
            })
    return rows


def bench_moe(ms, device, dtype, group, reps, bw, hidden, inter, experts, top_k) -> list[dict]:
    from clover_lite.kernels.moe import fused_moe
    from clover_lite.kernels.w4a16 import Int4Weights

    gate = Int4Weights(**random_int4(hidden, inter, group, device, experts))
    up = Int4Weights(**random_int4(hidden, inter, group, device, experts))
    down = Int4Weights(**random_int4(inter, hidden, group, device, experts))
    rows = []
    for m in ms:
        x = torch.randn(m, hidden, device=device, dtype=dtype)
        logits = torch.randn(m, experts, device=device)
        w, ids = torch.topk(torch.softmax(logits, -1), top_k)
        touched = int(torch.unique(ids).numel())
        t = timer(lambda x=x, w=w, ids=ids: fused_moe(x, w.to(dtype), ids, gate, up, down), device, reps)
        b = touched * (2 * int4_bytes(hidden, inter, group) + int4_bytes(inter, hidden, group))
        rows.append({"M": m, "experts_touched": touched, "expected_touched": experts * (1 - (1 - top_k / experts) ** m),
                     "moe_s": t, "GBps": b / t / 1e9, "of_copy_bw": b / t / bw, "floor_s": b / bw})
    return rows


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
        ax.plot([r["M"] for r in pts], [r["int4_of_copy_bw"] * 100 for r in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (rows)")
    ax.set_ylabel("% of measured copy bandwidth")
    ax.set_title("W4A16: achieved bandwidth vs M")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few repetitions (CI, CPU)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-nf4", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out"))
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no GPU: rerun with TRITON_INTERPRET=1 --smoke to exercise the kernels on the CPU", file=sys.stderr)
        return 2
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    smoke = args.smoke or device.type == "cpu"
    shapes, ms = (SMOKE_SHAPES, (1, 16)) if smoke else (CLOVER_SHAPES, MS)
    group = 32 if smoke else args.group_size
    reps = 3 if smoke else args.reps
    bw = copy_bandwidth(device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    dense = bench_dense(shapes, ms, device, dtype, group, reps, bw, with_nf4=not args.no_nf4 and not smoke)
    moe_kw = dict(hidden=64, inter=32, experts=16, top_k=2) if smoke else dict(hidden=2048, inter=512, experts=256,
                                                                             top_k=8)
    moe = bench_moe((4,) if smoke else (1, 16, 32, 64), device, dtype, group, reps, bw, **moe_kw)

    print(f"{card}: copy bandwidth {bw / 1e9:.0f} GB/s, {dtype}, group {group}")
    print(f"{'shape':>15} {'M':>3} {'int4 us':>9} {'GB/s':>7} {'%bw':>5} {'TFLOP/s':>8} {'x bf16':>7} {'x nf4':>6}")
    for r in dense:
        nf4 = f"{r['speedup_vs_nf4']:.2f}" if r["speedup_vs_nf4"] else "-"
        print(f"{r['shape']:>15} {r['M']:>3} {r['int4_s'] * 1e6:>9.1f} {r['int4_GBps']:>7.0f} "
              f"{r['int4_of_copy_bw'] * 100:>5.0f} {r['int4_TFLOPs']:>8.2f} {r['speedup_vs_bf16']:>7.2f} {nf4:>6}")
    print(f"{'MoE M':>6} {'touched':>8} {'us':>9} {'GB/s':>7} {'%bw':>5} {'floor us':>9}")
    for r in moe:
        print(f"{r['M']:>6} {r['experts_touched']:>8} {r['moe_s'] * 1e6:>9.1f} {r['GBps']:>7.0f} "
              f"{r['of_copy_bw'] * 100:>5.0f} {r['floor_s'] * 1e6:>9.1f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"card": card, "copy_GBps": bw / 1e9, "dtype": str(dtype), "group": group, "dense": dense, "moe": moe,
              "date": time.strftime("%Y-%m-%d")}
    (out / "kernels.json").write_text(json.dumps(result, indent=2))
    if not smoke:
        plot(dense, out / "kernels.png")
    bad = [r for r in dense if not math.isfinite(r["int4_s"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
