"""The `clover` command: run, info, tiny."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import torch

from ..errors import CloverError


class TextStreamer:
    """Turns the growing 'text so far' of step events into chunks safe to print: it holds back a
    trailing partial UTF-8 character and anything that could still turn out to start a stop string."""

    def __init__(self, stop: tuple[str, ...] = ()):
        self.printed = ""
        self.hold = max((len(s) for s in stop), default=1) - 1

    def feed(self, text: str) -> str:
        text = text.rstrip("\ufffd")
        safe = text[: len(text) - self.hold] if self.hold else text
        if not safe.startswith(self.printed) or len(safe) <= len(self.printed):
            return ""
        chunk, self.printed = safe[len(self.printed) :], safe
        return chunk

    def finish(self, text: str) -> str:
        if text.startswith(self.printed):
            return text[len(self.printed) :]
        # Should not happen (text only grows); show the whole answer rather than a garbled one.
        return "\n" + text


def load_with_progress(path, **kwargs):
    """clover_lite.load with a progress bar on a terminal (stderr) and the loader's notes printed."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from ..engine import load

    console = Console(stderr=True)
    if not console.is_terminal:
        engine = load(path, **kwargs)
    else:
        columns = (TextColumn("loading"), BarColumn(), TextColumn("{task.completed}/{task.total} tensors"),
                   TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("load", total=None)
            engine = load(path, progress=lambda done, total: bar.update(task, completed=done, total=total), **kwargs)
    for note in engine.load_report.notes if engine.load_report else []:
        click.echo(f"note: {note}", err=True)
    return engine


def _fail(e: Exception) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="clover-lite")
def main() -> None:
    """clover-lite: run block-diffusion language models on one GPU (or slowly on a CPU)."""


def _decoding_options(f):
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
        click.option("--seed", type=int, default=None, help="Seed for sampling."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--commit", type=click.Choice(["exact", "reuse"]), default="exact", show_default=True,
                     help="How a finished block enters the cache: clean re-forward, or reuse its last step."),
    ]
    for opt in reversed(options):
        f = opt(f)
    return f


@main.command()
@click.argument("prompt")
@click.option("--model", "-m", "model_path", type=click.Path(), default=None,
              help="Model directory (default: the bundled model).")
@_decoding_options
@click.option("--raw", is_flag=True, help="Use the prompt as is, without the chat template.")
@click.option("--system", default=None, help="System message (chat template only).")
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on GPU).")
@click.option("--stats/--no-stats", default=True, show_default=True, help="Print speed statistics to stderr.")
def run(prompt, model_path, raw, system, device, dtype, stats, **decoding) -> None:
    """Generate a reply to PROMPT ('-' reads it from stdin) and stream it to stdout."""
    from ..generation import DoneEvent, StepEvent

    if prompt == "-":
        prompt = sys.stdin.read()
    try:
        engine = load_with_progress(model_path, device=device, dtype=dtype)
        use_chat = not raw and engine.tokenizer is not None and engine.tokenizer.has_chat_template
        if use_chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            request = messages
        else:
            request = prompt
        decoding["stop"] = tuple(decoding["stop"])
        streamer = TextStreamer(decoding["stop"])
        result = None
        for event in engine.stream(request, **decoding):
            if isinstance(event, StepEvent):
                chunk = streamer.feed(event.text)
                if chunk:
                    click.echo(chunk, nl=False)
            elif isinstance(event, DoneEvent):
                result = event.generation
                click.echo(streamer.finish(result.text))
    except CloverError as e:
        _fail(e)
    if stats and result is not None:
        s = result.stats
        click.echo(
            f"[{s.new_tokens} tokens, {s.tokens_per_second:.1f} tok/s, {s.tokens_per_forward:.2f} tokens/forward, "
            f"{s.forwards} forwards, prefill {s.prompt_tokens} tokens in {s.prefill_seconds:.2f} s, "
            f"finish: {result.finish_reason}]",
            err=True,
        )


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def layer_pattern(layer_types: tuple[str, ...]) -> str:
    """'3 x GDN + 1 x attention, repeated 10 times' style summary of the layer order."""
    letters = "".join("A" if t == "full_attention" else "G" for t in layer_types)
    for period in range(1, len(letters) + 1):
        if len(letters) % period == 0 and letters[:period] * (len(letters) // period) == letters:
            break
    unit = letters[:period]
    runs, i = [], 0
    while i < len(unit):
        j = i
        while j < len(unit) and unit[j] == unit[i]:
            j += 1
        runs.append(f"{j - i} x {'attention' if unit[i] == 'A' else 'GDN'}")
        i = j
    text = " + ".join(runs)
    reps = len(letters) // period
    return f"({text}) x {reps}  [{letters}]" if reps > 1 else f"{text}  [{letters}]"


@main.command()
@click.argument("path", type=click.Path())
def info(path) -> None:
    """Print a model's architecture, parameter counts and layer pattern (nothing is loaded)."""
    from rich.console import Console
    from rich.table import Table

    from ..loader import checkpoint_files, read_header
    from ..models.config import load_config
    from ..models.denoiser import Denoiser

    try:
        config = load_config(path)
        with torch.device("meta"):
            model = Denoiser(config)
        total, active = model.num_parameters()
        files = checkpoint_files(Path(path))
        dtypes = sorted({i.dtype for f in files for i in read_header(f).values()})
        size = sum(f.stat().st_size for f in files)
    except CloverError as e:
        _fail(e)
    c = config
    table = Table(title=f"{Path(path).name}", show_header=False)
    rows = [
        ("model type", c.model_type),
        ("parameters", f"{_count(total)} total, {_count(active)} active per token"),
        ("layers", f"{c.num_hidden_layers}: {layer_pattern(c.layer_types)}"),
        ("hidden size", str(c.hidden_size)),
        ("attention", f"{c.num_attention_heads} q heads, {c.num_key_value_heads} kv heads, head dim {c.head_dim}, "
                      f"RoPE on {c.rotary_dim} dims (theta {c.rope_theta:g}), output gate"),
    ]
    if c.gdn_layers:
        rows.append(("Gated DeltaNet", f"{c.linear_num_key_heads} qk heads x {c.linear_key_head_dim}, "
                                       f"{c.linear_num_value_heads} v heads x {c.linear_value_head_dim}, "
                                       f"conv {c.linear_conv_kernel_dim}"))
    if "moe" in c.mlp_types:
        shared = f" + shared expert {c.shared_expert_intermediate_size}" if c.shared_expert_intermediate_size else ""
        rows.append(("MoE", f"{c.num_experts} experts, top-{c.num_experts_per_tok}, "
                            f"intermediate {c.moe_intermediate_size}{shared}"))
    if "dense" in c.mlp_types:
        rows.append(("dense MLP", f"{c.mlp_types.count('dense')} layers, intermediate {c.intermediate_size}"))
    rows += [
        ("vocabulary", f"{c.vocab_size}" + (" (tied lm_head)" if c.tie_word_embeddings else "")),
        ("context", str(c.max_position_embeddings)),
        ("block diffusion", f"block size {c.block_size or 'not set'}, mask token {c.mask_token_id}"),
        ("weights", f"{len(files)} file(s), {size / 2**20:.1f} MiB, {', '.join(dtypes)}"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


@main.command()
@click.argument("out", type=click.Path())
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--block-size", type=int, default=4, show_default=True)
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
def tiny(out, seed, block_size, force) -> None:
    """Write a tiny random block-diffusion checkpoint to OUT, to try the runtime without a download."""
    from ..tiny import write_tiny_checkpoint

    try:
        path = write_tiny_checkpoint(out, seed=seed, force=force, block_size=block_size)
    except CloverError as e:
        _fail(e)
    click.echo(f"wrote a tiny random clover_moe model to {path} (random weights: the text it writes is noise)")


def _register() -> None:
    from .quantize import eval_cmd, quantize

    main.add_command(quantize)
    main.add_command(eval_cmd)


_register()

if __name__ == "__main__":
    main()
