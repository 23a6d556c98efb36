"""Block-diffusion decoding: GenerationConfig, the runners that score a block, and the decoding loop.

The loop follows SDAR's published algorithm on a fixed block grid from position 0 (docs/ARCHITECTURE.md
section 2): prefill commits the prompt's whole blocks; each block starts as masks (the first one may
hold the prompt's tail); every step scores the masked positions, commits some of them by the policy;
a finished block is committed to the cache and the next one starts.
"""

from __future__ import annotations

import math
import numbers
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace

import torch

from clover_lite.errors import GenerationError
from clover_lite.models.denoiser import Denoiser
from clover_lite.runtime.nonfinite import nonfinite_error
from clover_lite.runtime.sampling import CONFIDENCE_RANGES, CONFIDENCES, choose
from clover_lite.tokenizer.incremental import IncrementalDecoder

POLICIES = ("threshold", "fixed")
LARGE_BLOCK_FACTOR = 4  # a block this many times the trained one warns
COMMIT_MODES = ("exact", "reuse")


# Below this, logits / temperature overflow fp32 for logits of ordinary size (tens), and sampling is argmax anyway.
MIN_TEMPERATURE = 1e-4


def check_seed(seed: int | None) -> None:
    """GenerationError unless `seed` is None or fits torch.Generator.manual_seed (64 bits, either sign)."""
    if seed is not None and (not isinstance(seed, numbers.Integral) or isinstance(seed, bool)):
        raise GenerationError(f"seed must be an integer or None, got {seed!r}")
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise GenerationError(f"seed must fit in 64 bits (-2**63 to 2**64 - 1), got {seed}")


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode. `block_size` / `steps_per_block` None take the model's trained block size and
    one token per step for the `fixed` policy."""

    max_new_tokens: int = 256
    block_size: int | None = None
    steps_per_block: int | None = None
    policy: str = "threshold"  # threshold: every masked position above `threshold`, at least one per step
    threshold: float = 0.9
    confidence: str = "prob"  # prob | margin | entropy (see sampling.choose)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    commit: str = "exact"  # exact: clean re-forward of a finished block; reuse: keep its last step's states

    def __post_init__(self) -> None:
        # One stop string may be given bare, and any sequence (or None) for the tuples: the same value whether
        # it comes through the constructor, replace() or keyword overrides.
        for key in ("stop", "stop_token_ids"):
            value = getattr(self, key)
            if value is None:
                value = ()
            elif isinstance(value, str) and key == "stop":
                value = (value,)
            elif isinstance(value, (list, tuple)):
                value = tuple(value)
            object.__setattr__(self, key, value)
        # numpy scalars (an embedder's values often come from arrays) as the Python numbers torch takes.
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (int, bool)):
                object.__setattr__(self, f.name, int(value))
            elif isinstance(value, numbers.Real) and not isinstance(value, (int, float, bool)):
                object.__setattr__(self, f.name, float(value))

    def replace(self, **overrides) -> GenerationConfig:
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise GenerationError(f"unknown generation setting(s) {unknown}; known: {sorted(known)}")
        return replace(self, **overrides)

    def resolved(self, model_block_size: int | None, max_length: int | None = None) -> GenerationConfig:
        """Fill the defaults that depend on the model and check every setting, the block size against the
        model's context (`max_length`) and trained block size: one far larger warns (UserWarning)."""
        self.validate()  # explicit values first, so block_size=0 is an error and not "use the default"
        block = self.block_size if self.block_size is not None else (model_block_size or 4)
        steps = self.steps_per_block if self.steps_per_block is not None else block
        cfg = replace(self, block_size=block, steps_per_block=steps)
        cfg.validate()
        if max_length is not None and block > max_length:
            raise GenerationError(f"block_size {block} exceeds the model's context of {max_length} positions; "
                                  f"use the model's block size ({model_block_size or 4}) or less than {max_length}")
        if model_block_size and block > LARGE_BLOCK_FACTOR * model_block_size:
            warnings.warn(f"block_size {block} is over {LARGE_BLOCK_FACTOR}x the block size the model was trained "
                          f"with ({model_block_size}): it then predicts many positions with little context, and "
                          "answers degrade or repeat", UserWarning, stacklevel=3)
        return cfg

    def _check_types(self) -> None:
        """A GenerationError naming the setting for a value of the wrong type (before any comparison with it)."""
        def is_int(v) -> bool:  # numpy's integers too: an embedder's values often come from arrays
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        def is_number(v) -> bool:
            return isinstance(v, numbers.Real) and not isinstance(v, bool)

        wrong = [
            *[(k, "an integer") for k in ("max_new_tokens", "top_k") if not is_int(getattr(self, k))],
            *[(k, "an integer or None") for k in ("block_size", "steps_per_block", "seed")
              if getattr(self, k) is not None and not is_int(getattr(self, k))],
            *[(k, "a number") for k in ("threshold", "temperature", "top_p") if not is_number(getattr(self, k))],
            *[(k, "a string") for k in ("policy", "confidence", "commit") if not isinstance(getattr(self, k), str)],
        ]
        if not isinstance(self.ignore_eos, bool):
            wrong.append(("ignore_eos", "True or False"))
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            wrong.append(("stop", "a string or a list of strings"))
        if not isinstance(self.stop_token_ids, tuple) or not all(is_int(t) for t in self.stop_token_ids):
            wrong.append(("stop_token_ids", "a list of integer token ids"))
        if wrong:
            key, kind = wrong[0]
            raise GenerationError(f"{key} must be {kind}, got {getattr(self, key)!r}")

    def validate(self) -> None:
        def bad(msg: str) -> GenerationError:
            return GenerationError(msg)

        self._check_types()
        if self.max_new_tokens < 1:
            raise bad(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.block_size is not None and self.block_size < 1:
            raise bad(f"block_size must be >= 1, got {self.block_size}")
        if self.steps_per_block is not None and self.steps_per_block < 1:
            raise bad(f"steps_per_block must be >= 1, got {self.steps_per_block}")
        if self.steps_per_block is not None and self.block_size is not None and self.steps_per_block > self.block_size:
            raise bad(f"steps_per_block must be at most block_size ({self.block_size}), got {self.steps_per_block}")
        if self.policy not in POLICIES:
            raise bad(f"policy must be one of {POLICIES}, got '{self.policy}'")
        if self.confidence not in CONFIDENCES:
            raise bad(f"confidence must be one of {CONFIDENCES}, got '{self.confidence}'")
        if self.commit not in COMMIT_MODES:
            raise bad(f"commit must be one of {COMMIT_MODES}, got '{self.commit}'")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise bad(f"temperature {self.temperature:g} is too small to sample with (logits divided by it overflow "
                      f"fp32); use 0 for greedy, or at least {MIN_TEMPERATURE:g}")
        check_seed(self.seed)
        if self.top_k < 0:
            raise bad(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.confidence in CONFIDENCE_RANGES:
            lo, hi = CONFIDENCE_RANGES[self.confidence]
            if not (math.isfinite(self.threshold) and lo <= self.threshold <= hi):
                raise bad(f"threshold must be in [{lo:g}, {hi:g}] for confidence '{self.confidence}', "
                          f"got {self.threshold}")
        if any(not s for s in self.stop):
            raise bad("stop strings must be non-empty")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0  # tokens returned
    committed_tokens: int = 0  # positions decided by denoising steps (may exceed new_tokens past a stop)
    forwards: int = 0  # denoising steps
    commit_forwards: int = 0  # forwards committing a finished block (none with commit="reuse" or recompute)
    blocks: int = 0
    prefill_seconds: float = 0.0
    seconds: float = 0.0  # whole generation, prefill included

    @property
    def tokens_per_forward(self) -> float:
        return self.committed_tokens / self.forwards if self.forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        decode = self.seconds - self.prefill_seconds
        return self.new_tokens / decode if decode > 0 else 0.0

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["tokens_per_forward"] = self.tokens_per_forward
        d["tokens_per_second"] = self.tokens_per_second
        return d


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos" | "stop" | "length"
    stats: GenerationStats


@dataclass
class StepEvent:
    """One denoising step. `block` is the current block with None for positions still masked."""

    block_start: int  # absolute position of the block's first position
    committed: list[int]  # absolute positions committed by this step
    tokens: list[int]  # the tokens put there
    block: list[int | None]
    text: str  # generated text so far (the contiguous committed part)
    kind: str = "step"


@dataclass
class BlockEvent:
    """A block became final (and was committed to the cache unless generation ends with it)."""

    block_start: int
    tokens: list[int]
    text: str
    kind: str = "block"


@dataclass
class DoneEvent:
    generation: Generation
    kind: str = "done"


Event = StepEvent | BlockEvent | DoneEvent


# ---- runners: who scores a block ---------------------------------------------------------------
class CachedRunner:
    """Scores blocks against a DenoiseCache: the committed past is run once."""

    def __init__(self, model: Denoiser, block_size: int, commit: str = "exact", prefill_chunk: int = 2048,
                 cache=None, static_step=None):
        """`cache` (reset here) and `static_step` (a graph.StaticStep over that cache) come from an engine that
        keeps them across generations; the static step serves full blocks of its block size."""
        self.model = model
        self.block_size = block_size
        self.commit_mode = commit
        self.prefill_chunk = prefill_chunk
        self.device = model.embed_tokens.weight.device
        self.persistent = cache is not None
        self.cache = cache if cache is not None else model.new_cache()
        self.cache.reset()
        self.static = static_step if static_step is not None and static_step.serves(block_size, commit) else None
        self._last_updates = None

    def reserve(self, total: int) -> None:
        if self.persistent and total > self.cache.capacity:
            # Growing the engine's cache would move the buffers its captured graph points at.
            raise GenerationError(
                f"this engine's cache holds {self.cache.capacity} positions and {total} are needed; "
                "load with a larger context (clover_lite.load(..., context=N))"
            )
        self.cache.reserve(total)

    def _ids(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor([list(ids)], dtype=torch.long, device=self.device)

    @torch.no_grad()
    def prefill(self, ids: Sequence[int]) -> None:
        if ids:
            self.model.prefill(self._ids(ids), self.cache, self.block_size, self.prefill_chunk)

    @torch.no_grad()
    def step(self, block: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        pos = torch.tensor(list(positions), dtype=torch.long, device=self.device)
        if self.static is not None and len(block) == self.block_size:
            return self.static(block)[0, pos]
        logits, updates = self.model.step(self._ids(block), self.cache, pos, keep_updates=self.commit_mode == "reuse")
        self._last_updates = updates
        return logits[0]

    @torch.no_grad()
    def replay(self, before: Sequence[int], block: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """What led to a step's logits, again, eagerly (never the captured graph) and from an empty cache: the
        committed sequence `before` (whole blocks) as a prefill, then the step. For finding where non-finite
        values arise (find_nonfinite_module): a NaN written to the cache by an earlier commit shows up where
        it was made, not where a later step read it. The cache is left holding `before`."""
        self.cache.reset()
        self.prefill(before)
        pos = torch.tensor(list(positions), dtype=torch.long, device=self.device)
        return self.model.step(self._ids(block), self.cache, pos)[0][0]

    @torch.no_grad()
    def commit(self, block: Sequence[int]) -> int:
        """Append a finished block to the cache; returns the forwards that took (reuse keeps the last step's
        states: none)."""
        updates, self._last_updates = self._last_updates, None
        if self.static is not None and len(block) == self.block_size and self.cache.length % self.block_size == 0:
            self.static.commit(block)  # a full block of the grid: the captured commit
            return 1
        self.model.commit(self._ids(block), self.cache, self.block_size, updates=updates)
        return int(updates is None)


class RecomputeRunner:
    """Re-runs the whole sequence (prompt + committed blocks + current block) at every step, with no
    cache: what llama.cpp's diffusion CLI and LLaDA's reference loop do. The baseline and the check."""

    def __init__(self, model: Denoiser, block_size: int):
        self.model = model
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        self.committed: list[int] = []

    def reserve(self, total: int) -> None:
        pass

    def prefill(self, ids: Sequence[int]) -> None:
        self.committed = list(ids)

    @torch.no_grad()
    def step(self, block: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([self.committed + list(block)], dtype=torch.long, device=self.device)
        logits = self.model(ids, block_size=self.block_size)[0]
        return logits[[len(self.committed) + p for p in positions]]

    def replay(self, before: Sequence[int], block: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """The step again after `before` (its whole sequence is re-run anyway)."""
        self.committed = list(before)
        return self.step(block, positions)

    def commit(self, block: Sequence[int]) -> int:
        """The block joins the sequence re-run at every step: no forward of its own."""
        self.committed += list(block)
        return 0


# ---- the loop ----------------------------------------------------------------------------------
def fixed_schedule(block_size: int, steps: int) -> list[int]:
    """Tokens committed at each step of a full block under `fixed`: block_size/steps, remainder first."""
    base, extra = divmod(block_size, steps)
    return [base + (1 if s < extra else 0) for s in range(steps)]


def select_positions(conf: torch.Tensor, cfg: GenerationConfig, step_in_block: int) -> torch.Tensor:
    """Indices (into the masked positions) to commit this step; always at least one."""
    n = conf.shape[0]
    if cfg.policy == "threshold":
        chosen = (conf > cfg.threshold).nonzero().flatten()
        return chosen if chosen.numel() else conf.argmax().reshape(1)
    schedule = fixed_schedule(cfg.block_size, cfg.steps_per_block)
    k = schedule[step_in_block] if step_in_block < len(schedule) else 1
    k = max(1, min(k, n))
    return torch.topk(conf, k).indices


def denoise(
    runner: CachedRunner | RecomputeRunner,
    prompt_ids: Sequence[int],
    cfg: GenerationConfig,
    mask_token_id: int,
    eos_token_ids: Sequence[int] = (),
    decode: Callable[[list[int]], str] | None = None,
    max_length: int | None = None,
    context_note: str = "",
    chooser: Callable = choose,
    detokenizer: IncrementalDecoder | None = None,
) -> Iterator[Event]:
    """Generate after `prompt_ids` by block diffusion, yielding an event per step and per block and a
    final DoneEvent. `cfg` must be resolved (block_size and steps_per_block set). `context_note` follows
    max_length in the error for a request over it (where that limit comes from). `chooser` picks each
    step's tokens and confidences (`runtime.sampling.choose`'s contract): the engine passes the one chosen
    at load with the kernels. The events' text comes from `detokenizer`, a fresh IncrementalDecoder (the engine
    passes its tokenizer's), else from `decode` re-run on all generated ids at every step (exact for any
    function, in time that grows with the reply), else is empty."""
    t0 = time.perf_counter()
    B = cfg.block_size
    P = len(prompt_ids)
    if P == 0:
        raise GenerationError("the prompt is empty; give at least one token (e.g. a BOS token or some text)")
    total = P + cfg.max_new_tokens
    if max_length is not None and total > max_length:
        raise GenerationError(
            f"prompt ({P} tokens) + max_new_tokens ({cfg.max_new_tokens}) = {total} exceeds the context "
            f"of {max_length} tokens{context_note}; shorten the prompt or lower max_new_tokens"
        )
    eos_ids = set() if cfg.ignore_eos else set(eos_token_ids)
    stop_ids = (set(cfg.stop_token_ids) | eos_ids) - {mask_token_id}
    generator = None
    if cfg.temperature > 0:
        generator = torch.Generator(device=runner.device)
        generator.manual_seed(cfg.seed if cfg.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))

    stats = GenerationStats(prompt_tokens=P)
    runner.reserve(total)
    first_start = P // B * B
    runner.prefill(prompt_ids[:first_start])
    if runner.device.type == "cuda":  # the prefill's kernels are queued, not done: wait once, here
        torch.cuda.synchronize(runner.device)
    stats.prefill_seconds = time.perf_counter() - t0

    generated: list[int] = []  # final tokens of finished blocks (generated part only)
    finish, out_ids, out_text = "length", None, None
    # The text of the contiguous committed prefix, decoded as it grows: a step costs the same at any length.
    detok = detokenizer if detokenizer is not None else IncrementalDecoder(decode or _no_text, windowed=False)

    start = first_start
    while start < total and out_ids is None:
        end = min(start + B, total)
        block: list[int | None] = list(prompt_ids[start:P]) + [None] * (end - max(start, P))
        gen0 = max(P - start, 0)  # the block's first generated position
        seen = gen0  # block[gen0:seen] is committed, contiguous with `generated` and pushed to `detok`
        step_in_block = 0
        while None in block:
            masked = [i for i, t in enumerate(block) if t is None]
            ids = [mask_token_id if t is None else t for t in block]
            logits = runner.step(ids, masked)
            tokens, conf = chooser(
                logits, cfg.temperature, cfg.top_k, cfg.top_p, cfg.confidence, mask_token_id, generator
            )
            # Whether the logits are all finite (NaN logits pick token 0 everywhere, an "empty" reply): one
            # reduction on the device, its flag riding with the confidences, so still one transfer.
            conf = torch.cat([conf.float(), torch.isfinite(logits).all().float().reshape(1)])
            # The block's choices to the host at once (at most 64 each): one wait for the device per step,
            # not one per selection and per committed token.
            tokens, conf = tokens.cpu(), conf.cpu()
            conf, finite = conf[:-1], bool(conf[-1])
            if not finite:
                raise nonfinite_error(runner, (list(prompt_ids) + generated)[:start], ids, masked, start)
            pick = select_positions(conf, cfg, step_in_block).tolist()
            for j in pick:
                block[masked[j]] = int(tokens[j])
            stats.forwards += 1
            stats.committed_tokens += len(pick)
            step_in_block += 1
            # A stop token or string in the contiguous committed prefix: earlier steps found none in theirs, so
            # only the tokens this step made contiguous, and the text they changed, can hold one.
            reason, new = None, []
            while seen < len(block) and block[seen] is not None:
                if block[seen] in stop_ids:
                    reason = "eos" if block[seen] in eos_ids else "stop"
                    break
                new.append(block[seen])
                seen += 1
            text = detok.push(new)
            if cfg.stop and new:
                # A match not in the previous text ends after what this push left unchanged. It comes before a
                # stop token found in this step (the text holds only the tokens before it), so it wins.
                hits = [i for s in cfg.stop if (i := text.find(s, max(0, detok.changed_from - len(s) + 1))) >= 0]
                if hits:
                    reason, text = "stop", text[: min(hits)]
            committed = sorted(start + masked[j] for j in pick)
            yield StepEvent(
                block_start=start,
                committed=committed,
                tokens=[block[p - start] for p in committed],
                block=list(block),
                text=text,
            )
            if reason is not None:
                finish, out_ids, out_text = reason, generated + block[gen0:seen], text
                if reason == "stop" and len(text) < len(detok.text):  # cut at a stop string: not its ids
                    out_ids = out_ids[: detok.ids_covering(text)]
                break
        if out_ids is not None:
            break
        final = [int(t) for t in block]
        generated += final[gen0:]  # what `detok` holds: the whole block was contiguous, with no stop token
        stats.blocks += 1
        if end < total:
            stats.commit_forwards += runner.commit(final)
        yield BlockEvent(block_start=start, tokens=final, text=detok.text)
        start = end

    if out_ids is None:
        out_ids = generated
        out_text = detok.text
    stats.new_tokens = len(out_ids)
    stats.seconds = time.perf_counter() - t0
    yield DoneEvent(Generation(text=out_text, token_ids=list(out_ids), finish_reason=finish, stats=stats))


def _no_text(ids: list[int]) -> str:
    return ""


def run_to_end(events: Iterator[Event]) -> Generation:
    for ev in events:
        if isinstance(ev, DoneEvent):
            return ev.generation
    raise RuntimeError("decoding ended without a result")


__all__ = [
    "GenerationConfig", "GenerationStats", "Generation", "StepEvent", "BlockEvent", "DoneEvent", "Event",
    "CachedRunner", "RecomputeRunner", "denoise", "run_to_end", "fixed_schedule", "select_positions",
]
