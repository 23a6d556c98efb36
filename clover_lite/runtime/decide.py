"""Joint decisions: several related questions answered in one denoising pass (`Engine.decide`), on top of
filling templates (`Engine.fill`). docs/ARCHITECTURE.md section 9.

A decision is a chat turn: the user message is the context followed by one line per question,
"name: option / option / ...", and the reply is the answers in question order, one per line, each a slot
restricted to its question's options, then the end of the turn as given text. The reply names nothing: it is
short, so several answers share a block and are denoised in the same forwards. `decision_messages` writes
both; the bundled model's `decide` task (training/tasks.py) is trained on exactly this text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from clover_lite.errors import GenerationError
from clover_lite.runtime.template import check_options

Questions = Mapping[str, Sequence[str]] | Sequence[tuple[str, Sequence[str]]]


@dataclass
class Filled:
    """A template filled in: each slot's value, the whole text, and what it cost."""

    values: dict[str, str]
    text: str
    token_ids: list[int]
    # Choice slots: each option's probability under the model, the product over the blocks it was scored in of
    # what it writes there (full vocabulary). Options dropped in different blocks cover different positions, so
    # these need not rank as the decision did: `confidence` says how sure the decision was.
    probabilities: dict[str, dict[str, float]]
    order: list[str]  # slots in the order they were completed
    forwards: int  # denoising forwards
    commit_forwards: int
    seconds: float
    steps: list[list[int]] = field(default_factory=list)  # template positions committed by each forward
    # Choice slots: the answer's share of the remaining options' probability, multiplied over the blocks that
    # decided it (1.0: no other option was possible; 0.5 for two options: a coin toss).
    confidence: dict[str, float] = field(default_factory=dict)


@dataclass
class Decision:
    """The answers to a set of questions decided together (or one after another, `mode="sequential"`)."""

    answers: dict[str, str]
    probabilities: dict[str, dict[str, float]]
    forwards: int
    order: list[str]
    mode: str
    commit_forwards: int = 0
    seconds: float = 0.0
    text: str = ""  # the reply as the model filled it
    confidence: dict[str, float] = field(default_factory=dict)  # per question, as Filled.confidence


def question_list(questions: Questions) -> list[tuple[str, list[str]]]:
    """The questions as (name, options) pairs, checked: one clear GenerationError for an empty set, a name that
    is not a one-line string or repeats, options that are not a non-empty list of distinct strings."""
    if isinstance(questions, Mapping):
        pairs = list(questions.items())
    elif isinstance(questions, Sequence) and not isinstance(questions, str):
        pairs = list(questions)
        if not all(isinstance(p, tuple | list) and len(p) == 2 for p in pairs):
            raise GenerationError("questions: give a dict name -> options, or a list of (name, options) pairs")
    else:
        raise GenerationError("questions: give a dict name -> options, or a list of (name, options) pairs")
    if not pairs:
        raise GenerationError("no questions to decide; give at least one name -> options")
    seen: set[str] = set()
    out = []
    for name, options in pairs:
        if not isinstance(name, str) or not name.strip() or "\n" in name or ":" in name:
            raise GenerationError(f"question name {name!r}: use a non-empty one-line string without ':'")
        if name in seen:
            raise GenerationError(f"question {name!r} appears more than once; give each question its own name")
        seen.add(name)
        if isinstance(options, str) or not isinstance(options, Sequence):
            raise GenerationError(f"question {name!r}: options must be a list of strings, not {options!r}")
        check_options(name, list(options))
        bad = [o for o in options if "\n" in o]
        if bad:
            raise GenerationError(f"question {name!r}: option {bad[0]!r} is not a one-line string")
        out.append((name, list(options)))
    return out


def decision_messages(context: str, questions: Questions) -> tuple[str, str]:
    """(user message, reply template) of a decision. Slots are named q0, q1, ... in question order."""
    if not isinstance(context, str):
        raise GenerationError(f"context must be a string, got {type(context).__name__}")
    pairs = question_list(questions)
    lines = [f"{name}: {' / '.join(options)}" for name, options in pairs]
    user = (context.rstrip() + "\n" if context.strip() else "") + "\n".join(lines)
    reply = "\n".join(f"{{q{k}}}" for k in range(len(pairs)))
    return user, reply


def decision_reply(questions: Questions, answers: Mapping[str, str]) -> str:
    """The reply text a decision's template becomes once filled (what the bundled model is trained on)."""
    return "\n".join(answers[name] for name, _ in question_list(questions))


__all__ = ["Filled", "Decision", "Questions", "question_list", "decision_messages", "decision_reply"]
