"""Filling templates and joint decisions (`Engine.fill`, `Engine.decide`, runtime/canvas.py): every answer is one
of its options, template text never changes, the cached canvas loop equals the recompute runner at any slot
length and offset, option probabilities are the reference forwards' (end-token padding included, a product over
the blocks a slot crosses), an option extending another wins when its continuation is likelier, a slot crossing
a block boundary is decided block by block whatever its options' order, joint uses fewer forwards than
sequential, and each bad input is one clear error. Random cases draw a fresh seed per run
(CLOVER_TEST_SEED repeats one)."""

import itertools
import math
import random
import zlib

import pytest
import torch

from clover_lite.errors import GenerationError
from clover_lite.runtime.canvas import fill_canvas
from clover_lite.runtime.generation import CachedRunner, GenerationConfig, RecomputeRunner
from clover_lite.runtime.template import build_canvas, parse

from .seed import SEED

LETTERS = "abcdefgh"


def _options(rng: random.Random) -> list[str]:
    """2-4 distinct options of 1-4 characters (byte tokenizer: one token each), often sharing first letters."""
    n = rng.randint(2, 4)
    stem = "".join(rng.choice(LETTERS) for _ in range(rng.randint(0, 2)))
    out: list[str] = []
    while len(out) < n:
        o = (stem if rng.random() < 0.6 else "") + "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 2)))
        if o not in out:
            out.append(o)
    return out


def _random_template(rng: random.Random) -> tuple[str, dict]:
    parts, slots = [], {}
    for k in range(rng.randint(1, 4)):
        parts.append("".join(rng.choice("xyz .:") for _ in range(rng.randint(0, 5))))
        if rng.random() < 0.7:
            slots[f"s{k}"] = _options(rng)
        else:
            slots[f"s{k}"] = rng.randint(1, 6)
        parts.append(f"{{s{k}}}")
    parts.append("".join(rng.choice("xyz .") for _ in range(rng.randint(0, 4))))
    return "".join(parts), slots


def test_template_syntax():
    assert parse("a {x:3} b {{lit}} {y:p|q} {z}") == ["a ", ("x", "3"), " b {lit} ", ("y", "p|q"), " ", ("z", None)]
    with pytest.raises(GenerationError, match="never closed"):
        parse("a {x:3")
    with pytest.raises(GenerationError, match="closes no slot"):
        parse("a } b {x:2}")
    with pytest.raises(GenerationError, match="not an identifier"):
        parse("{9x:2}")


def test_canvas_layout_moves_the_space_into_the_slot(tiny_engine):
    tok = tiny_engine.tokenizer
    c = build_canvas(tok, "go {d:left|right}!", None, 256, tiny_engine.mask_token_id)
    assert c.tokens == tok.encode("go") + [None] * 6 + tok.encode("!")
    (slot,) = c.slots
    assert slot.lead == " " and slot.option_ids == [tok.encode(" left"), tok.encode(" right")]
    assert slot.padded(256)[0] == tok.encode(" left") + [256]


@pytest.mark.parametrize("mode", ["joint", "sequential"])
def test_random_templates_cached_equals_recompute_and_answers_are_options(tiny_engine, mode):
    """Random templates (choice slots of shared-prefix, multi-token options and free slots, at random offsets
    after a random prompt, block sizes 1, 4 and 8): the cached loop and the recompute runner fill the same
    tokens with the same forwards; every choice is one of its options; the template's text is unchanged."""
    rng = random.Random(SEED + (mode == "joint"))
    model, mask = tiny_engine.model, tiny_engine.mask_token_id
    end, eos = tiny_engine.end_token_id, tiny_engine.eos_token_ids
    for case in range(25):
        template, slots = _random_template(rng)
        canvas = build_canvas(tiny_engine.tokenizer, template, slots, end, mask)
        prompt = [rng.randrange(0, 256) for _ in range(rng.randint(0, 11))]
        if not prompt and canvas.tokens[0] is None:
            prompt = [65]
        B = rng.choice([1, 4, 8])
        cfg = GenerationConfig(block_size=B, threshold=rng.choice([0.05, 0.5, 0.9]),
                               policy=rng.choice(["threshold", "fixed"]), steps_per_block=rng.randint(1, B)).resolved(4)
        why = f"seed {SEED}, case {case}: {template!r} {slots} prompt {len(prompt)} B {B}"
        a = fill_canvas(CachedRunner(model, B), prompt, canvas, cfg, mask, end, eos, mode=mode)
        b = fill_canvas(RecomputeRunner(model, B), prompt, canvas, cfg, mask, end, eos, mode=mode)
        assert a.tokens == b.tokens and a.forwards == b.forwards and a.steps == b.steps, why
        for p, t in enumerate(canvas.tokens):
            if t is not None:
                assert a.tokens[p] == t, why  # the given text never changes
        for s in canvas.slots:
            got = a.slot_tokens[s.name]
            if s.options is not None:
                assert got in s.padded(end), why
            assert mask not in got, why
        if mode == "sequential":  # one position per forward, left to right (plus what the constraints force)
            firsts = [step[0] for step in a.steps]
            assert firsts == sorted(firsts), why
        assert sorted(a.order) == sorted(s.name for s in canvas.slots)


def test_answers_are_options_at_temperature_one(tiny_engine):
    rng = random.Random(SEED + 7)
    for _ in range(5):
        questions = {f"q {k}": _options(rng) for k in range(rng.randint(1, 4))}
        d = tiny_engine.decide("pick", questions, temperature=1.0, seed=rng.randrange(1000))
        assert set(d.answers) == set(questions)
        for name, answer in d.answers.items():
            assert answer in questions[name], (SEED, questions, d.answers)
        assert all(0 < p <= 1 for probs in d.probabilities.values() for p in probs.values())


def test_option_probabilities_are_the_reference_forwards(tiny_engine):
    """Each option's probability is the product of the softmax probabilities of what it writes at the slot's
    positions (its tokens, then the end token padding "x" to the length of "yz") in the forward that decided
    them: here (one step per block) the first, which the reference (uncached, block-causal) forward of prompt +
    template with every slot masked reproduces."""
    model, mask = tiny_engine.model, tiny_engine.mask_token_id
    tok = tiny_engine.tokenizer
    prompt = tok.encode("ab")  # the first block: 2 prompt tokens, then the template
    template = "{a:x|yz}{b:p|q}"
    canvas = build_canvas(tok, template, None, tiny_engine.end_token_id, mask)
    assert len(prompt) + len(canvas.tokens) <= 8
    cfg = GenerationConfig(block_size=8, policy="fixed", steps_per_block=1).resolved(4)
    res = fill_canvas(CachedRunner(model, 8), prompt, canvas, cfg, mask, tiny_engine.end_token_id)
    assert res.forwards == 1
    ids = torch.tensor([prompt + [mask] * len(canvas.tokens)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids, block_size=8)[0].double(), -1)
    P, end = len(prompt), tiny_engine.end_token_id
    expect = {"a": {"x": (logp[P, tok.encode("x")[0]] + logp[P + 1, end]).exp(),
                    "yz": (logp[P, tok.encode("y")[0]] + logp[P + 1, tok.encode("z")[0]]).exp()},
              "b": {"p": logp[P + 2, tok.encode("p")[0]].exp(), "q": logp[P + 2, tok.encode("q")[0]].exp()}}
    for name, probs in expect.items():
        for option, p in probs.items():
            assert math.isclose(res.option_probabilities[name][option], float(p), rel_tol=1e-4), (name, option)


class ScriptedRunner:
    """Logits that put token `script[position]` first with the given confidence: a hand-worked case."""

    def __init__(self, script: dict[int, tuple[int, float]], vocab: int):
        self.script, self.vocab, self.device = script, vocab, torch.device("cpu")
        self.start, self.calls = 0, []

    def reserve(self, n):
        pass

    def prefill(self, ids):
        self.start = len(ids)

    def step(self, block, positions):
        self.calls.append(list(positions))
        out = torch.zeros(len(positions), self.vocab)
        for r, p in enumerate(positions):
            token, logit = self.script[self.start + p]
            out[r, token] = logit
        return out

    def commit(self, block):
        self.start += len(block)
        return 0


def test_free_slot_end_and_a_choice_decided_whole():
    """Hand-worked: a 1-token prompt, then a block of 8 holding free slot f (positions 1-4) and choice c
    (positions 5-7) between the ids 4 5 6 and 4 5 7; threshold 0.99, other logits 0 over a vocabulary of 16.
    Forward 1: the end token at 2 has p = e^9 / (e^9 + 15) = 0.998 and commits, ending f (3-4 take the end
    token); position 1 has e^2 / (e^2 + 15) = 0.33; c's options differ only at 7, where 7's logit is 3, so
    4 5 7 has the share e^3 / (e^3 + 1) = 0.95 of the two. Forward 2: nothing passes 0.99, so the most confident
    candidate, c, commits whole. Forward 3: position 1."""
    from clover_lite.runtime.template import Canvas, Slot

    end = 9
    slot_f = Slot(name="f", start=0, length=4)
    slot_c = Slot(name="c", start=4, length=3, options=["A", "B"], option_ids=[[4, 5, 6], [4, 5, 7]])
    canvas = Canvas(tokens=[None] * 7, slots=[slot_f, slot_c], pieces=[slot_f, slot_c], end_token_id=end)
    script = {1: (11, 2.0), 2: (end, 9.0), 3: (12, 1.0), 4: (13, 1.0), 5: (3, 9.0), 6: (3, 9.0), 7: (7, 3.0)}
    runner = ScriptedRunner(script, vocab=16)
    cfg = GenerationConfig(block_size=8, threshold=0.99).resolved(4)
    res = fill_canvas(runner, [1], canvas, cfg, mask_token_id=15, end_token_id=end)
    assert res.slot_tokens == {"f": [11, end, end, end], "c": [4, 5, 7]}
    assert runner.calls == [[1, 2, 3, 4, 5, 6, 7], [1, 5, 6, 7], [1]]
    assert res.steps == [[1, 2, 3], [4, 5, 6], [0]] and res.order == ["c", "f"] and res.forwards == 3
    p4 = 1 / (math.exp(9) + 15)  # token 4 at 5 and token 5 at 6, where token 3 has logit 9
    expect = {"A": p4 * p4 / (math.exp(3) + 15), "B": p4 * p4 * math.exp(3) / (math.exp(3) + 15)}
    for option, p in expect.items():
        assert math.isclose(res.option_probabilities["c"][option], p, rel_tol=1e-5)


@pytest.mark.parametrize("mode", ["joint", "sequential"])
def test_a_choice_is_its_best_option_not_its_best_tokens(mode):
    """Options 4 5, 4 6 and 7 8 at positions 1-2, then a free position. Per position, 4 (logit 6) and 8 (logit
    3) are the best tokens, but 4 8 is no option; summed log-probabilities rank 4 6 first (6 + 1, against 6 + 0
    and 0 + 3). Sequential decides the choice (leftmost) alone first, joint with threshold 0.1 decides both in
    one forward."""
    from clover_lite.runtime.template import Canvas, Slot

    slot = Slot(name="c", start=0, length=2, options=["A", "B", "C"], option_ids=[[4, 5], [4, 6], [7, 8]])
    free = Slot(name="f", start=2, length=1)
    canvas = Canvas(tokens=[None] * 3, slots=[slot, free], pieces=[slot, free], end_token_id=9)

    class Runner(ScriptedRunner):
        def step(self, block, positions):
            out = super().step(block, positions)
            if 2 in positions:
                out[positions.index(2), 6] = 1.0  # position 2's second choice
            return out

    runner = Runner({1: (4, 6.0), 2: (8, 3.0), 3: (12, 5.0)}, vocab=16)
    cfg = GenerationConfig(block_size=4, threshold=0.1).resolved(4)
    res = fill_canvas(runner, [1], canvas, cfg, mask_token_id=15, end_token_id=9, mode=mode)
    assert res.slot_tokens == {"c": [4, 6], "f": [12]}
    assert res.steps == ([[0, 1, 2]] if mode == "joint" else [[0, 1], [2]])


def _softmax64(logits: torch.Tensor) -> torch.Tensor:
    """Probabilities of one row of logits, by hand in float64."""
    e = [math.exp(float(v)) for v in logits]
    return torch.tensor([v / sum(e) for v in e], dtype=torch.float64)


class _RowsRunner(ScriptedRunner):
    """Row p - 1 of `logits` at absolute position p (one block after a 1-token prompt)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__({}, logits.shape[1])
        self.logits = logits

    def step(self, block, positions):
        self.calls.append(list(positions))
        return self.logits[torch.tensor(positions) - 1]


@pytest.mark.parametrize("mode", ["joint", "sequential"])
def test_an_option_that_extends_another_wins_when_its_continuation_is_likelier(mode):
    """Options a and a b c (token ids, random, in random order) in one block of 8 after a 1-token prompt; the
    end token pads a to a END END. Random logits over a vocabulary of 16, then the end token (short must win)
    or b and c (long must win) at positions 2-3 lifted above each row's best. The winner and both probabilities
    are the hand-computed products of what each option writes: p1(a) p2(END) p3(END) against p1(a) p2(b) p3(c)."""
    from clover_lite.runtime.template import Canvas, Slot

    rng = random.Random(SEED + 11)
    V, END, MASK = 16, 9, 15
    wins = set()
    for case in range(12):
        a, b, c = rng.sample([t for t in range(1, V) if t not in (END, MASK)], 3)
        options = {"short": [a], "long": [a, b, c]}
        order = rng.sample(list(options), 2)
        slot = Slot(name="s", start=0, length=3, options=order, option_ids=[options[o] for o in order])
        canvas = Canvas(tokens=[None] * 3, slots=[slot], pieces=[slot], end_token_id=END)
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        logits = torch.randn(3, V, generator=g) * 2  # rows: positions 1-3
        logits[0, a] += 3
        want = "short" if case % 2 else "long"
        for row, token in ((1, b), (2, c)):  # above the row's best: p >= e^3 / (e^3 + 15) > 1/2, so it decides
            logits[row, END if want == "short" else token] = logits[row].max() + rng.uniform(3, 6)
        cfg = GenerationConfig(block_size=8).resolved(4)
        res = fill_canvas(_RowsRunner(logits), [1], canvas, cfg, mask_token_id=MASK, end_token_id=END, mode=mode)
        p = [_softmax64(row) for row in logits]
        expect = {"short": float(p[0][a] * p[1][END] * p[2][END]), "long": float(p[0][a] * p[1][b] * p[2][c])}
        best = max(expect, key=expect.get)
        why = f"seed {SEED}, case {case}: options {order} {options}, expect {expect}"
        assert best == want, why  # the boost decides it (the test's own check)
        assert res.slot_tokens["s"] == canvas.slots[0].padded(END)[order.index(best)], why
        for o in options:
            assert math.isclose(res.option_probabilities["s"][o], expect[o], rel_tol=1e-4), why
        wins.add(best)
    assert wins == {"short", "long"}


class ContextRunner:
    """A fake model whose logits at an absolute position are a pseudo-random function of that position, every
    token before its block (the committed context) and its block's ids (masks included), plus `boost[p][t]`:
    a decision that used another forward's logits, or scored a later block before the earlier one was
    committed, gets other numbers than `logits_at`, the reference's."""

    device = torch.device("cpu")

    def __init__(self, block_size: int, vocab: int, boost: dict[int, dict[int, float]], salt: int):
        self.B, self.V, self.boost, self.salt = block_size, vocab, boost, salt
        self.history: list[int] = []
        self.forwards = 0

    def logits_at(self, p: int, history: list[int], block: list[int]) -> torch.Tensor:
        seed = zlib.crc32(repr((self.salt, p, history, block)).encode())
        out = torch.randn(self.V, generator=torch.Generator().manual_seed(seed))
        for t, v in self.boost.get(p, {}).items():
            out[t] += v
        return out

    def reserve(self, n):
        pass

    def prefill(self, ids):
        self.history = list(ids)

    def step(self, block, positions):
        self.forwards += 1
        start = len(self.history)
        return torch.stack([self.logits_at(start + j, self.history, list(block)) for j in positions])

    def commit(self, block):
        self.history += list(block)
        return 0


def _block_by_block(runner: ContextRunner, seq: list[int | None], slot_at: int, padded: list[list[int]],
                    mask: int) -> tuple[int, list[float], float]:
    """The reference for one choice slot at absolute positions slot_at.. of `seq` (None there), in float64: per
    block it reaches, each remaining option scores the log-probability of what it writes in that block (logits
    from the committed context before the block and the block with the slot's positions masked); the best
    (first listed on a tie) is written and the options writing the same there remain. Returns the option whose
    tokens end up in the slot, each option's summed log-probability and the decision's confidence: the product
    over blocks of the winner's share among the distinct things the remaining options write there."""
    B, n, length = runner.B, len(padded), len(padded[0])
    seq, alive, logp, sure = list(seq), list(range(n)), [0.0] * n, 1.0
    for b0 in range(slot_at // B * B, slot_at + length, B):
        block = list(range(b0, min(b0 + B, len(seq))))
        here = [p for p in block if slot_at <= p < slot_at + length]
        ids = [mask if seq[p] is None else seq[p] for p in block]
        lp = {p: _softmax64(runner.logits_at(p, seq[:b0], ids)).log() for p in here}
        score = {o: sum(float(lp[p][padded[o][p - slot_at]]) for p in here) for o in alive}
        best = max(alive, key=lambda o: score[o])  # max keeps the first of equals
        distinct = {tuple(padded[o][p - slot_at] for p in here): score[o] for o in alive}
        sure *= math.exp(score[best]) / sum(math.exp(v) for v in distinct.values())
        for o in alive:
            logp[o] += score[o]
        alive = [o for o in alive if all(padded[o][p - slot_at] == padded[best][p - slot_at] for p in here)]
        for p in here:
            seq[p] = padded[best][p - slot_at]
    (winner,) = {tuple(padded[o]) for o in alive}
    return padded.index(list(winner)), logp, sure


def test_a_choice_across_a_block_boundary_is_decided_block_by_block():
    """A choice slot of 5-7 positions at every offset in its block of 4 (random prompt and fixed text around
    it), its 2-4 options sharing the tokens of the slot's first block and of unequal lengths (end-token
    padding), after a random prompt. The logits depend on the committed context and the block (ContextRunner),
    and one random option's tokens in the later blocks are boosted. In every order of the options the boosted
    one wins, the slot holds its padded tokens, and each option's probability is the reference's product over
    the blocks it was scored in (an option dropped early keeps its product up to there)."""
    from clover_lite.runtime.template import Canvas, Slot

    rng = random.Random(SEED + 13)
    B, V, END, MASK = 4, 24, 9, 23
    vocab = [t for t in range(1, V) if t not in (END, MASK)]
    for offset in [o for o in range(B) for _ in range(3)]:
        pre, post = rng.randint(0, 2), rng.randint(0, 2)
        P = rng.randrange(1, 3) * B + (offset - pre) % B  # the slot starts at `offset` in its block
        prompt = [rng.choice(vocab) for _ in range(P)]
        shared = [rng.choice(vocab) for _ in range(B - offset)]  # the slot's positions in its first block
        n = rng.randint(2, 4)
        tails: list[list[int]] = []
        while len(tails) < n:
            tail = [rng.choice(vocab[:4]) for _ in range(rng.randint(1, 3))]  # few tokens: shared stretches
            if tail not in tails:
                tails.append(tail)
        option_ids = [shared + t for t in tails]
        length = max(len(ids) for ids in option_ids)
        padded = [ids + [END] * (length - len(ids)) for ids in option_ids]
        target = rng.randrange(n)
        slot_at = P + pre
        boost = {slot_at + j: {t: 6.0} for j, t in enumerate(padded[target]) if j >= len(shared)}
        given_pre, given_post = [rng.choice(vocab) for _ in range(pre)], [rng.choice(vocab) for _ in range(post)]
        salt = rng.randrange(1 << 30)
        expect_p = None
        for perm in itertools.permutations(range(n)):
            names = [f"o{k}" for k in perm]
            slot = Slot(name="s", start=pre, length=length, options=names, option_ids=[option_ids[k] for k in perm])
            canvas = Canvas(tokens=given_pre + [None] * length + given_post, slots=[slot], pieces=[slot],
                            end_token_id=END)
            runner = ContextRunner(B, V, boost, salt)
            cfg = GenerationConfig(block_size=B, threshold=rng.choice([0.5, 0.9, 0.99])).resolved(B)
            res = fill_canvas(runner, prompt, canvas, cfg, mask_token_id=MASK, end_token_id=END,
                              mode=rng.choice(["joint", "sequential"]))
            seq = prompt + given_pre + [None] * length + given_post
            won, logp, sure = _block_by_block(runner, seq, slot_at, [padded[k] for k in perm], MASK)
            why = f"seed {SEED}: offset {offset}, P {P}, options {option_ids} in order {perm}, target {target}"
            assert perm[won] == target, why  # the boost decides it (the test's own check)
            assert res.slot_tokens["s"] == padded[target], why
            assert res.forwards == len(range(slot_at // B * B, slot_at + length, B)), why  # one per block
            probs = {f"o{k}": math.exp(logp[i]) for i, k in enumerate(perm)}
            for name, p in probs.items():
                assert math.isclose(res.option_probabilities["s"][name], p, rel_tol=1e-4), (why, name)
            assert math.isclose(res.confidence["s"], sure, rel_tol=1e-4), why
            expect_p = expect_p or probs
            assert all(math.isclose(probs[k], expect_p[k], rel_tol=1e-9) for k in probs), why  # order-free


def test_a_choice_across_blocks_on_the_model_is_the_reference_forwards(tiny_engine):
    """The tiny model at block size 4, a choice of options sharing their first letters (a token each) of
    unequal lengths after a random prompt, at every offset: the cached loop's answer and option probabilities
    equal the block-by-block reference on uncached block-causal forwards in float64 (each block's logits
    after the committed blocks, the slot's positions in it masked)."""
    model, tok = tiny_engine.model, tiny_engine.tokenizer
    mask, end = tiny_engine.mask_token_id, tiny_engine.end_token_id
    rng = random.Random(SEED + 17)
    B = 4

    class Reference(ContextRunner):
        def logits_at(self, p, history, block):
            ids = torch.tensor([history + block])
            with torch.no_grad():
                return model(ids, block_size=B)[0, p].double()

    for offset in range(B):
        stem = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 4)))
        options: list[str] = []
        while len(options) < rng.randint(2, 4):
            o = stem + "".join(rng.choice("ab") for _ in range(rng.randint(0, 3)))
            if o not in options:
                options.append(o)
        canvas = build_canvas(tok, "{s}", {"s": options}, end, mask)
        P = rng.randrange(1, 3) * B + offset
        prompt = [rng.randrange(0, 256) for _ in range(P)]
        cfg = GenerationConfig(block_size=B).resolved(4)
        res = fill_canvas(CachedRunner(model, B), prompt, canvas, cfg, mask, end, tiny_engine.eos_token_ids)
        padded = canvas.slots[0].padded(end)
        won, logp, sure = _block_by_block(Reference(B, 0, {}, 0), prompt + canvas.tokens, P, padded, mask)
        why = f"seed {SEED}: offset {offset}, options {options}"
        assert res.slot_tokens["s"] == padded[won], why
        for o, lp in zip(options, logp, strict=True):
            assert math.isclose(res.option_probabilities["s"][o], math.exp(lp), rel_tol=1e-3), (why, o)
        assert math.isclose(res.confidence["s"], sure, rel_tol=1e-3), why


def test_joint_uses_fewer_forwards_than_sequential(tiny_engine):
    q = {"window": ["open", "closed"], "fan": ["on", "off"], "seat": ["hot", "cold"]}
    joint = tiny_engine.decide("cabin", q, policy="fixed", steps_per_block=1, block_size=16)
    seq = tiny_engine.decide("cabin", q, mode="sequential", policy="fixed", steps_per_block=1, block_size=16)
    assert joint.forwards < seq.forwards
    assert seq.forwards >= 3  # at least one per question's first letter
    for d in (joint, seq):
        assert all(d.answers[k] in v for k, v in q.items())


def test_fill_keeps_the_template_and_cuts_free_slots(tiny_engine):
    f = tiny_engine.fill("name: {who:5} says {word:hi|bye}.", prompt="hello")
    assert f.text.startswith("name: ") and f.text.endswith(".") and f.values["word"] in ("hi", "bye")
    assert f" says {f.values['word']}." in f.text and f.forwards >= 1
    assert set(f.order) == {"who", "word"}


@pytest.mark.parametrize("call, why", [
    # Errors name the question as the caller gave it (not the template's slot for it).
    (lambda e: e.decide("c", {"window": []}), "question 'window' has no options"),
    (lambda e: e.decide("c", [("a", ["x"]), ("a", ["y"])]), "more than once"),
    (lambda e: e.decide("c", {"window": ["x", "x"]}), "question 'window' lists .* more than once"),
    (lambda e: e.decide("c", {"window": ["<|mask|>", "y"]}), "question 'window': the tokenizer cannot encode"),
    (lambda e: e.decide("c", {"window": ["", "y"]}), "question 'window' has an empty option"),
    (lambda e: e.decide("c", {}), "no questions"),
    (lambda e: e.decide("c", {"a": "xy"}), "list of strings"),
    (lambda e: e.decide("c", {"a": ["x"]}, mode="parallel"), "mode must be"),
    (lambda e: e.fill("{a:3} {a:2}"), "more than once"),
    (lambda e: e.fill("no slot here"), "no slot"),
    (lambda e: e.fill("{a}"), "no spec"),
    (lambda e: e.fill("{a:2}", slots={"b": 3}), "not in the template"),
    (lambda e: e.fill("{a:0}"), "positions"),
    (lambda e: e.fill("{a:2}", slots={"a": 2}), "both"),
    (lambda e: e.fill("{a:2}", max_new_tokens=8), "max_new_tokens does not apply to fill or decide"),
    (lambda e: e.decide("c", {"a": ["x"]}, stop=["x"]), "stop does not apply"),
])
def test_bad_questions_and_templates_are_one_clear_error(tiny_engine, call, why):
    with pytest.raises(GenerationError, match=why):
        call(tiny_engine)


def test_template_over_the_context_is_refused(tiny_dir):
    import clover_lite

    e = clover_lite.load(tiny_dir, device="cpu", context=32)
    with pytest.raises(GenerationError, match=r"exceeds the context of 32"):
        e.fill("{a:40}", prompt="x")


def test_clover_decide_command(tiny_dir):
    """`clover decide`: JSON with every answer one of its options, the same answers as the API; a table; a
    malformed --question is a usage error showing the form."""
    import json

    from click.testing import CliRunner

    import clover_lite
    from clover_lite.cli.main import main

    args = ["decide", str(tiny_dir), "--context", "cabin hot", "-q", "window=open,closed", "-q", "fan=on,off,auto",
            "--device", "cpu"]
    r = CliRunner().invoke(main, [*args, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["answers"]["window"] in ("open", "closed") and out["answers"]["fan"] in ("on", "off", "auto")
    api = clover_lite.load(tiny_dir, device="cpu").decide("cabin hot", {"window": ["open", "closed"],
                                                                         "fan": ["on", "off", "auto"]})
    assert out["answers"] == api.answers and out["forwards"] == api.forwards
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and "window" in r.output and "forwards" in r.output, r.output
    r = CliRunner().invoke(main, ["decide", "--context", "x", "-q", "window"])
    assert r.exit_code == 2 and "name=option1,option2" in r.output


def test_cabin_assistant_example_runs(monkeypatch, capsys):
    """examples/cabin_assistant.py on the bundled model: an action per question, each one of its options."""
    import runpy
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "cabin_assistant.py"
    monkeypatch.setattr(sys, "argv", [str(path), "--device", "cpu"])
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    mod = runpy.run_path(str(path), run_name="example")
    for name, options in mod["QUESTIONS"].items():
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(f"{name}:"))
        assert any(line.split(": ", 1)[1].startswith(o) for o in options), line
    assert "forwards" in out
