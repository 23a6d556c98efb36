"""`clover bench` on a DiffusionGemma checkpoint: prefill (the encoder over the prompt), decoder step and
canvas-commit latency (a finished canvas appended to the prefix cache), a whole generation's tokens/s and
steps per canvas, and tokens/s projected by steps per canvas (its adaptive stop decides how many a trained
model takes; a random model never settles, so every canvas runs them all)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from clover_lite.cli.bench_table import latency_summary, report_table
from clover_lite.runtime.device import on_device
from clover_lite.runtime.diffusion_gemma_engine import DiffusionGemmaEngine
from clover_lite.runtime.diffusion_gemma_loop import DoneEvent, Session, StepEvent, image_token_ids, stream

ProgressFn = Callable[[str, int, int], None]


def bench_context(prompt_tokens: int, new_tokens: int, steps: int, canvas: int) -> int:
    """Positions a run holds at most: the prompt, then the timed commits' canvases or the generation's."""
    return prompt_tokens + max(steps, math.ceil(new_tokens / canvas)) * canvas


@torch.no_grad()
def run_diffusion_gemma_bench(engine: DiffusionGemmaEngine, prompt_tokens: int = 512, new_tokens: int = 128,
                              steps: int = 16, seed: int = 0, progress: ProgressFn | None = None) -> dict:
    """Time the prompt's encode, `steps` decoder steps and canvas commits, then a whole generation after the
    prompt (already cached, EOS ignored) with the checkpoint's own sampler settings, on random token ids."""
    model, C = engine.model, engine.canvas_length
    c = model.config
    device = model.decoder.embed_tokens.weight.device
    gen = torch.Generator().manual_seed(seed)
    image = torch.tensor(sorted(image_token_ids(c)), dtype=torch.long)

    def tokens(n: int) -> torch.Tensor:  # random ids, never an image placeholder (the text path refuses those)
        ids = torch.randint(0, c.vocab_size, (1, n), generator=gen)
        return torch.where(torch.isin(ids, image), 0, ids).to(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with on_device(device):
        warm = model.new_cache()  # first calls at each shape allocate and pick kernels (~0.5 s on a CPU)
        model.encode(tokens(prompt_tokens), warm)
        model.denoise(tokens(C), warm)
        model.encode(tokens(C), warm)
        sync()
        ids = tokens(prompt_tokens)
        cache = model.new_cache()
        sync()
        t = time.perf_counter()
        model.encode(ids, cache)
        sync()
        prefill_s = time.perf_counter() - t
        step_s, commit_s = [], []
        for i in range(steps):
            canvas = tokens(C)
            t = time.perf_counter()
            model.denoise(canvas, cache)
            sync()
            step_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            model.encode(canvas, cache)
            sync()
            commit_s.append(time.perf_counter() - t)
            if progress:
                progress("decoder steps and canvas commits", i + 1, steps)

        session = Session(model.new_cache(), ids[0].tolist())  # the prompt cached, as in a conversation
        model.encode(ids, session.cache)
        settings = replace(engine.settings, max_new_tokens=new_tokens, eos_token_ids=())
        N = settings.max_denoising_steps
        generator = torch.Generator(device=device).manual_seed(seed)
        done, result = 0, None
        sync()
        t = time.perf_counter()
        for event in stream(model, ids[0].tolist(), settings, session, generator):
            if isinstance(event, StepEvent):
                done += 1
                if progress:
                    progress("generation (decoder steps)", done, math.ceil(new_tokens / C) * N)
            elif isinstance(event, DoneEvent):
                result = event.result
        sync()
        seconds = time.perf_counter() - t
    n = len(result.tokens)
    step_med, commit_med = statistics.median(step_s), statistics.median(commit_s)
    projection = [{"steps_per_canvas": k, "tokens_per_second": C / (k * step_med + commit_med)}
                  for k in sorted({1, 2, 4, 8, 16, 32, 64, N}) if k <= N]
    return {
        "canvas_length": C,
        "max_denoising_steps": N,
        "prefill": {"tokens": prompt_tokens, "seconds": prefill_s,
                    "tokens_per_second": prompt_tokens / prefill_s if prefill_s else 0.0},
        "step": latency_summary(step_s),
        "commit": latency_summary(commit_s),
        "generation": {"prompt_tokens": prompt_tokens, "new_tokens": n, "seconds": seconds,
                       "tokens_per_second": n / seconds if seconds else 0.0,
                       "tokens_per_forward": result.tokens_per_forward, "forwards": result.steps,
                       "canvases": result.canvases, "steps_per_canvas": result.steps / result.canvases},
        "projection": projection,
    }


def table(report: dict):
    r, g = report, report["generation"]
    return report_table(
        r, f"{r['quant']}, {r['dtype']}, canvas {r['canvas_length']}, {r['kernels']} kernels, on {r['device_name']}",
        f"{g['tokens_per_second']:.1f} tok/s, {g['steps_per_canvas']:.1f} steps per canvas, "
        f"{g['tokens_per_forward']:.2f} tokens/forward ({g['new_tokens']} tokens: {g['canvases']} whole canvases, "
        f"{g['forwards']} decoder forwards)",
        ("decoder step", "canvas commit"), ("steps per canvas", "steps_per_canvas"))
