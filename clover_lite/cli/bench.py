"""`clover bench`: what a model does on this machine: tokens/s, tokens per forward, step and commit
latency, prefill speed and peak memory, on a checkpoint or on a named config with random weights made on
the device (no download: see what a card will do before fetching 70 GB).
"""

from __future__ import annotations

import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import click
import torch

from clover_lite.checkpoint.random_weights import ProgressFn, init_random_
from clover_lite.cli import bench_diffusion_gemma as dgbench
from clover_lite.cli.bench_table import latency_summary, report_table
from clover_lite.cli.common import SEED, given_on_command_line, not_for_diffusion_gemma
from clover_lite.cli.quantize import device_option, group_size_option
from clover_lite.errors import CloverError
from clover_lite.models.config import ModelConfig
from clover_lite.models.diffusion_gemma_config import is_diffusion_gemma_dir, load_diffusion_gemma_config
from clover_lite.planning.devices import fmt_bytes
from clover_lite.planning.memory import parse_quant
from clover_lite.planning.named_configs import NAMED_CONFIGS, named_config
from clover_lite.planning.planner import MemoryPlan, MemoryPlanError, meta_model, plan, ram_warning
from clover_lite.runtime.engine import Engine, on_device
from clover_lite.runtime.generation import DoneEvent, StepEvent


def random_model(config, quant: str, device: torch.device, dtype: torch.dtype | None = None, seed: int = 0,
                 progress: ProgressFn | None = None) -> torch.nn.Module:
    """The model `load` would build for `config` in format `quant`, allocated on `device` and filled with
    random weights there (nothing is read from disk)."""
    from clover_lite.kernels import dispatch

    model = meta_model(config, quant, dtype).to_empty(device=device)
    init_random_(model, seed, progress=progress)
    model.eval()
    dispatch.apply(model, dispatch.select(device))  # the kernels load() would pick (Triton on CUDA)
    return model


# ---- measurements ------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "peak CUDA memory allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss * (1 if sys.platform == "darwin" else 1024)), "peak RSS of the process, Python and torch included"


def _prompt_len(prompt_tokens: int, block_size: int) -> int:
    """The benchmark's prompt: whole blocks, at least one."""
    return max(block_size, prompt_tokens // block_size * block_size)


def bench_context(prompt_tokens: int, new_tokens: int, steps: int, block_size: int) -> int:
    """Positions a run of `run_bench` holds at most: its prompt, then the timed steps' commits or the
    generation, whichever is longer."""
    return _prompt_len(prompt_tokens, block_size) + max(new_tokens, (steps + 1) * block_size)


@torch.no_grad()
def run_bench(engine: Engine, block_size: int, prompt_tokens: int = 512, new_tokens: int = 128, steps: int = 16,
              threshold: float = 0.9, policy: str = "threshold", seed: int = 0,
              progress: ProgressFn | None = None) -> dict:
    """Time prefill, single denoising steps and commits, then a whole generation, on random token ids, as
    `clover run` runs them: in the engine's cache, each step through its CUDA graph when it has one (for
    this block size), with the model's device current (Triton launches on the current device)."""
    with on_device(engine.device):
        return _run_bench(engine, block_size, prompt_tokens, new_tokens, steps, threshold, policy, seed, progress)


def _run_bench(engine, block_size, prompt_tokens, new_tokens, steps, threshold, policy, seed, progress) -> dict:
    model, device, c, mask_token_id = engine.model, engine.device, engine.config, engine.mask_token_id
    B = block_size
    static = engine._static if engine._static is not None and engine._static.block_size == B else None
    cache = engine._cache if engine._cache is not None else model.new_cache()
    need = bench_context(prompt_tokens, new_tokens, steps, B)
    if engine._cache is not None and need > cache.capacity:  # growing it would move the graph's buffers
        raise CloverError(f"the engine's cache holds {cache.capacity} positions and this benchmark needs {need}; "
                          "load it with a longer context")
    gen = torch.Generator().manual_seed(seed)
    P = _prompt_len(prompt_tokens, B)

    def tokens(n: int) -> torch.Tensor:
        ids = torch.randint(0, c.vocab_size - 1, (1, n), generator=gen)
        ids[ids >= mask_token_id] += 1  # never the mask token
        return ids.to(device)

    masked = torch.full((1, B), mask_token_id, device=device)
    positions = torch.arange(B, device=device)

    def step() -> None:  # one denoising step of a fully masked block, as the decoding loop runs it
        if static is not None:
            static(masked)
        else:
            model.step(masked, cache, positions)

    # Warm-up: first calls allocate and pick kernels.
    cache.reset()
    cache.reserve(P + (steps + 1) * B)
    model.prefill(tokens(B), cache, B)
    step()
    _sync(device)

    cache.reset()
    ids = tokens(P)
    if progress:
        progress("prefill", 0, 1)
    _sync(device)
    t = time.perf_counter()
    model.prefill(ids, cache, B)
    _sync(device)
    prefill_s = time.perf_counter() - t
    if progress:
        progress("prefill", 1, 1)

    step_s, commit_s = [], []
    for i in range(steps):
        t = time.perf_counter()
        step()
        _sync(device)
        step_s.append(time.perf_counter() - t)
        block = tokens(B)
        t = time.perf_counter()
        model.commit(block, cache, B)
        _sync(device)
        commit_s.append(time.perf_counter() - t)
        if progress:
            progress("denoising steps and commits", i + 1, steps)

    done = 0
    result = None
    for event in engine.stream(tokens(P)[0].tolist(), max_new_tokens=new_tokens, block_size=B, threshold=threshold,
                               policy=policy, ignore_eos=True):
        if isinstance(event, StepEvent):
            done += len(event.committed)
            if progress:
                progress("generation", min(done, new_tokens), new_tokens)
        elif isinstance(event, DoneEvent):
            result = event.generation
    s = result.stats
    step_med, commit_med = statistics.median(step_s), statistics.median(commit_s)
    projection = [{"tokens_per_forward": k, "tokens_per_second": k / (step_med + commit_med * k / B)}
                  for k in (1, 2, 4, 8, 16, 32, 64) if k <= B]
    return {
        "block_size": B,
        "step_kind": "cuda graph" if static is not None and static.graph is not None
        else "static, eager" if static is not None else "eager",
        "prefill": {"tokens": P, "seconds": prefill_s, "tokens_per_second": P / prefill_s if prefill_s else 0.0},
        "step": latency_summary(step_s),
        "commit": latency_summary(commit_s),
        "generation": {"prompt_tokens": P, "new_tokens": s.new_tokens, "seconds": s.seconds - s.prefill_seconds,
                       "tokens_per_second": s.tokens_per_second, "tokens_per_forward": s.tokens_per_forward,
                       "forwards": s.forwards, "commit_forwards": s.commit_forwards, "policy": policy,
                       "threshold": threshold},
        "projection": projection,
    }


# ---- output ------------------------------------------------------------------------------------
def _table(report: dict):
    r, g = report, report["generation"]
    table = report_table(
        r, f"{r['quant']}, {r['dtype']}, block {r['block_size']}, {r['kernels']} kernels, {r['step_kind']} step, on "
           f"{r['device_name']}",
        f"{g['tokens_per_second']:.1f} tok/s, {g['tokens_per_forward']:.2f} tokens/forward ({g['new_tokens']} tokens, "
        f"{g['forwards']} forwards, {g['policy']} {g['threshold']})",
        ("step latency", "commit latency"), ("tokens/forward", "tokens_per_forward"))
    if r.get("random_weights"):
        table.add_row("note", "random weights: text is noise and a threshold policy commits ~1 token per forward; "
                              "the projection shows the speed at the tokens/forward a trained model reaches")
    return table


def write_plot(report: dict, path: Path) -> str | None:
    """A PNG of projected tokens/s against tokens per forward; None (and a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("--plot needs matplotlib, which is not a dependency of clover-lite (pip install matplotlib); "
                "the JSON has the same numbers")
    xs = [p["tokens_per_forward"] for p in report["projection"]]
    ys = [p["tokens_per_second"] for p in report["projection"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, ys, marker="o", label="projected from step + commit latency")
    g = report["generation"]
    ax.scatter([g["tokens_per_forward"]], [g["tokens_per_second"]], color="red", zorder=3, label="measured")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{report['model']} ({report['quant']}) on {report['device_name']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _smaller(p: MemoryPlan, random_weights: bool) -> str:
    """What bench's own options can do about memory: a shorter run, and 4-bit weights unless they already are."""
    advice = "use fewer --prompt-tokens or --new-tokens"
    if not p.scheme.quantized:
        advice += ", or --quant int4" if random_weights else ", or an INT4 checkpoint of it (clover quantize)"
    return advice


def _check_plan(p: MemoryPlan, device: torch.device, random_weights: bool) -> None:
    if device.type == "cuda" and not p.fits():
        raise MemoryPlanError(f"not building the model: it would run out of GPU memory.\n{p.message()}")
    if device.type == "cpu" and p.target.capacity and p.weight_bytes > p.target.capacity:
        raise MemoryPlanError(f"not building the model: the weights ({fmt_bytes(p.weight_bytes)}) exceed the "
                              f"available RAM ({fmt_bytes(p.target.capacity)}).\n{p.message()}")
    if device.type == "cpu" and p.target.capacity and p.total > p.target.capacity:
        raise MemoryPlanError(f"not running: the weights, cache and workspace ({fmt_bytes(p.total)}) exceed the "
                              f"available RAM ({fmt_bytes(p.target.capacity)}); {_smaller(p, random_weights)}."
                              f"\n{p.message()}")
    if device.type == "cpu" and ram_warning(p):  # the planner's rule of when to warn; bench's own advice
        click.echo(f"warning: this needs about {fmt_bytes(p.total)} of the {fmt_bytes(p.target.capacity)} of RAM "
                   "available now: the machine may swap, or the process be killed; close other programs, or "
                   f"{_smaller(p, random_weights)}", err=True)


def int4_group_size(cfg: ModelConfig, group_size: int | None) -> int:
    """The INT4 group size as `clover quantize` would take it for this config: None picks 128, or the largest
    of 64, 32, 16 that divides every layer; one that does not divide every layer's input features is refused
    naming those that do, before any weight is allocated."""
    from clover_lite.quant.checks import check_linear_shapes, linear_shapes
    from clover_lite.quant.options import QuantizeOptions

    options = QuantizeOptions(group_size=group_size)
    return check_linear_shapes(linear_shapes(meta_model(cfg, "fp32"), options), options).group_size


@click.command()
@click.argument("model", required=False, type=click.Path())
@click.option("--model", "-m", "model_path", type=click.Path(), default=None,
              help="A model directory (or give it as MODEL).")
@click.option("--config", "config_name", type=click.Choice(sorted(NAMED_CONFIGS)), default=None,
              help="A named config instead of a checkpoint (needs --random-weights).")
@click.option("--random-weights", is_flag=True, help="Random weights made on the device: nothing is downloaded.")
@click.option("--quant", type=click.Choice(["bf16", "fp16", "fp32", "int4", "nf4"]), default=None,
              help="Weight format with --random-weights (default: bf16 on a GPU, fp32 on a CPU). int4 = GPTQ.")
@click.option("--group-size", type=int, default=None, callback=group_size_option,
              help="INT4 group size with --quant int4 [default: 128, or the largest of 64, 32, 16 that divides every "
                   "layer].")
@click.option("--device", default="auto", show_default=True, callback=device_option)
@click.option("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on GPU).")
@click.option("--block-size", type=click.IntRange(min=1), default=None, help="Block size [default: the model's].")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=16, show_default=True,
              help="Timed denoising steps and commits.")
@click.option("--threshold", type=float, default=0.9, show_default=True)
@click.option("--policy", type=click.Choice(["threshold", "fixed"]), default="threshold", show_default=True)
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(), default=None,
              help="Also write the results as JSON to this file.")
@click.option("--plot", "plot_path", type=click.Path(), default=None,
              help="Also write a PNG (needs matplotlib, not a dependency).")
def bench(model, model_path, config_name, random_weights, quant, group_size, device, dtype, block_size, prompt_tokens,
          new_tokens, steps, threshold, policy, seed, json_path, plot_path) -> None:
    """Measure tokens/s, tokens per forward, step and commit latency, prefill speed and peak memory.

    On a checkpoint (MODEL or --model) or on a named config with random weights generated on the device
    (--config clover-35b-a3b --random-weights --quant int4): see what a card does before downloading."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from clover_lite.checkpoint.output import check_file_target, write_text_atomic
    from clover_lite.cli.common import fail, load_with_progress, model_argument
    from clover_lite.models.config import load_config
    from clover_lite.runtime.engine import resolve_device, resolve_dtype

    err = Console(stderr=True)
    model_path = model_argument(model, model_path)
    # Combinations that would be ignored or cannot run: usage errors, before anything is read.
    if (model_path is None) == (config_name is None):
        raise click.UsageError("give either a model directory (MODEL or --model PATH) or --config NAME "
                               "--random-weights")
    if config_name is not None and not random_weights:
        raise click.UsageError(f"the named config '{config_name}' has no weights: add --random-weights")
    if model_path is not None and quant is not None:
        raise click.UsageError("--quant applies to --random-weights; a checkpoint's format is its own "
                               "(clover quantize makes an INT4 one)")
    if model_path is not None and random_weights:
        raise click.UsageError("--random-weights applies to --config NAME; a checkpoint is benchmarked with its own "
                               "weights: leave --random-weights out")
    if group_size is not None and (model_path is not None or quant != "int4"):
        why = ("a checkpoint's format is its own" if model_path is not None
               else f"--quant {quant} has no groups" if quant else "the default format (fp32 or bf16) has no groups")
        raise click.UsageError(f"--group-size applies to --config NAME --random-weights --quant int4; {why}")
    diffusion_gemma = model_path is not None and is_diffusion_gemma_dir(Path(model_path))
    if diffusion_gemma:
        given = given_on_command_line(("block_size", "threshold", "policy"))
        if given or plot_path:
            raise not_for_diffusion_gemma(f"--{given[0].replace('_', '-')}" if given else "--plot",
                                          "the JSON has its steps-per-canvas projection")
    try:
        for target in (json_path, plot_path):  # before the run, not after it
            if target:
                check_file_target(target)
        dev = resolve_device(device)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
            tasks: dict[str, int] = {}

            def progress(stage: str, done: int, total: int) -> None:
                if stage not in tasks:
                    tasks[stage] = bar.add_task(stage, total=total)
                bar.update(tasks[stage], completed=done, total=total)

            if config_name is not None:
                cfg = named_config(config_name)
                q = quant or ("fp32" if dev.type == "cpu" else "bf16")
                if q == "int4":
                    group_size = int4_group_size(cfg, group_size)
                scheme = parse_quant(f"int4-g{group_size}" if q == "int4" else q)
                dt = resolve_dtype(dtype, dev) if scheme.quantized or dtype else None
                B = block_size or cfg.block_size or 4
                context = bench_context(prompt_tokens, new_tokens, steps, B)
                p = plan(cfg, scheme, context, dev, block_size=B, dtype=dt, _name=config_name)
                _check_plan(p, dev, random_weights=True)
                progress("initialising random weights", 0, 1)
                with on_device(dev):
                    model = random_model(cfg, scheme, dev, dt, seed, progress)
                    # As load() makes it: on CUDA with INT4 experts the step is captured as a CUDA graph.
                    engine = Engine(model, None, mask_token_id=cfg.mask_token_id, context=context)
                name, label = config_name, scheme.label()
            elif diffusion_gemma:  # canvases, not blocks: cli/bench_diffusion_gemma.py
                dg_cfg = load_diffusion_gemma_config(model_path)
                context = dgbench.bench_context(prompt_tokens, new_tokens, steps, dg_cfg.canvas_length)
                if context > dg_cfg.max_position_embeddings:
                    raise CloverError(f"this benchmark holds {context} positions (the prompt, then --steps or "
                                      f"--new-tokens in canvases of {dg_cfg.canvas_length}), over the model's context "
                                      f"of {dg_cfg.max_position_embeddings}; use fewer --prompt-tokens, --new-tokens "
                                      "or --steps")
                p = plan(model_path, None, context, dev, dtype=resolve_dtype(dtype, dev))
                _check_plan(p, dev, random_weights=False)
                engine = load_with_progress(model_path, diffusion_gemma=True, device=dev, dtype=dtype,
                                            check_memory=False)
                model = engine.model
                name, label = Path(model_path).name, p.scheme.label()
                report = dgbench.run_diffusion_gemma_bench(engine, prompt_tokens, new_tokens, steps, seed, progress)
                weights = model.decoder.embed_tokens.weight
            else:
                cfg = load_config(model_path)
                B = block_size or cfg.block_size or 4
                context = bench_context(prompt_tokens, new_tokens, steps, B)
                # Planned before loading: against the free memory the model will take, not what it leaves.
                p = plan(model_path, None, context, dev, block_size=B, dtype=resolve_dtype(dtype, dev))
                _check_plan(p, dev, random_weights=False)
                # Checked just now, with bench's advice: load's own check would repeat it with run's.
                engine = load_with_progress(model_path, device=dev, dtype=dtype, context=context, check_memory=False)
                model = engine.model
                name, label = Path(model_path).name, p.scheme.label()
                if engine.mask_token_id is None:
                    raise CloverError(f"{model_path}: the model has no mask token; it cannot be benchmarked")
            if not diffusion_gemma:
                report = run_bench(engine, B, prompt_tokens, new_tokens, steps, threshold, policy, seed, progress)
                weights = model.embed_tokens.weight
    except CloverError as e:
        fail(e)
    peak, kind = peak_memory(dev)
    report.update({
        "model": name, "random_weights": config_name is not None, "quant": label,
        "dtype": str(weights.dtype).replace("torch.", ""), "device": str(dev),
        "device_name": _device_name(dev), "torch": torch.__version__, "peak_memory_bytes": peak,
        "peak_memory_kind": kind, "plan": p.to_dict(), "kernels": getattr(model, "backend", "torch"),
    })
    Console().print(dgbench.table(report) if diffusion_gemma else _table(report))
    if json_path:
        try:
            write_text_atomic(json_path, json.dumps(report, indent=2, default=str))
        except CloverError as e:
            fail(e)
        click.echo(f"wrote {json_path}", err=True)
    if plot_path:
        msg = write_plot(report, Path(plot_path))
        click.echo(msg if msg else f"wrote {plot_path}", err=True)


__all__ = ["bench", "run_bench", "bench_context", "random_model", "init_random_", "write_plot", "peak_memory"]
