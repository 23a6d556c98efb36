"""Decoding policies and stopping on hand-worked cases: a scripted runner returns logits whose
probabilities we chose, so every commit decision can be predicted exactly."""

import math

import pytest
import torch

from clover_lite.errors import GenerationError
from clover_lite.runtime.generation import (
    BlockEvent,
    GenerationConfig,
    StepEvent,
    denoise,
    fixed_schedule,
    select_positions,
)
from clover_lite.runtime.sampling import choose, filter_logits

V = 32
MASK = 31
EOS = 30


class Scripted:
    """Position p (absolute) always predicts token `token_at(p)` with probability `prob_at(p)`; the rest of
    the mass is spread evenly. Records what each step was asked."""

    device = torch.device("cpu")

    def __init__(self, prob_at, token_at=lambda p: 1 + p % 20):
        self.prob_at, self.token_at = prob_at, token_at
        self.calls, self.commits, self.prefilled = [], [], None
        self.start = 0

    def reserve(self, n):
        pass

    def prefill(self, ids):
        self.prefilled = list(ids)
        self.start = len(ids)

    def step(self, block, positions):
        self.calls.append((list(block), list(positions)))
        rows = []
        for j in positions:
            p = self.start + j
            probs = torch.full((V,), (1 - self.prob_at(p)) / (V - 1), dtype=torch.float64)
            probs[self.token_at(p)] = self.prob_at(p)
            rows.append(probs.log().float())
        return torch.stack(rows)

    def commit(self, block):
        self.commits.append(list(block))
        self.start += len(block)
        return 0


def run(runner, prompt, **kw):
    cfg = GenerationConfig(**kw).resolved(None)
    events = list(denoise(runner, prompt, cfg, MASK, [EOS], decode=lambda ids: "".join(chr(97 + t % 26) for t in ids)))
    return events, events[-1].generation


def test_threshold_commits_every_confident_position_and_at_least_one():
    probs = {4: 0.95, 5: 0.5, 6: 0.92, 7: 0.3}
    r = Scripted(lambda p: probs.get(p, 0.99))
    events, out = run(r, [1, 2, 3, 4], max_new_tokens=4, block_size=4, threshold=0.9)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert [e.committed for e in steps] == [[4, 6], [5], [7]]  # then the most confident of the rest
    assert out.token_ids == [r.token_at(p) for p in range(4, 8)]
    assert out.stats.forwards == 3 and out.stats.committed_tokens == 4
    assert r.prefilled == [1, 2, 3, 4]


def test_fixed_policy_commits_k_per_step_most_confident_first():
    conf = {p: 0.1 + 0.8 * ((p * 7) % 8) / 8 for p in range(100)}
    r = Scripted(lambda p: conf[p])
    events, out = run(r, [1, 2, 3, 4, 5, 6, 7, 8], max_new_tokens=16, block_size=8, steps_per_block=4, policy="fixed")
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert [len(e.committed) for e in steps] == [2] * 8
    first_block = steps[:4]
    remaining = set(range(8, 16))
    for e in first_block:
        best = sorted(remaining, key=lambda p: -conf[p])[:2]
        assert sorted(e.committed) == sorted(best)
        remaining -= set(e.committed)
    assert out.stats.tokens_per_forward == 2.0
    assert fixed_schedule(5, 2) == [3, 2] and fixed_schedule(8, 3) == [3, 3, 2]


def test_prompt_tail_fills_the_first_block_on_the_grid():
    r = Scripted(lambda p: 0.99)
    events, out = run(r, list(range(1, 7)), max_new_tokens=5, block_size=4, threshold=0.5)
    assert r.prefilled == [1, 2, 3, 4]  # only whole blocks are prefilled
    first_block, positions = r.calls[0]
    assert first_block == [5, 6, MASK, MASK] and positions == [2, 3]
    assert r.commits == [[5, 6, r.token_at(6), r.token_at(7)]]
    # The last block is cut to what is still needed: 11 positions in all, the final block holds 3.
    assert r.calls[-1][0] == [MASK] * 3
    assert len(out.token_ids) == 5


def test_mask_token_is_never_committed():
    r = Scripted(lambda p: 0.97, token_at=lambda p: MASK)
    _, out = run(r, [1], max_new_tokens=6, block_size=2, threshold=0.5)
    assert MASK not in out.token_ids and len(out.token_ids) == 6


def test_eos_stops_only_once_everything_before_it_is_committed():
    # Block [4, 8): EOS at position 6 is certain, positions 4 and 5 are not.
    probs = {4: 0.2, 5: 0.1, 6: 0.99}
    r = Scripted(lambda p: probs.get(p, 0.95), token_at=lambda p: EOS if p == 6 else 1 + p % 20)
    events, out = run(r, [1, 2, 3, 4], max_new_tokens=40, block_size=4, threshold=0.9)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert steps[0].committed == [6, 7]  # EOS (and 7) committed first; generation goes on
    assert steps[1].committed == [4] and steps[2].committed == [5]
    assert len(steps) == 3 and out.finish_reason == "eos"
    assert out.token_ids == [r.token_at(4), r.token_at(5)]
    assert not any(isinstance(e, BlockEvent) for e in events) and r.commits == []


def test_ignore_eos_and_stop_token_ids():
    r = Scripted(lambda p: 0.99, token_at=lambda p: EOS if p == 5 else 1 + p % 20)
    _, out = run(r, [1, 2, 3, 4], max_new_tokens=8, block_size=4, ignore_eos=True)
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    r = Scripted(lambda p: 0.99)
    _, out = run(r, [1, 2, 3, 4], max_new_tokens=8, block_size=4, stop_token_ids=(r.token_at(6),))
    assert out.token_ids == [r.token_at(4), r.token_at(5)] and out.finish_reason == "stop"


def test_stop_string_truncates_text():
    r = Scripted(lambda p: 0.99)  # tokens 1 + p % 20 -> letters b + p % 20
    _, out = run(r, [1, 2, 3, 4], max_new_tokens=12, block_size=4, stop=("jk",))
    # Generated positions 4.. decode to "fghijk...": the text stops before "jk".
    assert out.text == "fghi" and out.finish_reason == "stop"
    assert out.token_ids == [r.token_at(p) for p in range(4, 8)]  # not the stop string's tokens nor later ones


def test_a_stop_string_before_an_eos_in_the_same_step_ends_the_reply_there():
    """All of a block committed in one step, EOS last: the stop string in the text before it still cuts."""
    r = Scripted(lambda p: 0.99, token_at=lambda p: EOS if p == 7 else 1 + p % 20)  # "fgh" then EOS
    _, out = run(r, [1, 2, 3, 4], max_new_tokens=8, block_size=4, stop=("gh",))
    assert (out.text, out.token_ids, out.finish_reason) == ("f", [r.token_at(4)], "stop")
    _, out = run(r, [1, 2, 3, 4], max_new_tokens=8, block_size=4, stop=("xy",))
    assert (out.text, out.finish_reason) == ("fgh", "eos")


def test_choose_confidences_against_hand_computation():
    probs = torch.tensor([[0.6, 0.3, 0.1, 0.0], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    logits = probs.clamp_min(1e-300).log().float()
    tok, prob = choose(logits, confidence="prob")
    assert tok.tolist() == [0, 0] and torch.allclose(prob, torch.tensor([0.6, 0.25]))
    _, margin = choose(logits, confidence="margin")
    assert torch.allclose(margin, torch.tensor([0.3, 0.0]), atol=1e-6)
    _, ent = choose(logits, confidence="entropy")
    h0 = -(0.6 * math.log(0.6) + 0.3 * math.log(0.3) + 0.1 * math.log(0.1))
    assert torch.allclose(ent, torch.tensor([math.exp(-h0), 0.25]), atol=1e-5)
    # The banned (mask) token is skipped even when it is the best.
    tok, prob = choose(logits, banned_token_id=0)
    assert tok[0] == 1 and abs(prob[0] - 0.75) < 1e-5


def test_top_k_top_p_filter_and_seeded_sampling():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    kept = filter_logits(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(kept).tolist() == [[True, True, False, False, False]]
    p = torch.softmax(logits, -1)[0]
    kept = filter_logits(logits, top_k=0, top_p=float(p[0] + p[1] / 2))  # needs the top two
    assert torch.isfinite(kept).tolist() == [[True, True, False, False, False]]
    many = logits.repeat(2000, 1)
    a = choose(many, temperature=1.0, generator=torch.Generator().manual_seed(3))[0]
    b = choose(many, temperature=1.0, generator=torch.Generator().manual_seed(3))[0]
    assert torch.equal(a, b)
    freq = torch.bincount(a, minlength=5).double() / len(a)
    assert torch.allclose(freq, p.double(), atol=0.04)  # draws follow the softmax
    assert choose(many, temperature=1.0, top_k=1, generator=torch.Generator())[0].eq(0).all()


def test_seeds_reproduce_on_a_real_model(tiny_engine):
    kw = dict(max_new_tokens=10, temperature=1.0, top_p=0.9)
    a = tiny_engine.generate([1, 2, 3], seed=7, **kw)
    b = tiny_engine.generate([1, 2, 3], seed=7, **kw)
    c = tiny_engine.generate([1, 2, 3], seed=8, **kw)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


@pytest.mark.parametrize(
    "bad, word",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(block_size=0), "block_size"),
        (dict(block_size=4, steps_per_block=5), "steps_per_block"),
        (dict(policy="greedy"), "policy"),
        (dict(confidence="logit"), "confidence"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(commit="lazy"), "commit"),
        (dict(stop=("",)), "stop"),
        (dict(temperature=1e-38), "use 0 for greedy"),
        (dict(seed=2**64), "seed must fit in 64 bits"),
        (dict(seed=-(2**63) - 1), "seed must fit in 64 bits"),
        # Wrong types: one GenerationError naming the setting, never a TypeError from deep inside.
        (dict(max_new_tokens=2.5), "max_new_tokens must be an integer"),
        (dict(max_new_tokens=None), "max_new_tokens must be an integer"),
        (dict(block_size=2.0), "block_size must be an integer or None"),
        (dict(top_k=1.5), "top_k must be an integer"),
        (dict(threshold=None), "threshold must be a number"),
        (dict(seed="abc"), "seed must be an integer or None"),
        (dict(stop=[3]), "stop must be a string or a list of strings"),
        (dict(stop_token_ids=224), "stop_token_ids must be a list of integer token ids"),
        (dict(stop_token_ids=["x"]), "stop_token_ids must be a list of integer token ids"),
        (dict(ignore_eos="no"), "ignore_eos must be True or False"),
    ],
)
def test_bad_generation_settings_are_clear_errors(bad, word):
    with pytest.raises(GenerationError, match=word):
        GenerationConfig(**bad).resolved(4)


def test_stop_is_the_same_however_it_is_given():
    """One bare string is one stop string through the constructor as through replace(); None is none."""
    for stop, want in (("3 5", ("3 5",)), (["a", "b"], ("a", "b")), (None, ())):
        assert GenerationConfig(stop=stop).stop == GenerationConfig().replace(stop=stop).stop == want
    assert GenerationConfig(stop_token_ids=[4, 5]).stop_token_ids == (4, 5)


def test_numpy_numbers_are_taken_as_python_ones(tiny_engine):
    """Settings read from arrays: numpy scalars become the ints and floats torch's generator and kernels take."""
    import numpy as np

    cfg = GenerationConfig(max_new_tokens=np.int64(6), seed=np.int64(3), temperature=np.float32(0.5))
    assert type(cfg.seed) is int and type(cfg.max_new_tokens) is int and type(cfg.temperature) is float
    a = tiny_engine.generate([1, 2, 3], cfg)
    assert a.token_ids == tiny_engine.generate([1, 2, 3], max_new_tokens=6, seed=3, temperature=0.5).token_ids


def test_the_smallest_temperature_and_the_seed_range_ends_sample(tiny_engine):
    """The bounds of what is accepted work end to end: finite confidences, tokens from the vocabulary."""
    from clover_lite.runtime.generation import MIN_TEMPERATURE

    for seed in (2**64 - 1, -(2**63)):
        out = tiny_engine.generate([1, 2, 3], max_new_tokens=4, temperature=MIN_TEMPERATURE, seed=seed)
        assert len(out.token_ids) >= 1 and all(0 <= t < tiny_engine.config.vocab_size for t in out.token_ids)


@pytest.mark.parametrize("confidence, lo, hi", [("prob", 0, 1), ("margin", -1, 1), ("entropy", 0, 1)])
def test_threshold_is_checked_against_its_confidence_range(confidence, lo, hi):
    """Every value confidence_of can give for random distributions lies in the range; thresholds outside it
    (which commit nothing or everything) are refused, naming the range; its ends are accepted."""
    from clover_lite.runtime.sampling import confidence_of

    probs = torch.softmax(torch.randn(64, 9) * 4, -1)
    picks = torch.randint(0, 9, (64,))  # sampled choices: not always the top one (margin goes negative)
    c = confidence_of(probs, picks, confidence)
    assert bool((c >= lo - 1e-6).all() and (c <= hi + 1e-6).all())
    for ok in (lo, hi, (lo + hi) / 2):
        GenerationConfig(threshold=ok, confidence=confidence).resolved(4)
    for bad in (lo - 0.5, hi + 1, float("nan"), float("inf")):
        with pytest.raises(GenerationError, match=rf"threshold must be in \[{lo:g}, {hi:g}\].*{confidence}"):
            GenerationConfig(threshold=bad, confidence=confidence).resolved(4)


def test_steps_per_block_error_shows_the_resolved_block_size():
    with pytest.raises(GenerationError, match=r"steps_per_block must be >= 1, got 0") as e:
        GenerationConfig(steps_per_block=0).resolved(4)
    assert "None" not in str(e.value)
    with pytest.raises(GenerationError, match=r"at most block_size \(4\), got 5"):
        GenerationConfig(steps_per_block=5).resolved(4)  # the model's block size, resolved


def test_block_size_against_the_context_and_the_trained_block():
    with pytest.raises(GenerationError, match="block_size 100000 exceeds the model's context of 2048"):
        GenerationConfig(block_size=100000).resolved(4, max_length=2048)
    with pytest.warns(UserWarning, match="trained with \\(4\\)"):
        GenerationConfig(block_size=64).resolved(4, max_length=2048)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GenerationConfig(block_size=16).resolved(4, max_length=2048)  # 4x: no warning


def test_engine_checks_block_size_against_its_model(tiny_engine):
    with pytest.raises(GenerationError, match="exceeds the model's context"):
        tiny_engine.generate("hi", block_size=tiny_engine.config.max_position_embeddings + 1, max_new_tokens=2)


def test_unknown_setting_is_named():
    with pytest.raises(GenerationError, match="blocksize"):
        GenerationConfig().replace(blocksize=3)


def test_tempered_choice_and_its_confidence_against_float64():
    """At temperature T a token is drawn from softmax(logits / T), and `prob` is its probability there; `margin`
    is its probability less the best other one (negative for a pick below the top), `entropy` exp(-H)."""
    from clover_lite.runtime.sampling import confidence_of

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    logits = torch.randn(64, 7, generator=gen) * 3
    for T in (0.5, 2.0):
        tokens, conf = choose(logits, temperature=T, generator=gen)
        ref = torch.softmax(logits.double() / T, -1)
        torch.testing.assert_close(conf.double(), ref.gather(1, tokens[:, None]).squeeze(1), atol=1e-6, rtol=1e-5)
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]])
    margin = confidence_of(probs, torch.tensor([1, 1]), "margin")
    torch.testing.assert_close(margin, torch.tensor([0.3 - 0.6, 0.5 - 0.3]))
    h = -(probs.double() * probs.double().log()).sum(-1)
    torch.testing.assert_close(confidence_of(probs, torch.tensor([0, 0]), "entropy").double(), torch.exp(-h),
                               atol=1e-6, rtol=1e-6)


def test_select_positions_hand_worked():
    """Threshold: strictly above it (a confidence equal to it does not commit), else the single most
    confident; fixed: the schedule's count for the step (block 7 in 3 steps: 3, 2, 2), the most confident."""
    cfg = GenerationConfig(threshold=0.9, block_size=4)
    assert select_positions(torch.tensor([0.9, 0.9, 0.3]), cfg, 0).tolist() == [0]
    assert select_positions(torch.tensor([0.3, 0.95, 0.91, 0.9]), cfg, 0).tolist() == [1, 2]
    assert select_positions(torch.tensor([0.2, 0.5, 0.4]), cfg, 0).tolist() == [1]
    fixed = GenerationConfig(policy="fixed", block_size=7, steps_per_block=3)
    assert fixed_schedule(7, 3) == [3, 2, 2]
    conf = torch.tensor([0.1, 0.7, 0.3, 0.9, 0.5, 0.2, 0.6])
    assert sorted(select_positions(conf, fixed, 0).tolist()) == [1, 3, 6]
    assert sorted(select_positions(conf[:4], fixed, 1).tolist()) == [1, 3]
    assert select_positions(conf[:1], fixed, 2).tolist() == [0]  # fewer masked than the schedule's count
