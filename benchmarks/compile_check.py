"""Compile every Triton kernel, in every tuning-table configuration, for every GPU architecture we tune
for, without a GPU: Triton compiles to PTX/cubin for a named target. Reports the shared memory the
compiler actually allocates against the architecture's limit, and fails on a compile error or an overrun.

    python benchmarks/compile_check.py                   # all architectures (a few minutes)
    python benchmarks/compile_check.py --archs sm_86 sm_90 --quick
Run with TRITON_INTERPRET unset (the interpreter replaces the compiler); the script clears it itself.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # must happen before any kernel module is imported

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from clover_lite.kernels import attention as attn_k  # noqa: E402
from clover_lite.kernels import configs  # noqa: E402
from clover_lite.kernels import gdn as gdn_k  # noqa: E402
from clover_lite.kernels import sampling as samp_k  # noqa: E402
from clover_lite.kernels import w4a16 as w4_k  # noqa: E402

FLOAT_SCALARS = {"qk_scale", "inv_temp"}


def source(fn, pointers: dict[str, str], consts: dict) -> ASTSource:
    """An ASTSource for `fn`: pointer types from `pointers` (default *fp32), i32 scalars, constexprs (every
    one of the kernel's must be given: a missing one would silently compile as an i32 argument)."""
    names = fn.arg_names
    missing = [names[i] for i in fn.constexprs if names[i] not in consts]
    if missing:
        raise ValueError(f"{fn.__name__}: no value for constexpr(s) {missing}")
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = pointers.get(n, "*fp32")
        elif n in FLOAT_SCALARS:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    return ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})


def compile_one(fn, pointers, consts, cap, num_warps, num_stages):
    k = triton.compile(source(fn, pointers, consts), target=GPUTarget("cuda", cap, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    return k.metadata.shared


def int4_pointers(act: str, out: str) -> dict[str, str]:
    p = {n: "*i32" for n in ("rows_ptr", "tile_expert_ptr", "row_expert_ptr", "qw_ptr", "qz_ptr", "gi_ptr",
                             "qw2_ptr", "qz2_ptr", "gi2_ptr")}
    p.update(x_ptr=act, out_ptr=out, row_scale_ptr="*fp32", sc_ptr="*fp16", sc2_ptr="*fp16")
    return p


def cases(arch: str, quick: bool):
    """(name, kernel, pointer types, constexprs, num_warps, num_stages, shared-memory estimate or None)."""
    act = "*bf16"
    buckets = (16, 64, 1 << 30) if quick else configs.M_BUCKETS
    for m in buckets:
        c = configs.gemm_config(arch, m)
        variants = [("dense", dict(HAS_ROWS=False, HAS_EXPERTS=False, FUSE_GATE_UP=False, HAS_ROW_SCALE=False)),
                    ("moe gate/up", dict(HAS_ROWS=True, HAS_EXPERTS=True, FUSE_GATE_UP=True, HAS_ROW_SCALE=False)),
                    ("moe down", dict(HAS_ROWS=False, HAS_EXPERTS=True, FUSE_GATE_UP=False, HAS_ROW_SCALE=True))]
        for label, flags in variants[: 1 if quick and m != 16 else 3]:
            for gidx in (False, True):
                consts = dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, HAS_GIDX=gidx, DOT_IEEE=False,
                              **flags)
                out = "*fp32" if c.split_k > 1 and not flags["FUSE_GATE_UP"] else act
                yield (f"w4a16 gemm M<={m} {label}{' g_idx' if gidx else ''}", w4_k._gemm_kernel,
                       int4_pointers(act, out), consts, c.num_warps, c.num_stages, c.smem_bytes())
    g = configs.GEMV_TABLE[arch]
    for fused in (False, True):
        consts = dict(BLOCK_N=g.block_n, BLOCK_K=g.block_k, HAS_ROWS=fused, HAS_EXPERTS=fused, HAS_GIDX=False,
                      FUSE_GATE_UP=fused, HAS_ROW_SCALE=not fused)
        yield (f"w4a16 gemv{' moe gate/up' if fused else ''}", w4_k._gemv_kernel, int4_pointers("*fp32", act), consts,
               g.num_warps, g.num_stages, g.smem_bytes())
    for write in (False, True):
        consts = dict(BLOCK_T=64, BLOCK_K=128, BLOCK_V=64, LOG2_T=6, WRITE_STATE=write)
        yield (f"gdn block{' commit' if write else ' step'}", gdn_k._gdn_kernel, {}, consts, 4, 1, None)
    for sample in (False, True):
        yield (f"sampling{' sample' if sample else ''}", samp_k._row_stats_kernel,
               {"logits_ptr": "*bf16", "idx_ptr": "*i64"}, dict(BLOCK_V=4096, SAMPLE=sample), 8, 1, None)
    for D in (128, 256):
        cfg = configs.attention_config(arch, D, 2)
        for in_memory in (False, True):  # True: the CUDA-graph step's form (cache length read on the device)
            for split in (False, True):
                consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=D, BLOCK_L=min(cfg.block_n, 32),
                              SPLIT=split, HAS_GATE=True, DOT_IEEE=False, LEN_IN_MEMORY=in_memory)
                ptrs = {n: act for n in ("q_ptr", "kc_ptr", "vc_ptr", "kb_ptr", "vb_ptr", "gate_ptr", "out_ptr")}
                ptrs["cache_len_ptr"] = "*i32"
                yield (f"attention D{D}{' graph' if in_memory else ''}{' split' if split else ''}",
                       attn_k._block_attn_kernel, ptrs, consts, cfg.num_warps, cfg.num_stages, cfg.smem_bytes(D, 2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", nargs="+", default=list(configs.SMEM_LIMIT))
    ap.add_argument("--quick", action="store_true", help="fewer M buckets and variants")
    ap.add_argument("--only", nargs="+", help="only the cases whose names contain one of these words")
    args = ap.parse_args(argv)
    failures = 0
    for arch in args.archs:
        limit = configs.SMEM_LIMIT[arch]
        for name, fn, ptrs, consts, warps, stages, est in cases(arch, args.quick):
            if args.only and not any(w in name for w in args.only):
                continue
            try:
                shared = compile_one(fn, ptrs, consts, int(arch.removeprefix("sm_")), warps, stages)
            except Exception as e:  # report every failure, then exit non-zero
                failures += 1
                print(f"FAIL {arch} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            over = shared > limit
            failures += over
            note = "" if est is None else f" (table estimate {est})"
            print(f"{'OVER' if over else 'ok  '} {arch} {name}: {shared} B shared of {limit}{note}", flush=True)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
