"""Small synthetic tasks with checkable answers, written as ChatML chat turns.

The bundled model is trained on them and `benchmarks/quality.py` measures it on them:
- sort:    "sort: 5 3 9 1"                      -> "1 3 5 9"   (2-8 numbers, 0-9 or 0-99)
- add:     "add: 23 + 58"                       -> "81"        (two numbers of 1-2 digits)
- reverse: "reverse: c a b l e"                 -> "e l b a c" (3-7 random letters, spelled out)
- rules:   "facts: ... rules: if A then B ... question: is X P?" -> "yes" / "no" (forward chaining)

Reverse spells words letter by letter because a tiny BPE model cannot see the letters inside a token.
A fixed held-out set per task (its own seed) is never produced by the training sampler.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from .byte_tokenizer import DEFAULT_CHAT_TEMPLATE

TASKS = ("sort", "add", "reverse", "rules")

CHAT_TEMPLATE = DEFAULT_CHAT_TEMPLATE  # ChatML, as the tiny test checkpoints use

HELDOUT_SIZE = 1000  # instances per task kept out of training; evaluations use a prefix of them
_HELDOUT_SEED = 7_000_000


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    answer: str


def chat_prompt(prompt: str) -> str:
    """The text the model sees before it answers (what the chat template renders for one user turn)."""
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def chat_text(ex: Example) -> str:
    """A whole training conversation: user turn, assistant answer, end of turn."""
    return chat_prompt(ex.prompt) + ex.answer + "<|im_end|>\n"


# ---- generators --------------------------------------------------------------------------------
def _sort(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(2, 8)
    hi = 9 if rng.random() < 0.5 else 99
    xs = [rng.randint(0, hi) for _ in range(n)]
    return "sort: " + " ".join(map(str, xs)), " ".join(map(str, sorted(xs)))


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = (rng.randint(0, 9) if rng.random() < 0.25 else rng.randint(10, 99) for _ in range(2))
    return f"add: {a} + {b}", str(a + b)


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = [chr(ord("a") + rng.randrange(26)) for _ in range(rng.randint(3, 7))]
    return "reverse: " + " ".join(word), " ".join(reversed(word))


NAMES = ("Ann", "Bob", "Cal", "Dan", "Eve", "Fay", "Gus", "Hal")
PROPS = ("red", "big", "cold", "kind", "fast", "old", "shy", "tall")


def _rules(rng: random.Random) -> tuple[str, str]:
    """One or two facts, a chain of rules from a fact, a distractor rule whose premise is false; the
    question asks about an atom that follows (yes) or one that does not (no), half and half."""
    atoms = rng.sample([(n, p) for n in NAMES for p in PROPS], 6)
    chain = atoms[: rng.randint(2, 3)]  # fact -> ... -> conclusion
    off = atoms[3:5]  # a rule whose premise is never true
    facts = [chain[0]] + ([atoms[5]] if rng.random() < 0.5 else [])
    rules = [(chain[i], chain[i + 1]) for i in range(len(chain) - 1)] + [tuple(off)]
    rng.shuffle(rules)
    rng.shuffle(facts)
    true = set(facts)
    changed = True
    while changed:  # forward chaining to the fixed point
        changed = False
        for a, b in rules:
            if a in true and b not in true:
                true.add(b)
                changed = True
    if rng.random() < 0.5:
        q, ans = rng.choice(sorted(true)), "yes"
    else:
        q, ans = rng.choice(off), "no"

    def say(atom):
        return f"{atom[0]} is {atom[1]}"

    text = (
        "facts: " + " ".join(say(f) + "." for f in facts)
        + " rules: " + " ".join(f"if {say(a)} then {say(b)}." for a, b in rules)
        + f" question: is {q[0]} {q[1]}?"
    )
    return text, ans


def _rules_lookup(rng: random.Random) -> tuple[str, str]:
    """The first step of `rules` (a training curriculum, never evaluated): one or two facts and a rule whose
    premise is false, same format; the question is a fact (yes) or an atom of the rule (no)."""
    atoms = rng.sample([(n, p) for n in NAMES for p in PROPS], 4)
    facts, off = atoms[: rng.randint(1, 2)], atoms[2:4]
    q, ans = (rng.choice(facts), "yes") if rng.random() < 0.5 else (rng.choice(off), "no")
    text = (
        "facts: " + " ".join(f"{n} is {p}." for n, p in facts)
        + f" rules: if {off[0][0]} is {off[0][1]} then {off[1][0]} is {off[1][1]}."
        + f" question: is {q[0]} {q[1]}?"
    )
    return text, ans


GENERATORS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "sort": _sort, "add": _add, "reverse": _reverse, "rules": _rules,
}
TRAIN_ONLY: dict[str, Callable[[random.Random], tuple[str, str]]] = {"rules-lookup": _rules_lookup}


def generate(task: str, rng: random.Random) -> Example:
    make = GENERATORS.get(task) or TRAIN_ONLY.get(task)
    if make is None:
        raise ValueError(f"unknown task '{task}'; tasks are {TASKS} (and, for training, {tuple(TRAIN_ONLY)})")
    return Example(task, *make(rng))


# ---- splits ------------------------------------------------------------------------------------
@cache
def heldout(task: str) -> tuple[Example, ...]:
    """The fixed held-out instances of a task (distinct prompts, deterministic)."""
    rng = random.Random(_HELDOUT_SEED + TASKS.index(task))
    seen: dict[str, Example] = {}
    while len(seen) < HELDOUT_SIZE:
        ex = generate(task, rng)
        seen.setdefault(ex.prompt, ex)
    return tuple(seen.values())


@cache
def _heldout_prompts() -> frozenset[str]:
    return frozenset(ex.prompt for t in TASKS for ex in heldout(t))


def sample_train(rng: random.Random, tasks: tuple[str, ...] = TASKS) -> Example:
    """A training instance of a random task; never one of the held-out prompts."""
    task = rng.choice(tasks)
    while True:
        ex = generate(task, rng)
        if ex.prompt not in _heldout_prompts():
            return ex


def eval_set(task: str, n: int) -> list[Example]:
    """The first n held-out instances of a task."""
    return list(heldout(task)[:n])
