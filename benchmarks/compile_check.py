"""Compile every Triton kernel, in every tuning-table configuration, for every GPU architecture we tune
for, without a GPU: Triton compiles to PTX/cubin for a named target. Reports the shared memory the
compiler actually allocates against the architecture's limit, and fails on a compile error or an overrun.

    python benchmarks/compile_check.py                   # all architectures (a few minutes)
    python benchmarks/compile_check.py --archs sm_86 sm_90 --quick
    python benchmarks/compile_check.py --archs sm_90 --only gemv --as-run   # + loads, registers, spills, SASS loop
Run with TRITON_INTERPRET unset (the interpreter replaces the compiler); the script clears it itself.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # must happen before any kernel module is imported

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from clover_lite.kernels import attention as attn_k  # noqa: E402
from clover_lite.kernels import configs, mma_layout  # noqa: E402
from clover_lite.kernels import gdn as gdn_k  # noqa: E402
from clover_lite.kernels import gdn_prep as prep_k  # noqa: E402
from clover_lite.kernels import int4_gemm as gemm_k  # noqa: E402
from clover_lite.kernels import int4_gemv as gemv_k  # noqa: E402
from clover_lite.kernels import moe_route as route_k  # noqa: E402
from clover_lite.kernels import norm as norm_k  # noqa: E402
from clover_lite.kernels import sampling as samp_k  # noqa: E402

FLOAT_SCALARS = {"qk_scale", "inv_temp"}


# What the launcher specializes at run time for Clover's shapes (--as-run): an integer argument equal to 1
# becomes a constant (the innermost stride of a row-major tensor), and pointers and integers that are
# multiples of 16 are marked so; both decide whether loads can be 16 bytes wide. Named for the INT4, GDN
# and attention kernels (Clover: K = V = 128, 32 value heads, head_dim 256).
UNIT_STRIDES = {"s_xk", "s_on", "s_qn", "s_sn", "s_zn", "s_gk", "s_qd", "s_kcd", "s_vcd", "s_kbd", "s_vbd", "s_gd",
                "s_oc"}
MULTIPLES_OF_16 = {"N", "K", "k_per_split", "group_size", "s_xm", "s_om", "s_os", "s_qe", "s_qk", "s_se", "s_sg",
                   "s_ze", "s_zg", "s_ge",  # W4A16
                   "V", "HV", "s_qb", "s_qt", "s_qh", "s_vb", "s_vt", "s_vh", "s_gb", "s_gt", "s_sb", "s_sh", "s_sk",
                   "s_ob", "s_ot", "s_oh",  # GDN
                   "D", "s_ql", "s_kcb", "s_kch", "s_kcn", "s_vcb", "s_vch", "s_vcn", "s_kbb", "s_kbh",
                   "s_kbn", "s_vbb", "s_vbh", "s_vbn", "s_gl", "s_gh", "s_ol",  # attention
                   "s_lr"}  # sampling (V as above)


def source(fn, pointers: dict[str, str], consts: dict, as_run: bool = False) -> ASTSource:
    """An ASTSource for `fn`: pointer types from `pointers` (default *fp32), i32 scalars, constexprs (every
    one of the kernel's must be given: a missing one would silently compile as an i32 argument)."""
    names = fn.arg_names
    missing = [names[i] for i in fn.constexprs if names[i] not in consts]
    if missing:
        raise ValueError(f"{fn.__name__}: no value for constexpr(s) {missing}")
    if as_run:
        consts = {**consts, **{n: 1 for n in UNIT_STRIDES if n in names}}
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in consts:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = pointers.get(n, "*fp32")
        elif n in FLOAT_SCALARS:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
        if as_run and n not in consts and (n.endswith("_ptr") or n in MULTIPLES_OF_16):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                     attrs=attrs)


def compile_one(fn, pointers, consts, cap, num_warps, num_stages, as_run: bool = False):
    return triton.compile(source(fn, pointers, consts, as_run), target=GPUTarget("cuda", cap, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def cuobjdump(kernel, flag: str) -> str | None:
    """Triton's bundled cuobjdump run on the kernel's cubin (None when the tool is missing)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True).stdout


def resource_usage(kernel) -> str:
    """Registers and stack frame per thread from the cubin: a stack means spills to local memory, which a
    bandwidth-bound kernel cannot afford."""
    out = cuobjdump(kernel, "-res-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+)", out or "")
    return f"{m.group(1)} registers, {m.group(2)} B stack" if m else "registers: unread"


def sass_loop(kernel) -> str:
    """Machine instructions per thread in the kernel's longest loop (the span of its longest backward
    branch: the K loop of the INT4 kernels), and how many are type conversions (I2F*, F2F*, F2I*). The CUDA
    guide gives conversions 16 per clock per SM, an eighth of the FMA rate: one per weight would cap an
    H200 at about 44% of its bandwidth, which is why the INT4 kernels build their floats with bit tricks."""
    out = cuobjdump(kernel, "-sass")
    if out is None:
        return "SASS: no cuobjdump"
    ins = []  # (address, opcode, operands)
    for ln in out.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", ln)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loop = (0, -1)
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr and addr - int(target.group(1), 16) > loop[1] - loop[0]:
            loop = (int(target.group(1), 16), addr)
    if loop[1] < 0:
        return "no loop in the SASS"
    body = [op for addr, op, _ in ins if loop[0] <= addr <= loop[1]]
    conv = sum(op.startswith(("I2F", "F2F", "F2I")) for op in body)
    return f"loop {len(body)} SASS instructions, {conv} conversions"


def ptx_stats(kernel) -> str:
    """Instructions in the PTX, and global loads with how many are 16 bytes wide (the device notes: are
    the loads 16 bytes wide?). cp.async copies (the pipelined tl.dot operands) are counted apart."""
    body = [ln.strip() for ln in kernel.asm["ptx"].splitlines()]
    body = [ln.split(None, 1)[1] if ln.startswith("@") and " " in ln else ln for ln in body]  # drop predicates
    n = sum(1 for ln in body if ln and not ln.startswith(("//", ".", "$", "{", "}", ")", "(")) and not ln.endswith(":"))
    loads = sum(ln.startswith("ld.global") for ln in body)
    wide = sum(ln.startswith("ld.global") and ".v4." in ln for ln in body)
    copies = sum(ln.startswith("cp.async.") and "shared.global" in ln for ln in body)
    return f"{n} PTX instructions, {loads} global loads ({wide} of 16 bytes), {copies} cp.async"


def int4_pointers(act: str, out: str) -> dict[str, str]:
    p = {n: "*i32" for n in ("rows_ptr", "tile_expert_ptr", "row_expert_ptr", "qw_ptr", "qz_ptr", "gi_ptr",
                             "qw2_ptr", "qz2_ptr", "gi2_ptr", "tile_done_ptr")}
    p.update(x_ptr=act, out_ptr=out, row_scale_ptr="*fp32", sc_ptr="*fp16", sc2_ptr="*fp16", sum_ptr=act)
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
                fused = flags["FUSE_GATE_UP"]
                g = configs.for_gathered_groups(c, arch, fused) if gidx else c  # as the launcher adjusts it
                consts = dict(BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, HAS_GIDX=gidx, DOT_IEEE=False,
                              PLANES=not gidx and g.block_k >= 128 and g.planes, PARTIAL=g.split_k > 1 and not fused,
                              MMA_ORDER=0, MMA_SWAP=False,
                              SUM_IN_KERNEL=g.split_k > 1 and not fused and g.sum_in_kernel, **flags)
                # (as the launcher sets it: the MoE's gate/up has no split; split partials summed by the last split)
                out = "*fp32" if g.split_k > 1 and not fused else act
                yield (f"w4a16 gemm M<={m} {label}{' g_idx' if gidx else ''}", gemm_k._gemm_kernel,
                       int4_pointers(act, out), consts, g.num_warps, g.num_stages,
                       g.smem_bytes(gathered=gidx, fused=fused))
                if not gidx:  # the modules' weights, repacked in the MMA order this Triton's dot takes
                    # (operands as they are and swapped, W^T x^T: configs.mma_swap picks one per arch and M;
                    # fp32 activations too at M <= 16 dense, IEEE dots, the tiny models')
                    mg = configs.for_mma_order(g, arch)
                    fp32s = (False, True) if m == 16 and label == "dense" else (False,)
                    for fp32, swap in itertools.product(fp32s, (False, True)):
                        yield (f"w4a16 gemm M<={m} {label} mma{' fp32' if fp32 else ''}{' swap' if swap else ''}",
                               gemm_k._gemm_kernel, int4_pointers(*(("*fp32", "*fp32") if fp32 else (act, out))),
                               dict(consts, BLOCK_K=mg.block_k, PLANES=False, DOT_IEEE=fp32,
                                    MMA_ORDER=mma_layout.kernel_order(), MMA_SWAP=swap),
                               mg.num_warps, mg.num_stages, mg.smem_bytes(act_bytes=4 if fp32 else 2, fused=fused))
    g = configs.GEMV_TABLE[arch]
    # Dense M = 1 (K split, fp32 partials), the MoE's fused gate/up and its down projection (routing weight).
    for label, fused, partial in (("", False, True), (" moe gate/up", True, False), (" moe down", False, False)):
        consts = dict(BLOCK_N=g.block_n, BLOCK_K=g.block_k, HAS_ROWS=fused, HAS_EXPERTS=bool(label),
                      HAS_GIDX=False, FUSE_GATE_UP=fused, HAS_ROW_SCALE=bool(label) and not fused, PARTIAL=partial,
                      EVEN_K=True, MMA_ORDER=0, SUM_IN_KERNEL=partial and not label and g.sum_in_kernel)
        for order in (0, mma_layout.kernel_order()):
            yield (f"w4a16 gemv{label}{' mma' if order else ''}", gemv_k._gemv_kernel,
                   int4_pointers(act, "*fp32" if partial else act), dict(consts, MMA_ORDER=order), g.num_warps,
                   g.num_stages, g.smem_bytes())
    # The MoE's routing glue (moe_route.py), at Clover's 256 experts, top-8, 2048 columns.
    yield ("moe route top-k", route_k._topk_softmax_kernel, {"logits_ptr": act, "w_ptr": act, "ids_ptr": "*i64"},
           dict(K=8, NORMALIZE=True, BLOCK_T=1, BLOCK_E=256, BLOCK_K=8), 1, 1, None)
    yield ("moe route sort", route_k._sort_pairs_kernel,
           {"ids_ptr": "*i64", "w_ptr": act, **{n: "*i32" for n in ("pos_ptr", "expert_ptr", "token_ptr", "rank_ptr",
                                                                   "count_ptr")}},
           dict(BLOCK_I=64, BLOCK_J=32), 4, 1, None)
    yield ("moe route combine", route_k._combine_kernel,
           {"y_ptr": "*fp32", "rows_ptr": "*i32", "out_ptr": act, "add_ptr": act, "logit_ptr": act, "res_ptr": act},
           dict(K=8, HAS_ADD=True, HAS_RESIDUAL=True, BLOCK_T=1, BLOCK_N=1024), 4, 1, None)
    # The GDN layer's input kernel (gdn_prep.py) at the GPU tile (a token, 4 heads of 128 channels), with and
    # without the conv tail written (commit / step).
    for tail in (False, True):
        yield (f"gdn prep{' commit' if tail else ' step'}", prep_k._gdn_prep_kernel,
               {"qkv_ptr": act, "tail_ptr": act, "w_ptr": act, "a_ptr": act, "b_ptr": act, "new_tail_ptr": act},
               dict(KW=4, BLOCK_T=1, BLOCK_S=4, BLOCK_D=128, WRITE_TAIL=tail), 4, 1, None)
    # RMSNorm (norm.py): plain, gated with a wider input (the GDN's output), with RoPE (attention q/k, head_dim
    # 256), with the residual add.
    for label, flags, block in (("", {}, 2048), (" gated fp32 in", dict(GATED=True, ROUND_INPUT=True), 128),
                                (" rotary", dict(ROTARY=True), 256), (" residual", dict(RESIDUAL=True), 2048)):
        consts = dict(UNIT_OFFSET=not flags.get("GATED", False), GATED=False, ROUND_PRODUCT=True, ROTARY=False,
                      ROUND_INPUT=False, RESIDUAL=False, BLOCK=block)
        consts.update(flags)
        ptrs = {n: act for n in ("x_ptr", "w_ptr", "gate_ptr", "out_ptr", "res_ptr", "sum_ptr")}
        if flags.get("ROUND_INPUT"):
            ptrs["x_ptr"] = "*fp32"
        yield (f"rms norm{label}", norm_k._rms_norm_kernel, ptrs, consts, 4 if block <= 1024 else 8, 1, None)
    for write in (False, True):
        t, v = configs.GDN_BLOCK_T, configs.GDN_BLOCK_V
        consts = dict(BLOCK_T=t, BLOCK_K=128, BLOCK_V=v, LOG2_T=t.bit_length() - 1, WRITE_STATE=write,
                      DOT_PREC=configs.GDN_DOT_PRECISION)
        yield (f"gdn block{' commit' if write else ' step'}", gdn_k._gdn_kernel, {}, consts, configs.GDN_NUM_WARPS, 1,
               None)
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


def check_sources(archs: list[str]) -> int:
    """Build every case's source as --as-run would, without compiling: a case that misses a kernel's new
    constexpr, or a specialized stride that no kernel has any more, is found before a GPU session."""
    failures, seen, n = 0, set(), 0
    for arch in archs:
        for name, fn, ptrs, consts, *_ in cases(arch, quick=False):
            n += 1
            seen.update(fn.arg_names)
            try:
                source(fn, ptrs, consts, as_run=True)
            except ValueError as e:
                failures += 1
                print(f"FAIL {arch} {name}: {e}")
    stale = sorted((UNIT_STRIDES | MULTIPLES_OF_16) - seen)
    if stale:
        failures += 1
        print(f"FAIL specialized arguments that no kernel has: {stale}")
    print(f"{n} case(s) over {len(archs)} architecture(s); {failures} failure(s)")
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", nargs="+", default=list(configs.SMEM_LIMIT))
    ap.add_argument("--quick", action="store_true", help="fewer M buckets and variants")
    ap.add_argument("--only", nargs="+", help="only the cases whose names contain one of these words")
    ap.add_argument("--as-run", action="store_true",
                    help="compile with the launcher's run-time specializations (unit strides, multiples of 16) "
                         "and print PTX instruction and load counts, registers and stack, and the SASS instructions "
                         "and conversions in the main loop per kernel")
    ap.add_argument("--sources-only", action="store_true",
                    help="only check each case against its kernel (every constexpr given a value, every specialized "
                         "stride still some kernel's argument), compiling nothing: a second")
    args = ap.parse_args(argv)
    if args.sources_only:
        return check_sources(args.archs)
    failures = 0
    for arch in args.archs:
        limit = configs.SMEM_LIMIT[arch]
        for name, fn, ptrs, consts, warps, stages, est in cases(arch, args.quick):
            if args.only and not any(w in name for w in args.only):
                continue
            try:
                kernel = compile_one(fn, ptrs, consts, int(arch.removeprefix("sm_")), warps, stages, args.as_run)
                shared = kernel.metadata.shared
            except Exception as e:  # report every failure, then exit non-zero
                failures += 1
                print(f"FAIL {arch} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            over = shared > limit
            failures += over
            note = "" if est is None else f" (table estimate {est})"
            stats = f"; {ptx_stats(kernel)}; {resource_usage(kernel)}; {sass_loop(kernel)}" if args.as_run else ""
            print(f"{'OVER' if over else 'ok  '} {arch} {name}: {shared} B shared of {limit}{note}{stats}", flush=True)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
