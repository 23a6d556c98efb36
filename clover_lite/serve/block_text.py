"""Text requests on a block denoiser (Engine): a request's fields as a GenerationConfig, and the worker's loop
over the engine's step events (streamed text, cancellation between steps) ending in a Reply."""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.concurrency import run_in_threadpool

from clover_lite.errors import GenerationError, TokenizerError
from clover_lite.runtime.engine import Engine
from clover_lite.runtime.generation import DoneEvent, StepEvent
from clover_lite.serve.requests import EXTENSION, ApiError, Prepared, TextRequest, bad, context_exceeded
from clover_lite.serve.responses import Reply, reply_of
from clover_lite.serve.scheduler import ITEM, Job, Scheduler

log = logging.getLogger("clover_lite.serve")


class BlockText:
    extension = EXTENSION  # the `clover` settings a request may carry
    decide_refusal: str | None = None  # joint decisions run on this model

    def __init__(self, engine: Engine, scheduler: Scheduler):
        self.engine, self.scheduler = engine, scheduler

    @property
    def vocab_size(self) -> int:
        return self.engine.config.vocab_size

    def card(self) -> dict:
        """The model's facts under `clover` in /v1/models."""
        c = self.engine.config
        return {"model_type": c.model_type, "context": self.engine.context_limit, "block_size": c.block_size,
                "vocab_size": c.vocab_size}

    async def prepare(self, req: TextRequest) -> Prepared:
        engine = self.engine
        try:
            ids = await run_in_threadpool(engine.encode_prompt, req.prompt, raw=req.kind == "completion")
        except (GenerationError, TokenizerError) as e:  # e.g. a chat template that refuses these messages
            raise bad(str(e), param="messages" if req.kind == "chat" else "prompt") from None
        limit, P = engine.context_limit, len(ids)
        room = limit - P
        if req.max_tokens is None and room < 1:
            raise ApiError(400, f"the prompt ({P} tokens) fills the model's context of {limit} by itself; shorten it",
                           param="messages" if req.kind == "chat" else "prompt", code="context_length_exceeded",
                           extra={"limits": {"context": limit, "prompt_tokens": P}})
        max_tokens = req.max_tokens if req.max_tokens is not None else min(engine.default_config.max_new_tokens, room)
        if max_tokens > room:
            raise context_exceeded(P, max_tokens, limit)
        try:
            cfg = engine.resolve_config(max_new_tokens=max_tokens, **req.overrides)
        except GenerationError as e:
            raise bad(str(e), param="clover") from None
        return Prepared(ids, cfg.stop, cfg, max_tokens)

    def work(self, p: Prepared, stream: bool) -> Callable[[Job], Reply | None]:
        """The worker's part: the Reply, or None when the job was cancelled (its text items emitted as it goes
        when `stream`)."""
        def run(job: Job) -> Reply | None:
            events = self.engine.stream(p.ids, p.settings)
            committed = 0
            try:
                for ev in events:
                    if isinstance(ev, DoneEvent):
                        return reply_of(ev.generation)
                    if isinstance(ev, StepEvent):
                        committed += len(ev.committed)
                        if stream:
                            job.emit(ITEM, ev.text)
                    if job.cancelled:  # the client left: stop before the next step, freeing the engine
                        self.scheduler.record_cancel({"committed_tokens": committed, "max_tokens": p.max_tokens})
                        log.info("%s cancelled (client gone or server stopping) after %d of %d positions",
                                 job.label, committed, p.max_tokens)
                        return None
            finally:
                events.close()
            return None
        return run
