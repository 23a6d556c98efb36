"""DiffusionGemma: our canvas loop against transformers' generate, side by side on the same model in one run.

Both load the same tiny random checkpoint (written in the Hub layout by clover-lite, read by each from
disk), generate after the same prompt with the same seed, and must give identical tokens where our encoder
takes the prompt in one chunk, as transformers does (the script fails otherwise). A longer prompt is encoded
in chunks no longer than the sliding window (models/diffusion_gemma.py): the same math in another rounding
order (equal in float64), so the sampled tokens may part after a while. There the encoder's final states
must agree with transformers' one-pass states to 1e-4 of their largest value, and whether the tokens agree
is reported. Adaptive stopping and EOS are off (a random model never settles), so every canvas runs all its
steps and the times compare like for like. Reported per prompt length: seconds per canvas, generated
tokens/s, and our loop's encode (prefill) time of the prompt.

    python benchmarks/diffusion_gemma.py                            # prompts of 256 and 2K tokens, CPU
    python benchmarks/diffusion_gemma.py --prompt-lengths 256 --canvases 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from clover_lite.checkpoint.diffusion_gemma_weights import load_diffusion_gemma
from clover_lite.checkpoint.tiny_diffusion_gemma import write_tiny_diffusion_gemma
from clover_lite.models.diffusion_gemma import encode_chunk
from clover_lite.runtime.diffusion_gemma_loop import CanvasEvent, DiffusionGemmaSettings, DoneEvent, stream


def run_ours(model, prompt, settings, seed):
    t0 = time.perf_counter()
    marks, result = [], None
    for event in stream(model, prompt, settings, generator=torch.Generator().manual_seed(seed)):
        if isinstance(event, CanvasEvent):
            marks.append(time.perf_counter())
        elif isinstance(event, DoneEvent):
            result = event.result
    return result.tokens, time.perf_counter() - t0, marks, t0


def run_hf(hf, prompt, settings, seed):
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=settings.max_new_tokens,
                      max_denoising_steps=settings.max_denoising_steps, t_min=settings.t_min, t_max=settings.t_max,
                      stability_threshold=None, confidence_threshold=None)
    return out.sequences[0, len(prompt):].tolist(), time.perf_counter() - t0


def encoder_gap(ours, hf, prompt) -> float:
    """Largest |difference| of the encoder's final states over the prompt, relative to their largest value:
    ours (in chunks) against transformers' one pass. (In float64 the chunked encode equals the one-pass one
    exactly; in fp32 the fused attention's blocked softmax rounds in another order.)"""
    from transformers.cache_utils import DynamicCache

    ids = torch.tensor([prompt])
    with torch.no_grad():
        mine = ours.encode(ids, ours.new_cache())
        ref = hf.model.encoder(input_ids=ids, cache=DynamicCache(config=hf.config.get_text_config(decoder=True)))
    ref = ref.last_hidden_state
    return ((mine - ref).abs().max() / ref.abs().max()).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-lengths", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--canvases", type=int, default=2, help="canvases generated per prompt")
    ap.add_argument("--canvas-length", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12, help="denoising steps per canvas")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=6, help="five sliding layers then one full, repeated")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--sliding-window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: several reduce matmuls in a shape-dependent order, and logits that "
                         "differ by 1e-5 can flip a sampled token between the two loops)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.set_num_threads(args.threads)
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(args.layers)]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_diffusion_gemma(
            Path(tmp) / "dg", seed=args.seed, canvas_length=args.canvas_length, vocab_size=args.vocab,
            hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
            layer_types=types, head_dim=32, global_head_dim=64, moe_intermediate_size=args.hidden // 2,
            sliding_window=args.sliding_window, max_position_embeddings=max(args.prompt_lengths) * 2 + 4096)
        ours, _ = load_diffusion_gemma(path)
        hf = DiffusionGemmaForBlockDiffusion.from_pretrained(path).eval()
    hf.generation_config.eos_token_id = None  # no EOS on either side: every canvas is generated and timed
    settings = DiffusionGemmaSettings(max_new_tokens=args.canvases * args.canvas_length,
                                      max_denoising_steps=args.steps, stability_threshold=None,
                                      confidence_threshold=None)
    print(f"tiny random DiffusionGemma: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
          f"canvas {args.canvas_length} x {args.steps} steps, {args.canvases} canvases, "
          f"{torch.get_num_threads()} CPU threads")
    print(f"{'prompt':>7} {'ours s/canvas':>14} {'hf s/canvas':>12} {'ours tok/s':>11} {'hf tok/s':>9} "
          f"{'speed-up':>9} {'ours prefill s':>15} {'same tokens':>12}")
    gen = torch.Generator().manual_seed(args.seed)
    run_ours(ours, [5, 6, 7], settings, args.seed)  # warm-up, both
    run_hf(hf, [5, 6, 7], settings, args.seed)
    results, ok = [], True
    for n in args.prompt_lengths:
        prompt = torch.randint(3, 256, (n,), generator=gen).tolist()
        hf_tokens, t_hf = run_hf(hf, prompt, settings, args.seed)
        tokens, t_ours, marks, t0 = run_ours(ours, prompt, settings, args.seed)
        # our first canvas mark includes the prompt's encode; the per-canvas time is the mean over canvases
        canvas_s = [b - a for a, b in zip([t0, *marks[:-1]], marks, strict=True)]
        same = tokens == hf_tokens
        chunked = n > encode_chunk(ours.config)
        gap = encoder_gap(ours, hf, prompt) if chunked else None
        ok &= (gap < 1e-4) if chunked else same
        row = dict(prompt_tokens=n, new_tokens=len(tokens), ours_s=t_ours, hf_s=t_hf,
                   ours_s_per_canvas=t_ours / len(marks), hf_s_per_canvas=t_hf / len(marks),
                   ours_tok_s=len(tokens) / t_ours, hf_tok_s=len(hf_tokens) / t_hf,
                   ours_canvas_s=canvas_s, identical_tokens=same, chunked_encode=chunked, encoder_max_diff=gap)
        results.append(row)
        print(f"{n:>7} {row['ours_s_per_canvas']:>14.3f} {row['hf_s_per_canvas']:>12.3f} {row['ours_tok_s']:>11.1f} "
              f"{row['hf_tok_s']:>9.1f} {t_hf / t_ours:>8.2f}x {canvas_s[0] - canvas_s[-1]:>15.3f} {str(same):>12}"
              + (f"  (encoded in chunks: states within {gap:.1e} of transformers', relative)" if chunked else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    if not ok:
        print("FAIL: tokens differ between clover-lite and transformers (one-chunk prompt), or the chunked "
              "encoder's states differ from transformers' by 1e-4 (relative) or more", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
