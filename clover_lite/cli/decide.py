"""`clover decide`: several questions about one context answered together, as a table or JSON."""

from __future__ import annotations

import json
import sys

import click

from clover_lite.cli.common import fail, load_with_progress, model_argument
from clover_lite.cli.terminal import for_stream
from clover_lite.errors import CloverError


def parse_question(text: str) -> tuple[str, list[str]]:
    """"name=opt1,opt2,..." -> (name, options); a bad one is a usage error showing the form."""
    name, sep, options = text.partition("=")
    if not sep or not name.strip() or not options.strip():
        raise click.UsageError(f"--question {text!r}: write it as name=option1,option2 (e.g. window=open,closed)")
    return name.strip(), [o.strip() for o in options.split(",")]


@click.command()
@click.argument("model", required=False)
@click.option("--model", "-m", "model_path", type=click.Path(), default=None,
              help="Model directory (or give it as MODEL; default: the bundled model).")
@click.option("--context", "-c", "context_text", required=True, help="What the questions are about ('-': stdin).")
@click.option("--question", "-q", "questions", multiple=True, required=True, metavar="NAME=OPT1,OPT2",
              help="A question and its allowed answers (repeatable).")
@click.option("--mode", type=click.Choice(["joint", "sequential"]), default="joint", show_default=True,
              help="joint: all questions in the same denoising forwards; sequential: one after another.")
@click.option("--threshold", type=float, default=0.9, show_default=True)
@click.option("--block-size", type=click.IntRange(min=1), default=None, help="Block size (default: the model's).")
@click.option("--json", "as_json", is_flag=True, help="Print the decision as JSON.")
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on GPU).")
def decide(model, model_path, context_text, questions, mode, threshold, block_size, as_json, device, dtype) -> None:
    """Answer several related questions about a context in one denoising pass, each answer one of its
    options: clover decide --context "cabin 31C, raining" -q window=open,closed -q ac=on,off"""
    pairs = [parse_question(q) for q in questions]
    names = [n for n, _ in pairs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise click.UsageError(f"question {dup[0]!r} is given more than once; give each question its own name")
    if context_text == "-":
        context_text = sys.stdin.read().removesuffix("\n").removesuffix("\r")  # the text, not its last newline
    try:
        engine = load_with_progress(model_argument(model, model_path), device=device, dtype=dtype)
        d = engine.decide(context_text, pairs, mode=mode, threshold=threshold, block_size=block_size)
    except CloverError as e:
        fail(e)
    if as_json:
        click.echo(json.dumps({"answers": d.answers, "confidence": d.confidence, "probabilities": d.probabilities,
                               "order": d.order,
                               "forwards": d.forwards, "commit_forwards": d.commit_forwards, "mode": d.mode,
                               "seconds": round(d.seconds, 4)}, indent=2))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    def cell(text: str) -> str:  # user and model text, never read as rich markup ("[red]", "[/b]")
        return escape(for_stream(text, sys.stdout))

    table = Table(title=f"{d.mode} decision: {d.forwards} forwards ({d.seconds * 1000:.0f} ms)")
    for col in ("question", "answer", "confidence", "p(answer)", "options (p)", "settled"):
        table.add_column(col)
    for name, options in pairs:
        probs = d.probabilities[name]
        table.add_row(cell(name), cell(d.answers[name]), f"{d.confidence[name]:.2f}", f"{probs[d.answers[name]]:.3g}",
                      ", ".join(f"{cell(o)} ({probs[o]:.2g})" for o in options),
                      str(d.order.index(name) + 1))
    Console().print(table)
