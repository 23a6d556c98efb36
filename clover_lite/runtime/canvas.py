"""Denoising a canvas: any pattern of given and masked positions after a prompt, filled on the block grid.

The open-ended loop (`generation.denoise`) is the case "prompt tail, then masks". Here every block of the
canvas holds given tokens (template text, which never changes) and masked slot positions, which are denoised
together with the same cache, steps and one commit per block (docs/ARCHITECTURE.md section 9):

- a choice slot's positions may only take the tokens of the options still consistent with what the slot
  has committed, so its value is always one of them; a position every consistent option agrees on is filled
  without a forward (constraint propagation), after the forward that scored it;
- a free slot is open text; once it commits an end token, its later positions take the end token;
- `joint` scores every masked position of the block in each forward and commits by the policy; `sequential`
  commits the leftmost masked position only, one per forward, as an autoregressive decoder must.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from clover_lite.errors import GenerationError
from clover_lite.runtime.generation import CachedRunner, GenerationConfig, RecomputeRunner, select_positions
from clover_lite.runtime.nonfinite import nonfinite_error
from clover_lite.runtime.sampling import choose
from clover_lite.runtime.template import Canvas

MODES = ("joint", "sequential")


@dataclass
class CanvasResult:
    """The canvas filled: every position's token, each slot's tokens, and what it cost."""

    tokens: list[int]
    slot_tokens: dict[str, list[int]]
    # Per choice slot, each option's probability as the product of its tokens' probabilities (full-vocabulary
    # softmax) in the first forward that scored each position.
    option_probabilities: dict[str, dict[str, float]]
    order: list[str]  # slots in the order they were completed
    forwards: int = 0  # denoising forwards (steps)
    commit_forwards: int = 0
    seconds: float = 0.0
    steps: list[list[int]] = field(default_factory=list)  # canvas positions committed by each forward


class _SlotState:
    """What a slot still allows: for a choice, the options consistent with its committed tokens."""

    def __init__(self, slot, end_token_id: int | None, end_ids: set[int]):
        self.slot = slot
        self.choice = slot.options is not None
        self.options = slot.padded(end_token_id) if self.choice else None
        self.alive = list(range(len(self.options))) if self.choice else None
        self.end_token_id, self.end_ids = end_token_id, end_ids

    def allowed(self, j: int) -> list[int] | None:
        """Tokens position j may take (None: any)."""
        if not self.choice:
            return None
        return sorted({self.options[o][j] for o in self.alive})

    def accepts(self, j: int, token: int) -> bool:
        return not self.choice or any(self.options[o][j] == token for o in self.alive)

    def commit(self, j: int, token: int) -> None:
        if self.choice:
            self.alive = [o for o in self.alive if self.options[o][j] == token]

    def forced(self, canvas_tokens: list[int | None], scored_below: int) -> list[tuple[int, int]]:
        """(canvas position, token) of masked positions that only one token can take now: for a choice, among
        positions before `scored_below` (those a forward has scored, so every option's probability has them);
        for a free slot, every position after its end token."""
        s, out = self.slot, []
        if self.choice:
            for j in range(min(s.length, scored_below - s.start)):
                if canvas_tokens[s.start + j] is None:
                    allowed = self.allowed(j)
                    if len(allowed) == 1:
                        out.append((s.start + j, allowed[0]))
        elif self.end_token_id is not None:
            ended = False
            for j in range(s.length):
                t = canvas_tokens[s.start + j]
                if ended and t is None:
                    out.append((s.start + j, self.end_token_id))
                ended = ended or (t is not None and t in self.end_ids)
        return out


def fill_canvas(
    runner: CachedRunner | RecomputeRunner,
    prompt_ids: Sequence[int],
    canvas: Canvas,
    cfg: GenerationConfig,
    mask_token_id: int,
    end_token_id: int | None,
    eos_token_ids: Sequence[int] = (),
    mode: str = "joint",
    chooser: Callable = choose,
    max_length: int | None = None,
) -> CanvasResult:
    """Fill `canvas` after `prompt_ids`. `cfg` must be resolved; its policy, threshold, confidence and sampling
    settings apply (max_new_tokens and stops do not: the canvas fixes the length)."""
    if mode not in MODES:
        raise GenerationError(f"mode must be one of {MODES}, got {mode!r}")
    t0 = time.perf_counter()
    B, P, C = cfg.block_size, len(prompt_ids), len(canvas.tokens)
    total = P + C
    if C == 0:
        raise GenerationError("the template is empty: nothing to fill")
    if max_length is not None and total > max_length:
        raise GenerationError(f"prompt ({P} tokens) + template ({C} positions) = {total} exceeds the context of "
                              f"{max_length} tokens; shorten the context, the template or its slots")
    end_ids = set(eos_token_ids) | ({end_token_id} if end_token_id is not None else set())
    states = [_SlotState(s, end_token_id, end_ids) for s in canvas.slots]
    where = canvas.slot_at()
    tokens: list[int | None] = list(canvas.tokens)
    generator = None
    if cfg.temperature > 0:
        generator = torch.Generator(device=runner.device)
        generator.manual_seed(cfg.seed if cfg.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    probs: dict[str, dict[str, float]] = {
        s.name: dict.fromkeys(s.options, 1.0) for s in canvas.slots if s.options is not None}
    scored: set[int] = set()
    done_at: dict[str, tuple[int, int]] = {}
    result = CanvasResult(tokens=[], slot_tokens={}, option_probabilities=probs, order=[])

    def set_token(c: int, token: int) -> None:
        tokens[c] = token
        k, j = where[c]
        states[k].commit(j, token)

    def propagate(scored_below: int) -> list[int]:
        filled = []
        changed = True
        while changed:
            changed = False
            for st in states:
                for c, t in st.forced(tokens, scored_below):
                    if tokens[c] is None:
                        set_token(c, t)
                        filled.append(c)
                        changed = True
        return filled

    def note_done(step: int) -> None:
        for k, s in enumerate(canvas.slots):
            if s.name not in done_at and all(tokens[s.start + j] is not None for j in range(s.length)):
                done_at[s.name] = (step, k)

    runner.reserve(total)
    first_start = P // B * B
    runner.prefill(list(prompt_ids[:first_start]))
    start = first_start
    while start < total:
        end = min(start + B, total)
        first_forward, step_in_block = True, 0
        while True:
            masked = [p - start for p in range(max(start, P), end) if tokens[p - P] is None]
            if not masked:
                break
            asked = masked if mode == "joint" or first_forward else masked[:1]
            ids = [mask_token_id if t is None else t for t in _block(prompt_ids, tokens, start, end)]
            logits = runner.step(ids, asked)
            if not bool(torch.isfinite(logits).all()):
                before = (list(prompt_ids) + [int(t) for t in tokens[: max(start - P, 0)]])[:start]
                raise nonfinite_error(runner, before, ids, asked, start)
            rows = [start + i - P for i in asked]  # canvas positions of the logits' rows
            if first_forward:
                _record_probabilities(logits, rows, where, canvas, states, probs, scored)
            chosen, conf = _choose(logits, rows, where, states, cfg, mask_token_id, generator, chooser)
            if mode == "joint":
                order = select_positions(torch.tensor(conf), cfg, step_in_block).tolist()
                order = sorted(order, key=lambda i: -conf[i])
            else:
                order = [0]  # the leftmost masked position
            committed_now = []
            for i in order:
                c, t = rows[i], chosen[i]
                k, j = where[c]
                if tokens[c] is None and states[k].accepts(j, t):
                    set_token(c, t)
                    committed_now.append(c)
                    committed_now += propagate(end - P)
            result.forwards += 1
            step_in_block += 1
            result.steps.append(sorted(committed_now))
            note_done(result.forwards)
            first_forward = False
        if end < total:
            runner.commit([int(t) for t in _block(prompt_ids, tokens, start, end)])
            result.commit_forwards += 1
        start = end
    note_done(result.forwards)
    result.tokens = [int(t) for t in tokens]
    result.slot_tokens = {s.name: result.tokens[s.start : s.start + s.length] for s in canvas.slots}
    result.order = [name for name, _ in sorted(done_at.items(), key=lambda kv: kv[1])]
    result.seconds = time.perf_counter() - t0
    return result


def _block(prompt_ids: Sequence[int], tokens: list[int | None], start: int, end: int) -> list[int | None]:
    """Positions start..end of prompt + canvas (None where the canvas is still masked)."""
    P = len(prompt_ids)
    return [prompt_ids[p] if p < P else tokens[p - P] for p in range(start, end)]


def _record_probabilities(logits, rows, where, canvas, states, probs, scored) -> None:
    """Multiply each option's probability by its token's, at the first forward that scores each position."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    for r, c in enumerate(rows):
        k, j = where[c]
        s = canvas.slots[k]
        if s.options is None or c in scored:
            continue
        scored.add(c)
        for text, ids in zip(s.options, s.option_ids, strict=True):
            if j < len(ids):  # an option's own tokens; the end-token padding is not part of it
                probs[s.name][text] *= math.exp(float(logp[r, ids[j]]))


def _choose(logits, rows, where, states, cfg, mask_token_id, generator, chooser) -> tuple[list[int], list[float]]:
    """Each row's token and confidence: free rows through the engine's chooser over the vocabulary, choice rows
    over the tokens their consistent options allow (confidence on that renormalised distribution)."""
    chosen, conf = [0] * len(rows), [0.0] * len(rows)
    free = [r for r, c in enumerate(rows) if states[where[c][0]].allowed(where[c][1]) is None]
    constrained = [r for r in range(len(rows)) if r not in set(free)]
    if free:
        t, p = chooser(logits[free], cfg.temperature, cfg.top_k, cfg.top_p, cfg.confidence, mask_token_id, generator)
        for r, ti, pi in zip(free, t.tolist(), p.float().tolist(), strict=True):
            chosen[r], conf[r] = int(ti), float(pi)
    if constrained:
        cols = sorted({t for r in constrained for t in states[where[rows[r]][0]].allowed(where[rows[r]][1])})
        index = {t: i for i, t in enumerate(cols)}
        sub = logits[constrained][:, cols].float()
        keep = torch.zeros_like(sub, dtype=torch.bool)
        for i, r in enumerate(constrained):
            for t in states[where[rows[r]][0]].allowed(where[rows[r]][1]):
                keep[i, index[t]] = True
        sub = sub.masked_fill(~keep, float("-inf"))
        t, p = choose(sub, cfg.temperature, cfg.top_k, cfg.top_p, cfg.confidence, None, generator)
        for r, ti, pi in zip(constrained, t.tolist(), p.float().tolist(), strict=True):
            chosen[r], conf[r] = cols[ti], float(pi)
    return chosen, conf


__all__ = ["CanvasResult", "fill_canvas", "MODES"]
