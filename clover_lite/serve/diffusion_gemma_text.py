"""Text requests on DiffusionGemma (DiffusionGemmaEngine): a request's fields as its sampler's settings, and
the worker's loop over its canvases ending in a Reply.

DiffusionGemma denoises whole canvases with its own sampler, so of OpenAI's sampling fields max_tokens, seed
and stop apply; temperature and top_p are refused (its temperature falls from `clover.t_max` to
`clover.t_min` over the denoising steps), never silently ignored. The model generates whole canvases; a reply
holds at most max_tokens tokens, the last canvas cut there. Text streams a canvas at a time (a canvas's
draft changes at every step until it is finished). A stop string cuts the reply at its start, and the
generation ends with the canvas that holds it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace

from starlette.concurrency import run_in_threadpool

from clover_lite.errors import GenerationError, TokenizerError
from clover_lite.runtime.diffusion_gemma_engine import DiffusionGemmaEngine, DiffusionGemmaReply
from clover_lite.runtime.diffusion_gemma_loop import CanvasEvent, StepEvent, check_text_prompt
from clover_lite.runtime.generation import check_seed
from clover_lite.serve.requests import ApiError, Prepared, TextRequest, bad, context_exceeded
from clover_lite.serve.responses import Reply
from clover_lite.serve.scheduler import ITEM, Job, Scheduler
from clover_lite.tokenizer.incremental import IncrementalDecoder

log = logging.getLogger("clover_lite.serve")

# The sampler's settings a request may carry in `clover` (runtime/diffusion_gemma_loop.DiffusionGemmaSettings).
EXTENSION = {
    "max_denoising_steps": (int, "an integer"),
    "entropy_bound": ((int, float), "a number"),
    "t_min": ((int, float), "a number"),
    "t_max": ((int, float), "a number"),
    "stability_threshold": ((int, type(None)), "an integer, or null for no adaptive stopping"),
    "confidence_threshold": ((int, float, type(None)), "a number, or null for no adaptive stopping"),
}
NOT_APPLICABLE = ("temperature", "top_p")


class DiffusionGemmaText:
    extension = EXTENSION
    decide_refusal = ("joint decisions need a block denoiser; this server runs DiffusionGemma, which denoises "
                      "whole canvases: ask through /v1/chat/completions or /v1/completions")

    def __init__(self, engine: DiffusionGemmaEngine, scheduler: Scheduler):
        self.engine, self.scheduler = engine, scheduler

    @property
    def vocab_size(self) -> int:
        return self.engine.model.config.vocab_size

    def card(self) -> dict:
        """The model's facts under `clover` in /v1/models."""
        c = self.engine.model.config
        return {"model_type": "diffusion_gemma", "context": self.engine.context_limit,
                "canvas_length": self.engine.canvas_length, "vocab_size": c.vocab_size}

    async def prepare(self, req: TextRequest) -> Prepared:
        overrides = dict(req.overrides)
        for name in NOT_APPLICABLE:
            if name in overrides:
                raise bad(f"'{name}' does not apply to DiffusionGemma: its sampler's temperature falls from "
                          f"clover.t_max to clover.t_min over the denoising steps; remove '{name}' (or set those)",
                          param=name, code="unsupported_field")
        seed, stop = overrides.pop("seed", None), overrides.pop("stop", ())
        try:
            check_seed(seed)
        except GenerationError as e:
            raise bad(str(e), param="seed") from None
        try:
            settings = replace(self.engine.settings, **overrides).checked()
        except GenerationError as e:
            raise bad(str(e), param="clover") from None
        prompt_param = "messages" if req.kind == "chat" else "prompt"
        try:
            ids = await run_in_threadpool(self.engine.encode_prompt, req.prompt, raw=req.kind == "completion")
            check_text_prompt(self.engine.model.config, ids)  # before it queues, not in the worker
        except (GenerationError, TokenizerError) as e:  # e.g. a chat template that refuses these messages
            raise bad(str(e), param=prompt_param) from None
        C = self.engine.canvas_length
        limit, P = self.engine.context_limit, len(ids)
        room = (limit - P) // C * C  # whole canvases
        if req.max_tokens is None and room < 1:
            raise ApiError(400, f"the prompt ({P} tokens) leaves no room for one canvas of {C} in the model's "
                                f"context of {limit}; shorten it", param=prompt_param, code="context_length_exceeded",
                           extra={"limits": {"context": limit, "prompt_tokens": P, "canvas_length": C}})
        max_tokens = req.max_tokens if req.max_tokens is not None else min(settings.max_new_tokens, room)
        needed = P + math.ceil(max_tokens / C) * C
        if needed > limit:
            raise context_exceeded(P, max_tokens, limit, needed, f" (in canvases of {C})")
        return Prepared(ids, stop, (seed, {**overrides, "max_new_tokens": max_tokens}), max_tokens)

    def work(self, p: Prepared, stream: bool) -> Callable[[Job], Reply | None]:
        """The worker's part: the Reply, or None when the job was cancelled (the text so far emitted after each
        canvas when `stream`)."""
        seed, settings = p.settings

        def run(job: Job) -> Reply | None:
            t0 = time.perf_counter()
            detok = self.engine.detokenizer()
            tokens: list[int] = []
            text, finish, forwards, canvases = "", None, 0, 0
            events = self.engine.stream(p.ids, seed=seed, **settings)
            try:
                for ev in events:
                    if isinstance(ev, DiffusionGemmaReply):
                        finish = ev.finish_reason
                        break
                    if isinstance(ev.event, StepEvent):
                        forwards += 1
                    elif isinstance(ev.event, CanvasEvent):
                        canvases += 1
                        finish, text = take_canvas(ev.event.tokens, tokens, detok, p.max_tokens, p.stop)
                        if stream:
                            job.emit(ITEM, text)
                        if finish is not None:
                            break
                    if job.cancelled:  # the client left: stop before the next step, freeing the engine
                        self.scheduler.record_cancel({"committed_tokens": len(tokens), "max_tokens": p.max_tokens})
                        log.info("%s cancelled (client gone or server stopping) after %d of %d tokens",
                                 job.label, len(tokens), p.max_tokens)
                        return None
            finally:
                events.close()
            if finish is None:
                return None
            seconds = time.perf_counter() - t0
            stats = {"forwards": forwards, "canvases": canvases,
                     "tokens_per_forward": round(len(tokens) / max(1, forwards), 4), "seconds": round(seconds, 4),
                     "tokens_per_second": round(len(tokens) / seconds, 2) if seconds > 0 else 0.0}
            return Reply(text, finish, len(p.ids), len(tokens), stats)
        return run


def take_canvas(canvas: list[int], tokens: list[int], detok: IncrementalDecoder, max_tokens: int,
                stop: tuple[str, ...]) -> tuple[str | None, str]:
    """Add a finished canvas's tokens, up to `max_tokens` in all, to `tokens` and `detok` (which holds the same
    ids) -> (finish reason or None to go on, the reply's text so far). A stop string in the text cuts it at
    its start and drops the tokens after those that cover what is left."""
    take = canvas[: max_tokens - len(tokens)]
    tokens += take
    text = detok.push(take)
    # A new match ends after what this push left unchanged (earlier canvases held none), as in the block loop.
    hits = [i for s in stop if (i := text.find(s, max(0, detok.changed_from - len(s) + 1))) >= 0]
    if hits:
        text = text[: min(hits)]
        del tokens[detok.ids_covering(text):]
        return "stop", text
    return ("length" if len(take) < len(canvas) else None), text
