"""Cached block decoding vs re-decoding the whole sequence at every step, side by side in one run.

The baseline is what llama.cpp's diffusion CLI and LLaDA's reference loop do: every denoising step runs
the prompt + committed blocks + current block again. Both paths must produce identical tokens; the
script fails loudly if they do not.

    python benchmarks/cache.py                      # tiny random model, prompts of 128, 1K and 4K tokens
    python benchmarks/cache.py --model DIR --prompt-lengths 512 2048 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

import clover_lite
from clover_lite.checkpoint.tiny import write_tiny_checkpoint
from clover_lite.runtime.generation import CachedRunner, RecomputeRunner, denoise, run_to_end


def timed(runner, prompt, cfg, engine):
    t = time.perf_counter()
    out = run_to_end(denoise(runner, prompt, cfg, engine.mask_token_id, engine.eos_token_ids))
    return out, time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: a tiny random clover_moe model)")
    ap.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or write_tiny_checkpoint(f"{tmp}/tiny", seed=args.seed)
        engine = clover_lite.load(path, device=args.device)
    cfg = engine.resolve_config(max_new_tokens=args.new_tokens, block_size=args.block_size, ignore_eos=True)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = min(engine.config.vocab_size, 256) if args.model is None else engine.config.vocab_size
    results = []
    print(f"model {path if args.model else 'tiny random clover_moe'} on {engine.device}, block {cfg.block_size}, "
          f"{args.new_tokens} new tokens, greedy")
    print(f"{'prompt':>7} {'cached s':>9} {'re-decode s':>12} {'speed-up':>9} {'forwards':>9} {'same tokens':>12}")
    ok = True
    for n in args.prompt_lengths:
        prompt = torch.randint(0, vocab, (n,), generator=gen).tolist()
        prompt = [t if t != engine.mask_token_id else 0 for t in prompt]
        timed(CachedRunner(engine.model, cfg.block_size), prompt[:8], cfg, engine)  # warm-up
        cached, t_cached = timed(CachedRunner(engine.model, cfg.block_size), prompt, cfg, engine)
        full, t_full = timed(RecomputeRunner(engine.model, cfg.block_size), prompt, cfg, engine)
        same = cached.token_ids == full.token_ids
        ok &= same
        print(f"{n:>7} {t_cached:>9.3f} {t_full:>12.3f} {t_full / t_cached:>8.1f}x {cached.stats.forwards:>9} "
              f"{str(same):>12}")
        results.append({"prompt_tokens": n, "cached_s": t_cached, "redecode_s": t_full,
                        "speedup": t_full / t_cached, "forwards": cached.stats.forwards,
                        "new_tokens": len(cached.token_ids), "identical_tokens": same,
                        "tokens": cached.token_ids})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(engine.device), "block_size": cfg.block_size, "results": results}, f, indent=2)
    if not ok:
        print("ERROR: the cached path and the re-decode produced different tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
