"""Small synthetic tasks with checkable answers, written as ChatML chat turns.

The bundled model is trained on them and `benchmarks/quality.py` measures it on them:
- sort:    "sort: 5 3 9 1"                      -> "1 3 5 9"   (2-8 numbers, 0-9 or 0-99)
- add:     "add: 23 + 58"                       -> "81"        (two numbers of 1-2 digits)
- reverse: "reverse: c a b l e"                 -> "e l b a c" (3-7 random letters, spelled out)
- rules:   "facts: ... rules: if A then B ... question: is X P?" -> "A. so B. yes" (forward chaining shown,
           then yes / no)

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
    question asks about an atom that follows (yes) or one that does not (no), half and half. Every atom is
    about a different person.

    The answer shows its work, then answers: the facts, each derived atom with "so" in the order forward
    chaining finds it, then yes or no ("Ann is red. so Bob is big. yes"). A bare yes/no gives one token
    of signal per example and a tiny model never learnt it (it answered "no" to everything); written out,
    each step is one lookup of a rule whose premise is already stated, and the answer a lookup in the
    model's own list. Only the last word is scored (`is_correct`)."""
    # Six people, one property each: a name stands for its atom, so reading an atom is one token's lookup
    # (with names shared between atoms the model copied "Bob is" from one atom and the property from another).
    atoms = [(n, rng.choice(PROPS)) for n in rng.sample(NAMES, 6)]
    chain = atoms[: rng.randint(2, 3)]  # fact -> ... -> conclusion
    off = atoms[3:5]  # a rule whose premise is never true
    facts = [chain[0]] + ([atoms[5]] if rng.random() < 0.5 else [])
    rules = [(chain[i], chain[i + 1]) for i in range(len(chain) - 1)] + [tuple(off)]
    rng.shuffle(rules)
    rng.shuffle(facts)
    known = list(facts)
    changed = True
    while changed:  # forward chaining to the fixed point, in the order atoms are found
        changed = False
        for a, b in rules:
            if a in known and b not in known:
                known.append(b)
                changed = True
    if rng.random() < 0.5:
        q, ans = rng.choice(sorted(known)), "yes"
    else:
        q, ans = rng.choice(off), "no"

    def say(atom):
        return f"{atom[0]} is {atom[1]}"

    text = (
        "facts: " + " ".join(say(f) + "." for f in facts)
        + " rules: " + " ".join(f"if {say(a)} then {say(b)}." for a, b in rules)
        + f" question: is {q[0]} {q[1]}?"
    )
    work = [say(f) + "." for f in facts] + [f"so {say(b)}." for b in known[len(facts):]]
    return text, " ".join(work + [ans])


GENERATORS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "sort": _sort, "add": _add, "reverse": _reverse, "rules": _rules,
}


def generate(task: str, rng: random.Random) -> Example:
    if task not in GENERATORS:
        raise ValueError(f"unknown task '{task}'; tasks are {TASKS}")
    return Example(task, *GENERATORS[task](rng))


def parse_rules(prompt: str) -> tuple[list[str], dict[str, str], str]:
    """A `rules` prompt read back: its facts, each concluded atom -> its rule's premise, and the asked atom
    (atoms as "Ann is red")."""
    facts_part, rest = prompt.removeprefix("facts: ").split(" rules: ")
    rules_part, question = rest.split(" question: is ")
    facts = [f.strip() for f in facts_part.split(".") if f.strip()]
    premise = {}
    for rule in rules_part.split(". "):
        a, b = rule.removeprefix("if ").rstrip(".").split(" then ")
        premise[b] = a
    name, prop = question.rstrip("?").split()
    return facts, premise, f"{name} is {prop}"


def rule_steps(ex: Example) -> int:
    """How many rules a `rules` question sits behind: from the asked atom, follow the rule that concludes
    it back to its premise until no rule does (0: a fact, or an atom nothing concludes). A question's
    difficulty, read from the prompt, so the same split serves any answer format."""
    _, premise, atom = parse_rules(ex.prompt)
    steps = 0
    while atom in premise:
        atom, steps = premise[atom], steps + 1
    return steps


def is_correct(ex: Example, reply: str) -> bool:
    """Exact match of the answer; for `rules` the final yes/no (the derivation before it is not scored)."""
    if ex.task == "rules":
        words = reply.split()
        return bool(words) and words[-1] == ex.answer.split()[-1]
    return reply.strip() == ex.answer


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
