"""The `clover` command: run, info, tiny (chat, bench, quantize and eval are registered at the end)."""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import click
import torch

from clover_lite.cli.common import (
    SEED,
    count_label,
    decoding_options,
    fail,
    layer_pattern,
    load_options,
    load_with_progress,
    model_argument,
)
from clover_lite.cli.terminal import for_stream
from clover_lite.errors import CloverError, GenerationError
from clover_lite.runtime.text_stream import TextStreamer

# Commands defined in other modules, imported when used (`clover --help` imports them all). Lazy, so that
# `clover run` does not pay for importing the chat UI, the benchmark or the quantizer.
LAZY_COMMANDS = {
    "chat": (".chat_command", "chat"),
    "bench": (".bench", "bench"),
    "quantize": (".quantize", "quantize"),
    "eval": (".quantize", "eval_cmd"),
    "decide": (".decide", "decide"),
    "serve": (".serve", "serve"),
}


class CloverGroup(click.Group):
    def list_commands(self, ctx) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx, name):
        cmd = super().get_command(ctx, name)
        if cmd is None and name in LAZY_COMMANDS:
            import importlib

            module, attr = LAZY_COMMANDS[name]
            cmd = getattr(importlib.import_module(module, __package__), attr)
            self.add_command(cmd, name)
        return cmd


@click.group(cls=CloverGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="clover-lite")
@click.pass_context
def main(ctx: click.Context) -> None:
    """clover-lite: run block-diffusion language models on one GPU (or slowly on a CPU)."""
    # A library warning (e.g. a block size far from the trained one) is a note to the user, not a source line:
    # for this command only (catch_warnings restores the handler when the command ends).
    ctx.with_resource(warnings.catch_warnings())
    warnings.showwarning = _warning_as_note
    # A library's deprecation (e.g. bitsandbytes importing torch.jit.script_method, 14 lines when Python's
    # warnings are on) says nothing the user of the command can act on.
    warnings.simplefilter("ignore", DeprecationWarning)


def _warning_as_note(message, category, filename, lineno, file=None, line=None) -> None:
    click.echo(f"note: {message}", err=True)


def _is_model_dir(path: str) -> bool:
    return (Path(path) / "config.json").is_file()


def run_arguments(words: tuple[str, ...], option: str | None) -> tuple[str | None, str]:
    """`clover run`'s [MODEL] PROMPT: (model directory or None, prompt)."""
    model_first = _is_model_dir(words[0])
    if len(words) == 1 and model_first and option is None:
        raise click.UsageError(f"'{words[0]}' is a model directory: give a prompt after it, e.g. "
                               f"clover run {words[0]} \"Hello\"")
    if len(words) == 1:
        return option, words[0]
    if len(words) == 2 and model_first:
        return model_argument(words[0], option), words[1]
    rest = words[1:] if model_first else words
    why = f"expected [MODEL] PROMPT, got {len(words)} arguments"
    if len(words) == 2:
        why += f" ('{words[0]}' is not a model directory: it has no config.json)"
    suggestion = (f"{words[0]} " if model_first else "") + '"' + " ".join(rest) + '"'
    raise click.UsageError(f"{why}; quote a prompt of several words: clover run {suggestion}")


@main.command()
@click.argument("words", nargs=-1, required=True, metavar="[MODEL] PROMPT")
@click.option("--model", "-m", "model_path", type=click.Path(), default=None,
              help="Model directory (or give it before PROMPT; default: the bundled model).")
@decoding_options
@click.option("--raw", is_flag=True, help="Use the prompt as is, without the chat template.")
@click.option("--system", default=None, help="System message (chat template only).")
@load_options
@click.option("--stats/--no-stats", default=True, show_default=True, help="Print speed statistics to stderr.")
def run(words, model_path, raw, system, device, dtype, context, stats, **decoding) -> None:
    """Generate a reply to PROMPT ('-' reads it from stdin) and stream it to stdout, with the model in
    directory MODEL (or --model; default: the bundled model)."""
    from clover_lite.runtime.engine import Engine
    from clover_lite.runtime.generation import DoneEvent, StepEvent

    model_path, prompt = run_arguments(words, model_path)
    if raw and system is not None:
        raise click.UsageError("--system is a chat-template turn and --raw skips the template; leave out one of them")
    if prompt == "-":
        # `echo "..." | clover run -` means the line, not the line and a newline the model would then continue.
        prompt = sys.stdin.read().removesuffix("\n").removesuffix("\r")
    try:
        engine = load_with_progress(model_path, diffusion_gemma=True, device=device, dtype=dtype, context=context)
        use_chat = not raw and engine.tokenizer is not None and engine.tokenizer.has_chat_template
        if system is not None and not use_chat:
            raise click.UsageError("--system needs the model's chat template, and this model has none; put the "
                                   "instruction in the prompt instead")
        request = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ] if use_chat else prompt
        if not isinstance(engine, Engine):  # DiffusionGemma: its own loop and settings
            return run_diffusion_gemma(engine, request, not use_chat, stats, decoding)
        decoding["stop"] = tuple(decoding["stop"])
        ids = engine.encode_prompt(request, raw=not use_chat)
        decoding["max_new_tokens"] = fit_reply(len(ids), decoding["max_new_tokens"], engine.context_limit,
                                               engine.config.max_position_embeddings)
        streamer = TextStreamer(decoding["stop"])
        result = None
        for event in engine.stream(ids, **decoding):
            if isinstance(event, StepEvent):
                chunk = streamer.feed(event.text)
                if chunk:  # model text is untrusted: a terminal gets its control characters made visible
                    click.echo(for_stream(chunk, sys.stdout), nl=False)
            elif isinstance(event, DoneEvent):
                result = event.generation
                click.echo(for_stream(streamer.finish(result.text), sys.stdout))
    except CloverError as e:
        fail(e)
    if stats and result is not None:
        s = result.stats
        click.echo(
            f"[{s.new_tokens} tokens, {s.tokens_per_second:.1f} tok/s, {s.tokens_per_forward:.2f} tokens/forward, "
            f"{s.forwards} forwards, prefill {s.prompt_tokens} tokens in {s.prefill_seconds:.2f} s, "
            f"finish: {result.finish_reason}]",
            err=True,
        )


def run_diffusion_gemma(engine, request, raw: bool, stats: bool, decoding: dict) -> None:
    """`clover run` on a DiffusionGemma checkpoint: each canvas printed as it is finished. Of the decoding
    options only -n and --seed apply; another one given on the command line is an error naming it."""
    from clover_lite.cli.common import diffusion_gemma_options
    from clover_lite.runtime.diffusion_gemma_engine import DiffusionGemmaReply, TextEvent

    opts = diffusion_gemma_options(decoding)
    settings = {"max_new_tokens": opts["max_new_tokens"]} if opts["max_new_tokens"] is not None else {}
    streamer, reply, t0 = TextStreamer(), None, time.perf_counter()
    try:
        for event in engine.stream(request, raw=raw, seed=opts["seed"], **settings):
            if isinstance(event, TextEvent):
                chunk = streamer.feed(event.committed)
                if chunk:
                    click.echo(for_stream(chunk, sys.stdout), nl=False)
            elif isinstance(event, DiffusionGemmaReply):
                reply = event
                click.echo(for_stream(streamer.finish(reply.text), sys.stdout))
    except CloverError as e:
        fail(e)
    if stats and reply is not None:
        r, seconds = reply.result, time.perf_counter() - t0
        click.echo(f"[{len(r.tokens)} tokens in {seconds:.2f} s, {r.canvases} canvases, {r.steps} decoder forwards, "
                   f"{r.tokens_per_forward:.2f} tokens/forward, finish: {r.finish_reason}]", err=True)


def fit_reply(prompt_tokens: int, asked: int, context: int, model_limit: int) -> int:
    """The reply length that fits the context after the prompt (said on stderr when it is less than asked);
    only a prompt that fills the context by itself is refused."""
    room = context - prompt_tokens
    if room < 1:
        longer = (f" (or load with a longer --context: the model takes up to {model_limit})"
                  if context < model_limit else "")
        raise GenerationError(f"the prompt ({prompt_tokens} tokens) fills the {context}-token context by itself; "
                              f"shorten it{longer}")
    if asked > room:
        click.echo(f"note: the prompt is {prompt_tokens} tokens; the reply is limited to {room} tokens (asked "
                   f"{asked}) to fit the {context}-token context", err=True)
        return room
    return asked


@main.command()
@click.argument("path", required=False)
@click.option("--gpu", "gpus", multiple=True,
              help="A card to check (rtx3090, rtx4080, rtx4090, rtx5090, h200, gb300; repeatable): says what to change "
                   "if the model does not fit. Default: a fit table for every known card.")
@click.option("--context", type=click.IntRange(min=1), default=None,
              help="Context length to plan for (default: 8192, or the model's limit if that is shorter).")
@click.option("--quant", "quants", multiple=True,
              help="Plan another format: bf16, fp16, fp32, int4 (GPTQ g128), int4-gG, nf4 (repeatable, to compare; "
                   "default: the checkpoint's).")
@click.option("--quantize-lm-head", is_flag=True, help="With --quant int4/nf4: lm_head quantized too.")
@click.option("--block-size", type=click.IntRange(min=1), default=None, help="Block size (default: the model's).")
@click.option("--json", "as_json", is_flag=True, help="The plan as JSON instead of tables.")
def info(path, gpus, context, quants, quantize_lm_head, block_size, as_json) -> None:
    """A model's architecture, parameters and memory plan (nothing is loaded).

    PATH is a model directory, a named config (tiny, clover-35b-a3b, diffusiongemma-26b-a4b, ...) or clover-tiny,
    the bundled model (the default). The memory plan counts weights by
    format, the KV cache and GDN state at --context tokens, an activation-workspace estimate, the logits
    buffer and the CUDA context, and says on which known cards the model fits. For DiffusionGemma: the prefix
    cache (sliding layers keep their window), the canvas's buffers, its own workspace estimate."""
    import json

    from rich.console import Console
    from rich.table import Table

    from clover_lite.checkpoint.files import checkpoint_files, read_header
    from clover_lite.checkpoint.load import read_quant_config
    from clover_lite.cli.info_diffusion_gemma import info_rows
    from clover_lite.models.config import load_config
    from clover_lite.models.denoiser import Denoiser
    from clover_lite.planning import devices, memory, named_configs, planner
    from clover_lite.planning.diffusion_gemma import DG_WORKSPACE_FORMULA, diffusion_gemma_of
    from clover_lite.runtime.engine import BUNDLED_MODEL, default_model_path

    try:
        if path is None or (path == BUNDLED_MODEL.name and not Path(path).exists()):
            path = str(default_model_path())
        dg = diffusion_gemma_of(path)  # DiffusionGemma: its own config and plan (docs/ARCHITECTURE.md section 11)
        named = not Path(path).exists() and (path in named_configs.NAMED_CONFIGS or dg is not None)
        if dg is not None:
            config, stored = dg[0], dg[2]
        else:
            config = named_configs.named_config(path) if named else load_config(path)
            with torch.device("meta"):
                model = Denoiser(config)
            total, active = model.num_parameters()
        if named:
            files, dtypes, size, ckpt_quant = [], [], 0, None
        else:
            files = checkpoint_files(Path(path))
            dtypes = sorted({i.dtype for f in files for i in read_header(f).values()})
            size = sum(f.stat().st_size for f in files)
            ckpt_quant = read_quant_config(Path(path))
        if dg is None:  # a 16-bit checkpoint's format is the dtype its config declares
            stored = ckpt_quant or memory.DTYPE_NAMES.get(str(config.torch_dtype or "").replace("torch.", ""))
        schemes = [memory.parse_quant(q) for q in quants] or [memory.parse_quant(stored)]
        if quantize_lm_head:
            schemes = [s.replace(lm_head=True) if s.quantized else s for s in schemes]
        if dg is None:
            check_group_sizes(model, schemes)
        if context is None:
            context = min(DEFAULT_PLAN_CONTEXT, config.max_position_embeddings)
        cards = [devices.normalize_gpu_name(g) or g for g in gpus]
        unknown = [g for g in cards if g not in devices.KNOWN_GPUS]
        if unknown:
            raise CloverError(f"unknown GPU '{unknown[0]}'; known: {', '.join(devices.KNOWN_GPUS)}")
        plans = [planner.plan(config, s, context, None, block_size=block_size, _name=Path(path).name)
                 for s in schemes]
    except CloverError as e:
        fail(e)
    if as_json:
        out = []
        for p in plans:
            d = p.to_dict()
            d["cards"] = {}
            for k in cards or devices.KNOWN_GPUS:
                q = planner.plan(config, p.scheme, context, k, block_size=block_size)
                d["cards"][k] = {"usable_bytes": devices.KNOWN_GPUS[k].usable, "fits": q.fits(),
                                 "max_context": q.max_context(devices.KNOWN_GPUS[k].usable),
                                 "suggestions": q.suggestions()}
            out.append(d)
        click.echo(json.dumps(out if len(out) > 1 else out[0], indent=2))
        return
    c = config
    console = Console()
    table = Table(title=f"{Path(path).name}", show_header=False)
    weights = (f"{len(files)} file(s), {size / 2**20:.1f} MiB, {', '.join(dtypes)}" if files
               else "none (a named config)")
    rows = info_rows(c, weights) if dg is not None else denoiser_info_rows(c, total, active, weights)
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    console.print(_plan_table(plans))
    console.print(_cards_table(plans, cards, context, block_size))
    if context > c.max_position_embeddings:
        console.print(f"note: --context {context} is longer than the model's {c.max_position_embeddings}",
                      style="yellow", markup=False)
    formula = DG_WORKSPACE_FORMULA if dg is not None else memory.WORKSPACE_FORMULA
    console.print("activation workspace:\n" + formula, style="dim", markup=False, highlight=False)
    for key in cards:
        for p in plans:
            q = planner.plan(config, p.scheme, context, key, block_size=block_size, _name=p.model)
            console.print(f"{devices.KNOWN_GPUS[key].name}, {p.scheme.label()}: {q.verdict()}", markup=False,
                          highlight=False, style="green" if q.fits() else "red")
            for s in q.suggestions():
                console.print(f"  - {s}", markup=False, highlight=False)


DEFAULT_PLAN_CONTEXT = 8192


def check_group_sizes(model, schemes) -> None:
    """CloverError for an INT4 group size that does not divide every layer `clover quantize` would pack."""
    from clover_lite.quant.checks import fitting_group_sizes, linear_shapes
    from clover_lite.quant.options import QuantizeOptions

    for s in schemes:
        if s.kind != "int4" or s.group_size == -1:
            continue
        shapes = linear_shapes(model, QuantizeOptions(quantize_lm_head=s.lm_head))
        if any(k % s.group_size for _, k in shapes.values()):
            fits = ", ".join(f"int4-g{g}" for g in fitting_group_sizes(shapes)) or "none of 128/64/32/16"
            raise CloverError(f"int4-g{s.group_size}: group size {s.group_size} does not divide every layer of "
                              f"this model; groups that do: {fits}, or int4-g-1 (per channel)")


def denoiser_info_rows(c, total: int, active: int, weights: str) -> list[tuple[str, str]]:
    """`clover info`'s (label, value) rows for a block denoiser; `weights` says what the checkpoint's files hold
    (DiffusionGemma's rows: cli/info_diffusion_gemma.py)."""
    rows = [
        ("model type", c.model_type),
        ("parameters", f"{count_label(total)} total, {count_label(active)} active per token"),
        ("layers", f"{c.num_hidden_layers}: {layer_pattern(c.layer_types)}"),
        ("hidden size", str(c.hidden_size)),
        ("attention", f"{c.num_attention_heads} q heads, {c.num_key_value_heads} kv heads, head dim {c.head_dim}, "
                      f"RoPE on {c.rotary_dim} dims (theta {c.rope_theta:g})"
                      + (", output gate" if c.attention_output_gate else "")),
    ]
    if c.gdn_layers:
        rows.append(("Gated DeltaNet", f"{c.linear_num_key_heads} qk heads x {c.linear_key_head_dim}, "
                                       f"{c.linear_num_value_heads} v heads x {c.linear_value_head_dim}, "
                                       f"conv {c.linear_conv_kernel_dim}"))
    if "moe" in c.mlp_types:
        shared = f" + shared expert {c.shared_expert_intermediate_size}" if c.shared_expert_intermediate_size else ""
        rows.append(("MoE", f"{c.num_experts} experts, top-{c.num_experts_per_tok} ({c.router} router), "
                            f"intermediate {c.moe_intermediate_size}{shared}"))
    if "dense" in c.mlp_types:
        rows.append(("dense MLP", f"{c.mlp_types.count('dense')} layers, intermediate {c.intermediate_size}"))
    return rows + [
        ("vocabulary", f"{c.vocab_size}" + (" (tied lm_head)" if c.tie_word_embeddings else "")),
        ("context", str(c.max_position_embeddings)),
        ("block diffusion", f"block size {c.block_size or 'not set'}, mask token {c.mask_token_id}"),
        ("weights", weights),
    ]


def _plan_table(plans):
    """Component | bytes per plan | how it is counted (for the last plan: with --quant bf16 --quant int4, the
    INT4 one's breakdown of qweight / scales / qzeros / g_idx)."""
    from rich.table import Table

    from clover_lite.planning.devices import fmt_bytes

    p0, last = plans[0], plans[-1]
    title = f"memory plan at {p0.context_len} tokens of context, {p0.step_label}, activations {p0.dtype}"
    table = Table(title=title)
    table.add_column("component")
    for p in plans:
        table.add_column(p.scheme.label(), justify="right")
    table.add_column("how it is counted" + (f" ({last.scheme.label()})" if len(plans) > 1 else ""))
    names = list(dict.fromkeys(name for p in plans for name, _, _ in p.rows()))
    for name in names:
        cells = []
        for p in plans:
            match = [b for n, b, _ in p.rows() if n == name]
            cells.append(fmt_bytes(match[0]) if match else "-")
        cells.append(next((d for n, _, d in last.rows() if n == name), ""))
        table.add_row(name, *cells)
    table.add_row("total", *[fmt_bytes(p.total) for p in plans], "", style="bold")
    return table


def _cards_table(plans, cards, context, block_size):
    from rich.table import Table

    from clover_lite.planning import devices, planner

    table = Table(title="known cards (usable = capacity - reserve; the total includes the CUDA context)")
    table.add_column("card")
    table.add_column("usable", justify="right")
    for p in plans:
        table.add_column(p.scheme.label(), justify="center")
    for key in cards or devices.KNOWN_GPUS:
        g = devices.KNOWN_GPUS[key]
        cells = []
        for p in plans:
            q = planner.plan(p.config, p.scheme, context, key, block_size=block_size)
            n = q.max_context(g.usable)
            if q.fits():
                cells.append(f"[green]fits[/] (up to {n} tokens)")
            elif n:
                cells.append(f"[red]no[/] (up to {n} tokens)")
            else:
                cells.append("[red]no[/] (weights too large)")
        table.add_row(g.name, devices.fmt_bytes(g.usable), *cells)
    return table


@main.command()
@click.argument("out", type=click.Path())
@click.option("--family", type=click.Choice(["clover_moe", "sdar", "sdar_moe", "llada2", "diffusion_gemma"]),
              default="clover_moe",
              show_default=True, help="Which model family, in its own Hub layout, tokenizer and defaults.")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--block-size", type=click.IntRange(min=1), default=None,
              help="Block size [default: 4; LLaDA2: 32].")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
def tiny(out, family, seed, block_size, force) -> None:
    """Write a tiny random block-diffusion checkpoint to OUT, to try the runtime without a download."""
    from clover_lite.checkpoint.tiny import write_tiny_checkpoint
    from clover_lite.checkpoint.tiny_families import write_family_checkpoint

    extra = {} if block_size is None else {"block_size": block_size}
    try:
        if family == "clover_moe":
            path = write_tiny_checkpoint(out, seed=seed, force=force, block_size=block_size or 4)
        elif family == "diffusion_gemma":
            if block_size is not None:
                raise click.UsageError("--block-size does not apply to DiffusionGemma (it denoises whole canvases)")
            from clover_lite.checkpoint.tiny_diffusion_gemma import write_tiny_diffusion_gemma

            path = write_tiny_diffusion_gemma(out, seed=seed, force=force)
        else:
            path = write_family_checkpoint(out, family, seed=seed, force=force, **extra)
    except CloverError as e:
        fail(e)
    click.echo(f"wrote a tiny random {family} model to {path} (random weights: the text it writes is noise)")


def _register() -> None:
    """Register every command now (the group also loads them lazily on first use; see LAZY_COMMANDS)."""
    import importlib

    for name, (module, attr) in LAZY_COMMANDS.items():
        if name not in main.commands:
            main.add_command(getattr(importlib.import_module(module, __package__), attr), name)


if __name__ == "__main__":
    main()
