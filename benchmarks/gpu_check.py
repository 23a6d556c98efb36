"""A GPU session's report: what the tests cannot say, then the benchmarks, within 10 minutes; a short table last.

The kernels' correctness on the GPU is the test suite's (`pytest --device cuda`: every kernel test, tolerances
for the GPU's arithmetic, the model with its CUDA graphs); benchmarks/gpu_session.sh runs it before this.
What stays here is report, never a pass or fail:

- the divergence report: a tiny quantized model on the kernels against its torch path (fp32, the static step
  captured), its logits' relative difference, whether greedy tokens agree, and the first module (in
  execution order) whose output leaves the reference by more than 1e-3, then the three largest differences
  (`first_divergence`): where to look when tests/test_kernels_model.py's logits check fails;
- the kernel benchmark (kernels.py: issue 4's goals) with at most 60% of the time left under --time-limit,
  then the step benchmark (step.py) with the rest, each stopped at its share.

    python benchmarks/gpu_check.py                  # on the GPU machine (benchmarks/gpu_session.sh runs it)
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --smoke   # the same on a CPU, tiny and slow

Copy the final table, the benchmark tables, the card and the date into benchmarks/RESULTS.md.
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


def report_model(device, gen, smoke) -> str:
    """The tiny quantized model (groups of 32), kernels against torch in fp32: logits, greedy tokens, and where
    the two paths part (first_divergence). The tests assert the logits (tests/test_kernels_model.py); this says
    which module to look at."""
    import tempfile

    import clover_lite
    from clover_lite.checkpoint.tiny import write_tiny_checkpoint
    from clover_lite.quant.pipeline import QuantizeOptions, quantize_model

    with tempfile.TemporaryDirectory() as tmp:
        # --smoke: the two-layer cut (one GDN, one attention layer), the interpreter being slow
        cut = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]) if smoke else {}
        src = write_tiny_checkpoint(Path(tmp) / "src", seed=1, **cut)
        out = quantize_model(src, Path(tmp) / "q", QuantizeOptions(group_size=32, nsamples=4, seqlen=32)).out
        # The path is chosen at load: on CUDA load() captures the step's CUDA graph with it, so
        # switching kernels afterwards would leave generate() replaying the other path's graph.
        ref = clover_lite.load(out, device=device, dtype=torch.float32, kernels="torch")
        tri = clover_lite.load(out, device=device, dtype=torch.float32, kernels="triton", static_step=True,
                               context=64)
        ids = torch.randint(0, 256, (1, 40), generator=gen).to(device)
        with torch.no_grad():
            err = rel_err(tri.model(ids, block_size=4).float(), ref.model(ids, block_size=4).float())
        try:
            where = first_divergence(ref.model, tri.model, ids, block_size=4)
        except Exception as e:  # the report must not hide the numbers before it
            where = f"no report of where ({type(e).__name__}: {e})"
        tokens = "not compared (--smoke: a generation takes a minute in the interpreter)"
        if not smoke:
            a = ref.generate([5, 6, 7, 8, 9], max_new_tokens=16).token_ids
            b = tri.generate([5, 6, 7, 8, 9], max_new_tokens=16).token_ids
            same = sum(x == y for x, y in zip(a, b, strict=False))
            tokens = "identical" if a == b else f"{same}/{len(a)} equal"
    graphs = "" if tri._static is None or tri._static.graph is None else " (step captured as a CUDA graph)"
    return f"logits rel err {err:.1e}; greedy tokens {tokens}{graphs}; {where}"


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


REPORTS = [("tiny model, kernels vs torch", report_model)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU with TRITON_INTERPRET=1)")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--no-report", action="store_true", help="skip the divergence report")
    ap.add_argument("--no-poison", action="store_true",
                    help="run the report on torch.empty's memory as it comes, not poisoned (tests/poison_empty.py)")
    ap.add_argument("--time-limit", type=int, default=540,
                    help="seconds for the whole run; the benchmarks share what the report leaves")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    smoke = args.smoke or device.type == "cpu"
    gen = torch.Generator().manual_seed(1)  # the model test's inputs (tests/test_kernels_model.py)
    t0 = time.time()
    results = []
    # The report runs the tuning table's configs as they stand, even where CLOVER_AUTOTUNE=1 is set:
    # autotuning (dozens of candidate compiles per shape) would spend minutes of device time reporting nothing.
    autotune = os.environ.get("CLOVER_AUTOTUNE")
    os.environ["CLOVER_AUTOTUNE"] = "0"
    # Uninitialized memory is NaN (or an out-of-range index) during the report, as in every test: a kernel
    # that reads an element nobody wrote, in a path only a GPU runs (CUDA graphs, the tables' tiles), then
    # shows NaN where the caching allocator would have handed it a previous tensor's plausible values.
    poison = contextlib.nullcontext()
    if not args.no_poison and not args.no_report:
        try:
            poison = runpy.run_path(str(HERE.parent / "tests" / "poison_empty.py"))["poisoned_empty"]()
        except Exception as e:  # a check of the report must not cost the session its device call
            print(f"uninitialized memory not poisoned: {type(e).__name__}: {e}", flush=True)
            args.no_poison = True
    with poison:
        for name, fn in [] if args.no_report else REPORTS:
            t = time.time()
            try:
                results.append((name, "ok", fn(device, gen, smoke), time.time() - t))
            except Exception as e:  # report every report, then fail
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
    memory = ", torch.empty as it comes" if args.no_poison else ", uninitialized memory poisoned"
    print(f"\n== gpu_check on {card}, {time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s"
          f"{'' if args.no_report else memory} ==")
    for name, status, detail, secs in results:
        print(f"{status:>4}  {name:<32} {detail} ({secs:.1f} s)")
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
