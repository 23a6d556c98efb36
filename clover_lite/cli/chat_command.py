"""`clover chat`: the command, picking the session and loop for the model (block denoiser or DiffusionGemma)."""

from __future__ import annotations

import sys

import click

from clover_lite.cli.chat import (
    ChatLoop,
    ChatSession,
    PlainView,
    TerminalView,
    _plain_input,
    _readline_input,
    banner,
)
from clover_lite.cli.chat_canvas import CanvasChatLoop, canvas_banner, canvas_session
from clover_lite.cli.common import decoding_options, fail, load_options, load_with_progress, model_argument
from clover_lite.errors import CloverError
from clover_lite.runtime.diffusion_gemma_engine import DiffusionGemmaEngine
from clover_lite.runtime.generation import GenerationConfig


@click.command()
@click.argument("model", required=False, type=click.Path())
@click.option("--model", "-m", "model_path", type=click.Path(), default=None,
              help="Model directory (or give it as MODEL; default: the bundled model).")
@decoding_options
@click.option("--system", default=None, help="System message.")
@load_options
@click.option("--plain", is_flag=True, help="Plain text even on a terminal (no colours, no block drawing).")
def chat(model, model_path, system, device, dtype, context, plain, **decoding) -> None:
    """Chat with the model in directory MODEL (or --model; default: the bundled model). The reply streams as
    blocks are denoised; /help lists the commands.

    On a terminal each block is drawn with a placeholder per masked position that fills in as the denoiser
    commits tokens. With stdin or stdout not a terminal, messages are read line by line from stdin and
    replies are written as plain text (statistics on stderr)."""
    interactive = sys.stdin.isatty() and sys.stdout.isatty() and not plain
    model_path = model_argument(model, model_path)
    try:
        engine = load_with_progress(model_path, diffusion_gemma=True, device=device, dtype=dtype, context=context)
        if isinstance(engine, DiffusionGemmaEngine):  # canvases, and the sampler's own settings
            session, loop_class, title = canvas_session(engine, decoding, system), CanvasChatLoop, canvas_banner
        else:
            decoding["stop"] = tuple(decoding["stop"])
            session, loop_class, title = ChatSession(engine, GenerationConfig(**decoding), system), ChatLoop, banner
    except CloverError as e:
        fail(e)
    if interactive:
        from rich.console import Console

        view = TerminalView(Console(highlight=False))
        read = _readline_input()
    else:
        view = PlainView(sys.stdout, sys.stderr, prompts=sys.stdin.isatty())
        read = _plain_input(sys.stderr if sys.stdin.isatty() else None)
    view.banner(title(engine))
    code = loop_class(session, read, view, watch_fd=sys.stdin.fileno() if interactive else None,
                      strict=not sys.stdin.isatty()).run()
    if interactive:
        view.console.print()
    sys.exit(code)
