"""`clover chat` on a DiffusionGemma checkpoint: the same loop and views, replies written canvas by canvas.

DiffusionGemma denoises whole canvases with its own sampler, so the session holds its settings
(runtime/diffusion_gemma_loop.DiffusionGemmaSettings, plus a seed) instead of a GenerationConfig, and a
reply shows each canvas when it is finished. The engine's prefix-cache session carries over between turns:
a new turn whose tokens extend the last one's encodes only what is new.
"""

from __future__ import annotations

import time
from dataclasses import fields, replace

from clover_lite.cli.chat import ChatLoop, ChatSession, ReplyStats, chat_help
from clover_lite.errors import CloverError, GenerationError
from clover_lite.runtime.diffusion_gemma_engine import DiffusionGemmaReply, TextEvent

# /set KEY -> DiffusionGemmaSettings field (or the seed); each one's parser
CANVAS_SETTINGS = {
    "max": ("max_new_tokens", int), "max_new_tokens": ("max_new_tokens", int), "n": ("max_new_tokens", int),
    "steps": ("max_denoising_steps", int), "max_denoising_steps": ("max_denoising_steps", int),
    "entropy_bound": ("entropy_bound", float), "bound": ("entropy_bound", float),
    "t_min": ("t_min", float), "t_max": ("t_max", float),
    "stability": ("stability_threshold", int), "stability_threshold": ("stability_threshold", int),
    "confidence": ("confidence_threshold", float), "confidence_threshold": ("confidence_threshold", float),
    "seed": ("seed", int),
}
SHOWN = ("max_new_tokens", "max_denoising_steps", "entropy_bound", "t_min", "t_max", "stability_threshold",
         "confidence_threshold")


class CanvasChatSession(ChatSession):
    """A ChatSession whose settings are DiffusionGemma's; messages, commands and statistics as the base's."""

    help = chat_help("The reply is written a canvas at a time: each canvas shows once it is denoised.",
                     "max (max tokens), steps (denoising steps per canvas), entropy_bound, t_min, t_max, "
                     "stability, confidence, seed")

    def __init__(self, engine, seed: int | None = None, max_new_tokens: int | None = None,
                 system: str | None = None):
        self.seed = seed
        super().__init__(engine, None, system)
        if max_new_tokens is not None:
            self.config = replace(self.config, max_new_tokens=max_new_tokens).checked()

    def initial_config(self, config):
        return self.engine.settings

    def request(self, user_text: str):
        ids = self.prompt_ids(user_text)
        if len(ids) >= self.engine.context_limit:
            raise GenerationError(f"the conversation ({len(ids)} tokens) fills the context "
                                  f"({self.engine.context_limit} tokens); /reset to start over")
        return ids, self.config

    def set(self, key: str, value: str) -> str:
        entry = CANVAS_SETTINGS.get(key.lower())
        if entry is None:
            raise GenerationError(f"unknown setting '{key}' for DiffusionGemma; settings: "
                                  "max, steps, entropy_bound, t_min, t_max, stability, confidence, seed")
        name, parse = entry
        raw = value.strip()
        if name in ("seed", "stability_threshold", "confidence_threshold") and raw.lower() in ("none", "default"):
            parsed = None
        else:
            try:
                parsed = parse(raw)
            except ValueError:
                what = "a whole number" if parse is int else "a number"
                raise GenerationError(f"{key} expects {what}, got '{raw}'") from None
        if name == "seed":
            self.seed = parsed
            return f"seed = {parsed}"
        self.config = replace(self.config, **{name: parsed}).checked()  # GenerationError with the reason
        return f"{name} = {getattr(self.config, name)}"

    def settings_text(self) -> str:
        names = {f.name for f in fields(self.config)}
        rows = [f"  {k:<21} {getattr(self.config, k)}" for k in SHOWN if k in names]
        return "\n".join(rows + [f"  {'seed':<21} {self.seed}"])


class CanvasChatLoop(ChatLoop):
    def reply(self, user_text: str) -> ReplyStats:
        """Stream one reply canvas by canvas; Ctrl-C or Ctrl-D ends it after the step under way, keeping the
        canvases already finished."""
        session = self.session
        ids, settings = session.request(user_text)
        shown, reply, t0 = "", None, time.perf_counter()
        overrides = {f.name: getattr(settings, f.name) for f in fields(settings)}
        self.view.reply_start()

        def handle(event) -> bool:
            nonlocal shown, reply
            if isinstance(event, TextEvent) and event.committed != shown:
                shown = event.committed
                self.view.reply_update(shown, [])
            elif isinstance(event, DiffusionGemmaReply):
                reply = event
            return reply is not None

        try:
            self.drive(session.engine.stream(ids, seed=session.seed, **overrides), handle)
        except BaseException:
            self.view.reply_end(shown, None)
            raise
        seconds = time.perf_counter() - t0
        if reply is not None:
            r = reply.result
            stats = ReplyStats(len(r.tokens), seconds, r.steps, len(r.tokens), r.finish_reason, len(ids))
            text = reply.text
        else:
            text = shown
            stats = ReplyStats(len(session.engine.tokenizer.encode(shown)) if shown else 0, seconds, 0, 0,
                               "interrupted", len(ids))
        self.view.reply_end(text, stats)
        session.record(user_text, text, stats)
        return stats


def canvas_banner(engine) -> str:
    c = engine.model.config
    name = engine.path.name if engine.path else "diffusion_gemma"
    return (f"clover chat \u00b7 {name} (diffusion_gemma, canvas {c.canvas_length}) \u00b7 /help for commands, "
            "Ctrl-D to leave")


def canvas_session(engine, decoding: dict, system: str | None) -> CanvasChatSession:
    """The session for `clover chat` on DiffusionGemma; a decoding option that does not apply is an error."""
    from clover_lite.cli.common import diffusion_gemma_options

    try:
        opts = diffusion_gemma_options(decoding)
        return CanvasChatSession(engine, opts["seed"], opts["max_new_tokens"], system)
    except GenerationError as e:
        raise CloverError(str(e)) from None
