"""What the `clover` commands share: their option sets, loading with a progress bar, and error exits."""

from __future__ import annotations

import sys

import click

from clover_lite.errors import CloverError


def load_with_progress(path, diffusion_gemma: bool = False, **kwargs):
    """clover_lite.load with a progress bar on a terminal (stderr) and the loader's notes printed. A
    DiffusionGemma checkpoint is refused (one error line) unless the command runs it (`diffusion_gemma`)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from clover_lite.runtime.engine import load

    ctx = click.get_current_context(silent=True)
    if ctx is not None and CHECK_FINITE_KEY in ctx.meta:  # --no-check-finite (load_options)
        kwargs.setdefault("check_finite", ctx.meta[CHECK_FINITE_KEY])
    console = Console(stderr=True)
    if not console.is_terminal:
        engine = load(path, **kwargs)
    else:
        # The count shows once the loader knows how many tensors there are (before that: reading the headers).
        columns = (TextColumn("loading"), BarColumn(), TextColumn("{task.fields[count]}"), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("load", total=None, count="")
            engine = load(path, progress=lambda done, total: bar.update(
                task, completed=done, total=total, count=f"{done}/{total} tensors"), **kwargs)
    from clover_lite.runtime.diffusion_gemma_engine import DiffusionGemmaEngine

    if isinstance(engine, DiffusionGemmaEngine) and not diffusion_gemma:
        name = ctx.info_name if ctx is not None else "this command"
        fail(CloverError(f"{path}: a DiffusionGemma checkpoint; `clover run`, `chat`, `serve` and the Python API "
                         f"run it, `clover {name}` does not yet"))
    for note in engine.load_report.notes if engine.load_report else []:
        click.echo(f"note: {note}", err=True)
    return engine


# What torch.Generator.manual_seed takes: a --seed outside it is a usage error naming the range, not a traceback.
SEED = click.IntRange(-(2**63), 2**64 - 1)


def fail(e: Exception) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(1)


def decoding_options(f):
    options = [
        click.option("--max-new-tokens", "-n", type=int, default=256, show_default=True, help="Tokens to generate."),
        click.option("--block-size", type=int, default=None, help="Block size (default: the model's)."),
        click.option("--steps-per-block", type=int, default=None,
                     help="Steps per block for --policy fixed (default: one token per step)."),
        click.option("--policy", type=click.Choice(["threshold", "fixed"]), default="threshold", show_default=True),
        click.option("--threshold", type=float, default=0.9, show_default=True,
                     help="Commit every masked position more confident than this (threshold policy)."),
        click.option("--confidence", type=click.Choice(["prob", "margin", "entropy"]), default="prob",
                     show_default=True),
        click.option("--temperature", "-t", type=float, default=0.0, show_default=True, help="0 is greedy."),
        click.option("--top-k", type=int, default=0, show_default=True),
        click.option("--top-p", type=float, default=1.0, show_default=True),
        click.option("--seed", type=SEED, default=None, help="Seed for sampling."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--commit", type=click.Choice(["exact", "reuse"]), default="exact", show_default=True,
                     help="How a finished block enters the cache: clean re-forward, or reuse its last step."),
    ]
    for opt in reversed(options):
        f = opt(f)
    return f


CHECK_FINITE_KEY = "clover_lite.check_finite"


def _remember_check_finite(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    ctx.meta[CHECK_FINITE_KEY] = value


def load_options(f):
    """Where and how the engine is loaded: shared by run and chat. --check-finite/--no-check-finite is not
    passed to the command: it is kept in the click context, where load_with_progress reads it."""
    options = [
        click.option("--device", default="auto", show_default=True),
        click.option("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on GPU)."),
        click.option("--context", type=click.IntRange(min=1), default=None,
                     help="Positions (prompt + replies) the engine holds [default: with the CUDA-graph step (GPU, "
                          "INT4 experts) as many as fit, at most 32K; otherwise the model's limit]."),
        click.option("--check-finite/--no-check-finite", default=True, show_default=True, expose_value=False,
                     callback=_remember_check_finite,
                     help="Scan the weights for NaN/Inf while loading (off: faster for a very large checkpoint; "
                          "non-finite logits still stop generation with an error)."),
    ]
    for opt in reversed(options):
        f = opt(f)
    return f


def model_argument(positional: str | None, option: str | None) -> str | None:
    """The model directory given as MODEL or with --model (not both), or None for the bundled model."""
    if positional and option:
        raise click.UsageError(f"the model is given twice ('{positional}' and --model '{option}'): give it once")
    return positional or option


def given_on_command_line(names) -> list[str]:
    """Those of the current command's parameters `names` that the command line set (not defaults), sorted."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    return sorted(k for k in names if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE)


def not_for_diffusion_gemma(option: str, what_applies: str) -> click.UsageError:
    return click.UsageError(f"{option} does not apply to DiffusionGemma (it denoises whole canvases with its own "
                            f"sampler); {what_applies}")


def diffusion_gemma_options(decoding: dict) -> dict:
    """Of `run`/`chat`'s decoding options, those that apply to DiffusionGemma (-n when given, --seed); one
    given on the command line that does not apply is a usage error naming it."""
    given = given_on_command_line(decoding)
    wrong = [k for k in given if k not in ("max_new_tokens", "seed")]
    if wrong:
        raise not_for_diffusion_gemma(f"--{wrong[0].replace('_', '-')}", "of the decoding options -n and --seed apply")
    return {"seed": decoding.get("seed"),
            "max_new_tokens": decoding["max_new_tokens"] if "max_new_tokens" in given else None}



def count_label(n: int) -> str:
    """A parameter count for `clover info`: 7.60M, 35.12B."""
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


# Each layer type's letter and name in `clover info`'s layer pattern.
LAYER_NAMES = {"full_attention": ("A", "attention"), "linear_attention": ("G", "GDN"),
               "sliding_attention": ("S", "sliding")}


def layer_pattern(layer_types: tuple[str, ...], names: dict[str, tuple[str, str]] | None = None) -> str:
    """'(3 x GDN + 1 x attention) x 10  [GGGA...]': the layer order as its repeating unit; `names` maps a layer
    type to its (letter, name), LAYER_NAMES by default."""
    names = names or LAYER_NAMES
    letters = "".join(names[t][0] for t in layer_types)
    word = {letter: name for letter, name in names.values()}
    period = next(p for p in range(1, len(letters) + 1)
                  if len(letters) % p == 0 and letters[:p] * (len(letters) // p) == letters)
    unit, runs, i = letters[:period], [], 0
    while i < len(unit):
        j = i
        while j < len(unit) and unit[j] == unit[i]:
            j += 1
        runs.append(f"{j - i} x {word[unit[i]]}")
        i = j
    text, reps = " + ".join(runs), len(letters) // period
    return f"({text}) x {reps}  [{letters}]" if reps > 1 else f"{text}  [{letters}]"
