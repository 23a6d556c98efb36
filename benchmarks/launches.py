"""Launches of one denoising step on the Triton path, counted on a CPU: each Triton kernel call, and each torch
operator that would be a kernel of its own on a GPU (views and allocations are not), with the line of
clover_lite that issued it. A GPU step of small tensors is bound by launches (benchmarks/RESULTS.md: 3,410
kernels in an H200 step of 16.75 ms, 2,208 of them torch elementwise glue), so this is the count to bring
down, and it needs no GPU. The model is a random tiny checkpoint with one GDN and one attention layer, both
MoE, quantized to INT4, run by the Triton interpreter.

It also times the host work of the INT4 launchers (checks, config, split, allocation) with the kernel
launch itself replaced by a no-op: what an eager step or prefill pays per linear before Triton's own launch.

    TRITON_INTERPRET=1 python benchmarks/launches.py [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# Operators that launch no kernel on a GPU (views, metadata, allocation without a fill).
NO_KERNEL = {"view", "reshape", "as_strided", "slice", "select", "t", "transpose", "unsqueeze", "squeeze", "expand",
             "permute", "_unsafe_view", "empty", "empty_strided", "detach", "alias", "lift_fresh", "unbind", "split",
             "chunk", "split_with_sizes", "narrow", "_local_scalar_dense", "empty_like", "new_empty",
             "new_empty_strided", "is_nonzero", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
             "promote_types", "result_type", "_reshape_alias", "is_same_size"}


class LaunchCounter(TorchDispatchMode):
    """Counts torch operators (by name and the clover_lite line that issued them) outside Triton launches,
    and the Triton launches themselves."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.triton: collections.Counter = collections.Counter()
        self.depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if self.depth == 0 and name not in NO_KERNEL:
            frames = [f for f in traceback.extract_stack() if "clover_lite" in f.filename]
            where = f"{frames[-1].filename.split('clover_lite/')[-1]}:{frames[-1].lineno}" if frames else "?"
            self.ops[(name, where)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        import triton.runtime.interpreter as interp

        self._interp, self._call = interp, interp.GridExecutor.__call__
        counter = self

        def call(executor, *a, **k):
            if counter.depth == 0:
                counter.triton[getattr(executor.fn, "__name__", "?")] += 1
            counter.depth += 1
            try:
                return counter._call(executor, *a, **k)
            finally:
                counter.depth -= 1

        interp.GridExecutor.__call__ = call
        return super().__enter__()

    def __exit__(self, *exc):
        self._interp.GridExecutor.__call__ = self._call
        return super().__exit__(*exc)


def count_step(dtype: torch.dtype = torch.float16, block: int = 4) -> dict:
    import clover_lite
    from clover_lite.checkpoint.tiny import write_tiny_checkpoint
    from clover_lite.quant.pipeline import QuantizeOptions, quantize_model

    with tempfile.TemporaryDirectory() as tmp:
        src = write_tiny_checkpoint(Path(tmp) / "src", seed=1, num_hidden_layers=2,
                                    layer_types=["linear_attention", "full_attention"])
        out = quantize_model(src, Path(tmp) / "q", QuantizeOptions(group_size=32, nsamples=4, seqlen=32)).out
        model = clover_lite.load(out, device="cpu", dtype=dtype, kernels="triton").model
        cache = model.new_cache(capacity=8 * block)
        ids = torch.randint(0, 256, (1, 2 * block), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            model.prefill(ids[:, :block], cache, block)
            counter = LaunchCounter()
            with counter:
                model.step(ids[:, block:], cache)
    rows = sorted(counter.ops.items(), key=lambda x: x[0][1])
    return {"torch_ops": sum(counter.ops.values()), "triton_launches": sum(counter.triton.values()),
            "triton": dict(counter.triton), "torch": [{"op": n, "line": w, "calls": c} for (n, w), c in rows]}


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def host_time(reps: int = 5, calls: int = 400) -> dict[str, float]:
    """Microseconds of Python per INT4 call, the fastest of `reps` rounds (the least disturbed on a noisy
    host), the Triton launches replaced by no-ops, at an expert's 2048 -> 512 (groups of 128): `w4a16_matmul`
    (checkpoint tensors, validated every call) and the prepared weights' gemv (M = 1) and gemm (M = 16) as
    QuantLinear calls them."""
    import importlib.util
    import time

    from clover_lite.kernels import int4_gemm, int4_gemv, int4_split_k, w4a16
    from clover_lite.kernels.int4_weights import Int4Weights

    spec = importlib.util.spec_from_file_location("clover_bench_kernels", Path(__file__).parent / "kernels.py")
    kb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kb)
    K = 2048
    t = kb.random_int4(K, 512, 128, "cpu")  # the kernel benchmark's random GPTQ tensors
    w = Int4Weights(**t)
    x1, x16 = torch.randn(1, K), torch.randn(16, K)
    cases = {"w4a16_matmul M=1": lambda: w4a16.w4a16_matmul(x1, **t),
             "w4a16_matmul M=16": lambda: w4a16.w4a16_matmul(x16, **t),
             "gemv, prepared, M=1": lambda: int4_gemv.gemv(x1, w),
             "gemm, prepared, M=16": lambda: int4_gemm.gemm(x16, w)}
    kernels = ((int4_gemm, "_gemm_kernel"), (int4_gemv, "_gemv_kernel"), (int4_split_k, "_sum_splits_kernel"))
    saved = {(m, n): getattr(m, n) for m, n in kernels}
    out = {}
    try:
        for m, n in kernels:
            setattr(m, n, _NoLaunch())
        for label, fn in cases.items():
            rounds = []
            for _ in range(reps + 1):  # the first round warms up
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                rounds.append((time.perf_counter() - t0) / calls)
            out[label] = 1e6 * min(rounds[1:])
    finally:
        for (m, n), k in saved.items():
            setattr(m, n, k)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("run with TRITON_INTERPRET=1 (set before python starts)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    r = count_step()
    print(f"one denoising step, tiny model (1 GDN + 1 attention layer, MoE), Triton path: "
          f"{r['torch_ops']} torch operators, {r['triton_launches']} Triton launches")
    print("Triton: " + ", ".join(f"{k} {v}" for k, v in sorted(r["triton"].items())))
    for row in r["torch"]:
        print(f"  {row['calls']:3d}  {row['op']:<22} {row['line']}")
    r["host_us"] = host_time()
    print("host time per INT4 call, launch excluded: " + ", ".join(f"{k} {v:.1f} us" for k, v in r["host_us"].items()))
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
