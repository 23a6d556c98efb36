"""Tile configurations of the INT4 kernels timed side by side on this GPU: the data behind the tuning table.

A denoising step at Clover-35B-A3B multiplies blocks of M = 32 rows (block size 32) by INT4 weights of a few
shapes, each a known number of times per step (10 attention, 30 GDN, 40 MoE layers with a shared expert).
For each M bucket asked for, the dense GEMM's candidates (BLOCK_N, BLOCK_K, warps, stages, split-K limit, nibble
planes or the unpacked tile) are timed on those shapes as kernels.py times (weights rotated over 4x the L2,
the calls replayed from a CUDA graph), each checked against the dequantized reference on its first call;
a candidate's score is its time summed over one step's calls. Stages are swept second, for the best few.
The fused MoE's GEMV (M = 32 tokens, top-8 of 256 experts) is swept the same way, each candidate's output
checked against the table entry's. The table's entry is timed
beside the winners; nothing is changed here: copy what wins into kernels/configs.py with the date and card.
The weights are in the MMA order the modules rearrange them into on a GPU (kernels/mma_layout.py: K tiles of
128 rows, no planes); `--order gptq` sweeps the checkpoint's order instead (w4a16_matmul's, and weights whose
groups are not a multiple of 128 rows).

    python benchmarks/sweep.py --ms 32 16 64 --time-limit 300 --json benchmarks/out/sweep.json
    TRITON_INTERPRET=1 python benchmarks/sweep.py --smoke            # the code path on a CPU, tiny
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("clover_bench_kernels", HERE / "kernels.py")
kb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kb)

from clover_lite.kernels import configs  # noqa: E402
from clover_lite.kernels.int4_gemm import gemm  # noqa: E402
from clover_lite.kernels.int4_launch import fill_split, gemm_config_for  # noqa: E402
from clover_lite.kernels.int4_weights import Int4Weights  # noqa: E402
from clover_lite.kernels.w4a16 import w4a16_matmul_reference  # noqa: E402

# (name, K, N, calls per denoising step at Clover-35B-A3B)
STEP_SHAPES = [
    ("gdn qkv / attn q+gate", 2048, 8192, 40),
    ("gdn z", 2048, 4096, 30),
    ("gdn out / attn o", 4096, 2048, 40),
    ("attn k,v / shared gate,up", 2048, 512, 100),
    ("shared down", 512, 2048, 40),
]
LM_HEAD = ("lm_head", 2048, 248320, 1)
SMOKE_SHAPES = [("tiny a", 128, 64, 2), ("tiny b", 256, 32, 1)]


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.time() + seconds

    def left(self) -> float:
        return self.end - time.time()


def kernel_seconds(calls: list, device: torch.device, reps: int) -> float:
    """Seconds per call: CUDA-graph replay of the rotated calls on a GPU (no eager pass: the sweep's time goes
    to candidates), else eager."""
    t = kb.graph_time(calls, device, reps) if device.type == "cuda" else None
    return t if t is not None else kb.time_calls(calls, device, reps, graph=False)[0]


def gemm_candidates(m: int, smoke: bool, mma: bool = False) -> list[tuple[configs.GemmConfig, bool]]:
    """(config, planes) pairs at stages 3; split_k is the most the fill rule may use. `mma`: weights in the
    MMA order, whose K tile is always 128 rows (configs.for_mma_order) and which have no planes: BLOCK_N,
    warps, split, and the operands as they are or swapped (GemmConfig.swap: the table's choice is
    configs.mma_swap's rule)."""
    if mma:
        if smoke:
            return [(configs.GemmConfig(16, bn, 128, sk, 4, 1, swap=swap), False)
                    for bn, sk, swap in ((32, 1, False), (64, 2, True))]
        return [(configs.GemmConfig(m, bn, 128, split, warps, 3, swap=swap), False)
                for bn in (64, 128, 256) for warps in (4, 8) for split in (1, 2, 4) for swap in (False, True)]
    if smoke:
        return [(configs.GemmConfig(16, 32, 32, 1, 4, 1), False), (configs.GemmConfig(16, 64, 32, 2, 4, 1), False)]
    out = []
    for bn in (64, 128, 256):
        for bk, planes in ((64, False), (128, False), (128, True)):
            for warps in (4, 8):
                for split in (1, 2, 4):
                    out.append((configs.GemmConfig(m, bn, bk, split, warps, 3), planes))
    return out


def fits(cfg: configs.GemmConfig, arch: str | None) -> bool:
    return arch is None or cfg.smem_bytes() <= configs.SMEM_LIMIT[arch]


def time_gemm(shape, m, cfg, planes, device, dtype, reps, cache, mma: bool = False) -> float | None:
    """Seconds per call (graph replay, rotated weights), or None if the config fails or is wrong. `mma`: the
    weights rearranged in the MMA order, as the modules hold them on a GPU."""
    name, K, N, _ = shape
    if (name, m) not in cache:
        group = 32 if device.type == "cpu" and not mma else 128
        ws = [kb.random_int4(K, N, group, device) for _ in range(kb.n_copies(kb.int4_bytes(K, N, group), device))]
        x = torch.randn(m, K, device=device, dtype=dtype)
        ref = w4a16_matmul_reference(x.float(), **ws[0])
        cache.clear()  # one shape's weights at a time
        cache[(name, m)] = (x, [kb.mma_weights(w) if mma else Int4Weights(**w) for w in ws], ref)
    x, ws, ref = cache[(name, m)]
    c = fill_split(cfg, m, N, device)
    try:
        out = gemm(x, ws[0], config=c, planes=planes).float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        if not err < (1e-3 if dtype == torch.float32 else 2e-2):
            print(f"  wrong result ({err:.1e}): {c} planes={planes} {name}", file=sys.stderr)
            return None
        return kernel_seconds([lambda w=w: gemm(x, w, config=c, planes=planes) for w in ws], device, reps)
    except Exception as e:  # noqa: BLE001 - out of resources on this part, say: not a candidate
        print(f"  failed: {c} planes={planes} {name}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
        return None


def sweep_gemm(m, shapes, device, dtype, reps, deadline, smoke, arch, mma: bool = False) -> dict:
    """Candidates scored on every shape; then stages 2 and 4 for the best three, and the three with their splits
    summed by a second launch (_sum_splits, against the in-kernel sum); the table's entry too (as the launcher
    runs it). Shapes are the outer loop (one shape's rotated weights in memory at a time)."""
    table = gemm_config_for(device, m)
    table_planes = table.block_k >= 128 and table.planes
    if mma:
        table, table_planes = (configs.for_mma_order(table, arch) if arch else table), False
    cands = [(c, p) for c, p in gemm_candidates(m, smoke, mma) if fits(c, arch)]
    if (table, table_planes) not in cands:
        cands.insert(0, (table, table_planes))
    cache: dict = {}

    def run(cands):
        per = {i: {} for i in range(len(cands))}
        for shape in shapes:
            for i, (c, p) in enumerate(cands):
                if deadline.left() < 0 or per[i] is None:
                    continue
                t = time_gemm(shape, m, c, p, device, dtype, reps, cache, mma)
                per[i] = None if t is None else {**per[i], shape[0]: t}
        out = []
        for i, (c, p) in enumerate(cands):
            if per[i] and len(per[i]) == len(shapes):
                out.append({"config": asdict(c), "planes": p, "per_shape_s": per[i],
                            "step_s": sum(per[i][s[0]] * s[3] for s in shapes)})
        return out

    results = run(cands)
    results.sort(key=lambda r: r["step_s"])
    if not smoke:
        more = []
        for r in results[:3]:
            c = configs.GemmConfig(**r["config"])
            for st in (2, 4):
                c2 = replace(c, num_stages=st)
                if fits(c2, arch) and (c2, r["planes"]) not in cands:
                    more.append((c2, r["planes"]))
            if c.split_k > 1:  # the splits summed by a second launch (_sum_splits), as before the in-kernel sum
                more.append((replace(c, sum_in_kernel=False), r["planes"]))
        results += run(more)
        results.sort(key=lambda r: r["step_s"])
    mine = next((r for r in results if configs.GemmConfig(**r["config"]) == table and r["planes"] == table_planes),
                None)
    return {"M": m, "table": asdict(table), "table_planes": table_planes, "table_step_s": mine and mine["step_s"],
            "results": results}


def time_lm_head(m, entries, device, dtype, reps, deadline, mma: bool = False) -> list[dict]:
    cache: dict = {}
    out = []
    for cfg, planes in entries:
        if deadline.left() < 0:
            break
        t = time_gemm(LM_HEAD, m, cfg, planes, device, dtype, reps, cache, mma)
        out.append({"config": asdict(cfg), "planes": planes, "s": t})
    return out


def sweep_moe(m, device, dtype, reps, deadline, smoke, arch, mma: bool = False) -> dict:
    """The fused MoE on a block of m tokens through the captured step's path, per GEMV config.
    `mma`: experts in the MMA order, as the modules hold them on a GPU."""
    from clover_lite.kernels.moe import fused_moe

    hidden, inter, E, k, group = (64, 32, 16, 2, 32) if smoke else (2048, 512, 256, 8, 128)
    if mma:
        hidden, inter, group = (128, 128, 128) if smoke else (hidden, inter, group)
    gate, up, down = ((kb.mma_weights if mma else lambda w: Int4Weights(**w))(kb.random_int4(kk, n, group, device, E))
                      for kk, n in ((hidden, inter), (hidden, inter), (inter, hidden)))
    x = torch.randn(m, hidden, device=device, dtype=dtype)
    per_expert = 2 * kb.int4_bytes(hidden, inter, group) + kb.int4_bytes(inter, hidden, group)
    touched = E * (1 - (1 - k / E) ** m)
    routings = []
    for _ in range(kb.n_copies(int(touched * per_expert), device, cap=64)):
        w, ids = torch.topk(torch.softmax(torch.randn(m, E, device=device), -1), k)
        routings.append((w.to(dtype), ids))
    floor = touched * per_expert / kb.copy_bandwidth(device)
    key = arch or "sm_90"
    base = configs.gemv_config(key, moe=True)
    if smoke:
        cands = [configs.GemvConfig(32, 32, 4, 1, 16), configs.GemvConfig(64, 32, 4, 1, 16)]
    else:
        cands = [configs.GemvConfig(bn, bk, w, 2, 16) for bn in (64, 128, 256) for bk in (64, 128) for w in (2, 4, 8)]
    if base not in cands:
        cands.insert(0, base)
    saved = dict(configs.MOE_GEMV_TABLE)
    results = []

    def moe(w, ids):
        return fused_moe(x, w, ids, gate, up, down, gemv_max_rows=1 << 30, validate=False)

    # the table's entry (tests/test_kernels_int4_shapes.py checks it against the dequantized experts)
    ref = moe(*routings[0]).float()

    def run(cfg):
        configs.MOE_GEMV_TABLE[key] = cfg
        try:
            err = ((moe(*routings[0]).float() - ref).abs().max() / ref.abs().max()).item()
            if not err < (1e-3 if dtype == torch.float32 else 2e-2):
                print(f"  MoE wrong result ({err:.1e}): {cfg}", file=sys.stderr)
                return None
            calls = [lambda w=w, ids=ids: moe(w, ids) for w, ids in routings]
            return kernel_seconds(calls, device, reps)
        except Exception as e:  # noqa: BLE001
            print(f"  MoE failed: {cfg}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
            return None
        finally:
            configs.MOE_GEMV_TABLE.clear()
            configs.MOE_GEMV_TABLE.update(saved)

    def entry(cfg, t):
        return {"config": asdict(cfg), "s": t}

    tried = []
    for cfg in cands:
        if deadline.left() < 0:
            break
        t = run(cfg)
        tried.append((cfg, t))
        if t is not None:
            results.append(entry(cfg, t))
    results.sort(key=lambda r: r["s"])
    if not smoke:
        for cfg0, _ in sorted(((c, t) for c, t in tried if t is not None), key=lambda ct: ct[1])[:3]:
            for st in (1, 3, 4):
                if deadline.left() < 0:
                    break
                cfg = replace(cfg0, num_stages=st)
                if cfg in (c for c, _ in tried):
                    continue
                t = run(cfg)
                tried.append((cfg, t))
                if t is not None:
                    results.append(entry(cfg, t))
        results.sort(key=lambda r: r["s"])
    table_s = next((t for c, t in tried if c == base), None)
    return {"M": m, "experts_touched": touched, "floor_s": floor, "table": asdict(base), "table_s": table_s,
            "results": results}


def print_moe(moe: dict) -> None:
    print(f"\n== fused MoE GEMV, M={moe['M']} ({moe['experts_touched']:.0f} experts touched, floor "
          f"{moe['floor_s'] * 1e6:.1f} us); table's entry {moe['table']}: "
          f"{(moe['table_s'] or float('nan')) * 1e6:.1f} us", flush=True)
    for x in moe["results"][:8]:
        print(f"  {fmt_moe(x)}  {x['s'] * 1e6:7.1f} us")


def fmt_moe(x: dict) -> str:
    c = x["config"]
    return f"GEMV BN {c['block_n']:>3} BK {c['block_k']:>3} w{c['num_warps']} st{c['num_stages']}"


def fmt_gemm(c: dict, planes: bool) -> str:
    return (f"BM {c['block_m']:>3} BN {c['block_n']:>3} BK {c['block_k']:>3} split<={c['split_k']} "
            f"w{c['num_warps']} st{c['num_stages']} {'planes' if planes else 'tile  '}"
            f"{' swap' if c.get('swap') else ''}{'' if c.get('sum_in_kernel', True) else ' sum launch'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", type=int, nargs="+", default=[32, 16, 64], help="M buckets, in the order swept")
    ap.add_argument("--no-moe", action="store_true")
    ap.add_argument("--moe-only", action="store_true", help="only the MoE GEMV candidates, at a 32-token block")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--time-limit", type=float, default=300, help="seconds; what is done by then is reported")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--order", choices=("mma", "gptq"), default="mma",
                    help="the weights' order: rearranged for the tensor cores as the modules hold them on a GPU "
                         "(kernels/mma_layout.py), or the checkpoint's GPTQ order (w4a16_matmul's, and weights "
                         "whose groups are not multiples of 128)")
    ap.add_argument("--json", default=str(HERE / "out" / "sweep.json"))
    args = ap.parse_args(argv)
    mma = args.order == "mma"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    smoke = args.smoke or device.type == "cpu"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    arch = None if device.type != "cuda" else configs.arch_of(torch.cuda.get_device_capability(device))
    deadline = Deadline(args.time_limit)
    shapes = SMOKE_SHAPES if smoke else STEP_SHAPES
    ms = [16] if smoke else args.ms
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    result = {"card": card, "arch": arch, "date": time.strftime("%Y-%m-%d"), "dtype": str(dtype), "order": args.order,
              "shapes": shapes, "gemm": [], "lm_head": {}, "moe": None}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(path)

    reps = 2 if smoke else args.reps
    if args.moe_only:
        result["moe"] = sweep_moe(16 if smoke else 32, device, dtype, reps, deadline, smoke, arch, mma)
        save()
        print_moe(result["moe"])
        print(f"\nsweep done, {args.time_limit - deadline.left():.0f} s; {path}")
        return 0
    print(f"{card} ({arch}), {dtype}: score = time of one step's calls of {[s[0] for s in shapes]}", flush=True)
    for i, m in enumerate(ms):
        if deadline.left() < 0:
            break
        r = sweep_gemm(m, shapes, device, dtype, reps, deadline, smoke, arch, mma)
        result["gemm"].append(r)
        save()
        base = r["table_step_s"]
        print(f"\n== GEMM M={m}: {len(r['results'])} configs; table's entry "
              f"{fmt_gemm(r['table'], r['table_planes'])}: {base * 1e6 if base else float('nan'):.0f} us/step")
        for x in r["results"][:8]:
            per = " ".join(f"{t * 1e6:6.1f}" for t in x["per_shape_s"].values())
            print(f"  {fmt_gemm(x['config'], x['planes'])}  {x['step_s'] * 1e6:7.0f} us/step  per call: {per}")
        if r["results"]:
            best_per = {s[0]: min(x["per_shape_s"][s[0]] for x in r["results"]) for s in shapes}
            print("  best per shape (us): " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in best_per.items()))
        if not args.no_moe and i == 0 and (smoke or m == 32):
            result["moe"] = sweep_moe(m, device, dtype, reps, deadline, smoke, arch, mma)
            save()
            print_moe(result["moe"])
        if not smoke and r["results"] and deadline.left() > 20:
            top = [(configs.GemmConfig(**x["config"]), x["planes"]) for x in r["results"][:3]]
            entry = (configs.GemmConfig(**r["table"]), r["table_planes"])
            heads = time_lm_head(m, [entry] + [t for t in top if t != entry], device, dtype, reps, deadline, mma)
            result["lm_head"][str(m)] = heads
            save()
            print("  lm_head 2048 -> 248320: " + "; ".join(
                f"{fmt_gemm(h['config'], h['planes'])} {h['s'] * 1e6:.0f} us" for h in heads if h["s"]))
    print(f"\nsweep done, {args.time_limit - deadline.left():.0f} s; {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
