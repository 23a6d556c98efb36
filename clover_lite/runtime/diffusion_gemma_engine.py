"""A DiffusionGemma checkpoint ready to generate text: model, tokenizer, settings and a prefix-cache session.

The seam for `clover_lite.load()` / the CLI: `DiffusionGemmaEngine.load(path)` for a config.json whose
model_type is `diffusion_gemma` (checked with models.diffusion_gemma_config.is_diffusion_gemma). Prompts are
text (through the chat template when there is one), chat messages or token ids, as Engine takes them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from clover_lite.checkpoint.diffusion_gemma_weights import DiffusionGemmaLoadReport, load_diffusion_gemma
from clover_lite.errors import GenerationError
from clover_lite.models.diffusion_gemma import DiffusionGemma
from clover_lite.runtime.device import resolve_device, resolve_dtype
from clover_lite.runtime.diffusion_gemma_loop import (
    CanvasEvent,
    DiffusionGemmaResult,
    DiffusionGemmaSettings,
    DoneEvent,
    Session,
    StepEvent,
    settings_from_generation_config,
    stream,
)
from clover_lite.runtime.exclusive import OneAtATime
from clover_lite.runtime.generation import check_seed
from clover_lite.runtime.prompt import prompt_ids
from clover_lite.tokenizer.incremental import IncrementalDecoder
from clover_lite.tokenizer.tokenizer import Tokenizer, has_tokenizer_files


@dataclass
class DiffusionGemmaReply:
    text: str
    tokens: list[int]
    finish_reason: str
    result: DiffusionGemmaResult


@dataclass
class TextEvent:
    """Text so far: `committed` (finished canvases) then `draft` (the current canvas's argmax, changing)."""

    committed: str
    draft: str
    event: StepEvent | CanvasEvent


class DiffusionGemmaEngine:
    def __init__(self, path: Path, model: DiffusionGemma, tokenizer: Tokenizer | None,
                 settings: DiffusionGemmaSettings, report: DiffusionGemmaLoadReport):
        self.path, self.model, self.tokenizer, self.settings, self.report = path, model, tokenizer, settings, report
        self.session = Session()  # one conversation's prefix cache, reused while prompts extend it
        self._turns = OneAtATime()  # the session is shared: one generation at a time, as Engine

    @property
    def context_limit(self) -> int:
        """The most positions (conversation and reply) the model takes."""
        return self.model.config.max_position_embeddings

    @property
    def canvas_length(self) -> int:
        """Positions per canvas: the settings' (generation_config.json) or the checkpoint's."""
        return self.settings.canvas_length or self.model.config.canvas_length

    @property
    def load_report(self) -> DiffusionGemmaLoadReport:
        """What loading read and skipped (Engine's name for it: the CLI prints its notes)."""
        return self.report

    @classmethod
    def load(cls, path: str | os.PathLike, device: str | torch.device = "cpu",
             dtype: str | torch.dtype | None = None, kernels: str | None = None,
             check_finite: bool = True) -> DiffusionGemmaEngine:
        """16-bit or GPTQ INT4 weights; `kernels` (auto|torch|triton) and `check_finite` (refuse NaN/Inf
        weights) as for the block denoisers."""
        path = Path(path)
        dev = resolve_device(device)
        model, report = load_diffusion_gemma(path, dev, resolve_dtype(dtype, dev), kernels=kernels,
                                             check_finite=check_finite)
        tokenizer = Tokenizer.from_dir(path) if has_tokenizer_files(path) else None
        settings = settings_from_generation_config(path, eos_fallback=model.config.eos_token_ids)
        return cls(path, model, tokenizer, settings, report)

    def encode_prompt(self, prompt: str | Sequence[int] | Sequence[dict[str, Any]], raw: bool = False) -> list[int]:
        """Token ids of a prompt: text (a user turn through the chat template unless `raw` or there is none),
        chat messages, or token ids."""
        return prompt_ids(prompt, self.tokenizer, self.model.config.vocab_size, raw=raw, path=self.path)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer else ""

    def detokenizer(self) -> IncrementalDecoder:
        """A fresh decoder of a growing reply whose text is always `decode` of its ids."""
        return self.tokenizer.incremental_decoder(skip_special_tokens=True) if self.tokenizer else \
            IncrementalDecoder(self.decode)

    def stream(self, prompt: str | Sequence[int] | Sequence[dict[str, Any]], *, raw: bool = False,
               seed: int | None = None, images: Any = None, wait: float | None = None, **overrides: Any
               ) -> Iterator[TextEvent | DiffusionGemmaReply]:
        """TextEvents per step and per canvas, then the DiffusionGemmaReply. The engine's session keeps the
        prefix cache: a follow-up whose token ids extend the last conversation encodes only what is new. One
        generation at a time, as on Engine: another caller waits (at most `wait` seconds, then
        EngineBusyError), and a stream left unadvanced while someone waits is taken over."""
        unknown = set(overrides) - set(DiffusionGemmaSettings.__dataclass_fields__)
        if unknown:
            raise GenerationError(f"unknown DiffusionGemma setting(s): {', '.join(sorted(unknown))}")
        settings = replace(self.settings, **overrides) if overrides else self.settings
        check_seed(seed)
        ids = self.encode_prompt(prompt, raw)
        device = self.model.decoder.embed_tokens.weight.device
        gen = None if seed is None else torch.Generator(device=device).manual_seed(seed)
        turn = self._turns.acquire(wait)
        try:
            events = stream(self.model, ids, settings, self.session, gen, images)
            detok = self.detokenizer()  # the committed text changes once per canvas: decoded then, its new ids
            committed = ""
            try:
                while True:
                    self._turns.advancing(turn)
                    event = next(events, None)
                    if event is None:
                        return
                    self._turns.paused(turn)
                    if isinstance(event, StepEvent):
                        yield TextEvent(committed, self.decode(event.draft), event)
                    elif isinstance(event, CanvasEvent):
                        committed = detok.push(event.tokens)
                        yield TextEvent(committed, "", event)
                    elif isinstance(event, DoneEvent):
                        r = event.result
                        yield DiffusionGemmaReply(self.decode(r.tokens), r.tokens, r.finish_reason, r)
            finally:
                events.close()
        finally:
            self._turns.release(turn)

    def generate(self, prompt: str | Sequence[int] | Sequence[dict[str, Any]], **kwargs: Any) -> DiffusionGemmaReply:
        for event in self.stream(prompt, **kwargs):
            if isinstance(event, DiffusionGemmaReply):
                return event
        raise AssertionError("stream ended without a reply")
