"""Block-diffusion training: the two-stream forward equals the runtime's reference forward block by block,
the loss goes down, runs are deterministic and a resumed run equals an uninterrupted one."""

import dataclasses
import random
import re

import pytest
import torch

from clover_lite.checkpoint.tiny import init_random, tiny_config
from clover_lite.models.config import config_from_dict
from clover_lite.models.denoiser import Denoiser
from clover_lite.models.gdn import gated_delta_rule_block_states, gated_delta_rule_chunked, gdn_block_states
from clover_lite.training import tasks
from clover_lite.training.train import (
    TrainConfig,
    block_diffusion_logits,
    init_weights,
    lr_at,
    noise_blocks,
    train,
    two_stream_mask,
)

MASK = 256 + 3


def tiny_model(seed=0, **overrides):
    cfg = config_from_dict(tiny_config(**overrides))
    return init_random(Denoiser(cfg), seed)


def test_noise_masks_every_block_at_its_own_ratio():
    clean = torch.randint(0, 256, (64, 32), generator=torch.Generator().manual_seed(0))
    noisy, masked = noise_blocks(clean, 8, MASK, torch.Generator().manual_seed(1))
    per_block = masked.reshape(64, 4, 8).sum(-1)
    assert per_block.min() >= 1 and per_block.max() == 8
    assert len(set(per_block.flatten().tolist())) == 8  # every count 1..8 occurs: ratios vary per block
    assert torch.equal(noisy[masked], torch.full_like(noisy[masked], MASK))
    assert torch.equal(noisy[~masked], clean[~masked])
    with pytest.raises(ValueError, match="multiple of the block size"):
        noise_blocks(clean[:, :30], 8, MASK, torch.Generator())


def test_noise_keeps_unmaskable_positions_clean():
    clean = torch.randint(0, 256, (16, 24), generator=torch.Generator().manual_seed(0))
    maskable = torch.zeros(16, 24, dtype=torch.bool)
    maskable[:, 5:11] = True  # a "reply" across blocks 0 and 1; block 2 is all prompt
    for ratio in (None, 1.0):
        noisy, masked = noise_blocks(clean, 8, MASK, torch.Generator().manual_seed(1), ratio, maskable)
        assert not (masked & ~maskable).any() and torch.equal(noisy[~masked], clean[~masked])
        per_block = masked.reshape(16, 3, 8).sum(-1)
        assert per_block[:, :2].min() >= 1 and per_block[:, 2].max() == 0
    assert torch.equal(masked, maskable)  # ratio 1 masks every maskable position


def test_two_stream_mask():
    m = two_stream_mask(8, 4, torch.device("cpu"))
    clean_q, noisy_q = m[:8], m[8:]
    assert clean_q[:, 8:].sum() == 0  # clean never sees noisy
    assert clean_q[1, :8].tolist() == [True] * 4 + [False] * 4  # block-causal, bidirectional in a block
    assert noisy_q[5].tolist() == [True] * 4 + [False] * 4 + [False] * 4 + [True] * 4  # clean past + own block


def test_block_states_match_the_recurrence():
    g = torch.Generator().manual_seed(0)
    b, L, hk, hv, dk, dv = 2, 24, 2, 4, 8, 8
    q, k = torch.randn(b, L, hk, dk, generator=g), torch.randn(b, L, hk, dk, generator=g)
    v = torch.randn(b, L, hv, dv, generator=g)
    gate = -torch.rand(b, L, hv, generator=g)
    beta = torch.rand(b, L, hv, generator=g)
    s0 = torch.randn(b, hv, dk, dv, generator=g)
    out, starts = gated_delta_rule_block_states(q, k, v, gate, beta, s0, chunk=4)
    ref, _ = gated_delta_rule_chunked(q, k, v, gate, beta, s0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(starts[:, 0], s0)
    for j in range(1, L // 4):
        _, s = gated_delta_rule_chunked(q[:, : 4 * j], k[:, : 4 * j], v[:, : 4 * j], gate[:, : 4 * j],
                                        beta[:, : 4 * j], s0)
        torch.testing.assert_close(starts[:, j], s, atol=1e-5, rtol=1e-5)


def test_gdn_block_states_are_what_the_cache_holds():
    model = tiny_model(1)
    layer = model.layers[0].linear_attn
    x = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(2))
    out, rec, tails = gdn_block_states(layer, x, 4)
    state = model.zero_gdn_state(2, x)
    torch.testing.assert_close(out, layer(x, state)[0], atol=1e-5, rtol=1e-5)
    for j in range(5):
        torch.testing.assert_close(rec[:, j], state[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tails[:, j], state[1])
        _, upd = layer(x[:, 4 * j : 4 * j + 4], state)
        state = (upd.recurrent, upd.conv)


@pytest.mark.parametrize("block_size", [4, 8])
def test_training_forward_equals_reference_forward(block_size):
    """Logits of noisy block b from the all-blocks forward == model(clean prefix + noisy block b)."""
    model = tiny_model(2)
    B, T = block_size, 4 * block_size
    clean = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(3))
    noisy, _ = noise_blocks(clean, B, MASK, torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = block_diffusion_logits(model, clean, noisy, B)
        for b in range(T // B):
            ids = torch.cat([clean[:, : b * B], noisy[:, b * B : (b + 1) * B]], dim=1)
            ref = model(ids, block_size=B)[:, b * B :]
            torch.testing.assert_close(logits[:, b * B : (b + 1) * B], ref, atol=1e-4, rtol=1e-4)


# ---- the loop ------------------------------------------------------------------------------------
def counting_batches(step: int) -> torch.Tensor:
    """Learnable windows: counting sequences from a step-dependent start."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, 40, (8, 1), generator=g)
    return (start + torch.arange(16)) % 40 + 10


def fresh(seed=0):
    return init_weights(Denoiser(config_from_dict(tiny_config())), seed)


def weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_training_lowers_the_loss():
    torch.manual_seed(0)
    cfg = TrainConfig(steps=40, lr=1e-2, warmup=5, block_size=4, log_every=5)
    hist = train(fresh(), counting_batches, cfg, MASK)
    first, last = hist[0]["ce"], hist[-1]["ce"]
    assert last < 0.6 * first, (first, last)
    assert 0.5 < hist[-1]["expert_load_max"] * 8 < 8  # routing is recorded (and not all on one expert)


def test_deterministic_and_resume_equals_uninterrupted(tmp_path):
    cfg = TrainConfig(steps=6, lr=1e-2, warmup=2, block_size=4, log_every=1, checkpoint_every_s=1e-9)
    a, b = fresh(), fresh()
    hist_a = train(a, counting_batches, cfg, MASK)
    train(b, counting_batches, cfg, MASK)
    assert torch.equal(weights(a), weights(b))

    def interrupted(step):
        if step == 3:
            raise KeyboardInterrupt
        return counting_batches(step)

    ckpt = tmp_path / "state.pt"
    c = fresh()
    assert not torch.equal(weights(a), weights(c))
    with pytest.raises(KeyboardInterrupt):
        train(c, interrupted, cfg, MASK, checkpoint=ckpt)
    assert torch.load(ckpt, weights_only=True)["step"] == 3
    d = fresh(seed=99)  # resuming restores the weights, whatever the new model holds
    hist_d = train(d, counting_batches, cfg, MASK, checkpoint=ckpt)
    assert torch.equal(weights(a), weights(d))
    assert [r["step"] for r in hist_d] == [4, 5, 6] and hist_d[-1]["ce"] == hist_a[-1]["ce"]

    # A phase cut short (stop_at) keeps the schedule of its `steps`: stopping at 4 and resuming is the same run.
    ckpt2, e = tmp_path / "stopped.pt", fresh()
    hist_e = train(e, counting_batches, dataclasses.replace(cfg, stop_at=4), MASK, checkpoint=ckpt2)
    assert [r["step"] for r in hist_e] == [1, 2, 3, 4] and torch.load(ckpt2, weights_only=True)["step"] == 4
    assert hist_e[-1]["lr"] == hist_a[3]["lr"]
    train(e, counting_batches, cfg, MASK, checkpoint=ckpt2)
    assert torch.equal(weights(a), weights(e))


def test_batches_with_maskable_positions():
    """A batch function may return (ids, maskable); only maskable positions are trained."""
    cfg = TrainConfig(steps=3, lr=1e-2, warmup=1, block_size=4, log_every=1)

    def with_mask(step):
        ids = counting_batches(step)
        maskable = torch.zeros_like(ids, dtype=torch.bool)
        maskable[:, 8:] = True
        return ids, maskable

    hist = train(fresh(), with_mask, cfg, MASK)
    assert all(0 < r["masked_tokens"] <= 8 * 8 for r in hist)


def test_chat_windows_mask_replies_to_the_end_of_their_block():
    from clover_lite.training import corpus

    tok = corpus.train_tokenizer(["def f(x):\n    return x + 1\n"] * 50, vocab_size=300)
    text = torch.arange(4, 200, dtype=torch.int32).repeat(5)
    batches = corpus.MixedBatches(tok, text, batch=3, length=64, task_windows=2, seed=0, block_size=4)
    ids, maskable = batches(7)
    again = batches(7)
    assert torch.equal(ids, again[0]) and torch.equal(maskable, again[1])  # a function of the step
    assert ids.shape == maskable.shape == (3, 64) and maskable[2].all()  # text rows: all maskable
    im_start = tok.token_to_id("<|im_start|>")
    assert ids[0, 0] == im_start and not maskable[0, :8].any()  # a window starts with a prompt, never masked
    blocks = maskable[:2].reshape(2, 16, 4).int()
    assert torch.equal(blocks, torch.cummax(blocks, -1).values)  # maskable up to the end of the block
    ex = tasks.generate("add", random.Random(0))
    chat, reply = corpus.encode_chat(tok, ex)
    assert tok.decode([t for t, r in zip(chat, reply, strict=True) if r], skip_special_tokens=False) == (
        ex.answer + "<|im_end|>"
    )


def test_task_weights_change_the_mix_from_their_step():
    from clover_lite.training import corpus

    tok = corpus.train_tokenizer(["def f(x):\n    return x + 1\n"] * 50, vocab_size=300)
    text = torch.arange(4, 200, dtype=torch.int32).repeat(5)
    plain = corpus.MixedBatches(tok, text, batch=8, length=256, task_windows=8, seed=0, block_size=4)
    weights = {"sort": 1, "add": 1, "reverse": 1, "rules": 6}
    heavy = corpus.MixedBatches(tok, text, batch=8, length=256, task_windows=8, seed=0, block_size=4,
                                task_weights=weights, reweight_from=5)

    def counts(batches, step):
        text = tok.decode(batches(step)[0].flatten().tolist(), skip_special_tokens=False)
        return {t: text.count("user\n" + ("facts:" if t == "rules" else t + ":")) for t in tasks.TASKS}

    assert torch.equal(plain(4)[0], heavy(4)[0])  # steps before reweight_from see the same data
    before = [counts(plain, s) for s in range(5, 9)]
    after = [counts(heavy, s) for s in range(5, 9)]
    share = [sum(c["rules"] for c in cs) / sum(sum(c.values()) for c in cs) for cs in (before, after)]
    assert share[0] < 0.35 and share[1] > 0.55, share  # chats are drawn 1/4 vs 6/9 rules
    drill = corpus.MixedBatches(tok, text, batch=8, length=256, task_windows=8, seed=0, block_size=4,
                                task_weights={"rules": 1, "recall": 3})  # a training-only task is drawn too
    drawn = tok.decode(drill(0)[0].flatten().tolist(), skip_special_tokens=False)
    assert drawn.count("user\nrecall:") > drawn.count("user\nfacts:") > 0
    assert "recall:" not in tok.decode(plain(0)[0].flatten().tolist(), skip_special_tokens=False)
    with pytest.raises(ValueError, match="unknown task"):
        corpus.MixedBatches(tok, text, 2, 64, 1, 0, task_weights={"poetry": 2})


def test_lr_schedule():
    cfg = TrainConfig(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)


# ---- tasks -----------------------------------------------------------------------------------------
def _rules_reply(prompt: str) -> str:
    """Parse a rules prompt and answer it from the text alone (independent of tasks._rules): the yes/no from
    forward chaining the facts to the fixed point, the reply by following rules back from the question."""
    facts = re.findall(r"(\w+ is \w+)\.", prompt.split(" rules: ")[0])
    rules = re.findall(r"(\w+ is \w+) if (\w+ is \w+)\.", prompt)
    name, prop = re.search(r"question: is (\w+) (\w+)\?$", prompt).groups()
    known = set(facts)
    for _ in rules:  # len(rules) passes reach the fixed point
        known |= {b for b, a in rules if a in known}
    premise_of, atom, steps = dict(rules), f"{name} is {prop}", []
    while atom in premise_of:
        steps.append(f"{atom} if {premise_of[atom]}.")
        atom = premise_of[atom]
    yes = f"{name} is {prop}" in known
    assert yes == (atom in facts)  # the backward chain reaches a fact exactly when forward chaining agrees
    return " ".join(steps + [f"{atom} is {'given' if yes else 'unknown'}.", "yes" if yes else "no"])


def test_tasks_are_checkable_and_held_out():

    rng = random.Random(0)
    held = {ex.prompt for t in tasks.TASKS for ex in tasks.heldout(t)}
    for _ in range(2000):
        ex = tasks.sample_train(rng)
        assert ex.prompt not in held
        if ex.task == "sort":
            assert ex.answer == " ".join(map(str, sorted(int(x) for x in ex.prompt[6:].split())))
        elif ex.task == "add":
            a, b = ex.prompt[5:].split(" + ")
            assert int(ex.answer) == int(a) + int(b)
        elif ex.task == "reverse":
            assert ex.answer == ex.prompt[9:][::-1]
        else:
            assert ex.answer == _rules_reply(ex.prompt)
            atoms = re.findall(r"(\w+) is (\w+)", ex.prompt)
            for i in (0, 1):  # no two atoms share a person or a property: either word names its atom
                assert len({a[i] for a in atoms}) == len(set(atoms))
    answers = [ex.answer.split()[-1] for ex in tasks.eval_set("rules", 400)]
    assert 0.4 < answers.count("yes") / 400 < 0.6
    assert {ex.answer.count(" if ") for ex in tasks.eval_set("rules", 400)} == {0, 1, 2}  # rules followed
    assert tasks.eval_set("sort", 5) == tasks.eval_set("sort", 5)
    assert all(ex.task in tasks.TASKS for ex in (tasks.sample_train(rng) for _ in range(200)))  # no drill


def test_recall_drill_answers_from_its_prompt():
    """The training-only lookup drill: the answer is the other word of the one atom the question names."""
    rng = random.Random(1)
    for _ in range(500):
        ex = tasks.sample_train(rng, ("recall",))
        atoms = re.findall(r"(\w+) is (\w+)\.", ex.prompt)
        assert 3 <= len(atoms) <= 6 and len({n for n, _ in atoms}) == len({p for _, p in atoms}) == len(atoms)
        kind, word = re.search(r" (what|who) is (\w+)\?$", ex.prompt).groups()
        want = dict(atoms)[word] if kind == "what" else {p: n for n, p in atoms}[word]
        assert ex.answer == f"it is {want}"


def test_decide_drill_is_the_decide_format_with_chained_truths():
    """The training-only joint drill: Engine.decide's exact user message and reply for three questions over one
    rule set, each answer what chaining the rules gives (worked out here independently), never on a held-out
    `rules` context."""
    from clover_lite.runtime.decide import decision_messages

    heldout = {ex.prompt.split(" question: ")[0] for ex in tasks.heldout("rules")}
    rng = random.Random(3)
    for _ in range(200):
        ex = tasks.sample_train(rng, ("decide",))
        context, *lines = ex.prompt.split("\n")
        assert context not in heldout and len(lines) == 3
        facts = re.findall(r"(\w+ is \w+)\.", context.split(" rules: ")[0])
        premise = dict(re.findall(r"(\w+ is \w+) if (\w+ is \w+)\.", context))
        questions = []
        for line, answer in zip(lines, ex.answer.split("\n"), strict=True):
            name, opts = line.split(": ")
            assert opts == "yes / no"
            atom = name.removeprefix("is ").replace(" ", " is ")
            while atom in premise:
                atom = premise[atom]
            assert answer == ("yes" if atom in facts else "no")
            questions.append((name, ["yes", "no"]))
        assert decision_messages(context, questions)[0] == ex.prompt


def test_interlocked_task_answers_each_question_with_its_worked_chain():
    """`interlocked`: two or three distinct atoms of one rule set asked together, the reply a line per question
    in the asked order, each line what `rules` answers for that question alone (worked out independently by
    _rules_reply); never a held-out `rules` context; questions on the same chain occur; held out like every
    evaluated task, and scored on every line's final yes/no."""
    heldout = {ex.prompt.split(" question: ")[0] for ex in tasks.heldout("rules")}
    held = {ex.prompt for ex in tasks.heldout("interlocked")}
    rng = random.Random(4)
    counts, shared = set(), 0
    for _ in range(300):
        ex = tasks.sample_train(rng, ("interlocked",))
        assert ex.prompt not in held
        context, asked = ex.prompt.split(" questions: ")
        assert context not in heldout
        questions = re.findall(r"is (\w+) (\w+)\?", asked)
        assert len(set(questions)) == len(questions) and " ".join(f"is {n} {p}?" for n, p in questions) == asked
        lines = ex.answer.split("\n")
        assert lines == [_rules_reply(f"{context} question: is {n} {p}?") for n, p in questions]
        assert tasks.interlocked_prompt(context, [f"{n} is {p}" for n, p in questions]) == ex.prompt
        counts.add(len(questions))
        named = [set(re.findall(r"\w+ is \w+", line)) for line in lines]  # the atoms each chain passes through
        shared += any(a & b for i, a in enumerate(named) for b in named[i + 1:])
        assert tasks.is_correct(ex, ex.answer) and tasks.final_answers(ex.answer) == [w.split()[-1] for w in lines]
        last = lines[-1].rsplit(" ", 1)
        flipped = lines[:-1] + [f"{last[0]} {'no' if last[1] == 'yes' else 'yes'}"]
        assert not tasks.is_correct(ex, "\n".join(flipped)) and not tasks.is_correct(ex, "\n".join(lines[:-1]))
    assert counts == {2, 3} and shared > 30
    assert len(tasks.heldout("interlocked")) == tasks.HELDOUT_SIZE


def test_cite_drill_answers_from_its_prompt():
    """The training-only premise-copy drill: each asked person's rule, in the asked order, read back from the
    prompt by a regex; chains (an atom concluded by one rule and the premise of another) always occur."""
    rng = random.Random(2)
    chains = set()
    for _ in range(500):
        ex = tasks.sample_train(rng, ("cite",))
        rules = re.findall(r"((\w+) is \w+) if (\w+ is \w+)\.", ex.prompt.split(" ask: ")[0])
        asked = re.search(r" ask: ([\w ]+)$", ex.prompt).group(1).split()
        rule_of = {name: f"{b} if {a}." for b, name, a in rules}
        assert ex.answer == " ".join(rule_of[name] for name in asked)
        assert 3 <= len(rules) <= 4 and sorted(asked) == sorted(rule_of)
        atoms = set(re.findall(r"(\w+) is (\w+)", ex.prompt))
        for i in (0, 1):  # no two atoms share a person or a property, as in `rules`
            assert len({a[i] for a in atoms}) == len(atoms)
        chains.add(len({b for b, _, _ in rules} & {a for _, _, a in rules}))
    assert chains == {1, 2}


def test_rule_steps_by_hand_and_on_the_heldout_set():
    """How many rules a question sits behind: hand-worked cases, then every held-out instance against a
    regex parse of its prompt followed recursively."""
    rules = " rules: Bob is big if Ann is red. Cal is old if Bob is big. Eve is tall if Dan is shy."
    for question, steps in [("Ann red", 0), ("Bob big", 1), ("Cal old", 2), ("Eve tall", 1), ("Fay fast", 0)]:
        ex = tasks.Example("rules", "facts: Ann is red." + rules + f" question: is {question}?", "no")
        assert tasks.rule_steps(ex) == steps, question

    def depth(rule_pairs: dict, atom: str) -> int:
        return 1 + depth(rule_pairs, rule_pairs[atom]) if atom in rule_pairs else 0

    seen = set()
    for ex in tasks.heldout("rules"):
        pairs = dict(re.findall(r"(\w+ is \w+) if (\w+ is \w+)\.", ex.prompt))
        name, prop = re.search(r"question: is (\w+) (\w+)\?", ex.prompt).groups()
        assert tasks.rule_steps(ex) == depth(pairs, f"{name} is {prop}")
        seen.add(tasks.rule_steps(ex))
    assert seen == {0, 1, 2}


def test_rules_are_scored_on_the_final_answer_and_others_exactly():
    ex = tasks.Example("rules", "facts: Ann is red. rules: ... question: is Bob big?",
                       "Bob is big if Ann is red. Ann is red is given. yes")
    assert tasks.is_correct(ex, " Bob is big if Ann is red. Ann is red is given. yes")
    assert tasks.is_correct(ex, "Bob is big is given. yes")  # the chain is shown, not scored
    assert not tasks.is_correct(ex, "Bob is big if Ann is red. Ann is red is given. no")
    assert not tasks.is_correct(ex, "") and not tasks.is_correct(ex, "yes no")
    add = tasks.Example("add", "add: 2 + 3", "5")
    assert tasks.is_correct(add, " 5") and not tasks.is_correct(add, "5 5") and not tasks.is_correct(add, "6")
