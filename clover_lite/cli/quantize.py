"""`clover quantize` and `clover eval`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from clover_lite.cli.common import SEED, fail
from clover_lite.errors import CloverError


# Option values checked as click parses them, so a bad one is a usage error naming the option (exit 2) before
# anything is read or written.
def group_size_option(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value != -1 and value < 1:
        raise click.BadParameter(f"{value} is not a group size: use a positive one (128, 64, 32, ...) or -1 "
                                 "(per-channel)")
    return value


def _damp_percent(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not 0 < value <= 1:  # also false for NaN
        raise click.BadParameter(f"{value} is not a fraction in (0, 1]: use e.g. 0.01 (the usual) to 0.1")
    return value


def device_option(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """--device checked against this machine (an unknown name, CUDA without a GPU); the resolved device."""
    from clover_lite.runtime.device import resolve_device

    try:
        return str(resolve_device(value))
    except CloverError as e:
        raise click.BadParameter(str(e)) from e


# Options that only some methods read: given explicitly with another method they would be ignored silently.
CALIBRATION = ("calib", "calibration", "moe_calibration", "nsamples", "seqlen")
ONLY_FOR = {**{name: ("gptq", "rtn") for name in ("group_size", "asym", "checkpoint_format", *CALIBRATION)},
            **{name: ("gptq",) for name in ("no_act_order", "no_static_groups", "damp_percent",
                                            "min_expert_samples")}}


def _check_method_options(ctx: click.Context, method: str) -> None:
    from click.core import ParameterSource

    flags = {p.name: p.opts[0] for p in ctx.command.params}
    given = [name for name, methods in ONLY_FOR.items()
             if method not in methods and ctx.get_parameter_source(name) != ParameterSource.DEFAULT]
    if given:
        methods = sorted({m for name in given for m in ONLY_FOR[name]})
        raise click.UsageError(f"{', '.join(flags[n] for n in given)} appl{'ies' if len(given) == 1 else 'y'} to "
                               f"--method {'/'.join(methods)}, not {method}: leave "
                               f"{'it' if len(given) == 1 else 'them'} out")


@click.command()
@click.argument("src", type=click.Path())
@click.argument("out", type=click.Path())
@click.option("--method", type=click.Choice(["gptq", "rtn", "nf4"]), default="gptq", show_default=True,
              help="gptq (calibrated), rtn (round-to-nearest), nf4 (bitsandbytes baseline, no calibration).")
@click.option("--group-size", type=int, default=None, callback=group_size_option,
              help="Input channels per group; -1: per-channel. Default: 128, or the largest of 64, 32, 16 that "
                   "divides every layer.")
@click.option("--asym", is_flag=True, help="Asymmetric zeros (default: symmetric).")
@click.option("--no-act-order", is_flag=True, help="Quantize columns in their natural order.")
@click.option("--no-static-groups", is_flag=True, help="Group parameters found during GPTQ (changes g_idx).")
@click.option("--damp-percent", type=float, default=0.01, show_default=True, callback=_damp_percent,
              help="GPTQ's damping of the Hessian, a fraction of its mean diagonal.")
@click.option("--format", "checkpoint_format", type=click.Choice(["gptq", "gptq_v2"]), default="gptq",
              show_default=True, help="gptq (v1): zero stored minus one, what most loaders expect; gptq_v2: true zero.")
@click.option("--quantize-lm-head", is_flag=True, help="Quantize lm_head too (default: keep it 16-bit).")
@click.option("--calib", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Calibration text (plain text or JSONL); default: the Python standard library's sources.")
@click.option("--calibration", type=click.Choice(["diffusion", "clean"]), default="diffusion", show_default=True,
              help="diffusion: last block of each sample masked at 0.1..1.0, as the denoiser sees it.")
@click.option("--moe-calibration", type=click.Choice(["all", "routed"]), default="all", show_default=True,
              help="all: every token through every expert for the Hessians; routed: only routed tokens.")
@click.option("--min-expert-samples", type=click.IntRange(min=0), default=16, show_default=True,
              help="Experts with fewer calibration samples fall back to RTN (reported).")
@click.option("--nsamples", type=click.IntRange(min=1), default=128, show_default=True,
              help="Calibration windows.")
@click.option("--seqlen", type=click.IntRange(min=1), default=512, show_default=True,
              help="Tokens per calibration window (at most the model's context).")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--device", default="cpu", show_default=True, callback=device_option,
              help="Where the math runs (cuda when there is a GPU).")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its last finished layer.")
@click.option("--restart", is_flag=True, help="Discard an interrupted run's finished layers and start again.")
@click.option("--force", is_flag=True, help="Replace OUT if it is an earlier output of clover-lite (nothing else).")
def quantize(src, out, method, group_size, asym, no_act_order, no_static_groups, damp_percent, checkpoint_format,
             quantize_lm_head, calib, calibration, moe_calibration, min_expert_samples, nsamples, seqlen, seed,
             device, resume, restart, force) -> None:
    """Quantize the 16-bit checkpoint SRC to INT4 (GPTQ format) in OUT, one layer at a time."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Table

    from clover_lite.models.diffusion_gemma_config import is_diffusion_gemma_dir
    from clover_lite.quant.diffusion_gemma import quantize_diffusion_gemma
    from clover_lite.quant.pipeline import QuantizeOptions, partial_dir, quantize_model
    from clover_lite.tokenizer.tokenizer import has_tokenizer_files

    _check_method_options(click.get_current_context(), method)
    options = QuantizeOptions(
        method=method, group_size=group_size, sym=not asym, act_order=not no_act_order,
        static_groups=not no_static_groups, damp_percent=damp_percent, checkpoint_format=checkpoint_format,
        quantize_lm_head=quantize_lm_head, nsamples=nsamples, seqlen=seqlen, seed=seed, calib=calib,
        calibration=calibration, moe_calibration=moe_calibration, min_expert_samples=min_expert_samples,
        device=device,
    )
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("layers"),
               TimeRemainingColumn())
    finished = [0]  # layers finished by this run: what an interruption keeps
    try:
        with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
            task = bar.add_task("quantizing", total=None)

            def on_layer(i: int, n: int, info: dict) -> None:
                finished[0] += 1
                bar.update(task, completed=i + 1, total=n, description=f"layer {i + 1}/{n} ({info['kind']})")
                if not console.is_terminal:
                    errs = ", ".join(f"{k} {v:.4f}" for k, v in info["errors"].items())
                    click.echo(f"layer {i + 1}/{n} {info['kind']}: {info['seconds']:.1f} s"
                               + (f", relative error {errs}" if errs else ""), err=True)

            # DiffusionGemma (an encoder-decoder) has its own layer walk: docs/ARCHITECTURE.md section 11.
            run = quantize_diffusion_gemma if is_diffusion_gemma_dir(Path(src)) else quantize_model
            report = run(src, out, options, force=force, resume=resume, restart=restart, on_layer=on_layer)
    except KeyboardInterrupt:
        partial = partial_dir(Path(out))
        if partial.is_dir():
            click.echo(f"\ninterrupted ({out} was not written): the run so far is in {partial} "
                       f"({finished[0]} layer(s) finished here); rerun the same command with --resume to continue, "
                       "or with --restart (or delete that directory) to start over", err=True)
        else:
            click.echo(f"\ninterrupted before any output was written ({out} was not written)", err=True)
        sys.exit(130)
    except CloverError as e:
        fail(e)
    table = Table(title=f"{method} -> {report.out}", show_header=False)
    if report.nf4_blocksize is not None:
        table.add_row("NF4 block size", f"{report.nf4_blocksize} weights per absmax")
    else:
        table.add_row("group size", str(report.group_size) + (" (chosen to divide every layer)"
                                                               if group_size is None and report.group_size != 128
                                                               else ""))
    table.add_row("time", f"{report.seconds:.1f} s")
    table.add_row("size", f"{report.bytes_before / 2**20:.1f} MiB -> {report.bytes_after / 2**20:.1f} MiB "
                          f"({report.bytes_before / max(report.bytes_after, 1):.2f}x smaller)")
    for kind, err in sorted(report.error_by_kind.items()):
        table.add_row(f"rel. output error: {kind}", f"{err:.4f}")
    fb = report.fallback_experts
    table.add_row("experts on RTN fallback", ", ".join(fb[:10]) + (f" and {len(fb) - 10} more" if len(fb) > 10 else "")
                  if fb else "none")
    Console().print(table)
    if not has_tokenizer_files(report.out):  # NF4 needs none to calibrate
        click.echo(f"note: {src} has no tokenizer files, so {report.out} has none either: it takes token ids "
                   "only; copy tokenizer.json (or tokenizer.model) and tokenizer_config.json from the model it was "
                   "made from into it to give it text", err=True)


@click.command("eval")
@click.argument("model", type=click.Path())
@click.option("--against", "reference", type=click.Path(), default=None, help="The 16-bit reference model.")
@click.option("--text", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Held-out text (plain or JSONL); default: standard-library files never used for calibration.")
@click.option("--nsamples", type=click.IntRange(min=1), default=64, show_default=True, help="Evaluation windows.")
@click.option("--seqlen", type=click.IntRange(min=1), default=256, show_default=True,
              help="Tokens per window (at most the model's context).")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--device", default="auto", show_default=True, callback=device_option)
def eval_cmd(model, reference, text, nsamples, seqlen, seed, device) -> None:
    """Masked-token NLL of MODEL (and KL against --against) on held-out text, block-diffusion style. For
    DiffusionGemma: the NLL of the true tokens at renoised canvas positions after the window's committed text."""
    from rich.console import Console
    from rich.table import Table

    from clover_lite.models.config import load_config
    from clover_lite.quant.eval import check_window, evaluate
    from clover_lite.runtime.engine import load

    try:
        from clover_lite.models.diffusion_gemma_config import is_diffusion_gemma_dir

        dg = [bool(path) and is_diffusion_gemma_dir(Path(path)) for path in (model, reference)]
        found = [bool(path) and (Path(path) / "config.json").is_file() for path in (model, reference)]
        if reference and all(found) and dg[0] != dg[1]:  # a missing one: load says so
            raise CloverError(f"one of {model} and --against {reference} is a DiffusionGemma checkpoint and the other "
                              "is not; compare a model with the checkpoint it was quantized from")
        t = time.perf_counter()
        if dg[0]:  # renoised canvases instead of masked blocks (quant/eval_diffusion_gemma.py)
            from clover_lite.models.diffusion_gemma_config import load_diffusion_gemma_config
            from clover_lite.quant.eval_diffusion_gemma import check_window as check_canvas_window
            from clover_lite.quant.eval_diffusion_gemma import evaluate_diffusion_gemma

            for path, here in zip((model, reference), found, strict=True):
                if here:  # before loading: a window that does not fit is refused
                    cfg = load_diffusion_gemma_config(Path(path))
                    check_canvas_window(cfg.canvas_length, cfg.max_position_embeddings, seqlen)
            engine = load(model, device=device)
            ref = load(reference, device=device) if reference else None
            result = evaluate_diffusion_gemma(engine, ref, text, nsamples=nsamples, seqlen=seqlen, seed=seed)
        else:
            for path, here, other in zip((model, reference), found, dg, strict=True):
                if here and not other:  # else load says what is wrong with it
                    check_window(load_config(path), seqlen)  # before loading: a window past the context is refused
            # No decoding here: no CUDA-graph step, nor the cache sized to the free memory it would keep.
            engine = load(model, device=device, static_step=False)
            ref = load(reference, device=device, static_step=False) if reference else None
            result = evaluate(engine, ref, text, nsamples=nsamples, seqlen=seqlen, seed=seed)
    except CloverError as e:
        fail(e)
    table = Table(title=f"{model}" + (f" vs {reference}" if reference else ""))
    nll = "renoised-token NLL" if dg[0] else "masked-token NLL"
    for col in (nll, "reference NLL", "KL(ref || model)", "top-1 agreement", "positions"):
        table.add_column(col)
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    table.add_row(fmt(result.nll, ".4f"), fmt(result.ref_nll, ".4f"), fmt(result.kl, ".5f"),
                  fmt(result.top1_agreement, ".3f"), str(result.positions))
    Console().print(table)
    click.echo(f"({time.perf_counter() - t:.1f} s)", err=True)
