"""DiffusionGemma generation: canvases of random tokens denoised against a prefix cache.

Per canvas (transformers 5.24 `generation_diffusion_gemma.py` is the reference; same draws in the same order,
so a generator seeded as torch's default one gives the same tokens):
- the canvas starts as uniform random tokens; each step runs the decoder on it (self-conditioned on the
  previous step's tempered logits), divides the logits by a temperature falling linearly from t_max towards
  t_min, samples every position, and accepts the lowest-entropy positions whose entropies, the largest left
  out, sum to at most `entropy_bound`; every other position is renoised with a fresh random token;
- it stops after max_denoising_steps, or earlier once the argmax canvas has stayed the same for
  `stability_threshold` steps and the mean entropy is below `confidence_threshold`;
- the last step's argmax is the canvas's text. EOS in it ends the generation after the EOS.
The prefix cache: committed text is encoded once; every step of a later canvas reads it, and a finished canvas
is appended to it by one encoder pass over its tokens before the next canvas starts. A Session keeps the cache
between calls, so a follow-up prompt that extends the previous text encodes only what is new.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from clover_lite.errors import GenerationError, NonFiniteError
from clover_lite.models.diffusion_gemma import DiffusionGemma, PrefixCache
from clover_lite.models.diffusion_gemma_config import DiffusionGemmaConfig
from clover_lite.runtime.generation import MIN_TEMPERATURE

SAMPLERS = ("entropy_bound",)
MAX_T = 1e30
MAX_STEPS = 2**31 - 1
_SAMPLER_CLASSES = {"EntropyBoundSamplerConfig": "entropy_bound"}
# transformers' defaults for what generation_config.json leaves unset (`_get_default_generation_params`).
DEFAULTS = dict(max_new_tokens=256, max_denoising_steps=48, entropy_bound=0.1, t_min=0.4, t_max=0.8,
                stability_threshold=1, confidence_threshold=0.005)


@dataclass(frozen=True)
class DiffusionGemmaSettings:
    max_new_tokens: int = 256  # rounded up to whole canvases, as transformers does
    max_denoising_steps: int = 48
    sampler: str = "entropy_bound"
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int | None = 1  # None (or confidence None): no adaptive stopping
    confidence_threshold: float | None = 0.005
    eos_token_ids: tuple[int, ...] = ()
    canvas_length: int | None = None  # None: the checkpoint's

    def checked(self) -> DiffusionGemmaSettings:
        """Self, or GenerationError naming the bad setting and its allowed values."""
        def bad(what: str) -> GenerationError:
            return GenerationError(f"DiffusionGemma setting {what}")

        if self.sampler not in SAMPLERS:
            raise bad(f"sampler={self.sampler!r} is unknown; the sampler is one of {', '.join(SAMPLERS)}")
        for key in ("max_new_tokens", "max_denoising_steps"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise bad(f"{key}={v!r} must be a positive integer")
        if self.canvas_length is not None and (not isinstance(self.canvas_length, int) or self.canvas_length <= 0):
            raise bad(f"canvas_length={self.canvas_length!r} must be a positive integer")
        for key in ("entropy_bound", "t_min", "t_max", "confidence_threshold"):
            v = getattr(self, key)
            if (v is not None or key != "confidence_threshold") and (
                    isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise bad(f"{key}={v!r} must be a finite number")
        st = self.stability_threshold
        if st is not None and (isinstance(st, bool) or not isinstance(st, int)):
            raise bad(f"stability_threshold={st!r} must be a whole number of steps (or None)")
        ids = self.eos_token_ids
        if not isinstance(ids, (tuple, list)) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise bad(f"eos_token_ids={ids!r} must be a list of integer token ids")
        if not self.entropy_bound > 0:
            raise bad(f"entropy_bound={self.entropy_bound!r} must be > 0")
        if not (0 <= self.t_min < self.t_max):
            raise bad(f"t_min={self.t_min!r}, t_max={self.t_max!r}: need 0 <= t_min < t_max")
        # The schedule is computed in fp32: below the floor the tempered logits overflow (sampling is argmax
        # there anyway); above the ceiling the temperature itself does.
        if not MIN_TEMPERATURE <= self.t_max <= MAX_T:
            raise bad(f"t_max={self.t_max!r} must be between {MIN_TEMPERATURE:g} and {MAX_T:g} (fp32 holds the "
                      "schedule there)")
        if self.max_denoising_steps > MAX_STEPS:
            raise bad(f"max_denoising_steps={self.max_denoising_steps!r} must be at most {MAX_STEPS} (an int32 "
                      "step count)")
        if self.stability_threshold is not None and self.stability_threshold < 0:
            raise bad(f"stability_threshold={self.stability_threshold!r} must be >= 0")
        if self.confidence_threshold is not None and not self.confidence_threshold > 0:
            raise bad(f"confidence_threshold={self.confidence_threshold!r} must be > 0")
        return self


def settings_from_generation_config(path: str | Path, eos_fallback: Sequence[int] = (), **overrides: Any
                                    ) -> DiffusionGemmaSettings:
    """Settings from `path`/generation_config.json (transformers' defaults for what it leaves unset; EOS ids
    from `eos_fallback` when it names none), then `overrides`. GenerationError on an unknown sampler."""
    file = Path(path) / "generation_config.json"
    raw: dict[str, Any] = {}
    if file.exists():
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise GenerationError(f"{file}: not valid JSON ({e})") from e
    values: dict[str, Any] = {k: raw[k] if raw.get(k) is not None else v for k, v in DEFAULTS.items()}
    sampler = raw.get("sampler_config")
    if sampler is not None:
        sampler = dict(sampler)
        name = _SAMPLER_CLASSES.get(sampler.pop("_cls_name", "EntropyBoundSamplerConfig"))
        if name is None or set(sampler) - {"entropy_bound"}:
            raise GenerationError(f"{file}: sampler_config {json.dumps(raw['sampler_config'])[:80]} is unknown; "
                                  "the supported sampler is EntropyBoundSamplerConfig(entropy_bound)")
        values["sampler"] = name
        values["entropy_bound"] = sampler.get("entropy_bound", DEFAULTS["entropy_bound"])
    eos = raw.get("eos_token_id")
    values["eos_token_ids"] = tuple([eos] if isinstance(eos, int) else eos or eos_fallback)
    unknown = set(overrides) - set(DiffusionGemmaSettings.__dataclass_fields__)
    if unknown:
        raise GenerationError(f"unknown DiffusionGemma setting(s): {', '.join(sorted(unknown))}")
    return DiffusionGemmaSettings(**{**values, **overrides}).checked()


@dataclass
class StepEvent:
    canvas: int
    step: int  # 1-based within the canvas
    draft: list[int]  # the step's argmax canvas: the closest thing to the final text, for streaming
    accepted: int  # positions the sampler kept this step


@dataclass
class CanvasEvent:
    canvas: int
    tokens: list[int]  # the canvas's final tokens (cut after EOS)
    steps: int


@dataclass
class DiffusionGemmaResult:
    tokens: list[int]  # generated tokens, through the first EOS
    finish_reason: str  # "eos" or "length"
    canvases: int
    steps: int  # decoder forwards
    encoded_tokens: int  # encoder positions run by this call (prompt suffix + finished canvases)

    @property
    def tokens_per_forward(self) -> float:
        return len(self.tokens) / max(1, self.steps)


@dataclass
class DoneEvent:
    result: DiffusionGemmaResult


@dataclass
class Session:
    """The prefix cache kept between calls and the tokens it holds."""

    cache: PrefixCache | None = None
    tokens: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.cache, self.tokens = None, []


def temperature(t_min: float, t_max: float, remaining: int, steps: int) -> torch.Tensor:
    """The linear schedule at the step with `remaining` steps left (steps..1): t_max * remaining / steps of
    the way from t_min. Computed as transformers does (an fp32 tensor), so the tempered logits match bitwise."""
    return t_min + (t_max - t_min) * (torch.tensor(remaining, dtype=torch.int32) / steps)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """Entropy-bound acceptance: the lowest-entropy positions whose entropies, less the largest of them, sum to
    at most `bound` (the lowest one always)."""
    ent, order = torch.sort(entropy, dim=-1)
    keep = torch.cumsum(ent, dim=-1) - ent <= bound
    return torch.zeros_like(keep).scatter(-1, order, keep)


class AdaptiveStop:
    """Stop a canvas once its argmax has been the same for the last `stability` steps (0: at once) and the
    mean entropy of the tempered logits is below `confidence`. One instance per canvas."""

    def __init__(self, stability: int, confidence: float):
        self.stability, self.confidence = stability, confidence
        self.history: list[torch.Tensor] = []

    def __call__(self, argmax: torch.Tensor, entropy: torch.Tensor) -> bool:
        """argmax [1, C] of this step, entropy [1, C] of its tempered logits."""
        # Fewer than `stability` earlier steps: not stable (transformers pads the history with -1).
        stable = len(self.history) == self.stability and all(bool((h == argmax).all()) for h in self.history)
        if self.stability:
            self.history = [*self.history[1 - self.stability :], argmax] if self.stability > 1 else [argmax]
        return stable and bool(entropy.mean() < self.confidence)


def image_token_ids(config: DiffusionGemmaConfig) -> set[int]:
    """The image placeholder ids (image, begin and end of image), which the text path refuses."""
    return {t for t in (config.image_token_id, config.boi_token_id, config.eoi_token_id) if t is not None}


def check_text_prompt(config: DiffusionGemmaConfig, prompt: Sequence[int]) -> None:
    """GenerationError for token ids the text path cannot take: outside the vocabulary, or image placeholders."""
    found = sorted(image_token_ids(config).intersection(prompt))
    if found:
        raise GenerationError(f"the prompt holds image placeholder token(s) {found}: clover-lite runs DiffusionGemma's "
                              "text path only (an image in the conversation puts them there, and so does their "
                              "text, such as <image_soft_token>, written in a message; remove it)")
    if any(not 0 <= t < config.vocab_size for t in prompt):
        raise GenerationError(f"prompt token id out of the vocabulary (0..{config.vocab_size - 1})")


def _check_request(model: DiffusionGemma, prompt: list[int], settings: DiffusionGemmaSettings, committed: int,
                   images: Any) -> int:
    c = model.config
    if images is not None:
        raise GenerationError("image input is not supported: clover-lite runs DiffusionGemma's text path only "
                              "(send text alone)")
    check_text_prompt(c, prompt)
    if not prompt and committed == 0:
        raise GenerationError("empty prompt: DiffusionGemma needs at least one token (e.g. BOS) to condition on")
    C = settings.canvas_length or c.canvas_length
    ctx = c.max_position_embeddings
    if C > ctx:
        raise GenerationError(f"canvas of {C} tokens is larger than the context ({ctx} positions); use a "
                              "canvas_length of at most that")
    canvases = math.ceil(settings.max_new_tokens / C)
    need = committed + len(prompt) + canvases * C
    if need > ctx:
        raise GenerationError(f"prompt ({committed + len(prompt)} tokens) plus {canvases} canvas(es) of {C} needs "
                              f"{need} positions, over the context of {ctx}; lower max_new_tokens or shorten the "
                              "prompt")
    return C


@torch.no_grad()
def stream(model: DiffusionGemma, prompt: Sequence[int], settings: DiffusionGemmaSettings | None = None,
           session: Session | None = None, generator: torch.Generator | None = None, images: Any = None,
           ) -> Iterator[StepEvent | CanvasEvent | DoneEvent]:
    """Generate after `prompt` (token ids: the whole conversation; with a `session` whose cached tokens it
    extends, only the new suffix is encoded). Yields a StepEvent per denoising step, a CanvasEvent per
    finished canvas and a final DoneEvent. `generator`: the random draws (torch's default one if None)."""
    settings = (settings or DiffusionGemmaSettings()).checked()
    session = session if session is not None else Session()
    prompt = [int(t) for t in prompt]
    reuse = session.cache is not None and prompt[: len(session.tokens)] == session.tokens
    committed = len(session.tokens) if reuse else 0
    new = prompt[committed:]
    C = _check_request(model, new, settings, committed, images)  # before the session is touched
    if not reuse:
        session.reset()
    try:
        yield from _canvases(model, new, settings, session, generator, C)
    except Exception:
        session.reset()  # a failed encode may have left the cache half-written
        raise


def _canvases(model: DiffusionGemma, new: list[int], settings: DiffusionGemmaSettings, session: Session,
              generator: torch.Generator | None, C: int) -> Iterator[StepEvent | CanvasEvent | DoneEvent]:
    device, dtype = model.decoder.embed_tokens.weight.device, model.decoder.embed_tokens.weight.dtype
    V, N = model.config.vocab_size, settings.max_denoising_steps
    if session.cache is None:
        session.cache = model.new_cache()
    cache = session.cache
    eos = torch.tensor(settings.eos_token_ids, dtype=torch.long, device=device)
    stopping = settings.stability_threshold is not None and settings.confidence_threshold is not None
    encoded, steps, out, finish = 0, 0, [], "length"
    pending = new  # committed tokens not yet in the cache
    for index in range(math.ceil(settings.max_new_tokens / C)):
        if pending:
            model.encode(torch.tensor([pending], device=device), cache)
            session.tokens += pending
            encoded += len(pending)
        canvas = torch.randint(0, V, (1, C), device=device, generator=generator)
        stopper = AdaptiveStop(settings.stability_threshold, settings.confidence_threshold) if stopping else None
        self_cond, argmax, done_steps = None, canvas, 0
        for cur_step in range(N, 0, -1):
            logits = model.denoise(canvas, cache, self_cond)
            if not bool(torch.isfinite(logits).all()):  # sampling would silently turn NaN into garbage tokens
                advice = ("load the model in float32 or bfloat16 rather than float16" if dtype == torch.float16
                          else "check its weights (load with check_finite=True, the default, scans them)")
                raise NonFiniteError(f"canvas {index + 1}, step {N - cur_step + 1}: the decoder's logits hold NaN "
                                     f"or Inf; {advice}")
            tempered = logits / temperature(settings.t_min, settings.t_max, cur_step, N).to(device)
            probs = torch.softmax(tempered, dim=-1, dtype=torch.float32)
            sampled = torch.multinomial(probs.view(-1, V), 1, generator=generator).view(1, C)
            argmax = tempered.argmax(-1)
            entropy = _entropy(tempered)
            keep = _accept(entropy, settings.entropy_bound)
            noise = torch.randint(0, V, (1, C), device=device, generator=generator)
            canvas = torch.where(keep, sampled, noise)
            self_cond = tempered.to(dtype)  # fed back in the embeddings' dtype, as transformers does
            steps += 1
            done_steps += 1
            stop = stopper is not None and stopper(argmax, entropy)
            yield StepEvent(canvas=index, step=done_steps, draft=argmax[0].tolist(), accepted=int(keep.sum()))
            if stop:
                break
        tokens = argmax[0].tolist()
        hit = torch.isin(argmax[0], eos).nonzero() if eos.numel() else torch.empty(0)
        if len(hit):
            tokens = tokens[: int(hit[0]) + 1]
            finish = "eos"
        out += tokens
        yield CanvasEvent(canvas=index, tokens=tokens, steps=done_steps)
        pending = argmax[0].tolist()
        if finish == "eos":
            break
    yield DoneEvent(DiffusionGemmaResult(tokens=out, finish_reason=finish, canvases=index + 1, steps=steps,
                                         encoded_tokens=encoded))


def generate(model: DiffusionGemma, prompt: Sequence[int], settings: DiffusionGemmaSettings | None = None,
             session: Session | None = None, generator: torch.Generator | None = None, images: Any = None,
             **overrides: Any) -> DiffusionGemmaResult:
    """Run `stream` to the end and return its result; `overrides` replace fields of `settings`."""
    if overrides:
        unknown = set(overrides) - set(DiffusionGemmaSettings.__dataclass_fields__)
        if unknown:
            raise GenerationError(f"unknown DiffusionGemma setting(s): {', '.join(sorted(unknown))}")
        settings = replace(settings or DiffusionGemmaSettings(), **overrides)
    for event in stream(model, prompt, settings, session, generator, images):
        if isinstance(event, DoneEvent):
            return event.result
    raise AssertionError("stream ended without a DoneEvent")
