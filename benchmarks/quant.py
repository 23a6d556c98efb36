"""Quantization methods side by side: RTN, GPTQ and NF4 against the 16-bit model, in one run.

For each method: quantization time, size on disk, and on held-out text (standard-library files never used
for calibration) the masked-token NLL, KL(16-bit || quantized) and top-1 agreement, block-diffusion style.

    python benchmarks/quant.py                          # the bundled model (or a tiny random one)
    python benchmarks/quant.py --model DIR --group-size 128 --nsamples 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import clover_lite
from clover_lite.checkpoint.tiny import write_tiny_checkpoint
from clover_lite.quant.eval import evaluate
from clover_lite.quant.pipeline import QuantizeOptions, quantize_model
from clover_lite.runtime.engine import BUNDLED_MODEL


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="16-bit model directory (default: the bundled model, else a tiny random one)")
    ap.add_argument("--methods", nargs="+", default=["rtn", "gptq", "nf4"])
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--nsamples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=128)
    ap.add_argument("--eval-seqlen", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="write the table here")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            src = Path(args.model)
        elif (BUNDLED_MODEL / "config.json").exists():
            src = BUNDLED_MODEL
        else:
            src = write_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        ref = clover_lite.load(src, device=args.device, static_step=False)  # no decoding
        eval_kw = dict(nsamples=args.eval_samples, seqlen=args.eval_seqlen)
        base = evaluate(ref, None, **eval_kw)
        size16 = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        rows = [{"method": "16-bit", "seconds": 0.0, "mib": size16 / 2**20, "nll": base.nll, "kl": 0.0,
                 "top1": 1.0}]
        for method in args.methods:
            opts = QuantizeOptions(method=method, group_size=args.group_size, nsamples=args.nsamples,
                                   seqlen=args.seqlen, device=args.device)
            t = time.perf_counter()
            report = quantize_model(src, Path(tmp) / method, opts)
            seconds = time.perf_counter() - t
            res = evaluate(clover_lite.load(report.out, device=args.device, static_step=False), ref, **eval_kw)
            rows.append({"method": method, "seconds": seconds, "mib": report.bytes_after / 2**20, "nll": res.nll,
                         "kl": res.kl, "top1": res.top1_agreement, "layer_error": report.error_by_kind})
    print(f"model: {src}  group size {args.group_size}, calibration {args.nsamples} x {args.seqlen}, "
          f"eval {args.eval_samples} windows of {args.eval_seqlen} ({base.positions} masked positions)")
    print(f"{'method':>8} {'quant s':>8} {'MiB':>8} {'NLL':>8} {'KL':>9} {'top-1':>7}")
    for r in rows:
        print(f"{r['method']:>8} {r['seconds']:>8.1f} {r['mib']:>8.2f} {r['nll']:>8.4f} {r['kl']:>9.5f} "
              f"{r['top1']:>7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(src), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
