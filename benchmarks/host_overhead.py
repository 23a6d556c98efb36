"""Host time per step of the decoding loop (runtime.generation.denoise) with no model: a stub runner returns
precomputed logits (vocabulary 4096) and the fixed policy commits the same number of tokens every step, so what
is timed is the loop's own work: choosing, committing, stop checks and the text of every event.

Three ways to get that text, through the bundled model's tokenizer (byte-level BPE, vocabulary 4096):
  incremental     the engine's: Tokenizer.incremental_decoder, a few ids decoded per step
  no decode       decode=None, every text empty: the floor
  full re-decode  decode= a plain function, all generated ids decoded again at every step (the loop before)
The incremental and the full texts and ids must be identical; the script fails loudly if they are not.

    python benchmarks/host_overhead.py                          # 256, 2,048 and 8,192 new tokens
    python benchmarks/host_overhead.py --new-tokens 2048 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from clover_lite.runtime.engine import BUNDLED_MODEL
from clover_lite.runtime.generation import GenerationConfig, denoise, run_to_end
from clover_lite.tokenizer.tokenizer import Tokenizer

VARIANTS = ("incremental", "no decode", "full re-decode")


class StubRunner:
    """What denoise calls of a runner, with logits drawn once: a pool of random blocks served in turn."""

    device = torch.device("cpu")

    def __init__(self, vocab: int, block_size: int, seed: int, pool: int = 256):
        gen = torch.Generator().manual_seed(seed)
        self.logits = 4 * torch.randn(pool, block_size, vocab, generator=gen)
        self.calls = 0

    def reserve(self, total: int) -> None:
        pass

    def prefill(self, ids) -> None:
        pass

    def step(self, block, positions) -> torch.Tensor:
        self.calls += 1
        return self.logits[self.calls % len(self.logits), : len(positions)]

    def commit(self, block) -> int:
        return 0


def run(tok: Tokenizer, variant: str, prompt: list[int], cfg: GenerationConfig, seed: int):
    kw = {}
    if variant == "incremental":
        kw["detokenizer"] = tok.incremental_decoder(skip_special_tokens=True)
    elif variant == "full re-decode":
        kw["decode"] = lambda ids: tok.decode(ids, skip_special_tokens=True)
    runner = StubRunner(tok.vocab_size, cfg.block_size, seed)
    t = time.perf_counter()
    out = run_to_end(denoise(runner, prompt, cfg, tok.mask_token_id, tok.eos_token_ids, **kw))
    return out, (time.perf_counter() - t) / out.stats.forwards


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[256, 2048, 8192])
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell; the fastest is reported")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--tokens-per-step", type=int, default=1, help="committed every step (divides the block)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--stop", nargs="*", default=[], help="stop strings that never match (to time the search)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.block_size % args.tokens_per_step:
        ap.error("--tokens-per-step must divide --block-size")

    torch.set_num_threads(1)  # the work is small ops and Python: extra OpenMP threads only spin on a busy machine
    tok = Tokenizer.from_dir(BUNDLED_MODEL)
    prompt = tok.encode("Once upon a time, in a small town by the sea,")
    print(f"host ms per step: stub runner, vocab {tok.vocab_size}, block {args.block_size}, "
          f"{args.tokens_per_step} token(s) per step, the bundled tokenizer; fastest of {args.repeats}")
    print(f"{'new tokens':>10} " + " ".join(f"{v:>15}" for v in args.variants))
    warm = GenerationConfig(max_new_tokens=64, block_size=args.block_size, ignore_eos=True).resolved(None)
    for v in args.variants:  # first calls (allocator, tokenizer caches) out of the timings
        run(tok, v, prompt, warm, args.seed)
    rows, ok = [], True
    for n in args.new_tokens:
        cfg = GenerationConfig(max_new_tokens=n, block_size=args.block_size, policy="fixed", ignore_eos=True,
                               steps_per_block=args.block_size // args.tokens_per_step,
                               stop=tuple(args.stop)).resolved(None)
        times: dict[str, list[float]] = {v: [] for v in args.variants}
        outs = {}
        for _ in range(args.repeats):
            for v in args.variants:  # interleaved, so a busy moment of the machine slows every variant alike
                outs[v], per_step = run(tok, v, prompt, cfg, args.seed)
                times[v].append(per_step * 1e3)
        row = {"new_tokens": n}
        for v, ts in times.items():
            row[v] = {"ms_per_step": min(ts), "median_ms": statistics.median(ts), "runs_ms": ts,
                      "steps": outs[v].stats.forwards, "finish": outs[v].finish_reason}
        row["identical_text"] = len({(o.text, tuple(o.token_ids)) for v, o in outs.items() if v != "no decode"}) <= 1
        ok &= row["identical_text"] and all(o.finish_reason == "length" for o in outs.values())
        rows.append(row)
        print(f"{n:>10} " + " ".join(f"{row[v]['ms_per_step']:>15.3f}" for v in args.variants))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"block_size": args.block_size, "tokens_per_step": args.tokens_per_step,
                       "vocab": tok.vocab_size, "repeats": args.repeats, "rows": rows}, f, indent=2)
    if not ok:
        print("ERROR: the incremental and the full re-decode texts differ, or a run stopped early", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
