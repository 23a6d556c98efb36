"""The public runtime: `load()` a checkpoint into an Engine, then `generate` or `stream`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from clover_lite.checkpoint.load import LoadReport, load_model
from clover_lite.errors import CloverError, GenerationError
from clover_lite.kernels import dispatch
from clover_lite.models.config import ModelConfig, load_config
from clover_lite.models.denoiser import Denoiser
from clover_lite.models.diffusion_gemma_config import is_diffusion_gemma_dir
from clover_lite.runtime.canvas import fill_canvas
from clover_lite.runtime.decide import Decision, Filled, Questions, decision_messages, question_list
from clover_lite.runtime.device import on_device, resolve_device, resolve_dtype
from clover_lite.runtime.exclusive import OneAtATime
from clover_lite.runtime.generation import CachedRunner, DoneEvent, Event, Generation, GenerationConfig, denoise
from clover_lite.runtime.graph import MAX_STATIC_CONTEXT, StaticStep, use_static_step
from clover_lite.runtime.prompt import Prompt, no_tokenizer_error, prompt_ids
from clover_lite.runtime.template import Canvas, SlotSpec, build_canvas, filled_text
from clover_lite.tokenizer.incremental import IncrementalDecoder
from clover_lite.tokenizer.tokenizer import Tokenizer, has_tokenizer_files

if TYPE_CHECKING:
    from clover_lite.runtime.diffusion_gemma_engine import DiffusionGemmaEngine


BUNDLED_MODEL = Path(__file__).parents[1] / "data" / "clover-tiny"


def default_model_path() -> Path:
    """The model shipped with the package, used when no path is given."""
    if not (BUNDLED_MODEL / "config.json").exists():
        raise CloverError(
            "no model given and this install has no bundled default model; pass a model directory "
            "(`clover tiny DIR` writes a tiny random one to try the runtime)"
        )
    return BUNDLED_MODEL


class Engine:
    """A loaded model ready to generate.

    Thread-safety: an engine runs one generation at a time. A call from another thread while a
    generation (or an open `stream`) is running waits for it to finish, at most `wait` seconds when given
    (EngineBusyError after that); a stream its caller stopped advancing for `abandon_after` seconds gives
    the engine to a waiting caller (runtime/exclusive.py). A nested call from the thread that is running
    one raises GenerationError (it would otherwise deadlock).

    Prompts: a string is a user message, sent through the model's chat template when it has one (as
    `clover run` does); `raw=True` encodes it as is. Chat messages always use the template; token ids are
    used as they are.
    """

    def __init__(
        self,
        model: Denoiser,
        tokenizer: Tokenizer | None,
        path: Path | None = None,
        mask_token_id: int | None = None,
        load_report: LoadReport | None = None,
        context: int | None = None,
        static_step: bool | None = None,
        static_context: int | None = None,
    ):
        """`context`: the most positions (prompt + reply) a generation may use (default: the model's limit).
        `static_step` (default: on CUDA with the Triton kernels) keeps one cache of `context` positions
        (default: `static_context`, which load() sets to what fits in free memory, else the model's limit,
        at most 32768) and a CUDA graph of the denoising step for the model's block size, captured here; on
        a CPU (the Triton kernels in the interpreter, tests) it runs the same static step eagerly."""
        self.model = model
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.path = path
        self.load_report = load_report
        self.mask_token_id = mask_token_id
        if self.mask_token_id is None:
            self.mask_token_id = self.config.mask_token_id
        if self.mask_token_id is None and tokenizer is not None:
            self.mask_token_id = tokenizer.mask_token_id
        eos = list(self.config.eos_token_ids) + (list(tokenizer.eos_token_ids) if tokenizer else [])
        self.eos_token_ids = list(dict.fromkeys(eos))
        self.default_config = GenerationConfig(block_size=self.config.block_size)
        self._choose = dispatch.chooser(getattr(model, "backend", "torch"))
        self._turns = OneAtATime()
        self._cache, self._static = None, None
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.config.vocab_size:
            raise CloverError(f"mask_token_id {self.mask_token_id} is outside the vocabulary (0 to "
                              f"{self.config.vocab_size - 1}); give the checkpoint's mask token id")
        check_context(context, self.config.max_position_embeddings)
        self._context = context
        block = self.default_config.resolved(self.config.block_size).block_size
        size = context or static_context or min(self.config.max_position_embeddings, MAX_STATIC_CONTEXT)
        if static_step is None:
            static_step = size >= block and use_static_step(model, block, self.device)
        if static_step:
            if size < block:
                raise CloverError(f"the static step needs a context of at least one block ({block} positions), "
                                  f"not {size}")
            why = StaticStep.supported(model, block)
            if why:
                raise CloverError(f"static_step=True: {why}; leave static_step unset to use it wherever it can run")
            self._build_static(size)

    def _build_static(self, context: int) -> None:
        block = self.default_config.resolved(self.config.block_size).block_size
        self._cache = self.model.new_cache(capacity=context)
        self._static = StaticStep(self.model, self._cache, block)
        if self.device.type == "cuda":
            try:
                self._static.capture()
            except Exception as e:  # a failed capture costs speed, not correctness: fall back to the eager step
                import warnings

                warnings.warn(f"CUDA graph capture failed ({e}); the denoising step runs eagerly", stacklevel=2)
                # The fixed-capacity cache was only for the graph's pointers: eager runs size their own.
                self._static, self._cache = None, None

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def abandon_after(self) -> float:
        """Seconds a stream may sit unadvanced before a waiting caller may take the engine (default 60)."""
        return self._turns.abandon_after

    @abandon_after.setter
    def abandon_after(self, seconds: float) -> None:
        self._turns.abandon_after = float(seconds)

    @property
    def context_limit(self) -> int:
        """The most positions (prompt + reply) one generation may use: the fixed cache's capacity when the
        engine keeps one (its CUDA graph points at those buffers), else the context given at load, else the
        model's limit."""
        limit = self.config.max_position_embeddings
        if self._cache is not None:
            return min(limit, self._cache.capacity)
        return min(limit, self._context) if self._context else limit

    # ---- prompts ----------------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt, add_generation_prompt: bool = True, raw: bool = False) -> list[int]:
        """Token ids for a prompt: a string (a user message through the chat template when the model has
        one; with `raw`, or without a template, encoded as is), a list of token ids, or chat messages (list
        of {"role", "content"} dicts, rendered with the model's chat template)."""
        return prompt_ids(prompt, self.tokenizer, self.config.vocab_size, raw=raw,
                          add_generation_prompt=add_generation_prompt, path=self.path)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer else ""

    def detokenizer(self) -> IncrementalDecoder | None:
        """A fresh decoder of a growing reply whose text is always `decode` of its ids (None: no tokenizer)."""
        return self.tokenizer.incremental_decoder(skip_special_tokens=True) if self.tokenizer else None

    def _tokenizer_or_error(self) -> Tokenizer:
        if self.tokenizer is None:
            raise no_tokenizer_error(self.path)
        return self.tokenizer

    # ---- generation -------------------------------------------------------------------------------
    def resolve_config(self, config: GenerationConfig | None = None, **overrides) -> GenerationConfig:
        cfg = config or self.default_config
        if overrides:
            cfg = cfg.replace(**overrides)
        return cfg.resolved(self.config.block_size, self.config.max_position_embeddings)

    def stream(self, prompt: Prompt, config: GenerationConfig | None = None, *, raw: bool = False,
               wait: float | None = None, **overrides) -> Iterator[Event]:
        """Yield a StepEvent per denoising step, a BlockEvent per finished block, then a DoneEvent. `raw`:
        a string prompt without the chat template; `wait`: the most seconds to wait for a busy engine."""
        cfg = self.resolve_config(config, **overrides)
        ids = self.encode_prompt(prompt, raw=raw)
        self._mask_or_error()
        return self._locked(ids, cfg, wait)

    def _locked(self, ids: list[int], cfg: GenerationConfig, wait: float | None) -> Iterator[Event]:
        turn = self._turns.acquire(wait)
        try:
            runner = CachedRunner(self.model, cfg.block_size, commit=cfg.commit, cache=self._cache,
                                  static_step=self._static)
            limit = self.context_limit
            events = denoise(
                runner, ids, cfg, self.mask_token_id, self.eos_token_ids,
                detokenizer=self.detokenizer(), max_length=limit,
                context_note="" if limit >= self.config.max_position_embeddings else
                f" (this engine's; the model's is {self.config.max_position_embeddings}: load with a longer "
                "context, --context N, if memory allows)",
                chooser=self._choose,
            )
            try:
                while True:
                    # Triton launches on the current CUDA device, not the tensors' (cuda:1 would fail):
                    # each advance runs with the model's device current, the caller's code between
                    # events with its own.
                    self._turns.advancing(turn)
                    with on_device(self.device):
                        event = next(events, None)
                    if event is None:
                        return
                    self._turns.paused(turn)
                    yield event
            finally:
                events.close()
        finally:
            self._turns.release(turn)

    def generate(self, prompt: Prompt, config: GenerationConfig | None = None, *, raw: bool = False,
                 wait: float | None = None, **overrides) -> Generation:
        """Generate a reply to `prompt`; returns text, token ids, finish reason and stats (`raw`, `wait`: as
        for `stream`)."""
        for event in self.stream(prompt, config, raw=raw, wait=wait, **overrides):
            if isinstance(event, DoneEvent):
                return event.generation
        raise RuntimeError("decoding ended without a result")

    # ---- templates and decisions --------------------------------------------------------------------
    @property
    def end_token_id(self) -> int | None:
        """What fills a slot's unused positions: the tokenizer's pad token, else the first end-of-sequence id."""
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else None
        return pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else None)

    def fill(self, template: str, slots: Mapping[str, SlotSpec] | None = None, *, prompt: Prompt | None = None,
             mode: str = "joint", config: GenerationConfig | None = None, raw: bool = False,
             wait: float | None = None, **overrides) -> Filled:
        """Fill the slots of `template` in one denoising pass: "{name:N}" is N positions of free text,
        "{name:a|b}" (or `slots={"name": [...]}`) one of the listed strings; the template's own text never
        changes (syntax: runtime/template.py). With `prompt` (encoded as for `generate`), the template is the
        reply to it; without, it starts the sequence. `mode="sequential"` commits one position (or choice slot)
        per forward, left to right, as an autoregressive model must. Generation settings (`threshold`,
        `temperature`, ...) as for `generate`."""
        cfg = self.canvas_config(config, **overrides)
        mask = self._mask_or_error()
        canvas = build_canvas(self._tokenizer_or_error(), template, slots, self.end_token_id, mask)
        ids = self.encode_prompt(prompt, raw=raw) if prompt is not None else []
        return self._fill(ids, canvas, cfg, mode, wait)

    def decide(self, context: str, questions: Questions, mode: str = "joint", *,
               config: GenerationConfig | None = None, wait: float | None = None, **overrides) -> Decision:
        """Answer several questions about `context` together: `questions` maps each name to its allowed
        answers (strings of any token length). Each answer is one of its options; `probabilities` gives each
        option's probability under the model, `forwards` the denoising forwards used, `order` the order the
        questions were settled. `mode="sequential"` decides one at a time, left to right (the comparison)."""
        pairs = question_list(questions)
        cfg = self.canvas_config(config, **overrides)
        user, reply = decision_messages(context, pairs)
        tok = self._tokenizer_or_error()
        mask = self._mask_or_error()
        slots = {f"q{k}": options for k, (_, options) in enumerate(pairs)}
        names = {f"q{k}": name for k, (name, _) in enumerate(pairs)}
        canvas = build_canvas(tok, reply if tok.has_chat_template else "\n" + reply, slots, self.end_token_id, mask,
                              labels=names)
        if self.eos_token_ids:  # the end of the reply, given: the answers see where the turn ends
            canvas.tokens.append(self.eos_token_ids[0])
        filled = self._fill(self.encode_prompt(user), canvas, cfg, mode, wait)
        return Decision(
            answers={names[k]: v for k, v in filled.values.items()},
            probabilities={names[k]: v for k, v in filled.probabilities.items()},
            forwards=filled.forwards, order=[names[k] for k in filled.order], mode=mode,
            commit_forwards=filled.commit_forwards, seconds=filled.seconds, text=filled.text,
            confidence={names[k]: v for k, v in filled.confidence.items()},
        )

    def canvas_config(self, config: GenerationConfig | None = None, **overrides) -> GenerationConfig:
        """The settings `fill` and `decide` run with (resolve_config's): the canvas fixes the reply's length
        and end, so settings for those are refused rather than ignored."""
        given = sorted(k for k in overrides if k in ("max_new_tokens", "stop", "stop_token_ids", "ignore_eos"))
        if given:
            raise GenerationError(f"{', '.join(given)} does not apply to fill or decide (the template fixes the "
                                  "reply's length and where it ends); leave it out")
        return self.resolve_config(config, **overrides)

    def _mask_or_error(self) -> int:
        if self.mask_token_id is None:
            raise GenerationError(
                "this model has no mask token (no 'mask_token_id' in config.json and none in the tokenizer); "
                "pass load(..., mask_token_id=ID) for a block-diffusion checkpoint"
            )
        return self.mask_token_id

    def _fill(self, ids: list[int], canvas: Canvas, cfg: GenerationConfig, mode: str, wait: float | None) -> Filled:
        turn = self._turns.acquire(wait)
        try:
            self._turns.advancing(turn)
            runner = CachedRunner(self.model, cfg.block_size, commit=cfg.commit, cache=self._cache,
                                  static_step=self._static)
            with on_device(self.device):
                res = fill_canvas(runner, ids, canvas, cfg, self.mask_token_id, self.end_token_id,
                                  self.eos_token_ids, mode=mode, chooser=self._choose, max_length=self.context_limit)
        finally:
            self._turns.release(turn)
        values = {}
        for slot in canvas.slots:
            toks = res.slot_tokens[slot.name]
            if slot.options is not None:
                value = next(o for o, o_ids in zip(slot.options, slot.padded(self.end_token_id), strict=True)
                             if o_ids == toks)
            else:
                ends = set(self.eos_token_ids) | {self.end_token_id}
                cut = next((j for j, t in enumerate(toks) if t in ends), len(toks))
                value = self.decode(toks[:cut])
                value = value[len(slot.lead):] if slot.lead and value.startswith(slot.lead) else value
            values[slot.name] = value
        return Filled(values=values, text=filled_text(canvas, values), token_ids=res.tokens,
                      probabilities=res.option_probabilities, order=res.order, forwards=res.forwards,
                      commit_forwards=res.commit_forwards, seconds=res.seconds, steps=res.steps,
                      confidence=res.confidence)


def check_context(context: int | None, model_limit: int) -> None:
    """CloverError unless `context` (positions a generation may use; None: the model's) is 1..model_limit."""
    if context is not None and not 1 <= context <= model_limit:
        raise CloverError(f"context must be 1 to {model_limit} positions (the model's limit), got {context}")


def load(
    path: str | os.PathLike | None = None,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    mask_token_id: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    check_memory: bool = True,
    context: int | None = None,
    kernels: str | None = None,
    static_step: bool | None = None,
    check_finite: bool = True,
) -> Engine | DiffusionGemmaEngine:
    """Load a model directory (Hugging Face layout: config.json, safetensors, tokenizer files).

    A DiffusionGemma checkpoint (model_type `diffusion_gemma`, 16-bit or GPTQ INT4) gives a DiffusionGemmaEngine
    (runtime/diffusion_gemma_engine.py: `generate` and `stream` with its own settings); `device`, `dtype`,
    `kernels`, `check_memory` and `check_finite` apply to it; the block cache's options (`context`,
    `static_step`, `mask_token_id`) are refused (CloverError).

    `path` None loads the bundled default model. `device` "auto" picks CUDA when present; `dtype` None
    means fp32 on CPU and bf16 on a GPU. `check_memory` plans the model's memory first (clover_lite.plan) and
    refuses with the plan instead of running out of memory halfway: on CUDA against the free memory, on CPU
    only when the weights alone exceed the available RAM. `kernels` (auto|torch|triton) overrides
    $CLOVER_KERNELS; `context` and `static_step` are the engine's (see Engine): on CUDA with the Triton
    kernels the denoising step is captured once as a CUDA graph over a cache of `context` positions.
    `check_finite` (default) scans every float tensor as it is read and refuses one holding NaN or Inf with a
    CheckpointError naming it; False skips that pass for a very large checkpoint (the report's notes say so).
    Either way a generation whose logits go non-finite stops with NonFiniteError.
    """
    if kernels is not None and (not isinstance(kernels, str) or kernels.lower() not in dispatch.MODES):
        raise CloverError(f"kernels={kernels!r}: use one of {', '.join(dispatch.MODES)} (None: $CLOVER_KERNELS, "
                          "else auto); the device is chosen by device=")
    model_path = Path(path) if path is not None else default_model_path()
    if not model_path.exists():
        raise CloverError(f"{model_path}: no such model directory")
    if not model_path.is_dir():
        raise CloverError(f"{model_path}: expected a model directory (config.json, *.safetensors, tokenizer)")
    if is_diffusion_gemma_dir(model_path):
        return _load_diffusion_gemma(model_path, device, dtype, kernels, check_memory, check_finite,
                                     mask_token_id=mask_token_id, context=context, static_step=static_step)
    config = load_config(model_path)
    check_context(context, config.max_position_embeddings)  # before the memory plan, which would plan for it
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    fits, p = None, None
    if check_memory:
        from clover_lite.planning.planner import check_load

        p = check_load(model_path, config, dev, dt, context)
        if context is None and p is not None and dev.type == "cuda":
            # A static step's cache (and its CUDA graph) is sized once: as long as fits (at least the checked
            # context, since the check passed), up to 32K by default. An eager engine's cache grows instead.
            fits = min(config.max_position_embeddings, MAX_STATIC_CONTEXT, p.max_context(p.target.capacity))
    model, report = load_model(model_path, config, dev, dt, progress, kernels=kernels,
                               check_finite=check_finite)
    if check_memory and p is not None and dev.type == "cpu":
        from clover_lite.planning.planner import ram_warning

        warning = ram_warning(p)  # weights that fit but leave little room: said, not refused
        if warning:
            report.notes.append(f"memory: {warning} (planned at {p.context_len} positions)")
    tokenizer = None
    if has_tokenizer_files(model_path):
        tokenizer = Tokenizer.from_dir(model_path)
    return Engine(model, tokenizer, model_path, mask_token_id, report, context=context, static_step=static_step,
                  static_context=fits)


def _load_diffusion_gemma(path: Path, device, dtype, kernels: str | None, check_memory: bool, check_finite: bool,
                          **engine_options) -> DiffusionGemmaEngine:
    from clover_lite.models.diffusion_gemma_config import load_diffusion_gemma_config
    from clover_lite.runtime.diffusion_gemma_engine import DiffusionGemmaEngine

    given = sorted(k for k, v in engine_options.items() if v is not None)
    if given:
        raise CloverError(f"{path}: DiffusionGemma runs with its own settings (canvases, no block cache or CUDA "
                          f"graph); {', '.join(given)} does not apply to it (leave it out)")
    if check_memory:  # its plan (planning/diffusion_gemma.py), checked as for the block denoisers
        from clover_lite.planning.planner import check_load

        dev = resolve_device(device)
        check_load(path, load_diffusion_gemma_config(path), dev, resolve_dtype(dtype, dev))
    return DiffusionGemmaEngine.load(path, device, dtype, kernels=kernels, check_finite=check_finite)

