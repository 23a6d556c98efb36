"""Small synthetic tasks with checkable answers, written as ChatML chat turns.

The bundled model is trained on them and `benchmarks/quality.py` measures it on them:
- sort:    "sort: 5 3 9 1"                      -> "1 3 5 9"   (2-8 numbers, 0-9 or 0-99)
- add:     "add: 23 + 58"                       -> "81"        (two numbers of 1-2 digits)
- reverse: "reverse: c a b l e"                 -> "e l b a c" (3-7 random letters, spelled out)
- rules:   "facts: A. rules: B if A. ... question: is X P?" -> "B if A. A is given. yes" (backward chaining
           from the question shown, then yes / no)
- interlocked: "facts: ... rules: ... questions: is X P? is Y Q?" -> a `rules` reply per question, one per
           line: several questions over one rule set answered in one reply (the chains often share links)

Two training-only drills (`TRAIN_ONLY`, drawn only when weighted in, never evaluated) isolate the two lookups a
rules step needs: `recall` (an atom's other word) and `cite` (the premise of the rule that concludes an atom).

Reverse spells words letter by letter because a tiny BPE model cannot see the letters inside a token.
A fixed held-out set per task (its own seed) is never produced by the training sampler.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from clover_lite.tokenizer.byte_tokenizer import DEFAULT_CHAT_TEMPLATE

TASKS = ("sort", "add", "reverse", "rules", "interlocked")
# What training draws when no weights are given, and what an unnamed task weighs 1 against: the four tasks of
# the bundled model's phases 1-9, so their commands draw the same data as when they ran (`interlocked` came
# with phase 10 and is drawn only when weighted in).
BASE_TASKS = ("sort", "add", "reverse", "rules")

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


def _say(atom: tuple[str, str]) -> str:
    return f"{atom[0]} is {atom[1]}"


def _rules(rng: random.Random) -> tuple[str, str]:
    """One or two facts, a chain of rules from a fact, a distractor rule whose premise is false; the
    question asks about an atom that follows (yes) or one that does not (no), half and half. Six atoms, no
    two sharing a person or a property, so either word names its atom.

    Rules are written conclusion first ("Bob is big if Cal is kind.") and the answer works backwards from
    the asked atom: each atom is followed by what follows it where a rule concludes it (" if" and the
    premise, which becomes the next atom), or by "is given." when it is a fact, or "is unknown." when
    neither; then yes or no ("Bob is big if Cal is kind. Cal is kind if Ann is red. Ann is red is given.
    yes"). So every step is a copy of what followed the same words in the prompt, and the yes/no follows
    the word before it. Two formats before this one, forward derivations and backward chains over "if A
    then B" rules, stayed at chance; this one took the bundled model to 73% with the `recall` drill and to
    100% once the `cite` drill taught it which rule's premise to copy (docs/journal/2026-12.md). Only the
    last word is scored (`is_correct`)."""
    props = rng.sample(PROPS, 6)  # drawn before the names (the order fixes the held-out set)
    atoms = list(zip(rng.sample(NAMES, 6), props, strict=True))
    chain = atoms[: rng.randint(2, 3)]  # fact -> ... -> conclusion
    off = atoms[3:5]  # a rule whose premise is never true
    facts = [chain[0]] + ([atoms[5]] if rng.random() < 0.5 else [])
    rules = [(chain[i], chain[i + 1]) for i in range(len(chain) - 1)] + [tuple(off)]
    rng.shuffle(rules)
    rng.shuffle(facts)
    if rng.random() < 0.5:
        q = rng.choice(sorted(set(facts + chain)))
    else:
        q = rng.choice(off)

    text = (
        "facts: " + " ".join(_say(f) + "." for f in facts)
        + " rules: " + " ".join(f"{_say(b)} if {_say(a)}." for a, b in rules)
        + f" question: is {q[0]} {q[1]}?"
    )
    return text, _worked(_say(q), [_say(f) for f in facts], {_say(b): _say(a) for a, b in rules})


def _worked(atom: str, facts: list[str], premise: dict[str, str]) -> str:
    """The `rules` reply for `atom` ("Ann is red"): the rules followed back from it, then given/unknown, yes/no."""
    work = []
    while atom in premise:  # every chain ends at a fact or at the distractor's premise
        work.append(f"{atom} if {premise[atom]}.")
        atom = premise[atom]
    given = atom in facts
    work.append(f"{atom} is {'given' if given else 'unknown'}. {'yes' if given else 'no'}")
    return " ".join(work)


def _interlocked(rng: random.Random) -> tuple[str, str]:
    """Two or three questions over one `rules` rule set, answered in one reply, a worked `rules` line per
    question in the order asked ("... questions: is Eve shy? is Hal kind?" -> "Eve is shy if Hal is kind. Hal is
    kind is given. yes\nHal is kind is given. yes"). The questions are any of the set's atoms, so they often sit
    on the same chain. Never a held-out `rules` context, so benchmarks/decide.py's sets stay unseen. (The draw
    order fixes the bundled model's phase-10 data.)"""
    prompt, context = _unseen_rules(rng)
    facts, premise, _ = parse_rules(prompt)
    atoms = sorted({*facts, *premise, *premise.values()})
    asked = rng.sample(atoms, rng.randint(2, 3))
    return interlocked_prompt(context, asked), "\n".join(_worked(a, facts, premise) for a in asked)


def interlocked_prompt(context: str, atoms: list[str]) -> str:
    """The `interlocked` prompt asking about `atoms` ("Ann is red") over a `rules` context (facts and rules)."""
    return f"{context} questions: " + " ".join(f"is {a.replace(' is ', ' ')}?" for a in atoms)


def final_answers(reply: str) -> list[str]:
    """The last word of each non-empty line of a reply: an `interlocked` reply's yes/no per question."""
    return [line.split()[-1] for line in reply.strip().split("\n") if line.split()]


def _recall(rng: random.Random) -> tuple[str, str]:
    """Training only: the content lookup every `rules` step needs, alone and with one word of answer
    ("recall: Ann is red. Bob is big. what is Bob?" -> "it is big"; "who is big?" -> "it is Bob"; the
    answer starts with "it is" so that the copied word is the same token as in the prompt)."""
    # zip stops at the 3-6 names (the draw order fixes the bundled model's training data)
    atoms = list(zip(rng.sample(NAMES, rng.randint(3, 6)), rng.sample(PROPS, 6), strict=False))
    name, prop = rng.choice(atoms)
    ask, ans = (f"what is {name}?", prop) if rng.random() < 0.5 else (f"who is {prop}?", name)
    return "recall: " + " ".join(f"{n} is {p}." for n, p in atoms) + " " + ask, f"it is {ans}"


def _cite(rng: random.Random) -> tuple[str, str]:
    """Training only: the premise copy of a `rules` step, several times per instance. Three or four
    conclusion-first rules over distinct atoms, one or two of them chained (an atom concluded by one rule is
    the premise of another, so its property appears twice in the prompt, as in `rules`); the question names
    the conclusions in a random order and the reply says each one's rule ("cite: Hal is old if Bob is tall.
    Ann is shy if Hal is old. ... ask: Ann Hal" -> "Ann is shy if Hal is old. Hal is old if Bob is tall.")."""
    # (The draw order fixes the bundled model's training data.)
    n_rules = rng.randint(3, 4)
    atoms = list(zip(rng.sample(NAMES, 8), rng.sample(PROPS, 8), strict=True))
    chained = rng.randint(1, 2)  # rules whose premise is the conclusion of another rule
    rules = [(atoms[0], atoms[1])]
    free = atoms[2:]
    for i in range(1, n_rules):
        premise = rules[-1][1] if i <= chained else free.pop()
        rules.append((premise, free.pop()))
    rng.shuffle(rules)
    asked = rng.sample(rules, len(rules))

    def rule(premise, conclusion):
        return f"{_say(conclusion)} if {_say(premise)}."

    text = "cite: " + " ".join(rule(*r) for r in rules) + " ask: " + " ".join(b[0] for _, b in asked)
    return text, " ".join(rule(*r) for r in asked)


def _decide(rng: random.Random) -> tuple[str, str]:
    """Training only (experimental): three questions over one `rules` rule set in `Engine.decide`'s format
    (runtime/decide.py: the context, a line per question, the answers one per line). Never a held-out
    `rules` context, so benchmarks/decide.py's sets stay unseen."""
    from clover_lite.runtime.decide import decision_messages, decision_reply

    prompt, context = _unseen_rules(rng)
    facts, premise, _ = parse_rules(prompt)
    atoms = sorted({*facts, *premise, *premise.values()})
    asked = rng.sample(atoms, 3)

    def holds(atom: str) -> bool:
        while atom in premise:
            atom = premise[atom]
        return atom in facts

    questions = [(f"is {a.replace(' is ', ' ')}", ["yes", "no"]) for a in asked]
    answers = {name: "yes" if holds(a) else "no" for (name, _), a in zip(questions, asked, strict=True)}
    user, _ = decision_messages(context, questions)
    return user, decision_reply(questions, answers)


def _unseen_rules(rng: random.Random) -> tuple[str, str]:
    """A `rules` prompt whose context (facts and rules) is not one of the held-out questions' contexts, and that
    context: what the multi-question tasks ask about, so benchmarks/decide.py's held-out sets stay unseen."""
    while True:
        prompt, _ = _rules(rng)
        context = prompt.split(" question: ")[0]
        if context not in _heldout_rules_contexts():
            return prompt, context


@cache
def _heldout_rules_contexts() -> frozenset[str]:
    return frozenset(ex.prompt.split(" question: ")[0] for ex in heldout("rules"))


GENERATORS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "sort": _sort, "add": _add, "reverse": _reverse, "rules": _rules, "recall": _recall, "cite": _cite,
    "decide": _decide, "interlocked": _interlocked,
}
TRAIN_ONLY = ("recall", "cite", "decide")  # drawn in training when weighted in, never evaluated


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
        b, a = rule.rstrip(".").split(" if ")
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
    """Exact match of the answer; for `rules` the final yes/no, for `interlocked` every line's (the derivations
    before them are not scored)."""
    if ex.task == "rules":
        words = reply.split()
        return bool(words) and words[-1] == ex.answer.split()[-1]
    if ex.task == "interlocked":
        return final_answers(reply) == final_answers(ex.answer)
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


def sample_train(rng: random.Random, tasks: tuple[str, ...] = BASE_TASKS) -> Example:
    """A training instance of a random task; never one of the held-out prompts."""
    task = rng.choice(tasks)
    while True:
        ex = generate(task, rng)
        if ex.prompt not in _heldout_prompts():
            return ex


def eval_set(task: str, n: int) -> list[Example]:
    """The first n held-out instances of a task."""
    return list(heldout(task)[:n])
