"""Denoising a canvas: any pattern of given and masked positions after a prompt, filled on the block grid.

The open-ended loop (`generation.denoise`) is the case "prompt tail, then masks". Here every block of the
canvas holds given tokens (template text, which never changes) and masked slot positions, which are denoised
together with the same cache, steps and one commit per block (docs/ARCHITECTURE.md section 9):

- a choice slot is decided block by block, as a block decoder must: in a forward its still-possible options
  are grouped by what they write at the slot's positions in this block (their tokens, then the end token that
  pads a shorter option to the slot's length: the canvas holds it afterwards), each group scores the summed
  log-probability of those tokens (full-vocabulary softmax), the best group (or one sampled, at a temperature)
  is the candidate, its confidence its share of the groups' probability; committing it writes the slot's
  positions in this block only, and the slot's options narrow to that group, which compete on their next
  positions in the next block (conditioned on the committed block). A slot inside one block is decided whole,
  its options ranked by the probability of all they write;
- a free slot is open text, position by position; once it commits an end token, its later positions take the
  end token without a forward;
- `joint` scores every masked position of the block in each forward and commits by the policy, a choice slot
  counting as one candidate; `sequential` commits only the leftmost undecided position or choice slot per
  forward, as an autoregressive decoder must.
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
    # Per choice slot, each option's probability: the product over the blocks it was scored in of the probability
    # of what it writes at the slot's positions there (its tokens and end-token padding, full-vocabulary softmax)
    # in the forward that decided those positions. An option dropped in a block keeps the product up to that
    # block (the one that dropped it included); the answer's is the probability of the slot's final tokens.
    option_probabilities: dict[str, dict[str, float]]
    # Per choice slot, how sure the decision was: the answer's share of the probability of the options still
    # possible, multiplied over the blocks that decided it (1.0 where no other option remained). Comparable
    # across slots and models, unlike option_probabilities (full-vocabulary products over unequal positions).
    confidence: dict[str, float]
    order: list[str]  # slots in the order they were completed
    forwards: int = 0  # denoising forwards (steps)
    commit_forwards: int = 0
    seconds: float = 0.0
    steps: list[list[int]] = field(default_factory=list)  # canvas positions committed by each forward


@dataclass
class _Candidate:
    """What one forward proposes to commit: a free position's token, or a choice slot's option."""

    first: int  # canvas position it starts at (left-to-right order)
    confidence: float
    writes: list[tuple[int, int]]  # (canvas position, token)
    slot: int | None = None  # choice slot index
    keep: list[int] = field(default_factory=list)  # a choice's options that remain possible once committed
    share: float = 1.0  # a choice's: its group's share of the groups' probability (untempered)
    scored: dict[int, float] = field(default_factory=dict)  # a choice's options: log-probability in this block


@dataclass
class _Choice:
    """A choice slot while it is filled: its options as written (padded to the slot's length), the ones still
    possible, and each option's log-probability summed over the blocks it was scored in."""

    padded: list[list[int]]
    alive: list[int]
    logp: list[float]
    sure: float = 1.0  # the product of the committed groups' shares


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
    where = canvas.slot_at()
    tokens: list[int | None] = list(canvas.tokens)
    choices: dict[int, _Choice] = {}
    for k, s in enumerate(canvas.slots):
        if s.options is not None:
            assert s.option_ids is not None
            if canvas.end_token_id is None and len({len(ids) for ids in s.option_ids}) > 1:
                raise GenerationError(f"slot {s.name!r}: its options have different token lengths and there is no "
                                      "end token to pad the shorter ones; make them the same length")
            choices[k] = _Choice(padded=s.padded(canvas.end_token_id), alive=list(range(len(s.options))),
                                 logp=[0.0] * len(s.options))
    generator = None
    if cfg.temperature > 0:
        generator = torch.Generator(device=runner.device)
        generator.manual_seed(cfg.seed if cfg.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    done_at: dict[str, tuple[int, int]] = {}
    result = CanvasResult(tokens=[], slot_tokens={}, option_probabilities={}, confidence={}, order=[])

    def write(c: int, token: int) -> list[int]:
        """Commit a token; a free slot's end token also ends the slot (its later masked positions)."""
        tokens[c] = token
        out = [c]
        k, j = where[c]
        s = canvas.slots[k]
        if s.options is None and token in end_ids and end_token_id is not None:
            for jj in range(j + 1, s.length):
                if tokens[s.start + jj] is None:
                    tokens[s.start + jj] = end_token_id
                    out.append(s.start + jj)
        return out

    runner.reserve(total)
    first_start = P // B * B
    runner.prefill(list(prompt_ids[:first_start]))
    start = first_start
    while start < total:
        end = min(start + B, total)
        step_in_block = 0
        while True:
            masked = [p - start for p in range(max(start, P), end) if tokens[p - P] is None]
            if not masked:
                break
            ids = [mask_token_id if t is None else t for t in _block(prompt_ids, tokens, start, end)]
            logits = runner.step(ids, masked)
            if not bool(torch.isfinite(logits).all()):
                before = (list(prompt_ids) + [int(t) for t in tokens[: max(start - P, 0)]])[:start]
                raise nonfinite_error(runner, before, ids, masked, start)
            rows = [start + i - P for i in masked]  # canvas positions of the logits' rows
            candidates = _candidates(logits, rows, where, canvas, cfg, mask_token_id, generator, chooser, choices)
            if mode == "joint":
                conf = torch.tensor([cand.confidence for cand in candidates])
                picked = [candidates[i] for i in select_positions(conf, cfg, step_in_block).tolist()]
            else:
                picked = [min(candidates, key=lambda cand: cand.first)]
            committed_now = []
            for cand in sorted(picked, key=lambda cand: -cand.confidence):
                for c, t in cand.writes:
                    if tokens[c] is None:
                        committed_now += write(c, t)
                if cand.slot is not None:  # this block's factor, and the options that remain
                    choice = choices[cand.slot]
                    for o, v in cand.scored.items():
                        choice.logp[o] += v
                    choice.alive = cand.keep
                    choice.sure *= cand.share
            result.forwards += 1
            step_in_block += 1
            result.steps.append(sorted(committed_now))
            for k, s in enumerate(canvas.slots):
                if s.name not in done_at and all(tokens[s.start + j] is not None for j in range(s.length)):
                    done_at[s.name] = (result.forwards, k)
        if end < total:
            result.commit_forwards += runner.commit([int(t) for t in _block(prompt_ids, tokens, start, end)])
        start = end
    result.tokens = [int(t) for t in tokens]
    result.slot_tokens = {s.name: result.tokens[s.start : s.start + s.length] for s in canvas.slots}
    result.order = [name for name, _ in sorted(done_at.items(), key=lambda kv: kv[1])]
    result.option_probabilities = {  # each option's product over the blocks it was scored in
        canvas.slots[k].name: dict(zip(canvas.slots[k].options, map(math.exp, choice.logp), strict=True))
        for k, choice in choices.items()
    }
    result.confidence = {canvas.slots[k].name: choice.sure for k, choice in choices.items()}
    result.seconds = time.perf_counter() - t0
    return result


def _block(prompt_ids: Sequence[int], tokens: list[int | None], start: int, end: int) -> list[int | None]:
    """Positions start..end of prompt + canvas (None where the canvas is still masked)."""
    P = len(prompt_ids)
    return [prompt_ids[p] if p < P else tokens[p - P] for p in range(start, end)]


def _candidates(logits, rows, where, canvas, cfg, mask_token_id, generator, chooser,
                choices: dict[int, _Choice]) -> list[_Candidate]:
    """One candidate per masked free position (the engine's chooser over the vocabulary) and per choice slot with
    masked positions in this block: its still-possible options grouped by what they write at those positions,
    each group scored by those tokens' summed log-probability; the best group (or one sampled at temperature > 0)
    with its share of the groups' probability as confidence, writing those positions only."""
    out: list[_Candidate] = []
    free = [r for r, c in enumerate(rows) if canvas.slots[where[c][0]].options is None]
    if free:
        t, p = chooser(logits[free], cfg.temperature, cfg.top_k, cfg.top_p, cfg.confidence, mask_token_id, generator)
        for r, ti, pi in zip(free, t.tolist(), p.float().tolist(), strict=True):
            out.append(_Candidate(first=rows[r], confidence=float(pi), writes=[(rows[r], int(ti))]))
    by_slot: dict[int, list[int]] = {}
    for r, c in enumerate(rows):
        if canvas.slots[where[c][0]].options is not None:
            by_slot.setdefault(where[c][0], []).append(r)
    if not by_slot:
        return out
    logp = torch.log_softmax(logits.float(), dim=-1)
    for k, slot_rows in by_slot.items():
        s, choice = canvas.slots[k], choices[k]
        here = sorted((where[rows[r]][1], r) for r in slot_rows)  # (index in the slot, logits row)
        groups: dict[tuple[int, ...], list[int]] = {}  # what is written here -> the options writing it
        for o in choice.alive:
            groups.setdefault(tuple(choice.padded[o][j] for j, _ in here), []).append(o)
        keys = list(groups)
        lp = logp[torch.tensor([r for _, r in here], device=logp.device)]  # (positions here, vocabulary)
        written = torch.tensor(keys, dtype=torch.long, device=logp.device)  # (groups, positions here)
        scores = lp[torch.arange(len(here), device=logp.device).unsqueeze(0), written].double().sum(dim=1).cpu()
        share = torch.softmax(scores / cfg.temperature if cfg.temperature > 0 else scores, dim=0)
        if cfg.temperature > 0:
            best = int(torch.multinomial(share.float().to(generator.device), 1, generator=generator))
        else:
            best = int(share.argmax())
        out.append(_Candidate(
            first=s.start + here[0][0], confidence=float(share[best]), slot=k,
            writes=[(s.start + j, t) for (j, _), t in zip(here, keys[best], strict=True)], keep=groups[keys[best]],
            scored={o: float(v) for key, v in zip(keys, scores.tolist(), strict=True) for o in groups[key]},
            share=float(torch.softmax(scores, dim=0)[best]),
        ))
    return out


__all__ = ["CanvasResult", "fill_canvas", "MODES"]
